// Connect's agreement steps (SessionImpl::Connect runs them in order, then prepares the pairs,
// opens the verdict board and sets up the host path): every rank holds the same plan; engine
// ranks register their parameters once and publish where their region ids start; the transport
// connects to the plan's peers; trainer ranks learn each receiver's region ids.
#pragma once

#include <map>
#include <vector>

#include "sync/bindings.h"
#include "sync/context.h"
#include "sync/guard.h"

namespace shardsync::sync_internal {

// Publishes this rank's plan hash and checks every other rank's (FailedPrecondition naming both
// hashes and the rank) before any byte moves.
Status AgreeOnPlan(const SessionContext& ctx, SyncGuard& guard, Clock::time_point deadline);

// Engine ranks: registers every bound parameter with the transport (dense region ids) and
// publishes the first id as "regbase/<rank>": senders put straight into the parameters.
// `staging` (block-FP8 receivers with staged bands on prepared pairs, PreparedPairs::
// AllocStaging): registered right after the parameters, as region base + parameter count.
Status RegisterParams(const SessionContext& ctx, const Bindings& bindings,
                      const MemRegion* staging = nullptr);

// The plan's peers of this rank plus `extra` (the harness's), sorted, once each.
std::vector<int> TransportPeers(const SessionContext& ctx, const std::vector<int>& extra);
Status ConnectTransport(const SessionContext& ctx, const std::vector<int>& peers,
                        Clock::time_point deadline);

// Trainer ranks: the first parameter region id of every engine rank this rank sends to.
Result<std::map<int, uint32_t>> ReadRegionBases(const SessionContext& ctx, SyncGuard& guard,
                                                Clock::time_point deadline);

}  // namespace shardsync::sync_internal
