// The delta encoder on the device (delta_gpu.h): the bytes EncodeDelta (delta.cc) writes.
//
// A reduce-then-scan: no block waits on another before its last step.
// Pass 1 (EncodeTileKernel): the bucket's tiles split into ranges of consecutive tiles, one range
// per block, as many blocks as fit the GPU at once; a block loads its next tile (base and next,
// 16 KiB each) before it works on the current one, so its loads stay in flight through the
// work. Per tile: both checksum sums, the bitmap form's bytes straight into `out` (their place
// does not depend on other tiles), the tile's change count, and its changes staged in the
// range's part of the scratch: values packed in element order and, while the range is within the
// index form's limit, indices (element within the tile, 2 bytes); the range's total count and the
// checksum sums at its end.
// Pass 2 (EncodeWriteKernel, a few blocks per range): each block sums the ranges' totals (the
// changes before its range, and the total, hence the form; block 0 writes the header and the
// result), scans its range's tile counts, and moves the range's staged changes to their place,
// which is contiguous for the range: bitmap form, the values after the bitmap (one copy
// with 16-byte stores); index form (over the bitmap's bytes), its tiles' running counts, then the
// offsets and the values, one copy each.
// A range that ran out of staging room re-reads those tiles (a warp per tile). Nothing for kFull.
// Traffic: base and next read once, the bitmap written once, the changes written twice and read
// once (plus 2 bytes per change of staged indices while a range can be in the index form).
#include <cuda_runtime.h>

#include "cuda/kernels/delta_encode.cuh"

namespace shardsync::gpu::delta {
namespace {

// Block 0 of the write pass: the header (unless kFull), the result, the control block at rest.
template <int E>
__device__ void EncodeFinish(const EncArgs& a, uint64_t total, uint64_t escapes,
                             const DeltaSize& size) {
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
  r->escapes = escapes;
  r->bytes = full ? 0 : size.bytes;
  r->elements = a.elements;
  r->base_checksum = base_sum;
  r->new_checksum = new_sum;
  c->sum_a = 0;
  c->sum_b = 0;
  __threadfence_system();  // the pinned result, before the host sees the stream pass
}

// The tile's 4 vectors of base and next per thread (zero past the bucket's end).
__device__ __forceinline__ void LoadTile(const EncArgs& a, uint32_t t, uint4 (&b)[kTileVecs],
                                         uint4 (&x)[kTileVecs]) {
  const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
  if ((static_cast<uint64_t>(t) + 1) * kTileBytes <= a.n) {
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
      b[k] = o < a.n ? LoadVec(a.base, o, a.n) : make_uint4(0, 0, 0, 0);
      x[k] = o < a.n ? LoadVec(a.next, o, a.n) : make_uint4(0, 0, 0, 0);
    }
  }
}

template <int E>
__global__ void __launch_bounds__(kThreads, kEncMinBlocks) EncodeTileKernel(EncArgs a) {
  static_assert(kTileVecs <= 4, "per-vector counts are packed 16 bits apart in one word");
  constexpr uint64_t kTileElems = kTileBytes / E;
  static_assert(kTileElems <= 65536, "staged indices are 16-bit");
  extern __shared__ __align__(128) unsigned char s_buf[];  // [stage][base, next][tile]
  __shared__ __align__(8) uint64_t s_bar[kEncStages];
  __shared__ uint64_t s_scan[2][kWarps];
  __shared__ uint32_t s_wesc[2][kWarps];  // element size 2: each warp's escapes, by tile parity
  const uint64_t n = a.n;
  const Range g = RangeOf<E>(a, blockIdx.x);
  // Whole tiles come through the copy engine, kEncStages in flight; the bucket's ragged last
  // tile, if any, is loaded by the threads.
  const uint32_t whole_hi = min(g.hi, static_cast<uint32_t>(n / kTileBytes));
  auto issue = [&](uint32_t t) {  // one thread
    const uint32_t st = (t - g.lo) % kEncStages;
    unsigned char* dst = s_buf + st * 2 * kTileBytes;
    MbarExpect(&s_bar[st], 2 * kTileBytes);
    BulkLoad(dst, a.base + uint64_t{t} * kTileBytes, kTileBytes, &s_bar[st]);
    BulkLoad(dst + kTileBytes, a.next + uint64_t{t} * kTileBytes, kTileBytes, &s_bar[st]);
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < kEncStages; ++i) MbarInit(&s_bar[i], 1);
    MbarInitFence();
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (uint32_t t = g.lo; t < whole_hi && t < g.lo + kEncStages; ++t) issue(t);
  uint64_t vused = 0, iused = 0;  // the range's staging so far (the same in every thread)
  uint64_t rcount = 0;            // the range's changes so far
  uint64_t resc = 0;              // element size 2: the range's escaped changes so far
  uint64_t sb = 0, sx = 0;
  // Keys of this thread's first word in tile g.lo, then one tile on per iteration.
  constexpr uint64_t kKeyVec = uint64_t{kThreads} * 2 * kChecksumStep;  // 256 vectors on
  constexpr uint64_t kKeyTile = kTileBytes / 8 * kChecksumStep;
  uint64_t key0 = MixKey((static_cast<uint64_t>(g.lo) * kThreads * kTileVecs + threadIdx.x) * 2);
  for (uint32_t t = g.lo; t < g.hi; ++t, key0 += kKeyTile) {
    uint4 b[kTileVecs], x[kTileVecs];
    if (t < whole_hi) {
      const uint32_t i = t - g.lo, st = i % kEncStages;
      MbarWait(&s_bar[st], (i / kEncStages) & 1);
      const auto* vb = reinterpret_cast<const uint4*>(s_buf + st * 2 * kTileBytes);
      const uint4* vx = vb + kTileBytes / 16;
#pragma unroll
      for (int k = 0; k < kTileVecs; ++k) {
        b[k] = vb[k * kThreads + threadIdx.x];
        x[k] = vx[k * kThreads + threadIdx.x];
      }
      // The tile is in registers: refill its stage at once, so the copy has this tile's work and
      // the next one's to land. Without the fence the refill could land under a read still in
      // flight: on one H200 the encoder's base sums and counts then changed from run to run.
      FenceProxyAsync();
      __syncthreads();
      if (threadIdx.x == 0 && t + kEncStages < whole_hi) issue(t + kEncStages);
    } else {
      LoadTile(a, t, b, x);
    }
    const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
    uint64_t cnt = 0;
    unsigned m[kTileVecs];
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      // The word's checksum key (MixKey of word o / 8), stepped rather than multiplied.
      const uint64_t key = key0 + static_cast<uint64_t>(k) * kKeyVec;
      if (o < n) {
        sb += MixWithKey(Lo64(b[k]), key);
        sx += MixWithKey(Lo64(x[k]), key);
        if (o + 8 < n) {
          sb += MixWithKey(Hi64(b[k]), key + kChecksumStep);
          sx += MixWithKey(Hi64(x[k]), key + kChecksumStep);
        }
      }
      m[k] = ChangedMask<E>(b[k], x[k]);
      // Per-vector counts packed 16 bits apart (a segment's total is at most 256 x 16).
      cnt |= static_cast<uint64_t>(__popc(m[k])) << (16 * k);
    }
    // The packed form's subtile counts (128 elements: 8E vectors, as many consecutive threads):
    // the four vectors' counts a byte each (a subtile holds at most 128 changes), summed over
    // the subtile's threads at once, one word into the scratch (SubtileSlot).
    if constexpr (E != 4) {
      constexpr int kGroup = 8 * E;
      uint32_t c = 0;
#pragma unroll
      for (int k = 0; k < kTileVecs; ++k) c |= static_cast<uint32_t>(__popc(m[k])) << (8 * k);
#pragma unroll
      for (int o = kGroup / 2; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
      if ((threadIdx.x & (kGroup - 1)) == 0)
        reinterpret_cast<uint32_t*>(a.s.subc +
                                    uint64_t{t} * kSubtilesPerTile)[threadIdx.x / kGroup] = c;
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
    uint64_t tot_c = 0;
    const uint64_t ex = BlockExclusiveScan(cnt, &tot_c, s_scan[0]);
    uint32_t aggregate = 0;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k)
      aggregate += static_cast<uint32_t>((tot_c >> (16 * k)) & 0xffff);
    rcount += aggregate;
    if constexpr (E == 2) {
      // The tile before's escapes (its warps' counts, from its staging loop below, are visible
      // past this tile's scan).
      if (threadIdx.x == 0 && t > g.lo) {
        uint32_t e = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) e += s_wesc[(t - 1) & 1][w];
        a.s.etile[t - 1] = e;
        resc += e;
      }
    }
    // Staging room, decided alike in every thread (no atomics, no barrier).
    // A tile without changes gets a (empty) place too: kNoSlot means "found no room".
    uint32_t vo = kNoSlot, io = kNoSlot;
    if (vused + aggregate <= g.vcap) {
      vo = static_cast<uint32_t>(g.vbase + vused);
      vused += aggregate;
    }
    if (iused + aggregate <= g.icap) {
      io = static_cast<uint32_t>(g.ibase + iused);
      iused += aggregate;
    }
    if (threadIdx.x == 0) {
      a.s.tile[t] = aggregate;
      a.s.voff[t] = vo;
      a.s.ioff[t] = io;
    }
    if (a.advance != nullptr && vo != kNoSlot && io != kNoSlot) {
      // The base advanced in place while the tile is in registers (its copy landed before; no
      // copy in flight reads it). A tile that found no staging room may be re-read by the write
      // pass, so EncodeAdvanceRestKernel advances it after that.
#pragma unroll
      for (int k = 0; k < kTileVecs; ++k)
        if (m[k] != 0) StoreVec(a.advance, (v0 + uint64_t{kThreads} * k) * 16, n, x[k]);
    }
    // The changes staged; for element size 2 each one's packed value byte too, and the tile's
    // escaped changes (DeltaEscaped) counted, staged or not.
    uint32_t esc = 0;
    if (aggregate > 0 && (E == 2 || vo != kNoSlot || io != kNoSlot)) {
      uint64_t pos = 0;
#pragma unroll
      for (int k = 0; k < kTileVecs; ++k) {
        uint64_t at = pos + ((ex >> (16 * k)) & 0xffff);
        pos += (tot_c >> (16 * k)) & 0xffff;
        const uint32_t local0 =
            static_cast<uint32_t>((uint64_t{kThreads} * k + threadIdx.x) * 16 / E);
        for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++at) {
          const int r = __ffs(mm) - 1;
          const uint32_t nv = Extract<E>(x[k], r);
          unsigned char vb = 0;
          if constexpr (E == 2) {
            const uint32_t ov = Extract<E>(b[k], r);
            const bool escaped = DeltaEscaped(ov, nv);
            esc += escaped;
            vb = escaped ? kDeltaEscape : DeltaByte(ov, nv);
          }
          if (vo != kNoSlot) {
            StoreElem<E>(a.s.vals + (vo + at) * E, nv, true);
            if constexpr (E == 2) a.s.pv[vo + at] = vb;
          }
          if (io != kNoSlot) a.s.idx[io + at] = static_cast<uint16_t>(local0 + r);
        }
      }
    }
    if constexpr (E == 2) {
      esc = __reduce_add_sync(0xffffffffu, esc);
      if ((threadIdx.x & 31) == 0) s_wesc[t & 1][threadIdx.x >> 5] = esc;
    }
  }
  GridDepTrigger();  // the write pass may launch now (it waits for this pass to complete)
  uint64_t v[2] = {sb, sx}, tot[2];
  BlockScanN<2>(v, tot, s_scan);  // its barriers: the last tile's escapes visible
  if (threadIdx.x == 0) {
    if constexpr (E == 2) {
      if (g.hi > g.lo) {
        uint32_t e = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) e += s_wesc[(g.hi - 1) & 1][w];
        a.s.etile[g.hi - 1] = e;
        resc += e;
      }
    }
    atomicAdd(&a.s.ctl->sum_a, static_cast<unsigned long long>(tot[0]));
    atomicAdd(&a.s.ctl->sum_b, static_cast<unsigned long long>(tot[1]));
    a.s.rtot[blockIdx.x] = static_cast<uint32_t>(rcount);
    if constexpr (E == 2) a.s.etot[blockIdx.x] = static_cast<uint32_t>(resc);
  }
}

// Writes change number `at` of the encoding (value v of element `local` of its tile): the value
// at `vals_off` (the bitmap form's, or the index form's) and, for the index form, the element's
// u16 offset within its tile at `offs_off`.
template <int E, bool kIndex>
__device__ __forceinline__ void PutChange(unsigned char* out, uint64_t vals_off, uint64_t offs_off,
                                          bool aligned, uint64_t at, uint32_t local, uint32_t v) {
  StoreElem<E>(out + vals_off + at * E, v, aligned);
  if constexpr (kIndex)
    reinterpret_cast<uint16_t*>(out + offs_off)[at] = static_cast<uint16_t>(local);
}

// One warp writes tile t's changes from change number p0: from staging when the tile found room,
// else by re-reading its base and next.
template <int E, bool kIndex>
__device__ void WriteTile(const EncArgs& a, uint32_t t, uint64_t p0, uint32_t cnt, uint32_t vo,
                          uint32_t io, int lane, uint64_t total) {
  constexpr uint64_t kTileElems = kTileBytes / E;
  const DeltaIndexLayout il = DeltaIndexPayload(a.elements, E, total);
  const uint64_t vals_off = kDeltaHeaderBytes + (kIndex ? il.values : a.bitmap_bytes);
  const uint64_t offs_off = kDeltaHeaderBytes + il.offsets;
  const bool aligned = vals_off % E == 0;
  const uint64_t e0 = uint64_t{t} * kTileElems;
  if (vo != kNoSlot && (!kIndex || io != kNoSlot)) {
    for (uint32_t j = lane; j < cnt; j += 32)
      PutChange<E, kIndex>(a.out, vals_off, offs_off, aligned, p0 + j,
                           kIndex ? a.s.idx[uint64_t{io} + j] : 0,
                           StagedValue<E>(a.s.vals, uint64_t{vo} + j));
    return;
  }
  constexpr int kSteps = 4;  // vectors per lane in flight
  const uint64_t v_end = min((uint64_t{t} + 1) * kThreads * kTileVecs, (a.n + 15) / 16);
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
      uint32_t inc = __popc(m);
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
      }
      uint64_t at = run + inc - __popc(m);
      run += __shfl_sync(0xffffffffu, inc, 31);
      const uint32_t i0 = static_cast<uint32_t>((v0 + 32 * q + lane) * 16 / E);
      for (unsigned mm = m; mm != 0; mm &= mm - 1, ++at) {
        const int r = __ffs(mm) - 1;
        PutChange<E, kIndex>(a.out, vals_off, offs_off, aligned, at,
                             static_cast<uint32_t>(i0 + r - e0), Extract<E>(x[q], r));
      }
    }
  }
}

// kWriteSplit blocks per range of the tile pass. A range whose every tile found staging room is
// contiguous in staging and in `out`: one copy split among its blocks (bitmap form: the values;
// index form: the offsets and the values; its running counts from the range's scan). Otherwise
// a warp per tile.
template <int E>
__global__ void __launch_bounds__(kThreads, 4) EncodeWriteKernel(EncArgs a) {
  constexpr uint32_t kPer = (kMaxRangeTiles + kThreads - 1) / kThreads;
  __shared__ uint32_t s_p[kMaxRangeTiles + 1];
  __shared__ uint32_t s_e[E == 2 ? kMaxRangeTiles + 1 : 1];  // running escapes (element size 2)
  __shared__ uint64_t s_scan[4][kWarps];
  GridDepWait();  // the tile pass complete
  const uint32_t rg = blockIdx.x / kWriteSplit, part = blockIdx.x % kWriteSplit;
  const Range g = RangeOf<E>(a, rg);
  const uint32_t nt = g.hi - g.lo;
  // Every load first, all in flight at once: the range's tile counts (each thread a run of kPer,
  // for the scan), its staging marks, and the ranges' totals.
  uint32_t cnt[kPer], ecnt[kPer];
  uint64_t run = 0, erun = 0;
#pragma unroll
  for (uint32_t q = 0; q < kPer; ++q) {
    const uint32_t i = threadIdx.x * kPer + q;
    cnt[q] = i < nt ? a.s.tile[g.lo + i] : 0;
    ecnt[q] = E == 2 && i < nt ? a.s.etile[g.lo + i] : 0;
  }
  // Bitwise, so that no load waits on another (a short-circuit would chain them).
  bool vstaged = true, istaged = true;
#pragma unroll 4
  for (uint32_t i = threadIdx.x; i < nt; i += kThreads) {
    vstaged &= a.s.voff[g.lo + i] != kNoSlot;
    istaged &= a.s.ioff[g.lo + i] != kNoSlot;
  }
  // The changes before this block's range, and all of them (the form); the same for escapes.
  uint64_t v[4] = {0, 0, 0, 0}, tot[4];
  for (uint32_t i = threadIdx.x; i < a.ranges; i += kThreads) {
    const uint32_t x = a.s.rtot[i];
    v[0] += i < rg ? x : 0;
    v[1] += x;
    if constexpr (E == 2) {
      const uint32_t y = a.s.etot[i];
      v[2] += i < rg ? y : 0;
      v[3] += y;
    }
  }
#pragma unroll
  for (uint32_t q = 0; q < kPer; ++q) {
    run += cnt[q];
    erun += ecnt[q];
  }
  BlockScanN<4>(v, tot, s_scan);
  const uint64_t before = tot[0], total = tot[1], ebefore = tot[2], escapes = tot[3];
  const DeltaSize size = DeltaSizeRule(a.elements, E, total, escapes);
  if (blockIdx.x == 0 && threadIdx.x == 0) EncodeFinish<E>(a, total, escapes, size);
  if (size.kind == DeltaKind::kFull) return;
  const bool index = size.kind == DeltaKind::kIndex;
  // Index and packed forms need the offsets staged too.
  bool staged = vstaged && (size.kind == DeltaKind::kBitmap || istaged);
  uint64_t range_total = 0;
  uint64_t at = before + BlockExclusiveScan(run, &range_total, s_scan[0]);
#pragma unroll
  for (uint32_t q = 0; q < kPer; ++q) {
    const uint32_t i = threadIdx.x * kPer + q;
    if (i < nt) s_p[i] = static_cast<uint32_t>(at);
    at += cnt[q];
  }
  if (threadIdx.x == 0) s_p[nt] = static_cast<uint32_t>(before + range_total);
  if constexpr (E == 2) {
    if (size.kind == DeltaKind::kPacked) {
      uint64_t range_esc = 0;
      uint64_t eat = ebefore + BlockExclusiveScan(erun, &range_esc, s_scan[0]);
#pragma unroll
      for (uint32_t q = 0; q < kPer; ++q) {
        const uint32_t i = threadIdx.x * kPer + q;
        if (i < nt) s_e[i] = static_cast<uint32_t>(eat);
        eat += ecnt[q];
      }
      if (threadIdx.x == 0) s_e[nt] = static_cast<uint32_t>(ebefore + range_esc);
    }
  }
  staged = __syncthreads_and(staged);
  if (nt == 0) return;
  if constexpr (E != 4) {
    if (size.kind == DeltaKind::kPacked) {
      WritePackedRange<E>(a, g, nt, rg, part, s_p, s_e, staged, total, escapes);
      return;
    }
  }
  const DeltaIndexLayout il = DeltaIndexPayload(a.elements, E, total);
  if (index && part == 0) {
    // The running count through each of the range's tiles, and the zero padding after the
    // offsets (block 0).
    auto* ends = reinterpret_cast<uint32_t*>(a.out + kDeltaHeaderBytes);
    for (uint32_t i = threadIdx.x; i < nt; i += kThreads) ends[g.lo + i] = s_p[i + 1];
    if (rg == 0 && threadIdx.x == 0)
      for (uint64_t b = il.offsets + 2 * total; b < il.values; ++b)
        a.out[kDeltaHeaderBytes + b] = 0;
  }
  const uint64_t p_lo = s_p[0], p_hi = s_p[nt];
  if (staged && p_hi > p_lo) {
    // Staging starts at the range's first tile that has changes (earlier tiles staged nothing).
    uint32_t first = 0;
    while (s_p[first + 1] == s_p[first]) ++first;
    const uint64_t vo = a.s.voff[g.lo + first];
    const uint64_t changes = p_hi - p_lo;
    const uint64_t from = changes * part / kWriteSplit, to = changes * (part + 1) / kWriteSplit;
    if (!index) {
      BlockCopy(a.out + kDeltaHeaderBytes + a.bitmap_bytes + (p_lo + from) * E,
                a.s.vals + (vo + from) * E, (to - from) * E);
      return;
    }
    // Index form: the range's offsets and values are as contiguous in staging as in `out`.
    const uint64_t io = a.s.ioff[g.lo + first];
    BlockCopy(a.out + kDeltaHeaderBytes + il.offsets + (p_lo + from) * 2,
              reinterpret_cast<const unsigned char*>(a.s.idx + io + from), (to - from) * 2);
    BlockCopy(a.out + kDeltaHeaderBytes + il.values + (p_lo + from) * E, a.s.vals + (vo + from) * E,
              (to - from) * E);
    return;
  }
  const int lane = threadIdx.x & 31;
  for (uint32_t i = part * kWarps + (threadIdx.x >> 5); i < nt; i += kWriteSplit * kWarps) {
    const uint32_t cnt = s_p[i + 1] - s_p[i];
    if (cnt == 0) continue;
    const uint32_t t = g.lo + i;
    if (index) {
      WriteTile<E, true>(a, t, s_p[i], cnt, a.s.voff[t], a.s.ioff[t], lane, total);
    } else {
      WriteTile<E, false>(a, t, s_p[i], cnt, a.s.voff[t], a.s.ioff[t], lane, total);
    }
  }
}

// With `advance`: the tiles the tile pass left (no staging room), once the write pass has read
// them: each vector that differs gets next's bytes. A block per tile, grid-stride.
__global__ void __launch_bounds__(kThreads) EncodeAdvanceRestKernel(EncArgs a) {
  for (uint32_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
    if (a.s.voff[t] != kNoSlot && a.s.ioff[t] != kNoSlot) continue;
    const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      if (o >= a.n) break;
      const uint4 b = LoadVec(a.base, o, a.n), x = LoadVec(a.next, o, a.n);
      if (b.x != x.x || b.y != x.y || b.z != x.z || b.w != x.w) StoreVec(a.advance, o, a.n, x);
    }
  }
}

template <int E>
int Launch(const EncArgs& a, cudaStream_t s) {
  EncodeTileKernel<E><<<a.ranges, kThreads, kEncSmem, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return static_cast<int>(e);
  e = LaunchDependent(EncodeWriteKernel<E>, a.ranges * kWriteSplit, 0, s, a);
  if (e != cudaSuccess || a.advance == nullptr) return static_cast<int>(e);
  EncodeAdvanceRestKernel<<<min(a.tiles, a.ranges * 4u), kThreads, 0, s>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <int E>
int BlocksPerSm() {
  int blocks = 0;
  if (cudaFuncSetAttribute(EncodeTileKernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kEncSmem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, EncodeTileKernel<E>, kThreads,
                                                    kEncSmem) != cudaSuccess)
    return 0;
  return blocks;
}

}  // namespace

int EncodeBlocksPerSm(int element_size) {
  switch (element_size) {
    case 1:
      return BlocksPerSm<1>();
    case 2:
      return BlocksPerSm<2>();
    default:
      return BlocksPerSm<4>();
  }
}

int LaunchEncode(const void* base, const void* next, uint64_t bytes, int element_size,
                 uint64_t base_version, void* out, const ScratchPtrs& s, int blocks, void* stream,
                 void* advance) {
  EncArgs a{};
  a.base = static_cast<const unsigned char*>(base);
  a.advance = static_cast<unsigned char*>(advance);
  a.next = static_cast<const unsigned char*>(next);
  a.out = static_cast<unsigned char*>(out);
  a.n = bytes;
  a.elements = bytes / static_cast<uint64_t>(element_size);
  a.bitmap_bytes = DeltaBitmapBytes(a.elements);
  a.base_version = base_version;
  a.tiles = static_cast<uint32_t>(Tiles(bytes));
  // As many ranges as blocks fit at once, and enough that none holds more tiles than the write
  // pass's offsets.
  const uint32_t fit = static_cast<uint32_t>(blocks > 0 ? blocks : 264);
  a.ranges = max(min(a.tiles, fit), (a.tiles + kMaxRangeTiles - 1) / kMaxRangeTiles);
  a.s = s;
  auto st = static_cast<cudaStream_t>(stream);
  switch (element_size) {
    case 1:
      return Launch<1>(a, st);
    case 2:
      return Launch<2>(a, st);
    default:
      return Launch<4>(a, st);
  }
}

}  // namespace shardsync::gpu::delta
