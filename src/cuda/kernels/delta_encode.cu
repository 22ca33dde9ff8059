// The delta encoder on the device (delta_gpu.h): the bytes EncodeDelta (delta.cc) writes.
//
// No pass waits on another block: a reduce-then-scan, not a single-pass scan with look-back.
// Pass 1 (EncodeTileKernel, one tile per block, no inter-block dependency): reads base and next
// once, adds both checksum sums, writes the tile's bitmap bytes straight into `out` (their place
// in the bitmap form does not depend on other tiles), counts the tile's changes and stages them
// in scratch: the values packed in element order at a place taken from a global allocator (one
// atomic per tile), and, while the index form can still win, the indices (element within the
// tile, 2 bytes). The last block to finish (a ticket) scans the tiles' counts into offsets,
// applies the size rule (delta_rule.h, shared with the host), writes the header and the result.
// Pass 2 (EncodeWriteKernel, a warp per tile): moves each tile's staged changes to their place:
// bitmap form, the packed values after the bitmap (a tile that found no staging room re-reads
// its base and next); index form, the records (over the bitmap's bytes). Nothing for kFull.
// Traffic: base and next read once, the bitmap written once, the changes written twice and read
// once (plus 2 bytes per change of staged indices while the index form can win).
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
  uint64_t positions;     // most changes the index form can hold: bitmap_bytes / 4
  uint64_t val_cap;       // values the scratch can stage (elements)
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

// The last block of the tile pass: tile offsets, size rule, header, result, control at rest.
template <int E>
__device__ void EncodeFinish(const EncArgs& a, uint64_t* smem) {
  const uint64_t total = ScanTiles(a.s.tile, a.tiles, smem);
  if (threadIdx.x != 0) return;
  const DeltaSize size = DeltaSizeRule(a.elements, E, total);
  Ctl* c = a.s.ctl;
  HostResult* r = a.s.result;
  const bool full = size.kind == DeltaKind::kFull;
  const uint64_t sum_a = atomicAdd(&c->sum_a, 0ull), sum_b = atomicAdd(&c->sum_b, 0ull);
  const uint64_t base_sum = full ? 0 : ChecksumFinish(sum_a, a.n);
  const uint64_t new_sum = full ? 0 : ChecksumFinish(sum_b, a.n);
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
  c->go = static_cast<unsigned long long>(size.kind);
  c->changed = total;
  r->code = kOk;
  r->kind = static_cast<unsigned long long>(size.kind);
  r->changed = total;
  r->bytes = full ? 0 : size.bytes;
  r->elements = a.elements;
  r->base_checksum = base_sum;
  r->new_checksum = new_sum;
  c->sum_a = 0;
  c->sum_b = 0;
  c->val_alloc = 0;
  c->idx_alloc = 0;
  c->ticket = 0;
  __threadfence_system();  // the pinned result, before the host sees the stream pass
}

template <int E>
__global__ void __launch_bounds__(kThreads, kMinBlocks) EncodeTileKernel(EncArgs a) {
  static_assert(kTileVecs <= 4, "per-vector counts are packed 16 bits apart in one word");
  constexpr uint64_t kTileElems = kTileBytes / E;
  static_assert(kTileElems <= 65536, "staged indices are 16-bit");
  __shared__ uint64_t s_scan[3][kWarps];
  __shared__ uint32_t s_vo, s_io;
  __shared__ bool s_last;
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
  // The bitmap form's bytes, at their place (inside the bucket's size: a larger form is kFull).
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    const uint64_t jb = o / E / 8;
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
  }
  // One exchange: the count scan within the tile and the two checksum sums.
  uint64_t v[3] = {cnt, sb, sx}, tot[3];
  BlockScanN<3>(v, tot, s_scan);
  const uint64_t ex = v[0], tot_c = tot[0];
  uint32_t aggregate = 0;
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k)
    aggregate += static_cast<uint32_t>((tot_c >> (16 * k)) & 0xffff);
  Ctl* c = a.s.ctl;
  if (threadIdx.x == 0) {
    atomicAdd(&c->sum_a, static_cast<unsigned long long>(tot[1]));
    atomicAdd(&c->sum_b, static_cast<unsigned long long>(tot[2]));
    uint32_t vo = kNoSlot, io = kNoSlot;
    if (aggregate > 0) {
      const uint64_t vv = atomicAdd(&c->val_alloc, static_cast<unsigned long long>(aggregate));
      const uint64_t ii = atomicAdd(&c->idx_alloc, static_cast<unsigned long long>(aggregate));
      if (vv + aggregate <= a.val_cap) vo = static_cast<uint32_t>(vv);
      // Every tile finds room when the total fits the index form: staged indices never miss.
      if (ii + aggregate <= a.positions) io = static_cast<uint32_t>(ii);
    }
    a.s.tile[tile] = aggregate;
    a.s.voff[tile] = vo;
    a.s.ioff[tile] = io;
    s_vo = vo;
    s_io = io;
  }
  __syncthreads();
  const uint32_t vo = s_vo, io = s_io;
  if (vo != kNoSlot || io != kNoSlot) {
    uint64_t pos = 0;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      uint64_t at = pos + ((ex >> (16 * k)) & 0xffff);
      pos += (tot_c >> (16 * k)) & 0xffff;
      const uint32_t local0 = static_cast<uint32_t>((uint64_t{kThreads} * k + threadIdx.x) * 16 / E);
      for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++at) {
        const int r = __ffs(mm) - 1;
        if (vo != kNoSlot) StoreElem<E>(a.s.vals + (vo + at) * E, Extract<E>(x[k], r), true);
        if (io != kNoSlot) a.s.idx[io + at] = static_cast<uint16_t>(local0 + r);
      }
    }
  }
  // The last block scans the counts (they are fenced before the ticket).
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(&c->ticket, 1u) == a.tiles - 1;
  }
  __syncthreads();
  if (s_last) EncodeFinish<E>(a, s_scan[0]);
}

// One warp re-reads tile t of base and next and writes its changed values from out offset
// `dst` (the bitmap form's values of a tile that found no staging room).
template <int E>
__device__ void RecomputeTile(const EncArgs& a, uint32_t t, unsigned char* dst, bool aligned,
                              int lane) {
  constexpr int kSteps = 4;  // vectors per lane in flight
  const uint64_t v_end = min((static_cast<uint64_t>(t) + 1) * kThreads * kTileVecs, (a.n + 15) / 16);
  uint64_t run = 0;
  for (uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs; v0 < v_end;
       v0 += 32 * kSteps) {
    uint4 b[kSteps], x[kSteps];
#pragma unroll
    for (int q = 0; q < kSteps; ++q) {
      const uint64_t o = (v0 + 32 * q + lane) * 16;
      b[q] = o < a.n ? LoadVec(a.base, o, a.n) : make_uint4(0, 0, 0, 0);
      x[q] = o < a.n ? LoadVec(a.next, o, a.n) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int q = 0; q < kSteps; ++q) {
      const unsigned m = ChangedMask<E>(b[q], x[q]);
      uint32_t inc = __popc(m);
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
      }
      uint64_t at = run + inc - __popc(m);
      run += __shfl_sync(0xffffffffu, inc, 31);
      for (unsigned mm = m; mm != 0; mm &= mm - 1, ++at)
        StoreElem<E>(dst + at * E, Extract<E>(x[q], __ffs(mm) - 1), aligned);
    }
  }
}

template <int E>
__global__ void __launch_bounds__(kThreads) EncodeWriteKernel(EncArgs a) {
  const Ctl* c = a.s.ctl;
  const auto kind = static_cast<DeltaKind>(c->go);
  if (kind == DeltaKind::kFull) return;
  constexpr uint64_t kTileElems = kTileBytes / E;
  constexpr uint64_t kRecord = kDeltaIndexBytes + E;
  const int lane = threadIdx.x & 31;
  const uint64_t vals_off = kDeltaHeaderBytes + a.bitmap_bytes;
  const bool aligned = vals_off % E == 0;
  const uint32_t warps = gridDim.x * kWarps;
  for (uint32_t t = blockIdx.x * kWarps + (threadIdx.x >> 5); t < a.tiles; t += warps) {
    const uint32_t p0 = a.s.tile[t], p1 = a.s.tile[t + 1];
    const uint32_t vo = a.s.voff[t], io = a.s.ioff[t];
    const uint32_t cnt = p1 - p0;
    if (cnt == 0) continue;
    if (kind == DeltaKind::kBitmap) {
      if (vo != kNoSlot) {
        WarpCopy(a.out + vals_off + uint64_t{p0} * E, a.s.vals + uint64_t{vo} * E,
                 uint64_t{cnt} * E, lane);
      } else {
        RecomputeTile<E>(a, t, a.out + vals_off + uint64_t{p0} * E, aligned, lane);
      }
      continue;
    }
    // Index form: the total fits, so every tile staged its indices and values (io, vo valid).
    for (uint32_t j = lane; j < cnt; j += 32) {
      unsigned char* p = a.out + kDeltaHeaderBytes + (uint64_t{p0} + j) * kRecord;
      const uint32_t i = static_cast<uint32_t>(t * kTileElems + a.s.idx[io + j]);
      if constexpr (E == 4) {
        reinterpret_cast<uint32_t*>(p)[0] = i;
        reinterpret_cast<uint32_t*>(p)[1] =
            reinterpret_cast<const uint32_t*>(a.s.vals)[uint64_t{vo} + j];
      } else if constexpr (E == 2) {
        auto* q = reinterpret_cast<unsigned short*>(p);
        q[0] = static_cast<unsigned short>(i);
        q[1] = static_cast<unsigned short>(i >> 16);
        q[2] = reinterpret_cast<const unsigned short*>(a.s.vals)[uint64_t{vo} + j];
      } else {
#pragma unroll
        for (int b = 0; b < 4; ++b) p[b] = static_cast<unsigned char>(i >> (8 * b));
        p[4] = a.s.vals[uint64_t{vo} + j];
      }
    }
  }
}

template <int E>
int Launch(const EncArgs& a, int sm_count, cudaStream_t s) {
  EncodeTileKernel<E><<<a.tiles, kThreads, 0, s>>>(a);
  const uint32_t write_blocks =
      min((a.tiles + kWarps - 1) / kWarps, static_cast<uint32_t>((sm_count > 0 ? sm_count : 132) * 8));
  EncodeWriteKernel<E><<<write_blocks, kThreads, 0, s>>>(a);
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
  a.val_cap = min(s.vals_bytes / static_cast<uint64_t>(element_size), a.elements);
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
