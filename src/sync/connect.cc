#include "sync/connect.h"

#include <algorithm>
#include <cstdlib>

#include "plan/plan_hash.h"

namespace shardsync::sync_internal {

Status AgreeOnPlan(const SessionContext& ctx, SyncGuard& guard, Clock::time_point deadline) {
  const std::string& mine = ctx.plan.plan_hash;
  // The hash's text too, in the same round trip: a mismatch then names the field that differs.
  const std::string text = PlanHashText(ctx.in);
  SS_RETURN_IF_ERROR(ctx.store.SetMany({{ctx.Key("planspec/" + std::to_string(ctx.rank)), text},
                                        {ctx.Key("hash/" + std::to_string(ctx.rank)), mine}}));
  std::vector<std::string> keys;
  std::vector<int> others;
  for (int r = 0; r < ctx.world; ++r) {
    if (r == ctx.rank) continue;
    keys.push_back(ctx.Key("hash/" + std::to_string(r)));
    others.push_back(r);
  }
  auto mismatch = [&](size_t i, const std::string& theirs) {
    const std::string peer = "sync rank " + std::to_string(others[i]);
    auto their_text = ctx.store.Get(ctx.Key("planspec/" + std::to_string(others[i])), Millis(0));
    std::string field = their_text.ok() ? FirstPlanDifference(text, *their_text, peer) : "";
    if (field.empty()) field = "the differing field is unknown (" + peer + " published none)";
    return FailedPreconditionError("plan hash mismatch: " + peer + " has " + theirs +
                                   ", sync rank " + std::to_string(ctx.rank) + " (this rank) has " +
                                   mine + ": " + field +
                                   " (ranks were started with different model, layouts or plan "
                                   "options)");
  };
  auto hashes = guard.GetFromRanks(keys, others, deadline, [&](size_t i) {
    return "plan hash of sync rank " + std::to_string(others[i]);
  });
  if (!hashes.ok()) {
    // A peer that saw a mismatch first has left already: report the mismatch, not its leaving.
    for (size_t i = 0; i < keys.size() && hashes.status().code() == StatusCode::kUnavailable; ++i) {
      auto h = ctx.store.Get(keys[i], Millis(0));
      if (h.ok() && *h != mine) return mismatch(i, *h);
    }
    return hashes.status();
  }
  for (size_t i = 0; i < others.size(); ++i) {
    if ((*hashes)[i] != mine) return mismatch(i, (*hashes)[i]);
  }
  return OkStatus();
}

Status RegisterParams(const SessionContext& ctx, const Bindings& bindings,
                      const MemRegion* staging) {
  if (ctx.who.is_trainer) return OkStatus();
  uint32_t base = 0;
  const std::vector<DestBinding>& dests = bindings.dests();
  for (size_t i = 0; i < dests.size(); ++i) {
    const DestBinding& d = dests[i];
    const size_t bytes = static_cast<size_t>(NumElements(d.shape)) * DTypeSize(d.dtype);
    SS_ASSIGN_OR_RETURN(uint32_t id, ctx.tx.RegisterMemory({d.data, bytes, d.mem, d.device}));
    if (i == 0) base = id;
    if (id != base + i) {
      return InternalError("transport " + std::string(ctx.tx.name()) +
                           ": region ids are not dense (parameter " + d.name + " got " +
                           std::to_string(id) + ")");
    }
  }
  if (staging != nullptr) {
    SS_ASSIGN_OR_RETURN(uint32_t id, ctx.tx.RegisterMemory(*staging));
    if (dests.empty() || id != base + dests.size()) {
      return InternalError("transport " + std::string(ctx.tx.name()) +
                           ": the block-FP8 staging got region " + std::to_string(id) +
                           ", not the one after the parameters");
    }
  }
  return ctx.store.Set(ctx.Key("regbase/" + std::to_string(ctx.rank)), std::to_string(base));
}

std::vector<int> TransportPeers(const SessionContext& ctx, const std::vector<int>& extra) {
  std::vector<int> peers;
  for (const Message& m : ctx.plan.sends) peers.push_back(m.dst);
  for (const Message& m : ctx.plan.recvs) peers.push_back(m.src);
  peers.insert(peers.end(), extra.begin(), extra.end());
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

Status ConnectTransport(const SessionContext& ctx, const std::vector<int>& peers,
                        Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
  return ctx.tx.Connect(ctx.store, ctx.Key("tx/"), ctx.rank, peers, std::max(left, Millis(1)));
}

Result<std::map<int, uint32_t>> ReadRegionBases(const SessionContext& ctx, SyncGuard& guard,
                                                Clock::time_point deadline) {
  std::vector<std::string> keys;
  std::vector<int> dsts;
  for (const Message& m : ctx.plan.sends) {
    keys.push_back(ctx.Key("regbase/" + std::to_string(m.dst)));
    dsts.push_back(m.dst);
  }
  auto who = [&](size_t i) { return "engine sync rank " + std::to_string(dsts[i]); };
  SS_ASSIGN_OR_RETURN(std::vector<std::string> got,
                      guard.GetFromRanks(keys, dsts, deadline, [&](size_t i) {
                        return "memory registration of " + who(i);
                      }));
  std::map<int, uint32_t> bases;
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string& b = got[i];
    char* end = nullptr;
    const unsigned long v = std::strtoul(b.c_str(), &end, 10);
    if (b.empty() || *end != '\0' || v > UINT32_MAX) {
      return DataLossError("memory registration of " + who(i) + " is malformed: '" + b + "'");
    }
    bases[dsts[i]] = static_cast<uint32_t>(v);
  }
  return bases;
}

}  // namespace shardsync::sync_internal
