// An engine rank's host receive path: every bucket of the messages that are not prepared pairs.
// Two-sided transports receive each run straight into its parameter (no staging copy) and, with
// the built-in packer, checksum it as it lands (or let the transport sum it while copying); with
// one-sided puts the bucket is checksummed through the packer once its control message arrived.
// Every bucket is verified against the checksum its sender packed.
#pragma once

#include <memory>
#include <vector>

#include "sync/bindings.h"
#include "sync/context.h"
#include "sync/guard.h"
#include "sync/host_path.h"
#include "sync/landed_sum.h"
#include "sync/pairs.h"
#include "sync/transfers.h"

namespace shardsync::sync_internal {

class HostReceiver final : public HostRecvPath {
 public:
  HostReceiver(const SessionContext& ctx, SyncGuard& guard) : ctx_(ctx), guard_(guard) {}

  Status Prepare(const Bindings& bindings, const PreparedPairs& pairs) override;
  Status Receive(RankSyncStats& st) override;

 private:
  // One bucket a receiver expects on the host path.
  struct Expect {
    int msg = 0;
    int bucket = 0;
    size_t slot = 0;          // index into HostRecv::ctrl
    std::vector<XferId> ids;  // data receives (tag mode), then the control receive
    const std::vector<WireRun>* runs = nullptr;  // tag mode: the data receives, in order
    size_t runs_done = 0;
    LandedSum landed;    // incremental checksum of the runs that completed
    size_t sums_at = 0;  // summed receives: this bucket's first entry of `sums`
  };
  // The host path's state for one sync.
  struct HostRecv {
    bool put = false, incremental = false, summed = false;
    // Posted receive buffers must outlive a failed sync: a late control message may still land.
    std::shared_ptr<std::vector<Control>> ctrl;
    // So must the CopySums of summed receives (one per run, at fixed addresses).
    std::shared_ptr<std::vector<CopySum>> sums = std::make_shared<std::vector<CopySum>>();
    std::vector<Expect> pending;
  };

  // Posts every host-path receive: per bucket its data runs (tag mode) and its control message.
  Status Post(HostRecv& hr, RankSyncStats& st);
  // Completes the posted receives, verifying each bucket once its control message arrived.
  Status Poll(HostRecv& hr, RankSyncStats& st);
  // Adds the `done` data runs of `e` that just completed to its landed checksum.
  void AddLanded(HostRecv& hr, Expect& e, size_t done);
  // `landed`: the bucket's checksum accumulated run by run as the runs completed (null: read
  // the landed bytes now through the packer).
  Status VerifyBucket(const Message& m, int bucket, const Control& c, LandedSum* landed);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  const Bindings* bindings_ = nullptr;
  const PreparedPairs* pairs_ = nullptr;
  // [recv message][bucket] -> the transfers, as the sender cuts them.
  std::vector<std::vector<std::vector<WireRun>>> runs_;
  // What a failed sync's transfers may still write into (late control messages, the sums of
  // summed copies): kept for the session's life.
  std::vector<std::shared_ptr<void>> graveyard_;
};

}  // namespace shardsync::sync_internal
