// The partial amaxes of the amax exchange over device pairs (fp8_kernels.h Fp8AmaxBatch): per
// sync, a trainer rank's rows of every block row it shares with other trainer ranks are reduced
// to one magnitude per 128-column block, which the session posts through the store
// (sync/fp8_send.cc). Hand-written: the reduction must equal fp8.h's Fp8PartialAmax bit for bit
// (an integer max of fp32 magnitude bits), which no CUDA library offers in this form.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/kernels/fp8_device.cuh"
#include "cuda/kernels/fp8_kernels.h"
#include "shardsync/fp8.h"

namespace shardsync::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t B = kFp8Block;

struct ATask {
  const unsigned char* src;
  int64_t stride;  // elements
  int64_t rows, cols;
  int64_t slot;
  int64_t block_begin;  // the task's first CTA (FindTask)
  int32_t dtype;        // 0 f32, 1 bf16, 2 f16
  int32_t vec;          // rows and columns on 16 bytes: 16-byte loads
};

// |x| as fp32 bits: what the CPU takes after widening to fp32 (fp8.cc LoadRow, MaxMagnitudeBits).
__device__ __forceinline__ uint32_t Mag(uint32_t raw, int dtype) {
  if (dtype == 0) return raw & 0x7fffffffu;
  if (dtype == 1) return (raw & 0x7fffu) << 16;
  return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(raw)))) &
         0x7fffffffu;
}
__device__ __forceinline__ uint32_t MagWord(uint32_t w, int dtype) {
  if (dtype == 0) return Mag(w, 0);
  return max(Mag(w & 0xffffu, dtype), Mag(w >> 16, dtype));
}

__global__ void __launch_bounds__(kThreads)
    PartialAmaxKernel(const ATask* tasks, int n_tasks, uint32_t* out) {
  __shared__ unsigned int shared[kThreads / 32];
  const ATask& t = tasks[fp8dev::FindTask(tasks, n_tasks, blockIdx.x)];
  const int64_t bc = blockIdx.x - t.block_begin, c0 = bc * B;
  const int nr = static_cast<int>(t.rows);
  const int nc = static_cast<int>(min(B, t.cols - c0));
  const int es = t.dtype == 0 ? 4 : 2;
  const unsigned char* base = t.src + c0 * es;
  const int64_t row_bytes = t.stride * es;
  unsigned int m = 0;
  if (t.vec) {
    const int per_row = nc * es / 16;  // 16-byte pieces per row
    for (int i = threadIdx.x; i < nr * per_row; i += kThreads) {
      const int r = i / per_row, p = i - r * per_row;
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(base + r * row_bytes + p * 16));
      m = max(m, max(max(MagWord(v.x, t.dtype), MagWord(v.y, t.dtype)),
                     max(MagWord(v.z, t.dtype), MagWord(v.w, t.dtype))));
    }
  } else {
    for (int i = threadIdx.x; i < nr * nc; i += kThreads) {
      const int r = i / nc, c = i - r * nc;
      const unsigned char* p = base + r * row_bytes + c * es;
      const uint32_t raw = es == 4 ? *reinterpret_cast<const uint32_t*>(p)
                                   : *reinterpret_cast<const unsigned short*>(p);
      m = max(m, Mag(raw, t.dtype));
    }
  }
  m = fp8dev::BlockReduce<kThreads>(
      m, [](unsigned int a, unsigned int b) { return max(a, b); }, shared);
  if (threadIdx.x == 0) out[t.slot + bc] = m;
}

class AmaxBatch final : public Fp8AmaxBatch {
 public:
  ~AmaxBatch() override {
    cudaSetDevice(device_);
    if (tasks_) cudaFree(tasks_);
    if (dev_) cudaFree(dev_);
    if (host_) cudaFreeHost(host_);
  }

  Status Init(const std::vector<Fp8AmaxPart>& parts, int64_t out_len, int device) {
    device_ = device;
    len_ = out_len;
    std::vector<ATask> tasks;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Fp8AmaxPart& p = parts[i];
      const int code = p.dtype == DType::kF32    ? 0
                       : p.dtype == DType::kBF16 ? 1
                       : p.dtype == DType::kF16  ? 2
                                                 : -1;
      const int64_t nbc = Fp8Blocks(p.cols);
      if (code < 0 || !p.src || p.rows < 1 || p.rows > B || p.cols < 1 || p.src_stride < p.cols ||
          p.slot < 0 || p.slot + nbc > out_len) {
        return InvalidArgumentError(
            "fp8 partial amax: part " + std::to_string(i) +
            " is malformed (dtype f32/bf16/f16, a source, 1 to 128 rows, a stride covering a "
            "row, its blocks inside the " +
            std::to_string(out_len) + " entries)");
      }
      const int es = code == 0 ? 4 : 2;
      ATask t{};
      t.src = static_cast<const unsigned char*>(p.src);
      t.stride = p.src_stride;
      t.rows = p.rows;
      t.cols = p.cols;
      t.slot = p.slot;
      t.block_begin = blocks_;
      t.dtype = code;
      t.vec = reinterpret_cast<uintptr_t>(p.src) % 16 == 0 && (p.src_stride * es) % 16 == 0 &&
                      (p.cols * es) % 16 == 0
                  ? 1
                  : 0;
      blocks_ += nbc;
      tasks.push_back(t);
    }
    if (blocks_ > 0x7fffffff) {
      return InvalidArgumentError("fp8 partial amax: " + std::to_string(blocks_) +
                                  " blocks in one launch");
    }
    n_tasks_ = static_cast<int>(tasks.size());
    SS_CUDA(cudaSetDevice(device), "fp8 partial amax: cudaSetDevice");
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, len_)) * 4;
    SS_CUDA(cudaMalloc(&dev_, bytes), "fp8 partial amax: partials");
    // Entries no part writes stay zero; uploaded and waited for (a cudaMemset on the legacy
    // stream is not ordered before the launch on the packer's non-blocking stream).
    const std::vector<uint32_t> zeros(bytes / 4, 0u);
    SS_RETURN_IF_ERROR(
        internal::UploadBlocking(dev_, zeros.data(), bytes, "fp8 partial amax: zero partials"));
    SS_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host_), bytes, cudaHostAllocDefault),
            "fp8 partial amax: pinned partials");
    std::memset(host_, 0, bytes);
    if (!tasks.empty()) {
      SS_CUDA(cudaMalloc(&tasks_, tasks.size() * sizeof(ATask)), "fp8 partial amax: tasks");
      SS_RETURN_IF_ERROR(internal::UploadBlocking(
          tasks_, tasks.data(), tasks.size() * sizeof(ATask), "fp8 partial amax: upload tasks"));
    }
    return OkStatus();
  }

  Status Launch(void* stream) override {
    auto s = static_cast<cudaStream_t>(stream);
    SS_CUDA(cudaSetDevice(device_), "fp8 partial amax: cudaSetDevice");
    if (blocks_ > 0) {
      PartialAmaxKernel<<<static_cast<unsigned>(blocks_), kThreads, 0, s>>>(tasks_, n_tasks_, dev_);
      SS_CUDA(cudaGetLastError(), "fp8 partial amax: launch");
    }
    if (len_ > 0) {
      SS_CUDA(
          cudaMemcpyAsync(host_, dev_, static_cast<size_t>(len_) * 4, cudaMemcpyDeviceToHost, s),
          "fp8 partial amax: copy to host");
    }
    return OkStatus();
  }
  const uint32_t* host() const override { return host_; }

 private:
  int device_ = 0;
  int64_t len_ = 0, blocks_ = 0;
  int n_tasks_ = 0;
  ATask* tasks_ = nullptr;
  uint32_t* dev_ = nullptr;
  uint32_t* host_ = nullptr;  // pinned
};

}  // namespace

Result<std::unique_ptr<Fp8AmaxBatch>> Fp8AmaxBatch::Prepare(const std::vector<Fp8AmaxPart>& parts,
                                                            int64_t out_len, int device) {
  if (out_len < 0) return InvalidArgumentError("fp8 partial amax: negative length");
  auto b = std::make_unique<AmaxBatch>();
  SS_RETURN_IF_ERROR(b->Init(parts, out_len, device));
  return std::unique_ptr<Fp8AmaxBatch>(std::move(b));
}

}  // namespace shardsync::gpu
