#include "sync/pairs.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <unordered_map>

namespace shardsync::sync_internal {

void PreparedPairs::AddDelta(const PairDeltaReport& d, bool sender, DeltaSyncStats& st) {
  for (const PairDeltaBucket& b : d.buckets) {
    CountBucket(st, b.reason, static_cast<int64_t>(b.wire_bytes),
                static_cast<int64_t>(b.full_bytes));
    st.changed += static_cast<int64_t>(b.changed);
    st.elements += static_cast<int64_t>(b.elements);
  }
  (sender ? st.encode_seconds : st.decode_seconds) += d.seconds;
  if (st.first_fallback.empty()) st.first_fallback = d.first_fallback;
}

bool PreparedPairs::Prepared(int peer, int mem) const {
  const TransportCaps c = ctx_.tx.PeerCaps(peer);
  return c.prepared && mem >= 0 &&
         (static_cast<MemKind>(mem) == MemKind::kCuda ? c.device_memory : c.host_memory);
}

std::string PreparedPairs::PairKey(int src, int dst) const {
  return ctx_.Key("pair/" + std::to_string(src) + "_" + std::to_string(dst) + "/");
}

Status PreparedPairs::Prepare(const Bindings& bindings, PeerShapes& shapes,
                              const std::map<int, uint32_t>& regbase, Clock::time_point deadline) {
  const RankPlan& plan = ctx_.plan;
  const DType wire = ctx_.in.options.wire_dtype;
  const int mem = bindings.BoundMem();
  send_.resize(plan.sends.size());
  recv_.resize(plan.recvs.size());
  auto left = [&] {
    return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now()));
  };
  SS_RETURN_IF_ERROR(codec_.PreparePairs(bindings, [&](int peer) { return Prepared(peer, mem); }));
  // The delta encoding on prepared pairs (transport.h PairDelta): the transport keeps the images
  // and runs the device codec; encoding auto prices each delta at the device steps' speeds over
  // the pair's link (DevicePairDeltaLink: cuda_ipc's or the cross-node one).
  // Staged engine ranks: each landing (staging) tensor's live parameter, a delta's base.
  auto live = std::make_shared<std::unordered_map<const void*, const void*>>();
  if (staged_.on() && ctx_.in.options.encoding != WireEncoding::kFull) {
    for (size_t p = 0; p < bindings.dests().size() && p < staged_.live().size(); ++p) {
      live->emplace(bindings.dests()[p].data, staged_.live()[p].data);
    }
  }
  auto delta_for = [&](int peer) -> Result<PairDelta> {
    PairDelta delta;
    if (ctx_.in.options.encoding == WireEncoding::kFull) return delta;
    delta.on = true;
    delta.element_size = DeltaElementSize(ctx_.in);
    if (staged_.on()) {
      // Staged: the buckets land in staging (the redirected bindings), a delta's base is the
      // committed bytes the engine serves (the host path's DeltaReceiver::Live): each landing
      // tensor maps to its live parameter, at the committed version.
      delta.live = [live](const void* landing) -> const void* {
        auto it = live->find(landing);
        return it == live->end() ? nullptr : it->second;
      };
      const StagedCommit* staged = &staged_;
      delta.committed = [staged] { return staged->committed(); };
    }
    if (ctx_.in.options.encoding != WireEncoding::kAuto) return delta;
    SS_ASSIGN_OR_RETURN(const DeltaLink link, DevicePairDeltaLink(ctx_.tx.PeerTransport(peer)));
    // Where no delta can pay at the link's speeds, the pair runs as encoding full (the host
    // path's ResolveAuto): both sides read the same knobs for the same transport.
    SS_ASSIGN_OR_RETURN(bool can, DeltaCanPay(link));
    delta.on = can;
    if (!can) auto_full_.insert(peer);
    const int es = delta.element_size;
    delta.pays = [link, es](uint64_t elements, uint64_t changed) {
      auto p = DeltaPays(link, elements, es, changed);
      return p.ok() && *p;
    };
    return delta;
  };
  for (size_t mi = 0; mi < plan.recvs.size(); ++mi) {
    const Message& m = plan.recvs[mi];
    if (!Prepared(m.src, mem)) continue;
    SS_ASSIGN_OR_RETURN(PairDelta delta, delta_for(m.src));
    PairSpec spec{m.src, /*send=*/false, wire, {}, PairKey(m.src, ctx_.rank), false, delta};
    spec.image = !codec_.in_place();
    for (const Bucket& b : m.buckets) spec.buckets.push_back(codec_.RecvBucket(bindings, m, b));
    SS_ASSIGN_OR_RETURN(recv_[mi], ctx_.tx.Prepare(ctx_.store, spec, left()));
  }
  for (size_t mi = 0; mi < plan.sends.size(); ++mi) {
    const Message& m = plan.sends[mi];
    if (!Prepared(m.dst, mem)) continue;
    SS_ASSIGN_OR_RETURN(PairDelta delta, delta_for(m.dst));
    PairSpec spec{m.dst, /*send=*/true, wire, {}, PairKey(ctx_.rank, m.dst), false, delta};
    spec.image = !codec_.in_place();
    const uint32_t base = regbase.at(m.dst);
    for (const Bucket& b : m.buckets) {
      spec.buckets.push_back(codec_.SendBucket(bindings, shapes, m, b, base));
    }
    SS_ASSIGN_OR_RETURN(send_[mi], ctx_.tx.Prepare(ctx_.store, spec, left()));
  }
  return OkStatus();
}

Status PreparedPairs::PostSends(const std::function<bool(size_t)>& which) {
  return Post(send_, which);
}

Status PreparedPairs::Post(Pairs& pairs, const std::function<bool(size_t)>& which) {
  for (size_t i = 0; i < pairs.size(); ++i) {
    auto& p = pairs[i];
    if (!p || (which && !which(i))) continue;
    SS_RETURN_IF_ERROR(p->Post(guard_.version()));
    Trace(ctx_.rank, guard_.version(), [&] { return "posted: " + p->Describe(); });
  }
  return OkStatus();
}

Status PreparedPairs::Wait(Pairs& pairs, const std::function<std::string(size_t)>& who,
                           const std::function<Status()>& while_waiting) {
  std::vector<size_t> left;
  for (size_t i = 0; i < pairs.size(); ++i) {
    if (pairs[i]) left.push_back(i);
  }
  const auto start = Clock::now();
  auto idle_since = start;
  bool waited = false;
  while (!left.empty()) {
    bool progressed = false;
    for (size_t k = 0; k < left.size();) {
      auto st = pairs[left[k]]->Poll();
      if (!st.ok()) {
        Status e = st.status();
        return e.Annotate("sync rank " + std::to_string(ctx_.rank) + ": " + who(left[k]));
      }
      if (*st == XferState::kDone) {
        Trace(ctx_.rank, guard_.version(), [&] { return "done: " + who(left[k]); });
        left.erase(left.begin() + k);
        progressed = true;
      } else {
        ++k;
      }
    }
    if (left.empty()) break;
    // After 1 ms the pairs are running (a launch waits only for its receivers' mailbox
    // messages, microseconds apart): a store round trip then delays no launch.
    if (while_waiting && !waited && Clock::now() - start >= Millis(1)) {
      waited = true;
      SS_RETURN_IF_ERROR(while_waiting());
      progressed = true;  // time passed in it: poll again at once
    }
    SS_RETURN_IF_ERROR(guard_.CheckDeadline(left[0], who));
    SyncGuard::PairBackoff(progressed, idle_since);
  }
  return OkStatus();
}

Status PreparedPairs::FinishSends(RankSyncStats& st, const std::function<Status()>& while_waiting) {
  const RankPlan& plan = ctx_.plan;
  SS_RETURN_IF_ERROR(Wait(
      send_,
      [&](size_t i) {
        return "sending to sync rank " + std::to_string(plan.sends[i].dst) + " (" +
               send_[i]->Describe() + ")";
      },
      while_waiting));
  for (size_t mi = 0; mi < send_.size(); ++mi) {
    if (!send_[mi]) continue;
    const Message& m = plan.sends[mi];
    for (const Bucket& b : m.buckets) {
      st.send_bytes += b.bytes;
      if (auto_full_.count(m.dst)) CountAutoFull(st.delta, b.bytes);
    }
    if (const PairDeltaReport* d = send_[mi]->Delta()) AddDelta(*d, /*sender=*/true, st.delta);
    if (send_[mi]->DeliversSums()) continue;
    SS_ASSIGN_OR_RETURN(PairSums sums, send_[mi]->Sums());
    if (sums.packed.size() != m.buckets.size()) {
      return InternalError("sync rank " + std::to_string(ctx_.rank) + ": pair to sync rank " +
                           std::to_string(m.dst) + " reported " +
                           std::to_string(sums.packed.size()) + " checksums for " +
                           std::to_string(m.buckets.size()) + " buckets");
    }
    std::string text;
    for (uint64_t v : sums.packed) {
      if (!text.empty()) text += ',';
      text += Hex(v);
    }
    SS_RETURN_IF_ERROR(ctx_.store.Set(
        ctx_.Key(guard_.VKey("sums/") + std::to_string(ctx_.rank) + "_" + std::to_string(m.dst)),
        text));
  }
  Trace(ctx_.rank, guard_.version(), [] { return "checksums published"; });
  return OkStatus();
}

Status PreparedPairs::StoreSums(const Message& m, std::vector<uint64_t>& sent) {
  const std::string from = "sync rank " + std::to_string(m.src);
  Trace(ctx_.rank, guard_.version(), [&] { return "waiting for the checksums of " + from; });
  SS_ASSIGN_OR_RETURN(
      std::string text,
      guard_.GetUntil(
          ctx_.Key(guard_.VKey("sums/") + std::to_string(m.src) + "_" + std::to_string(ctx_.rank)),
          guard_.deadline(), "the checksums of " + from, /*watch_abort=*/true));
  for (size_t at = 0; at <= text.size() && !text.empty();) {
    const size_t c = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, c - at);
    char* end = nullptr;
    sent.push_back(std::strtoull(item.c_str(), &end, 16));
    if (item.size() != 16 || *end != '\0') {
      return DataLossError("sync rank " + std::to_string(ctx_.rank) + ": checksums of " + from +
                           " are malformed: '" + text.substr(0, 80) + "'");
    }
    at = c + 1;
  }
  return OkStatus();
}

Status PreparedPairs::FinishRecvs(RankSyncStats& st, const Bindings& bindings) {
  const RankPlan& plan = ctx_.plan;
  SS_RETURN_IF_ERROR(Wait(recv_, [&](size_t i) {
    return "receiving from sync rank " + std::to_string(plan.recvs[i].src) + " (" +
           recv_[i]->Describe() + ")";
  }));
  for (size_t mi = 0; mi < recv_.size(); ++mi) {
    if (!recv_[mi]) continue;
    const Message& m = plan.recvs[mi];
    SS_ASSIGN_OR_RETURN(PairSums mine, recv_[mi]->Sums());
    // The sender's packed sums: with the data where the transport delivers them, else the
    // store.
    std::vector<uint64_t> sent = std::move(mine.packed);
    if (sent.empty()) SS_RETURN_IF_ERROR(StoreSums(m, sent));
    if (sent.size() != m.buckets.size() || mine.landed.size() != m.buckets.size()) {
      return DataLossError("sync rank " + std::to_string(ctx_.rank) + ": sync rank " +
                           std::to_string(m.src) + " sent " + std::to_string(sent.size()) +
                           " checksums, " + std::to_string(mine.landed.size()) + " landed, for " +
                           std::to_string(m.buckets.size()) + " buckets");
    }
    if (const PairDeltaReport* d = recv_[mi]->Delta()) AddDelta(*d, /*sender=*/false, st.delta);
    st.checksums_total += static_cast<int64_t>(m.buckets.size());
    for (size_t b = 0; b < sent.size(); ++b) {
      if (sent[b] != mine.landed[b]) {
        return bindings.MismatchError(m, static_cast<int>(b), guard_.version(), sent[b],
                                      mine.landed[b]);
      }
      ++st.checksums_ok;
      st.recv_bytes += m.buckets[b].bytes;
      if (auto_full_.count(m.src)) CountAutoFull(st.delta, m.buckets[b].bytes);
    }
  }
  return OkStatus();
}

void PreparedPairs::CancelAll() {
  for (auto* pairs : {&send_, &recv_}) {
    for (auto& p : *pairs) {
      if (p) p->Cancel();
    }
  }
}

}  // namespace shardsync::sync_internal
