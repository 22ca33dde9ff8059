// What the job harness (src/job: bench, device mode) may do with a session beyond the public
// SessionOptions, exported by the sync layer (docs/architecture.md "Layers"): transport peers
// beyond the plan's (the broadcast-all baseline's), and a hook run after the session registered
// its memory and before the transport connects (the baseline's staging).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "shardsync/session.h"

namespace shardsync {

struct HarnessHooks {
  std::vector<int> extra_peers;
  std::function<Status(Transport&)> before_transport_connect;
};
// SyncSession::Create with `hooks`.
Result<std::unique_ptr<SyncSession>> CreateHarnessSession(const PlanInputs& inputs, int rank,
                                                          StoreClient& store, Transport& transport,
                                                          SessionOptions options,
                                                          HarnessHooks hooks);

}  // namespace shardsync
