// The lean landed pack kernel (kernels.cuh LeanChunk): the common chunks of a landed f32 -> bf16
// pack in a kernel with the registers of two simple shapes only; BatchKernel, launched right
// after, does the rest.
#include "cuda/kernels/kernels.cuh"

namespace shardsync::gpu::kernels {
namespace {

// kU streams per thread; kBlocks resident blocks per SM the registers are capped for.
template <int kCast, int kU, int kBlocks>
__global__ void __launch_bounds__(kThreads, kBlocks)
    LeanPackKernel(const LeanChunk* __restrict__ chunks, int num_chunks, unsigned long long* sums,
                   unsigned long long* const* __restrict__ landed, unsigned int* ticket) {
  constexpr int kInV = kCast == 1 ? 2 : 1;  // input uint4 per wire pair
  constexpr int kInPair = 16 * kInV;
  __shared__ int dyn_next;
  const int static_end = max(0, num_chunks - kDynTail * static_cast<int>(gridDim.x));
  for (int c = blockIdx.x;; c += gridDim.x) {
    if (c >= static_end) {
      if (kDynTail == 0) break;
      __syncthreads();
      if (threadIdx.x == 0) dyn_next = static_end + static_cast<int>(atomicAdd(ticket, 1u));
      __syncthreads();
      c = dyn_next;
      if (c >= num_chunks) break;
    }
    const LeanChunk ch = chunks[c];
    const uint32_t ppr = ch.ppr;
    // kU streams per thread over far-apart parts of the chunk (see BatchKernel); each keeps its
    // (row, col) and steps it by kThreads pairs without dividing again.
    const uint32_t part = ch.pairs / kU;
    const uint32_t step_row = kThreads / ppr, step_col = kThreads % ppr;
    uint32_t row[kU], col[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t p = threadIdx.x + u * part;
      row[u] = p / ppr;
      col[u] = p - row[u] * ppr;
    }
    uint64_t acc = 0, ldelta = 0;
    auto one = [&](uint32_t p, uint32_t r, uint32_t cl, const uint4(&a)[kInV]) {
      uint4 o[1];
      uint64_t w0, w1;
      PairConvert<kCast>(a, o, &w0, &w1);
      uint4* dst = reinterpret_cast<uint4*>(ch.out + r * ch.out_stride + cl * 16ull);
      Store(dst, o[0]);
      const uint64_t key = (ch.word0 + 2ull * p) * kChecksumStep + kChecksumSeed;
      acc += MixKeyed(w0, key) + MixKeyed(w1, key + kChecksumStep);
      const uint4 l = Readback(reinterpret_cast<const uint4*>(ch.landed + 16ull * p));
      const uint64_t l0 = Lo(l), l1 = Hi(l);
      if (l0 != w0 || l1 != w1) {
        ldelta += MixKeyed(l0, key) - MixKeyed(w0, key) + MixKeyed(l1, key + kChecksumStep) -
                  MixKeyed(w1, key + kChecksumStep);
      }
    };
    for (uint32_t q = threadIdx.x; q < part; q += kThreads) {
      uint4 a[kU][kInV];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const uint4* src =
            reinterpret_cast<const uint4*>(ch.in + row[u] * ch.in_stride + col[u] * 1ull * kInPair);
#pragma unroll
        for (int k = 0; k < kInV; ++k) a[u][k] = Load(src + k);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        one(q + u * part, row[u], col[u], a[u]);
        col[u] += step_col;
        row[u] += step_row;
        if (col[u] >= ppr) {
          col[u] -= ppr;
          ++row[u];
        }
      }
    }
    for (uint32_t p = kU * part + threadIdx.x; p < ch.pairs; p += kThreads) {
      const uint32_t r = p / ppr, cl = p - r * ppr;
      uint4 a[kInV];
      const uint4* src =
          reinterpret_cast<const uint4*>(ch.in + r * ch.in_stride + cl * 1ull * kInPair);
#pragma unroll
      for (int k = 0; k < kInV; ++k) a[k] = Load(src + k);
      one(p, r, cl, a);
    }
    WarpAdd(acc, &sums[ch.bucket]);
    WarpAdd(acc + ldelta, landed[ch.bucket]);
  }
}

}  // namespace

LeanFn PickLean(int cast) { return cast == 1 ? &LeanPackKernel<1, 2, 4> : nullptr; }

std::optional<LeanChunk> ToLean(const Chunk& c, const Desc& d, const Seg& seg, int in_size,
                                int wire_size) {
  if (c.seg1 - c.seg0 != 1) return std::nullopt;
  const int64_t a = d.wire_offset + c.e0 * wire_size, b = d.wire_offset + c.e1 * wire_size;
  if (a % 16 != 0 || (b - a) % 16 != 0 || b <= a || (b - a) / 16 > INT32_MAX) return std::nullopt;
  LeanChunk l{};
  l.landed = seg.p + (a - seg.lo);
  if (reinterpret_cast<uintptr_t>(l.landed) % 16 != 0 || b > seg.hi) return std::nullopt;
  l.pairs = static_cast<uint32_t>((b - a) / 16);
  l.word0 = static_cast<uint64_t>(a / 8);
  l.bucket = d.bucket;
  const int in_pair = 16 / wire_size * in_size;
  if (d.flags == 3) {
    l.in = d.in + c.e0 * in_size;
    l.out = d.out + c.e0 * wire_size;
    l.ppr = l.pairs;
    l.in_stride = static_cast<int64_t>(l.pairs) * in_pair;
    l.out_stride = static_cast<int64_t>(l.pairs) * 16;
  } else if (c.pad == 1) {
    const int64_t row_wire = d.row_elems * wire_size;
    if (row_wire % 16 != 0 || c.e0 % d.row_elems != 0 || (c.e1 - c.e0) % d.row_elems != 0)
      return std::nullopt;
    const int64_t r0 = c.e0 / d.row_elems;
    l.in = d.in + r0 * d.in_stride * in_size;
    l.out = d.out + r0 * d.out_stride * wire_size;
    l.ppr = static_cast<uint32_t>(row_wire / 16);
    l.in_stride = d.in_stride * in_size;
    l.out_stride = d.out_stride * wire_size;
  } else {
    return std::nullopt;
  }
  if (reinterpret_cast<uintptr_t>(l.in) % 16 != 0 || reinterpret_cast<uintptr_t>(l.out) % 16 != 0 ||
      l.in_stride % 16 != 0 || l.out_stride % 16 != 0 || l.ppr == 0) {
    return std::nullopt;
  }
  return l;
}

}  // namespace shardsync::gpu::kernels
