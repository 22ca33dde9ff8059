// CUDA implementation of the session's Packer (pack.h): pack / verify / unpack of device
// regions with the fused checksum, one launch per call, prepared batches cached by their inputs
// so a replayed plan uploads its descriptors once. The Packer interface is the common layer's
// (pack.h): the cuda layer neither includes nor links the sync layer.
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/device/packer_access.h"
#include "cuda/kernels/area_kernels.h"
#include "shardsync/gpu.h"
#include "shardsync/pack.h"

namespace shardsync::gpu {

using internal::CudaStatus;

namespace {

// Cache key: every input that shapes the descriptors.
std::string Key(char mode, const std::vector<PackRegion>& regions, const void* buf, DType wire,
                int64_t bytes) {
  std::string k;
  auto put = [&](const void* p, size_t n) { k.append(static_cast<const char*>(p), n); };
  put(&mode, 1);
  put(&buf, sizeof(buf));
  put(&wire, sizeof(wire));
  put(&bytes, sizeof(bytes));
  for (const PackRegion& r : regions) {
    put(&r.base, sizeof(r.base));
    put(&r.dtype, sizeof(r.dtype));
    const int64_t nd = static_cast<int64_t>(r.shape.size());
    put(&nd, sizeof(nd));
    put(r.shape.data(), r.shape.size() * sizeof(int64_t));
    put(&r.region.ndim, sizeof(r.region.ndim));
    put(r.region.offset.data(), sizeof(int64_t) * r.region.ndim);
    put(r.region.extent.data(), sizeof(int64_t) * r.region.ndim);
    put(&r.wire_offset, sizeof(r.wire_offset));
  }
  return k;
}

class CudaPacker final : public Packer, public PackerAccess {
 public:
  CudaPacker(int device, Millis timeout) : device_(device), timeout_(timeout) {}
  ~CudaPacker() override {
    block_quantize_.reset();
    if (pinned_) cudaFreeHost(pinned_);
    if (quiesce_) cudaEventDestroy(quiesce_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  std::string_view name() const override { return "cuda"; }

  Result<uint64_t> Pack(const std::vector<PackRegion>& regions, DType wire, void* out,
                        int64_t bytes) override {
    SS_ASSIGN_OR_RETURN(CopyBatch * b, Get('p', regions, out, wire, bytes));
    return Run(b);
  }

  Result<uint64_t> ChecksumLanded(const std::vector<PackRegion>& regions, int64_t bytes) override {
    const DType wire = regions.empty() ? DType::kBF16 : regions[0].dtype;
    SS_ASSIGN_OR_RETURN(CopyBatch * b, Get('v', regions, nullptr, wire, bytes));
    return Run(b);
  }

  Status Unpack(const void* in, DType wire, int64_t bytes,
                const std::vector<PackRegion>& regions) override {
    SS_ASSIGN_OR_RETURN(CopyBatch * b, Get('u', regions, const_cast<void*>(in), wire, bytes));
    return Run(b).status();
  }

  Status ZeroFill(void* base, DType dtype, const Shape& shape, const Region& region) override {
    SS_RETURN_IF_ERROR(Init());
    const int64_t es = DTypeSize(dtype);
    Status s;
    ForEachRun(region, shape, [&](int64_t off, int64_t len) {
      if (!s.ok()) return;
      s = CudaStatus(
          cudaMemsetAsync(static_cast<unsigned char*>(base) + off * es, 0, len * es, stream_),
          "cuda packer: zero fill");
    });
    SS_RETURN_IF_ERROR(s);
    return Wait();
  }

  // Work the framework queued on torch's default stream (the legacy default stream): an event
  // recorded there and polled until the timeout, since our stream is non-blocking.
  // One event for the packer's life: it is on every sync's path (creating and destroying one each
  // time cost driver calls there).
  Status Quiesce() override {
    SS_RETURN_IF_ERROR(Init());
    if (!quiesce_) {
      SS_CUDA(cudaEventCreateWithFlags(&quiesce_, cudaEventDisableTiming), "cuda packer: event");
    }
    cudaEvent_t ev = quiesce_;
    Status s = CudaStatus(cudaEventRecord(ev, cudaStreamLegacy), "cuda packer: quiesce");
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (s.ok()) {
      const cudaError_t e = cudaEventQuery(ev);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        s = CudaStatus(e, "cuda packer: quiesce");
      } else if (std::chrono::steady_clock::now() > deadline) {
        s = DeadlineExceededError("cuda packer: work queued on device " + std::to_string(device_) +
                                  " did not finish within " + std::to_string(timeout_.count()) +
                                  " ms");
      }
    }
    return s;
  }

  // The codecs' steps over device memory (pack.h CodecKernels; packer_access.h), one per codec
  // that has any, sharing this packer's stream and bounded wait.
  std::vector<CodecKernels*> codec_kernels() override { return {block_quantize_.get()}; }
  Status Ready() override { return Init(); }
  int device() const override { return device_; }
  void* stream() override { return stream_; }

  // Through a pinned buffer, so the copy is stream-ordered and waited for with the bound (a
  // pageable copy may return before the bytes land: cuda_util.h UploadBlocking).
  Status Upload(void* dst, const void* src, size_t bytes) override {
    SS_RETURN_IF_ERROR(Init());
    if (bytes == 0) return OkStatus();
    if (pinned_bytes_ < bytes) {
      if (pinned_) cudaFreeHost(pinned_);
      pinned_ = nullptr;
      pinned_bytes_ = 0;
      SS_CUDA(cudaHostAlloc(&pinned_, bytes, cudaHostAllocDefault),
              "cuda packer: pinned upload buffer");
      pinned_bytes_ = bytes;
    }
    std::memcpy(pinned_, src, bytes);
    SS_CUDA(cudaMemcpyAsync(dst, pinned_, bytes, cudaMemcpyHostToDevice, stream_),
            "cuda packer: upload");
    return Wait();
  }

  // Staging on the device: the pack kernel writes it, and device transports read it.
  Result<int64_t> FreeBytes() override {
    SS_RETURN_IF_ERROR(Init());
    size_t free_bytes = 0, total = 0;
    SS_CUDA(cudaMemGetInfo(&free_bytes, &total), "cuda packer: cudaMemGetInfo");
    return static_cast<int64_t>(free_bytes);
  }

  // Copies: adjacent pairs merged into one cudaMemcpyAsync (bound parameters that sit back to
  // back in one allocation copy as one); a merged run the runtime refuses (it spans two
  // allocations that happen to be adjacent) is copied pair by pair. Swaps: one exchange kernel
  // per pair. One wait at the end.
  Status CopyAreas(const std::vector<AreaCopy>& copies, bool swap) override {
    SS_RETURN_IF_ERROR(Init());
    if (!swap) {
      std::vector<std::pair<AreaCopy, std::vector<AreaCopy>>> merged;  // run, its pairs
      for (const AreaCopy& c : copies) {
        if (c.bytes <= 0) continue;
        if (!merged.empty()) {
          AreaCopy& m = merged.back().first;
          if (static_cast<unsigned char*>(m.dst) + m.bytes == c.dst &&
              static_cast<unsigned char*>(m.src) + m.bytes == c.src) {
            m.bytes += c.bytes;
            merged.back().second.push_back(c);
            continue;
          }
        }
        merged.push_back({c, {c}});
      }
      for (const auto& [run, pairs] : merged) {
        cudaError_t e = cudaMemcpyAsync(run.dst, run.src, static_cast<size_t>(run.bytes),
                                        cudaMemcpyDeviceToDevice, stream_);
        if (e == cudaErrorInvalidValue && pairs.size() > 1) {
          cudaGetLastError();  // not sticky: clear it and copy the run's pairs one by one
          for (const AreaCopy& c : pairs) {
            e = cudaMemcpyAsync(c.dst, c.src, static_cast<size_t>(c.bytes),
                                cudaMemcpyDeviceToDevice, stream_);
            if (e != cudaSuccess) break;
          }
        }
        SS_CUDA(e, "cuda packer: commit copy of " + std::to_string(run.bytes) + " bytes");
      }
    } else {
      if (sm_count_ == 0) {
        SS_CUDA(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_),
                "cuda packer: SM count");
      }
      for (const AreaCopy& c : copies) {
        SS_CUDA(static_cast<cudaError_t>(LaunchSwap(c.dst, c.src, c.bytes, stream_, sm_count_)),
                "cuda packer: commit exchange of " + std::to_string(c.bytes) + " bytes");
      }
    }
    return Wait();
  }

  Result<std::shared_ptr<unsigned char>> AllocStaging(size_t bytes) override {
    SS_RETURN_IF_ERROR(Init());
    void* p = nullptr;
    SS_CUDA(cudaMalloc(&p, internal::IpcAllocBytes(bytes)),
            "cuda packer: staging of " + std::to_string(bytes) + " bytes");
    const int device = device_;
    return std::shared_ptr<unsigned char>(static_cast<unsigned char*>(p),
                                          [device](unsigned char* q) {
                                            cudaSetDevice(device);
                                            cudaFree(q);
                                          });
  }

 private:
  Status Init() {
    if (stream_) return OkStatus();
    SS_CUDA(cudaSetDevice(device_), "cuda packer: cudaSetDevice " + std::to_string(device_));
    SS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cuda packer: stream");
    return OkStatus();
  }

  Status Wait() override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (true) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return OkStatus();
      if (e != cudaErrorNotReady) return CudaStatus(e, "cuda packer");
      if (std::chrono::steady_clock::now() > deadline) {
        return DeadlineExceededError("cuda packer: kernel not done within " +
                                     std::to_string(timeout_.count()) + " ms");
      }
    }
  }

  Result<uint64_t> Run(CopyBatch* b) {
    SS_RETURN_IF_ERROR(b->Launch(stream_));
    SS_RETURN_IF_ERROR(Wait());
    SS_ASSIGN_OR_RETURN(auto c, b->Checksums());
    return c[0];
  }

  Result<CopyBatch*> Get(char mode, const std::vector<PackRegion>& regions, void* buf, DType wire,
                         int64_t bytes) {
    SS_RETURN_IF_ERROR(Init());
    const std::string key = Key(mode, regions, buf, wire, bytes);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second.get();
    BatchSpec spec;
    spec.mode = mode == 'p'   ? BatchMode::kPack
                : mode == 'u' ? BatchMode::kUnpack
                              : BatchMode::kVerify;
    spec.bucket_bytes = {bytes};
    const int ws = DTypeSize(wire);
    for (size_t i = 0; i < regions.size(); ++i) {
      const PackRegion& r = regions[i];
      if (i > 0 && r.dtype != regions[0].dtype) {
        return UnimplementedError("cuda packer: region " + std::to_string(i) + " is " +
                                  std::string(DTypeName(r.dtype)) + ", region 0 is " +
                                  std::string(DTypeName(regions[0].dtype)) +
                                  " (one dtype per bucket)");
      }
      if (!RegionInside(r.region, r.shape)) {
        return OutOfRangeError("cuda packer: region " + std::to_string(i) + " " +
                               r.region.ToString() + " outside its tensor " +
                               ShapeToString(r.shape));
      }
      const int ts = DTypeSize(r.dtype);
      auto* wire_at = buf ? static_cast<unsigned char*>(buf) + r.wire_offset : nullptr;
      const size_t first = spec.runs.size();
      // Pack orientation: tensor -> wire. Unpack swaps the sides afterwards.
      AppendRegionRuns(r.region, r.shape, r.base, ts, wire_at, ws, ws, 0, r.wire_offset,
                       &spec.runs);
      if (mode == 'u') {
        for (size_t k = first; k < spec.runs.size(); ++k) {
          CopyRun& c = spec.runs[k];
          const void* tensor = c.in;
          c.in = c.out;
          c.out = const_cast<void*>(tensor);
          std::swap(c.in_stride, c.out_stride);
        }
      }
    }
    const DType tensor_dtype = regions.empty() ? wire : regions[0].dtype;
    if (mode == 'p') {
      spec.in_dtype = tensor_dtype;
      spec.out_dtype = wire;
    } else if (mode == 'u') {
      spec.in_dtype = wire;
      spec.out_dtype = tensor_dtype;
    } else {
      spec.in_dtype = wire;
    }
    SS_ASSIGN_OR_RETURN(auto batch, CopyBatch::Prepare(spec, device_));
    if (cache_.size() > 4096) cache_.clear();  // bound memory if buffers keep changing
    CopyBatch* raw = batch.get();
    cache_.emplace(key, std::move(batch));
    return raw;
  }

  int device_;
  Millis timeout_;
  cudaStream_t stream_ = nullptr;
  int sm_count_ = 0;
  cudaEvent_t quiesce_ = nullptr;
  std::map<std::string, std::unique_ptr<CopyBatch>> cache_;
  std::unique_ptr<CodecKernels> block_quantize_ = MakeCudaBlockQuantizeKernels(*this);
  void* pinned_ = nullptr;  // Upload's buffer
  size_t pinned_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Packer> MakeCudaPacker(int device, Millis timeout) {
  return std::make_unique<CudaPacker>(device, timeout);
}

}  // namespace shardsync::gpu
