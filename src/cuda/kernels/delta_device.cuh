// Device helpers of the delta kernels (delta_encode.cu, delta_decode.cu): block scans and
// reductions, the single-pass scan's decoupled look-back over tile states, checksum words.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/delta_kernels.h"
#include "shardsync/checksum.h"

namespace shardsync::gpu::delta {

inline constexpr int kWarps = kThreads / 32;

// ---- tile states: [63:34] epoch, [33:32] flag, [31:0] value ----
// The epoch tags a call's states, so the array needs no clearing between calls.
inline constexpr uint64_t kFlagAggregate = 1;  // the tile's own count is known
inline constexpr uint64_t kFlagPrefix = 2;     // the count of every tile up to it is known
inline constexpr uint64_t kEpochMask = (uint64_t{1} << 30) - 1;

__device__ __forceinline__ unsigned long long PackState(uint64_t epoch, uint64_t flag,
                                                        uint32_t value) {
  return ((epoch & kEpochMask) << 34) | (flag << 32) | value;
}
__device__ __forceinline__ void StoreState(unsigned long long* s, unsigned long long v) {
  *reinterpret_cast<volatile unsigned long long*>(s) = v;
}
__device__ __forceinline__ unsigned long long LoadState(const unsigned long long* s) {
  return *reinterpret_cast<const volatile unsigned long long*>(s);
}

// Decoupled look-back (Merrill and Garland, "Single-pass Parallel Prefix Scan with Decoupled
// Look-back"): called by the 32 lanes of warp 0 of the block holding tile t, which publishes its
// aggregate, sums predecessors' aggregates back to the first one with a prefix, and publishes its
// own prefix. Tile ids come from an atomic counter, so every predecessor belongs to a block that
// is already running: the spin ends. Returns the exclusive prefix to every lane.
__device__ __forceinline__ uint32_t LookBack(unsigned long long* states, uint32_t t,
                                             uint32_t aggregate, uint64_t epoch) {
  const int lane = threadIdx.x & 31;
  if (t == 0) {
    if (lane == 0) StoreState(&states[0], PackState(epoch, kFlagPrefix, aggregate));
    return 0;
  }
  if (lane == 0) StoreState(&states[t], PackState(epoch, kFlagAggregate, aggregate));
  uint32_t prefix = 0;
  int64_t top = static_cast<int64_t>(t) - 1;
  while (true) {
    const int64_t j = top - lane;
    uint64_t flag = kFlagPrefix;
    uint32_t value = 0;
    if (j >= 0) {
      unsigned long long s;
      do {
        s = LoadState(&states[j]);
      } while ((s >> 34) != (epoch & kEpochMask) || ((s >> 32) & 3) == 0);
      flag = (s >> 32) & 3;
      value = static_cast<uint32_t>(s);
    }
    const unsigned prefixes = __ballot_sync(0xffffffffu, flag == kFlagPrefix);
    const int stop = prefixes != 0 ? __ffs(prefixes) - 1 : 31;
    uint32_t v = lane <= stop ? value : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    prefix += v;
    if (prefixes != 0) break;
    top -= 32;
  }
  if (lane == 0) StoreState(&states[t], PackState(epoch, kFlagPrefix, prefix + aggregate));
  return prefix;
}

// Exclusive scan over the block in thread order; *total gets the block's sum. `smem` holds
// kWarps values; ends with a barrier, so it can be reused at once.
__device__ __forceinline__ uint64_t BlockExclusiveScan(uint64_t v, uint64_t* total,
                                                       uint64_t* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint64_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) smem[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint64_t w = lane < kWarps ? smem[lane] : 0;
#pragma unroll
    for (int o = 1; o < kWarps; o <<= 1) {
      const uint64_t y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kWarps) smem[lane] = w;
  }
  __syncthreads();
  const uint64_t before = warp > 0 ? smem[warp - 1] : 0;
  *total = smem[kWarps - 1];
  __syncthreads();
  return before + x - v;
}

// N exclusive scans in thread order at once (one exchange through shared memory, two barriers);
// total[i] gets the block's sum of v[i] in every thread. `smem` holds N x kWarps values.
template <int N>
__device__ __forceinline__ void BlockScanN(uint64_t (&v)[N], uint64_t (&total)[N],
                                           uint64_t (*smem)[kWarps]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint64_t x[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    x[i] = v[i];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t y = __shfl_up_sync(0xffffffffu, x[i], o);
      if (lane >= o) x[i] += y;
    }
    if (lane == 31) smem[i][warp] = x[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    uint64_t before = 0, tot = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const uint64_t s = smem[i][w];
      before += w < warp ? s : 0;
      tot += s;
    }
    v[i] = before + x[i] - v[i];
    total[i] = tot;
  }
  __syncthreads();
}

// Sum over the block, valid in thread 0. Ends with a barrier.
__device__ __forceinline__ uint64_t BlockSum(uint64_t v, uint64_t* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  uint64_t s = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) s += smem[w];
  __syncthreads();
  return s;
}

__device__ __forceinline__ uint64_t Lo64(const uint4& v) {
  return (static_cast<uint64_t>(v.y) << 32) | v.x;
}
__device__ __forceinline__ uint64_t Hi64(const uint4& v) {
  return (static_cast<uint64_t>(v.w) << 32) | v.z;
}

// 16 bytes of p at byte offset o of a buffer of n bytes, zero past n (the ragged end).
__device__ __forceinline__ uint4 LoadVec(const unsigned char* p, uint64_t o, uint64_t n) {
  if (o + 16 <= n) return *reinterpret_cast<const uint4*>(p + o);
  uint32_t w[4] = {0, 0, 0, 0};
  for (uint64_t i = o; i < n && i < o + 16; ++i)
    w[(i - o) / 4] |= uint32_t{p[i]} << (8 * ((i - o) % 4));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Word j (8 bytes, zero padded past n) of a 16-byte aligned buffer of n bytes.
__device__ __forceinline__ uint64_t LoadWord(const unsigned char* p, uint64_t j, uint64_t n) {
  const uint64_t o = j * 8;
  if (o + 8 <= n) return *reinterpret_cast<const unsigned long long*>(p + o);
  uint64_t w = 0;
  for (uint64_t i = o; i < n; ++i) w |= static_cast<uint64_t>(p[i]) << (8 * (i - o));
  return w;
}

// Bytes [at, at + E) of a little-endian word replaced by the low E bytes of v.
template <int E>
__device__ __forceinline__ uint64_t Patch(uint64_t word, int at, uint64_t v) {
  constexpr uint64_t kMask = E == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * E)) - 1;
  return (word & ~(kMask << (8 * at))) | ((v & kMask) << (8 * at));
}

__device__ __forceinline__ uint64_t Mix(uint64_t word, uint64_t j) {
  return ChecksumMixWord(word, j);
}

}  // namespace shardsync::gpu::delta
