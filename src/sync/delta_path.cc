// The delta encoding's bookkeeping (delta_path.h): base advertisements, decisions, reasons.
#include "sync/delta_path.h"

#include <charconv>

#include "shardsync/settings.h"

namespace shardsync {

void DeltaSyncStats::Add(const DeltaSyncStats& o) {
  wire_bytes += o.wire_bytes;
  full_bytes += o.full_bytes;
  changed += o.changed;
  elements += o.elements;
  buckets_delta += o.buckets_delta;
  buckets_full += o.buckets_full;
  fallback_no_image += o.fallback_no_image;
  fallback_version += o.fallback_version;
  fallback_checksum += o.fallback_checksum;
  full_by_size += o.full_by_size;
  full_by_cost += o.full_by_cost;
  full_by_auto += o.full_by_auto;
  encode_seconds += o.encode_seconds;
  decode_seconds += o.decode_seconds;
  held_bytes += o.held_bytes;
  if (first_fallback.empty()) first_fallback = o.first_fallback;
}

namespace sync_internal {
namespace {

constexpr std::string_view kBasesMagic = "D1";

template <typename T>
bool ParseNum(std::string_view s, T* v, int base = 10) {
  if (s.empty()) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v, base);
  return ec == std::errc() && end == s.data() + s.size();
}

}  // namespace

std::string EncodeBases(const std::vector<std::pair<int, std::vector<BucketBase>>>& by_src) {
  std::string out(kBasesMagic);
  for (const auto& [src, bases] : by_src) {
    out += ' ' + std::to_string(src) + ':';
    for (size_t i = 0; i < bases.size(); ++i) {
      if (i) out += ',';
      out += std::to_string(bases[i].version) + '.' + Hex(bases[i].checksum);
    }
  }
  return out;
}

Result<std::vector<BucketBase>> ParseBases(std::string_view value, int src, size_t buckets,
                                           int receiver) {
  auto bad = [&](const std::string& why) {
    return DataLossError("the delta bases sync rank " + std::to_string(receiver) +
                         " advertised (its ready value) " + why);
  };
  if (value.substr(0, kBasesMagic.size()) != kBasesMagic)
    return bad("do not start with " + std::string(kBasesMagic) +
               " (is every rank on encoding "
               "delta?)");
  const std::string want = ' ' + std::to_string(src) + ':';
  const size_t at = value.find(want);
  if (at == std::string_view::npos)
    return bad("name no buckets from sync rank " + std::to_string(src));
  std::string_view list = value.substr(at + want.size());
  list = list.substr(0, list.find(' '));
  std::vector<BucketBase> out;
  while (!list.empty() && out.size() <= buckets) {
    const size_t comma = list.find(',');
    const std::string_view item = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    const size_t dot = item.find('.');
    BucketBase b;
    if (dot == std::string_view::npos || !ParseNum(item.substr(0, dot), &b.version) ||
        !ParseNum(item.substr(dot + 1), &b.checksum, 16))
      return bad("have a malformed base for bucket " + std::to_string(out.size()) +
                 " from sync rank " + std::to_string(src));
    out.push_back(b);
  }
  if (out.size() != buckets)
    return bad("list " + std::to_string(out.size()) + " buckets from sync rank " +
               std::to_string(src) + ", the plan has " + std::to_string(buckets));
  return out;
}

DeltaReason CheckBase(const KeptImage& kept, const BucketBase& base) {
  if (!kept.valid()) return DeltaReason::kNoImage;
  if (base.version != kept.version) return DeltaReason::kVersion;
  if (base.checksum != kept.checksum) return DeltaReason::kChecksum;
  return DeltaReason::kDelta;
}

std::string DescribeFallback(DeltaReason r, int dst, int bucket, const KeptImage& kept,
                             const BucketBase& base) {
  std::string s = "to sync rank " + std::to_string(dst) + ", bucket " + std::to_string(bucket) +
                  ": " + std::string(DeltaReasonText(r));
  if (r == DeltaReason::kVersion || r == DeltaReason::kChecksum) {
    s += " (it holds v" + std::to_string(base.version) + " " + Hex(base.checksum) + ", kept v" +
         std::to_string(kept.version) + " " + Hex(kept.checksum) + ")";
  }
  return s;
}

void CountBucket(DeltaSyncStats& st, DeltaReason r, int64_t wire, int64_t full) {
  st.wire_bytes += wire;
  st.full_bytes += full;
  if (r == DeltaReason::kDelta) {
    ++st.buckets_delta;
    return;
  }
  ++st.buckets_full;
  switch (r) {
    case DeltaReason::kNoImage:
      ++st.fallback_no_image;
      break;
    case DeltaReason::kVersion:
      ++st.fallback_version;
      break;
    case DeltaReason::kChecksum:
      ++st.fallback_checksum;
      break;
    case DeltaReason::kSize:
      ++st.full_by_size;
      break;
    case DeltaReason::kCost:
      ++st.full_by_cost;
      break;
    case DeltaReason::kDelta:
      break;
  }
}

namespace {
Result<DeltaLink> LinkFromKnobs(const char* link_knob, const char* encode_knob,
                                const char* decode_knob) {
  DeltaLink l;
  SS_ASSIGN_OR_RETURN(const int64_t link, IntKnob(link_knob));
  SS_ASSIGN_OR_RETURN(const int64_t enc, IntKnob(encode_knob));
  SS_ASSIGN_OR_RETURN(const int64_t dec, IntKnob(decode_knob));
  l.link_gbps = static_cast<double>(link) / 1e3;
  l.encode_gbps = static_cast<double>(enc) / 1e3;
  l.decode_gbps = static_cast<double>(dec) / 1e3;
  return l;
}
}  // namespace

Result<DeltaLink> DeltaLinkFromKnobs() {
  return LinkFromKnobs("SHARDSYNC_DELTA_LINK_MBPS", "SHARDSYNC_DELTA_ENCODE_MBPS",
                       "SHARDSYNC_DELTA_DECODE_MBPS");
}

Result<DeltaLink> DevicePairDeltaLink(std::string_view transport) {
  return LinkFromKnobs(
      transport == "cuda_ipc" ? "SHARDSYNC_DELTA_IPC_LINK_MBPS" : "SHARDSYNC_DELTA_LINK_MBPS",
      "SHARDSYNC_DELTA_DEVICE_ENCODE_MBPS", "SHARDSYNC_DELTA_DEVICE_DECODE_MBPS");
}

Result<bool> DeltaPays(const DeltaLink& link, uint64_t elements, int element_size,
                       uint64_t changed) {
  DeltaCostInput in;
  in.bucket_bytes = elements * static_cast<uint64_t>(element_size);
  in.density = elements ? static_cast<double>(changed) / static_cast<double>(elements) : 0;
  in.element_size = element_size;
  in.link_gbps = link.link_gbps;
  in.encode_gbps = link.encode_gbps;
  in.decode_gbps = link.decode_gbps;
  SS_ASSIGN_OR_RETURN(const DeltaCost c, EstimateDeltaCost(in));
  return c.pays;
}

Result<bool> DeltaCanPay(const DeltaLink& link) { return DeltaPays(link, uint64_t{1} << 30, 1, 0); }

Status DeltaAgreement(bool delta, std::string_view value, int self, int dst) {
  const bool theirs = value.substr(0, kBasesMagic.size()) == kBasesMagic;
  if (delta == theirs) return OkStatus();
  auto runs = [](bool d) { return d ? "with its delta steps" : "as encoding full"; };
  return FailedPreconditionError("encoding auto: sync rank " + std::to_string(self) +
                                 " runs the host path " + runs(delta) + ", sync rank " +
                                 std::to_string(dst) + " " + runs(theirs) +
                                 " (does SHARDSYNC_DELTA_LINK_MBPS, SHARDSYNC_DELTA_ENCODE_MBPS or "
                                 "SHARDSYNC_DELTA_DECODE_MBPS differ between them?)");
}

Status CheckDeltaControl(const Control& d, const std::string& where, int64_t bucket_bytes) {
  const auto form = static_cast<DeltaKind>(d.form);
  if (d.form > static_cast<uint32_t>(DeltaKind::kPacked) ||
      d.reason > static_cast<uint32_t>(DeltaReason::kCost) ||
      (form == DeltaKind::kFull) == (d.reason == static_cast<uint32_t>(DeltaReason::kDelta)))
    return DataLossError(where + ": malformed delta control message (form " +
                         std::to_string(d.form) + ", reason " + std::to_string(d.reason) + ")");
  const auto whole = static_cast<uint64_t>(bucket_bytes);
  if (form == DeltaKind::kFull ? d.payload != whole
                               : (d.payload < kDeltaHeaderBytes || d.payload >= whole))
    return DataLossError(where + ": the sender announces " + std::to_string(d.payload) + " " +
                         std::string(DeltaKindName(form)) + " bytes for a " +
                         std::to_string(bucket_bytes) + "-byte bucket");
  return OkStatus();
}

}  // namespace sync_internal
}  // namespace shardsync
