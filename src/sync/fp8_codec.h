// The block-FP8 codec of the host data path (codec.h; fp8_plan.h, docs/fp8.md), an image
// codec. Pack (fp8_host_pack.cc): a bucket's wire image is built in a staging slot (quantize ops
// with the fused CPU quantize-pack, copy ops cast to the wire dtype, stage ops as the trainer's raw
// values, every op's pad zeroed) and checksummed while it is built. Blocks shared with other
// trainer ranks (kAmax) are quantized with the scale their holders agree on through the store
// first (Exchange), here or by the rank's prepared pairs (cuda_ipc: the partials taken by the
// packer's kernel, the scales uploaded for the launch). A non-finite trainer value in a quantized
// block fails the sync with DataLoss naming the tensor (block FP8 cannot carry it; the engine
// ranks stay poisoned).
// Land (fp8_host_land.cc): a verified bucket image (pads checked to be zero) is scattered: e4m3
// bytes into the weight, fp32 scales into its weight_scale_inv, copies into their parameters,
// staged rows into the staging buffer. A staged band is quantized with Fp8QuantizeBlock (fp8.h)
// the moment its last rows landed verified, so it is a deterministic function of checked bytes;
// a non-finite value there fails the sync with DataLoss naming the parameter.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardsync/fp8.h"
#include "shardsync/pack.h"
#include "shardsync/transport.h"
#include "sync/bindings.h"
#include "sync/codec.h"
#include "sync/context.h"
#include "sync/guard.h"
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

class Fp8Codec final : public Codec {
 public:
  explicit Fp8Codec(const SessionContext& ctx) : ctx_(ctx) {}

  bool in_place() const override { return false; }

  // Pack side: host sources and two-sided peers for the host path's messages, and where the amax
  // exchange reads this rank's rows (host memory, or device memory through the packer).
  Status PrepareSend(const Bindings& bindings, const std::vector<int>& msgs) override;
  Result<std::shared_ptr<unsigned char>> AllocSlot(size_t bytes) override;
  // kAmax plans (fp8_plan.h AmaxBand): whether this rank holds rows of blocks shared with
  // other trainer ranks.
  bool exchanges() const override { return !ctx_.plan.amax_bands.empty(); }
  // Posts this version's partial amaxes of those blocks under the job's key
  // v<version>/amax/<rank>#, reads the other holders' (watched: a gone holder or an abort fails
  // the wait, bounded by the sync's deadline) and derives every block's scale for Pack. A
  // non-finite value in a shared block fails every holder with DataLoss naming the tensor. Rows
  // in device memory are reduced by the packer (PartialAmax); the scales then go to the device
  // memory the prepared pairs' amax ops read (PreparedPairs::UploadAmaxScales), so a rank whose
  // pairs carry amax ops runs this before posting them.
  Status Exchange(SyncGuard& guard) override;
  Result<uint64_t> Pack(const Message& m, const Bucket& b, unsigned char* out) override;

  // Land side: host parameters and two-sided peers, and the staging of the rank's bands.
  Status PrepareRecv(const Bindings& bindings, const std::vector<int>& msgs) override;
  void BeginRecv() override;
  Status Land(const Message& m, int bucket, const unsigned char* img) override;
  Status FinishRecv() override;
  // Delta encoding: the landed image of a bucket without stage ops (codec.h).
  Status RebuildImage(const Bindings& bindings, const Message& m, const Bucket& b,
                      const std::function<void*(int param)>& live,
                      unsigned char* out) const override;

  // Prepared pairs (fp8_pairs.cc).
  Result<const MemRegion*> AllocPairStaging(const Bindings& bindings) override;
  Status PreparePairs(const Bindings& bindings, const std::function<bool(int)>& prepared) override;
  PairBucket RecvBucket(const Bindings& bindings, const Message& m, const Bucket& b) override;
  PairBucket SendBucket(const Bindings& bindings, PeerShapes& shapes, const Message& m,
                        const Bucket& b, uint32_t base) override;
  // Trainers whose prepared pairs carry amax ops: Exchange uploads the agreed scales they read.
  bool pairs_read_exchange() const override { return amax_scales_ != nullptr; }
  Status AfterPairsVerified() override;

  // Quantizes staged band `band` from `staging` into the bound weight and scale parameters;
  // returns the non-finite inputs it saw.
  static int64_t QuantizeBand(const StagedBand& band, const unsigned char* staging,
                              const Bindings& bindings);

 private:
  // The blocks' scales from this rank's partials and the peers' values (plan.amax_peers order).
  Status Combine(const std::vector<uint32_t>& own, const std::vector<std::string>& got);
  Status NonFinite(const AmaxBand& b, bool mine) const;
  // FP8 ops prepared pairs do not run (amax-exchanged blocks over two-sided pairs; staged bands
  // without device staging), refused naming the tensor.
  Status RefuseUnbuilt(const Bindings& bindings, const std::function<bool(int)>& prepared) const;
  // Trainers with amax ops over prepared pairs: device memory (the packer's) for the agreed
  // scales of every shared block, and each band's slot in it.
  Status AllocAmaxScales(const std::function<bool(int)>& prepared);
  // The agreed scales (plan slot order) copied into that device memory; no-op without it.
  Status UploadAmaxScales(const std::vector<float>& scales);

  const SessionContext& ctx_;
  const Bindings* bindings_ = nullptr;
  // Pack side.
  Fp8AmaxScales amax_;
  // The bands whose rows this rank holds in device memory, as the packer reduces them, and
  // whether each band (plan order) is one of them.
  std::vector<Fp8AmaxTask> device_amax_;
  std::vector<bool> band_on_device_;
  uint64_t amax_posted_ = 0;  // the version whose partials this rank last posted
  // Land side.
  std::vector<int> recv_msgs_;  // recv messages of the host path
  std::unique_ptr<unsigned char[]> host_staging_;
  // The staged rows still to land this sync, per band (bands staged over prepared pairs are the
  // device staging's: PreparedPairs::QuantizeStaged).
  std::vector<int64_t> band_left_;
  // Prepared pairs. Receivers with staged bands in device memory (AllocPairStaging): the staging,
  // its registration and the bands' quantize tasks over it.
  std::shared_ptr<unsigned char> device_staging_;
  MemRegion staging_region_;
  std::vector<Fp8BandTask> bands_;
  // Trainers with amax ops over prepared pairs (AllocAmaxScales): the agreed scales' device
  // memory, and per band (tensor, first row) its first block's index there.
  std::shared_ptr<unsigned char> amax_buf_;
  float* amax_scales_ = nullptr;
  std::map<std::pair<int32_t, int64_t>, int64_t> pair_amax_slot_;
};

}  // namespace shardsync::sync_internal
