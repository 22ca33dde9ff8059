// The delta encoding's step in the host send loop (host_send.h; delta_path.h has the protocol).
// Under encoding delta / auto the loop packs every bucket's whole wire image (the codec's Pack)
// and hands it here: Encode compares it with the image this rank kept of what it last sent in that
// bucket and, when the receiver's advertised base is that image, returns the delta to send in its
// place (else the image itself, with the reason), then keeps the new image. A whole bucket is
// sent from the kept image, so the loop's one staging slot is free once Encode returned; with the
// built-in packer and the copy codec there is none (EncodePacked packs chunk by chunk). Memory:
// one copy of every host bucket's wire bytes (bf16: 2 bytes per parameter sent), plus a 1 MiB
// chunk (or that staging slot, as large as the largest bucket) and the deltas in flight.
#pragma once

#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "sync/context.h"
#include "sync/delta_path.h"
#include "sync/guard.h"
#include "sync/landed_sum.h"

namespace shardsync::sync_internal {

class DeltaSender {
 public:
  DeltaSender(const SessionContext& ctx, SyncGuard& guard) : ctx_(ctx), guard_(guard) {}

  // Connect: the host path's send messages `msgs` (indices into plan.sends).
  Status Prepare(const std::vector<int>& msgs);
  // Sync, receiver `dst`'s ready value: the bases it holds (ParseBases).
  Status SetBases(int dst, std::string_view value);

  // What the loop sends for one bucket: `bytes` at `data` (the kept image, which now holds the
  // new one, or the delta in `encoded`).
  struct Out {
    const unsigned char* data = nullptr;
    uint64_t bytes = 0;
    DeltaKind form = DeltaKind::kFull;
    DeltaReason reason = DeltaReason::kNoImage;
    std::shared_ptr<std::vector<std::byte>> encoded;  // alive until its send completed
    uint64_t checksum = 0;                            // EncodePacked: the new image's
  };
  // How big EncodePacked's chunks are: what the path holds instead of a staging slot.
  static constexpr size_t kChunkBytes = size_t{1} << 20;
  // Bucket `bi` of send message `mi`: its new image `img` (the bucket's bytes) of checksum
  // `checksum`, as the codec packed it.
  Result<Out> Encode(int mi, int bi, const unsigned char* img, uint64_t checksum);
  // The same for a bucket this step packs itself (the copy codec with the built-in packer):
  // `pack(from, len, out, sum)` writes wire bytes [from, from + len) at `out`, adding their
  // checksum to `sum`. With no delta to encode it packs straight into the kept image; else chunk
  // by chunk (kChunkBytes) into the encoder (DeltaAdvanceEncoder), which moves the kept image to
  // the new bytes: no bucket-sized staging. The new image's checksum is in Out::checksum.
  using PackFn = std::function<void(int64_t from, int64_t len, unsigned char* out, LandedSum& sum)>;
  Result<Out> EncodePacked(int mi, int bi, const PackFn& pack);
  // A bucket whose send did not complete: it starts over whole (the receiver may hold any of it).
  // Returns the kept image's bytes, which a whole bucket's sends may still read.
  std::shared_ptr<void> Forget(int mi, int bi) {
    auto bytes = std::make_shared<std::vector<std::byte>>(std::move(slots_[mi][bi].kept.bytes));
    slots_[mi][bi].kept = KeptImage{};
    return bytes;
  }
  // Bytes of the images this rank keeps (DeltaSyncStats::held_bytes less the staging slot).
  int64_t KeptBytes() const;
  // Sync, at its end: this sync's figures (moved out), and the bases forgotten.
  DeltaSyncStats Finish();

 private:
  struct Slot {
    KeptImage kept;
    BucketBase base;
    bool base_known = false;
  };
  std::string Who() const { return "sync rank " + std::to_string(ctx_.rank); }
  std::string Name(int mi, int bi) const {
    return "sync rank " + std::to_string(ctx_.plan.sends[mi].dst) + " bucket " + std::to_string(bi);
  }
  // Encode's and EncodePacked's common steps: the slot of bucket `bi` of message `mi` with its
  // base known; after the encoder ran, the form it leaves (size rule, encoding auto's cost); at
  // the end, the trace, the kept image's new version and checksum, and the counts.
  Result<Slot*> Known(int mi, int bi);
  Status Settle(Out& out, const DeltaEncodeResult& r);
  void Close(int mi, int bi, Out& out, uint64_t checksum, Clock::time_point t0);
  // A buffer for an encoded delta: one whose send completed, reused (its capacity: the encoder
  // writes into memory already faulted in, not fresh pages every bucket of every sync).
  std::shared_ptr<std::vector<std::byte>> Buffer();

  const SessionContext& ctx_;
  SyncGuard& guard_;
  std::vector<std::vector<Slot>> slots_;  // [send message][bucket]; empty off the host path
  std::vector<std::shared_ptr<std::vector<std::byte>>> buffers_;  // Buffer's
  std::vector<unsigned char> chunk_;                              // EncodePacked's
  DeltaLink link_;
  DeltaSyncStats st_;
};

}  // namespace shardsync::sync_internal
