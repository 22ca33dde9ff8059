// Internal: what the device delta encoder's passes share (delta_encode.cu has the overview): the
// launch shape, the arguments, element access in 16-byte vectors, and the packed form's part of
// the write pass.
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels/delta_device.cuh"

namespace shardsync::gpu::delta {
namespace {

// Tile pass: 256 threads, kEncStages tiles of base and next in shared memory (one worked on, the
// other in flight), three blocks per SM.
inline constexpr int kEncMinBlocks = 3;
inline constexpr uint32_t kEncStages = 2;
inline constexpr uint32_t kEncSmem = kEncStages * 2 * kTileBytes;  // dynamic shared memory
// Write pass: blocks per range, and the most tiles a range may hold (its offsets in shared memory).
inline constexpr uint32_t kWriteSplit = 2;
inline constexpr uint32_t kMaxRangeTiles = 4096;

struct EncArgs {
  const unsigned char* base;
  unsigned char* advance;  // null, or base: the vectors that differ get next's bytes
  const unsigned char* next;
  unsigned char* out;
  uint64_t n;  // bucket bytes
  uint64_t elements;
  uint64_t bitmap_bytes;  // ceil(elements / 8)
  uint64_t base_version;
  uint32_t tiles;
  uint32_t ranges;  // blocks of the tile pass
  ScratchPtrs s;
};

// Tiles [lo, hi) of range r, and where its staging starts (values and indices, in elements).
struct Range {
  uint32_t lo, hi;
  uint64_t vbase, vcap, ibase, icap;
};
template <int E>
__device__ __forceinline__ Range RangeOf(const EncArgs& a, uint32_t r) {
  constexpr uint64_t kTileElems = kTileBytes / E;
  Range g;
  g.lo = static_cast<uint32_t>(uint64_t{a.tiles} * r / a.ranges);
  g.hi = static_cast<uint32_t>(uint64_t{a.tiles} * (r + 1) / a.ranges);
  g.vbase = uint64_t{g.lo} * (kTileElems / kStageDivisor);
  g.vcap = uint64_t{g.hi - g.lo} * (kTileElems / kStageDivisor);
  g.ibase = uint64_t{g.lo} * (kTileElems / kIndexDivisor);
  g.icap = uint64_t{g.hi - g.lo} * (kTileElems / kIndexDivisor);
  return g;
}

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

// Where the tile pass leaves tile t's subtile count number `local`: its threads' groups g (8E
// consecutive threads, a subtile of each of the kTileVecs vectors) each write one word, vector
// k's subtile k x groups + g in byte k.
template <int E>
__device__ __forceinline__ uint64_t SubtileSlot(uint64_t t, uint64_t local) {
  constexpr uint64_t kGroups = kThreads / (8 * E);
  return t * kSubtilesPerTile + local % kGroups * 4 + local / kGroups;
}

template <int E>
__device__ __forceinline__ uint32_t StagedValue(const unsigned char* vals, uint64_t k) {
  if constexpr (E == 1) {
    return vals[k];
  } else if constexpr (E == 2) {
    return reinterpret_cast<const uint16_t*>(vals)[k];
  } else {
    return reinterpret_cast<const uint32_t*>(vals)[k];
  }
}

// Packed form (element size 1 or 2): one warp writes tile t's changes from change number p0 and
// escape number e0: offsets within their subtile and value bytes (delta_rule.h), the escapes'
// values; from staging when the tile found room, else by re-reading its base and next.
template <int E>
__device__ void WritePackedTile(const EncArgs& a, const DeltaPackedLayout& pl, uint32_t t,
                                uint64_t p0, uint32_t cnt, uint64_t e0, uint32_t vo, uint32_t io,
                                int lane) {
  constexpr uint64_t kTileElems = kTileBytes / E;
  unsigned char* pay = a.out + kDeltaHeaderBytes;
  unsigned char* offs = pay + pl.offsets;
  unsigned char* vals = pay + pl.values;
  uint16_t* escs = reinterpret_cast<uint16_t*>(pay + pl.escapes);
  const unsigned below = (1u << lane) - 1;
  uint64_t erun = e0;
  if (vo != kNoSlot && io != kNoSlot) {
    for (uint32_t j0 = 0; j0 < cnt; j0 += 32) {
      const uint32_t j = j0 + lane;
      bool esc = false;
      if (j < cnt) {
        offs[p0 + j] = static_cast<unsigned char>(a.s.idx[uint64_t{io} + j] % kDeltaSubtileElems);
        const unsigned char vb = E == 1 ? a.s.vals[uint64_t{vo} + j] : a.s.pv[uint64_t{vo} + j];
        vals[p0 + j] = vb;
        esc = E == 2 && vb == kDeltaEscape;
      }
      if constexpr (E == 2) {
        const unsigned bal = __ballot_sync(0xffffffffu, esc);
        if (esc)
          escs[erun + __popc(bal & below)] =
              static_cast<uint16_t>(StagedValue<E>(a.s.vals, uint64_t{vo} + j));
        erun += __popc(bal);
      }
    }
    return;
  }
  constexpr int kSteps = 4;  // vectors per lane in flight
  const uint64_t v_end = min((uint64_t{t} + 1) * kThreads * kTileVecs, (a.n + 15) / 16);
  const uint64_t el0 = uint64_t{t} * kTileElems;
  uint64_t run = p0;
  for (uint64_t v0 = uint64_t{t} * kThreads * kTileVecs; v0 < v_end; v0 += 32 * kSteps) {
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
      unsigned em = 0;
      if constexpr (E == 2)
        for (unsigned mm = m; mm != 0; mm &= mm - 1) {
          const int r = __ffs(mm) - 1;
          if (DeltaEscaped(Extract<E>(b[q], r), Extract<E>(x[q], r))) em |= 1u << r;
        }
      // Changes and escapes before this lane's vector, packed 16 bits apart.
      uint32_t inc = __popc(m) | __popc(em) << 16;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
      }
      const uint32_t mine = __popc(m) | __popc(em) << 16;
      uint64_t at = run + ((inc - mine) & 0xffff), eat = erun + ((inc - mine) >> 16);
      const uint32_t all = __shfl_sync(0xffffffffu, inc, 31);
      run += all & 0xffff;
      erun += all >> 16;
      const uint64_t i0 = (v0 + 32 * q + lane) * 16 / E;
      for (unsigned mm = m; mm != 0; mm &= mm - 1, ++at) {
        const int r = __ffs(mm) - 1;
        const uint32_t nv = Extract<E>(x[q], r);
        offs[at] = static_cast<unsigned char>((i0 + r - el0) % kDeltaSubtileElems);
        unsigned char vb = static_cast<unsigned char>(nv);
        if constexpr (E == 2) {
          if (em >> r & 1u) {
            vb = kDeltaEscape;
            escs[eat++] = static_cast<uint16_t>(nv);
          } else {
            vb = DeltaByte(Extract<E>(b[q], r), nv);
          }
        }
        vals[at] = vb;
      }
    }
  }
}

// The packed form's part of the write pass for range rg (kWriteSplit blocks, this one `part`):
// the running counts and the escapes', the subtile counts, and the changes (delta.h "Encoded
// form"); s_p / s_e: the running counts before each of the range's tiles and after its last.
template <int E>
__device__ void WritePackedRange(const EncArgs& a, const Range& g, uint32_t nt, uint32_t rg,
                                 uint32_t part, const uint32_t* s_p, const uint32_t* s_e,
                                 bool staged, uint64_t total, uint64_t escapes) {
  const DeltaPackedLayout pl = DeltaPackedPayload(a.elements, E, total, escapes);
  unsigned char* pay = a.out + kDeltaHeaderBytes;
  constexpr uint64_t kSpt = kTileBytes / E / kDeltaSubtileElems;
  if (part == 0) {
    // The running counts (and escapes') through each of the range's tiles; block 0: the
    // padding byte before the escapes.
    auto* ends = reinterpret_cast<uint32_t*>(pay);
    auto* eends = reinterpret_cast<uint32_t*>(pay + pl.escape_ends);
    for (uint32_t i = threadIdx.x; i < nt; i += kThreads) {
      ends[g.lo + i] = s_p[i + 1];
      if constexpr (E == 2) eends[g.lo + i] = s_e[i + 1];
    }
    if (rg == 0 && threadIdx.x == 0 && pl.escapes > pl.values + total) pay[pl.values + total] = 0;
  }
  // The range's subtile counts, from the tile pass's.
  const uint64_t sb0 = uint64_t{g.lo} * kSpt, sb1 = min(uint64_t{g.hi} * kSpt, pl.subtiles);
  for (uint64_t sb = sb0 + part * kThreads + threadIdx.x; sb < sb1; sb += kWriteSplit * kThreads)
    pay[pl.subs + sb] = a.s.subc[SubtileSlot<E>(sb / kSpt, sb % kSpt)];
  const int lane = threadIdx.x & 31;
  const uint32_t w0 = part * kWarps + (threadIdx.x >> 5);
  if (staged && s_p[nt] > s_p[0]) {
    // The range's offsets and value bytes are as contiguous in staging as in `out`: the
    // offsets reduced to their subtile, the value bytes copied; then the escapes, a warp per
    // tile that has any.
    uint32_t fi = 0;
    while (s_p[fi + 1] == s_p[fi]) ++fi;
    const uint64_t vo = a.s.voff[g.lo + fi], io = a.s.ioff[g.lo + fi];
    const uint64_t p_lo = s_p[0], changes = s_p[nt] - p_lo;
    const uint64_t from = changes * part / kWriteSplit, to = changes * (part + 1) / kWriteSplit;
    unsigned char* offs = pay + pl.offsets + p_lo;
    // A batch of loads before its stores (the compiler may not reorder a load past a store
    // it cannot prove apart).
    constexpr int kBatch = 8;
    for (uint64_t j0 = from + threadIdx.x; j0 < to; j0 += kBatch * kThreads) {
      uint16_t v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const uint64_t j = j0 + uint64_t{kThreads} * u;
        v[u] = j < to ? a.s.idx[io + j] : 0;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const uint64_t j = j0 + uint64_t{kThreads} * u;
        if (j < to) offs[j] = static_cast<unsigned char>(v[u] % kDeltaSubtileElems);
      }
    }
    BlockCopy(pay + pl.values + p_lo + from, (E == 1 ? a.s.vals : a.s.pv) + vo + from, to - from);
    if constexpr (E == 2) {
      uint16_t* escs = reinterpret_cast<uint16_t*>(pay + pl.escapes);
      const unsigned below = (1u << lane) - 1;
      for (uint32_t i = w0; i < nt; i += kWriteSplit * kWarps) {
        if (s_e[i + 1] == s_e[i]) continue;
        const uint64_t tv = a.s.voff[g.lo + i];
        const uint32_t c = s_p[i + 1] - s_p[i];
        uint64_t erun = s_e[i];
        for (uint32_t j0 = 0; j0 < c; j0 += 32) {
          const uint32_t j = j0 + lane;
          const bool esc = j < c && a.s.pv[tv + j] == kDeltaEscape;
          const unsigned bal = __ballot_sync(0xffffffffu, esc);
          if (esc)
            escs[erun + __popc(bal & below)] =
                static_cast<uint16_t>(StagedValue<E>(a.s.vals, tv + j));
          erun += __popc(bal);
        }
      }
    }
    return;
  }
  for (uint32_t i = w0; i < nt; i += kWriteSplit * kWarps) {
    const uint32_t c = s_p[i + 1] - s_p[i];
    if (c == 0) continue;
    const uint32_t t = g.lo + i;
    WritePackedTile<E>(a, pl, t, s_p[i], c, E == 2 ? s_e[i] : 0, a.s.voff[t], a.s.ioff[t], lane);
  }
  return;
}

}  // namespace
}  // namespace shardsync::gpu::delta
