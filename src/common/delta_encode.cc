// The delta codec's encoder (delta.h: EncodeDelta, EncodeDeltaAdvance): one pass over base and
// new image, changed 64-byte blocks found with lane compares.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <variant>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/delta_internal.h"
#include "shardsync/checksum.h"
#include "shardsync/delta.h"
#include "shardsync/delta_rule.h"

namespace shardsync {
namespace {

using namespace delta_internal;  // NOLINT(build/namespaces): the codec's own helpers

struct EncodeSums {
  uint64_t base = 0, next = 0, changed = 0, escapes = 0;
};

// Bit k set when element k of the 64-byte block at `o` changed (64 / E elements).
template <int E>
uint64_t BlockMaskScalar(const std::byte* b, const std::byte* x, size_t o) {
  uint64_t m = 0;
  for (size_t w = 0; w < 8; ++w) {
    const uint64_t d = Get<uint64_t>(b + o + 8 * w) ^ Get<uint64_t>(x + o + 8 * w);
    m |= uint64_t{ChangedMask<E>(d)} << (w * 8 / E);
  }
  return m;
}

// The first 64-byte block from `o` on (in steps of 64, below `end`) where base and next differ,
// with its element mask in *mask; `end` (and *mask 0) when none does. At RL densities nearly
// every block is equal: two 32-byte compares per stream and step, prefetched like the checksum's
// loop (checksum.cc: the hardware prefetcher alone leaves such loops latency-bound).
template <int E>
size_t NextChangedBlockScalar(const std::byte* b, const std::byte* x, size_t o, size_t end,
                              uint64_t* mask) {
  for (; o + 64 <= end; o += 64) {
    uint64_t d = 0;
    for (size_t k = 0; k < 64; k += 8) d |= Get<uint64_t>(b + o + k) ^ Get<uint64_t>(x + o + k);
    if (d != 0) {
      *mask = BlockMaskScalar<E>(b, x, o);
      return o;
    }
  }
  *mask = 0;
  return end;
}

#if defined(__x86_64__)
bool DeltaHaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
}

template <int E>
__attribute__((target("avx2"))) size_t NextChangedBlockAvx2(const std::byte* b, const std::byte* x,
                                                            size_t o, size_t end, uint64_t* mask) {
  for (; o + 64 <= end; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(b + o + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x + o + 1024), _MM_HINT_T0);
    const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + o));
    const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + o + 32));
    const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + o));
    const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + o + 32));
    const __m256i d = _mm256_or_si256(_mm256_xor_si256(a0, c0), _mm256_xor_si256(a1, c1));
    if (_mm256_testz_si256(d, d)) continue;
    // The element mask from lane compares: bytes, then 16-bit lanes packed to bytes (packs
    // interleaves the 128-bit halves; the permute restores element order), or 32-bit lanes.
    if constexpr (E == 1) {
      const auto e0 = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a0, c0)));
      const auto e1 = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a1, c1)));
      *mask = ~(uint64_t{e0} | uint64_t{e1} << 32);
    } else if constexpr (E == 2) {
      const __m256i p = _mm256_packs_epi16(_mm256_cmpeq_epi16(a0, c0), _mm256_cmpeq_epi16(a1, c1));
      const auto e = static_cast<uint32_t>(
          _mm256_movemask_epi8(_mm256_permute4x64_epi64(p, 0xD8)));  // 0xD8: lanes 0, 2, 1, 3
      *mask = ~e & 0xFFFFFFFFull;
    } else {
      const auto e0 = static_cast<uint32_t>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a0, c0))));
      const auto e1 = static_cast<uint32_t>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a1, c1))));
      *mask = ~(e0 | e1 << 8) & 0xFFFFull;
    }
    return o;
  }
  *mask = 0;
  return end;
}
#endif

// Calls f(byte offset, element mask) for every 64-byte block of [begin, end) (both multiples of
// 64 from the bucket's start) in which an element differs.
template <int E, typename F>
void ForEachChangedBlock(const std::byte* b, const std::byte* x, size_t begin, size_t end, F&& f) {
#if defined(__x86_64__)
  const bool avx2 = DeltaHaveAvx2();
#else
  constexpr bool avx2 = false;
#endif
  uint64_t m = 0;
  for (size_t o = begin; o < end; o += 64) {
#if defined(__x86_64__)
    o = avx2 ? NextChangedBlockAvx2<E>(b, x, o, end, &m)
             : NextChangedBlockScalar<E>(b, x, o, end, &m);
#else
    o = NextChangedBlockScalar<E>(b, x, o, end, &m);
#endif
    if (o >= end) break;
    f(o, m);
  }
}

}  // namespace

// Not in the anonymous namespace: DeltaAdvanceEncoder::Impl holds one.
namespace delta_encode_detail {

// One pass over base and new, which the form follows as the count grows: (index, value) records
// while the index form can still win under the size rule (delta_rule.h; its payload before the
// values is not above the bitmap's bytes); past that the records so far become the bitmap and its
// values, and the pass goes on in the bitmap form; once even that is not smaller than the bucket,
// it only counts. The index form's tiles need the final count, so its records are laid out at
// Finish. Leaves *out holding the payload after kDeltaHeaderBytes (header unwritten), or empty
// for kFull. With `advance` (the writable base), each changed word is written there as it is
// found, while it is in cache: the base ends holding next's bytes whatever the form. The new
// image may come in pieces (Diff, in order): the host path's sender packs it chunk by chunk
// (DeltaAdvanceEncoder).
template <int E>
class Body {
 public:
  Body(const std::byte* b, size_t n, std::vector<std::byte>* out, std::byte* advance)
      : b_(b), n_(n), out_(out), advance_(advance), nbits_(BitmapBytes(n / E)) {
    // The index form wins while round_up(4 x tiles + 2 x count, 4) <= bitmap bytes, i.e. while
    // 4 x tiles + 2 x count <= the bitmap bytes rounded down to a multiple of 4.
    const uint64_t ends = DeltaIndexPayload(n / E, E, 0).offsets;
    const uint64_t room = nbits_ / 4 * 4;
    if (ends > room) {  // a few elements: the bitmap is smaller even with nothing changed
      out_->resize(kDeltaHeaderBytes);
      ToBitmap();
      return;
    }
    index_limit_ = (room - ends) / 2;
    out_->resize(kDeltaHeaderBytes + std::min<uint64_t>(index_limit_, 4096) * kRecord + 8);
  }

  // Bytes [at, at + len) of the new image, at `x` (its byte `at`); `at` a multiple of 64 unless
  // the piece is the bucket's tail. Pieces come in order and tile the bucket.
  void Diff(size_t at, const std::byte* x, size_t len) {
    const size_t blocks = n_ & ~size_t{63};
    const size_t end = at + len;
    if (at < blocks) {
      const size_t stop = std::min(end, blocks);
      ForEachChangedBlock<E>(b_ + at, x, 0, stop - at, [&](size_t o, uint64_t m) {
        Found((at + o) / E, m, x + o, b_ + at + o);  // before the advance overwrites the base
        if (advance_ != nullptr) std::memcpy(advance_ + at + o, x + o, 64);
      });
    }
    if (end > blocks) {
      const size_t from = std::max(at, blocks);
      ForEachChanged<E>(b_ + at, x, from - at, end - at, [&](uint64_t i) {
        const size_t o = i * E;  // from the piece's start
        Found((at + o) / E, 1, x + o, b_ + at + o);
        if (advance_ != nullptr) Put<Elem<E>>(advance_ + at + o, Get<Elem<E>>(x + o));
      });
    }
  }
  // Once every piece was diffed: the changed count and the form, *out trimmed to the payload.
  DeltaSize Finish(uint64_t* changed, uint64_t* escapes) {
    *changed = changed_;
    *escapes = escapes_;
    const DeltaSize size = DeltaEncodedBytes(n_ / E, E, changed_, escapes_);
    if (size.kind == DeltaKind::kFull)
      out_->clear();
    else if (size.kind == DeltaKind::kIndex)
      LayOutIndex();
    else if (size.kind == DeltaKind::kPacked)
      LayOutPacked();
    else
      out_->resize(used_);  // the size rule's bytes (checked by the caller)
    return size;
  }

 private:
  // Scratch record while the index (or packed) form may win: u32 element index, the value, and
  // for 2-byte elements the packed form's value byte.
  static constexpr size_t kRecord = 4 + E + (E == 2 ? 1 : 0);
  static constexpr uint64_t kTileElems = kDeltaTileBytes / E;
  enum class Form { kIndex, kBitmap, kCount };

  // The records become the index form (delta.h "Encoded form"): moved past the final layout
  // first (memmove: the regions may overlap), then read once in order while the running counts,
  // offsets and values are written below them.
  void LayOutIndex() {
    std::vector<std::byte>& out = *out_;
    const uint64_t count = changed_;
    const DeltaIndexLayout l = DeltaIndexPayload(n_ / E, E, count);
    const size_t recs = kDeltaHeaderBytes + l.bytes;
    out.resize(recs + count * kRecord);
    std::memmove(out.data() + recs, out.data() + kDeltaHeaderBytes, count * kRecord);
    std::byte* p = out.data() + kDeltaHeaderBytes;
    uint64_t tile = 0;  // tiles below it have their running count
    for (uint64_t k = 0; k < count; ++k) {
      const std::byte* rec = out.data() + recs + k * kRecord;
      const uint32_t i = Get<uint32_t>(rec);
      const uint64_t t = i / kTileElems;
      for (; tile < t; ++tile) Put<uint32_t>(p + 4 * tile, static_cast<uint32_t>(k));
      Put<uint16_t>(p + l.offsets + 2 * k, static_cast<uint16_t>(i - t * kTileElems));
      Put<Elem<E>>(p + l.values + k * E, Get<Elem<E>>(rec + 4));
    }
    for (; tile < l.tiles; ++tile) Put<uint32_t>(p + 4 * tile, static_cast<uint32_t>(count));
    std::memset(p + l.offsets + 2 * count, 0, l.values - (l.offsets + 2 * count));
    out.resize(kDeltaHeaderBytes + l.bytes);
  }

  // The records become the packed form (delta.h "Encoded form"), as LayOutIndex does: moved past
  // the final layout, then read once in order while the running counts (changes, escapes), the
  // subtile counts, offsets, value bytes and escapes are written below them.
  void LayOutPacked() {
    std::vector<std::byte>& out = *out_;
    const uint64_t count = changed_;
    const DeltaPackedLayout l = DeltaPackedPayload(n_ / E, E, count, escapes_);
    const size_t recs = kDeltaHeaderBytes + l.bytes;
    out.resize(recs + count * kRecord);
    std::memmove(out.data() + recs, out.data() + kDeltaHeaderBytes, count * kRecord);
    std::byte* p = out.data() + kDeltaHeaderBytes;
    std::memset(p + l.subs, 0, l.subtiles);
    if (l.escapes > l.values + count) p[l.values + count] = std::byte{0};
    uint64_t tile = 0, esc = 0;  // tiles below `tile` have their running counts
    for (uint64_t k = 0; k < count; ++k) {
      const std::byte* rec = out.data() + recs + k * kRecord;
      const uint32_t i = Get<uint32_t>(rec);
      const uint64_t t = i / kTileElems;
      for (; tile < t; ++tile) {
        Put<uint32_t>(p + 4 * tile, static_cast<uint32_t>(k));
        if constexpr (E == 2)
          Put<uint32_t>(p + l.escape_ends + 4 * tile, static_cast<uint32_t>(esc));
      }
      const uint64_t sub = i / kDeltaSubtileElems;
      p[l.subs + sub] = std::byte(static_cast<uint8_t>(p[l.subs + sub]) + 1);
      p[l.offsets + k] = std::byte(static_cast<uint8_t>(i % kDeltaSubtileElems));
      if constexpr (E == 2) {
        const std::byte vb = rec[4 + E];
        p[l.values + k] = vb;
        if (vb == std::byte{kDeltaEscape})
          Put<uint16_t>(p + l.escapes + 2 * esc++, Get<uint16_t>(rec + 4));
      } else {
        p[l.values + k] = rec[4];
      }
    }
    for (; tile < l.tiles; ++tile) {
      Put<uint32_t>(p + 4 * tile, static_cast<uint32_t>(count));
      if constexpr (E == 2) Put<uint32_t>(p + l.escape_ends + 4 * tile, static_cast<uint32_t>(esc));
    }
    out.resize(kDeltaHeaderBytes + l.bytes);
  }

  // The records so far become the bitmap and its values, in place in *out (no allocation once
  // the caller's buffer grew to such a size before): the records move up past the bitmap, which
  // is zeroed, then compact into the values (value k is written at or before record k's place).
  void ToBitmap() {
    std::vector<std::byte>& out = *out_;
    const size_t records = used_ - kDeltaHeaderBytes;
    const size_t count = records / kRecord;
    const size_t vals = kDeltaHeaderBytes + nbits_;
    out.resize(std::max(out.size(), vals + records + 64 + 16));
    std::memmove(out.data() + vals, out.data() + kDeltaHeaderBytes, records);
    std::memset(out.data() + kDeltaHeaderBytes, 0, nbits_);
    std::byte* bits = out.data() + kDeltaHeaderBytes;
    for (size_t k = 0; k < count; ++k) {
      const std::byte* rec = out.data() + vals + k * kRecord;
      const uint32_t i = Get<uint32_t>(rec);
      bits[i / 8] |= std::byte(1u << (i % 8));
      std::memmove(out.data() + vals + k * E, rec + 4, E);
    }
    used_ = vals + count * E;
    form_ = Form::kBitmap;
  }
  // Elements idx + k for the bits k of `m` changed, their new values at `at` + k * E; idx is a
  // multiple of 8 unless `m` is one bit (bitmap bytes are whole).
  // For 2-byte elements each change's packed value byte (delta_rule.h) comes from its old value
  // at `old` + k * E, and the escaped ones are counted in every form.
  void Found(uint64_t idx, uint64_t m, const std::byte* at, const std::byte* old) {
    std::vector<std::byte>& out = *out_;
    changed_ += Popcount64(m);
    if (form_ == Form::kIndex) {
      for (uint64_t r = m; r != 0; r &= r - 1) {
        if (used_ + kRecord > out.size()) out.resize(2 * out.size());
        const int k = std::countr_zero(r);
        const Elem<E> v = Get<Elem<E>>(at + k * E);
        Put<uint32_t>(out.data() + used_, static_cast<uint32_t>(idx + k));
        Put<Elem<E>>(out.data() + used_ + 4, v);
        if constexpr (E == 2) {
          const Elem<E> o = Get<Elem<E>>(old + k * E);
          const bool escaped = DeltaEscaped(o, v);
          escapes_ += escaped;
          out[used_ + 4 + E] = std::byte(escaped ? kDeltaEscape : DeltaByte(o, v));
        }
        used_ += kRecord;
      }
      if (changed_ > index_limit_) ToBitmap();
      return;
    }
    if constexpr (E == 2)
      for (uint64_t r = m; r != 0; r &= r - 1) {
        const int k = std::countr_zero(r);
        escapes_ += DeltaEscaped(Get<Elem<E>>(old + k * E), Get<Elem<E>>(at + k * E));
      }
    if (form_ == Form::kCount) return;
    if (kDeltaHeaderBytes + nbits_ + changed_ * E >= n_) {  // even the bitmap form is not smaller
      form_ = Form::kCount;
      return;
    }
    if (used_ + 64 + 16 > out.size()) out.resize(2 * out.size());
    std::byte* bits = out.data() + kDeltaHeaderBytes;
    if (m == 1) {
      bits[idx / 8] |= std::byte(1u << (idx % 8));
    } else {
      for (uint64_t r = m, k = idx / 8; r != 0; r >>= 8, ++k) bits[k] |= std::byte(r & 0xFF);
    }
    for (uint64_t r = m; r != 0; r &= r - 1) {
      Put<Elem<E>>(out.data() + used_, Get<Elem<E>>(at + std::countr_zero(r) * E));
      used_ += E;
    }
  }

  const std::byte* b_;
  size_t n_;
  std::vector<std::byte>* out_;
  std::byte* advance_;
  uint64_t nbits_, index_limit_ = 0;
  Form form_ = Form::kIndex;
  size_t used_ = kDeltaHeaderBytes;  // index: records end; bitmap: values end
  uint64_t changed_ = 0;
  uint64_t escapes_ = 0;  // 2-byte elements: changes DeltaEscaped
};

}  // namespace delta_encode_detail

namespace {

using delta_encode_detail::Body;

// The whole new image at once. With `checksums`, both checksum sums too, chunk by chunk so the
// checksums and the diff read each chunk from cache.
template <int E>
DeltaSize EncodeBody(const std::byte* b, const std::byte* x, size_t n, std::vector<std::byte>* out,
                     bool checksums, EncodeSums* sums, std::byte* advance) {
  Body<E> body(b, n, out, advance);
  if (checksums) {
    for (size_t c = 0; c < n; c += kChunk) {
      const size_t len = std::min(kChunk, n - c);
      sums->base += ChecksumPartial(b + c, len, c);
      sums->next += ChecksumPartial(x + c, len, c);
      body.Diff(c, x + c, len);
    }
  } else {
    body.Diff(0, x, n);
  }
  return body.Finish(&sums->changed, &sums->escapes);
}

// Element size and bucket size, as every encoder entry checks them.
Status CheckSizes(size_t base_bytes, size_t n, int e, std::string_view bucket) {
  if (!ValidElementSize(e))
    return InvalidArgumentError(
        fmt::format("delta of bucket {}: element_size must be 1, 2 or 4, got {}", bucket, e));
  if (base_bytes != n)
    return InvalidArgumentError(
        fmt::format("delta of bucket {}: base is {} bytes, new is {}", bucket, base_bytes, n));
  if (n % e != 0)
    return InvalidArgumentError(fmt::format(
        "delta of bucket {}: {} bytes is not a multiple of element_size {}", bucket, n, e));
  if (n / e > kDeltaMaxElements)
    return InvalidArgumentError(
        fmt::format("delta of bucket {}: {} elements, the codec's indices hold at most {}", bucket,
                    n / e, kDeltaMaxElements));
  return OkStatus();
}

// Writes the header of a delta whose payload *out holds after kDeltaHeaderBytes, and checks its
// length against the size rule.
Status WriteHeader(const DeltaEncodeResult& r, DeltaSize size, int e, uint64_t base_version,
                   std::string_view bucket, std::vector<std::byte>* out) {
  std::byte* h = out->data();
  Put<uint32_t>(h, kMagic);
  Put<uint8_t>(h + 4, kFormat);
  Put<uint8_t>(h + 5, static_cast<uint8_t>(size.kind));
  Put<uint8_t>(h + 6, static_cast<uint8_t>(e));
  Put<uint8_t>(h + 7, 0);
  Put<uint64_t>(h + 8, r.elements);
  Put<uint64_t>(h + 16, base_version);
  Put<uint64_t>(h + 24, r.base_checksum);
  Put<uint64_t>(h + 32, r.new_checksum);
  Put<uint64_t>(h + 40, r.changed);
  if (out->size() != size.bytes)
    return InternalError(fmt::format("delta of bucket {}: encoded {} bytes, the size rule says {}",
                                     bucket, out->size(), size.bytes));
  return OkStatus();
}

// EncodeDelta and EncodeDeltaAdvance: `advance` null (base only read, checksums computed) or the
// writable base (checksums given in `known`).
Result<DeltaEncodeResult> Encode(std::span<const std::byte> base, std::span<const std::byte> next,
                                 std::byte* advance, const EncodeSums* known, int element_size,
                                 uint64_t base_version, std::string_view bucket,
                                 std::vector<std::byte>* out) {
  out->clear();
  SS_RETURN_IF_ERROR(CheckSizes(base.size(), next.size(), element_size, bucket));
  const size_t n = next.size();
  const int e = element_size;
  DeltaEncodeResult r;
  r.elements = n / e;
  EncodeSums sums;
  const std::byte* b = base.data();
  const std::byte* x = next.data();
  const bool compute = known == nullptr;
  const DeltaSize size = e == 1   ? EncodeBody<1>(b, x, n, out, compute, &sums, advance)
                         : e == 2 ? EncodeBody<2>(b, x, n, out, compute, &sums, advance)
                                  : EncodeBody<4>(b, x, n, out, compute, &sums, advance);
  r.changed = sums.changed;
  r.escapes = sums.escapes;
  r.kind = size.kind;
  if (size.kind == DeltaKind::kFull) return r;
  r.base_checksum = compute ? ChecksumFinish(sums.base, n) : known->base;
  r.new_checksum = compute ? ChecksumFinish(sums.next, n) : known->next;
  SS_RETURN_IF_ERROR(WriteHeader(r, size, e, base_version, bucket, out));
  return r;
}

}  // namespace

Result<DeltaEncodeResult> EncodeDelta(std::span<const std::byte> base,
                                      std::span<const std::byte> next, int element_size,
                                      uint64_t base_version, std::string_view bucket,
                                      std::vector<std::byte>* out) {
  return Encode(base, next, nullptr, nullptr, element_size, base_version, bucket, out);
}

Result<DeltaEncodeResult> EncodeDeltaAdvance(std::span<std::byte> base,
                                             std::span<const std::byte> next, int element_size,
                                             uint64_t base_version, uint64_t base_checksum,
                                             uint64_t new_checksum, std::string_view bucket,
                                             std::vector<std::byte>* out) {
  EncodeSums known;
  known.base = base_checksum;
  known.next = new_checksum;
  return Encode(base, next, base.data(), &known, element_size, base_version, bucket, out);
}

struct DeltaAdvanceEncoder::Impl {
  std::variant<std::monostate, Body<1>, Body<2>, Body<4>> body;
  std::string bucket;
  std::vector<std::byte>* out = nullptr;
  size_t n = 0;
  size_t fed = 0;  // bytes of the new image diffed so far
  int e = 0;
};

DeltaAdvanceEncoder::DeltaAdvanceEncoder() : impl_(std::make_unique<Impl>()) {}
DeltaAdvanceEncoder::~DeltaAdvanceEncoder() = default;

Status DeltaAdvanceEncoder::Begin(std::span<std::byte> base, int element_size,
                                  std::string_view bucket, std::vector<std::byte>* out) {
  Impl& m = *impl_;
  m.body = std::monostate{};
  out->clear();
  SS_RETURN_IF_ERROR(CheckSizes(base.size(), base.size(), element_size, bucket));
  m.bucket = bucket;
  m.out = out;
  m.n = base.size();
  m.fed = 0;
  m.e = element_size;
  std::byte* b = base.data();
  if (element_size == 1) m.body.emplace<Body<1>>(b, m.n, out, b);
  if (element_size == 2) m.body.emplace<Body<2>>(b, m.n, out, b);
  if (element_size == 4) m.body.emplace<Body<4>>(b, m.n, out, b);
  return OkStatus();
}

Status DeltaAdvanceEncoder::Feed(uint64_t at, std::span<const std::byte> piece) {
  Impl& m = *impl_;
  if (m.body.index() == 0)
    return FailedPreconditionError("delta encoder: Feed before Begin (or after Finish)");
  if (at != m.fed || piece.size() > m.n - m.fed ||
      (m.fed + piece.size() < m.n && piece.size() % 64 != 0))
    return InvalidArgumentError(fmt::format(
        "delta of bucket {}: a piece of {} bytes at {} after {} of {} bytes fed (pieces come in "
        "order, each a multiple of 64 bytes but the last)",
        m.bucket, piece.size(), at, m.fed, m.n));
  std::visit(
      [&](auto& body) {
        if constexpr (!std::is_same_v<std::decay_t<decltype(body)>, std::monostate>)
          body.Diff(static_cast<size_t>(at), piece.data(), piece.size());
      },
      m.body);
  m.fed += piece.size();
  return OkStatus();
}

Result<DeltaEncodeResult> DeltaAdvanceEncoder::Finish(uint64_t base_version, uint64_t base_checksum,
                                                      uint64_t new_checksum) {
  Impl& m = *impl_;
  if (m.body.index() == 0)
    return FailedPreconditionError("delta encoder: Finish before Begin (or twice)");
  if (m.fed != m.n)
    return InvalidArgumentError(
        fmt::format("delta of bucket {}: {} of {} bytes fed", m.bucket, m.fed, m.n));
  DeltaEncodeResult r;
  r.elements = m.n / static_cast<size_t>(m.e);
  DeltaSize size;
  std::visit(
      [&](auto& body) {
        if constexpr (!std::is_same_v<std::decay_t<decltype(body)>, std::monostate>)
          size = body.Finish(&r.changed, &r.escapes);
      },
      m.body);
  m.body = std::monostate{};
  r.kind = size.kind;
  if (size.kind == DeltaKind::kFull) return r;
  r.base_checksum = base_checksum;
  r.new_checksum = new_checksum;
  SS_RETURN_IF_ERROR(WriteHeader(r, size, m.e, base_version, m.bucket, m.out));
  return r;
}

}  // namespace shardsync
