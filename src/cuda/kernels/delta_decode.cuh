// Internal: what the delta decoder's kernels share (delta_decode.cu: the bitmap form, decide,
// fix-up and the launch; delta_decode_index.cu: the index form's passes): their arguments, the
// encoding's records and bitmap as the kernels read them, and the write-before-decide rule.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda/kernels/delta_device.cuh"

namespace shardsync::gpu::delta {

struct DecArgs {
  const unsigned char* enc;
  uint64_t enc_bytes;
  unsigned char* bucket;
  uint64_t n;
  uint64_t base_version;
  uint32_t tiles;   // 16 KiB tiles of the bucket
  uint32_t ranges;  // ranges of consecutive tiles, one per block (<= tiles)
  ScratchPtrs s;
};

// The index form's payload (delta_rule.h DeltaIndexPayload; the payload is 16-byte aligned, so
// the running counts, offsets and values are aligned to their size): record k's element within
// its tile and its value.
struct IndexView {
  const uint32_t* ends;  // running count through each tile
  const uint16_t* offs;  // element within its tile, per record
  const unsigned char* vals;
};
template <int E>
__device__ __forceinline__ IndexView IndexOf(const unsigned char* payload, uint64_t elements,
                                             uint64_t changed) {
  const DeltaIndexLayout l = DeltaIndexPayload(elements, E, changed);
  return {reinterpret_cast<const uint32_t*>(payload),
          reinterpret_cast<const uint16_t*>(payload + l.offsets), payload + l.values};
}
// The packed form's records expanded by its records pass (delta_decode_index.cu) into the
// scratch, after the saved old values (change k's at k x E): a u16 per record, its element within
// its tile, with kPackedAdd set when (element size 2) the value is a difference to add to the old
// one; then its value (Elem<E>: the new value, or the difference sign-extended). Fits: the packed
// form holds at most 1/16 of a bucket's elements (DeltaPackedAllowed, checked with the header), so
// this takes at most a quarter of the bucket's bytes (element size 1; 3/16 for 2), and the
// scratch's staging holds 3/8 of the largest bucket's (LayoutScratch).
inline constexpr uint16_t kPackedAdd = 0x8000;
template <int E>
__device__ __forceinline__ IndexView PackedScratch(const ScratchPtrs& s, uint64_t changed) {
  const uint64_t offs = (changed * E + 15) / 16 * 16;
  const uint64_t vals = (offs + 2 * changed + 15) / 16 * 16;
  return {nullptr, reinterpret_cast<const uint16_t*>(s.vals + offs), s.vals + vals};
}

template <int E>
__device__ __forceinline__ uint64_t RecValue(const IndexView& v, uint64_t k) {
  if constexpr (E == 4) {
    return reinterpret_cast<const uint32_t*>(v.vals)[k];
  } else if constexpr (E == 2) {
    return reinterpret_cast<const uint16_t*>(v.vals)[k];
  } else {
    return v.vals[k];
  }
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

// The count pass's range r of tiles: [RangeFirst(r), RangeFirst(r + 1)).
__device__ __forceinline__ uint32_t RangeFirst(const DecArgs& a, uint32_t r) {
  return static_cast<uint32_t>(uint64_t{r} * a.tiles / a.ranges);
}
// Whether the changes are written before the decision (the decide kernel reads the same): the
// header passed, the form's own checks that come before any write passed (index: every record;
// bitmap: its tail and popcount), and the old values fit the scratch (always for the index form:
// its changes are under 1/16 of the bucket's elements; the bitmap form up to about 31% density).
// Read after the passes that set those fields (the records pass; the count pass).
template <int E>
__device__ __forceinline__ bool WillApply(const DecArgs& a, const HeaderView& h) {
  if (h.code != kOk || h.changed * E > a.s.stage_bytes) return false;
  const Ctl* c = a.s.ctl;
  if (h.kind == static_cast<int>(DeltaKind::kIndex)) return c->bad_record == ~0ull;
  // The packed form's expansion always fits (PackedScratch): it is applied like the index form.
  if (h.kind == static_cast<int>(DeltaKind::kPacked)) return c->bad_record == ~0ull;
  return c->tail_bad == 0 && c->popcount == h.changed;
}

template <int E>
using Elem =
    std::conditional_t<E == 1, unsigned char, std::conditional_t<E == 2, unsigned short, uint32_t>>;

// Element r (of 16 / E) of a 16-byte vector's little-endian bytes.
template <int E>
__device__ __forceinline__ uint64_t VecElem(uint64_t lo, uint64_t hi, int r) {
  constexpr uint64_t kMask = (uint64_t{1} << (8 * E)) - 1;
  const int byte = r * E;
  return ((byte < 8 ? lo >> (8 * byte) : hi >> (8 * (byte - 8)))) & kMask;
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

// Blocks of `kernel` that fit an SM with `smem` bytes of dynamic shared memory (the attribute
// set first: over 48 KiB needs it), at least 1.
inline int FitPerSm(void (*kernel)(DecArgs), uint32_t smem) {
  int blocks = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem) != cudaSuccess)
    return 1;
  return std::max(blocks, 1);
}

// The index form's passes (delta_decode_index.cu), queued first on `s`: the records pass, then
// the tile pass as a programmatic dependent (its ranges as many as its blocks fit).
template <int E>
cudaError_t LaunchIndexPasses(const DecArgs& a, int sms, cudaStream_t s);

}  // namespace shardsync::gpu::delta
