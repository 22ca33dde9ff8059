// Fuzzes the delta codec (include/shardsync/delta.h), both directions.
// Properties: decoding arbitrary bytes over a bucket never crashes; a refused delta leaves the
// bucket untouched; an accepted one leaves bytes whose checksum is the header's new_checksum.
// Encoding two arbitrary halves and decoding the result over the first gives the second.
// The rest laid out as an index payload, and as a packed one, under a valid format-3 header
// (right base checksum, the count its last running count, the escapes the last of theirs): the
// decoder calls it malformed exactly when a plain reading of the format says so, and only the
// result checksum refuses a well-formed one (random bytes alone rarely get past the running
// counts).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "shardsync/checksum.h"
#include "shardsync/delta.h"
#include "shardsync/delta_rule.h"

namespace {

using shardsync::DeltaIndexLayout;
using shardsync::DeltaPackedLayout;

template <typename T>
T Load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// delta.h "Encoded form" read plainly: running counts non-decreasing ending at the count, each
// tile's offsets increasing and in the tile, zero padding.
bool WellFormed(const std::byte* p, const DeltaIndexLayout& l, uint64_t elements, uint64_t count) {
  uint64_t from = 0;
  for (uint64_t t = 0; t < l.tiles; ++t) {
    const uint64_t end = Load<uint32_t>(p + 4 * t);
    if (end < from || end > count) return false;
    const uint64_t n = std::min(l.tile_elems, elements - t * l.tile_elems);
    for (uint64_t k = from; k < end; ++k) {
      const uint16_t off = Load<uint16_t>(p + l.offsets + 2 * k);
      if (off >= n || (k > from && off <= Load<uint16_t>(p + l.offsets + 2 * (k - 1))))
        return false;
    }
    from = end;
  }
  if (from != count) return false;
  for (uint64_t i = l.offsets + 2 * count; i < l.values; ++i)
    if (p[i] != std::byte{0}) return false;
  return true;
}

// The packed form read plainly: running counts (changes, escapes) non-decreasing ending at the
// count and the escapes; per tile, each subtile's count within its elements and their sum the
// tile's changes, offsets increasing within a subtile and inside it, the escaped value bytes the
// tile's escapes; the padding byte zero.
bool WellFormedPacked(const std::byte* p, const DeltaPackedLayout& l, int e, uint64_t elements,
                      uint64_t count, uint64_t escapes) {
  uint64_t from = 0, efrom = 0;
  const uint64_t spt = l.tile_elems / shardsync::kDeltaSubtileElems;
  for (uint64_t t = 0; t < l.tiles; ++t) {
    const uint64_t end = Load<uint32_t>(p + 4 * t);
    const uint64_t eend = e == 2 ? Load<uint32_t>(p + l.escape_ends + 4 * t) : 0;
    if (end < from || end > count || eend < efrom || eend > escapes) return false;
    uint64_t k = from, sum = 0, n_esc = 0;
    for (uint64_t sb = t * spt; sb < std::min((t + 1) * spt, l.subtiles); ++sb) {
      const uint64_t m = std::min<uint64_t>(128, elements - sb * 128);
      const uint64_t cs = static_cast<uint8_t>(p[l.subs + sb]);
      if (cs > m) return false;
      sum += cs;
      if (k + cs > end) return false;
      for (uint64_t q = 0; q < cs; ++q, ++k) {
        const auto off = static_cast<uint8_t>(p[l.offsets + k]);
        if (off >= m || (q > 0 && off <= static_cast<uint8_t>(p[l.offsets + k - 1]))) return false;
        n_esc += e == 2 && p[l.values + k] == std::byte{shardsync::kDeltaEscape};
      }
    }
    if (sum != end - from || n_esc != eend - efrom) return false;
    from = end;
    efrom = eend;
  }
  if (from != count || efrom != escapes) return false;
  return l.escapes == l.values + count || p[l.values + count] == std::byte{0};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardsync;
  if (size < 3) return 0;
  const int e = 1 << (data[0] % 3);
  const size_t split = data[1] | size_t{data[2]} << 8;
  const std::byte* p = reinterpret_cast<const std::byte*>(data + 3);
  size = size - 3;
  const size_t base_len = (std::min(split, size) / e) * e;
  std::vector<std::byte> base(p, p + base_len);
  std::vector<std::byte> rest(p + base_len, p + size);

  // 1. The rest as an encoding over the base.
  std::vector<std::byte> bucket = base;
  Status s = DecodeDeltaInPlace(rest, bucket, {"fuzz", e, 0});
  if (!s.ok() && bucket != base) __builtin_trap();
  if (s.ok()) {
    auto info = InspectDelta(rest, "fuzz");
    if (!info.ok() || Checksum(bucket.data(), bucket.size()) != info->new_checksum)
      __builtin_trap();
  }

  // 2. Round trip: base against the rest cut to the base's length (padded with the base).
  std::vector<std::byte> next = base;
  std::memcpy(next.data(), rest.data(), std::min(rest.size(), next.size()));
  std::vector<std::byte> enc;
  auto r = EncodeDelta(base, next, e, 5, "fuzz", &enc);
  if (!r.ok()) __builtin_trap();
  if (r->kind != DeltaKind::kFull) {
    bucket = base;
    if (!DecodeDeltaInPlace(enc, bucket, {"fuzz", e, 5}).ok() || bucket != next) __builtin_trap();
  }

  // 3. The rest as an index payload (cut or zero-padded to its layout's length).
  const uint64_t elements = base.size() / e;
  const uint64_t tiles = DeltaIndexPayload(elements, e, 0).tiles;
  if (tiles == 0 || rest.size() < 4 * tiles) return 0;
  const uint64_t count = Load<uint32_t>(rest.data() + 4 * (tiles - 1));
  if (count > elements) return 0;
  const DeltaIndexLayout l = DeltaIndexPayload(elements, e, count);
  std::vector<std::byte> d(kDeltaHeaderBytes + l.bytes);
  std::memcpy(d.data() + kDeltaHeaderBytes, rest.data(), std::min<size_t>(rest.size(), l.bytes));
  const uint32_t magic = 0x4C445353;  // "SSDL"
  const uint64_t version = 5, base_sum = Checksum(base.data(), base.size()), new_sum = 0;
  std::memcpy(d.data(), &magic, 4);
  d[4] = std::byte{3};  // format
  d[5] = std::byte{1};  // index
  d[6] = static_cast<std::byte>(e);
  std::memcpy(d.data() + 8, &elements, 8);
  std::memcpy(d.data() + 16, &version, 8);
  std::memcpy(d.data() + 24, &base_sum, 8);
  std::memcpy(d.data() + 32, &new_sum, 8);
  std::memcpy(d.data() + 40, &count, 8);
  bucket = base;
  s = DecodeDeltaInPlace(d, bucket, {"fuzz", e, 5});
  if (!s.ok() && bucket != base) __builtin_trap();
  const bool malformed = s.message().find("malformed") != std::string::npos;
  const bool well = WellFormed(d.data() + kDeltaHeaderBytes, l, elements, count);
  if (!s.ok() && malformed == well) __builtin_trap();
  if (s.ok() && (!well || Checksum(bucket.data(), bucket.size()) != new_sum)) __builtin_trap();

  // 4. The rest as a packed payload (element sizes 1 and 2), the same way.
  if (e == 4) return 0;
  const uint64_t ptiles = DeltaPackedPayload(elements, e, 0, 0).tiles;
  if (rest.size() < (e == 2 ? 8 : 4) * ptiles) return 0;
  const uint64_t pcount = Load<uint32_t>(rest.data() + 4 * (ptiles - 1));
  const uint64_t pesc = e == 2 ? Load<uint32_t>(rest.data() + 4 * ptiles + 4 * (ptiles - 1)) : 0;
  if (!DeltaPackedAllowed(elements, e, pcount) || pesc > pcount) return 0;
  const DeltaPackedLayout pl = DeltaPackedPayload(elements, e, pcount, pesc);
  std::vector<std::byte> q(kDeltaHeaderBytes + pl.bytes);
  std::memcpy(q.data() + kDeltaHeaderBytes, rest.data(), std::min<size_t>(rest.size(), pl.bytes));
  std::memcpy(q.data(), d.data(), kDeltaHeaderBytes);
  q[5] = std::byte{3};  // packed
  std::memcpy(q.data() + 40, &pcount, 8);
  bucket = base;
  s = DecodeDeltaInPlace(q, bucket, {"fuzz", e, 5});
  if (!s.ok() && bucket != base) __builtin_trap();
  const bool pmalformed = s.message().find("malformed") != std::string::npos;
  const bool pwell = WellFormedPacked(q.data() + kDeltaHeaderBytes, pl, e, elements, pcount, pesc);
  if (!s.ok() && pmalformed == pwell) __builtin_trap();
  if (s.ok() && (!pwell || Checksum(bucket.data(), bucket.size()) != new_sum)) __builtin_trap();
  return 0;
}
