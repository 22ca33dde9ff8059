// A trainer rank's host send path, for every encoding (codec.h): every bucket of the messages
// that are not prepared pairs, packed (or checksummed) and posted, with each bucket's checksum
// sent in a control message after its bytes. For the copy codec, the built-in CPU packer packs
// transfer by transfer into a small staging ring and sends direct runs from the trainer's memory;
// otherwise (a packer passed in, or an image codec) the codec's Pack step builds whole buckets in
// double-buffered staging slots, sent from there.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "sync/bindings.h"
#include "sync/codec.h"
#include "sync/context.h"
#include "sync/delta_send.h"
#include "sync/guard.h"
#include "sync/host_pack.h"
#include "sync/pairs.h"
#include "sync/transfers.h"

namespace shardsync::sync_internal {

class HostSender {
 public:
  HostSender(const SessionContext& ctx, SyncGuard& guard, Codec& codec)
      : ctx_(ctx), guard_(guard), codec_(codec) {
    // The delta encoding (delta_send.h): every bucket goes the image way, each through its step.
    if (ctx.in.options.encoding != WireEncoding::kFull)
      delta_ = std::make_unique<DeltaSender>(ctx, guard);
  }

  // Connect, after the pairs are prepared: the codec's checks, staging, and every host bucket's
  // transfers (replayed each sync). `regbase`: each receiver's first region id (one-sided puts).
  Status Prepare(const Bindings& bindings, PeerShapes& shapes, PreparedPairs& pairs,
                 std::map<int, uint32_t> regbase);
  // Whether this rank sends any bucket on the host path.
  bool has_buckets() const { return has_buckets_; }
  // The codec's step before any bucket is packed (Codec::Exchange), and whether it has one.
  bool exchanges() const { return codec_.exchanges(); }
  Status Exchange() { return codec_.Exchange(guard_); }
  // Sync, once receiver `dst` is ready: its ready value, the bases it holds under the delta
  // encoding (DeltaSender::SetBases); nothing otherwise.
  Status SetReceiverBases(int dst, std::string_view value) {
    if (ctx_.in.options.encoding == WireEncoding::kAuto)
      SS_RETURN_IF_ERROR(DeltaAgreement(delta_ != nullptr, value, ctx_.rank, dst));
    return delta_ ? delta_->SetBases(dst, value) : OkStatus();
  }
  // Sync: sends every host bucket and waits until each one and its control message completed.
  Status Send(RankSyncStats& st);

 private:
  // Sender-side state of one bucket in flight.
  struct InFlight {
    int msg = 0;
    int bucket = 0;
    int slot = 0;
    std::vector<XferId> xfers;  // puts + flush (put mode) or data + control sends (tag mode)
    std::vector<size_t> lens;   // wire bytes of each of xfers (0: flush / control)
    uint64_t checksum = 0;
    DeltaSender::Out delta;  // the delta encoding: what went on the wire
    std::unique_ptr<Control> control;
    // Summed sends (transport caps().summed_copy): the bucket's checksum is complete only once
    // the transport reported the words it summed while copying; the control message waits.
    std::shared_ptr<LandedSum> sum;       // shared with the fill functions of filled sends
    size_t sums_begin = 0, sums_end = 0;  // this bucket's entries of the sync's CopySum array
  };
  // The host path's state for one sync.
  struct HostSend {
    std::vector<std::pair<int, int>> order;  // (message, bucket) in posting order
    bool put = false, fused = false, summed = false, filled = false;
    // One CopySum per direct transfer of this sync, at fixed addresses the transport writes
    // into; kept past a failure (graveyard_) since the transport may still complete them.
    std::shared_ptr<std::vector<CopySum>> send_sums = std::make_shared<std::vector<CopySum>>();
    std::vector<size_t> sum_words;  // bytes of whole words each CopySum covers
    std::deque<InFlight> flying;
    size_t outstanding = 0;  // wire bytes posted and not yet seen complete (fused path)
    size_t ring_at = 0;      // next free byte of the staging ring (fused path)
    std::vector<std::unique_ptr<Control>> sent_controls;  // alive until their sends complete
    std::vector<XferId> ctrl_ids;
    std::vector<uint64_t> next_seq;
    int next_slot = 0;
  };

  // Whole bucket images in staging slots: an image codec's, or any under the delta encoding.
  bool image() const { return !codec_.in_place() || delta_ != nullptr; }
  HostSend Plan() const;
  Status SendAll(HostSend& hs, RankSyncStats& st);
  std::unique_ptr<Control> MakeControl(const InFlight& f) const;
  // Completes the oldest transfers (in posting order) until at most `limit` wire bytes are
  // outstanding, driving progress meanwhile.
  Status Drain(HostSend& hs, size_t limit);
  Status FinishOldest(HostSend& hs, RankSyncStats& st);
  Status CheckPacked(const Message& m, int bucket, uint64_t bytes) const;
  // Packs (or checksums) and posts every transfer of bucket `bi` of send message `mi`.
  Status PostBucket(HostSend& hs, int mi, int bi);
  // One transfer `r` of the bucket in flight `f`: from staging (a packer passed in), or, with the
  // built-in packer, straight from the source (direct) or packed just before it is posted.
  Result<XferId> PostTransfer(HostSend& hs, InFlight& f, const WireRun& r, unsigned char* stage);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  Codec& codec_;
  const Bindings* bindings_ = nullptr;
  const PreparedPairs* pairs_ = nullptr;
  std::map<int, uint32_t> regbase_;               // engine sync rank -> its first region id
  std::shared_ptr<unsigned char> staging_[2];     // the codec's slots (or the packer's ring)
  std::vector<std::vector<SendBucket>> buckets_;  // [send message][bucket]
  bool has_buckets_ = false;
  std::unique_ptr<DeltaSender> delta_;  // encoding delta / auto
  int64_t delta_staging_bytes_ = 0;     // the delta encoding's one staging slot (or chunk)
  bool packed_by_delta_ = false;        // the delta step packs each bucket (EncodePacked)
  // What a failed sync's transfers may still write into or read (the sums of summed copies, the
  // control messages in flight): kept for the session's life.
  std::vector<std::shared_ptr<void>> graveyard_;
};

}  // namespace shardsync::sync_internal
