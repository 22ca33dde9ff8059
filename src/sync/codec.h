// A session's view of an encoding: its codec. The planner's side of an encoding (its grid, the
// ops it adds with their plan.h Encoding, its tables in RankPlan) is the plan's; a codec is what
// a sync session does with those ops. It provides:
//  - the host path's pack step (sender) and land step (receiver), per bucket: one sender loop
//    (host_send.h) and one receiver loop (host_recv.h) own everything an encoding does not change
//    (bucket order, staging slots, transfers, control messages, checksums, stats, waits);
//  - the memory it needs (its staging slots, anything it keeps between buckets) and any step the
//    senders agree on before packing (Exchange);
//  - for prepared device pairs, its ops as encoded regions of a PairBucket (transport.h), which
//    the GPU transports hand to the codec's kernels by their encoding (gpu.h).
//
// Two kinds of codec on the host path:
//  - in place (the copy codec: kCopy ops, a cast to the wire dtype at most): the wire bytes are
//    the destination's own bytes. The loops cut a bucket into transfers that land straight in
//    the parameters (BucketTransfers), may use one-sided puts, and with the built-in CPU packer
//    pack (or post direct) transfer by transfer, checksumming in cache. The codec only packs
//    whole buckets for a packer passed in (Pack).
//  - image (block FP8, fp8_codec.h; a new encoding): the sender's Pack step builds a bucket's
//    whole wire image in a staging slot and returns its checksum; the image travels as
//    kMaxTransferBytes pieces into one of the receiver's two slots of that message; once its
//    control message arrived and its checksum matched, the codec's Land step scatters it into
//    the bound parameters (and whatever else the encoding keeps, e.g. staged rows).
// A new encoding is a new codec (a file set named for it) plus a line in MakeCodec (codec.cc); the
// loops stay as they are. Steps run per bucket, never per element.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "shardsync/plan.h"
#include "shardsync/status.h"
#include "shardsync/transport.h"
#include "sync/context.h"
#include "sync/transfers.h"

namespace shardsync::sync_internal {

class Bindings;
class PeerShapes;
class SyncGuard;

class Codec {
 public:
  virtual ~Codec() = default;

  // Whether wire bytes are the destination's bytes (the copy codec): see above.
  virtual bool in_place() const = 0;

  // --- Pack side (a trainer rank) ---
  // Connect: checks that the send messages `msgs` (indices into plan.sends: those of the host
  // path) can be packed here, and sets up what the codec keeps (e.g. its amax exchange).
  virtual Status PrepareSend(const Bindings& bindings, const std::vector<int>& msgs) = 0;
  // A staging slot for one bucket's wire image of `bytes`, in the memory Pack writes.
  virtual Result<std::shared_ptr<unsigned char>> AllocSlot(size_t bytes) = 0;
  // Whether the senders agree on something each sync before any bucket is packed (block FP8:
  // the scales of blocks shared by trainer ranks), and that step (Exchange). The session runs it
  // before the prepared pairs launch when they read its result (pairs_read_exchange).
  virtual bool exchanges() const { return false; }
  virtual Status Exchange(SyncGuard& /*guard*/) { return OkStatus(); }
  // Packs the whole wire image of bucket `b` of send message `m` into `out` (b.bytes bytes);
  // returns its checksum (checksum.h, finished over the bucket's bytes). An error fails the sync
  // (e.g. DataLoss: a value the encoding cannot carry, naming the tensor).
  virtual Result<uint64_t> Pack(const Message& m, const Bucket& b, unsigned char* out) = 0;

  // --- Land side (an engine rank; image codecs) ---
  // Connect: checks that the receive messages `msgs` (indices into plan.recvs: the host path's)
  // can land here, and sets up the codec's memory (e.g. staging of staged bands).
  virtual Status PrepareRecv(const Bindings& /*bindings*/, const std::vector<int>& /*msgs*/) {
    return OkStatus();
  }
  // Each sync, before any bucket lands.
  virtual void BeginRecv() {}
  // Bucket `bucket` of receive message `m` arrived in `img` (its b.bytes wire bytes) and its
  // checksum matched: place it.
  virtual Status Land(const Message& /*m*/, int /*bucket*/, const unsigned char* /*img*/) {
    return InternalError("this encoding lands in place, not from a bucket image");
  }
  // Each sync, once every host bucket landed (e.g. a staged band that never completed).
  virtual Status FinishRecv() { return OkStatus(); }

  // --- Delta encoding, land side (delta_recv.h) ---
  // The inverse of landing: writes into `out` (b.bytes) the wire image bucket `b` of receive
  // message `m` landed as, read from the parameters `live(param)` points at (their bound shapes
  // and dtypes), so that for unchanged parameters it is byte-identical to what the sender packed.
  // The copy codec gathers the ops' destination regions; block FP8 writes each op's e4m3 rows,
  // scales and zero pads as its Pack lays them out. Buckets with staged rows (kStage: values the
  // receiver quantized itself) have no landed image; the session refuses delta for such plans.
  virtual Status RebuildImage(const Bindings& bindings, const Message& m, const Bucket& b,
                              const std::function<void*(int param)>& live,
                              unsigned char* out) const = 0;

  // --- Prepared device pairs (pairs.h; transport.h PairBucket) ---
  // Connect, on a receiver before its parameters are registered: device memory the senders' pairs
  // write into besides the parameters (block FP8: the staging of bands whose rows straddle
  // trainer ranks), registered after them; null for none.
  virtual Result<const MemRegion*> AllocPairStaging(const Bindings& /*bindings*/) {
    return static_cast<const MemRegion*>(nullptr);
  }
  // Connect, before any pair is prepared (so no peer waits for this rank's maps): refuses ops the
  // pairs with peers `prepared(peer)` cannot run, naming the tensor, and sets up memory the send
  // pairs read (block FP8: the agreed scales of shared blocks).
  virtual Status PreparePairs(const Bindings& /*bindings*/,
                              const std::function<bool(int)>& /*prepared*/) {
    return OkStatus();
  }
  // Bucket `b` of receive message `m`, and of send message `m` (`base`: the receiver's first
  // region id), as the pair's PairBucket: copies as `local` / `remote`, the codec's other ops as
  // `encoded` regions carrying their encoding (image codecs: PairSpec::image).
  virtual PairBucket RecvBucket(const Bindings& bindings, const Message& m, const Bucket& b) = 0;
  virtual PairBucket SendBucket(const Bindings& bindings, PeerShapes& shapes, const Message& m,
                                const Bucket& b, uint32_t base) = 0;
  // Whether the send pairs read Exchange's result at their launch, so it runs before they post.
  virtual bool pairs_read_exchange() const { return false; }
  // Receiver, once every pair's checksum verified: the codec's last step over device memory
  // (block FP8: quantizing the staged bands, a packer kernel).
  virtual Status AfterPairsVerified() { return OkStatus(); }
};

// The codec of the session's plan: block FP8's for a quantized model, the copy codec otherwise.
std::unique_ptr<Codec> MakeCodec(const SessionContext& ctx);

// The dtype engine parameter `p` is bound in under the plan's codec: the wire dtype (bytes land
// in place), or what the codec's engine holds (block FP8: e4m3 weights, fp32 scales).
DType BoundDType(const PlanInputs& in, const EngineParam& p);
// Connect's binding check of a plan whose ops carry a codec's encodings (Bindings::Check).
Status CheckEncodedBindings(const SessionContext& ctx, const Bindings& bindings);

// What MakeCodec, BoundDType and CheckEncodedBindings pick from, per codec (each defined in its
// own files; block FP8's in fp8_*.cc).
std::unique_ptr<Codec> MakeCopyCodec(const SessionContext& ctx);
std::unique_ptr<Codec> MakeBlockQuantizeCodec(const SessionContext& ctx);
DType BlockQuantizeBoundDType(const EngineParam& p, DType wire);
Status CheckBlockQuantizeBindings(const SessionContext& ctx, const Bindings& bindings);

// Copies region `r` of a row-major tensor at `base` (`es`-byte elements) into the contiguous
// `out`, row-major; returns the bytes written (RebuildImage's gather).
int64_t GatherRegion(const void* base, const Shape& shape, const Region& r, int es,
                     unsigned char* out);

// How the loops cut an image codec's bucket into transfers (both ends): pieces of at most
// kMaxTransferBytes, in wire order. fn(offset in the bucket, length).
template <typename Fn>
void ForEachImageTransfer(int64_t bytes, Fn&& fn) {
  const auto step = static_cast<int64_t>(kMaxTransferBytes);
  for (int64_t at = 0; at < bytes; at += step) fn(at, std::min(step, bytes - at));
}

}  // namespace shardsync::sync_internal
