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
//    with the same quantizer once every part landed (Fp8StagedBand). Costs trainer-dtype bytes on
//    the wire for those bands, the staging memory, and a pass on the receiver.
//  * kAmax (PlanOptions::fp8_split = kAmax, the default): the same straddling band without
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
// parameters (Fp8Message::local); a layout whose Megatron shards cut a block is refused at plan
// time naming the HF tensor, its rows and columns and the Megatron rank.
// Every op's wire size is padded to 8 bytes (zeros, checksummed) so every op and every scale
// section starts on a checksum word.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardsync/plan.h"

namespace shardsync {

// Bumped whenever the FP8 planner's output for the same inputs changes; part of PlanHash for
// quantized models.
inline constexpr std::string_view kFp8PlannerVersion = "shardsync-fp8-plan/1";

enum class Fp8OpKind : uint8_t { kCopy, kQuantize, kStage, kAmax };
std::string_view Fp8OpKindName(Fp8OpKind k);  // "copy" | "quantize" | "stage" | "amax"

struct Fp8Op {
  Fp8OpKind kind = Fp8OpKind::kCopy;
  int32_t tensor = 0;  // index into HfTensorInventory(model): the trainer's tensors
  int32_t param = 0;   // kCopy / kQuantize: index into the dst rank's params
  // kQuantize, and kAmax ops that send their band's scales: the weight_scale_inv parameter of
  // `param`; -1 for a kAmax op of another holder of the band (e4m3 rows only).
  int32_t scale_param = -1;
  int32_t stage = -1;  // kStage: index into the receiver's Fp8RankPlan::staged
  // Region of the HF tensor: rows block-aligned for kQuantize; for kAmax the sender's rows of one
  // block row (the band is rows [src row / 128 * 128, + 128) of the tensor), columns on the grid.
  Region src;
  Region dst;        // kCopy / kQuantize / kAmax: param region; kStage: rows x cols of the band
  Region scale_dst;  // kQuantize, kAmax with scale_param >= 0: the scale param's blocks of `dst`
  int64_t wire_offset = 0;  // multiple of 8 inside the message's wire image
  // kCopy: numel * wire dtype; kQuantize: Fp8WireBytes(rows, cols); kStage: numel * trainer
  // dtype; kAmax: Fp8PartWireBytes(rows, cols, scale_param >= 0); each rounded up to 8.
  int64_t bytes = 0;
  // kStage: the band's staging_offset at the receiver. A stage op spans whole rows of its band
  // (dst: rows x every column), so its bytes sit at staging_offset + dst row * row bytes: what a
  // sender writing straight into the receiver's staging (cuda_ipc) needs, since only the
  // receiver's plan holds the band.
  int64_t staging_offset = 0;
};

// A band of rows (<= 128) x whole blocks of one engine piece whose rows straddle trainer ranks:
// the receiver quantizes it from staged raw values once all its kStage ops landed.
struct Fp8StagedBand {
  int32_t tensor = 0;
  int32_t param = 0;
  int32_t scale_param = 0;
  Region src;                  // HF region of the band
  Region dst;                  // fp8 param region
  Region scale_dst;            // scale param region
  DType dtype = DType::kF32;   // of the staged values (the trainer dtype)
  int64_t staging_offset = 0;  // into the receiver's staging buffer, multiple of 8; row-major
  int64_t bytes = 0;           // rows * cols * dtype size
};

// A band of one block row (<= 128 rows x every column of an HF tensor) whose rows straddle FSDP
// trainer ranks, as one of its holders sees it (kAmax): the holder computes the partial amax of
// its own rows per 128-column block, posts it at `slot` of its store value, and combines it with
// the other holders' at their slots.
struct Fp8AmaxHolder {
  int32_t rank = 0;  // sync rank (trainer) of another holder, in this rank's group
  int64_t slot = 0;  // index of the band's first block in that holder's value
};
struct Fp8AmaxBand {
  int32_t tensor = 0;
  int64_t row0 = 0, rows = 0;      // the band: HF rows [row0, row0 + rows), on the 128 grid
  int64_t own0 = 0, own_rows = 0;  // the rows this rank holds
  int64_t blocks = 0;              // ceil(columns / 128): partials per holder
  int64_t slot = 0;                // index of the band's first block in this rank's value
  std::vector<Fp8AmaxHolder> others;
};

struct Fp8Message {
  int32_t src = 0;  // sync rank (trainer)
  int32_t dst = 0;  // sync rank (engine)
  int64_t bytes = 0;
  std::vector<Fp8Op> ops;
  std::vector<Bucket> buckets;
  // Megatron trainers: local[i] says where the sender holds ops[i].src (Message::local); empty
  // for FSDP-like layouts.
  std::vector<LocalSource> local;
};

struct Fp8RankPlan {
  int rank = 0;
  std::string plan_hash;
  std::vector<Fp8Message> sends;      // trainers, ordered by dst
  std::vector<Fp8Message> recvs;      // engines, ordered by src
  std::vector<Fp8StagedBand> staged;  // engines: bands this rank quantizes itself
  int64_t staging_bytes = 0;          // engines: staging buffer size
  // Trainers of kAmax plans: every straddling band this rank holds rows of (sorted by tensor,
  // row), whether or not it sends them (replica groups share the work, every holder posts), the
  // length of its value (partials, 4 bytes each) and the ranks whose values it reads.
  std::vector<Fp8AmaxBand> amax_bands;
  int64_t amax_blocks = 0;
  std::vector<int32_t> amax_peers;
};

// The plan of one sync rank for a model with a QuantConfig (FailedPrecondition without one).
// Deterministic; the same inputs give the same plan on every machine. The bucket cap must hold
// one 128 x 128 block (InvalidArgument naming --bucket-mb below 64 KiB).
Result<Fp8RankPlan> PlanFp8ForRank(const PlanInputs& in, int sync_rank);

// The plan's outline as a RankPlan: the same messages and buckets, byte for byte, and one
// TransferOp per FP8 op naming its HF tensor, source region, engine parameter (the e4m3 weight for
// quantize and stage ops), wire offset and wire bytes; a stage op's dst is its rows x columns
// inside the staged band. What SyncSession::plan() returns for a block-FP8 model: peers, buckets
// and bytes, not a replayable bf16 plan.
RankPlan Fp8PlanOutline(const Fp8RankPlan& fp8);

struct Fp8PlanSummary {
  std::string plan_hash;
  int64_t ops = 0, messages = 0;
  int64_t total_bytes = 0;                  // on the wire, every pair
  int64_t copy_bytes = 0;                   // kCopy ops
  int64_t quantize_bytes = 0;               // kQuantize ops (e4m3 + scales + padding)
  int64_t stage_bytes = 0;                  // kStage ops (raw trainer values)
  int64_t sender_quantized_elements = 0;    // quantized by trainer ranks on the fly
  int64_t receiver_quantized_elements = 0;  // quantized by engine ranks from staging
  int64_t staged_bands = 0;
  int64_t max_staging_bytes = 0;  // largest staging buffer of an engine rank
  // kAmax: ops' bytes (e4m3 + the scale senders' scales), elements, the straddling bands
  // (distinct HF block rows) and their blocks, and the store bytes of the exchange per sync:
  // every holder's value (4 bytes per block it holds rows of) written once and read by each
  // other holder of its bands.
  int64_t amax_bytes = 0;
  int64_t amax_elements = 0;
  int64_t amax_bands = 0, amax_blocks = 0;
  int64_t exchange_write_bytes = 0, exchange_read_bytes = 0;
  // Memory-bound figure of the same work: every trainer element the plan reads, read once in
  // the trainer dtype, plus every engine byte (e4m3, scales, unquantized params) written once.
  int64_t bound_read_bytes = 0;
  int64_t bound_write_bytes = 0;
  std::vector<EngineRankSummary> engine_ranks;  // recv_bytes (wire) and owned_bytes (in memory)
  std::vector<TrainerRankSummary> trainer_ranks;
};
// Enumerates every engine rank's plan (the job's traffic is the union of their receives).
Result<Fp8PlanSummary> SummarizeFp8Plan(const PlanInputs& in);

// Validates a whole (small) FP8 job element by element: every engine byte and every scale
// covered exactly once (by a kCopy, a kQuantize, a staged band or a zero-fill), each from the HF
// bytes the shard map says, every staged band's rows landed exactly once, sources held by the
// sending trainer rank, both sides of every message identical, wire offsets and buckets
// consistent.
Status ValidateFp8Plan(const PlanInputs& in);

}  // namespace shardsync
