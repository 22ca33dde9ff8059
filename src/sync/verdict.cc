// A rank's verdict of one sync as a store value: "SSV1 rank ok send recv seconds checksums_ok
// checksums_total|error". Every rank writes one and reads every other rank's on each sync's
// critical path, so it is a short line parsed with from_chars rather than JSON.
#include <charconv>
#include <iterator>
#include <string>
#include <string_view>

#include "sync/verdict_codec.h"

namespace shardsync::sync_internal {
namespace {

constexpr std::string_view kVerdictMagic = "SSV1";
constexpr size_t kFields = 8;  // magic and the seven numbers before '|'

template <typename T>
void Append(std::string* out, T v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  out->push_back(' ');
  out->append(buf, ec == std::errc() ? end : buf);
}

template <typename T>
bool Parse(std::string_view field, T* v) {
  if (field.empty()) return false;
  auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), *v);
  return ec == std::errc() && end == field.data() + field.size();
}

}  // namespace

std::string EncodeVerdict(const RankSyncStats& s) {
  std::string out(kVerdictMagic);
  out.reserve(96 + s.error.size());
  Append(&out, s.rank);
  Append(&out, s.ok ? 1 : 0);
  Append(&out, s.send_bytes);
  Append(&out, s.recv_bytes);
  Append(&out, s.seconds);  // shortest text that reads back to the same double
  Append(&out, s.checksums_ok);
  Append(&out, s.checksums_total);
  // The delta figures (encoding delta / auto) as one optional field: "D:" and 14 numbers.
  const DeltaSyncStats& d = s.delta;
  if (d.wire_bytes || d.full_bytes || d.buckets_delta || d.buckets_full) {
    out += " D:";
    std::string nums;
    for (int64_t v : {d.wire_bytes, d.full_bytes, d.changed, d.elements, d.buckets_delta,
                      d.buckets_full, d.fallback_no_image, d.fallback_version, d.fallback_checksum,
                      d.full_by_size, d.full_by_cost, d.full_by_auto})
      Append(&nums, v);
    Append(&nums, d.encode_seconds);
    Append(&nums, d.decode_seconds);
    for (char& c : nums) c = c == ' ' ? ',' : c;
    out += nums.substr(1);
  }
  out.push_back('|');
  out += s.error;
  return out;
}

Result<RankSyncStats> DecodeVerdict(std::string_view text, int rank) {
  auto bad = [&](std::string_view why) {
    return DataLossError("sync report of rank " + std::to_string(rank) +
                         " is malformed: " + std::string(why));
  };
  const size_t bar = text.find('|');
  if (bar == std::string_view::npos) return bad("no '|' before the error text");
  std::string_view head = text.substr(0, bar);
  // The optional delta field (EncodeVerdict) goes last.
  std::string_view delta;
  if (const size_t d = head.rfind(" D:"); d != std::string_view::npos) {
    delta = head.substr(d + 3);
    head = head.substr(0, d);
  }
  std::string_view f[kFields];
  for (size_t i = 0; i < kFields; ++i) {
    const size_t sp = head.find(' ');
    if ((sp == std::string_view::npos) != (i + 1 == kFields)) {
      return bad("expected " + std::to_string(kFields) + " space-separated fields before '|'");
    }
    f[i] = head.substr(0, sp);
    head = sp == std::string_view::npos ? std::string_view() : head.substr(sp + 1);
  }
  if (f[0] != kVerdictMagic) return bad("does not start with " + std::string(kVerdictMagic));
  RankSyncStats s;
  int ok = -1;
  if (!Parse(f[1], &s.rank)) return bad("rank is not an integer");
  if (!Parse(f[2], &ok) || (ok != 0 && ok != 1)) return bad("ok is not 0 or 1");
  if (!Parse(f[3], &s.send_bytes) || !Parse(f[4], &s.recv_bytes) || s.send_bytes < 0 ||
      s.recv_bytes < 0) {
    return bad("byte counts are not non-negative integers");
  }
  if (!Parse(f[5], &s.seconds) || !(s.seconds >= 0)) return bad("seconds is not a number >= 0");
  if (!Parse(f[6], &s.checksums_ok) || !Parse(f[7], &s.checksums_total) || s.checksums_ok < 0 ||
      s.checksums_ok > s.checksums_total) {
    return bad("checksum counts are not 0 <= ok <= total");
  }
  if (!delta.empty()) {
    DeltaSyncStats& d = s.delta;
    int64_t* ints[] = {&d.wire_bytes,        &d.full_bytes,       &d.changed,
                       &d.elements,          &d.buckets_delta,    &d.buckets_full,
                       &d.fallback_no_image, &d.fallback_version, &d.fallback_checksum,
                       &d.full_by_size,      &d.full_by_cost,     &d.full_by_auto};
    double* reals[] = {&d.encode_seconds, &d.decode_seconds};
    size_t i = 0;
    for (; !delta.empty(); ++i) {
      const size_t comma = delta.find(',');
      const std::string_view v = delta.substr(0, comma);
      delta = comma == std::string_view::npos ? std::string_view() : delta.substr(comma + 1);
      const bool parsed = i < std::size(ints) ? Parse(v, ints[i]) && *ints[i] >= 0
                          : i < std::size(ints) + std::size(reals)
                              ? Parse(v, reals[i - std::size(ints)])
                              : false;
      if (!parsed)
        return bad("the delta field's number " + std::to_string(i + 1) + " is malformed");
    }
    if (i != std::size(ints) + std::size(reals)) return bad("the delta field has too few numbers");
  }
  s.ok = ok == 1;
  s.error = std::string(text.substr(bar + 1));
  if (s.rank != rank) {
    return DataLossError("sync report of rank " + std::to_string(rank) + " names rank " +
                         std::to_string(s.rank));
  }
  return s;
}

}  // namespace shardsync::sync_internal
