// The delta decoder on the device (delta_gpu.h): DecodeDeltaInPlace's checks and result.
//
// Every kernel checks the header first (delta_kernels.h ParseHeader, the host's order) and does
// nothing when it is refused. No kernel waits on another block.
// Index form, the bucket read once at streaming speed and the changed words once more: Records
// (DecodeRecordsKernel, a thread per record) checks every record (in range, strictly increasing)
// and adds the new minus the old checksum term of every word holding a change (the word's first
// record reads it and patches the word's records); Sum (DecodeSumKernel, grid-stride) adds the
// base checksum terms of the whole bucket.
// Bitmap form: Counts (DecodeCountKernel, a range of consecutive tiles per block, a warp per
// tile) popcount each tile's bitmap bytes (n / 8E bytes in all) and scan them within the range;
// the last block scans the ranges; TileFix (DecodeTileFixKernel) adds each range's first value,
// so tile[t] is tile t's first value. Check (DecodeCheckKernel, one tile of the bucket per block)
// reads the tile once, adds its base checksum terms, finds its changed elements (the bitmap's
// bits) and their values (from tile[t] on, loaded into shared memory together with the tile),
// and adds the new minus the old term of every changed word: the result's checksum is predicted
// from the words in registers, never read twice. None of them writes what the caller sees.
// Decide (DecodeDecideKernel, one thread): the decision from the sums (header, base checksum,
// records, bitmap tail and count, predicted result checksum), reported to the host; the control
// block back at rest.
// Apply (DecodeApplyKernel, the check pass's tiles): writes the changed elements only when the
// decision is "apply" (bitmap form: each 16-byte vector holding a change read, patched and
// written whole; index form: one store per record).
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda/kernels/delta_device.cuh"

namespace shardsync::gpu::delta {
namespace {

struct DecArgs {
  const unsigned char* enc;
  uint64_t enc_bytes;
  unsigned char* bucket;
  uint64_t n;
  uint64_t base_version;
  uint32_t tiles;   // check tiles of the bucket
  uint32_t ranges;  // the count pass's ranges of consecutive tiles, one per block (<= tiles)
  ScratchPtrs s;
};

template <int E>
__device__ __forceinline__ uint64_t RecIndex(const unsigned char* payload, uint64_t k) {
  return LoadLE(payload + k * (kDeltaIndexBytes + E), 4);
}
template <int E>
__device__ __forceinline__ uint64_t RecValue(const unsigned char* payload, uint64_t k) {
  return LoadLE(payload + k * (kDeltaIndexBytes + E) + kDeltaIndexBytes, E);
}

template <int E>
__device__ __forceinline__ HeaderView Parse(const DecArgs& a) {
  return ParseHeader(a.enc, a.enc_bytes, E, a.n, a.base_version);
}

// Bits of the bitmap for the 16 / E elements from elem0 (a multiple of 16 / E), zero past the
// last element.
template <int E>
__device__ __forceinline__ unsigned VectorBits(const unsigned char* bitmap, uint64_t elem0,
                                               uint64_t elements) {
  constexpr int kBits = 16 / E;
  const uint64_t j = elem0 / 8;
  unsigned bits;
  if constexpr (E == 1) {
    bits = bitmap[j] | (elem0 + 8 < elements ? unsigned{bitmap[j + 1]} << 8 : 0u);
  } else if constexpr (E == 2) {
    bits = bitmap[j];
  } else {
    bits = (bitmap[j] >> (elem0 % 8)) & 0xfu;
  }
  if (elem0 + kBits > elements) bits &= (1u << (elements - elem0)) - 1;
  return bits;
}

// Index form: every record checked (in range, strictly increasing), and the new minus the old
// checksum term of every word holding a change, taken by the word's first record (it reads the
// word from the bucket and patches the word's records, at most 8 / E): the result's checksum is
// predicted from the changed words only, so the base checksum is a plain streaming pass.
template <int E>
__global__ void __launch_bounds__(kThreads) DecodeRecordsKernel(DecArgs a) {
  GridDepWait();
  GridDepTrigger();
  constexpr uint64_t kPerWord = 8 / E;
  __shared__ HeaderView h;
  __shared__ uint64_t s_red[kWarps];
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kIndex)) return;
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  const uint64_t c = h.changed;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  uint64_t delta = 0;
  for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k < c;
       k += stride) {
    const uint64_t i = RecIndex<E>(payload, k);
    const uint64_t prev = k > 0 ? RecIndex<E>(payload, k - 1) : 0;
    if (i >= h.elements || (k > 0 && i <= prev)) {
      atomicMin(&a.s.ctl->bad_record, static_cast<unsigned long long>(k));
      continue;
    }
    const uint64_t w = i / kPerWord;
    if (k > 0 && prev / kPerWord == w) continue;  // not the word's first record
    const uint64_t old = LoadWord(a.bucket, w, a.n);
    uint64_t word = Patch<E>(old, static_cast<int>(i % kPerWord) * E, RecValue<E>(payload, k));
    for (uint64_t j = k + 1; j < c && j < k + kPerWord; ++j) {
      const uint64_t ij = RecIndex<E>(payload, j);
      if (ij / kPerWord != w) break;  // (a bad record here is refused by its own thread)
      word = Patch<E>(word, static_cast<int>(ij % kPerWord) * E, RecValue<E>(payload, j));
    }
    delta += Mix(word, w) - Mix(old, w);
  }
  delta = BlockSum(delta, s_red);
  if (threadIdx.x == 0 && delta != 0)
    atomicAdd(&a.s.ctl->sum_b, static_cast<unsigned long long>(delta));
}

// Index form: the base checksum, a streaming reduction over the bucket (grid-stride, four 16-byte
// loads in flight per thread, the terms summed per thread and added once per block).
template <int E>
__global__ void __launch_bounds__(kThreads) DecodeSumKernel(DecArgs a) {
  GridDepWait();
  GridDepTrigger();
  constexpr int kU = 4;
  __shared__ HeaderView h;
  __shared__ uint64_t s_red[kWarps];
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kIndex)) return;
  const uint64_t n = a.n, full = n / 16, vecs = (n + 15) / 16;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  uint64_t sum = 0;
  uint64_t v = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; v + (kU - 1) * stride < full; v += kU * stride) {
    uint4 x[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      x[u] = *reinterpret_cast<const uint4*>(a.bucket + (v + u * stride) * 16);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint64_t key = MixKey(2 * (v + u * stride));
      sum += MixWithKey(Lo64(x[u]), key) + MixWithKey(Hi64(x[u]), key + kChecksumStep);
    }
  }
  for (; v < vecs; v += stride) {  // the rest, and the ragged end (zero padded words)
    const uint64_t o = v * 16;
    const uint4 x = LoadVec(a.bucket, o, n);
    const uint64_t key = MixKey(2 * v);
    sum += MixWithKey(Lo64(x), key);
    if (o + 8 < n) sum += MixWithKey(Hi64(x), key + kChecksumStep);
  }
  sum = BlockSum(sum, s_red);
  if (threadIdx.x == 0) atomicAdd(&a.s.ctl->sum_a, static_cast<unsigned long long>(sum));
}

// Element r of a 16-byte vector's little-endian bytes replaced by v.
template <int E>
__device__ __forceinline__ void PatchVec(uint64_t& lo, uint64_t& hi, int r, uint64_t v) {
  const int byte = r * E;
  if (byte < 8) {
    lo = Patch<E>(lo, byte, v);
  } else {
    hi = Patch<E>(hi, byte - 8, v);
  }
}

// Bitmap form: the value of change number `at` (the values after the bitmap), 0 past the
// encoding's end (the decode is refused then).
template <int E>
__device__ __forceinline__ uint64_t ChangeValue(const unsigned char* vals, uint64_t vals_bytes,
                                                uint64_t at) {
  if ((at + 1) * E > vals_bytes) return 0;
  const unsigned char* p = vals + at * E;
  if constexpr (E == 2) {
    if ((reinterpret_cast<uintptr_t>(p) & 1) == 0) return *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (E == 4) {
    if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  }
  return LoadLE(p, E);
}

// A tile's values (bitmap form) staged in shared memory when they fit: up to 25% density for
// every element size (a denser tile reads them from the encoding one by one).
inline constexpr uint32_t kValsSmem = kTileBytes / 4;

// Bytes [p0 E, p1 E) of the values (clamped to the encoding) into s_vals, when they fit; the
// caller's barrier makes them visible. Returns whether they were staged.
template <int E>
__device__ __forceinline__ bool StageValues(unsigned char* s_vals, const unsigned char* vals,
                                            uint64_t vals_bytes, uint32_t p0, uint32_t p1) {
  const uint64_t from = uint64_t{p0} * E;
  const uint64_t len = p1 >= p0 ? uint64_t{p1 - p0} * E : 0;
  if (len > kValsSmem) return false;
#pragma unroll 4
  for (uint32_t i = threadIdx.x; i < len; i += kThreads)
    s_vals[i] = from + i < vals_bytes ? vals[from + i] : 0;
  return true;
}

template <int E>
__device__ __forceinline__ uint64_t StagedValue(const unsigned char* s_vals, uint64_t j) {
  if constexpr (E == 1) {
    return s_vals[j];
  } else if constexpr (E == 2) {
    return reinterpret_cast<const uint16_t*>(s_vals)[j];
  } else {
    return reinterpret_cast<const uint32_t*>(s_vals)[j];
  }
}

// The bitmap form's layout over a bucket of n bytes (used before the header is checked: only
// inside the encoding, and only trusted once the decision says "bitmap").
struct BitmapLayout {
  uint64_t elements, bitmap_bytes, vals_bytes;
  bool bits_in;  // the encoding holds the whole bitmap
};
template <int E>
__device__ __forceinline__ BitmapLayout Layout(const DecArgs& a) {
  BitmapLayout l;
  l.elements = a.n / E;
  l.bitmap_bytes = DeltaBitmapBytes(l.elements);
  l.bits_in = a.enc_bytes >= kDeltaHeaderBytes + l.bitmap_bytes;
  l.vals_bytes = l.bits_in ? a.enc_bytes - kDeltaHeaderBytes - l.bitmap_bytes : 0;
  return l;
}

// The count pass's range r of tiles: [RangeFirst(r), RangeFirst(r + 1)).
__device__ __forceinline__ uint32_t RangeFirst(const DecArgs& a, uint32_t r) {
  return static_cast<uint32_t>(uint64_t{r} * a.tiles / a.ranges);
}
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

// The check pass holds one side's vectors only: 48 registers, 5 blocks per SM.
inline constexpr int kCheckMinBlocks = 5;

template <int E>
__global__ void __launch_bounds__(kThreads, kCheckMinBlocks) DecodeCheckKernel(DecArgs a) {
  GridDepWait();
  static_assert(kTileVecs <= 4, "per-vector counts are packed 16 bits apart in one word");
  __shared__ HeaderView h;
  __shared__ uint64_t s_scan[2][kWarps];
  __shared__ __align__(16) unsigned char s_vals[kValsSmem];  // the tile's values
  // The index form's checks are the records and sum passes': nothing to do here.
  if (a.enc_bytes >= kDeltaHeaderBytes && a.enc[5] == static_cast<unsigned char>(DeltaKind::kIndex))
    return;
  Ctl* c = a.s.ctl;
  const uint32_t t = blockIdx.x;
  const uint64_t n = a.n;
  const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
  uint4 w[kTileVecs];
  if ((static_cast<uint64_t>(t) + 1) * kTileBytes <= n) {  // every load in flight at once
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k)
      w[k] = *reinterpret_cast<const uint4*>(a.bucket + (v0 + uint64_t{kThreads} * k) * 16);
  } else {
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      w[k] = o < n ? LoadVec(a.bucket, o, n) : make_uint4(0, 0, 0, 0);
    }
  }
  // The tile's first value and the next tile's (the count pass).
  const uint32_t tp0 = a.s.tile[t], tp1 = a.s.tile[t + 1];
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  // Bitmap form (read from the kind byte before the header is checked, so the bits and the
  // values load with the tile; only used once the header passed): bits and staged values.
  const BitmapLayout bl = Layout<E>(a);
  const bool maybe_bitmap =
      bl.bits_in && a.enc[5] == static_cast<unsigned char>(DeltaKind::kBitmap);
  unsigned m[kTileVecs];
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    m[k] = maybe_bitmap && o < n ? VectorBits<E>(payload, o / E, bl.elements) : 0;
  }
  const unsigned char* vals = payload + bl.bitmap_bytes;
  const bool staged = maybe_bitmap && StageValues<E>(s_vals, vals, bl.vals_bytes, tp0, tp1);
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kBitmap)) return;
  uint64_t sum = 0, cnt = 0;
  // Checksum keys (MixKey of word o / 8), stepped rather than multiplied.
  constexpr uint64_t kKeyVec = uint64_t{kThreads} * 2 * kChecksumStep;
  const uint64_t key0 = MixKey(v0 * 2);
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    if (o < n) {
      const uint64_t key = key0 + static_cast<uint64_t>(k) * kKeyVec;
      sum += MixWithKey(Lo64(w[k]), key);
      if (o + 8 < n) sum += MixWithKey(Hi64(w[k]), key + kChecksumStep);
    }
    cnt |= static_cast<uint64_t>(__popc(m[k])) << (16 * k);
  }
  uint64_t v[2] = {cnt, sum}, tot[2];
  BlockScanN<2>(v, tot, s_scan);
  const uint64_t ex = v[0], tot_c = tot[0];
  if (threadIdx.x == 0) atomicAdd(&c->sum_a, static_cast<unsigned long long>(tot[1]));
  uint64_t prefix = tp0;  // the tile's first value (the count pass)
  const uint64_t first = prefix;
  uint64_t delta = 0;
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    uint64_t at = prefix + ((ex >> (16 * k)) & 0xffff);
    prefix += (tot_c >> (16 * k)) & 0xffff;
    if (m[k] == 0) continue;
    const uint64_t old_lo = Lo64(w[k]), old_hi = Hi64(w[k]);
    uint64_t new_lo = old_lo, new_hi = old_hi;
    for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++at) {
      // Staged values cover [tp0, tp1): past them (a count that disagrees, refused) read 0.
      const uint64_t value = staged ? (at < tp1 ? StagedValue<E>(s_vals, at - first) : 0)
                                    : ChangeValue<E>(vals, bl.vals_bytes, at);
      PatchVec<E>(new_lo, new_hi, __ffs(mm) - 1, value);
    }
    const uint64_t key = key0 + static_cast<uint64_t>(k) * kKeyVec;
    delta += MixWithKey(new_lo, key) - MixWithKey(old_lo, key);
    delta += MixWithKey(new_hi, key + kChecksumStep) - MixWithKey(old_hi, key + kChecksumStep);
  }
  GridDepTrigger();
  delta = BlockSum(delta, s_scan[0]);
  if (threadIdx.x == 0 && delta != 0) atomicAdd(&c->sum_b, static_cast<unsigned long long>(delta));
}

// One thread: the decision from the sums (header, base checksum, records, bitmap tail and count,
// predicted result checksum), left in the control block for the apply pass and reported to the
// host (read only after the call's event, so after the apply pass too); the control block's sums
// go back to rest here, since the apply pass reads only the decision.
template <int E>
__global__ void DecodeDecideKernel(DecArgs a) {
  GridDepWait();
  GridDepTrigger();
  Ctl* c = a.s.ctl;
  const HeaderView h = Parse<E>(a);
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
  c->go = code | static_cast<unsigned long long>(h.kind) << 32;
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

// One tile of the bucket per block (the check pass's tiles), writing only on the decide kernel's
// "apply". The bitmap bits and the tile's values are loaded before the decision is read. Bitmap
// form: each 16-byte vector holding a change is read, patched and written whole (coalesced across
// the warp) instead of one store per element; index form: one store per record.
template <int E>
__global__ void __launch_bounds__(kThreads, kMinBlocks) DecodeApplyKernel(DecArgs a) {
  GridDepWait();
  __shared__ uint64_t s_scan[1][kWarps];
  __shared__ __align__(16) unsigned char s_vals[kValsSmem];
  const Ctl* c = a.s.ctl;
  const uint64_t n = a.n;
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  // Bits and values as the bitmap form lays them out, read only inside the encoding (unused
  // unless the decision is "apply a bitmap form", which implies the layout).
  const BitmapLayout bl = Layout<E>(a);
  const uint32_t t = blockIdx.x;
  const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
  const bool maybe_bitmap =
      bl.bits_in && a.enc[5] == static_cast<unsigned char>(DeltaKind::kBitmap);
  const uint32_t tp0 = a.s.tile[t], tp1 = a.s.tile[t + 1];
  unsigned m[kTileVecs];
  uint64_t cnt = 0;
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    m[k] = maybe_bitmap && o < n ? VectorBits<E>(payload, o / E, bl.elements) : 0;
    cnt |= static_cast<uint64_t>(__popc(m[k])) << (16 * k);
  }
  const unsigned char* vals = payload + bl.bitmap_bytes;
  const bool staged = maybe_bitmap && StageValues<E>(s_vals, vals, bl.vals_bytes, tp0, tp1);
  const uint64_t go = c->go;
  if (static_cast<uint32_t>(go) != kOk) return;
  using T = std::conditional_t<E == 1, unsigned char,
                               std::conditional_t<E == 2, unsigned short, uint32_t>>;
  if (static_cast<int>(go >> 32) == static_cast<int>(DeltaKind::kIndex)) {
    T* out = reinterpret_cast<T*>(a.bucket);
    const uint64_t changed = c->changed;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
    constexpr int kU = 4;  // records per thread with their loads in flight at once
    for (uint64_t k0 = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k0 < changed;
         k0 += kU * stride) {
      uint64_t idx[kU], val[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const uint64_t k = k0 + u * stride;
        idx[u] = k < changed ? RecIndex<E>(payload, k) : 0;
        val[u] = k < changed ? RecValue<E>(payload, k) : 0;
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (k0 + u * stride < changed) out[idx[u]] = static_cast<T>(val[u]);
    }
    return;
  }
  // The check pass's scan, from the tile's first value (the count pass's offset); its barriers
  // also make the staged values visible.
  uint64_t tot_c = 0;
  const uint64_t ex = BlockExclusiveScan(cnt, &tot_c, s_scan[0]);
  uint64_t at = tp0;
  uint4 w[kTileVecs];
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    w[k] = m[k] != 0 && o + 16 <= n ? *reinterpret_cast<const uint4*>(a.bucket + o)
                                    : make_uint4(0, 0, 0, 0);
  }
  auto value = [&](uint64_t i) -> uint64_t {
    return staged ? StagedValue<E>(s_vals, i - tp0) : ChangeValue<E>(vals, bl.vals_bytes, i);
  };
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
      T* out = reinterpret_cast<T*>(a.bucket);
      for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++i)
        out[o / E + __ffs(mm) - 1] = static_cast<T>(value(i));
    }
  }
}

template <int E>
int Launch(const DecArgs& a, int sms, cudaStream_t s) {
  const uint32_t grid = static_cast<uint32_t>(sms) * 8;
  DecodeRecordsKernel<E><<<grid, kThreads, 0, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = LaunchDependent(DecodeCountKernel<E>, a.ranges, 0, s, a);
  if (e == cudaSuccess) e = LaunchDependent(DecodeTileFixKernel<E>, a.ranges, 0, s, a);
  if (e == cudaSuccess) e = LaunchDependent(DecodeSumKernel<E>, grid, 0, s, a);
  if (e == cudaSuccess) e = LaunchDependent(DecodeCheckKernel<E>, a.tiles, 0, s, a);
  if (e == cudaSuccess) e = LaunchDependent(DecodeDecideKernel<E>, 1, 0, s, a, 1);
  if (e == cudaSuccess) e = LaunchDependent(DecodeApplyKernel<E>, a.tiles, 0, s, a);
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
  // At least one tile, so the apply pass always sees a check pass (and an empty bucket works).
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
