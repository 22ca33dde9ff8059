// Fused pack + quantize of block-FP8 syncs on the GPU (fp8_kernels.h): the trainer's values are
// read once, quantized per 128 x 128 block with the arithmetic of fp8.h (shared inline code, so
// the bytes equal the CPU quantizer's), written where the wire image says, and checksummed as
// they are written. Hand-written: no CUDA library quantizes to block FP8 with these semantics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cuda/cuda_util.h"
#include "cuda/kernels/fp8_device.cuh"
#include "cuda/kernels/fp8_kernels.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"

namespace shardsync::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kWordsPerRow = kFp8Block / 8;                           // 16
constexpr int kWordsPerThread = kFp8Block * kWordsPerRow / kThreads;  // 8
constexpr int64_t B = kFp8Block;

struct DeviceTask {
  const unsigned char* src;
  int64_t src_row_stride;
  int64_t rows, cols;
  unsigned char* out;
  uint64_t wire_offset;
  int64_t block_begin;  // first global block of the task
  int32_t dtype;        // 0 f32, 1 bf16, 2 f16
  int32_t sum_index;
};

__device__ __forceinline__ float LoadValue(const unsigned char* p, int dtype) {
  if (dtype == 0) return *reinterpret_cast<const float*>(p);
  const unsigned short h = *reinterpret_cast<const unsigned short*>(p);
  if (dtype == 1) return __uint_as_float(static_cast<uint32_t>(h) << 16);
  return __half2float(__ushort_as_half(h));
}

using fp8dev::FindTask;
template <typename T, typename Op>
__device__ __forceinline__ T BlockReduce(T v, Op op, T* shared) {
  return fp8dev::BlockReduce<kThreads>(v, op, shared);
}

// One CTA per block. Thread t owns words w = t + 256 k (k < 8) of the block: row w / 16, columns
// [8 (w % 16), +8). Values stay in registers between the amax reduction and the stores.
__global__ void __launch_bounds__(kThreads)
    QuantizePackKernel(const DeviceTask* tasks, int n_tasks, unsigned long long* sums,
                       unsigned long long* nonfinite) {
  __shared__ float f_shared[kThreads / 32];
  __shared__ unsigned long long u_shared[kThreads / 32];
  const int64_t block = blockIdx.x;
  const DeviceTask& t = tasks[FindTask(tasks, n_tasks, block)];
  const int64_t nbc = (t.cols + B - 1) / B;
  const int64_t local = block - t.block_begin;
  const int64_t br = local / nbc, bc = local % nbc;
  const int64_t r0 = br * B, c0 = bc * B;
  const int nr = static_cast<int>(min(B, t.rows - r0)), nc = static_cast<int>(min(B, t.cols - c0));
  const int es = t.dtype == 0 ? 4 : 2;
  float v[kWordsPerThread][8];
  float amax = 0.f;
  unsigned long long bad = 0;
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k) {
    const int w = threadIdx.x + kThreads * k, r = w / kWordsPerRow, c = (w % kWordsPerRow) * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[k][i] = 0.f;
      if (r < nr && c + i < nc) {
        v[k][i] = LoadValue(t.src + ((r0 + r) * t.src_row_stride + c0 + c + i) * es, t.dtype);
        const float a = fabsf(v[k][i]);
        if (!(a <= 3.402823466e38f)) {
          ++bad;
        } else {
          amax = fmaxf(amax, a);
        }
      }
    }
  }
  amax = BlockReduce(
      amax, [](float a, float b) { return fmaxf(a, b); }, f_shared);
  bad = BlockReduce(
      bad, [](unsigned long long a, unsigned long long b) { return a + b; }, u_shared);
  const float scale = bad > 0 ? Fp8BitsFloat(kFp8ScaleNanBits) : Fp8BlockScale(amax);
  const float inv = Fp8InverseScale(scale);
  // Words of the e4m3 section are whole and 8-aligned when cols % 8 == 0 (c0 is a multiple of
  // 128); otherwise the tail kernel checksums that section.
  const bool words = t.cols % 8 == 0;
  unsigned long long sum = 0;
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k) {
    const int w = threadIdx.x + kThreads * k, r = w / kWordsPerRow, c = (w % kWordsPerRow) * 8;
    if (r >= nr || c >= nc) continue;
    const int64_t off = (r0 + r) * t.cols + c0 + c;
    uint64_t word = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (c + i < nc) {
        const uint8_t q = bad > 0 ? kFp8E4M3Nan : Fp8QuantizeValue(v[k][i], inv);
        word |= static_cast<uint64_t>(q) << (8 * i);
      }
    }
    if (words) {
      *reinterpret_cast<uint64_t*>(t.out + off) = word;
      sum += ChecksumMixWord(word, (t.wire_offset + off) / 8);
    } else {
      for (int i = 0; i < 8 && c + i < nc; ++i)
        t.out[off + i] = static_cast<unsigned char>(word >> (8 * i));
    }
  }
  if (threadIdx.x == 0) {
    const int64_t fp8_bytes = (t.rows * t.cols + 7) & ~int64_t{7};
    float* scales = reinterpret_cast<float*>(t.out + fp8_bytes);
    scales[br * nbc + bc] = scale;
  }
  sum = BlockReduce(
      sum, [](unsigned long long a, unsigned long long b) { return a + b; },
      reinterpret_cast<unsigned long long*>(u_shared));
  if (threadIdx.x == 0) {
    if (words && sum != 0) atomicAdd(&sums[t.sum_index], static_cast<unsigned long long>(sum));
    if (bad > 0) atomicAdd(nonfinite, bad);
  }
}

// One CTA per task, after the main kernel: zero pads, and the checksum terms of the scale
// section (and of the e4m3 section when cols % 8 != 0).
__global__ void __launch_bounds__(kThreads)
    TailKernel(const DeviceTask* tasks, unsigned long long* sums) {
  __shared__ unsigned long long u_shared[kThreads / 32];
  const DeviceTask& t = tasks[blockIdx.x];
  const int64_t fp8 = t.rows * t.cols, fp8_padded = (fp8 + 7) & ~int64_t{7};
  const int64_t nb = ((t.rows + B - 1) / B) * ((t.cols + B - 1) / B);
  const int64_t end = fp8_padded + ((nb * 4 + 7) & ~int64_t{7});
  for (int64_t i = fp8 + threadIdx.x; i < fp8_padded; i += kThreads) t.out[i] = 0;
  for (int64_t i = fp8_padded + nb * 4 + threadIdx.x; i < end; i += kThreads) t.out[i] = 0;
  __syncthreads();
  const int64_t begin = t.cols % 8 == 0 ? fp8_padded : 0;
  unsigned long long sum = 0;
  for (int64_t w = begin / 8 + threadIdx.x; w < end / 8; w += kThreads) {
    uint64_t word = 0;
    for (int i = 0; i < 8; ++i) word |= static_cast<uint64_t>(t.out[w * 8 + i]) << (8 * i);
    sum += ChecksumMixWord(word, t.wire_offset / 8 + w);
  }
  sum = BlockReduce(
      sum, [](unsigned long long a, unsigned long long b) { return a + b; }, u_shared);
  if (threadIdx.x == 0 && sum != 0)
    atomicAdd(&sums[t.sum_index], static_cast<unsigned long long>(sum));
}

}  // namespace

Result<Fp8DeviceResult> Fp8QuantizePackDevice(const std::vector<Fp8QuantizeTask>& tasks,
                                              int num_sums, void* stream) {
  if (num_sums < 1) return InvalidArgumentError("fp8 quantize: no checksum accumulator");
  std::vector<DeviceTask> dt;
  dt.reserve(tasks.size());
  int64_t blocks = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Fp8QuantizeTask& t = tasks[i];
    const int code = t.dtype == DType::kF32    ? 0
                     : t.dtype == DType::kBF16 ? 1
                     : t.dtype == DType::kF16  ? 2
                                               : -1;
    if (code < 0 || t.src == nullptr || t.out == nullptr || t.rows < 1 || t.cols < 1 ||
        t.src_row_stride < t.cols || t.wire_offset % 8 != 0 || t.sum_index < 0 ||
        t.sum_index >= num_sums || reinterpret_cast<uintptr_t>(t.out) % 8 != 0) {
      return InvalidArgumentError("fp8 quantize: task " + std::to_string(i) +
                                  " is malformed (dtype f32/bf16/f16, positive extents, row stride "
                                  ">= cols, 8-aligned wire offset and output, a valid sum index)");
    }
    dt.push_back(DeviceTask{static_cast<const unsigned char*>(t.src), t.src_row_stride, t.rows,
                            t.cols, static_cast<unsigned char*>(t.out), t.wire_offset, blocks, code,
                            t.sum_index});
    blocks += ((t.rows + B - 1) / B) * ((t.cols + B - 1) / B);
  }
  Fp8DeviceResult res;
  res.sums.assign(num_sums, 0);
  if (tasks.empty()) return res;
  auto s = static_cast<cudaStream_t>(stream);
  DeviceTask* d_tasks = nullptr;
  unsigned long long* d_sums = nullptr;  // num_sums accumulators, then the non-finite count
  SS_CUDA(cudaMalloc(&d_tasks, dt.size() * sizeof(DeviceTask)), "fp8 quantize: tasks");
  auto run = [&]() -> Status {
    SS_CUDA(cudaMalloc(&d_sums, (num_sums + 1) * sizeof(unsigned long long)), "fp8 quantize: sums");
    SS_CUDA(cudaMemcpyAsync(d_tasks, dt.data(), dt.size() * sizeof(DeviceTask),
                            cudaMemcpyHostToDevice, s),
            "fp8 quantize: upload");
    SS_CUDA(cudaMemsetAsync(d_sums, 0, (num_sums + 1) * sizeof(unsigned long long), s),
            "fp8 quantize: zero sums");
    QuantizePackKernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
        d_tasks, static_cast<int>(dt.size()), d_sums, d_sums + num_sums);
    SS_CUDA(cudaGetLastError(), "fp8 quantize: launch");
    TailKernel<<<static_cast<unsigned>(dt.size()), kThreads, 0, s>>>(d_tasks, d_sums);
    SS_CUDA(cudaGetLastError(), "fp8 quantize: tail launch");
    std::vector<unsigned long long> host(num_sums + 1);
    SS_CUDA(cudaMemcpyAsync(host.data(), d_sums, host.size() * sizeof(unsigned long long),
                            cudaMemcpyDeviceToHost, s),
            "fp8 quantize: download");
    SS_CUDA(cudaStreamSynchronize(s), "fp8 quantize: synchronize");
    for (int i = 0; i < num_sums; ++i) res.sums[i] = host[i];
    res.nonfinite = static_cast<int64_t>(host[num_sums]);
    return OkStatus();
  };
  const Status st = run();
  (void)cudaFree(d_sums);
  (void)cudaFree(d_tasks);
  if (!st.ok()) return st;
  return res;
}

}  // namespace shardsync::gpu
