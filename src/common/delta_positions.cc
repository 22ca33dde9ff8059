// The delta decoder's check of the packed form's positions (delta.h "Encoded form"; the other
// forms' checks are in delta.cc).
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "common/delta_internal.h"
#include "shardsync/delta.h"
#include "shardsync/delta_rule.h"

namespace shardsync::delta_internal {

// The packed form's positions (delta.h "Encoded form"), in DecodeDeltaInPlace's order: the running
// counts, the escapes' (element size 2), then tile by tile each subtile's count, the tile's sum,
// each record within its subtile, the tile's escaped value bytes; then the padding.
Status PackedPositions(const DeltaInfo& info, const std::byte* payload, std::string_view bucket,
                       uint16_t* offs_out) {
  auto bad = [&](std::string what) {
    return DataLossError(fmt::format("delta of bucket {}: malformed encoding: {}", bucket, what));
  };
  const uint64_t e = info.element_size, c = info.changed;
  const DeltaPackedLayout l = DeltaPackedPayload(info.elements, e, c, info.escapes);
  for (int pass = 0; pass < (e == 2 ? 2 : 1); ++pass) {
    const uint64_t at = pass == 0 ? 0 : l.escape_ends, want = pass == 0 ? c : info.escapes;
    const char* what = pass == 0 ? "" : "escape ";
    uint64_t prev = 0;
    for (uint64_t t = 0; t < l.tiles; ++t) {
      const uint32_t end = Get<uint32_t>(payload + at + 4 * t);
      if (end < prev)
        return bad(fmt::format("tile {}: running {}count {} below the previous tile's {}", t, what,
                               end, prev));
      prev = end;
    }
    if (l.tiles > 0 && prev != want)
      return bad(fmt::format("tile {}: running {}count {}, the {} says {}", l.tiles - 1, what, prev,
                             pass == 0 ? "count" : "length", want));
  }
  // Every running count is now at most the count (the escapes' at most the escapes).
  const uint64_t spt = l.tile_elems / kDeltaSubtileElems;
  const std::byte* subs = payload + l.subs;
  const std::byte* offs = payload + l.offsets;
  const std::byte* vals = payload + l.values;
  for (uint64_t t = 0, k = 0; t < l.tiles; ++t) {
    const uint64_t end = Get<uint32_t>(payload + 4 * t);
    const uint64_t s0 = t * spt, s1 = std::min(s0 + spt, l.subtiles);
    uint64_t sum = 0;
    for (uint64_t sb = s0; sb < s1; ++sb) {
      const uint64_t m = std::min(kDeltaSubtileElems, info.elements - sb * kDeltaSubtileElems);
      const uint64_t cs = static_cast<uint8_t>(subs[sb]);
      if (cs > m) return bad(fmt::format("subtile {}: count {} over its {} elements", sb, cs, m));
      sum += cs;
    }
    if (sum != end - k)
      return bad(fmt::format("tile {}: subtile counts sum to {}, the running counts say {}", t, sum,
                             end - k));
    const uint64_t first = k;
    for (uint64_t sb = s0; sb < s1; ++sb) {
      const uint64_t m = std::min(kDeltaSubtileElems, info.elements - sb * kDeltaSubtileElems);
      uint64_t last = 0;
      for (const uint64_t stop = k + static_cast<uint8_t>(subs[sb]), from = k; k < stop; ++k) {
        const uint64_t off = static_cast<uint8_t>(offs[k]);
        if (off >= m)
          return bad(fmt::format("record {}: element {} of subtile {} out of range [0, {})", k, off,
                                 sb, m));
        if (k > from && off <= last)
          return bad(fmt::format("record {}: element {} of subtile {} not above the previous {}", k,
                                 off, sb, last));
        last = off;
        offs_out[k] = static_cast<uint16_t>((sb - s0) * kDeltaSubtileElems + off);
      }
    }
    if (e == 2) {
      const uint64_t e0 = t > 0 ? Get<uint32_t>(payload + l.escape_ends + 4 * (t - 1)) : 0;
      const uint64_t e1 = Get<uint32_t>(payload + l.escape_ends + 4 * t);
      uint64_t n = 0;
      for (uint64_t j = first; j < end; ++j) n += vals[j] == std::byte{kDeltaEscape};
      if (n != e1 - e0)
        return bad(fmt::format("tile {}: {} escaped values, the running escape counts say {}", t, n,
                               e1 - e0));
    }
  }
  if (l.escapes > l.values + c && payload[l.values + c] != std::byte{0})
    return bad(fmt::format("packed padding byte {} not zero", l.values + c));
  return OkStatus();
}

}  // namespace shardsync::delta_internal
