// The delta encoding's host receive path (delta_recv.h).
#include "sync/delta_recv.h"

#include <cstring>
#include <span>

#include "sync/landed_sum.h"

namespace shardsync::sync_internal {

Status DeltaHostReceiver::Prepare(const Bindings& bindings, const PreparedPairs& pairs) {
  bindings_ = &bindings;
  const RankPlan& plan = ctx_.plan;
  const std::string enc(WireEncodingName(ctx_.in.options.encoding));
  slots_.assign(plan.recvs.size(), {});
  for (size_t mi = 0; mi < plan.recvs.size(); ++mi) {
    if (pairs.recvs(mi)) continue;
    const Message& m = plan.recvs[mi];
    if (!ctx_.builtin_packer()) {
      return UnimplementedError(Who() + ": encoding " + enc +
                                " applies deltas in host memory, so it needs the built-in CPU "
                                "packer (host-memory parameters); use encoding full");
    }
    if (!ctx_.tx.PeerCaps(m.src).two_sided) {
      return UnimplementedError(Who() + ": encoding " + enc +
                                " receives deltas as two-sided messages, which " +
                                ctx_.tx.PeerTransport(m.src) + " (from sync rank " +
                                std::to_string(m.src) + ") does not offer");
    }
    SS_ASSIGN_OR_RETURN(SyncRank src, DescribeSyncRank(ctx_.in, m.src));
    uint64_t seq = 0;
    for (const Bucket& b : m.buckets) {
      Slot s;
      s.runs = BucketTransfers(
          ctx_.in, ctx_.inventory, src.trainer_rank, m, b,
          [&](int param) -> const Shape& { return bindings.dest(param).shape; },
          [&](int param) { return bindings.LocalShape(m, param); });
      s.seq0 = seq;
      seq += s.runs.size();
      slots_[mi].push_back(std::move(s));
    }
  }
  return OkStatus();
}

std::string DeltaHostReceiver::Where(int mi, int bi) const {
  return "message from sync rank " + std::to_string(ctx_.plan.recvs[mi].src) + " to sync rank " +
         std::to_string(ctx_.rank) + ", bucket " + std::to_string(bi);
}

unsigned char* DeltaHostReceiver::Live(const WireRun& r) const {
  // Under a staged commit the bound parameters are redirected to staging: the live ones are the
  // engine's, which hold the committed version.
  void* base = staged_.on() ? staged_.live()[r.param].data : bindings_->dest(r.param).data;
  return static_cast<unsigned char*>(base) + r.param_offset;
}

unsigned char* DeltaHostReceiver::Landing(const WireRun& r) const {
  return static_cast<unsigned char*>(bindings_->dest(r.param).data) + r.param_offset;
}

Result<std::string> DeltaHostReceiver::ReadyValue() {
  std::vector<std::pair<int, std::vector<BucketBase>>> by_src;
  for (size_t mi = 0; mi < slots_.size(); ++mi) {
    if (slots_[mi].empty()) continue;
    std::vector<BucketBase> bases;
    for (Slot& s : slots_[mi]) {
      // Recomputed every sync over the live bytes: a corrupted byte or restored older bytes
      // show here, whatever the version says.
      LandedSum sum;
      for (const WireRun& r : s.runs) sum.Add(Live(r), r.len, static_cast<uint64_t>(r.wire_offset));
      s.advertised.version = staged_.on() ? staged_.committed() : s.verified;
      s.advertised.checksum = sum.Finish();
      bases.push_back(s.advertised);
    }
    by_src.emplace_back(ctx_.plan.recvs[mi].src, std::move(bases));
  }
  return EncodeBases(by_src);
}

Status DeltaHostReceiver::Receive(RankSyncStats& st) {
  size_t total = 0;
  for (const auto& s : slots_) total += s.size();
  st.checksums_total = static_cast<int64_t>(total);
  auto ctrls = std::make_shared<std::vector<DeltaControl>>(total);
  std::vector<Pending> pending;
  Status s;
  for (size_t mi = 0; mi < slots_.size() && s.ok(); ++mi) {
    const Message& m = ctx_.plan.recvs[mi];
    for (size_t bi = 0; bi < slots_[mi].size() && s.ok(); ++bi) {
      Pending p;
      p.msg = static_cast<int>(mi);
      p.bucket = static_cast<int>(bi);
      p.ctrl = pending.size();
      auto id = ctx_.tx.PostRecv(m.src, ControlTag(guard_.version(), static_cast<uint32_t>(bi)),
                                 &(*ctrls)[p.ctrl], sizeof(DeltaControl));
      s = id.status();
      if (s.ok()) p.ids.push_back(*id);
      pending.push_back(std::move(p));
    }
  }
  int idle = 0;
  while (s.ok() && !pending.empty()) {
    bool progressed = false;
    size_t keep = 0;
    for (size_t i = 0; i < pending.size() && s.ok(); ++i) {
      Pending& p = pending[i];
      size_t done = 0;
      for (; done < p.ids.size(); ++done) {
        auto state = ctx_.tx.Poll(p.ids[done]);
        if (!state.ok()) {
          s = state.status();
          s = s.Annotate(Who() + ": receiving from sync rank " +
                         std::to_string(ctx_.plan.recvs[p.msg].src));
          break;
        }
        if (*state == XferState::kInProgress) break;
      }
      if (!s.ok()) break;
      progressed |= done > 0;
      p.ids.erase(p.ids.begin(), p.ids.begin() + static_cast<std::ptrdiff_t>(done));
      const DeltaControl& c = (*ctrls)[p.ctrl];
      if (p.ids.empty() && !p.data_posted) {
        s = PostData(p, c);  // the control message arrived: its data goes where its form says
        if (!s.ok()) break;
        progressed = true;
      }
      if (!p.ids.empty()) {
        if (keep != i) pending[keep] = std::move(p);
        ++keep;
        continue;
      }
      s = Land(p, c, st);
      if (!s.ok()) break;
      ++st.checksums_ok;
      st.recv_bytes += ctx_.plan.recvs[p.msg].buckets[p.bucket].bytes;
    }
    if (!s.ok()) break;
    pending.resize(keep);
    if (pending.empty()) break;
    s = guard_.CheckDeadline("waiting for " + std::to_string(pending.size()) +
                             " buckets (first from sync rank " +
                             std::to_string(ctx_.plan.recvs[pending[0].msg].src) + ")");
    if (s.ok()) SyncGuard::Backoff(progressed, idle);
  }
  if (!s.ok()) {
    // Receives still posted may be written into by late messages.
    graveyard_.push_back(ctrls);
    for (Pending& p : pending) {
      if (p.payload) graveyard_.push_back(p.payload);
    }
  }
  return s;
}

Status DeltaHostReceiver::PostData(Pending& p, const DeltaControl& c) {
  const Message& m = ctx_.plan.recvs[p.msg];
  const Bucket& b = m.buckets[p.bucket];
  Slot& slot = slots_[p.msg][p.bucket];
  const std::string where = Where(p.msg, p.bucket);
  SS_RETURN_IF_ERROR(CheckControl(c.c, where, p.bucket, ctx_.job_tag, guard_.version(), b.bytes));
  SS_RETURN_IF_ERROR(CheckDeltaControl(c, where, b.bytes));
  p.data_posted = true;
  const bool delta = static_cast<DeltaKind>(c.form) != DeltaKind::kFull;
  if (delta) {
    p.payload = std::make_shared<std::vector<std::byte>>(c.payload);
  } else if (!staged_.on()) {
    slot.verified = 0;  // the live bytes are about to be overwritten
  }
  for (size_t k = 0; k < slot.runs.size(); ++k) {
    const WireRun& r = slot.runs[k];
    const auto at = static_cast<uint64_t>(r.wire_offset);
    if (at >= c.payload) break;
    const size_t len = static_cast<size_t>(std::min<uint64_t>(r.len, c.payload - at));
    void* dst = delta ? static_cast<void*>(p.payload->data() + at) : Landing(r);
    SS_ASSIGN_OR_RETURN(
        XferId id, ctx_.tx.PostRecv(m.src, DataTag(guard_.version(), slot.seq0 + k), dst, len));
    p.ids.push_back(id);
  }
  return OkStatus();
}

Status DeltaHostReceiver::Land(const Pending& p, const DeltaControl& c, RankSyncStats& st) {
  const Message& m = ctx_.plan.recvs[p.msg];
  const Bucket& b = m.buckets[p.bucket];
  Slot& slot = slots_[p.msg][p.bucket];
  const auto reason = static_cast<DeltaReason>(c.reason);
  const auto t0 = Clock::now();
  if (static_cast<DeltaKind>(c.form) != DeltaKind::kFull) {
    const std::string where = Where(p.msg, p.bucket);
    const std::span<const std::byte> enc(*p.payload);
    SS_ASSIGN_OR_RETURN(const DeltaInfo info, InspectDelta(enc, where));
    // The base: this rank's live bytes of the bucket, gathered in wire order.
    base_.resize(static_cast<size_t>(b.bytes));
    for (const WireRun& r : slot.runs) std::memcpy(base_.data() + r.wire_offset, Live(r), r.len);
    DeltaExpect expect;
    expect.bucket = where;
    expect.element_size = DTypeSize(ctx_.in.options.wire_dtype);
    expect.base_version = slot.advertised.version;
    Status applied = DecodeDeltaInPlace(enc, base_, expect);
    if (!applied.ok()) {
      return applied.Annotate(Who() + ": the delta of version " + std::to_string(guard_.version()) +
                              " was refused, nothing of it landed");
    }
    if (!staged_.on()) slot.verified = 0;
    for (const WireRun& r : slot.runs) std::memcpy(Landing(r), base_.data() + r.wire_offset, r.len);
    st.delta.changed += static_cast<int64_t>(info.changed);
    st.delta.elements += static_cast<int64_t>(info.elements);
  }
  // What landed, checksummed against the sender's checksum of the bucket, as every bucket is.
  LandedSum sum;
  for (const WireRun& r : slot.runs)
    sum.Add(Landing(r), r.len, static_cast<uint64_t>(r.wire_offset));
  const uint64_t got = sum.Finish();
  st.delta.decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  if (got != c.c.checksum) {
    return bindings_->MismatchError(m, p.bucket, guard_.version(), c.c.checksum, got);
  }
  if (!staged_.on()) slot.verified = guard_.version();
  CountBucket(st.delta, reason, static_cast<int64_t>(c.payload), b.bytes);
  return OkStatus();
}

}  // namespace shardsync::sync_internal
