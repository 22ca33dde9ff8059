// An engine rank's host receive path under the delta encoding (PlanOptions::encoding delta /
// auto; delta_path.h has the protocol). Before it says it is ready, the rank checksums what it
// holds in every host bucket (the live parameters: in place, or under a staged commit the
// committed ones) and advertises it with the version each bucket was verified at. Per bucket the
// control message comes first and names the form: a whole bucket is received straight into its
// parameters (staging under a staged commit); a delta into scratch, then applied over a copy of
// the base gathered from the live parameters with DecodeDeltaInPlace (which refuses another base
// or a malformed delta, failing the sync) and landed. Either way the landed bytes are then
// checksummed against the sender's checksum of the bucket, as every host bucket is.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sync/bindings.h"
#include "sync/context.h"
#include "sync/delta_path.h"
#include "sync/guard.h"
#include "sync/host_path.h"
#include "sync/pairs.h"
#include "sync/staging.h"
#include "sync/transfers.h"

namespace shardsync::sync_internal {

class DeltaHostReceiver final : public HostRecvPath {
 public:
  DeltaHostReceiver(const SessionContext& ctx, SyncGuard& guard, const StagedCommit& staged)
      : ctx_(ctx), guard_(guard), staged_(staged) {}

  Status Prepare(const Bindings& bindings, const PreparedPairs& pairs) override;
  Result<std::string> ReadyValue() override;
  Status Receive(RankSyncStats& st) override;

 private:
  // One host bucket: its transfers, its first data tag, what this rank holds there.
  struct Slot {
    std::vector<WireRun> runs;
    uint64_t seq0 = 0;
    uint64_t verified = 0;  // in place: the version its bytes were verified at (0: unknown)
    BucketBase advertised;  // this sync's advertisement
  };
  // A bucket of this sync: its control message, then its data.
  struct Pending {
    int msg = 0, bucket = 0;
    size_t ctrl = 0;  // index into the sync's control buffers
    bool data_posted = false;
    std::vector<XferId> ids;
    std::shared_ptr<std::vector<std::byte>> payload;  // a delta's bytes
  };

  std::string Who() const { return "sync rank " + std::to_string(ctx_.rank); }
  std::string Where(int mi, int bi) const;
  // Live bytes of run `r` (the base) and where it lands this sync.
  unsigned char* Live(const WireRun& r) const;
  unsigned char* Landing(const WireRun& r) const;
  Status PostData(Pending& p, const DeltaControl& c);
  // The bucket's data completed: apply a delta, then verify what landed.
  Status Land(const Pending& p, const DeltaControl& c, RankSyncStats& st);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  const StagedCommit& staged_;
  const Bindings* bindings_ = nullptr;
  std::vector<std::vector<Slot>> slots_;  // [recv message][bucket]; empty for prepared pairs
  std::vector<std::byte> base_;           // a bucket's base gathered, then the decoded result
  // What a failed sync's receives may still write into: kept for the session's life.
  std::vector<std::shared_ptr<void>> graveyard_;
};

}  // namespace shardsync::sync_internal
