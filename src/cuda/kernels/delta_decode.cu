// The delta decoder on the device (delta_gpu.h): DecodeDeltaInPlace's checks and result. This
// file: the bitmap form's passes, decide, fix-up and the launch; delta_decode_index.cu: the index
// form's passes; delta_decode.cuh: what they share.
//
// Apply, then verify, restore on refusal. The checks that need no bucket byte (header, records,
// bitmap tail and count) come before any write; the two that do (base checksum, result
// checksum) come from the same pass that writes the changes: it reads each tile of the bucket
// once, adds its base checksum terms, writes the changed vectors back and saves the values they
// held in the scratch (change k's old value at k x E). Decide then reads the sums, and only a
// refusal costs a further pass: Fixup puts the saved values back, leaving the bucket exactly as
// it was. (A bitmap delta whose old values do not fit the scratch, over about 31% density, is
// checked first and written by Fixup, as before.) Every kernel checks the header first
// (delta_kernels.h ParseHeader, the host's order); every form's passes are queued, and those of
// the other form return at once. No kernel waits on another block.
// Index form: Records (DecodeRecordsKernel, a warp per tile) checks the tile's running count,
// its records (inside the tile, strictly increasing) and the padding, and writes each tile's
// first record; IndexTile (DecodeIndexTileKernel, a
// range of tiles per block, the copy engine loading the next tile while the block works on one)
// sums each tile, patches its records into the tile in shared memory and writes back the
// vectors that changed.
// Bitmap form: Counts (DecodeCountKernel, a range of consecutive tiles per block, a warp per
// tile) popcount each tile's bitmap bytes (n / 8E bytes in all) and scan them within the range;
// the last block scans the ranges; TileFix (DecodeTileFixKernel) adds each range's first value,
// so tile[t] is tile t's first value. BitmapTile (DecodeBitmapTileKernel, a range of tiles per
// block, the copy engine loading the next tile, its bits and its values while the block works on
// one) sums each tile, finds its changed elements (the bits) and their values (from tile[t]
// on), and writes each 16-byte vector holding a change back patched.
// Decide (DecodeDecideKernel, one thread): the decision from the sums, reported to the host; the
// control block back at rest. Fixup (DecodeFixupKernel): the restore, or the late apply.
#include "cuda/kernels/delta_decode.cuh"

namespace shardsync::gpu::delta {
namespace {

// Bitmap form, a range of consecutive tiles per block: a warp per tile counts its bitmap bytes
// (16-byte loads); the block scans its tiles' counts into each one's first value within the
// range (tile[t]) and the range's total (rtot[r]); the last block to finish scans the ranges'
// totals into each range's first value (rtot[r]) and the total popcount (also tile[tiles]).
// Bits past the last element count too: the decision refuses them (tail) before the count.
template <int E>
__global__ void __launch_bounds__(kThreads) DecodeCountKernel(DecArgs a) {
  GridDepWait();
  GridDepTrigger();
  constexpr uint64_t kTileBitmap = kTileBytes / E / 8;
  __shared__ HeaderView h;
  __shared__ uint64_t s_red[kWarps];
  __shared__ bool s_last;
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kBitmap)) return;
  const int lane = threadIdx.x & 31;
  const unsigned char* bm = a.enc + kDeltaHeaderBytes;
  const uint64_t bitmap_bytes = DeltaBitmapBytes(h.elements);
  const uint32_t r = blockIdx.x, t0 = RangeFirst(a, r), t1 = RangeFirst(a, r + 1);
  for (uint32_t t = t0 + (threadIdx.x >> 5); t < t1; t += kWarps) {
    const uint64_t b0 = uint64_t{t} * kTileBitmap, b1 = min(b0 + kTileBitmap, bitmap_bytes);
    uint32_t cnt = 0;
    for (uint64_t o = b0 + uint64_t(lane) * 16; o < b1; o += 32 * 16) {
      if (o + 16 <= b1) {
        const uint4 v = *reinterpret_cast<const uint4*>(bm + o);
        cnt += __popc(v.x) + __popc(v.y) + __popc(v.z) + __popc(v.w);
      } else {
        for (uint64_t i = o; i < b1; ++i) cnt += __popc(bm[i]);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
    if (lane == 0) a.s.tile[t] = cnt;
  }
  __syncthreads();  // the block's counts, visible to the block
  uint64_t carry = 0;
  for (uint32_t b = t0; b < t1; b += kThreads) {
    const uint32_t t = b + threadIdx.x;
    const uint32_t v = t < t1 ? a.s.tile[t] : 0;
    uint64_t tot = 0;
    const uint64_t ex = BlockExclusiveScan(v, &tot, s_red);
    if (t < t1) a.s.tile[t] = static_cast<uint32_t>(carry + ex);
    carry += tot;
  }
  Ctl* c = a.s.ctl;
  if (threadIdx.x == 0) {
    const uint64_t tail = h.elements % 8;
    if (r == 0 && tail != 0 && (bm[bitmap_bytes - 1] >> tail) != 0) c->tail_bad = 1;
    a.s.rtot[r] = static_cast<uint32_t>(carry);
    __threadfence();  // before the block's ticket
    s_last = atomicAdd(&c->ticket, 1u) == a.ranges - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const uint32_t per = (a.ranges + kThreads - 1) / kThreads;
  const uint32_t lo = min(threadIdx.x * per, a.ranges), hi = min(lo + per, a.ranges);
  uint64_t sum = 0;
  for (uint32_t i = lo; i < hi; ++i) sum += __ldcg(a.s.rtot + i);
  uint64_t all = 0;
  uint64_t run = BlockExclusiveScan(sum, &all, s_red);
  for (uint32_t i = lo; i < hi; ++i) {
    const uint32_t v = __ldcg(a.s.rtot + i);
    a.s.rtot[i] = static_cast<uint32_t>(run);
    run += v;
  }
  if (threadIdx.x == 0) {
    c->popcount = all;
    a.s.tile[a.tiles] = static_cast<uint32_t>(all);
    c->ticket = 0;
  }
}

// Bitmap form: each tile's first value within its range plus the range's (block r: range r), so
// the check and apply passes read tile[t] and tile[t + 1] as they are.
template <int E>
__global__ void __launch_bounds__(kThreads) DecodeTileFixKernel(DecArgs a) {
  GridDepWait();
  GridDepTrigger();
  __shared__ HeaderView h;
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kBitmap)) return;
  const uint32_t r = blockIdx.x, t1 = RangeFirst(a, r + 1);
  const uint32_t first = a.s.rtot[r];
  for (uint32_t t = RangeFirst(a, r) + threadIdx.x; t < t1; t += kThreads) a.s.tile[t] += first;
}

// The bitmap form's tile pass: per stage the tile (16 KiB), its bitmap bytes and a 16-byte
// aligned window holding its values (when it fits and lies inside the encoding), all three
// filled by the copy engine on one barrier while the block works on the other stage. 3 or 4
// stages measured slower (553-560 / 641-644 us against 535 at bf16 512 MiB 10%: 3 or 2 blocks
// per SM instead of 4).
inline constexpr uint32_t kBmStages = 2;
inline constexpr uint32_t kBmWindow = kValsSmem + 32;
// A stage: the tile, its bitmap bytes, the values' window (each 16-byte aligned).
template <int E>
inline constexpr uint32_t kBmStage =
    static_cast<uint32_t>(kTileBytes + kTileBytes / E / 8) + kBmWindow;
template <int E>
inline constexpr uint32_t kBmSmem = kBmStages* kBmStage<E>;  // dynamic shared memory
inline constexpr int kBmMinBlocks = 4;

// Bitmap form, a range of consecutive tiles per block (as many blocks as fit), each tile read
// once: its base checksum terms, its changed elements (the bits) and their values (from tile[t]
// on), the new minus the old term of every changed word, and, when the changes are applied
// before the decision (WillApply), each 16-byte vector holding a change written back patched and
// its old values saved (change k's at k x E of the scratch).
template <int E>
__global__ void __launch_bounds__(kThreads, kBmMinBlocks) DecodeBitmapTileKernel(DecArgs a) {
  GridDepWait();
  constexpr uint32_t kTileBitmap = static_cast<uint32_t>(kTileBytes / E / 8);
  constexpr uint64_t kTileElems = kTileBytes / E;
  extern __shared__ __align__(128) unsigned char s_dyn[];  // kBmStages stages
  auto s_tile = [&](uint32_t st) { return reinterpret_cast<uint4*>(s_dyn + st * kBmStage<E>); };
  auto s_bits = [&](uint32_t st) { return s_dyn + st * kBmStage<E> + kTileBytes; };
  auto s_win = [&](uint32_t st) { return s_dyn + st * kBmStage<E> + kTileBytes + kTileBitmap; };
  __shared__ __align__(8) uint64_t s_bar[kBmStages];
  __shared__ uint32_t s_tp[kBmStages][2];  // the stage's tile[t], tile[t + 1]
  __shared__ uint32_t s_voff[kBmStages];   // its first value's byte in the window (kNoSlot: none)
  __shared__ HeaderView h;
  __shared__ bool s_apply;
  __shared__ uint64_t s_scan[kWarps];
  // The index form's checks are the records and index tile passes': nothing to do here.
  if (a.enc_bytes >= kDeltaHeaderBytes && a.enc[5] == static_cast<unsigned char>(DeltaKind::kIndex))
    return;
  if (threadIdx.x == 0) {
    h = Parse<E>(a);
    s_apply = h.kind == static_cast<int>(DeltaKind::kBitmap) && WillApply<E>(a, h);
    for (int i = 0; i < kBmStages; ++i) MbarInit(&s_bar[i], 1);
    MbarInitFence();
  }
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kBitmap)) return;
  const bool apply = s_apply;
  const uint64_t n = a.n;
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  const BitmapLayout bl = Layout<E>(a);
  const unsigned char* vals = payload + bl.bitmap_bytes;
  const uintptr_t enc_end = reinterpret_cast<uintptr_t>(a.enc) + a.enc_bytes;
  Elem<E>* saved = reinterpret_cast<Elem<E>*>(a.s.vals);
  const uint32_t lo = RangeFirst(a, blockIdx.x), hi = RangeFirst(a, blockIdx.x + 1);
  const uint32_t whole_hi = min(hi, static_cast<uint32_t>(n / kTileBytes));
  // One thread: tile t's loads into its stage, given tile[t] and tile[t + 1].
  auto issue = [&](uint32_t t, uint32_t tp0, uint32_t tp1) {
    const uint32_t st = (t - lo) % kBmStages;
    const uintptr_t from = reinterpret_cast<uintptr_t>(vals) + uint64_t{tp0} * E;
    const uintptr_t to = reinterpret_cast<uintptr_t>(vals) + uint64_t{tp1} * E;
    const uintptr_t ws = from & ~uintptr_t{15}, we = (to + 15) & ~uintptr_t{15};
    const bool win = tp1 >= tp0 && we - ws <= kBmWindow && we <= enc_end;
    s_tp[st][0] = tp0;
    s_tp[st][1] = tp1;
    s_voff[st] = win ? static_cast<uint32_t>(from - ws) : kNoSlot;
    MbarExpect(&s_bar[st], static_cast<uint32_t>(kTileBytes + kTileBitmap + (win ? we - ws : 0)));
    BulkLoad(s_tile(st), a.bucket + uint64_t{t} * kTileBytes, kTileBytes, &s_bar[st]);
    BulkLoad(s_bits(st), payload + uint64_t{t} * kTileBitmap, kTileBitmap, &s_bar[st]);
    if (win && we > ws)
      BulkLoad(s_win(st), reinterpret_cast<const void*>(ws), static_cast<uint32_t>(we - ws),
               &s_bar[st]);
  };
  if (threadIdx.x == 0)
    for (uint32_t t = lo; t < whole_hi && t < lo + kBmStages; ++t)
      issue(t, a.s.tile[t], a.s.tile[t + 1]);
  __syncthreads();  // the stages' offsets
  constexpr uint64_t kKeyVec = uint64_t{kThreads} * 2 * kChecksumStep;
  constexpr uint64_t kKeyTile = kTileBytes / 8 * kChecksumStep;
  uint64_t key0 = MixKey((static_cast<uint64_t>(lo) * kThreads * kTileVecs + threadIdx.x) * 2);
  uint64_t sum = 0, delta = 0;
  for (uint32_t t = lo; t < hi; ++t, key0 += kKeyTile) {
    const uint32_t i = t - lo, st = i % kBmStages;
    // Thread 0: tile[] of the tile two on, loaded now, used at the end to refill this stage.
    uint32_t nx0 = 0, nx1 = 0;
    if (threadIdx.x == 0 && t + kBmStages < whole_hi) {
      nx0 = a.s.tile[t + kBmStages];
      nx1 = a.s.tile[t + kBmStages + 1];
    }
    const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
    uint4 w[kTileVecs];
    unsigned m[kTileVecs];
    uint32_t tp0, tp1, voff;
    const unsigned char* win;
    if (t < whole_hi) {
      MbarWait(&s_bar[st], (i / kBmStages) & 1);
      tp0 = s_tp[st][0];
      tp1 = s_tp[st][1];
      voff = s_voff[st];
      win = s_win(st);
#pragma unroll
      for (int k = 0; k < kTileVecs; ++k) {
        w[k] = s_tile(st)[k * kThreads + threadIdx.x];
        const uint64_t local = (uint64_t{kThreads} * k + threadIdx.x) * 16 / E;
        m[k] = VectorBits<E>(s_bits(st), local, kTileElems);
      }
    } else {  // the ragged last tile: loaded by the threads
      tp0 = a.s.tile[t];
      tp1 = a.s.tile[t + 1];
      const bool staged = StageValues<E>(s_win(st), vals, bl.vals_bytes, tp0, tp1);
      voff = staged ? 0 : kNoSlot;
      win = s_win(st);
#pragma unroll
      for (int k = 0; k < kTileVecs; ++k) {
        const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
        w[k] = o < n ? LoadVec(a.bucket, o, n) : make_uint4(0, 0, 0, 0);
        m[k] = o < n ? VectorBits<E>(payload, o / E, bl.elements) : 0;
      }
    }
    uint64_t cnt = 0;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      const uint64_t key = key0 + static_cast<uint64_t>(k) * kKeyVec;
      if (o < n) {
        sum += MixWithKey(Lo64(w[k]), key);
        if (o + 8 < n) sum += MixWithKey(Hi64(w[k]), key + kChecksumStep);
      }
      cnt |= static_cast<uint64_t>(__popc(m[k])) << (16 * k);
    }
    uint64_t tot_c = 0;
    const uint64_t ex = BlockExclusiveScan(cnt, &tot_c, s_scan);  // its barriers: values staged
    // Change `at`'s value: from the window (byte loads where it is not aligned for E), else from
    // the encoding; 0 past the tile's values (a count that disagrees: refused).
    const bool aligned = voff != kNoSlot && voff % E == 0;
    auto value = [&](uint64_t at) -> uint64_t {
      if (voff == kNoSlot) return ChangeValue<E>(vals, bl.vals_bytes, at);
      if (at >= tp1) return 0;
      const unsigned char* p = win + voff + (at - tp0) * E;
      if (aligned) return *reinterpret_cast<const Elem<E>*>(p);
      return LoadLE(p, E);
    };
    uint64_t prefix = tp0;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      uint64_t at = prefix + ((ex >> (16 * k)) & 0xffff);
      prefix += (tot_c >> (16 * k)) & 0xffff;
      if (m[k] == 0) continue;
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      const uint64_t key = key0 + static_cast<uint64_t>(k) * kKeyVec;
      const uint64_t old_lo = Lo64(w[k]), old_hi = Hi64(w[k]);
      uint64_t new_lo = old_lo, new_hi = old_hi;
      for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++at) {
        const int r = __ffs(mm) - 1;
        const uint64_t v = value(at);
        if (apply) {
          saved[at] = static_cast<Elem<E>>(VecElem<E>(old_lo, old_hi, r));
          if (o + 16 > n) reinterpret_cast<Elem<E>*>(a.bucket)[o / E + r] = v;
        }
        PatchVec<E>(new_lo, new_hi, r, v);
      }
      if (apply && o + 16 <= n)
        *reinterpret_cast<uint4*>(a.bucket + o) =
            make_uint4(static_cast<uint32_t>(new_lo), static_cast<uint32_t>(new_lo >> 32),
                       static_cast<uint32_t>(new_hi), static_cast<uint32_t>(new_hi >> 32));
      delta += MixWithKey(new_lo, key) - MixWithKey(old_lo, key);
      delta += MixWithKey(new_hi, key + kChecksumStep) - MixWithKey(old_hi, key + kChecksumStep);
    }
    FenceProxyAsync();  // the stage's reads, before the copy engine refills it
    __syncthreads();    // the stage is read: refill it
    if (threadIdx.x == 0 && t + kBmStages < whole_hi) issue(t + kBmStages, nx0, nx1);
  }
  GridDepTrigger();
  sum = BlockSum(sum, s_scan);
  delta = BlockSum(delta, s_scan);
  if (threadIdx.x == 0) {
    atomicAdd(&a.s.ctl->sum_a, static_cast<unsigned long long>(sum));
    if (delta != 0) atomicAdd(&a.s.ctl->sum_b, static_cast<unsigned long long>(delta));
  }
}

// One thread: the decision from the sums (header, base checksum, records, bitmap tail and count,
// result checksum), left in the control block for the fix-up pass with whether the changes were
// already written, and reported to the host (read only after the call's event, so after the
// fix-up pass too); the control block's sums go back to rest here, since the fix-up pass reads
// only the decision.
template <int E>
__global__ void DecodeDecideKernel(DecArgs a) {
  GridDepWait();
  GridDepTrigger();
  Ctl* c = a.s.ctl;
  const HeaderView h = Parse<E>(a);
  const bool applied = WillApply<E>(a, h);
  uint32_t code = h.code;
  uint64_t have = 0, detail = 0;
  const bool bitmap = h.kind == static_cast<int>(DeltaKind::kBitmap);
  if (code == kOk) {
    have = ChecksumFinish(c->sum_a, a.n);
    if (have != h.base_checksum) {
      code = kBaseChecksum;
    } else if (!bitmap && c->bad_record != ~0ull) {
      code = kBadRecord;
      detail = c->bad_record;
    } else if (bitmap && c->tail_bad != 0) {
      code = kBitmapTail;
    } else if (bitmap && c->popcount != h.changed) {
      code = kPopcount;
      detail = c->popcount;
    } else {
      have = ChecksumFinish(c->sum_a + c->sum_b, a.n);
      if (have != h.new_checksum) code = kResultChecksum;
    }
  }
  c->go = code | static_cast<unsigned long long>(h.kind) << 32 |
          static_cast<unsigned long long>(applied) << 40;
  c->changed = h.changed;
  HostResult* r = a.s.result;
  r->code = code;
  r->have = have;
  r->detail = detail;
  for (uint64_t i = 0; i < kDeltaHeaderBytes; ++i) r->header[i] = i < a.enc_bytes ? a.enc[i] : 0;
  c->sum_a = 0;
  c->sum_b = 0;
  c->bad_record = ~0ull;
  c->popcount = 0;
  c->ticket = 0;
  c->tail_bad = 0;
  __threadfence_system();
}

// The last pass (grid-stride, few blocks: nothing to do in the common case, changes applied and
// accepted). Changes applied and the decode refused: every changed element gets its old value
// back from the scratch, so the bucket holds exactly its bytes from before the call. Not applied
// (old values past the scratch) and accepted: the changes are written now. Index form: a store
// per record; bitmap form: each 16-byte vector holding a change read, patched and written whole.
template <int E>
__global__ void __launch_bounds__(kThreads, kMinBlocks) DecodeFixupKernel(DecArgs a) {
  GridDepWait();
  __shared__ uint64_t s_scan[kWarps];
  __shared__ __align__(16) unsigned char s_vals[kValsSmem];
  const Ctl* c = a.s.ctl;
  const uint64_t go = c->go;
  const bool ok = static_cast<uint32_t>(go) == kOk, applied = ((go >> 40) & 1) != 0;
  if (ok == applied) return;  // accepted and written, or refused with nothing written
  // From here the header passed (applied, or accepted): its layout holds.
  const uint64_t n = a.n, changed = c->changed;
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  const unsigned char* saved = a.s.vals;  // the old values (restore)
  Elem<E>* out = reinterpret_cast<Elem<E>*>(a.bucket);
  const int kind = static_cast<int>((go >> 32) & 0xff);
  if (kind == static_cast<int>(DeltaKind::kPacked)) {
    // Always applied (WillApply): the restore, from the expanded records' elements.
    const IndexView xv = PackedScratch<E>(a.s, changed);
    constexpr uint64_t kTileElems = kTileBytes / E;
    for (uint32_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
      Elem<E>* te = out + uint64_t{t} * kTileElems;
      for (uint64_t k = a.s.tile[t] + threadIdx.x; k < a.s.tile[t + 1]; k += kThreads)
        te[xv.offs[k] & ~kPackedAdd] = reinterpret_cast<const Elem<E>*>(saved)[k];
    }
    return;
  }
  if (kind == static_cast<int>(DeltaKind::kIndex)) {
    // A block per tile (tile[t]: its first record, from the records pass), a store per record.
    const IndexView iv = IndexOf<E>(payload, n / E, changed);
    constexpr uint64_t kTileElems = kTileBytes / E;
    for (uint32_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
      Elem<E>* te = out + uint64_t{t} * kTileElems;
      for (uint64_t k = a.s.tile[t] + threadIdx.x; k < a.s.tile[t + 1]; k += kThreads)
        te[iv.offs[k]] = applied ? reinterpret_cast<const Elem<E>*>(saved)[k]
                                 : static_cast<Elem<E>>(RecValue<E>(iv, k));
    }
    return;
  }
  const BitmapLayout bl = Layout<E>(a);
  const unsigned char* src = applied ? saved : payload + bl.bitmap_bytes;
  const uint64_t src_bytes = applied ? changed * E : bl.vals_bytes;
  for (uint32_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
    const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
    const uint32_t tp0 = a.s.tile[t], tp1 = a.s.tile[t + 1];
    unsigned m[kTileVecs];
    uint64_t cnt = 0;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      m[k] = o < n ? VectorBits<E>(payload, o / E, bl.elements) : 0;
      cnt |= static_cast<uint64_t>(__popc(m[k])) << (16 * k);
    }
    const bool staged = StageValues<E>(s_vals, src, src_bytes, tp0, tp1);
    uint64_t tot_c = 0;
    const uint64_t ex = BlockExclusiveScan(cnt, &tot_c, s_scan);  // its barriers: s_vals staged
    uint4 w[kTileVecs];
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      w[k] = m[k] != 0 && o + 16 <= n ? *reinterpret_cast<const uint4*>(a.bucket + o)
                                      : make_uint4(0, 0, 0, 0);
    }
    auto value = [&](uint64_t i) -> uint64_t {
      return staged ? StagedValue<E>(s_vals, i - tp0) : ChangeValue<E>(src, src_bytes, i);
    };
    uint64_t at = tp0;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      uint64_t i = at + ((ex >> (16 * k)) & 0xffff);
      at += (tot_c >> (16 * k)) & 0xffff;
      if (m[k] == 0) continue;
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      if (o + 16 <= n) {
        uint64_t lo = Lo64(w[k]), hi = Hi64(w[k]);
        for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++i)
          PatchVec<E>(lo, hi, __ffs(mm) - 1, value(i));
        *reinterpret_cast<uint4*>(a.bucket + o) =
            make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                       static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
      } else {  // the ragged end: element stores inside the bucket
        for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++i)
          out[o / E + __ffs(mm) - 1] = static_cast<Elem<E>>(value(i));
      }
    }
    __syncthreads();  // s_vals is the next tile's
  }
}

// Every form's passes are queued (the host does not read the header); a pass of the other form
// returns at once, and every grid but the count pass's is sized for the GPU, not the bucket.
template <int E>
int Launch(const DecArgs& a, int sms, cudaStream_t s) {
  // The tile pass's ranges: as many as its blocks fit at once (tile[] holds absolute offsets
  // after the fix pass, so they need not be the count pass's).
  static const int bm_fit = FitPerSm(DecodeBitmapTileKernel<E>, kBmSmem<E>);
  // The attribute is the current device's: set on every call (cheap), the fit computed once.
  cudaError_t e = cudaFuncSetAttribute(
      DecodeBitmapTileKernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, int{kBmSmem<E>});
  if (e != cudaSuccess) return static_cast<int>(e);
  DecArgs ab = a;
  ab.ranges = static_cast<uint32_t>(std::min<uint64_t>(a.tiles, uint64_t(sms) * bm_fit));
  const uint32_t fix_grid =
      static_cast<uint32_t>(std::min<uint64_t>(a.tiles, uint64_t(sms) * kMinBlocks));
  e = LaunchIndexPasses<E>(a, sms, s);
  if (e == cudaSuccess) e = LaunchDependent(DecodeCountKernel<E>, a.ranges, 0, s, a);
  if (e == cudaSuccess) e = LaunchDependent(DecodeTileFixKernel<E>, a.ranges, 0, s, a);
  if (e == cudaSuccess)
    e = LaunchDependent(DecodeBitmapTileKernel<E>, ab.ranges, kBmSmem<E>, s, ab);
  if (e == cudaSuccess) e = LaunchDependent(DecodeDecideKernel<E>, 1, 0, s, a, 1);
  if (e == cudaSuccess) e = LaunchDependent(DecodeFixupKernel<E>, fix_grid, 0, s, a);
  return static_cast<int>(e);
}

}  // namespace

int LaunchDecode(const void* encoded, uint64_t encoded_bytes, void* bucket, uint64_t bytes,
                 int element_size, uint64_t base_version, const ScratchPtrs& s, int sm_count,
                 void* stream) {
  DecArgs a{};
  a.enc = static_cast<const unsigned char*>(encoded);
  a.enc_bytes = encoded_bytes;
  a.bucket = static_cast<unsigned char*>(bucket);
  a.n = bytes;
  a.base_version = base_version;
  // At least one tile, so every tile pass has a tile (and an empty bucket works).
  a.tiles = static_cast<uint32_t>(bytes == 0 ? 1 : (bytes + kTileBytes - 1) / kTileBytes);
  a.s = s;
  const int sms = sm_count > 0 ? sm_count : 132;
  a.ranges = static_cast<uint32_t>(std::min<uint64_t>(a.tiles, static_cast<uint64_t>(sms) * 4));
  auto st = static_cast<cudaStream_t>(stream);
  switch (element_size) {
    case 1:
      return Launch<1>(a, sms, st);
    case 2:
      return Launch<2>(a, sms, st);
    default:
      return Launch<4>(a, sms, st);
  }
}

}  // namespace shardsync::gpu::delta
