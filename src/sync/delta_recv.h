// The delta encoding's steps in the host receive loop (host_recv.h; delta_path.h has the
// protocol). Before the rank says it is ready, Advertise checksums what it holds in every host
// bucket (the wire image the codec rebuilds from the live parameters, Codec::RebuildImage: in
// place, or under a staged commit the committed ones) and names the version each was verified
// at. Each bucket arrives whole or as a delta (its control message says which) in one of the
// loop's receive slots: Apply turns a delta into the bucket's image over that rebuilt base
// (DecodeDeltaInPlace, which refuses another base or a malformed delta: the sync fails and
// nothing of it lands); the loop then checksums the image against the sender's, as every bucket,
// and Land places it (the copy codec's runs, or the image codec's Land; into staging under a
// staged commit).
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
  // Bucket `bi` of receive message `mi` arrived in `slot` (c.payload bytes) with control `c`:
  // the bucket's whole image (`slot`, or the delta applied in a buffer of this object's).
  Result<const unsigned char*> Apply(int mi, int bi, const Control& c, const unsigned char* slot);
  // The verified image `img` lands in the parameters (staging under a staged commit).
  Status Land(int mi, int bi, const Control& c, const unsigned char* img);
  // Sync, at its end: this sync's figures (moved out).
  DeltaSyncStats Finish();

 private:
  struct Slot {
    std::vector<WireRun> runs;  // in place: where the bucket's bytes land (BucketTransfers)
    uint64_t verified = 0;      // in place: the version its bytes were verified at (0: unknown)
    BucketBase advertised;      // this sync's advertisement
  };
  std::string Who() const { return "sync rank " + std::to_string(ctx_.rank); }
  std::string Where(int mi, int bi) const;
  // The live parameter `param` (what the base is rebuilt from), and where run `r` lands.
  void* Live(int param) const;
  unsigned char* Landing(const WireRun& r) const;
  // The base of bucket `bi` of receive message `mi`, rebuilt by the codec into image_.
  Status Rebuild(int mi, int bi);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  Codec& codec_;
  const StagedCommit& staged_;
  const Bindings* bindings_ = nullptr;
  std::vector<std::vector<Slot>> slots_;  // [recv message][bucket]; empty off the host path
  std::vector<std::byte> image_;          // a bucket's base rebuilt, then the decoded image
  DeltaSyncStats st_;
};

}  // namespace shardsync::sync_internal
