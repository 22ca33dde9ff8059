// Fingerprints of 20 real plans (bf16 and block FP8, FSDP-like and Megatron trainers, SGLang and
// vLLM, dense and MoE): each plan's PlanHash, a digest of every rank's plan (every op, bucket,
// local source and quantization table, as canonical text) and a digest of its summary. The table
// is checked in (plan_fingerprints.txt): a change of the planner's output for the same inputs
// shows here, and must come with a planner version bump (plan.h kPlannerVersion,
// fp8_plan.h kFp8PlannerVersion) and a new table. On a mismatch the test prints the new table.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <xxhash.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "shardsync/fp8_plan.h"
#include "shardsync/plan.h"

#ifndef SHARDSYNC_PLAN_FINGERPRINTS
#error "SHARDSYNC_PLAN_FINGERPRINTS: the path of the checked-in table"
#endif

namespace shardsync {
namespace {

struct Case {
  const char* model;
  const char* trainer;
  const char* rollout;
  EngineKind engine;
  bool fp8;
  Fp8Split split = Fp8Split::kAmax;
  DType trainer_dtype = DType::kF32;
  int64_t bucket = int64_t{512} << 20;
};

const Case kCases[] = {
    // bf16
    {"qwen3-8b", "fsdp=1", "dp=1,tp=2,pp=2", EngineKind::kSglang, false},
    {"qwen3-8b", "fsdp=4", "dp=2,tp=2,pp=1", EngineKind::kVllm, false},
    {"qwen3-8b", "megatron=tp=2,pp=2", "dp=1,tp=2,pp=2", EngineKind::kSglang, false},
    {"qwen3-8b", "megatron=tp=4", "dp=1,tp=2,pp=1", EngineKind::kVllm, false, Fp8Split::kAmax,
     DType::kBF16},
    {"qwen3-30b-a3b", "fsdp=4", "dp=1,tp=2,pp=1,ep=2", EngineKind::kVllm, false},
    {"qwen3-30b-a3b", "megatron=tp=2,ep=2,etp=1", "dp=1,tp=4,pp=1", EngineKind::kSglang, false},
    {"llama-3.1-8b", "hsdp=2x2", "dp=3,tp=2,pp=1", EngineKind::kSglang, false},
    {"qwen3-0.6b", "single", "dp=2,tp=1,pp=2", EngineKind::kVllm, false, Fp8Split::kAmax,
     DType::kBF16, int64_t{1} << 20},
    {"qwen2.5-7b", "fsdp=8", "dp=1,tp=4,pp=1", EngineKind::kSglang, false},
    {"qwen3-30b-a3b", "hsdp=2x4", "dp=2,tp=2,pp=1,ep=2", EngineKind::kSglang, false},
    // block FP8
    {"qwen3-8b", "fsdp=1", "dp=1,tp=2,pp=2", EngineKind::kSglang, true},
    {"qwen3-8b", "megatron=tp=2,pp=2", "dp=1,tp=2,pp=2", EngineKind::kSglang, true},
    {"qwen3-8b", "fsdp=4", "dp=1,tp=2,pp=2", EngineKind::kVllm, true},
    {"qwen3-8b", "fsdp=3", "dp=1,tp=1,pp=1", EngineKind::kSglang, true, Fp8Split::kAmax,
     DType::kBF16, int64_t{1} << 20},
    {"qwen3-8b", "replicate=2", "dp=2,tp=2,pp=1", EngineKind::kVllm, true, Fp8Split::kStage},
    {"qwen3-0.6b", "hsdp=2x2", "dp=2,tp=2,pp=1", EngineKind::kVllm, true, Fp8Split::kAmax,
     DType::kBF16},
    {"qwen3-30b-a3b", "fsdp=4", "dp=1,tp=2,pp=1,ep=2", EngineKind::kVllm, true},
    {"qwen3-30b-a3b", "fsdp=4", "dp=1,tp=2,pp=1,ep=2", EngineKind::kVllm, true, Fp8Split::kStage},
    {"qwen3-30b-a3b", "megatron=tp=2,ep=2,etp=1", "dp=1,tp=2,pp=1,ep=2", EngineKind::kSglang, true},
    {"qwen3-30b-a3b", "hsdp=2x4", "dp=2,tp=2,pp=1,ep=2", EngineKind::kSglang, true},
};

Result<PlanInputs> InputsOf(const Case& c) {
  PlanInputs in;
  SS_ASSIGN_OR_RETURN(in.model, LoadModelSpec(c.model));
  if (c.fp8) {
    SS_ASSIGN_OR_RETURN(in.model.quant, ParseQuantFlag("fp8-block128"));
  }
  SS_ASSIGN_OR_RETURN(in.trainer, ParseTrainerSpec(c.trainer));
  SS_ASSIGN_OR_RETURN(in.rollout, ParseRolloutSpec(c.rollout, c.engine));
  in.options.straddle = c.split;
  in.options.bucket_bytes = c.bucket;
  in.trainer_dtype = c.trainer_dtype;
  return in;
}

std::string Digest(const std::string& s) {
  const XXH128_hash_t h = XXH3_128bits(s.data(), s.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

// One op as canonical text: the same line for an op of any plan (a bf16 op is a copy with no
// scale, stage or staging).
struct OpText {
  std::string_view kind = "copy";
  int32_t tensor = 0, param = 0, scale_param = -1, stage = -1;
  Region src, dst, scale_dst;
  int64_t wire_offset = 0, bytes = 0, staging_offset = 0;
  std::string Line() const {
    return fmt::format("op {} t{} p{} s{} g{} {} {} {} @{} +{} so{}\n", kind, tensor, param,
                       scale_param, stage, src.ToString(), dst.ToString(), scale_dst.ToString(),
                       wire_offset, bytes, staging_offset);
  }
};

OpText TextOf(const TransferOp& op) {
  OpText t;
  t.kind = EncodingName(op.encoding);
  t.tensor = op.tensor;
  t.param = op.param;
  t.scale_param = op.scale_param;
  t.stage = op.stage;
  t.src = op.src;
  t.dst = op.dst;
  t.scale_dst = op.scale_dst;
  t.wire_offset = op.wire_offset;
  t.bytes = op.bytes;
  t.staging_offset = op.staging_offset;
  return t;
}

void AppendMessage(std::string_view dir, const Message& m, std::string* s) {
  *s += fmt::format("{} {}->{} {}B\n", dir, m.src, m.dst, m.bytes);
  for (const auto& op : m.ops) *s += TextOf(op).Line();
  for (const Bucket& b : m.buckets) {
    *s += fmt::format("bucket {}..{} @{} +{}\n", b.op_begin, b.op_end, b.wire_offset, b.bytes);
  }
  for (const LocalSource& l : m.local)
    *s += fmt::format("local p{} {}\n", l.param, l.region.ToString());
}

void AppendMessages(const RankPlan& p, std::string* s) {
  *s += fmt::format("rank {} {}\n", p.rank, p.plan_hash);
  for (const auto& m : p.sends) AppendMessage("send", m, s);
  for (const auto& m : p.recvs) AppendMessage("recv", m, s);
}

void AppendQuantTables(const RankPlan& p, std::string* s) {
  for (const StagedBand& b : p.staged) {
    *s += fmt::format("band t{} p{} s{} {} {} {} {} so{} +{}\n", b.tensor, b.param, b.scale_param,
                      b.src.ToString(), b.dst.ToString(), b.scale_dst.ToString(),
                      DTypeName(b.dtype), b.staging_offset, b.bytes);
  }
  *s += fmt::format("staging {}\n", p.staging_bytes);
  for (const AmaxBand& b : p.amax_bands) {
    *s += fmt::format("amax t{} r{}+{} own{}+{} b{} slot{}", b.tensor, b.row0, b.rows, b.own0,
                      b.own_rows, b.blocks, b.slot);
    for (const AmaxHolder& h : b.others) *s += fmt::format(" {}@{}", h.rank, h.slot);
    *s += "\n";
  }
  *s += fmt::format("amax_blocks {} peers", p.amax_blocks);
  for (int32_t r : p.amax_peers) *s += fmt::format(" {}", r);
  *s += "\n";
}

std::string PlansText(const PlanInputs& in) {
  std::string s;
  const int world = SyncWorldSize(in);
  for (int r = 0; r < world; ++r) {
    auto p = PlanForRank(in, r);
    if (!p.ok()) return "error " + p.status().ToString();
    AppendMessages(*p, &s);
    // The quantization tables, for block-FP8 plans only.
    if (in.model.quant) AppendQuantTables(*p, &s);
  }
  return s;
}

void AppendRanks(const std::vector<EngineRankSummary>& er,
                 const std::vector<TrainerRankSummary>& tr, std::string* s) {
  for (const auto& e : er) {
    *s += fmt::format("e {} {} {} {} {}\n", e.replica, e.tp_rank, e.pp_rank, e.recv_bytes,
                      e.owned_bytes);
  }
  for (const auto& t : tr) *s += fmt::format("t {} {}\n", t.rank, t.send_bytes);
}

// A block-FP8 summary's line has the codec's figures (as the table was first written); a bf16
// one the broadcast-all figure.
std::string SummaryText(const PlanInputs& in) {
  auto x = SummarizePlan(in);
  if (!x.ok()) return "error " + x.status().ToString();
  std::string s;
  if (in.model.quant) {
    s += fmt::format(
        "{} ops{} msgs{} total{} copy{} quant{} stage{} sq{} rq{} bands{} staging{} amax{} ae{} "
        "ab{} abl{} xw{} xr{} br{} bw{}\n",
        x->plan_hash, x->ops, x->messages, x->total_bytes, x->copy_bytes, x->quantize_bytes,
        x->stage_bytes, x->sender_quantized_elements, x->receiver_quantized_elements,
        x->staged_bands, x->max_staging_bytes, x->amax_bytes, x->amax_elements, x->amax_bands,
        x->amax_blocks, x->exchange_write_bytes, x->exchange_read_bytes, x->bound_read_bytes,
        x->bound_write_bytes);
  } else {
    s += fmt::format("{} ops{} msgs{} total{} bcast{}\n", x->plan_hash, x->ops, x->messages,
                     x->total_bytes, x->broadcast_recv_bytes_per_rank);
  }
  AppendRanks(x->engine_ranks, x->trainer_ranks, &s);
  return s;
}

std::string CaseName(const Case& c) {
  std::string n = fmt::format("{} {} -> {} {}", c.model, c.trainer, c.rollout,
                              c.engine == EngineKind::kSglang ? "sglang" : "vllm");
  n += c.fp8 ? fmt::format(" fp8/{}", Fp8SplitName(c.split)) : " bf16";
  if (c.trainer_dtype != DType::kF32) n += fmt::format(" trainer {}", DTypeName(c.trainer_dtype));
  if (c.bucket != (int64_t{512} << 20)) n += fmt::format(" bucket {}", c.bucket);
  return n;
}

TEST(PlanFingerprints, MatchTheCheckedInTable) {
  std::string table;
  for (const Case& c : kCases) {
    auto inputs = InputsOf(c);
    ASSERT_TRUE(inputs.ok()) << CaseName(c) << ": " << inputs.status().ToString();
    const PlanInputs& in = *inputs;
    const std::string plans = PlansText(in);
    ASSERT_EQ(plans.rfind("error", 0), std::string::npos) << CaseName(c) << ": " << plans;
    table += fmt::format("| {} | {} | {} | {} |\n", CaseName(c), PlanHash(in), Digest(plans),
                         Digest(SummaryText(in)));
  }
  std::ifstream f(SHARDSYNC_PLAN_FINGERPRINTS);
  ASSERT_TRUE(f.good()) << SHARDSYNC_PLAN_FINGERPRINTS;
  std::stringstream want;
  want << f.rdbuf();
  // The diff shows the computed rows (plan | PlanHash | every rank's plan | summary).
  EXPECT_EQ(want.str(), table);
}

}  // namespace
}  // namespace shardsync
