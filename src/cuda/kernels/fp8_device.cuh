// Device helpers of the two block-FP8 kernel files (fp8_kernels.cu: the quantize-pack into a
// wire buffer; fp8_batch.cu: the prepared batch of device pairs).
#pragma once

#include <cstdint>

namespace shardsync::gpu::fp8dev {

// Index of the task holding global block `block`: tasks sorted by their first block
// (`block_begin`), n > 0.
template <typename Task>
__device__ __forceinline__ int FindTask(const Task* tasks, int n, int64_t block) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tasks[mid].block_begin <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// `op` over the CTA's kThreads values: warp shuffles, then one slot per warp in `shared`
// (kThreads / 32 of them); every thread gets the result.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T BlockReduce(T v, Op op, T* shared) {
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = shared[0];
  for (int w = 1; w < kThreads / 32; ++w) v = op(v, shared[w]);
  return v;
}

}  // namespace shardsync::gpu::fp8dev
