// Block-FP8 sessions (fp8_plan.h, docs/fp8.md): the codec's helpers for the parts every session
// shares (bindings: the checks of FP8 bindings; the engine dtypes are fp8_plan.h Fp8DestDType) and
// for its data path (where stage ops land in a receiver's staging, the receiver's band quantize
// tasks). The session's `plan` is the block-FP8 plan itself (its ops carry their Encoding):
// transport peers, region bases and the parameters named in a checksum mismatch come from it as for
// bf16.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "shardsync/fp8_plan.h"
#include "sync/context.h"
#include "sync/transfers.h"

namespace shardsync::sync_internal {

class Bindings;

// Connect's binding check for FP8 sessions: every source an op reads bound and holding the op's
// region; every parameter, scale and staged band an op writes inside its binding.
Status CheckFp8Bindings(const SessionContext& ctx, const Bindings& bindings);

// Staged bands over prepared pairs (device memory, docs/fp8.md): the sender writes each stage op's
// raw rows straight into the receiver's staging, which the receiver quantizes once the sync's
// data is verified. Where stage op `op` lands in the receiver's staging, in bytes of its band's
// row-major image: at byte `offset` of the staging, region `dst` of a tensor of `shape` (the
// band's rows up to the op's last, every column). Computed from the sender's own plan.
struct Fp8StageTarget {
  int64_t offset = 0;
  Shape shape;
  Region dst;
};
Fp8StageTarget Fp8StageTargetOf(const TransferOp& op);
// The receiver's quantize pass: each staged band of `plan` from its place in `staging` into its
// e4m3 rows and scales in `dests` (the bound parameters).
std::vector<Fp8BandTask> Fp8BandTasks(const RankPlan& plan, const std::vector<DestBinding>& dests,
                                      const unsigned char* staging);
// DataLoss naming the parameter and rows of the first band with non-finite values (`bad`: per
// band, as Packer::QuantizeBands returns), or OK.
Status Fp8BandsStatus(int rank, const RankPlan& plan, const std::vector<DestBinding>& dests,
                      const std::vector<int64_t>& bad);

// NotFound / DataLoss text helpers shared by the FP8 parts: "sync rank R".
inline std::string RankName(int rank) { return "sync rank " + std::to_string(rank); }

}  // namespace shardsync::sync_internal
