// A trainer rank's host send path under the delta encoding (PlanOptions::encoding delta / auto;
// delta_path.h has the protocol). Each bucket is packed whole into an image of its own, compared
// with the image this rank kept of what it last sent there, and sent as a delta or whole: its
// control message first (the form and the payload length), then the payload as a prefix of the
// bucket's transfers (delta) or the transfers in full (whole). The image then becomes the kept
// one. Memory: one copy of every host bucket's wire bytes (bf16: 2 bytes per parameter sent),
// plus one bucket of scratch and the encoded deltas in flight.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <string_view>
#include <vector>

#include "sync/bindings.h"
#include "sync/context.h"
#include "sync/delta_path.h"
#include "sync/guard.h"
#include "sync/host_pack.h"
#include "sync/host_path.h"
#include "sync/pairs.h"

namespace shardsync::sync_internal {

class DeltaHostSender final : public HostSendPath {
 public:
  DeltaHostSender(const SessionContext& ctx, SyncGuard& guard) : ctx_(ctx), guard_(guard) {}

  Status Prepare(const Bindings& bindings, PeerShapes& shapes, PreparedPairs& pairs,
                 std::map<int, uint32_t> regbase) override;
  bool has_buckets() const override { return has_buckets_; }
  Status SetReceiverBases(int dst, std::string_view value) override;
  Status Send(RankSyncStats& st) override;

 private:
  // One host bucket: its transfers and sources, the image kept, the receiver's base this sync.
  struct Slot {
    SendBucket sb;
    uint64_t seq0 = 0;  // its first transfer's data tag sequence number within the message
    KeptImage kept;
    BucketBase base;
    bool base_known = false;
  };
  struct InFlight {
    int msg = 0, bucket = 0;
    std::vector<XferId> ids;
    std::unique_ptr<DeltaControl> control;
    std::shared_ptr<std::vector<std::byte>> encoded;  // the delta's bytes (empty: whole)
  };

  std::string Who() const { return "sync rank " + std::to_string(ctx_.rank); }
  // Decides, packs and posts bucket `bi` of send message `mi`.
  Status PostBucket(int mi, int bi, RankSyncStats& st, std::deque<InFlight>& flying);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  const PreparedPairs* pairs_ = nullptr;
  std::vector<std::vector<Slot>> slots_;  // [send message][bucket]; empty for prepared pairs
  std::vector<std::byte> scratch_;        // the next image, swapped into the kept one
  DeltaLink link_;
  bool has_buckets_ = false;
  // What a failed sync's sends may still read: kept for the session's life.
  std::vector<std::shared_ptr<void>> graveyard_;
};

}  // namespace shardsync::sync_internal
