// Device helpers of the delta kernels (delta_encode.cu, delta_decode.cu): block scans and
// reductions, checksum words.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/delta_kernels.h"
#include "shardsync/checksum.h"

namespace shardsync::gpu::delta {

inline constexpr int kWarps = kThreads / 32;

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

// v into bytes [o, o + 16) of a buffer of n bytes, those inside it (the ragged end).
__device__ __forceinline__ void StoreVec(unsigned char* p, uint64_t o, uint64_t n, const uint4& v) {
  if (o + 16 <= n) {
    *reinterpret_cast<uint4*>(p + o) = v;
    return;
  }
  for (uint64_t i = o; i < n && i < o + 16; ++i) {
    const uint64_t w = i - o < 8 ? Lo64(v) : Hi64(v);
    p[i] = static_cast<unsigned char>(w >> (8 * ((i - o) % 8)));
  }
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
// ChecksumMixWord split: the key of word j (j x step + seed, which consecutive words can step
// to by adding), and the mix of a word with its key. MixWithKey(w, MixKey(j)) == Mix(w, j).
__device__ __forceinline__ uint64_t MixKey(uint64_t j) { return j * kChecksumStep + kChecksumSeed; }
__device__ __forceinline__ uint64_t MixWithKey(uint64_t word, uint64_t key) {
  const uint64_t t = (word ^ key) * kChecksumMul;
  return t ^ (t >> 32);
}

// ---- Programmatic dependent launch: a call's kernels after the first are launched with it, so
// each one's launch overlaps the tail of the one before; each waits (GridDepWait) for the one
// before to complete, memory included, before it reads what that one wrote. ----
__device__ __forceinline__ void GridDepWait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void GridDepTrigger() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Launches kernel<<<grid, threads, smem, stream>>>(args) as a dependent of the stream's last.
template <typename Args>
cudaError_t LaunchDependent(void (*kernel)(Args), uint32_t grid, uint32_t smem, cudaStream_t stream,
                            const Args& args, uint32_t threads = kThreads) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args);
}

// ---- Bulk copies global -> shared memory (the Hopper copy engine, cp.async.bulk), completion
// counted in bytes on an mbarrier: a block keeps several tiles in flight at no register cost. ----
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count));
}
// Makes the initialized barriers visible to the copy engine (then a block barrier).
__device__ __forceinline__ void MbarInitFence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One thread: the barrier's current phase completes once `bytes` more bytes have landed.
__device__ __forceinline__ void MbarExpect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
// Orders this thread's generic-proxy accesses to shared memory, reads as well as writes, before
// later copy-engine (async proxy) ones. A block barrier alone does not: a read of a stage still in
// flight at the barrier can see the refill's bytes (Triton's proxy fence insertion puts this fence
// between a shared load and a later TMA load into the same buffer: its `fence_write_after_read`
// test). So every thread fences after its last read of a stage, then the barrier, then the refill.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Waits until the barrier's phase with parity `phase` completed.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t phase) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, "
        "0, p;\n}"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(phase)
        : "memory");
  }
}

// Lanes of one warp copy `len` bytes from src to dst (any alignment; dst's 4-byte words written
// whole, each from two aligned words of src). Reads up to 3 bytes past src + len, never past the
// 4-byte word holding src + len + 3.
__device__ __forceinline__ void WarpCopy(unsigned char* dst, const unsigned char* src, uint64_t len,
                                         int lane) {
  const uint64_t head =
      min(len, static_cast<uint64_t>((4 - reinterpret_cast<uintptr_t>(dst) % 4) % 4));
  if (static_cast<uint64_t>(lane) < head) dst[lane] = src[lane];
  dst += head;
  src += head;
  len -= head;
  const uint64_t words = len / 4;
  const uint32_t sh = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(src) % 4);
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(src - sh);
  uint32_t* dw = reinterpret_cast<uint32_t*>(dst);
#pragma unroll 4
  for (uint64_t w = lane; w < words; w += 32) {
    const uint32_t lo = sw[w];
    const uint32_t hi = sh != 0 ? sw[w + 1] : 0u;
    dw[w] = __funnelshift_r(lo, hi, 8 * sh);
  }
  for (uint64_t i = words * 4 + lane; i < len; i += 32) dst[i] = src[i];
}

// 16 bytes of the 32 in (lo, hi) from byte r on (r uniform across the block).
__device__ __forceinline__ uint4 Shift16(const uint4& lo, const uint4& hi, uint32_t r) {
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const uint32_t s = 8 * (r % 4);
  uint4 o;
  switch (r / 4) {
    case 0:
      o = make_uint4(__funnelshift_r(w[0], w[1], s), __funnelshift_r(w[1], w[2], s),
                     __funnelshift_r(w[2], w[3], s), __funnelshift_r(w[3], w[4], s));
      break;
    case 1:
      o = make_uint4(__funnelshift_r(w[1], w[2], s), __funnelshift_r(w[2], w[3], s),
                     __funnelshift_r(w[3], w[4], s), __funnelshift_r(w[4], w[5], s));
      break;
    case 2:
      o = make_uint4(__funnelshift_r(w[2], w[3], s), __funnelshift_r(w[3], w[4], s),
                     __funnelshift_r(w[4], w[5], s), __funnelshift_r(w[5], w[6], s));
      break;
    default:
      o = make_uint4(__funnelshift_r(w[3], w[4], s), __funnelshift_r(w[4], w[5], s),
                     __funnelshift_r(w[5], w[6], s), __funnelshift_r(w[6], w[7], s));
  }
  return o;
}

// The block copies len bytes from src to dst (any alignment): dst's 16-byte chunks written whole,
// each from two aligned 16-byte loads of src. Reads up to 31 bytes past src + len.
__device__ inline void BlockCopy(unsigned char* dst, const unsigned char* src, uint64_t len) {
  const uint64_t head =
      min(len, static_cast<uint64_t>((16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16));
  if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];
  dst += head;
  src += head;
  len -= head;
  const uint64_t chunks = len / 16;
  const uint32_t r = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(src) % 16);
  const uint4* s16 = reinterpret_cast<const uint4*>(src - r);
  uint4* d16 = reinterpret_cast<uint4*>(dst);
  constexpr int kU = 4;
  for (uint64_t c0 = threadIdx.x; c0 < chunks; c0 += kU * kThreads) {
    uint4 lo[kU], hi[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint64_t c = c0 + static_cast<uint64_t>(u) * kThreads;
      lo[u] = c < chunks ? s16[c] : make_uint4(0, 0, 0, 0);
      hi[u] = c < chunks && r != 0 ? s16[c + 1] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint64_t c = c0 + static_cast<uint64_t>(u) * kThreads;
      if (c < chunks) d16[c] = r == 0 ? lo[u] : Shift16(lo[u], hi[u], r);
    }
  }
  for (uint64_t i = chunks * 16 + threadIdx.x; i < len; i += kThreads) dst[i] = src[i];
}

}  // namespace shardsync::gpu::delta
