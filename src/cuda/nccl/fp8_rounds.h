// Internal: block-FP8 rounds of a two-sided device pair (nccl, nccl_pairs.cc). A round is one plan
// bucket sent as the plan's FP8 wire image, the bytes the host path sends (fp8.h Fp8WireBytes per
// quantize op: e4m3 rows, zero pad to 8, fp32 scales, zero pad to 8; copy ops as wire-dtype
// elements, zero pad to 8), built in the round's slot on the sender and scattered from it on the
// receiver. Free of CUDA headers so C++ tests can run a round's sender and receiver batches on one
// GPU without NCCL; compiled only with CUDA (SHARDSYNC_HAVE_CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shardsync/dtype.h"
#include "shardsync/gpu.h"
#include "shardsync/status.h"
#include "shardsync/transport.h"

namespace shardsync::gpu {

// Bytes of the scratch a round reads its zero pads from (sender) or dumps them into (receiver):
// device memory the caller owns, zeroed on the sender side. Pads longer than this are cut.
inline constexpr int64_t kImageRoundScratchBytes = 256;

// Sender. `pack`: the quantize ops as EncodedTasks writing their e4m3 rows and scales into `slot`
// at their wire offsets (the kernel reads back the same words: landed == slot), the copy ops cast
// to the wire dtype at theirs, every byte between them written as a zero (runs from `zeros`), so
// no byte of [0, bytes) keeps a previous round's value. `verify`: the slot's bytes summed by
// position (one kVerify U8 run over the round), the packed checksum of the bytes that are sent;
// the Fp8Batch's own sums are not used (its copies are keyed by a compact image). Launch `pack`
// then `verify` on one stream; `pack->NonFinite()` counts non-finite trainer values (their blocks
// are NaN on the wire).
struct ImageSendRound {
  std::unique_ptr<CopyBatch> pack;
  std::unique_ptr<CopyBatch> verify;
};
// `b`: a sender's FP8 PairBucket (PairSpec::fp8: `local` the copy ops' sources with
// `wire_offsets`, `quantize` with src.wire_offset in the whole image); no stage ops.
Result<ImageSendRound> PrepareImageSendRound(const PairBucket& b, DType wire, void* slot,
                                             const void* zeros, int device, const std::string& who);

// Receiver: one kUnpack U8 batch whose runs tile the round: e4m3 rows into the weight parameter
// (strided), each scale row's bytes into weight_scale_inv, copy ops' bytes into their parameters
// (which hold the wire dtype), pads into `sink`. Its checksum, keyed by position like the
// sender's verify, is the landed checksum of the round.
Result<std::unique_ptr<CopyBatch>> PrepareImageRecvRound(const PairBucket& b, DType wire,
                                                         const void* slot, void* sink, int device,
                                                         const std::string& who);
// The same batch's spec, unprepared (the delta pairs reverse its runs to rebuild the image a
// receiver holds: cuda/delta/delta_recv.cc).
Result<BatchSpec> ImageRecvRoundSpec(const PairBucket& b, DType wire, const void* slot, void* sink,
                                     const std::string& who);

}  // namespace shardsync::gpu
