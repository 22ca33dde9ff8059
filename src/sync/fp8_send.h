// A trainer rank's host send path for block-FP8 plans (fp8_plan.h): each bucket's wire image is
// built in one of two staging slots (quantize ops with the fused CPU quantize-pack, copy ops cast
// to the wire dtype, stage ops as the trainer's raw values, every op's pad zeroed), checksummed
// while it is built, and sent as transfers of at most kMaxTransferBytes followed by its control
// message. Blocks shared with other trainer ranks (kAmax) are quantized with the scale their
// holders agree on through the store first (ExchangeAmax), here or by the rank's prepared pairs
// (cuda_ipc: the partials taken by the packer's kernel, the scales uploaded for the launch).
// A non-finite trainer value in a
// quantized block fails the sync with DataLoss naming the tensor (block FP8 cannot carry it; the
// engine ranks stay poisoned).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sync/bindings.h"
#include "sync/context.h"
#include "sync/guard.h"
#include "sync/host_path.h"
#include "sync/pairs.h"

namespace shardsync::sync_internal {

// What packing one bucket found.
struct Fp8Packed {
  uint64_t checksum = 0;  // finished (checksum.h) over the bucket's wire bytes, pads included
  int64_t nonfinite = 0;  // non-finite inputs of quantize ops (their blocks are NaN)
  int32_t first_bad_op = -1;
};

// The scales of the blocks this rank exchanged amaxes for (kAmax ops): per band (tensor, first
// row), the index of its first block in `scales`.
struct Fp8AmaxScales {
  std::map<std::pair<int32_t, int64_t>, int64_t> slot;
  std::vector<float> scales;
};

// Packs bucket `b` of FP8 send message `m` from the sender's bound sources into `out`
// (b.bytes bytes); kAmax ops take their blocks' scales from `amax`. InvalidArgument for an op
// the quantizer refuses (a malformed region).
Result<Fp8Packed> PackFp8Bucket(const SessionContext& ctx, const Bindings& bindings,
                                const Message& m, const Bucket& b, unsigned char* out,
                                const Fp8AmaxScales* amax = nullptr);

class Fp8HostSender final : public HostSendPath {
 public:
  Fp8HostSender(const SessionContext& ctx, SyncGuard& guard) : ctx_(ctx), guard_(guard) {}

  // Connect: which messages go this way (not prepared pairs), the staging slots, and where the
  // amax exchange reads this rank's rows (host memory, or device memory through the packer).
  Status Prepare(const Bindings& bindings, PeerShapes& shapes, PreparedPairs& pairs,
                 std::map<int, uint32_t> regbase) override;
  bool has_buckets() const override { return !order_.empty(); }
  // kAmax plans (fp8_plan.h AmaxBand): whether this rank holds rows of blocks shared with
  // other trainer ranks.
  bool exchanges() const override { return !ctx_.plan.amax_bands.empty(); }
  // Posts this version's partial amaxes of those blocks under the job's key
  // v<version>/amax/<rank>#, reads the other holders' (watched: a gone holder or an abort fails
  // the wait, bounded by the sync's deadline) and derives every block's scale for Send. A
  // non-finite value in a shared block fails every holder with DataLoss naming the tensor. Rows
  // in device memory are reduced by the packer (PartialAmax); the scales then go to the device
  // memory the prepared pairs' amax ops read (PreparedPairs::UploadAmaxScales), so a rank whose
  // pairs carry amax ops runs this before posting them.
  Status ExchangeAmax() override;
  Status Send(RankSyncStats& st) override;

 private:
  // The blocks' scales from this rank's partials and the peers' values (plan.amax_peers order).
  Status Combine(const std::vector<uint32_t>& own, const std::vector<std::string>& got);
  Status NonFinite(const AmaxBand& b, bool mine) const;
  struct Flying {
    int msg = 0, bucket = 0, slot = 0;
    std::vector<XferId> ids;
    std::unique_ptr<Control> control;
  };
  Status Post(int mi, int bi, int slot, std::deque<Flying>& flying, std::vector<uint64_t>& seq);
  Status FinishOldest(std::deque<Flying>& flying, RankSyncStats& st);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  const Bindings* bindings_ = nullptr;
  std::vector<std::pair<int, int>> order_;  // (message, bucket) in posting order
  std::unique_ptr<unsigned char[]> slots_[2];
  // Controls of a failed sync may still be read by the transport: kept for the session's life.
  std::vector<std::unique_ptr<Control>> graveyard_;
  Fp8AmaxScales amax_;
  // The bands whose rows this rank holds in device memory, as the packer reduces them, and
  // whether each band (plan order) is one of them.
  std::vector<Fp8AmaxTask> device_amax_;
  std::vector<bool> band_on_device_;
  PreparedPairs* pairs_ = nullptr;
  uint64_t amax_posted_ = 0;  // the version whose partials this rank last posted
};

}  // namespace shardsync::sync_internal
