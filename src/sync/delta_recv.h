// The delta encoding's steps in the host receive loop (host_recv.h; delta_path.h has the
// protocol). Before the rank says it is ready, Advertise checksums what it holds in every host
// bucket and names the version each was verified at: in place (the copy codec) the bucket's landed
// runs themselves, read once in wire order (live parameters, or under a staged commit the
// committed ones); an image codec's bucket as the codec rebuilds its wire image from them
// (Codec::RebuildImage). Each bucket then arrives whole or as a delta (its control message says
// which): the loop posts both forms' receives, a whole bucket's runs where WholeTarget says and
// a delta's into one of its receive slots (the sender fills the other form with empty messages),
// and Receive lands it verified:
//  - whole: already in place (or in the rebuilt image), checksummed there against the sender's
//    (an image codec: then its Land); the only memory a delta sync adds on this side is the
//    slots' pages that deltas filled;
//  - a delta, in place: applied straight onto the runs (DecodeDeltaPieces: one read of the runs
//    for the base checksum, then only the changed elements; under a staged commit the base is
//    copied from the live parameters into staging in that read). The decode refuses a base whose
//    version or checksum is not the one the delta names and a result whose checksum (the base's
//    as read now, with the changed words' terms replaced) is not the sender's, before it writes:
//    the final checksum covers the resulting weights, and nothing of a refused delta lands;
//  - a delta, image codec: over the image rebuilt for the advertisement (DecodeDeltaInPlace),
//    then the codec's Land, which rewrites the whole bucket from that verified result.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sync/bindings.h"
#include "sync/codec.h"
#include "sync/context.h"
#include "sync/delta_path.h"
#include "sync/guard.h"
#include "sync/staging.h"
#include "sync/transfers.h"

namespace shardsync::sync_internal {

class DeltaReceiver {
 public:
  DeltaReceiver(const SessionContext& ctx, SyncGuard& guard, Codec& codec,
                const StagedCommit& staged)
      : ctx_(ctx), guard_(guard), codec_(codec), staged_(staged) {}

  // Connect: the host path's receive messages `msgs` (indices into plan.recvs).
  Status Prepare(const Bindings& bindings, const std::vector<int>& msgs);
  // Sync, before this rank is ready: its ready value (EncodeBases).
  Result<std::string> Advertise();
  // Bucket `bi` of receive message `mi` arrived in `slot` (c.payload bytes) with control `c`
  // (CheckControl passed): lands it, verified against c.checksum (above).
  Status Receive(int mi, int bi, const Control& c, const unsigned char* slot);
  // Where run `r` of bucket `bi` of receive message `mi` lands when the bucket comes whole: its
  // parameter bytes (in place; under a staged commit, staging), or the image rebuilt for the
  // advertisement (image codecs), which a whole bucket replaces.
  unsigned char* WholeTarget(int mi, int bi, const WireRun& r);
  // A bucket whose receives were posted in a sync that failed before it verified: its bytes may
  // have changed (a whole bucket lands before it is verified), so their version is unknown.
  // Returns what a late receive may still write into (an image codec's rebuilt image, given up:
  // the next advertisement rebuilds a fresh one), or null.
  std::shared_ptr<void> Unverify(int mi, int bi) {
    Slot& s = slots_[mi][bi];
    if (s.verified == guard_.version()) return nullptr;
    s.verified = 0;
    if (s.image.empty()) return nullptr;
    return std::make_shared<std::vector<std::byte>>(std::move(s.image));
  }
  // Image codecs: bytes of the images rebuilt for the advertisement (kept between syncs).
  int64_t ImageBytes() const {
    int64_t n = 0;
    for (const auto& msg : slots_) {
      for (const Slot& s : msg) n += static_cast<int64_t>(s.image.size());
    }
    return n;
  }
  // Sync, at its end: this sync's figures (moved out).
  DeltaSyncStats Finish();

 private:
  struct Slot {
    std::vector<WireRun> runs;  // in place: where the bucket's bytes land, in wire order
    uint64_t verified = 0;      // in place: the version its bytes were verified at (0: unknown)
    BucketBase advertised;      // this sync's advertisement
    // Image codecs: the image rebuilt for the advertisement, which a delta is applied to (one
    // copy of the bucket's wire bytes, kept between syncs).
    std::vector<std::byte> image;
  };
  std::string Who() const { return "sync rank " + std::to_string(ctx_.rank); }
  std::string Where(int mi, int bi) const;
  // The live parameter `param` (the base), and where run `r` lands.
  void* Live(int param) const;
  unsigned char* Landing(const WireRun& r) const;
  // In place: bucket `bi` of receive message `mi` as pieces (DeltaPiece) into pieces_, read from
  // `from` (null: the live parameters) and written to the landing runs.
  const std::vector<DeltaPiece>& Pieces(int mi, int bi, const unsigned char* from);
  // Image codecs: the base of bucket `bi` of receive message `mi`, rebuilt into its slot's image.
  Status Rebuild(int mi, int bi);
  Status ReceiveWhole(int mi, int bi, const Control& c, const unsigned char* slot);
  Status ReceiveDelta(int mi, int bi, const Control& c, const unsigned char* slot);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  Codec& codec_;
  const StagedCommit& staged_;
  const Bindings* bindings_ = nullptr;
  std::vector<std::vector<Slot>> slots_;  // [recv message][bucket]; empty off the host path
  std::vector<DeltaPiece> pieces_;        // in place: Pieces' result
  DeltaSyncStats st_;
};

}  // namespace shardsync::sync_internal
