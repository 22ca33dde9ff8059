// Transfer plan: trainer shards -> engine shards, point to point, computed once per job from pure
// inputs and replayed every step. Deterministic: the same inputs give the same plan everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/model.h"
#include "shardsync/region.h"
#include "shardsync/shard_map.h"
#include "shardsync/status.h"
#include "shardsync/trainer_map.h"

namespace shardsync {

// Where trainer ranks hold each HF tensor. FSDP2 Shard(0) uses torch.chunk sizes: ceil(n/S) rows
// per rank, trailing ranks short or empty.
//
// fsdp / hsdp / replicate / single are R replica groups x S shards along dim 0 (rank = g*S + s):
// fsdp=S is 1xS, hsdp=RxS, replicate=S is Sx1, single is 1x1. megatron is a Megatron-Core
// TP x PP (x VPP x EP x ETP x CP x DP) layout (trainer_map.h, docs/megatron.md): its ranks hold
// local parameters (BuildTrainerParams), not dim-0 slabs of HF tensors.
struct TrainerSpec {
  enum class Kind { kFsdp, kHsdp, kReplicate, kSingle, kMegatron };
  Kind kind = Kind::kFsdp;
  int replicas = 1;         // hsdp R (replicate: S)
  int shards = 1;           // fsdp/hsdp S
  MegatronLayout megatron;  // kMegatron only
  int world() const;
  // "fsdp=8", "hsdp=2x4", "replicate=4", "single", "megatron=tp=2,pp=2" (canonical: the plan hash
  // covers it).
  std::string ToString() const;
  int groups() const;            // R: full copies (megatron: cp*dp copies of the dense grid)
  int shards_per_group() const;  // S: dim-0 chunks per copy (megatron: tp*pp)
};
// "fsdp=S", "hsdp=RxS", "replicate=S", "single" or "megatron=tp=T,pp=P,..." (trainer_map.h);
// InvalidArgument naming the field ("--trainer megatron vpp: ...").
Result<TrainerSpec> ParseTrainerSpec(std::string_view s);
// Region of a tensor of `shape` held by trainer `rank` (ndim kept; empty when it holds none).
// Megatron ranks hold local parameters, not HF regions: empty for them (use BuildTrainerParams).
Region TrainerHeldRegion(const TrainerSpec& t, int rank, const Shape& shape);

// The trainer map of one rank (trainer_map.h): its local parameters and the HF bytes each holds,
// `dtype` being the dtype the trainer holds (PlanInputs::trainer_dtype). FSDP-like layouts give
// one parameter per HF tensor. InvalidArgument naming the field when the layout does not fit the
// model (the divisibilities Megatron-Core asserts); OutOfRange for a rank outside the world.
Result<TrainerRankParams> BuildTrainerParams(const ModelSpec& model, const TrainerSpec& t, int rank,
                                             DType dtype);
// Checks a trainer layout against a model (Megatron-Core's asserts; nothing for FSDP-like).
Status CheckTrainerLayout(const ModelSpec& model, const TrainerSpec& t);
// Megatron: half-open global decoder layer range of model chunk `chunk` on pipeline rank
// `pp_rank` (transformer_layer.py get_transformer_layer_offset, transformer_block.py
// get_num_layers_to_build).
Result<std::pair<int64_t, int64_t>> MegatronChunkLayers(const MegatronLayout& m, int64_t num_layers,
                                                        int pp_rank, int chunk);
// Megatron: padded vocabulary, ceil(V / (vocab_div*tp)) * vocab_div*tp (Megatron's
// vocab_size_with_padding); tail rows past V hold no HF byte.
int64_t MegatronPaddedVocab(const MegatronLayout& m, int64_t vocab_size);

// Renderings of trainer maps (`shardsync shards --trainer`; JSON schema in docs/cli.md).
// One row per rank: Megatron coordinates and layers, parameters, HF elements held, bytes.
std::string TrainerMapToTable(const ModelSpec& model, const TrainerSpec& t,
                              const std::vector<TrainerRankParams>& ranks);
// {model, trainer, world, [padded_vocab], ranks: [{rank, [coords], params: [{name, chunk, shape,
// dtype, pieces: [{source, src_offset, local_offset, extent}]}]}]}, one line.
std::string TrainerMapToJson(const ModelSpec& model, const TrainerSpec& t,
                             const std::vector<TrainerRankParams>& ranks);
// Where the bytes of local parameter `name` come from on every rank holding it, or, given an HF
// tensor name, where ranks hold its bytes. NotFound if neither.
Result<std::string> ExplainTrainerParam(const std::vector<TrainerRankParams>& ranks,
                                        std::string_view name);

struct RolloutSpec {
  int dp = 1;
  ShardSpec shard;  // engine, tp, pp, ep, partition
  int world() const { return dp * shard.tp * shard.pp; }
};
// "dp=2,tp=2,pp=2[,ep=2]"; errors name the field.
Result<RolloutSpec> ParseRolloutSpec(std::string_view s, EngineKind engine);

// How an op's bytes travel and land. Every op of an unquantized plan is a copy; a block-FP8 plan
// (ModelSpec::quant, fp8_plan.h) adds the other three, its codec's (docs/fp8.md).
enum class Encoding : uint8_t {
  kCopy,      // the source cast to the wire dtype, landed in place
  kQuantize,  // e4m3 rows + the fp32 scales of their 128 x 128 blocks, quantized by the sender
  kStage,     // raw trainer values into the receiver's staging (RankPlan::staged), which quantizes
  kAmax,      // e4m3 rows quantized with their block's scale agreed among the trainer ranks holding
              // it (RankPlan::amax_bands)
};
std::string_view EncodingName(Encoding e);  // "copy" | "quantize" | "stage" | "amax"

// How host-path buckets travel each sync (delta.h, docs/delta.md): kFull sends every bucket whole
// (the default); kDelta sends, per bucket, only the wire elements that changed since the image
// the sender last sent when the receiver holds that image (its base), else the whole bucket;
// kAuto as kDelta where the cost model (EstimateDeltaCost) says the delta pays at the link speed
// (SHARDSYNC_DELTA_LINK_MBPS). Every rank must agree: in the plan hash when not kFull.
enum class WireEncoding : uint8_t { kFull, kDelta, kAuto };
std::string_view WireEncodingName(WireEncoding e);  // "full" | "delta" | "auto"
// "full" | "delta" | "auto"; InvalidArgument naming `flag` otherwise.
Result<WireEncoding> ParseWireEncoding(std::string_view s, std::string_view flag = "--encoding");

struct PlanOptions {
  DType wire_dtype = DType::kBF16;
  int64_t bucket_bytes = int64_t{512} << 20;
  // Quantized models only: the encoding of a quantization block whose rows straddle trainer
  // ranks. kAmax: its holders exchange partial amaxes through the store and each quantizes its
  // own rows with the block's scale; kStage: each holder sends its rows raw and the receiver
  // quantizes the band from staging (block FP8's --fp8-split, fp8_plan.h). In the plan hash when
  // kAmax (kStage plans keep their hashes).
  Encoding straddle = Encoding::kAmax;
  // In the plan hash when not kFull (existing plans keep their hashes).
  WireEncoding encoding = WireEncoding::kFull;
};

// Bumped whenever the planner's output for the same inputs changes; part of PlanHash.
inline constexpr std::string_view kPlannerVersion = "shardsync-plan/1";

struct PlanInputs {
  ModelSpec model;
  TrainerSpec trainer;
  RolloutSpec rollout;
  PlanOptions options;
  DType trainer_dtype = DType::kF32;  // dtype senders hold (cast to wire_dtype while packing)
};

// Sync world: trainer ranks [0, S), then engine rank (replica d, tp, pp) at S + d*T*P + pp*T + tp.
struct SyncRank {
  bool is_trainer = false;
  int trainer_rank = -1;
  int replica = -1;
  int tp_rank = -1;
  int pp_rank = -1;
};
int SyncWorldSize(const PlanInputs& in);
Result<SyncRank> DescribeSyncRank(const PlanInputs& in, int sync_rank);

// One contiguous destination run filled from one source region.
struct TransferOp {
  int32_t tensor = 0;  // index into HfTensorInventory(model)
  int32_t param = 0;   // index into the destination rank's EngineRankShards::params
  Region src;          // region of the HF tensor (source coordinates)
  // Region of the engine parameter (same element count); kStage: rows x cols inside the band.
  Region dst;
  int64_t wire_offset = 0;  // byte offset inside the message's wire image (a multiple of 8 for
                            // every op of a block-FP8 plan)
  // Wire bytes. kCopy: src.numel() * DTypeSize(wire_dtype) (block-FP8 plans: rounded up to 8);
  // the others: fp8_plan.h.
  int64_t bytes = 0;
  Encoding encoding = Encoding::kCopy;
  // kQuantize, and kAmax ops that send their band's scales: the weight_scale_inv parameter of
  // `param`, and its blocks of `dst`; -1 otherwise.
  int32_t scale_param = -1;
  Region scale_dst;
  // kStage: the band (index into the receiver's RankPlan::staged) and its staging offset there:
  // a stage op spans whole rows of its band, so its bytes sit at staging_offset + dst row * row
  // bytes (what a sender writing straight into the receiver's staging needs).
  int32_t stage = -1;
  int64_t staging_offset = 0;
};

// Where a Megatron sender holds an op's bytes: local parameter `param` (index into the sender's
// BuildTrainerParams(...).params) at `region` (same extents as the op's src). FSDP-like senders
// hold `tensor`'s dim-0 shard (TrainerHeldRegion) and need none.
struct LocalSource {
  int32_t param = 0;
  Region region;
};

// A slice of a message's ops sent and verified as a unit (one checksum), under the bucket cap.
struct Bucket {
  int32_t op_begin = 0;
  int32_t op_end = 0;
  int64_t wire_offset = 0;
  int64_t bytes = 0;
};

// Everything one sender sends one receiver, in a deterministic order.
struct Message {
  int32_t src = 0;  // sync rank (trainer)
  int32_t dst = 0;  // sync rank (engine)
  int64_t bytes = 0;
  std::vector<TransferOp> ops;
  std::vector<Bucket> buckets;
  // Megatron trainers: local[i] says where the sender holds ops[i]. Empty for FSDP-like layouts,
  // so their plans stay as they were (a parallel array costs them nothing).
  std::vector<LocalSource> local;
};

// The quantization tables of a block-FP8 plan (fp8_plan.h, docs/fp8.md).
//
// A band of rows (<= 128) x whole blocks of one engine piece whose rows straddle trainer ranks
// (kStage): the receiver quantizes it from staged raw values once all its stage ops landed.
struct StagedBand {
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
struct AmaxHolder {
  int32_t rank = 0;  // sync rank (trainer) of another holder, in this rank's group
  int64_t slot = 0;  // index of the band's first block in that holder's value
};
struct AmaxBand {
  int32_t tensor = 0;
  int64_t row0 = 0, rows = 0;      // the band: HF rows [row0, row0 + rows), on the 128 grid
  int64_t own0 = 0, own_rows = 0;  // the rows this rank holds
  int64_t blocks = 0;              // ceil(columns / 128): partials per holder
  int64_t slot = 0;                // index of the band's first block in this rank's value
  std::vector<AmaxHolder> others;
};

// One rank's part of the plan: what it sends and what it receives. Computed directly from the
// layouts, without enumerating the job's other ops.
struct RankPlan {
  int rank = 0;
  std::string plan_hash;
  std::vector<Message> sends;  // ordered by dst
  std::vector<Message> recvs;  // ordered by src
  // Block-FP8 plans' quantization tables (empty otherwise). Engines: the bands this rank
  // quantizes itself and its staging size. Trainers of kAmax plans: every straddling band this
  // rank holds rows of (sorted by tensor, row), whether or not it sends them (replica groups
  // share the work, every holder posts), the length of its value (partials, 4 bytes each) and
  // the ranks whose values it reads.
  std::vector<StagedBand> staged;
  int64_t staging_bytes = 0;
  std::vector<AmaxBand> amax_bands;
  int64_t amax_blocks = 0;
  std::vector<int32_t> amax_peers;
};

// Hash of everything that defines the plan (model, layouts, engine, options, planner version):
// 32 hex chars. Ranks compare it before any byte moves.
std::string PlanHash(const PlanInputs& in);

// The plan of one sync rank; a block-FP8 plan for a model with a QuantConfig (fp8_plan.h).
Result<RankPlan> PlanForRank(const PlanInputs& in, int sync_rank);

struct EngineRankSummary {
  int replica = 0, tp_rank = 0, pp_rank = 0;
  int64_t recv_bytes = 0;   // wire bytes received
  int64_t owned_bytes = 0;  // bytes of its parameters minus zero-fills, in wire dtype
};
struct TrainerRankSummary {
  int rank = 0;
  int64_t send_bytes = 0;
};
struct PlanSummary {
  std::string plan_hash;
  int64_t ops = 0;
  int64_t messages = 0;
  int64_t total_bytes = 0;
  std::vector<EngineRankSummary> engine_ranks;
  std::vector<TrainerRankSummary> trainer_ranks;
  int64_t broadcast_recv_bytes_per_rank = 0;  // every full HF tensor, as broadcast-all sends
  double plan_seconds = 0;
  // Block-FP8 plans (fp8_plan.h; zero otherwise). Wire bytes by encoding (kQuantize: e4m3 +
  // scales + padding; kStage: raw trainer values), elements quantized by trainer ranks on the fly
  // and by engine ranks from staging, the staged bands and the largest staging buffer of an
  // engine rank.
  int64_t copy_bytes = 0, quantize_bytes = 0, stage_bytes = 0;
  int64_t sender_quantized_elements = 0, receiver_quantized_elements = 0;
  int64_t staged_bands = 0, max_staging_bytes = 0;
  // kAmax: ops' bytes (e4m3 + the scale senders' scales), elements, the straddling bands
  // (distinct HF block rows) and their blocks, and the store bytes of the exchange per sync:
  // every holder's value (4 bytes per block it holds rows of) written once and read by each
  // other holder of its bands.
  int64_t amax_bytes = 0, amax_elements = 0;
  int64_t amax_bands = 0, amax_blocks = 0;
  int64_t exchange_write_bytes = 0, exchange_read_bytes = 0;
  // Memory-bound figure of the same work: every trainer element the plan reads, read once in
  // the trainer dtype, plus every engine byte (e4m3, scales, unquantized params) written once.
  int64_t bound_read_bytes = 0, bound_write_bytes = 0;
};
// Job-wide statistics: computed analytically per tensor (never enumerating the job's ops); a
// block-FP8 plan's by enumerating every engine rank's plan (the job's traffic is the union of
// their receives), engine_ranks' owned_bytes in the engine's dtypes.
Result<PlanSummary> SummarizePlan(const PlanInputs& in);

// ---- Placement and cost model ----
//
// GPUs are numbered node by node (GPU i on node i / gpus_per_node). Trainer rank i runs on GPU i.
// When the trainer and rollout worlds have the same size the job is colocated: engine sync rank
// S + j (j = d*T*P + pp*T + tp, the rollout worker index) runs on GPU j, as colocated RL does.
// Otherwise they are placed separately: engine rank j on GPU S + j.
struct Placement {
  int nodes = 0;  // 0: as many as needed
  int gpus_per_node = 8;
  double intra_node_gbps = 450;  // GB/s per direction per GPU (H200 NVLink)
  double inter_node_gbps = 50;   // GB/s per direction per GPU (400 Gb/s NIC)
};
struct ResolvedPlacement {
  int nodes = 0;
  int gpus_per_node = 0;
  bool colocated = false;
  int TrainerNode(int rank) const;
  int EngineNode(int engine_index, int trainer_world) const;  // engine_index = sync rank - S
};
// Errors name --nodes / --gpus-per-node when the job does not fit.
Result<ResolvedPlacement> ResolvePlacement(const PlanInputs& in, const Placement& p);

struct CostEstimate {
  double seconds = 0;              // max over ranks and links of bytes / bandwidth
  double broadcast_seconds = 0;    // broadcast-all baseline
  double lower_bound_seconds = 0;  // max((B/(T*P))/bw, D*B/(S*bw)) at the fastest link
  int64_t model_bytes = 0;         // B: every HF tensor once, in the wire dtype
};

// Per-rank detail beside the required fields.
struct RankTraffic {
  int64_t ops = 0;
  int64_t messages = 0;
  int64_t intra_node_bytes = 0;  // to / from ranks on the same node (same GPU included)
};

struct SummaryOptions {
  Placement placement;
  int heatmap_max_blocks = 64;  // trainer x engine byte matrix aggregated to at most this many
};

// Trainer-rank x engine-rank bytes, aggregated into blocks of consecutive ranks.
struct Heatmap {
  int trainer_ranks = 0, engine_ranks = 0;
  int trainer_block = 1, engine_block = 1;  // ranks per block
  int rows = 0, cols = 0;
  std::vector<int64_t> bytes;  // rows x cols, row-major
};

struct DetailedSummary {
  PlanSummary summary;
  std::vector<RankTraffic> trainer_traffic;  // by trainer rank
  std::vector<RankTraffic> engine_traffic;   // by engine index (sync rank - S)
  ResolvedPlacement placement;
  CostEstimate cost;
  Heatmap heatmap;
  // Bytes per (trainer node, engine node), row-major nodes x nodes; empty above kMaxNodePairNodes
  // nodes.
  std::vector<int64_t> node_pair_bytes;
  static constexpr int kMaxNodePairNodes = 512;
};
Result<DetailedSummary> SummarizePlanDetailed(const PlanInputs& in, const SummaryOptions& opts);

// Plain SVG heatmap of the byte matrix (axis labels, legend). No dependency.
std::string HeatmapSvg(const DetailedSummary& s, std::string_view title);
// "model: trainer -> dp=..,tp=..,pp=.. (engine)", the heatmap title `plan --svg` uses.
std::string PlanHeatmapTitle(const PlanInputs& in);

// The plan's report as JSON (schema in docs/cli.md, `shardsync plan --json`): sizes, per-rank
// traffic and nodes, node pairs, placement and the cost model's estimates under `placement`.
std::string PlanReportJson(const PlanInputs& in, const DetailedSummary& ds,
                           const Placement& placement);

// Every check planning makes of the inputs (layouts, dtypes, bucket cap, the engine's
// divisibility rules, PP layer ranges) without planning: microseconds, for constructors that
// must fail early. Errors name the field as PlanForRank / SummarizePlan do.
Status ValidatePlanInputs(const PlanInputs& in);

// Validates a whole (small) job: every engine byte covered exactly once by ops or zero-fills,
// every source region inside its tensor and held by the sending trainer rank, both sides of
// every message identical, wire offsets and buckets consistent, the summary in agreement.
// Block-FP8 plans: every engine byte and every scale covered exactly once (by a copy, a
// quantize or amax op, a staged band or a zero-fill), each from the HF bytes the shard map says,
// every staged band's rows landed exactly once. Enumerates every rank's plan: for tests and
// small jobs only.
Status ValidatePlan(const PlanInputs& in);

}  // namespace shardsync
