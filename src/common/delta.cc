// The delta codec of delta.h. Hand-written (no Debian library diffs a buffer against a base the
// receiver holds, nor names the base); the format and the size rule are in the header.
#include "shardsync/delta.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "shardsync/checksum.h"

namespace shardsync {
namespace {

constexpr uint32_t kMagic = 0x4C445353;  // "SSDL" little-endian
constexpr uint8_t kFormat = 1;
constexpr size_t kChunk = size_t{64} << 10;  // checksum + diff chunk: both stay in L2
constexpr uint64_t kIndexBytes = 4;

bool ValidElementSize(int e) { return e == 1 || e == 2 || e == 4; }

uint64_t BitmapBytes(uint64_t elements) { return (elements + 7) / 8; }

template <typename T>
void Put(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

bool ElementEqual(const std::byte* a, const std::byte* b, int e) {
  switch (e) {
    case 1:
      return *a == *b;
    case 2:
      return Get<uint16_t>(a) == Get<uint16_t>(b);
    default:
      return Get<uint32_t>(a) == Get<uint32_t>(b);
  }
}

// Calls f(element index) for every element of [begin, end) (byte offsets, element aligned) that
// differs, comparing 8 bytes at a time first: at RL densities most words are equal.
template <typename F>
void ForEachChanged(const std::byte* base, const std::byte* next, size_t begin, size_t end, int e,
                    F&& f) {
  size_t o = begin;
  for (; o + 8 <= end; o += 8) {
    if (Get<uint64_t>(base + o) == Get<uint64_t>(next + o)) continue;
    for (size_t k = o; k < o + 8; k += e)
      if (!ElementEqual(base + k, next + k, e)) f(k / e);
  }
  for (; o < end; o += e)
    if (!ElementEqual(base + o, next + o, e)) f(o / e);
}

}  // namespace

std::string_view DeltaKindName(DeltaKind kind) {
  switch (kind) {
    case DeltaKind::kFull:
      return "full";
    case DeltaKind::kIndex:
      return "index";
    case DeltaKind::kBitmap:
      return "bitmap";
  }
  return "unknown";
}

DeltaSize DeltaEncodedBytes(uint64_t elements, int element_size, uint64_t changed) {
  const uint64_t e = static_cast<uint64_t>(element_size);
  const uint64_t full = elements * e;
  changed = std::min(changed, elements);
  // Both forms carry the changed values; they differ in how positions are named.
  const bool index = kIndexBytes * changed <= BitmapBytes(elements);
  const uint64_t bytes =
      kDeltaHeaderBytes + changed * e + (index ? kIndexBytes * changed : BitmapBytes(elements));
  if (bytes >= full) return {DeltaKind::kFull, full};
  return {index ? DeltaKind::kIndex : DeltaKind::kBitmap, bytes};
}

Result<DeltaEncodeResult> EncodeDelta(std::span<const std::byte> base,
                                      std::span<const std::byte> next, int element_size,
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
  // Pass 1, chunk by chunk so the checksums and the diff read each chunk from cache: both
  // checksums, the count, and the index records while the index form can still win.
  const uint64_t index_limit = BitmapBytes(elements) / kIndexBytes;
  const size_t record = kIndexBytes + e;
  out->reserve(kDeltaHeaderBytes + std::min<uint64_t>(index_limit, 1 << 16) * record);
  out->resize(kDeltaHeaderBytes);
  uint64_t sum_base = 0, sum_next = 0, changed = 0;
  const std::byte* b = base.data();
  const std::byte* x = next.data();
  for (size_t c = 0; c < n; c += kChunk) {
    const size_t len = std::min(kChunk, n - c);
    sum_base += ChecksumPartial(b + c, len, c);
    sum_next += ChecksumPartial(x + c, len, c);
    ForEachChanged(b, x, c, c + len, e, [&](uint64_t i) {
      if (++changed > index_limit) return;
      const size_t at = out->size();
      out->resize(at + record);
      Put<uint32_t>(out->data() + at, static_cast<uint32_t>(i));
      std::memcpy(out->data() + at + kIndexBytes, x + i * e, e);
    });
  }
  r.changed = changed;
  const DeltaSize size = DeltaEncodedBytes(elements, e, changed);
  r.kind = size.kind;
  if (size.kind == DeltaKind::kFull) {
    out->clear();
    return r;
  }
  r.base_checksum = ChecksumFinish(sum_base, n);
  r.new_checksum = ChecksumFinish(sum_next, n);
  if (size.kind == DeltaKind::kBitmap) {
    // Pass 2: the bitmap, then the values in element order.
    out->assign(size.bytes, std::byte{0});
    std::byte* bits = out->data() + kDeltaHeaderBytes;
    std::byte* vals = bits + BitmapBytes(elements);
    ForEachChanged(b, x, 0, n, e, [&](uint64_t i) {
      bits[i / 8] |= std::byte(1u << (i % 8));
      std::memcpy(vals, x + i * e, e);
      vals += e;
    });
  }
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

Result<DeltaInfo> InspectDelta(std::span<const std::byte> encoded, std::string_view bucket) {
  auto bad = [&](std::string what) {
    return DataLossError(fmt::format("delta of bucket {}: malformed encoding: {}", bucket, what));
  };
  if (encoded.size() < kDeltaHeaderBytes)
    return bad(fmt::format("{} bytes, shorter than the {}-byte header", encoded.size(),
                           kDeltaHeaderBytes));
  const std::byte* h = encoded.data();
  if (Get<uint32_t>(h) != kMagic) return bad(fmt::format("magic {:#x}", Get<uint32_t>(h)));
  if (Get<uint8_t>(h + 4) != kFormat) return bad(fmt::format("format {}", Get<uint8_t>(h + 4)));
  DeltaInfo info;
  const uint8_t kind = Get<uint8_t>(h + 5);
  if (kind != static_cast<uint8_t>(DeltaKind::kIndex) &&
      kind != static_cast<uint8_t>(DeltaKind::kBitmap))
    return bad(fmt::format("kind {}", kind));
  info.kind = static_cast<DeltaKind>(kind);
  info.element_size = Get<uint8_t>(h + 6);
  if (!ValidElementSize(info.element_size))
    return bad(fmt::format("element_size {}", info.element_size));
  if (Get<uint8_t>(h + 7) != 0) return bad("reserved byte 7 not zero");
  info.elements = Get<uint64_t>(h + 8);
  info.base_version = Get<uint64_t>(h + 16);
  info.base_checksum = Get<uint64_t>(h + 24);
  info.new_checksum = Get<uint64_t>(h + 32);
  info.changed = Get<uint64_t>(h + 40);
  if (info.elements > kDeltaMaxElements)
    return bad(fmt::format("elements {} over the limit {}", info.elements, kDeltaMaxElements));
  if (info.changed > info.elements)
    return bad(fmt::format("count {} over elements {}", info.changed, info.elements));
  // elements < 2^32 and changed <= elements: no product below overflows 64 bits.
  const uint64_t e = info.element_size;
  const uint64_t payload = info.kind == DeltaKind::kIndex
                               ? info.changed * (kIndexBytes + e)
                               : BitmapBytes(info.elements) + info.changed * e;
  if (encoded.size() - kDeltaHeaderBytes != payload)
    return bad(fmt::format("{} payload bytes, the header's {} form of {} changes needs {}",
                           encoded.size() - kDeltaHeaderBytes, DeltaKindName(info.kind),
                           info.changed, payload));
  return info;
}

Status DecodeDeltaInPlace(std::span<const std::byte> encoded, std::span<std::byte> bucket,
                          const DeltaExpect& expect) {
  SS_ASSIGN_OR_RETURN(const DeltaInfo info, InspectDelta(encoded, expect.bucket));
  const std::string_view name = expect.bucket;
  if (info.element_size != expect.element_size)
    return InvalidArgumentError(
        fmt::format("delta of bucket {}: element_size {} in the encoding, the receiver's is {}",
                    name, info.element_size, expect.element_size));
  const uint64_t e = info.element_size;
  if (bucket.size() % e != 0 || bucket.size() / e != info.elements)
    return InvalidArgumentError(fmt::format(
        "delta of bucket {}: the encoding covers {} elements of {} bytes, the receiver's bucket "
        "is {} bytes",
        name, info.elements, e, bucket.size()));
  if (info.base_version != expect.base_version)
    return FailedPreconditionError(fmt::format(
        "delta of bucket {}: computed against base version {}, the receiver holds version {}: "
        "not applied",
        name, info.base_version, expect.base_version));
  const size_t n = bucket.size();
  std::byte* data = bucket.data();
  const uint64_t base_sum = ChecksumPartial(data, n, 0);
  const uint64_t have = ChecksumFinish(base_sum, n);
  if (have != info.base_checksum)
    return FailedPreconditionError(fmt::format(
        "delta of bucket {}: base_checksum {:#018x} (version {}), the receiver's bytes have "
        "{:#018x}: not applied",
        name, info.base_checksum, info.base_version, have));

  // Validate every position and predict the result's checksum before writing anything: the
  // checksum is a sum of per-word terms, so the result's sum is the base's with the terms of
  // the changed words replaced. Positions are visited in increasing order, so each changed word
  // is finished before the next one starts.
  const std::byte* payload = encoded.data() + kDeltaHeaderBytes;
  uint64_t sum = base_sum;
  uint64_t word_at = UINT64_MAX;  // byte offset of the word being patched
  uint64_t word = 0;
  auto word_of = [&](uint64_t at) {
    uint64_t w = 0;
    std::memcpy(&w, data + at, std::min<uint64_t>(8, n - at));
    return w;
  };
  auto patch = [&](uint64_t i, const std::byte* value) {
    const uint64_t at = i * e / 8 * 8;
    if (at != word_at) {
      if (word_at != UINT64_MAX)
        sum += ChecksumMixWord(word, word_at / 8) - ChecksumMixWord(word_of(word_at), word_at / 8);
      word_at = at;
      word = word_of(at);
    }
    std::memcpy(reinterpret_cast<std::byte*>(&word) + (i * e - at), value, e);
  };
  auto finish = [&] {
    if (word_at != UINT64_MAX)
      sum += ChecksumMixWord(word, word_at / 8) - ChecksumMixWord(word_of(word_at), word_at / 8);
  };
  auto bad = [&](std::string what) {
    return DataLossError(fmt::format("delta of bucket {}: malformed encoding: {}", name, what));
  };

  const std::byte* bits = payload;  // bitmap form: the bitmap, then the values
  const std::byte* vals =
      payload + (info.kind == DeltaKind::kBitmap ? BitmapBytes(info.elements) : 0);
  if (info.kind == DeltaKind::kIndex) {
    const size_t record = kIndexBytes + e;
    int64_t prev = -1;
    for (uint64_t k = 0; k < info.changed; ++k) {
      const uint32_t i = Get<uint32_t>(payload + k * record);
      if (i >= info.elements)
        return bad(fmt::format("record {}: index {} out of range [0, {})", k, i, info.elements));
      if (static_cast<int64_t>(i) <= prev)
        return bad(fmt::format("record {}: index {} not above the previous {}", k, i, prev));
      prev = i;
      patch(i, payload + k * record + kIndexBytes);
    }
  } else {
    const uint64_t nbits = BitmapBytes(info.elements);
    const unsigned tail = info.elements % 8;
    if (tail != 0 && (static_cast<unsigned>(bits[nbits - 1]) >> tail) != 0)
      return bad(fmt::format("bitmap bits set past element {}", info.elements));
    uint64_t count = 0;
    for (uint64_t j = 0; j < nbits; ++j) count += std::popcount(static_cast<unsigned>(bits[j]));
    if (count != info.changed)
      return bad(fmt::format("bitmap has {} bits set, the count says {}", count, info.changed));
    uint64_t k = 0;
    for (uint64_t j = 0; j < nbits; ++j)
      for (unsigned m = static_cast<unsigned>(bits[j]); m != 0; m &= m - 1)
        patch(j * 8 + std::countr_zero(m), vals + e * k++);
  }
  finish();
  if (ChecksumFinish(sum, n) != info.new_checksum)
    return DataLossError(fmt::format(
        "delta of bucket {}: the result's checksum {:#018x} is not the sender's new_checksum "
        "{:#018x} (corrupt values): not applied",
        name, ChecksumFinish(sum, n), info.new_checksum));

  // Apply: everything checked.
  if (info.kind == DeltaKind::kIndex) {
    const size_t record = kIndexBytes + e;
    for (uint64_t k = 0; k < info.changed; ++k)
      std::memcpy(data + uint64_t{Get<uint32_t>(payload + k * record)} * e,
                  payload + k * record + kIndexBytes, e);
  } else {
    uint64_t k = 0;
    for (uint64_t j = 0; j < BitmapBytes(info.elements); ++j)
      for (unsigned m = static_cast<unsigned>(bits[j]); m != 0; m &= m - 1)
        std::memcpy(data + (j * 8 + std::countr_zero(m)) * e, vals + e * k++, e);
  }
  return OkStatus();
}

Result<DeltaCost> EstimateDeltaCost(const DeltaCostInput& in) {
  if (!ValidElementSize(in.element_size))
    return InvalidArgumentError(
        fmt::format("delta cost: element_size must be 1, 2 or 4, got {}", in.element_size));
  if (in.bucket_bytes % in.element_size != 0)
    return InvalidArgumentError(
        fmt::format("delta cost: bucket_bytes {} is not a multiple of element_size {}",
                    in.bucket_bytes, in.element_size));
  if (!std::isfinite(in.density) || in.density < 0 || in.density > 1)
    return InvalidArgumentError(
        fmt::format("delta cost: density must be in [0, 1], got {}", in.density));
  for (auto [name, v] :
       {std::pair{"link_gbps", in.link_gbps}, std::pair{"encode_gbps", in.encode_gbps},
        std::pair{"decode_gbps", in.decode_gbps}})
    if (!std::isfinite(v) || v <= 0)
      return InvalidArgumentError(
          fmt::format("delta cost: {} must be positive and finite, got {}", name, v));
  const uint64_t elements = in.bucket_bytes / in.element_size;
  const uint64_t changed =
      static_cast<uint64_t>(std::llround(in.density * static_cast<double>(elements)));
  const DeltaSize size = DeltaEncodedBytes(elements, in.element_size, changed);
  DeltaCost c;
  c.kind = size.kind;
  c.full_bytes = in.bucket_bytes;
  c.wire_bytes = size.bytes;
  const double f = static_cast<double>(in.bucket_bytes);
  c.full_seconds = f / (in.link_gbps * 1e9);
  if (size.kind == DeltaKind::kFull) {
    c.delta_seconds = c.full_seconds;  // the encoder sends the bucket whole
    return c;
  }
  const double enc = f / (in.encode_gbps * 1e9), dec = f / (in.decode_gbps * 1e9);
  const double wire = static_cast<double>(size.bytes) / (in.link_gbps * 1e9);
  c.delta_seconds = in.overlap ? std::max({enc, wire, dec}) : enc + wire + dec;
  c.pays = c.delta_seconds < c.full_seconds;
  // Serial: pays while enc + dec < (f - w) / L. Overlapped: while L < min(encode, decode).
  const double saved = 1.0 - static_cast<double>(size.bytes) / f;
  c.break_even_link_gbps = in.overlap ? std::min(in.encode_gbps, in.decode_gbps)
                                      : saved / (1.0 / in.encode_gbps + 1.0 / in.decode_gbps);
  return c;
}

}  // namespace shardsync
