// Planner tests: layouts, parsing, exact cover (brute force), balance, determinism, errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "plan/plan_hash.h"
#include "plan/planner.h"
#include "shardsync/plan.h"

namespace shardsync {
namespace {

using plan_internal::PlanContext;

// A tiny Qwen3-MoE: small enough for the per-element oracle, with padded vocab (zero-fills),
// dense and MoE layers, qk-norm.
ModelSpec TinyMoe(bool tied) {
  ModelSpec m;
  m.name = "tiny-moe";
  m.arch = Architecture::kQwen3Moe;
  m.hidden_size = 32;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.head_dim = 8;
  m.num_hidden_layers = 4;
  m.intermediate_size = 48;
  m.vocab_size = 100;  // padded to 128
  m.tie_word_embeddings = tied;
  m.qk_norm = true;
  m.num_experts = 4;
  m.moe_intermediate_size = 16;
  m.num_experts_per_tok = 2;
  m.mlp_only_layers = {0};
  return m;
}

ModelSpec TinyDense() {
  ModelSpec m;
  m.name = "tiny-dense";
  m.arch = Architecture::kQwen2;
  m.hidden_size = 48;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.head_dim = 12;
  m.num_hidden_layers = 3;
  m.intermediate_size = 64;
  m.vocab_size = 130;
  m.qkv_bias = true;
  return m;
}

PlanInputs Inputs(const ModelSpec& m, std::string_view trainer, std::string_view rollout,
                  EngineKind engine = EngineKind::kSglang) {
  PlanInputs in;
  in.model = m;
  in.trainer = *ParseTrainerSpec(trainer);
  in.rollout = *ParseRolloutSpec(rollout, engine);
  return in;
}

TEST(TrainerSpec, ParsesAndPrints) {
  for (std::string_view s : {"fsdp=8", "hsdp=2x4", "replicate=4", "single"}) {
    auto t = ParseTrainerSpec(s);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(t->ToString(), s);
  }
  EXPECT_EQ(ParseTrainerSpec("hsdp=2x4")->world(), 8);
  EXPECT_EQ(ParseTrainerSpec("replicate=3")->world(), 3);
  EXPECT_EQ(ParseTrainerSpec("single")->world(), 1);
}

TEST(TrainerSpec, ErrorsNameTheField) {
  struct Case {
    const char* in;
    const char* field;
  } cases[] = {{"fsdp=0", "--trainer fsdp"},
               {"fsdp=x", "--trainer fsdp"},
               {"hsdp=4", "--trainer hsdp"},
               {"hsdp=0x4", "--trainer hsdp R"},
               {"hsdp=2x-1", "--trainer hsdp S"},
               {"megatron=2", "--trainer"},
               {"fsdp", "--trainer"},
               {"replicate=99999999", "--trainer replicate"}};
  for (const auto& c : cases) {
    auto t = ParseTrainerSpec(c.in);
    ASSERT_FALSE(t.ok()) << c.in;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.field), std::string::npos) << t.status().message();
  }
}

TEST(RolloutSpec, ParsesAndRejects) {
  auto r = ParseRolloutSpec("pp=2,dp=3,tp=4,ep=2", EngineKind::kVllm);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->dp, 3);
  EXPECT_EQ(r->shard.tp, 4);
  EXPECT_EQ(r->shard.pp, 2);
  EXPECT_EQ(r->shard.ep, 2);
  EXPECT_EQ(r->shard.engine, EngineKind::kVllm);
  EXPECT_EQ(r->world(), 24);
  struct Case {
    const char* in;
    const char* field;
  } cases[] = {{"dp=2,tp=0", "--rollout tp"}, {"dp=2,xp=1", "xp"},        {"dp=2,dp=3", "dp"},
               {"tp=4,ep=3", "--rollout ep"}, {"dp=two", "--rollout dp"}, {"", "--rollout"},
               {"dp=1,tp", "--rollout"}};
  for (const auto& c : cases) {
    auto x = ParseRolloutSpec(c.in, EngineKind::kSglang);
    ASSERT_FALSE(x.ok()) << c.in;
    EXPECT_NE(x.status().message().find(c.field), std::string::npos) << x.status().message();
  }
}

TEST(TrainerHeldRegion, TorchChunkSizes) {
  TrainerSpec t = *ParseTrainerSpec("fsdp=4");
  // n = 10: ceil(10/4) = 3 -> 3,3,3,1.
  const int64_t want[4][2] = {{0, 3}, {3, 3}, {6, 3}, {9, 1}};
  for (int r = 0; r < 4; ++r) {
    Region h = TrainerHeldRegion(t, r, {10, 5});
    EXPECT_EQ(h.offset[0], want[r][0]);
    EXPECT_EQ(h.extent[0], want[r][1]);
    EXPECT_EQ(h.extent[1], 5);
  }
  // n = 5: ceil(5/4) = 2 -> 2,2,1,0 (trailing rank empty).
  EXPECT_EQ(TrainerHeldRegion(t, 2, {5}).extent[0], 1);
  EXPECT_TRUE(TrainerHeldRegion(t, 3, {5}).empty());
  // hsdp: rank g*S + s holds chunk s.
  TrainerSpec h = *ParseTrainerSpec("hsdp=2x4");
  EXPECT_EQ(TrainerHeldRegion(h, 5, {10}), TrainerHeldRegion(t, 1, {10}));
  EXPECT_EQ(TrainerHeldRegion(*ParseTrainerSpec("replicate=3"), 2, {7, 3}), Region::Full({7, 3}));
  EXPECT_EQ(TrainerHeldRegion(*ParseTrainerSpec("single"), 0, {7, 3}), Region::Full({7, 3}));
}

TEST(SyncRank, LayoutOrder) {
  PlanInputs in = Inputs(TinyDense(), "fsdp=3", "dp=2,tp=2,pp=2");
  EXPECT_EQ(SyncWorldSize(in), 3 + 8);
  auto r = DescribeSyncRank(in, 3 + 1 * 4 + 1 * 2 + 0);  // replica 1, pp 1, tp 0
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->is_trainer);
  EXPECT_EQ(r->replica, 1);
  EXPECT_EQ(r->pp_rank, 1);
  EXPECT_EQ(r->tp_rank, 0);
  EXPECT_TRUE(DescribeSyncRank(in, 2)->is_trainer);
  EXPECT_EQ(DescribeSyncRank(in, 11).status().code(), StatusCode::kOutOfRange);
}

// Hand-built shard map: a piece whose dst is not contiguous must be split into runs, adjacent
// pieces must be coalesced, a 2-d source may land in a 3-d stack.
TEST(Planner, HandBuiltMapRunsAndCoalescing) {
  std::vector<HfTensor> inv = {{"a", {6, 4}, DType::kBF16}, {"b", {2, 3}, DType::kBF16}};
  ShardMap map;
  map.spec.tp = 1;
  map.spec.pp = 1;
  EngineRankShards rk;
  // p0 [6, 8]: columns 0..3 <- a (all rows): dst not contiguous (6 runs of 4 unless whole rows).
  EngineParam p0{"p0", {6, 8}, DType::kBF16, {}, {}};
  p0.pieces.push_back({"a", Region::Make({0, 0}, {3, 4}), Region::Make({0, 0}, {3, 4})});
  p0.pieces.push_back({"a", Region::Make({3, 0}, {3, 4}), Region::Make({3, 0}, {3, 4})});
  p0.zero_fills.push_back({Region::Make({0, 4}, {6, 4})});
  // p1 [2, 2, 3]: stack of b into slot 1; slot 0 zero-filled.
  EngineParam p1{"p1", {2, 2, 3}, DType::kBF16, {}, {}};
  p1.pieces.push_back({"b", Region::Make({0, 0}, {2, 3}), Region::Make({1, 0, 0}, {1, 2, 3})});
  p1.zero_fills.push_back({Region::Make({0, 0, 0}, {1, 2, 3})});
  rk.params = {p0, p1};
  map.ranks = {rk};
  PlanInputs in;
  in.trainer = *ParseTrainerSpec("fsdp=2");
  in.rollout = *ParseRolloutSpec("dp=1,tp=1,pp=1", EngineKind::kSglang);
  auto ctx = PlanContext::Build(in, map, inv);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  // The two pieces of p0 coalesce into one.
  EXPECT_EQ(ctx->pieces().size(), 2u);
  ASSERT_TRUE(plan_internal::ValidateContext(*ctx).ok())
      << plan_internal::ValidateContext(*ctx).ToString();
  auto rp = ctx->PlanForRank(2);
  ASSERT_TRUE(rp.ok());
  ASSERT_EQ(rp->recvs.size(), 2u);
  // From trainer 0 (rows 0..2 of a, row 0 of b): 3 runs of p0 + 1 op for b.
  EXPECT_EQ(rp->recvs[0].ops.size(), 4u);
  for (const auto& m : rp->recvs) {
    for (const auto& op : m.ops) {
      const Shape& sh = op.param == 0 ? p0.shape : p1.shape;
      EXPECT_TRUE(RegionIsContiguous(op.dst, sh)) << op.dst.ToString();
    }
  }
  // A non-box piece is rejected with the rank and parameter named.
  map.ranks[0].params[1].pieces[0].dst = Region::Make({1, 0, 0}, {1, 3, 2});
  auto bad = PlanContext::Build(in, map, inv);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("p1"), std::string::npos) << bad.status().message();
}

TEST(Planner, BucketSplitsLargeOps) {
  Region box = Region::Make({0, 0, 0}, {1, 100, 64});  // 6400 elements, bf16 12800 bytes
  EXPECT_EQ(plan_internal::SplitCount(box, 2, 1 << 20), 1);
  EXPECT_EQ(plan_internal::SplitCount(box, 2, 4096), 4);  // 32 rows per part
  int n = 0;
  int64_t total = 0;
  plan_internal::SplitBox(box, 2, 4096, [&](const Region& r) {
    ++n;
    total += r.numel();
    EXPECT_LE(r.numel() * 2, 4096);
    EXPECT_TRUE(RegionIsContiguous(r, {1, 100, 64}));
  });
  EXPECT_EQ(n, 4);
  EXPECT_EQ(total, 6400);
  // One row over the cap: split along the next dim.
  Region wide = Region::Make({0, 0}, {3, 5000});
  EXPECT_EQ(plan_internal::SplitCount(wide, 2, 4096), 3 * 3);
}

// Exact cover, per element, for random configurations of every layout.
TEST(Planner, RandomConfigsExactCover) {
  std::mt19937 rng(12345);
  const std::vector<std::string> trainers = {"fsdp=1",   "fsdp=3",   "fsdp=8",      "fsdp=13",
                                             "hsdp=2x3", "hsdp=3x2", "hsdp=4x5",    "replicate=3",
                                             "single",   "hsdp=1x4", "replicate=2", "replicate=1"};
  int validated = 0;
  for (int iter = 0; iter < 80; ++iter) {
    const bool moe = rng() % 2;
    ModelSpec m = moe ? TinyMoe(rng() % 2) : TinyDense();
    PlanInputs in;
    in.model = m;
    in.trainer = *ParseTrainerSpec(trainers[rng() % trainers.size()]);
    const EngineKind eng = rng() % 2 ? EngineKind::kSglang : EngineKind::kVllm;
    const int tp = 1 << (rng() % 3), pp = 1 + rng() % 3, dp = 1 + rng() % 3;
    int ep = 1;
    if (moe && rng() % 2) ep = eng == EngineKind::kVllm ? tp : 1 << (rng() % 3);
    if (ep > tp) ep = tp;
    in.rollout = *ParseRolloutSpec(fmt::format("dp={},tp={},pp={},ep={}", dp, tp, pp, ep), eng);
    in.options.wire_dtype = rng() % 3 == 0 ? DType::kF32 : DType::kBF16;
    in.options.bucket_bytes = rng() % 2 ? 4096 : int64_t{512} << 20;
    auto ctx = plan_internal::MakeContext(in);
    if (!ctx.ok()) {
      // Only the engine's divisibility rules may refuse a config here.
      EXPECT_EQ(ctx.status().code(), StatusCode::kInvalidArgument) << ctx.status().ToString();
      continue;
    }
    Status s = plan_internal::ValidateContext(*ctx);
    ASSERT_TRUE(s.ok()) << in.trainer.ToString() << " dp=" << dp << " tp=" << tp << " pp=" << pp
                        << " ep=" << ep << ": " << s.ToString();
    ++validated;
  }
  EXPECT_GE(validated, 30);
  RecordProperty("validated", validated);
}

TEST(Planner, RecvEqualsOwnedInEveryLayout) {
  for (const char* t : {"fsdp=4", "hsdp=2x2", "replicate=4", "single"}) {
    auto s = SummarizePlan(Inputs(TinyMoe(false), t, "dp=2,tp=2,pp=2"));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    for (const auto& e : s->engine_ranks) {
      EXPECT_EQ(e.recv_bytes, e.owned_bytes) << t;
      EXPECT_GT(e.owned_bytes, 0);
    }
  }
}

TEST(Planner, SingleIsTheFunnel) {
  PlanInputs in = Inputs(TinyDense(), "single", "dp=2,tp=2,pp=1");
  auto s = SummarizePlan(in);
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(s->trainer_ranks.size(), 1u);
  EXPECT_EQ(s->trainer_ranks[0].send_bytes, s->total_bytes);
  int64_t owned = 0;
  for (const auto& e : s->engine_ranks) owned += e.owned_bytes;
  EXPECT_EQ(s->total_bytes, owned);
  EXPECT_EQ(s->messages, 4);  // rank 0 -> each engine rank, once
  EXPECT_TRUE(ValidatePlan(in).ok());
}

// Max bytes per trainer rank within 1% of the optimum: for replicate, total / S; for hsdp, the
// demand on each dim-0 chunk spread over its R holders.
void ExpectBalanced(const PlanInputs& in) {
  auto s = SummarizePlan(in);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const int R = in.trainer.groups(), S = in.trainer.shards_per_group();
  std::vector<int64_t> demand(S, 0);
  int64_t mx = 0;
  for (const auto& t : s->trainer_ranks) {
    demand[t.rank % S] += t.send_bytes;
    mx = std::max(mx, t.send_bytes);
  }
  double opt = 0;
  for (int64_t d : demand) opt = std::max(opt, static_cast<double>(d) / R);
  EXPECT_LE(mx, opt * 1.01) << in.trainer.ToString() << " -> dp " << in.rollout.dp;
  EXPECT_GT(opt, 0);
}

TEST(Planner, BalancedReplicateAndHsdp) {
  auto m = LoadModelSpec("qwen3-8b");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  for (const char* t : {"replicate=8", "replicate=3", "hsdp=4x2", "hsdp=8x8", "hsdp=3x5"}) {
    for (const char* r : {"dp=1,tp=4,pp=1", "dp=2,tp=2,pp=2", "dp=5,tp=1,pp=3"}) {
      ExpectBalanced(Inputs(*m, t, r));
    }
  }
  // R divides D: whole replicas per holder group.
  ExpectBalanced(Inputs(*m, "replicate=2", "dp=4,tp=2,pp=1"));
  ExpectBalanced(Inputs(*m, "hsdp=2x4", "dp=4,tp=2,pp=2"));
  // A MoE model as well.
  auto moe = LoadModelSpec("qwen3-30b-a3b");
  ASSERT_TRUE(moe.ok());
  ExpectBalanced(Inputs(*moe, "hsdp=4x8", "dp=2,tp=4,pp=2"));
  ExpectBalanced(Inputs(*moe, "replicate=16", "dp=2,tp=4,pp=2"));
}

TEST(Planner, PlanForRankAgreesWithSummaryOnARealModel) {
  auto m = LoadModelSpec("qwen3-30b-a3b");
  ASSERT_TRUE(m.ok());
  for (const char* t : {"fsdp=8", "hsdp=2x4"}) {
    PlanInputs in = Inputs(*m, t, "dp=2,tp=2,pp=2");
    auto ctx = plan_internal::MakeContext(in);
    ASSERT_TRUE(ctx.ok());
    auto ds = ctx->Summarize(SummaryOptions{});
    ASSERT_TRUE(ds.ok());
    for (int r : {0, 5, 8, 8 + 3, 8 + 7}) {
      auto rp = ctx->PlanForRank(r);
      ASSERT_TRUE(rp.ok());
      int64_t bytes = 0, ops = 0, msgs = 0;
      for (const auto* v : {&rp->sends, &rp->recvs}) {
        for (const auto& msg : *v) {
          bytes += msg.bytes;
          ops += static_cast<int64_t>(msg.ops.size());
          ++msgs;
        }
      }
      if (r < 8) {
        EXPECT_EQ(bytes, ds->summary.trainer_ranks[r].send_bytes) << t << " rank " << r;
        EXPECT_EQ(ops, ds->trainer_traffic[r].ops);
        EXPECT_EQ(msgs, ds->trainer_traffic[r].messages);
      } else {
        EXPECT_EQ(bytes, ds->summary.engine_ranks[r - 8].owned_bytes) << t << " rank " << r;
        EXPECT_EQ(ops, ds->engine_traffic[r - 8].ops);
        EXPECT_EQ(msgs, ds->engine_traffic[r - 8].messages);
      }
    }
  }
}

bool SamePlan(const RankPlan& a, const RankPlan& b) {
  auto same = [](const std::vector<Message>& x, const std::vector<Message>& y) {
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i].src != y[i].src || x[i].dst != y[i].dst || x[i].bytes != y[i].bytes ||
          x[i].ops.size() != y[i].ops.size() || x[i].buckets.size() != y[i].buckets.size()) {
        return false;
      }
      for (size_t k = 0; k < x[i].ops.size(); ++k) {
        const auto &p = x[i].ops[k], &q = y[i].ops[k];
        if (p.tensor != q.tensor || p.param != q.param || !(p.src == q.src) || !(p.dst == q.dst) ||
            p.wire_offset != q.wire_offset || p.bytes != q.bytes) {
          return false;
        }
      }
    }
    return true;
  };
  return a.plan_hash == b.plan_hash && same(a.sends, b.sends) && same(a.recvs, b.recvs);
}

class PlannerDeterminism : public ::testing::TestWithParam<const char*> {};

// dp=2: whole replicas per holder group; dp=3: byte-balanced cuts (R does not divide D).
INSTANTIATE_TEST_SUITE_P(Layouts, PlannerDeterminism,
                         ::testing::Values("dp=2,tp=2,pp=2", "dp=3,tp=2,pp=2"));

TEST_P(PlannerDeterminism, SamePlansAndHash) {
  PlanInputs in = Inputs(TinyMoe(true), "hsdp=2x3", GetParam());
  in.model.mlp_only_layers = {0, 2};
  PlanInputs shuffled = in;
  shuffled.model.mlp_only_layers = {2, 0};  // same set, other order
  shuffled.model.name = "/some/other/path/config.json";
  EXPECT_EQ(PlanHash(in), PlanHash(shuffled));
  EXPECT_EQ(PlanHash(in).size(), 32u);
  for (int r = 0; r < SyncWorldSize(in); ++r) {
    auto a = PlanForRank(in, r);
    auto b = PlanForRank(shuffled, r);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(SamePlan(*a, *b)) << "rank " << r;
  }
  // Anything that defines the plan changes the hash.
  std::vector<PlanInputs> variants(6, in);
  variants[0].options.wire_dtype = DType::kF32;
  variants[1].options.bucket_bytes = 1 << 20;
  variants[2].trainer = *ParseTrainerSpec("fsdp=6");
  variants[3].rollout.shard.engine = EngineKind::kVllm;
  variants[4].rollout.dp = in.rollout.dp + 1;
  variants[5].trainer_dtype = DType::kBF16;
  for (const auto& v : variants) EXPECT_NE(PlanHash(v), PlanHash(in));
}

// Every engine hashes under its own name (plan_hash.cc, EngineKindName), one name per engine:
// the hash once spelled every engine but SGLang "vllm", so a third engine's plans would have
// agreed with vLLM's. sglang and vllm keep their bytes (plan_fingerprints.txt pins them).
TEST(Planner, EachEngineHashesUnderItsOwnName) {
  std::set<std::string> names;
  for (EngineKind e : {EngineKind::kSglang, EngineKind::kVllm}) {
    const PlanInputs in = Inputs(TinyDense(), "fsdp=2", "dp=1,tp=2", e);
    const std::string name(EngineKindName(e));
    EXPECT_NE(PlanHashText(in).find("\nengine=" + name + "\n"), std::string::npos) << name;
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 2u);
  EXPECT_EQ(*names.begin(), "sglang");
  EXPECT_EQ(*names.rbegin(), "vllm");
  // A value no engine has (what a new enumerator would be to an old switch) hashes as neither.
  PlanInputs other = Inputs(TinyDense(), "fsdp=2", "dp=1,tp=2", EngineKind::kVllm);
  other.rollout.shard.engine = static_cast<EngineKind>(7);
  const std::string text = PlanHashText(other);
  EXPECT_EQ(text.find("\nengine=vllm\n"), std::string::npos);
  EXPECT_EQ(text.find("\nengine=sglang\n"), std::string::npos);
  EXPECT_NE(PlanHash(other),
            PlanHash(Inputs(TinyDense(), "fsdp=2", "dp=1,tp=2", EngineKind::kVllm)));
}

TEST(Planner, EmbeddedAndParsedConfigsAgree) {
  // The same model read from reordered JSON text gives the same hash.
  auto text = EmbeddedModelConfig("qwen3-0.6b");
  ASSERT_TRUE(text.ok());
  auto a = ParseModelConfig(*text, "a.json");
  ASSERT_TRUE(a.ok());
  auto j = nlohmann::json::parse(*text);
  std::string reordered = "{";
  std::vector<std::string> keys;
  for (auto& [k, v] : j.items()) keys.push_back(k);
  std::reverse(keys.begin(), keys.end());
  for (size_t i = 0; i < keys.size(); ++i) {
    reordered += (i ? "," : "") + nlohmann::json(keys[i]).dump() + ":" + j[keys[i]].dump();
  }
  reordered += "}";
  auto b = ParseModelConfig(reordered, "b.json");
  ASSERT_TRUE(b.ok());
  PlanInputs ia = Inputs(*a, "fsdp=4", "dp=1,tp=2,pp=2");
  PlanInputs ib = Inputs(*b, "fsdp=4", "dp=1,tp=2,pp=2");
  EXPECT_EQ(PlanHash(ia), PlanHash(ib));
}

TEST(Planner, ClearErrorsForImpossibleSpecs) {
  auto m = LoadModelSpec("qwen3-8b");
  ASSERT_TRUE(m.ok());
  // 32 heads are not divisible by tp 3.
  auto s = SummarizePlan(Inputs(*m, "fsdp=8", "dp=1,tp=3,pp=1"));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("--tp"), std::string::npos) << s.status().message();
  // More stages than layers.
  s = SummarizePlan(Inputs(*m, "fsdp=8", "dp=1,tp=1,pp=64"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("--pp"), std::string::npos) << s.status().message();
  // Placement that does not fit.
  PlanInputs in = Inputs(*m, "fsdp=8", "dp=2,tp=4,pp=1");
  Placement p;
  p.nodes = 1;
  p.gpus_per_node = 4;
  auto r = ResolvePlacement(in, p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--nodes"), std::string::npos);
  // Unsupported wire dtype.
  in.options.wire_dtype = DType::kI8;
  s = SummarizePlan(in);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("--wire-dtype"), std::string::npos);
}

// ValidatePlanInputs fails exactly where planning would, with the same message, without planning.
TEST(Planner, ValidateInputsAgreesWithSummary) {
  auto m = LoadModelSpec("qwen3-8b");
  ASSERT_TRUE(m.ok());
  std::vector<PlanInputs> cases = {
      Inputs(*m, "fsdp=8", "dp=1,tp=3,pp=1"),   // 32 heads over tp 3
      Inputs(*m, "fsdp=8", "dp=1,tp=1,pp=64"),  // more stages than layers
      Inputs(*m, "fsdp=8", "dp=2,tp=4,pp=2"),   // fine
      Inputs(TinyMoe(false), "hsdp=2x2", "dp=1,tp=4,pp=2,ep=4"),
      Inputs(TinyMoe(false), "fsdp=2", "dp=1,tp=4,pp=1,ep=2", EngineKind::kVllm),  // vLLM ep
  };
  PlanInputs dtype = cases[2];
  dtype.trainer_dtype = DType::kI32;
  cases.push_back(dtype);
  PlanInputs bucket = cases[2];
  bucket.options.bucket_bytes = 100;
  cases.push_back(bucket);
  PlanInputs partition = cases[2];
  partition.rollout.shard.pp_partition = {30, 7};
  cases.push_back(partition);
  int failing = 0;
  for (const PlanInputs& in : cases) {
    const Status v = ValidatePlanInputs(in);
    const auto s = SummarizePlan(in);
    EXPECT_EQ(v.ok(), s.ok()) << v.ToString() << " vs " << s.status().ToString();
    if (!v.ok() && !s.ok()) {
      ++failing;
      EXPECT_EQ(v.message(), s.status().message());
    }
  }
  EXPECT_EQ(failing, 6);
}

TEST(Planner, CostModelAndPlacement) {
  auto m = LoadModelSpec("qwen3-30b-a3b");
  ASSERT_TRUE(m.ok());
  PlanInputs in = Inputs(*m, "fsdp=8", "dp=2,tp=2,pp=2");
  SummaryOptions o;
  auto ds = SummarizePlanDetailed(in, o);
  ASSERT_TRUE(ds.ok());
  EXPECT_TRUE(ds->placement.colocated);
  EXPECT_EQ(ds->placement.nodes, 1);
  // One node: everything intra-node.
  for (const auto& t : ds->trainer_traffic) EXPECT_GT(t.intra_node_bytes, 0);
  EXPECT_GT(ds->cost.seconds, 0);
  EXPECT_GE(ds->cost.seconds, ds->cost.lower_bound_seconds * 0.999);
  EXPECT_GT(ds->cost.broadcast_seconds, ds->cost.seconds);
  // Per engine rank about a quarter of the broadcast-all bytes (tp*pp = 4).
  for (const auto& e : ds->summary.engine_ranks) {
    const double f = static_cast<double>(e.recv_bytes) / ds->summary.broadcast_recv_bytes_per_rank;
    EXPECT_NEAR(f, 0.25, 0.02);
  }
  // Separate placement when the worlds differ; spanning nodes uses the NIC.
  PlanInputs sep = Inputs(*m, "fsdp=4", "dp=2,tp=2,pp=2");
  auto ds2 = SummarizePlanDetailed(sep, o);
  ASSERT_TRUE(ds2.ok());
  EXPECT_FALSE(ds2->placement.colocated);
  EXPECT_EQ(ds2->placement.nodes, 2);
  int64_t pairs = 0;
  for (int64_t b : ds2->node_pair_bytes) pairs += b;
  EXPECT_EQ(pairs, ds2->summary.total_bytes);
  EXPECT_GT(ds2->node_pair_bytes[0 * 2 + 1], 0);  // trainer node 0 -> engine node 1
  const std::string svg = HeatmapSvg(*ds2, "t<x>");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("t&lt;x&gt;"), std::string::npos);
  EXPECT_NE(svg.find("trainer rank"), std::string::npos);
  // Engine columns name replica, tp and pp (dp=2,tp=2,pp=2: engine rank 5 is replica 1 tp 1 pp 0).
  EXPECT_NE(svg.find(">r0 tp0 pp0<"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">r1 tp1 pp0<"), std::string::npos) << svg;
  EXPECT_EQ(svg.find(">e0<"), std::string::npos);
}

// Issue 36: on a narrow grid (one trainer, one engine rank) the image is as wide as its title.
TEST(Planner, HeatmapTitleFitsANarrowGrid) {
  auto m = LoadModelSpec("qwen2.5-0.5b");
  ASSERT_TRUE(m.ok());
  auto ds = SummarizePlanDetailed(Inputs(*m, "single", "dp=1,tp=1,pp=1"), SummaryOptions{});
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  const std::string title(90, 'T');
  const std::string svg = HeatmapSvg(*ds, title);
  const size_t w = svg.find("width=\"");
  ASSERT_NE(w, std::string::npos);
  const int width = std::stoi(svg.substr(w + 7));
  EXPECT_GE(width, 12 + 90 * 8) << "a 90-character title at 14 px needs about 8 px a character";
}

TEST(Planner, HeatmapAggregatesManyRanks) {
  PlanInputs in = Inputs(TinyDense(), "fsdp=200", "dp=50,tp=2,pp=1");
  SummaryOptions o;
  o.heatmap_max_blocks = 16;
  auto ds = SummarizePlanDetailed(in, o);
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  EXPECT_LE(ds->heatmap.rows, 16);
  EXPECT_LE(ds->heatmap.cols, 16);
  int64_t sum = 0;
  for (int64_t b : ds->heatmap.bytes) sum += b;
  EXPECT_EQ(sum, ds->summary.total_bytes);
}

}  // namespace
}  // namespace shardsync

namespace shardsync {
namespace {

using ::testing::HasSubstr;

// The validators' bucket check (copy and block FP8 plans share it): buckets cut the ops in order
// at their wire offsets; a bucket that names ops past the message's end is reported, never read.
TEST(CheckBucketsCoverOps, AcceptsACoverAndNamesTheMessageOfABadOne) {
  Message m;
  m.src = 1;
  m.dst = 3;
  for (int i = 0; i < 3; ++i) {
    TransferOp op;
    op.wire_offset = 16 * i;
    op.bytes = 16;
    m.ops.push_back(op);
  }
  m.buckets = {{0, 2, 0, 32}, {2, 3, 32, 16}};
  EXPECT_TRUE(plan_internal::CheckBucketsCoverOps(m, 32).ok());
  // One op may exceed the cap alone; two may not.
  EXPECT_FALSE(plan_internal::CheckBucketsCoverOps(m, 16).ok());
  for (const std::vector<Bucket>& bad :
       std::vector<std::vector<Bucket>>{{{0, 2, 0, 32}},                  // op 2 in no bucket
                                        {{0, 2, 0, 32}, {2, 9, 32, 16}},  // past the last op
                                        {{0, 2, 0, 32}, {2, 3, 40, 16}},  // wrong wire offset
                                        {{0, 2, 0, 24}, {2, 3, 32, 16}},  // bytes not the ops'
                                        {{1, 3, 0, 32}}}) {
    m.buckets = bad;
    const Status s = plan_internal::CheckBucketsCoverOps(m, 64);
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(s.message(), HasSubstr("message 1->3"));
  }
}

}  // namespace
}  // namespace shardsync
