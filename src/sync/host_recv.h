// An engine rank's host receive path, for every encoding (codec.h): every bucket of the
// messages that are not prepared pairs, verified against the checksum its sender packed. In place
// (the copy codec), two-sided transports receive each run straight into its parameter (no staging
// copy) and, with the built-in packer, checksum it as it lands (or let the transport sum it while
// copying); with one-sided puts the bucket is checksummed through the packer once its control
// message arrived. An image codec's buckets land in two receive slots per message (the next
// bucket is posted as a slot frees up), are checksummed there and handed to the codec's Land.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sync/bindings.h"
#include "sync/codec.h"
#include "sync/context.h"
#include "sync/delta_recv.h"
#include "sync/guard.h"
#include "sync/landed_sum.h"
#include "sync/pairs.h"
#include "sync/transfers.h"

namespace shardsync::sync_internal {

class HostReceiver {
 public:
  HostReceiver(const SessionContext& ctx, SyncGuard& guard, Codec& codec,
               const StagedCommit& staged)
      : ctx_(ctx), guard_(guard), codec_(codec) {
    // The delta encoding (delta_recv.h): every bucket lands the image way, through its steps.
    if (ctx.in.options.encoding != WireEncoding::kFull)
      delta_ = std::make_unique<DeltaReceiver>(ctx, guard, codec, staged);
  }

  // Connect: the codec's checks, and every bucket's transfers as the sender cuts them (replayed
  // each sync).
  Status Prepare(const Bindings& bindings, const PreparedPairs& pairs);
  // Sync, before this rank says it is ready: its ready value ("1"; under the delta encoding the
  // bases it holds, DeltaReceiver::Advertise).
  Result<std::string> ReadyValue() {
    return delta_ ? delta_->Advertise() : Result<std::string>(std::string("1"));
  }
  // Sync: posts the host receives, then completes, verifies and lands each bucket.
  Status Receive(RankSyncStats& st);

 private:
  // One bucket a receiver expects on the host path.
  struct Expect {
    int msg = 0;
    int bucket = 0;
    size_t slot = 0;          // index into HostRecv::ctrl (and, image codecs, HostRecv::images)
    std::vector<XferId> ids;  // data receives (tag mode), then the control receive
    const std::vector<WireRun>* runs = nullptr;  // tag mode: the data receives, in order
    size_t runs_done = 0;
    LandedSum landed;                    // incremental checksum of the runs that completed
    size_t sums_at = 0;                  // summed receives: this bucket's first entry of `sums`
    const unsigned char* img = nullptr;  // image codecs: the slot the bucket lands in
  };
  // The host path's state for one sync.
  struct HostRecv {
    bool put = false, incremental = false, summed = false;
    // Posted receive buffers must outlive a failed sync: a late control message may still land.
    std::shared_ptr<std::vector<Control>> ctrl;
    // So must the CopySums of summed receives (one per run, at fixed addresses).
    std::shared_ptr<std::vector<CopySum>> sums = std::make_shared<std::vector<CopySum>>();
    // Image codecs: two receive slots per host message (so must they).
    std::vector<std::shared_ptr<unsigned char>> images;
    std::vector<Expect> pending;
    std::vector<int> next;      // per recv message: its next bucket to post
    std::vector<uint64_t> seq;  // per recv message: its next data tag
  };

  // Whole bucket images in receive slots: an image codec's, or any under the delta encoding.
  bool image() const { return !codec_.in_place() || delta_ != nullptr; }
  // Posts the host-path receives: per bucket its data runs (tag mode) and its control message;
  // every bucket in place, the first two of each message for an image codec.
  Status Post(HostRecv& hr, RankSyncStats& st);
  // Posts the next bucket of recv message `mi` (if any is left) with control slot `k` into `into`.
  Status PostNext(HostRecv& hr, int mi, size_t k, std::vector<Expect>& into);
  // Completes the posted receives, verifying each bucket once its control message arrived.
  Status Poll(HostRecv& hr, RankSyncStats& st);
  // Adds the `done` data runs of `e` that just completed to its landed checksum.
  void AddLanded(HostRecv& hr, Expect& e, size_t done);
  // `landed`: the bucket's checksum accumulated run by run as the runs completed (null: read
  // the landed bytes now, from the image `img` or through the packer). An image is then landed
  // by the codec.
  Status VerifyBucket(const Message& m, int bucket, const Control& c, LandedSum* landed,
                      const unsigned char* img);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  Codec& codec_;
  const Bindings* bindings_ = nullptr;
  const PreparedPairs* pairs_ = nullptr;
  // [recv message][bucket] -> the transfers, as the sender cuts them.
  std::vector<std::vector<std::vector<WireRun>>> runs_;
  std::vector<int64_t> slot_bytes_;  // image codecs, per recv message: its largest bucket
  // Image codecs: the receive slots (two per host message, in posting order), kept between
  // syncs that succeeded.
  std::vector<std::shared_ptr<unsigned char>> slots_;
  std::vector<int> slot_msg_;             // the recv message of each of slots_
  std::unique_ptr<DeltaReceiver> delta_;  // encoding delta / auto
  // What a failed sync's transfers may still write into (late control messages, the sums of
  // summed copies, image slots): kept for the session's life.
  std::vector<std::shared_ptr<void>> graveyard_;
};

}  // namespace shardsync::sync_internal
