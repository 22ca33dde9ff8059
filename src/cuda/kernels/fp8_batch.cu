// Prepared block-FP8 packs (gpu.h BatchSpec::quantize): the quantize ops of a cuda_ipc pair's
// buckets (and its amax ops: rows of a block row quantized with the scales their holders agreed
// on, EncodedTask::given_scales), replayed every sync beside the pair's copies. The quantize kernel
// (PipeKernel) reads the trainer's values once into shared-memory stages, reduces each 128 x 128
// block's amax, writes the e4m3 words straight into the peer's weight and the scale into its
// weight_scale_inv, and sums every word it wrote twice: as packed, and as read back (from L2)
// through the receiver's own map of the same bytes, as the copy kernels do. A tail kernel sums the
// scale sections the same two ways. The copies run in an ordinary CopyBatch over a compact image of
// them, on a side stream beside the quantize kernel; a host word written after both is the launch's
// signal. The arithmetic is fp8.h's, shared with the CPU. Hand-written: no CUDA library quantizes
// to block FP8 with these semantics. The kernels are in fp8_batch_kernels.cuh; this file holds the
// batch that prepares, launches and sums them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/cuda_util.h"
#include "cuda/kernels/fp8_batch_kernels.cuh"
#include "cuda/kernels/fp8_device.cuh"
#include "cuda/kernels/fp8_kernels.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"
#include "shardsync/settings.h"

namespace shardsync::gpu {
namespace {

class Fp8Batch final : public CopyBatch {
 public:
  ~Fp8Batch() override {
    cudaSetDevice(device_);
    if (tasks_) cudaFree(tasks_);
    if (acc_) cudaFree(acc_);
    if (host_) cudaFreeHost(host_);
    if (flag_) cudaFreeHost(flag_);
    if (side_) cudaStreamDestroy(side_);
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
  }

  Status Init(const BatchSpec& spec, int device) {
    device_ = device;
    nb_ = static_cast<int>(spec.bucket_bytes.size());
    bucket_bytes_ = spec.bucket_bytes;
    if (spec.mode != BatchMode::kPack || spec.copy_bytes.size() != spec.bucket_bytes.size()) {
      return InvalidArgumentError("fp8 batch: a pack with copy_bytes for every bucket (" +
                                  std::to_string(spec.copy_bytes.size()) + " for " +
                                  std::to_string(nb_) + " buckets)");
    }
    SS_CUDA(cudaSetDevice(device), "fp8 batch: cudaSetDevice");
    std::vector<PTask> tasks;
    for (size_t i = 0; i < spec.encoded.size(); ++i) {
      SS_ASSIGN_OR_RETURN(PTask t, Check(spec, i));
      t.block_begin = blocks_;
      dtype_ = i == 0 ? t.dtype : (dtype_ == t.dtype ? dtype_ : -1);
      blocks_ += ((t.rows + B - 1) / B) * ((t.cols + B - 1) / B);
      wire_ += t.given ? Fp8PartWireBytes(t.rows, t.cols, t.scales != nullptr)
                       : Fp8WireBytes(t.rows, t.cols);
      in_ += t.rows * t.cols * (t.dtype == 0 ? 4 : 2);
      tasks.push_back(t);
    }
    BatchSpec copies = spec;
    copies.encoded.clear();
    copies.copy_bytes.clear();
    copies.stage_runs.clear();
    copies.stage_landed_runs.clear();
    copies.stage_bytes.clear();
    copies.bucket_bytes = spec.copy_bytes;
    inner_landed_ = !spec.landed_runs.empty();
    if (!inner_landed_) copies.landed_sums.clear();
    SS_ASSIGN_OR_RETURN(inner_, CopyBatch::Prepare(copies, device));
    n_tasks_ = static_cast<int>(tasks.size());
    SS_RETURN_IF_ERROR(PickKernel(device));
    if (!tasks.empty()) {
      SS_CUDA(cudaMalloc(&tasks_, tasks.size() * sizeof(PTask)), "fp8 batch: tasks");
      SS_RETURN_IF_ERROR(internal::UploadBlocking(
          tasks_, tasks.data(), tasks.size() * sizeof(PTask), "fp8 batch: upload tasks"));
    }
    const size_t words = 3 * static_cast<size_t>(std::max(1, nb_));
    SS_CUDA(cudaMalloc(&acc_, words * 8), "fp8 batch: sums");
    SS_CUDA(cudaMemset(acc_, 0, words * 8), "fp8 batch: sums");
    SS_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host_), words * 8, cudaHostAllocDefault),
            "fp8 batch: pinned sums");
    std::memset(host_, 0, words * 8);
    SS_RETURN_IF_ERROR(InitOverlap());
    return InitStage(spec, device);
  }

  Status Launch(void* stream) override {
    if (stage_) SS_RETURN_IF_ERROR(stage_->Launch(stream));
    SS_RETURN_IF_ERROR(Quantize(static_cast<cudaStream_t>(stream)));
    return inner_->Launch(stream);
  }
  // The stage copies, the quantize kernels and the copy of their sums go first: the copies'
  // signal, last on the stream, covers them.
  Status LaunchSignaled(void* stream, uint64_t seq) override {
    if (stage_) SS_RETURN_IF_ERROR(stage_->Launch(stream));
    if (overlap_) return LaunchOverlapped(static_cast<cudaStream_t>(stream), seq);
    SS_RETURN_IF_ERROR(Quantize(static_cast<cudaStream_t>(stream)));
    return inner_->LaunchSignaled(stream, seq);
  }
  uint64_t Signaled() const override {
    return overlap_ ? __atomic_load_n(flag_, __ATOMIC_ACQUIRE) : inner_->Signaled();
  }

  Result<std::vector<uint64_t>> Sums() const override {
    SS_ASSIGN_OR_RETURN(std::vector<uint64_t> s, inner_->Sums());
    for (int b = 0; b < nb_; ++b) s[b] += host_[b];
    if (stage_) {
      SS_ASSIGN_OR_RETURN(std::vector<uint64_t> st, stage_->Sums());
      for (int b = 0; b < nb_; ++b) s[b] += st[b];
    }
    return s;
  }
  Result<std::vector<uint64_t>> Checksums() const override {
    SS_ASSIGN_OR_RETURN(std::vector<uint64_t> s, Sums());
    for (int b = 0; b < nb_; ++b)
      s[b] = ChecksumFinish(s[b], static_cast<uint64_t>(bucket_bytes_[b]));
    return s;
  }
  Result<std::vector<uint64_t>> LandedSums() const override {
    std::vector<uint64_t> l(nb_, 0);
    if (inner_landed_) {
      SS_ASSIGN_OR_RETURN(l, inner_->LandedSums());
    }
    for (int b = 0; b < nb_; ++b) l[b] += host_[nb_ + b];
    return l;
  }
  std::vector<int64_t> NonFinite() const override {
    std::vector<int64_t> v(nb_);
    for (int b = 0; b < nb_; ++b) v[b] = static_cast<int64_t>(host_[2 * nb_ + b]);
    return v;
  }
  int64_t wire_bytes() const override {
    return inner_->wire_bytes() + wire_ + (stage_ ? stage_->wire_bytes() : 0);
  }
  int64_t in_bytes() const override {
    return inner_->in_bytes() + in_ + (stage_ ? stage_->in_bytes() : 0);
  }
  int64_t out_bytes() const override {
    return inner_->out_bytes() + wire_ + (stage_ ? stage_->out_bytes() : 0);
  }
  size_t num_chunks() const override {
    return inner_->num_chunks() + blocks_ + (stage_ ? stage_->num_chunks() : 0);
  }

 private:
  // Stage ops (BatchSpec::stage_runs): a plain CopyBatch of the trainer dtype, no cast, launched
  // first; its landed sums go straight into acc_'s landed section (Quantize hands them over and
  // re-zeroes them), its packed sums are its own, read with ours. None without stage bytes: a
  // plan without staged bands runs exactly as before.
  Status InitStage(const BatchSpec& spec, int device) {
    int64_t total = 0;
    for (int64_t b : spec.stage_bytes) total += b;
    if (!spec.stage_bytes.empty() && static_cast<int>(spec.stage_bytes.size()) != nb_) {
      return InvalidArgumentError("fp8 batch: stage_bytes for " +
                                  std::to_string(spec.stage_bytes.size()) + " buckets, not " +
                                  std::to_string(nb_));
    }
    if (total == 0) {
      if (!spec.stage_runs.empty() || !spec.stage_landed_runs.empty()) {
        return InvalidArgumentError("fp8 batch: stage runs without stage_bytes");
      }
      return OkStatus();
    }
    BatchSpec st;
    st.mode = BatchMode::kPack;
    st.in_dtype = spec.stage_dtype;
    st.out_dtype = spec.stage_dtype;
    st.runs = spec.stage_runs;
    st.bucket_bytes = spec.stage_bytes;
    st.landed_runs = spec.stage_landed_runs;
    if (!st.landed_runs.empty()) {
      for (int b = 0; b < nb_; ++b) st.landed_sums.push_back(acc_ + nb_ + b);
    }
    SS_ASSIGN_OR_RETURN(stage_, CopyBatch::Prepare(st, device));
    return OkStatus();
  }

  Result<PTask> Check(const BatchSpec& spec, size_t i) const {
    const EncodedTask& q = spec.encoded[i];
    const std::string who = "fp8 batch: quantize op " + std::to_string(i);
    const int code = q.dtype == DType::kF32    ? 0
                     : q.dtype == DType::kBF16 ? 1
                     : q.dtype == DType::kF16  ? 2
                                               : -1;
    auto aligned = [](const void* p, int64_t stride, int64_t to) {
      return reinterpret_cast<uintptr_t>(p) % to == 0 && stride % to == 0;
    };
    const int64_t nbc = Fp8Blocks(q.cols);
    // A kAmax op (given scales) covers rows of one block row and may send no scales (both
    // scale pointers null); a quantize op always sends them.
    const bool given = q.given_scales != nullptr;
    const bool with_scales = q.scales != nullptr || q.landed_scales != nullptr;
    if (code < 0 || !q.src || !q.weight || !q.landed_weight ||
        (with_scales && (!q.scales || !q.landed_scales)) || (!given && !with_scales) ||
        (given && q.rows > kFp8Block) || q.rows < 1 || q.cols < 1 || q.cols % 8 != 0 ||
        q.src_stride < q.cols || q.weight_stride < q.cols || q.landed_weight_stride < q.cols ||
        (with_scales && (q.scale_stride < nbc || q.landed_scale_stride < nbc))) {
      return InvalidArgumentError(who +
                                  " is malformed (dtype f32/bf16/f16, non-null pointers, "
                                  "positive extents, columns a multiple of 8, strides "
                                  "covering a row; given scales: at most 128 rows)");
    }
    if (!aligned(q.weight, q.weight_stride, 8) ||
        !aligned(q.landed_weight, q.landed_weight_stride, 8) || !aligned(q.scales, 0, 4) ||
        !aligned(q.landed_scales, 0, 4) || !aligned(q.given_scales, 0, 4)) {
      return InvalidArgumentError(who + ": e4m3 rows must start on 8 bytes and scales on 4");
    }
    const int64_t op_bytes =
        given ? Fp8PartWireBytes(q.rows, q.cols, with_scales) : Fp8WireBytes(q.rows, q.cols);
    if (q.bucket < 0 || q.bucket >= nb_ || q.wire_offset < 0 || q.wire_offset % 8 != 0 ||
        q.wire_offset + op_bytes > spec.bucket_bytes[q.bucket]) {
      return InvalidArgumentError(who + ": bucket " + std::to_string(q.bucket) + ", wire offset " +
                                  std::to_string(q.wire_offset) +
                                  " outside its bucket or not a multiple of 8");
    }
    const int es = code == 0 ? 4 : 2;
    PTask t{};
    t.src = static_cast<const unsigned char*>(q.src);
    t.src_stride = q.src_stride;
    t.rows = q.rows;
    t.cols = q.cols;
    t.weight = static_cast<unsigned char*>(q.weight);
    t.wstride = q.weight_stride;
    t.scales = static_cast<float*>(q.scales);
    t.sstride = q.scale_stride;
    t.lweight = static_cast<const unsigned char*>(q.landed_weight);
    t.lwstride = q.landed_weight_stride;
    t.lscales = static_cast<const float*>(q.landed_scales);
    t.lsstride = q.landed_scale_stride;
    t.given = q.given_scales;
    t.wire_offset = q.wire_offset;
    t.dtype = code;
    t.bucket = q.bucket;
    t.vec = aligned(q.src, q.src_stride * es, 16) ? 1 : 0;
    return t;
  }

  // The copies run on a side stream beside the quantize kernel, which is launched first: they
  // take the SMs its CTAs leave at its tail (its 3 CTAs per SM leave no registers for theirs
  // before). The signal is then a host word written after both (SetFlag), not the copies' own.
  // On one H200, qwen3-8b fsdp=1 -> tp2 pp2: 7.52-7.56 ms against 7.68-7.72 ms in line
  // (docs/benchmarks.md). SHARDSYNC_FP8_OVERLAP=0 runs them in line, for A/B.
  Status InitOverlap() {
    SS_ASSIGN_OR_RETURN(const bool overlap, BoolKnob("SHARDSYNC_FP8_OVERLAP"));
    overlap_ = blocks_ > 0 && overlap;
    if (!overlap_) return OkStatus();
    SS_CUDA(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "fp8 batch: side stream");
    SS_CUDA(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "fp8 batch: event");
    SS_CUDA(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), "fp8 batch: event");
    SS_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&flag_), 8, cudaHostAllocMapped),
            "fp8 batch: pinned flag");
    SS_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dflag_), flag_, 0),
            "fp8 batch: flag");
    *flag_ = 0;
    return OkStatus();
  }

  Status LaunchOverlapped(cudaStream_t s, uint64_t seq) {
    SS_CUDA(cudaEventRecord(fork_, s), "fp8 batch: fork");
    SS_CUDA(cudaStreamWaitEvent(side_, fork_, 0), "fp8 batch: fork");
    SS_RETURN_IF_ERROR(Quantize(s));
    SS_RETURN_IF_ERROR(inner_->LaunchSignaled(side_, seq));
    SS_CUDA(cudaEventRecord(join_, side_), "fp8 batch: join");
    SS_CUDA(cudaStreamWaitEvent(s, join_, 0), "fp8 batch: join");
    SetFlag<<<1, 1, 0, s>>>(dflag_, seq);
    SS_CUDA(cudaGetLastError(), "fp8 batch: flag launch");
    return OkStatus();
  }

  Status Quantize(cudaStream_t s) {
    SS_CUDA(cudaSetDevice(device_), "fp8 batch: cudaSetDevice");
    const size_t bytes = 3 * static_cast<size_t>(std::max(1, nb_)) * 8;
    if (blocks_ > 0 && pipe_) {
      pipe_<<<grid_, kThreads, smem_, s>>>(tasks_, n_tasks_, blocks_, acc_, nb_);
      SS_CUDA(cudaGetLastError(), "fp8 batch: quantize launch");
      ScaleSumKernel<<<static_cast<unsigned>(n_tasks_), kThreads, 0, s>>>(tasks_, acc_, nb_);
      SS_CUDA(cudaGetLastError(), "fp8 batch: scale sums launch");
    } else if (blocks_ > 0) {
      const unsigned grid = static_cast<unsigned>(blocks_);
      switch (dtype_) {
        case 0:
          QuantizeKernel<0><<<grid, kThreads, 0, s>>>(tasks_, n_tasks_, acc_, nb_);
          break;
        case 1:
          QuantizeKernel<1><<<grid, kThreads, 0, s>>>(tasks_, n_tasks_, acc_, nb_);
          break;
        case 2:
          QuantizeKernel<2><<<grid, kThreads, 0, s>>>(tasks_, n_tasks_, acc_, nb_);
          break;
        default:
          QuantizeKernel<-1><<<grid, kThreads, 0, s>>>(tasks_, n_tasks_, acc_, nb_);
      }
      SS_CUDA(cudaGetLastError(), "fp8 batch: quantize launch");
      ScaleSumKernel<<<static_cast<unsigned>(n_tasks_), kThreads, 0, s>>>(tasks_, acc_, nb_);
      SS_CUDA(cudaGetLastError(), "fp8 batch: scale sums launch");
    }
    SS_CUDA(cudaMemcpyAsync(host_, acc_, bytes, cudaMemcpyDeviceToHost, s), "fp8 batch: sums");
    SS_CUDA(cudaMemsetAsync(acc_, 0, bytes, s), "fp8 batch: zero sums");
    return OkStatus();
  }

  // The pipelined kernel for the tasks' dtype, its stages' shared memory and its grid (the
  // resident CTAs); null: one CTA per block (SHARDSYNC_FP8_STAGES=0).
  Status PickKernel(int device) {
    SS_ASSIGN_OR_RETURN(const int64_t knob, IntKnob("SHARDSYNC_FP8_STAGES"));  // 0..4
    int stages = static_cast<int>(knob);
    if (stages <= 0 || blocks_ == 0) return OkStatus();
    stages = std::min(4, std::max(2, stages));
    PipeFn pipe = PickPipe(dtype_, stages);
    const int stage_bytes = (dtype_ == 1 || dtype_ == 2 ? 2 : 4) * static_cast<int>(B * B);
    const int smem = stages * stage_bytes;
    int sms = 0, occ = 0;
    SS_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "fp8 batch: sms");
    // A GPU with less shared memory per block than the stages need keeps one CTA per block.
    if (cudaFuncSetAttribute(reinterpret_cast<const void*>(pipe),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, reinterpret_cast<const void*>(pipe),
                                                      kThreads, smem) != cudaSuccess ||
        occ < 1) {
      cudaGetLastError();
      return OkStatus();
    }
    pipe_ = pipe;
    smem_ = smem;
    grid_ = static_cast<unsigned>(std::min<int64_t>(blocks_, int64_t{sms} * occ));
    return OkStatus();
  }

  int device_ = 0;
  int nb_ = 0;
  PipeFn pipe_ = nullptr;
  int smem_ = 0;
  unsigned grid_ = 1;
  std::vector<int64_t> bucket_bytes_;
  std::unique_ptr<CopyBatch> inner_;
  std::unique_ptr<CopyBatch> stage_;  // null without stage ops
  bool inner_landed_ = false;
  PTask* tasks_ = nullptr;
  int n_tasks_ = 0;
  int dtype_ = -1;  // the tasks' common dtype code, -1 when mixed
  int64_t blocks_ = 0, wire_ = 0, in_ = 0;
  unsigned long long* acc_ = nullptr;
  unsigned long long* host_ = nullptr;  // [packed | landed | non-finite], pinned
  bool overlap_ = false;                // SHARDSYNC_FP8_OVERLAP (default 1)
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  unsigned long long* flag_ = nullptr;   // the overlapped launch's signal, pinned
  unsigned long long* dflag_ = nullptr;  // its device address
};

}  // namespace

Result<std::unique_ptr<CopyBatch>> PrepareBlockQuantizeBatch(const BatchSpec& spec, int device) {
  auto b = std::make_unique<Fp8Batch>();
  SS_RETURN_IF_ERROR(b->Init(spec, device));
  return std::unique_ptr<CopyBatch>(std::move(b));
}

}  // namespace shardsync::gpu
