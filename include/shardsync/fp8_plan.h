// Block-FP8 sync plan (docs/fp8.md): trainer shards (fp32 / bf16, unquantized) -> engine
// parameters in float8_e4m3fn + fp32 weight_scale_inv per 128 x 128 block, exact to the byte.
//
// Where each block is quantized is a plan-level decision, made once per job:
//  * kQuantize: one trainer rank holds every row of a band of blocks (FSDP chunk boundaries on the
//    128 grid, the usual case): it reads its values once and sends e4m3 bytes + the blocks' scales
//    (3 bytes per element moved instead of 4 for bf16 read + bf16 write).
//  * kStage: a band's rows straddle trainer ranks (a chunk boundary inside a block, e.g. fsdp=4 on
//    768-row experts: 192 rows per rank), so no sender sees the block's amax. Each holder sends its
//    rows raw (trainer dtype, exact) into a staging area of the receiver, which quantizes the band
//    with the same quantizer once every part landed (RankPlan::staged). Costs trainer-dtype bytes
//    on the wire for those bands, the staging memory, and a pass on the receiver.
//  * kAmax (PlanOptions::straddle = kAmax, the default): the same straddling band without
//    staging. Every trainer rank holding rows of it posts the band's partial amax over its rows
//    (per 128-column block) to the store once per sync, reads the other holders' partials, and
//    quantizes its own rows with the block's scale (max of partials / 448: max is associative, so
//    bit-exact with the whole block's quantizer); the holder of the band's first row also sends
//    the scales. e4m3 on the wire, no staging, no receiver pass; host path and one-sided device
//    pairs (cuda_ipc), not nccl pairs.
//  * kCopy: parameters the engine keeps unquantized (embeddings, norms, biases, router gate,
//    lm_head, modules_to_not_convert) move as in a bf16 plan.
// Megatron trainers hold whole 128 x 128 blocks of every quantized weight for the usual models
// (head_dim 128, per-rank widths on the grid): their ops are kQuantize / kCopy read from local
// parameters (Message::local); a layout whose Megatron shards cut a block is refused at plan
// time naming the HF tensor, its rows and columns and the Megatron rank.
// Every op's wire size is padded to 8 bytes (zeros, checksummed) so every op and every scale
// section starts on a checksum word.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/plan.h"

namespace shardsync {

// --fp8-split (PlanOptions::straddle): Encoding::kAmax | Encoding::kStage.
using Fp8Split = Encoding;
std::string_view Fp8SplitName(Fp8Split s);  // "amax" | "stage"
// "amax" | "stage"; InvalidArgument naming `flag` otherwise.
Result<Fp8Split> ParseFp8Split(std::string_view s, std::string_view flag = "--fp8-split");

// Bumped whenever the FP8 planner's output for the same inputs changes; part of PlanHash for
// quantized models.
inline constexpr std::string_view kFp8PlannerVersion = "shardsync-fp8-plan/1";

// The dtype an engine parameter of a block-FP8 map is bound in: e4m3 weights and their fp32
// weight_scale_inv as they are; every other parameter in the wire dtype (bytes land in place).
// Sessions check bindings against it; harnesses and engine hooks allocate with it.
DType Fp8DestDType(const EngineParam& p, DType wire);
// True for the fp32 weight_scale_inv of a block-FP8 weight: filled by its weight's ops, checked
// with its weight.
bool IsFp8ScaleParam(const EngineParam& p);

// A block-FP8 plan is a RankPlan (plan.h PlanForRank) whose ops carry their Encoding: kCopy,
// kQuantize, kStage (with RankPlan::staged) or kAmax (with RankPlan::amax_bands). Wire bytes:
// kCopy numel * wire dtype; kQuantize Fp8WireBytes(rows, cols); kStage numel * trainer dtype;
// kAmax Fp8PartWireBytes(rows, cols, scale_param >= 0); each rounded up to 8. A kAmax op's src is
// the sender's rows of one block row (the band is rows [src row / 128 * 128, + 128) of the
// tensor), columns on the grid; kQuantize rows are block-aligned.
// Planning one needs a bucket cap holding one 128 x 128 block (InvalidArgument naming --bucket-mb
// below 64 KiB).

// Its summary is a PlanSummary (SummarizePlan fills the block-FP8 figures) and ValidatePlan
// checks it.

}  // namespace shardsync
