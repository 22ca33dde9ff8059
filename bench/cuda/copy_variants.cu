// Exploration benchmark (not built by CMake): which copy-kernel shape reaches cudaMemcpy's HBM
// rate on this GPU, with and without the shardsync checksum mix. Build: nvcc -O3 -arch=sm_90.
// `copy_variants` runs parts 1 and 2; `copy_variants 3` runs part 3 (cp.async staging, mixes).
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>

constexpr uint64_t kStep = 0x9E3779B97F4A7C15ull, kSeed = 0xD6E8FEB86659FD93ull,
                   kMul = 0xFF51AFD7ED558CCDull;
__device__ __forceinline__ uint64_t Mix(uint64_t w, uint64_t key) {
  const uint64_t t = (w ^ key) * kMul;
  return t ^ (t >> 32);
}

template <int kU, int kMode, int kLoad>  // mode 0 copy, 1 copy+mix, 2 copy+mix+readback
__global__ void Copy(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t n,
                     unsigned long long* sum) {
  uint64_t acc = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  for (; i + (kU - 1) * stride < n; i += kU * stride) {
    uint4 a[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      a[u] = kLoad == 0 ? __ldcs(in + i + u * stride)
                        : (kLoad == 1 ? __ldg(in + i + u * stride) : __ldlu(in + i + u * stride));
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      out[i + u * stride] = a[u];
      if (kMode >= 1) {
        const uint64_t w = static_cast<uint64_t>(i + u * stride) * 2;
        const uint64_t k = w * kStep + kSeed;
        acc += Mix((uint64_t(a[u].y) << 32) | a[u].x, k) +
               Mix((uint64_t(a[u].w) << 32) | a[u].z, k + kStep);
      }
    }
    if (kMode == 2) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const uint4 b = __ldcg(out + i + u * stride);
        const uint64_t w = static_cast<uint64_t>(i + u * stride) * 2;
        const uint64_t k = w * kStep + kSeed;
        acc += Mix((uint64_t(b.y) << 32) | b.x, k) + Mix((uint64_t(b.w) << 32) | b.z, k + kStep);
      }
    }
  }
  for (; i < n; i += stride) out[i] = in[i];
  if (kMode >= 1) {
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(sum, acc);
  }
}

// Blocked: block owns whole chunks of `chunk` uint4 (grid-stride over chunks), like BatchKernel.
// kPat 0: u-stride blockDim; 1: u-stride chunk/kU (each u sweeps a quarter); 2: chunks
// interleaved at warp granularity across the grid (chunk c, warp w -> one 512 B piece per u).
template <int kU, int kPat>
__global__ void Blocked(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t n,
                        int64_t chunk, unsigned long long* sum) {
  uint64_t acc = 0;
  const int64_t nchunks = n / chunk;
  const int64_t ustride = kPat == 0 ? blockDim.x : chunk / kU;
  const int64_t jend = kPat == 0 ? chunk : chunk / kU;
  const int64_t jstep = kPat == 0 ? kU * blockDim.x : blockDim.x;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int64_t base = c * chunk;
    for (int64_t j = threadIdx.x; j + (kPat == 0 ? (kU - 1) * blockDim.x : 0) < jend; j += jstep) {
      uint4 a[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) a[u] = __ldcs(in + base + j + u * ustride);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        out[base + j + u * ustride] = a[u];
        const uint64_t k = static_cast<uint64_t>(base + j + u * ustride) * 2 * kStep + kSeed;
        acc += Mix((uint64_t(a[u].y) << 32) | a[u].x, k) +
               Mix((uint64_t(a[u].w) << 32) | a[u].z, k + kStep);
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(sum, acc);
}

template <int kPat>
void RunBlocked(int64_t chunk_bytes, const uint4* in, uint4* out, int64_t n,
                unsigned long long* sum, int grid_per_sm) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int grid = sms * grid_per_sm;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  Blocked<4, kPat><<<grid, 256>>>(in, out, n, chunk_bytes / 16, sum);
  cudaEventRecord(a);
  for (int r = 0; r < 5; ++r) Blocked<4, kPat><<<grid, 256>>>(in, out, n, chunk_bytes / 16, sum);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  printf("blocked pat %d chunk %8lld B, grid %d/SM: %7.0f GB/s\n", kPat, (long long)chunk_bytes,
         grid_per_sm, 2.0 * n * 16 * 5 / (ms / 1e3) / 1e9);
}

template <int kU, int kMode, int kLoad>
void Run(const char* name, const uint4* in, uint4* out, int64_t n, unsigned long long* sum,
         int threads, int blocks_per_sm) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int occ = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, Copy<kU, kMode, kLoad>, threads, 0);
  const int grid = sms * (blocks_per_sm > 0 ? blocks_per_sm : occ);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  Copy<kU, kMode, kLoad><<<grid, threads>>>(in, out, n, sum);
  cudaEventRecord(a);
  for (int r = 0; r < 5; ++r) Copy<kU, kMode, kLoad><<<grid, threads>>>(in, out, n, sum);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  printf("%-34s threads %4d grid %5d (occ %d/SM): %7.0f GB/s\n", name, threads, grid, occ,
         2.0 * n * 16 * 5 / (ms / 1e3) / 1e9);
}

// Part 1: cudaMemcpy, grid-interleaved and chunked copy kernels.
void InterleavedVsChunked(const uint4* in, uint4* out, int64_t n, unsigned long long* sum) {
  const int64_t bytes = n * 16;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(a);
  for (int r = 0; r < 5; ++r) cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  printf("%-34s %7.0f GB/s\n", "cudaMemcpy D2D", 2.0 * bytes * 5 / (ms / 1e3) / 1e9);
  for (int64_t c : {16 << 10, 64 << 10, 256 << 10, 1 << 20}) {
    RunBlocked<0>(c, in, out, n, sum, 4);
    RunBlocked<1>(c, in, out, n, sum, 4);
  }
  for (int t : {256}) {
    Run<1, 0, 0>("copy U1 ldcs", in, out, n, sum, t, 0);
    Run<4, 0, 0>("copy U4 ldcs", in, out, n, sum, t, 0);
    Run<4, 0, 1>("copy U4 ldg", in, out, n, sum, t, 0);
    Run<4, 1, 0>("copy+mix U4 ldcs", in, out, n, sum, t, 0);
    Run<8, 1, 0>("copy+mix U8 ldcs", in, out, n, sum, t, 0);
    Run<4, 2, 0>("copy+mix+readback U4", in, out, n, sum, t, 0);
    Run<8, 2, 0>("copy+mix+readback U8", in, out, n, sum, t, 0);
  }
  Run<4, 1, 0>("copy+mix U4 ldcs 1 block/SM x1024", in, out, n, sum, 1024, 1);
  Run<4, 1, 0>("copy+mix U4 ldcs 2 blocks/SM x512", in, out, n, sum, 512, 2);
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}

// Chunked quarter streams (BatchKernel's order) with copy + mix + readback; kLd 0 ldcs, 1 ldg,
// 2 plain; kSt 0 plain, 1 stcs, 2 stcg.
template <int kU, int kLd, int kSt, bool kRb>
__global__ void Quarter(const uint4* __restrict__ in, uint4* out, int64_t n, int64_t chunk,
                        unsigned long long* sum) {
  uint64_t acc = 0, lacc = 0;
  const int64_t nchunks = n / chunk;
  const int64_t qn = chunk / kU;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int64_t base = c * chunk;
    for (int64_t j = threadIdx.x; j < qn; j += blockDim.x) {
      uint4 a[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const uint4* p = in + base + j + u * qn;
        a[u] = kLd == 0 ? __ldcs(p) : (kLd == 1 ? __ldg(p) : *p);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        uint4* o = out + base + j + u * qn;
        if (kSt == 0)
          *o = a[u];
        else if (kSt == 1)
          __stcs(o, a[u]);
        else
          __stcg(o, a[u]);
        const uint64_t k = static_cast<uint64_t>(base + j + u * qn) * 2 * kStep + kSeed;
        const uint64_t w0 = (uint64_t(a[u].y) << 32) | a[u].x,
                       w1 = (uint64_t(a[u].w) << 32) | a[u].z;
        acc += Mix(w0, k) + Mix(w1, k + kStep);
        if (kRb) {
          const uint4 b = __ldcg(o);
          const uint64_t l0 = (uint64_t(b.y) << 32) | b.x, l1 = (uint64_t(b.w) << 32) | b.z;
          if (l0 != w0 || l1 != w1)
            lacc += Mix(l0, k) - Mix(w0, k) + Mix(l1, k + kStep) - Mix(w1, k + kStep);
        }
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc + lacc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(sum, acc);
}

template <int kU, int kLd, int kSt, bool kRb>
void RunQ(const char* name, const uint4* in, uint4* out, int64_t n, unsigned long long* sum) {
  int sms = 0, occ = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, Quarter<kU, kLd, kSt, kRb>, 256, 0);
  const int grid = sms * occ;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  Quarter<kU, kLd, kSt, kRb><<<grid, 256>>>(in, out, n, 16384, sum);
  cudaEventRecord(a);
  for (int r = 0; r < 5; ++r) Quarter<kU, kLd, kSt, kRb><<<grid, 256>>>(in, out, n, 16384, sum);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  printf("%-28s occ %d: %7.0f GB/s\n", name, occ, 2.0 * n * 16 * 5 / (ms / 1e3) / 1e9);
}

// Part 3: loads staged through shared memory with cp.async (kS stages of kV x 16 B per thread
// in flight without registers); each thread consumes the slots it filled (no block barrier),
// then stores, mixes and (kRb) reads back like the landed pack.
// kMix 0: the shardsync mix (64-bit multiply); 1: 64x32 multiply (odd 32-bit constant);
// 2: 32-bit lanes (two IMAD.WIDE); 3: xor only (the no-multiply ceiling).
constexpr uint64_t kMul32 = 0xED558CCDull;
template <int kMix>
__device__ __forceinline__ uint64_t MixK(uint64_t w, uint64_t key) {
  if constexpr (kMix == 0) return Mix(w, key);
  if constexpr (kMix == 1) {
    const uint64_t t = (w ^ key) * kMul32;
    return t ^ (t >> 32);
  }
  if constexpr (kMix == 2) {
    const uint64_t x = w ^ key;
    const uint64_t a = static_cast<uint64_t>(static_cast<uint32_t>(x)) * 0xED558CCDu;
    const uint64_t b = static_cast<uint64_t>(static_cast<uint32_t>(x >> 32)) * 0x85EBCA6Bu;
    return a ^ (b << 32 | b >> 32);
  }
  return w ^ key;
}
template <int kV, int kS, bool kRb, int kMix = 0>
__global__ void __launch_bounds__(256)
    Staged(const uint4* __restrict__ in, uint4* out, int64_t n, unsigned long long* sum) {
  extern __shared__ uint4 sm[];
  const int64_t tile = int64_t{kV} * 256;
  const int64_t ntiles = n / tile;
  uint64_t acc = 0, lacc = 0;
  auto issue = [&](int64_t t, int s) {
    if (t < ntiles) {
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        const uint4* g = in + t * tile + v * 256 + threadIdx.x;
        const unsigned sa =
            static_cast<unsigned>(__cvta_generic_to_shared(&sm[(s * kV + v) * 256 + threadIdx.x]));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(g));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  int64_t t = blockIdx.x;
#pragma unroll
  for (int s = 0; s < kS - 1; ++s) issue(t + s * int64_t{gridDim.x}, s);
  int s = 0;
  for (; t < ntiles; t += gridDim.x) {
    issue(t + (kS - 1) * int64_t{gridDim.x}, (s + kS - 1) % kS);
    asm volatile("cp.async.wait_group %0;" ::"n"(kS - 1));
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      const uint4 a = sm[(s * kV + v) * 256 + threadIdx.x];
      const int64_t i = t * tile + v * 256 + threadIdx.x;
      out[i] = a;
      const uint64_t k = static_cast<uint64_t>(i) * 2 * kStep + kSeed;
      const uint64_t w0 = (uint64_t(a.y) << 32) | a.x, w1 = (uint64_t(a.w) << 32) | a.z;
      acc += MixK<kMix>(w0, k) + MixK<kMix>(w1, k + kStep);
      if (kRb) {
        const uint4 b = __ldcg(out + i);
        const uint64_t l0 = (uint64_t(b.y) << 32) | b.x, l1 = (uint64_t(b.w) << 32) | b.z;
        if (l0 != w0 || l1 != w1)
          lacc += MixK<kMix>(l0, k) - MixK<kMix>(w0, k) + MixK<kMix>(l1, k + kStep) -
                  MixK<kMix>(w1, k + kStep);
      }
    }
    s = (s + 1) % kS;
  }
  asm volatile("cp.async.wait_all;");
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc + lacc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(sum, acc);
}

template <int kV, int kS, bool kRb, int kMix = 0>
void RunS(const char* name, const uint4* in, uint4* out, int64_t n, unsigned long long* sum) {
  const int smem = kV * kS * 256 * 16;
  auto* fn = Staged<kV, kS, kRb, kMix>;
  cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int sms = 0, occ = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, 256, smem);
  const int grid = sms * occ;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  fn<<<grid, 256, smem>>>(in, out, n, sum);
  cudaEventRecord(a);
  for (int r = 0; r < 5; ++r) fn<<<grid, 256, smem>>>(in, out, n, sum);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  printf("%-28s occ %d: %7.0f GB/s\n", name, occ, 2.0 * n * 16 * 5 / (ms / 1e3) / 1e9);
}

// Parts 2 and 3: BatchKernel's chunk order with the landed readback and cache-hint variants;
// cp.async staging and checksum mixes (part 3 alone with any argument).
int main(int argc, char** argv) {
  const bool part3 = argc > 1;
  const int64_t bytes = int64_t{8} << 30;  // 8 GiB each side, like one trainer's sync
  const int64_t n = bytes / 16;
  uint4 *in, *out;
  unsigned long long* sum;
  cudaMalloc(&in, bytes);
  cudaMalloc(&out, bytes);
  cudaMalloc(&sum, 8);
  cudaMemset(in, 0x3c, bytes);
  if (!part3) InterleavedVsChunked(in, out, n, sum);
  if (part3) {
    RunQ<2, 2, 0, true>("quarter U2 ld st rb", in, out, n, sum);
    RunS<2, 4, false>("staged V2 S4", in, out, n, sum);
    RunS<2, 4, true>("staged V2 S4 rb", in, out, n, sum);
    RunS<4, 4, true>("staged V4 S4 rb", in, out, n, sum);
    RunS<1, 8, true>("staged V1 S8 rb", in, out, n, sum);
    RunS<1, 8, false, 1>("staged V1 S8 mix64x32", in, out, n, sum);
    RunS<1, 8, true, 1>("staged V1 S8 rb mix64x32", in, out, n, sum);
    RunS<1, 8, true, 2>("staged V1 S8 rb mix32x2", in, out, n, sum);
    RunS<1, 8, false, 3>("staged V1 S8 xor", in, out, n, sum);
    RunS<1, 8, true, 3>("staged V1 S8 rb xor", in, out, n, sum);
    RunS<2, 4, true, 1>("staged V2 S4 rb mix64x32", in, out, n, sum);
    RunS<2, 4, true, 3>("staged V2 S4 rb xor", in, out, n, sum);
  } else {
    RunQ<2, 0, 0, false>("U2 ldcs st", in, out, n, sum);
    RunQ<4, 0, 0, false>("U4 ldcs st", in, out, n, sum);
    RunQ<2, 0, 0, true>("U2 ldcs st rb", in, out, n, sum);
    RunQ<4, 0, 0, true>("U4 ldcs st rb", in, out, n, sum);
    RunQ<2, 1, 0, true>("U2 ldg st rb", in, out, n, sum);
    RunQ<4, 1, 0, true>("U4 ldg st rb", in, out, n, sum);
    RunQ<2, 2, 0, true>("U2 ld st rb", in, out, n, sum);
    RunQ<2, 0, 1, true>("U2 ldcs stcs rb", in, out, n, sum);
    RunQ<4, 0, 1, true>("U4 ldcs stcs rb", in, out, n, sum);
    RunQ<2, 0, 2, true>("U2 ldcs stcg rb", in, out, n, sum);
    RunQ<4, 1, 1, true>("U4 ldg stcs rb", in, out, n, sum);
    RunQ<8, 0, 0, true>("U8 ldcs st rb", in, out, n, sum);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
