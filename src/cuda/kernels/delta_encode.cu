// The delta encoder on the device (delta_gpu.h): the bytes EncodeDelta (delta.cc) writes.
//
// Pass 1 (EncodeScanKernel, one tile per block): reads base and next once, adds both checksum
// sums, and, with each tile's output offset from a single-pass scan (decoupled look-back over
// tile states), writes the bitmap form straight into `out` (the bitmap, then the changed values
// from offset 48 + bitmap bytes) and stages the index form (indices and values, as far as the
// index form can reach: 4 x count <= bitmap bytes) in scratch. The form is only known once every
// tile is counted, so both are written; the staged index form is small by construction.
// Pass 2 (EncodeFinishKernel): the size rule (delta_rule.h, shared with the host) on the total
// count picks the form; block 0 writes the header and the result; when the index form won, the
// grid writes the records over the bitmap form's bytes.
#include <cuda_runtime.h>

#include "cuda/kernels/delta_device.cuh"

namespace shardsync::gpu::delta {
namespace {

struct EncArgs {
  const unsigned char* base;
  const unsigned char* next;
  unsigned char* out;
  uint64_t n;  // bucket bytes
  uint64_t elements;
  uint64_t bitmap_bytes;  // ceil(elements / 8)
  uint64_t positions;     // index-form positions staged: bitmap_bytes / 4
  uint64_t base_version;
  uint32_t tiles;
  ScratchPtrs s;
};

__device__ __forceinline__ uint32_t Comp(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Bit r set when element r of the 16-byte vectors differs.
template <int E>
__device__ __forceinline__ unsigned ChangedMask(const uint4& a, const uint4& b) {
  unsigned m = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t x = Comp(a, i), y = Comp(b, i);
    if constexpr (E == 1) {
      // 0xff per differing byte; gather bits 0, 8, 16, 24 to bits 21..24.
      const uint32_t r = __vcmpne4(x, y) & 0x01010101u;
      m |= ((r * 0x00204081u) >> 21 & 0xfu) << (4 * i);
    } else if constexpr (E == 2) {
      const uint32_t r = __vcmpne2(x, y);
      m |= ((r & 1u) | (r >> 15 & 2u)) << (2 * i);
    } else {
      m |= unsigned{x != y} << i;
    }
  }
  return m;
}

template <int E>
__device__ __forceinline__ uint32_t Extract(const uint4& v, int r) {
  const uint32_t w = Comp(v, r * E / 4);
  if constexpr (E == 4) {
    return w;
  } else {
    return (w >> (8 * (r * E % 4))) & ((1u << (8 * E)) - 1);
  }
}

template <int E>
__device__ __forceinline__ void StoreElem(unsigned char* p, uint32_t v, bool aligned) {
  if constexpr (E == 1) {
    *p = static_cast<unsigned char>(v);
  } else {
    if (aligned) {
      if constexpr (E == 2) {
        *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(v);
      } else {
        *reinterpret_cast<uint32_t*>(p) = v;
      }
    } else {
#pragma unroll
      for (int i = 0; i < E; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
    }
  }
}

template <int E>
__global__ void __launch_bounds__(kThreads, kMinBlocks) EncodeScanKernel(EncArgs a) {
  static_assert(kTileVecs <= 4, "per-vector counts are packed 16 bits apart in one word");
  __shared__ uint64_t s_scan[3][kWarps];
  __shared__ uint32_t s_prefix;
  // Tile ids in launch order, as CUB's single-pass scans take them: blocks are dispatched in
  // increasing order, so a tile's predecessors are running or done and the look-back ends.
  const uint32_t tile = blockIdx.x;
  const uint64_t v0 = static_cast<uint64_t>(tile) * kThreads * kTileVecs + threadIdx.x;
  const uint64_t n = a.n;

  uint4 b[kTileVecs], x[kTileVecs];
  if ((static_cast<uint64_t>(tile) + 1) * kTileBytes <= n) {  // every load in flight at once
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      b[k] = __ldcs(reinterpret_cast<const uint4*>(a.base + o));
      x[k] = __ldcs(reinterpret_cast<const uint4*>(a.next + o));
    }
  } else {
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      b[k] = make_uint4(0, 0, 0, 0);
      x[k] = b[k];
      if (o < n) {
        b[k] = LoadVec(a.base, o, n);
        x[k] = LoadVec(a.next, o, n);
      }
    }
  }
  const uint64_t epoch = *reinterpret_cast<volatile unsigned long long*>(&a.s.ctl->epoch);
  uint64_t sb = 0, sx = 0, cnt = 0;
  unsigned m[kTileVecs];
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    if (o < n) {
      sb += Mix(Lo64(b[k]), o / 8);
      sx += Mix(Lo64(x[k]), o / 8);
      if (o + 8 < n) {
        sb += Mix(Hi64(b[k]), o / 8 + 1);
        sx += Mix(Hi64(x[k]), o / 8 + 1);
      }
    }
    m[k] = ChangedMask<E>(b[k], x[k]);
    // Per-vector counts packed 16 bits apart (a segment's total is at most 256 x 16).
    cnt |= static_cast<uint64_t>(__popc(m[k])) << (16 * k);
  }
  // One exchange: the count scan and the two checksum sums.
  uint64_t v[3] = {cnt, sb, sx}, tot[3];
  BlockScanN<3>(v, tot, s_scan);
  const uint64_t ex = v[0], tot_c = tot[0];
  uint32_t aggregate = 0;
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k)
    aggregate += static_cast<uint32_t>((tot_c >> (16 * k)) & 0xffff);
  if (threadIdx.x == 0) {
    atomicAdd(&a.s.ctl->sum_a, static_cast<unsigned long long>(tot[1]));
    atomicAdd(&a.s.ctl->sum_b, static_cast<unsigned long long>(tot[2]));
  }
  if (threadIdx.x < 32) {
    const uint32_t p = LookBack(a.s.states, tile, aggregate, epoch);
    if (threadIdx.x == 0) s_prefix = p;
  }
  __syncthreads();

  // Writes: bitmap bytes and values of the bitmap form (inside the bucket's size: a larger form
  // is kFull), staged index records (while the index form can still win).
  const uint64_t vals_off = kDeltaHeaderBytes + a.bitmap_bytes;
  const bool aligned = vals_off % E == 0;
  uint64_t pos = s_prefix;
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t seg_tot = (tot_c >> (16 * k)) & 0xffff;
    uint64_t at = pos + ((ex >> (16 * k)) & 0xffff);
    pos += seg_tot;
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    const uint64_t elem0 = o / E;
    const uint64_t jb = elem0 / 8;
    if constexpr (E == 4) {
      const unsigned partner = __shfl_down_sync(0xffffffffu, m[k], 1);
      if ((threadIdx.x & 1) == 0 && o < n && kDeltaHeaderBytes + jb < n)
        a.out[kDeltaHeaderBytes + jb] = static_cast<unsigned char>(m[k] | partner << 4);
    } else if (o < n) {
      if (kDeltaHeaderBytes + jb < n)
        a.out[kDeltaHeaderBytes + jb] = static_cast<unsigned char>(m[k]);
      if constexpr (E == 1) {
        if (jb + 1 < a.bitmap_bytes && kDeltaHeaderBytes + jb + 1 < n)
          a.out[kDeltaHeaderBytes + jb + 1] = static_cast<unsigned char>(m[k] >> 8);
      }
    }
    for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++at) {
      const int r = __ffs(mm) - 1;
      const uint32_t v = Extract<E>(x[k], r);
      const uint64_t off = vals_off + at * E;
      if (off + E <= n) StoreElem<E>(a.out + off, v, aligned);
      if (at < a.positions) {
        a.s.idx[at] = static_cast<uint32_t>(elem0 + r);
        StoreElem<E>(a.s.vals + at * E, v, true);
      }
    }
  }
}

template <int E>
__global__ void __launch_bounds__(kThreads) EncodeFinishKernel(EncArgs a) {
  const uint64_t total = static_cast<uint32_t>(LoadState(&a.s.states[a.tiles - 1]));
  const DeltaSize size = DeltaSizeRule(a.elements, E, total);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    Ctl* c = a.s.ctl;
    HostResult* r = a.s.result;
    const bool full = size.kind == DeltaKind::kFull;
    const uint64_t base_sum = full ? 0 : ChecksumFinish(c->sum_a, a.n);
    const uint64_t new_sum = full ? 0 : ChecksumFinish(c->sum_b, a.n);
    if (!full) {
      unsigned char* h = a.out;
      *reinterpret_cast<uint32_t*>(h) = kMagic;
      h[4] = kFormat;
      h[5] = static_cast<unsigned char>(size.kind);
      h[6] = E;
      h[7] = 0;
      auto* w = reinterpret_cast<unsigned long long*>(h);
      w[1] = a.elements;
      w[2] = a.base_version;
      w[3] = base_sum;
      w[4] = new_sum;
      w[5] = total;
    }
    r->code = kOk;
    r->kind = static_cast<unsigned long long>(size.kind);
    r->changed = total;
    r->bytes = full ? 0 : size.bytes;
    r->elements = a.elements;
    r->base_checksum = base_sum;
    r->new_checksum = new_sum;
    c->sum_a = 0;
    c->sum_b = 0;
    c->tile_counter = 0;
    const uint64_t next_epoch = (c->epoch + 1) & kEpochMask;
    c->epoch = next_epoch == 0 ? 1 : next_epoch;
    __threadfence_system();  // the pinned result, before the host sees the stream pass
  }
  if (size.kind != DeltaKind::kIndex) return;
  constexpr uint64_t kRecord = kDeltaIndexBytes + E;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k < total;
       k += stride) {
    unsigned char* p = a.out + kDeltaHeaderBytes + k * kRecord;
    const uint32_t i = a.s.idx[k];
    if constexpr (E == 4) {
      reinterpret_cast<uint32_t*>(p)[0] = i;
      reinterpret_cast<uint32_t*>(p)[1] = reinterpret_cast<const uint32_t*>(a.s.vals)[k];
    } else if constexpr (E == 2) {
      auto* q = reinterpret_cast<unsigned short*>(p);
      q[0] = static_cast<unsigned short>(i);
      q[1] = static_cast<unsigned short>(i >> 16);
      q[2] = reinterpret_cast<const unsigned short*>(a.s.vals)[k];
    } else {
#pragma unroll
      for (int b = 0; b < 4; ++b) p[b] = static_cast<unsigned char>(i >> (8 * b));
      p[4] = a.s.vals[k];
    }
  }
}

template <int E>
int Launch(const EncArgs& a, int sm_count, cudaStream_t s) {
  EncodeScanKernel<E><<<a.tiles, kThreads, 0, s>>>(a);
  EncodeFinishKernel<E><<<(sm_count > 0 ? sm_count : 132) * 8, kThreads, 0, s>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LaunchEncode(const void* base, const void* next, uint64_t bytes, int element_size,
                 uint64_t base_version, void* out, const ScratchPtrs& s, int sm_count,
                 void* stream) {
  EncArgs a{};
  a.base = static_cast<const unsigned char*>(base);
  a.next = static_cast<const unsigned char*>(next);
  a.out = static_cast<unsigned char*>(out);
  a.n = bytes;
  a.elements = bytes / static_cast<uint64_t>(element_size);
  a.bitmap_bytes = DeltaBitmapBytes(a.elements);
  a.positions = a.bitmap_bytes / kDeltaIndexBytes;
  a.base_version = base_version;
  a.tiles = static_cast<uint32_t>((bytes + kTileBytes - 1) / kTileBytes);
  a.s = s;
  auto st = static_cast<cudaStream_t>(stream);
  switch (element_size) {
    case 1:
      return Launch<1>(a, sm_count, st);
    case 2:
      return Launch<2>(a, sm_count, st);
    default:
      return Launch<4>(a, sm_count, st);
  }
}

}  // namespace shardsync::gpu::delta
