// Fuzzes the delta codec (include/shardsync/delta.h), both directions.
// Properties: decoding arbitrary bytes over a bucket never crashes; a refused delta leaves the
// bucket untouched; an accepted one leaves bytes whose checksum is the header's new_checksum.
// Encoding two arbitrary halves and decoding the result over the first gives the second.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "shardsync/checksum.h"
#include "shardsync/delta.h"

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
  return 0;
}
