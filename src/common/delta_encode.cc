// The delta codec's encoder (delta.h: EncodeDelta, EncodeDeltaAdvance): one pass over base and
// new image, changed 64-byte blocks found with lane compares.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/delta_internal.h"
#include "shardsync/checksum.h"
#include "shardsync/delta.h"

namespace shardsync {
namespace {

using namespace delta_internal;  // NOLINT(build/namespaces): the codec's own helpers

struct EncodeSums {
  uint64_t base = 0, next = 0, changed = 0;
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

// One pass over base and new, which the form follows as the count grows: index records while
// the index form can still win (4 * count <= bitmap bytes); past that the records so far become
// the bitmap and its values, and the pass goes on in the bitmap form; once even that is not
// smaller than the bucket, it only counts. With `checksums`, both checksum sums too, chunk by
// chunk so the checksums and the diff read each chunk from cache. Leaves *out holding the
// payload after kDeltaHeaderBytes (header unwritten), or empty for kFull. With `advance` (the
// writable base), each changed word is written there as it is found, while it is in cache: the
// base ends holding next's bytes whatever the form.
template <int E>
DeltaSize EncodeBody(const std::byte* b, const std::byte* x, size_t n, std::vector<std::byte>* out,
                     bool checksums, EncodeSums* sums, std::byte* advance) {
  constexpr size_t kRecord = kIndexBytes + E;
  const uint64_t elements = n / E;
  const uint64_t nbits = BitmapBytes(elements);
  const uint64_t index_limit = nbits / kIndexBytes;
  enum class Form { kIndex, kBitmap, kCount } form = Form::kIndex;
  out->resize(kDeltaHeaderBytes + std::min<uint64_t>(index_limit, 4096) * kRecord + 8);
  size_t used = kDeltaHeaderBytes;  // index: records end; bitmap: values end
  uint64_t changed = 0;
  // The records so far become the bitmap and its values, in place in *out (no allocation once
  // the caller's buffer grew to such a size before): the records move up past the bitmap, which
  // is zeroed, then compact into the values (value k is written at or before record k's place).
  auto to_bitmap = [&] {
    const size_t records = used - kDeltaHeaderBytes;
    const size_t count = records / kRecord;
    const size_t vals = kDeltaHeaderBytes + nbits;
    out->resize(std::max(out->size(), vals + records + 64 + 16));
    std::memmove(out->data() + vals, out->data() + kDeltaHeaderBytes, records);
    std::memset(out->data() + kDeltaHeaderBytes, 0, nbits);
    std::byte* bits = out->data() + kDeltaHeaderBytes;
    for (size_t k = 0; k < count; ++k) {
      const std::byte* rec = out->data() + vals + k * kRecord;
      const uint32_t i = Get<uint32_t>(rec);
      bits[i / 8] |= std::byte(1u << (i % 8));
      std::memmove(out->data() + vals + k * E, rec + kIndexBytes, E);
    }
    used = vals + count * E;
    form = Form::kBitmap;
  };
  // Elements idx + k for the bits k of `m` changed, their new values at `at` + k * E; idx is a
  // multiple of 8 unless `m` is one bit (bitmap bytes are whole).
  auto found = [&](uint64_t idx, uint64_t m, const std::byte* at) {
    changed += Popcount64(m);
    if (form == Form::kIndex) {
      for (uint64_t r = m; r != 0; r &= r - 1) {
        if (used + kRecord > out->size()) out->resize(2 * out->size());
        const int k = std::countr_zero(r);
        Put<uint32_t>(out->data() + used, static_cast<uint32_t>(idx + k));
        Put<Elem<E>>(out->data() + used + kIndexBytes, Get<Elem<E>>(at + k * E));
        used += kRecord;
      }
      if (changed > index_limit) to_bitmap();
      return;
    }
    if (form == Form::kCount) return;
    if (kDeltaHeaderBytes + nbits + changed * E >= n) {  // even the bitmap form is not smaller
      form = Form::kCount;
      return;
    }
    if (used + 64 + 16 > out->size()) out->resize(2 * out->size());
    std::byte* bits = out->data() + kDeltaHeaderBytes;
    if (m == 1) {
      bits[idx / 8] |= std::byte(1u << (idx % 8));
    } else {
      for (uint64_t r = m, k = idx / 8; r != 0; r >>= 8, ++k) bits[k] |= std::byte(r & 0xFF);
    }
    for (uint64_t r = m; r != 0; r &= r - 1) {
      Put<Elem<E>>(out->data() + used, Get<Elem<E>>(at + std::countr_zero(r) * E));
      used += E;
    }
  };
  auto diff = [&](size_t begin, size_t end) {
    ForEachChangedBlock<E>(b, x, begin, end, [&](size_t o, uint64_t m) {
      if (advance != nullptr) std::memcpy(advance + o, x + o, 64);
      found(o / E, m, x + o);
    });
  };
  const size_t blocks = n & ~size_t{63};
  if (checksums) {
    for (size_t c = 0; c < n; c += kChunk) {
      const size_t len = std::min(kChunk, n - c);
      sums->base += ChecksumPartial(b + c, len, c);
      sums->next += ChecksumPartial(x + c, len, c);
      diff(c, std::min(c + len, blocks));
    }
  } else {
    diff(0, blocks);
  }
  ForEachChanged<E>(b, x, blocks, n, [&](uint64_t i) {
    if (advance != nullptr) Put<Elem<E>>(advance + i * E, Get<Elem<E>>(x + i * E));
    found(i, 1, x + i * E);
  });
  sums->changed = changed;
  const DeltaSize size = DeltaEncodedBytes(elements, E, changed);
  if (size.kind == DeltaKind::kFull)
    out->clear();
  else
    out->resize(used);  // the size rule's bytes (checked by the caller)
  return size;
}

// EncodeDelta and EncodeDeltaAdvance: `advance` null (base only read, checksums computed) or the
// writable base (checksums given in `known`).
Result<DeltaEncodeResult> Encode(std::span<const std::byte> base, std::span<const std::byte> next,
                                 std::byte* advance, const EncodeSums* known, int element_size,
                                 uint64_t base_version, std::string_view bucket,
                                 std::vector<std::byte>* out) {
  out->clear();
  if (!ValidElementSize(element_size))
    return InvalidArgumentError(fmt::format(
        "delta of bucket {}: element_size must be 1, 2 or 4, got {}", bucket, element_size));
  if (base.size() != next.size())
    return InvalidArgumentError(fmt::format("delta of bucket {}: base is {} bytes, new is {}",
                                            bucket, base.size(), next.size()));
  const size_t n = next.size();
  const int e = element_size;
  if (n % e != 0)
    return InvalidArgumentError(fmt::format(
        "delta of bucket {}: {} bytes is not a multiple of element_size {}", bucket, n, e));
  const uint64_t elements = n / e;
  if (elements > kDeltaMaxElements)
    return InvalidArgumentError(
        fmt::format("delta of bucket {}: {} elements, the codec's indices hold at most {}", bucket,
                    elements, kDeltaMaxElements));

  DeltaEncodeResult r;
  r.elements = elements;
  EncodeSums sums;
  const std::byte* b = base.data();
  const std::byte* x = next.data();
  const bool compute = known == nullptr;
  const DeltaSize size = e == 1   ? EncodeBody<1>(b, x, n, out, compute, &sums, advance)
                         : e == 2 ? EncodeBody<2>(b, x, n, out, compute, &sums, advance)
                                  : EncodeBody<4>(b, x, n, out, compute, &sums, advance);
  r.changed = sums.changed;
  r.kind = size.kind;
  if (size.kind == DeltaKind::kFull) return r;
  r.base_checksum = compute ? ChecksumFinish(sums.base, n) : known->base;
  r.new_checksum = compute ? ChecksumFinish(sums.next, n) : known->next;
  const uint64_t changed = sums.changed;
  std::byte* h = out->data();
  Put<uint32_t>(h, kMagic);
  Put<uint8_t>(h + 4, kFormat);
  Put<uint8_t>(h + 5, static_cast<uint8_t>(size.kind));
  Put<uint8_t>(h + 6, static_cast<uint8_t>(e));
  Put<uint8_t>(h + 7, 0);
  Put<uint64_t>(h + 8, elements);
  Put<uint64_t>(h + 16, base_version);
  Put<uint64_t>(h + 24, r.base_checksum);
  Put<uint64_t>(h + 32, r.new_checksum);
  Put<uint64_t>(h + 40, changed);
  if (out->size() != size.bytes)
    return InternalError(fmt::format("delta of bucket {}: encoded {} bytes, the size rule says {}",
                                     bucket, out->size(), size.bytes));
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

}  // namespace shardsync
