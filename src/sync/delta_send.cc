// The delta encoding's host send path (delta_send.h).
#include "sync/delta_send.h"

#include <algorithm>

#include "sync/landed_sum.h"

namespace shardsync::sync_internal {
namespace {

std::string EncodingText(const SessionContext& ctx) {
  return std::string(WireEncodingName(ctx.in.options.encoding));
}

}  // namespace

Status DeltaHostSender::Prepare(const Bindings& bindings, PeerShapes& shapes, PreparedPairs& pairs,
                                std::map<int, uint32_t> /*regbase*/) {
  const RankPlan& plan = ctx_.plan;
  pairs_ = &pairs;
  if (!ctx_.builtin_packer()) {
    return UnimplementedError(Who() + ": encoding " + EncodingText(ctx_) +
                              " keeps and diffs wire images in host memory, so it needs the "
                              "built-in CPU packer (host-memory sources); use encoding full");
  }
  SS_ASSIGN_OR_RETURN(link_, DeltaLinkFromKnobs());
  slots_.assign(plan.sends.size(), {});
  for (size_t mi = 0; mi < plan.sends.size(); ++mi) {
    if (pairs.sends(mi)) continue;
    const Message& m = plan.sends[mi];
    if (!ctx_.tx.PeerCaps(m.dst).two_sided) {
      return UnimplementedError(Who() + ": encoding " + EncodingText(ctx_) +
                                " sends deltas as two-sided messages, which " +
                                ctx_.tx.PeerTransport(m.dst) + " (to sync rank " +
                                std::to_string(m.dst) + ") does not offer");
    }
    uint64_t seq = 0;
    for (const Bucket& b : m.buckets) {
      Slot s;
      s.sb = MakeSendBucket(ctx_, bindings, shapes, m, b);
      s.seq0 = seq;
      seq += s.sb.xfers.size();
      // The prefix rule (delta_path.h) needs the transfers in wire order, tiling the bucket.
      int64_t at = 0;
      for (const WireRun& r : s.sb.xfers) {
        if (r.wire_offset != at) {
          return InternalError(Who() + ": bucket transfers to sync rank " + std::to_string(m.dst) +
                               " do not tile the bucket in order");
        }
        at += static_cast<int64_t>(r.len);
      }
      slots_[mi].push_back(std::move(s));
    }
    has_buckets_ = has_buckets_ || !m.buckets.empty();
  }
  return OkStatus();
}

Status DeltaHostSender::SetReceiverBases(int dst, std::string_view value) {
  for (size_t mi = 0; mi < ctx_.plan.sends.size(); ++mi) {
    const Message& m = ctx_.plan.sends[mi];
    if (m.dst != dst || slots_[mi].empty()) continue;
    SS_ASSIGN_OR_RETURN(std::vector<BucketBase> bases,
                        ParseBases(value, ctx_.rank, slots_[mi].size(), dst));
    for (size_t b = 0; b < bases.size(); ++b) {
      slots_[mi][b].base = bases[b];
      slots_[mi][b].base_known = true;
    }
  }
  return OkStatus();
}

Status DeltaHostSender::Send(RankSyncStats& st) {
  // Buckets round-robin over receivers, as the full path posts them (host_send.cc says why).
  std::vector<std::pair<int, int>> order;
  size_t max_buckets = 0;
  for (const auto& s : slots_) max_buckets = std::max(max_buckets, s.size());
  const size_t nmsg = slots_.size();
  const size_t first = nmsg ? static_cast<size_t>(ctx_.who.trainer_rank) % nmsg : 0;
  for (size_t b = 0; b < max_buckets; ++b) {
    for (size_t k = 0; k < nmsg; ++k) {
      const size_t m = (first + k) % nmsg;
      if (b < slots_[m].size()) order.emplace_back(static_cast<int>(m), static_cast<int>(b));
    }
  }
  std::deque<InFlight> flying;
  Status s;
  for (auto [mi, bi] : order) {
    // Two buckets in flight: one on the wire while the next is diffed.
    while (s.ok() && flying.size() >= 2) {
      s = guard_.WaitAll(
          flying.front().ids,
          "sending to sync rank " + std::to_string(ctx_.plan.sends[flying.front().msg].dst));
      if (s.ok()) flying.pop_front();
    }
    if (s.ok()) s = guard_.CheckDeadline("while sending");
    if (s.ok()) s = PostBucket(mi, bi, st, flying);
    if (!s.ok()) break;
  }
  while (s.ok() && !flying.empty()) {
    s = guard_.WaitAll(
        flying.front().ids,
        "sending to sync rank " + std::to_string(ctx_.plan.sends[flying.front().msg].dst));
    if (s.ok()) flying.pop_front();
  }
  for (auto& sl : slots_) {
    for (Slot& x : sl) x.base_known = false;  // each sync advertises anew
  }
  if (!s.ok()) {
    // Sends still in flight may read their buffers: they outlive the session's use of them, and
    // their buckets start over whole (the receiver may hold any part of them).
    for (InFlight& f : flying) {
      graveyard_.push_back(std::shared_ptr<void>(std::move(f.control)));
      graveyard_.push_back(f.encoded);
      KeptImage& k = slots_[f.msg][f.bucket].kept;
      graveyard_.push_back(std::make_shared<std::vector<std::byte>>(std::move(k.bytes)));
      k = KeptImage{};
    }
  }
  return s;
}

Status DeltaHostSender::PostBucket(int mi, int bi, RankSyncStats& st,
                                   std::deque<InFlight>& flying) {
  const Message& m = ctx_.plan.sends[mi];
  const Bucket& b = m.buckets[bi];
  Slot& slot = slots_[mi][bi];
  const auto t0 = Clock::now();
  // The new image, whole, with its checksum (as the full path packs it).
  scratch_.resize(static_cast<size_t>(b.bytes));
  LandedSum sum;
  PackRange(slot.sb, ctx_.in.trainer_dtype, ctx_.in.options.wire_dtype, 0, b.bytes,
            reinterpret_cast<unsigned char*>(scratch_.data()), sum);
  if (sum.bytes() != static_cast<uint64_t>(b.bytes)) {
    return InternalError(Who() + ": packed " + std::to_string(sum.bytes()) + " bytes of a " +
                         std::to_string(b.bytes) + "-byte bucket to sync rank " +
                         std::to_string(m.dst));
  }
  const uint64_t checksum = sum.Finish();
  if (!slot.base_known) {
    return InternalError(Who() + ": no delta base from sync rank " + std::to_string(m.dst) +
                         " for bucket " + std::to_string(bi));
  }
  DeltaReason reason = CheckBase(slot.kept, slot.base);
  DeltaKind kind = DeltaKind::kFull;
  auto encoded = std::make_shared<std::vector<std::byte>>();
  const int es = DTypeSize(ctx_.in.options.wire_dtype);
  if (reason == DeltaReason::kDelta) {
    const std::string name = "sync rank " + std::to_string(m.dst) + " bucket " + std::to_string(bi);
    SS_ASSIGN_OR_RETURN(DeltaEncodeResult r, EncodeDelta(slot.kept.bytes, scratch_, es,
                                                         slot.kept.version, name, encoded.get()));
    st.delta.changed += static_cast<int64_t>(r.changed);
    st.delta.elements += static_cast<int64_t>(r.elements);
    kind = r.kind;
    if (r.kind == DeltaKind::kFull) {
      reason = DeltaReason::kSize;
    } else if (ctx_.in.options.encoding == WireEncoding::kAuto) {
      SS_ASSIGN_OR_RETURN(const bool pays, DeltaPays(link_, r.elements, es, r.changed));
      if (!pays) reason = DeltaReason::kCost;
    }
    if (reason != DeltaReason::kDelta) {
      encoded->clear();
      kind = DeltaKind::kFull;
    }
  } else if (st.delta.first_fallback.empty() && reason != DeltaReason::kNoImage) {
    st.delta.first_fallback = DescribeFallback(reason, m.dst, bi, slot.kept, slot.base);
  }
  Trace(ctx_.rank, guard_.version(), [&] {
    return DescribeFallback(reason, m.dst, bi, slot.kept, slot.base) + ", " +
           std::to_string(reason == DeltaReason::kDelta ? encoded->size() : b.bytes) + " bytes";
  });
  // The new image is what the receiver holds once this bucket verified.
  slot.kept.bytes.swap(scratch_);
  slot.kept.version = guard_.version();
  slot.kept.checksum = checksum;
  st.delta.encode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();

  const bool delta = reason == DeltaReason::kDelta;
  const uint64_t payload = delta ? encoded->size() : static_cast<uint64_t>(b.bytes);
  flying.emplace_back();
  InFlight& f = flying.back();
  f.msg = mi;
  f.bucket = bi;
  f.encoded = encoded;
  f.control = std::make_unique<DeltaControl>();
  DeltaControl& c = *f.control;
  c.c.bucket = static_cast<uint32_t>(bi);
  c.c.version = guard_.version();
  c.c.bytes = static_cast<uint64_t>(b.bytes);
  c.c.checksum = checksum;
  c.c.job = ctx_.job_tag;
  c.form = static_cast<uint32_t>(kind);
  c.reason = static_cast<uint32_t>(reason);
  c.payload = payload;
  // The control message first: the receiver posts the data receives where the form says.
  SS_ASSIGN_OR_RETURN(XferId cid, ctx_.tx.PostSend(m.dst, ControlTag(guard_.version(), bi),
                                                   f.control.get(), sizeof(DeltaControl)));
  f.ids.push_back(cid);
  const std::byte* src = delta ? encoded->data() : slot.kept.bytes.data();
  for (size_t k = 0; k < slot.sb.xfers.size(); ++k) {
    const WireRun& r = slot.sb.xfers[k];
    const auto at = static_cast<uint64_t>(r.wire_offset);
    if (at >= payload) break;
    const size_t len = static_cast<size_t>(std::min<uint64_t>(r.len, payload - at));
    SS_ASSIGN_OR_RETURN(XferId id, ctx_.tx.PostSend(m.dst, DataTag(guard_.version(), slot.seq0 + k),
                                                    src + at, len));
    f.ids.push_back(id);
  }
  CountBucket(st.delta, reason, static_cast<int64_t>(payload), b.bytes);
  st.send_bytes += b.bytes;
  return OkStatus();
}

}  // namespace shardsync::sync_internal
