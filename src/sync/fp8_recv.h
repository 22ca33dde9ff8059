// An engine rank's host receive path for block-FP8 plans (fp8_plan.h). Each bucket lands in one of
// two receive slots of its message, is verified against its sender's checksum (pads included, and
// checked to be zero), then scattered: e4m3 bytes into the weight, fp32 scales into its
// weight_scale_inv, copies into their parameters, staged rows into the staging buffer. A staged
// band is quantized with Fp8QuantizeBlock (fp8.h) the moment its last rows landed verified, so it
// is a deterministic function of checked bytes; a non-finite value there fails the sync with
// DataLoss naming the parameter.
#pragma once

#include <memory>
#include <vector>

#include "sync/bindings.h"
#include "sync/context.h"
#include "sync/guard.h"
#include "sync/host_path.h"
#include "sync/pairs.h"

namespace shardsync::sync_internal {

class Fp8HostReceiver final : public HostRecvPath {
 public:
  Fp8HostReceiver(const SessionContext& ctx, SyncGuard& guard) : ctx_(ctx), guard_(guard) {}

  // Connect: which messages come this way, and the staging buffer of the rank's bands.
  Status Prepare(const Bindings& bindings, const PreparedPairs& pairs) override;
  // Sync: every host bucket received, verified and scattered; every band quantized.
  Status Receive(RankSyncStats& st) override;

  // Quantizes staged band `band` from `staging` into the bound weight and scale parameters;
  // returns the non-finite inputs it saw.
  static int64_t QuantizeBand(const StagedBand& band, const unsigned char* staging,
                              const Bindings& bindings);

 private:
  // One message's receive state: its slots and the buckets posted into them.
  struct Posted {
    int bucket = 0;
    int slot = 0;
    std::vector<XferId> ids;  // data, then the control message
  };
  struct Inbox {
    int msg = 0;
    int next = 0;      // next bucket to post
    uint64_t seq = 0;  // next data tag
    std::vector<Posted> posted;
    std::shared_ptr<unsigned char> slots[2];
    std::shared_ptr<Control> ctrl;  // one per slot
  };

  Status PostBucket(Inbox& in, int slot);
  // The bucket in `p` arrived: verify, scatter, and quantize the bands it completed.
  Status Land(Inbox& in, const Posted& p, std::vector<int64_t>& band_left);
  Status Scatter(const Message& m, const Bucket& b, const unsigned char* img, int bucket,
                 std::vector<int64_t>& band_left);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  const Bindings* bindings_ = nullptr;
  std::vector<int> msgs_;            // recv messages of the host path
  std::vector<int64_t> slot_bytes_;  // per recv message: its largest bucket
  std::unique_ptr<unsigned char[]> staging_;
  // Buffers a failed sync's receives may still write into: kept for the session's life.
  std::vector<std::shared_ptr<void>> graveyard_;
};

}  // namespace shardsync::sync_internal
