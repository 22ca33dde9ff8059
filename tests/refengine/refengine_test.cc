// The sharded forward on engine-layout buffers must generate what the unsharded model generates,
// for every layout; a wrong layout (swapped k/v, swapped gate/up, wrong expert) must be caught.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "refengine/kernels.h"
#include "shardsync/refengine.h"

namespace shardsync {
namespace {

using ::testing::HasSubstr;

// Tiny configs: hidden 64, vocab 200 (padded to 256, so the last vocab rank holds zero rows).
std::string Config(std::string_view arch, std::string_view extra, int layers = 4,
                   bool tied = false) {
  return fmt::format(R"({{"architectures":["{}"],"hidden_size":64,"num_attention_heads":4,)"
                     R"("num_key_value_heads":2,"num_hidden_layers":{},"intermediate_size":128,)"
                     R"("vocab_size":200,"tie_word_embeddings":{},"rms_norm_eps":1e-6,)"
                     R"("rope_theta":10000.0,"torch_dtype":"bfloat16"{}}})",
                     arch, layers, tied ? "true" : "false", extra);
}

ModelSpec Spec(const std::string& json) {
  auto s = ParseModelConfig(json, "test-config");
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : ModelSpec{};
}

ModelSpec Llama(bool tied = false, int layers = 4) {
  return Spec(Config("LlamaForCausalLM", "", layers, tied));
}
ModelSpec Qwen2(bool tied = true) { return Spec(Config("Qwen2ForCausalLM", "", 3, tied)); }
ModelSpec Qwen3() {
  // head_dim 32 != hidden / heads, as in real Qwen3.
  return Spec(Config("Qwen3ForCausalLM", R"(,"head_dim":32)", 3, true));
}
ModelSpec Qwen3Moe() {
  return Spec(Config("Qwen3MoeForCausalLM",
                     R"(,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":32,)"
                     R"("norm_topk_prob":true,"decoder_sparse_step":1,"mlp_only_layers":[1],)"
                     R"("head_dim":16)",
                     3, false));
}

struct Fixture {
  ModelSpec spec;
  ShardMap map;
  std::unique_ptr<SyntheticWeightSource> weights;
  std::vector<EngineBuffers> buffers;
};

Fixture Make(const ModelSpec& spec, EngineKind engine, int tp, int pp, int ep = 1) {
  Fixture f;
  f.spec = spec;
  auto map = BuildShardMap(spec, ShardSpec{engine, tp, pp, ep, {}});
  EXPECT_TRUE(map.ok()) << map.status().ToString();
  if (!map.ok()) return f;
  f.map = *map;
  EXPECT_TRUE(ValidateShardMap(f.map).ok());
  f.weights = std::make_unique<SyntheticWeightSource>(spec, /*seed=*/7);
  auto cut = CutEngineShards(f.map, *f.weights);
  EXPECT_TRUE(cut.ok()) << cut.status().ToString();
  if (cut.ok()) f.buffers = std::move(cut).value();
  return f;
}

GenerationCheck Check(const Fixture& f, int n = 6) {
  auto c = CheckGeneration(f.map, f.buffers, *f.weights, DefaultPrompt(), n);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : GenerationCheck{};
}

void ExpectMatch(const ModelSpec& spec, EngineKind engine, int tp, int pp, int ep = 1) {
  SCOPED_TRACE(
      fmt::format("{} {} tp {} pp {} ep {}", spec.name, EngineKindName(engine), tp, pp, ep));
  Fixture f = Make(spec, engine, tp, pp, ep);
  ASSERT_EQ(f.buffers.size(), static_cast<size_t>(tp * pp));
  GenerationCheck c = Check(f);
  EXPECT_TRUE(c.match) << "max diff " << c.max_logit_diff << " tol " << c.tolerance;
  EXPECT_EQ(c.reference_tokens, c.engine_tokens);
  EXPECT_EQ(c.reference_tokens.size(), 6u);
  EXPECT_LT(c.max_logit_diff, c.tolerance);
  // Not degenerate: a synthetic model (tied or not) does not emit one token forever, so the
  // token comparison has power.
  std::set<int64_t> distinct(c.reference_tokens.begin(), c.reference_tokens.end());
  EXPECT_GT(distinct.size(), 1u);
  if (getenv("SS_VERBOSE")) {
    fmt::print("{} tp {} pp {} ep {}: tokens {} max diff {:.3g} tol {:.3g}\n",
               EngineKindName(engine), tp, pp, ep, fmt::join(c.reference_tokens, ","),
               c.max_logit_diff, c.tolerance);
  }
}

TEST(ShardedForward, LlamaUntiedEveryTpPp) {
  const ModelSpec s = Llama(false);  // 4 layers: pp 3 is uneven ([1,1,2] / vLLM [1,2,1])
  for (int tp : {1, 2, 4}) {         // tp 4 > 2 kv heads: replicated kv heads
    for (int pp : {1, 2, 3}) ExpectMatch(s, EngineKind::kSglang, tp, pp);
  }
  ExpectMatch(s, EngineKind::kVllm, 2, 3);
  ExpectMatch(s, EngineKind::kVllm, 4, 3);
}

TEST(ShardedForward, LlamaTiedBothEngines) {
  const ModelSpec s = Llama(true, 3);
  for (EngineKind e : {EngineKind::kSglang, EngineKind::kVllm}) {
    ExpectMatch(s, e, 1, 1);
    ExpectMatch(s, e, 2, 2);  // SGLang: lm_head.weight on the last stage; vLLM: embed_tokens
    ExpectMatch(s, e, 4, 3);
  }
}

TEST(ShardedForward, LlamaAttentionBiasAddedOnce) {
  ModelSpec s = Spec(Config("LlamaForCausalLM", R"(,"attention_bias":true)", 2));
  ExpectMatch(s, EngineKind::kSglang, 2, 1);
  ExpectMatch(s, EngineKind::kSglang, 4, 2);
}

TEST(ShardedForward, LlamaRopeScaling) {
  ModelSpec s = Spec(Config("LlamaForCausalLM",
                            R"(,"rope_scaling":{"rope_type":"llama3","factor":8.0,)"
                            R"("low_freq_factor":1.0,"high_freq_factor":4.0,)"
                            R"("original_max_position_embeddings":64})",
                            2));
  ExpectMatch(s, EngineKind::kSglang, 2, 2);
}

TEST(ShardedForward, Qwen2Biases) {
  const ModelSpec s = Qwen2(true);
  ExpectMatch(s, EngineKind::kSglang, 2, 1);
  ExpectMatch(s, EngineKind::kSglang, 4, 2);
  ExpectMatch(s, EngineKind::kVllm, 4, 3);
  ExpectMatch(Qwen2(false), EngineKind::kSglang, 2, 3);
}

TEST(ShardedForward, Qwen3QkNorms) {
  const ModelSpec s = Qwen3();
  ExpectMatch(s, EngineKind::kSglang, 4, 1);
  ExpectMatch(s, EngineKind::kSglang, 2, 3);
  ExpectMatch(s, EngineKind::kVllm, 2, 2);
}

TEST(ShardedForward, Qwen3MoeExpertParallel) {
  const ModelSpec s = Qwen3Moe();  // layer 1 dense (mlp_only_layers), layers 0 and 2 MoE
  ExpectMatch(s, EngineKind::kSglang, 2, 1, 1);
  ExpectMatch(s, EngineKind::kSglang, 2, 1, 2);
  ExpectMatch(s, EngineKind::kSglang, 4, 2, 2);  // moe_tp 2 inside each of 2 EP groups
  ExpectMatch(s, EngineKind::kVllm, 2, 2, 1);
  ExpectMatch(s, EngineKind::kVllm, 4, 1, 4);
}

// ---- the check can fail ----

// Swaps two equal row blocks [a, a+n) and [b, b+n) of a 2-d (or stacked 3-d) buffer.
void SwapRows(HostTensor& t, int64_t a, int64_t b, int64_t n) {
  const int64_t row = t.shape.back() * DTypeSize(t.dtype);
  std::vector<uint8_t> tmp(n * row);
  std::memcpy(tmp.data(), t.data.data() + a * row, n * row);
  std::memmove(t.data.data() + a * row, t.data.data() + b * row, n * row);
  std::memcpy(t.data.data() + b * row, tmp.data(), n * row);
}

TEST(ShardedForwardDetects, KAndVSwappedInQkv) {
  Fixture f = Make(Llama(), EngineKind::kSglang, 2, 2);
  ASSERT_TRUE(Check(f).match);
  // Rank (tp 1, pp 1), layer 3: q 2 heads x 16 rows, then k 16 rows, then v 16 rows.
  HostTensor& qkv = f.buffers[1 * 2 + 1].at("model.layers.3.self_attn.qkv_proj.weight");
  SwapRows(qkv, 32, 48, 16);
  GenerationCheck c = Check(f);
  EXPECT_FALSE(c.match);
  EXPECT_GT(c.max_logit_diff, c.tolerance);
}

TEST(ShardedForwardDetects, GateAndUpSwapped) {
  Fixture f = Make(Qwen2(), EngineKind::kVllm, 2, 1);
  HostTensor& gu = f.buffers[0].at("model.layers.1.mlp.gate_up_proj.weight");
  SwapRows(gu, 0, 64, 64);  // I / tp = 64 rows each
  GenerationCheck c = Check(f);
  EXPECT_FALSE(c.match);
  EXPECT_GT(c.max_logit_diff, c.tolerance);
}

TEST(ShardedForwardDetects, WrongPlanWithKAndVSourcesSwapped) {
  // A deliberately wrong shard map: every qkv_proj takes its k rows from v_proj and vice versa.
  Fixture f = Make(Qwen3(), EngineKind::kSglang, 2, 2);
  for (auto& rank : f.map.ranks) {
    for (auto& p : rank.params) {
      for (auto& piece : p.pieces) {
        if (piece.source.ends_with("k_proj.weight")) {
          piece.source.replace(piece.source.size() - 13, 1, "v");
        } else if (piece.source.ends_with("v_proj.weight")) {
          piece.source.replace(piece.source.size() - 13, 1, "k");
        }
      }
    }
  }
  ASSERT_TRUE(ValidateShardMap(f.map).ok());  // still an exact cover: only the math can tell
  auto wrong = CutEngineShards(f.map, *f.weights);
  ASSERT_TRUE(wrong.ok());
  f.buffers = *wrong;
  GenerationCheck c = Check(f);
  EXPECT_FALSE(c.match);
}

TEST(ShardedForwardDetects, ExpertsOnTheWrongEpRank) {
  Fixture f = Make(Qwen3Moe(), EngineKind::kSglang, 2, 1, 2);
  ASSERT_TRUE(Check(f).match);
  // Exchange the expert stacks of the two EP ranks of layer 2 (both shapes match).
  auto& a = f.buffers[0].at("model.layers.2.mlp.experts.w13_weight");
  auto& b = f.buffers[1].at("model.layers.2.mlp.experts.w13_weight");
  std::swap(a.data, b.data);
  GenerationCheck c = Check(f);
  EXPECT_FALSE(c.match);
}

TEST(ShardedForward, PaddingRowsAreIgnored) {
  Fixture f = Make(Llama(), EngineKind::kSglang, 4, 1);
  // Rank 3 holds real rows [192, 200) and 56 padding rows: fill the padding with garbage.
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
    HostTensor& t = f.buffers[3].at(name);
    const int64_t row = 64 * 2;
    std::memset(t.data.data() + 8 * row, 0x7f, 56 * row);
  }
  GenerationCheck c = Check(f);
  EXPECT_TRUE(c.match) << c.max_logit_diff;
}

TEST(ShardedForward, BadBuffersAreNamedErrors) {
  Fixture f = Make(Llama(), EngineKind::kSglang, 2, 2);
  auto missing = f.buffers;
  missing[3].erase("model.norm.weight");
  auto m = MakeShardedModel(f.map, missing);
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr("(tp 1, pp 1)"));
  EXPECT_THAT(m.status().message(), HasSubstr("model.norm.weight"));
  auto shape = f.buffers;
  shape[0].at("model.layers.0.input_layernorm.weight").shape = {32, 2};
  EXPECT_THAT(MakeShardedModel(f.map, shape).status().message(),
              HasSubstr("model.layers.0.input_layernorm.weight"));
  auto extra = f.buffers;
  extra[0].emplace("model.layers.3.mlp.down_proj.weight", HostTensor{});
  EXPECT_THAT(MakeShardedModel(f.map, extra).status().message(), HasSubstr("not in the shard map"));
  auto lm = MakeShardedModel(f.map, f.buffers);
  ASSERT_TRUE(lm.ok());
  const int64_t bad[1] = {200};
  EXPECT_EQ((*lm)->Forward(bad).status().code(), StatusCode::kInvalidArgument);
}

// ---- dumps and checkpoints ----

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/ss_refengine_test_XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& f) const { return path_ + "/" + f; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(EngineDump, RoundTripThroughFilesNamedBySyncRank) {
  Fixture f = Make(Qwen2(), EngineKind::kSglang, 2, 2);
  TempDir dir;
  for (size_t i = 0; i < f.buffers.size(); ++i) {
    const auto& r = f.map.ranks[i];
    ASSERT_TRUE(WriteEngineDump(dir / fmt::format("rank-{}.safetensors", 3 + i), f.buffers[i],
                                {0, r.tp_rank, r.pp_rank})
                    .ok());
  }
  auto loaded = LoadEngineDump(dir.path(), f.map);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  f.buffers = *loaded;
  EXPECT_TRUE(Check(f).match);

  std::filesystem::remove(dir / "rank-4.safetensors");  // (tp 1, pp 0)
  auto missing = LoadEngineDump(dir.path(), f.map);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("(tp 1, pp 0)"));
  ASSERT_TRUE(WriteEngineDump(dir / "dup.safetensors", f.buffers[0], {0, 0, 0}).ok());
  EXPECT_THAT(LoadEngineDump(dir.path(), f.map).status().message(), HasSubstr("both claim"));
}

// Issue 26: `--dump-dir` followed a planted rank-N.safetensors.tmp symlink and overwrote its
// target, and dumps were world-readable.
TEST(EngineDump, PlantedSymlinkLeavesItsTargetUnchangedAndTheDumpIsPrivate) {
  Fixture f = Make(Qwen2(), EngineKind::kSglang, 1, 1);
  TempDir dir;
  const std::string victim = dir / "victim";
  std::ofstream(victim) << "precious";
  const std::string dump = dir / "rank-3.safetensors";
  ASSERT_EQ(::symlink(victim.c_str(), (dump + ".tmp").c_str()), 0);
  ASSERT_TRUE(WriteEngineDump(dump, f.buffers[0], {0, 0, 0}).ok());
  std::ifstream in(victim);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), {}), "precious");
  struct stat st {};
  ASSERT_EQ(::lstat(dump.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto loaded = LoadEngineDump(dir.path(), f.map);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
}

// Issue 26: an absurd but valid config is a named error before anything is allocated (it used
// to abort on std::bad_alloc), and so is keeping the logits of an absurd number of steps.
TEST(Budget, AbsurdSizesAreRefusedBeforeAllocating) {
  // ~2^61 weights: fp32 bytes overflow int64, so the estimate must saturate, not wrap.
  const ModelSpec absurd =
      Spec(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":536870912,"intermediate_size":2,)"
           R"("num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":1,)"
           R"("vocab_size":2147483648,"torch_dtype":"bfloat16"})");
  SyntheticWeightSource w(absurd, 1);
  auto m = MakeReferenceModel(absurd, w);
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("over 8 EiB"));
  auto map = BuildShardMap(absurd, {EngineKind::kSglang, 2, 1, 1, {}});
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_THAT(CutEngineShards(*map, w).status().message(), HasSubstr("GiB needed, more than"));
  EXPECT_THAT(MakeShardedModel(*map, {}).status().message(), HasSubstr("over 8 EiB"));

  Fixture f = Make(Qwen2(), EngineKind::kSglang, 1, 1);
  auto lm = MakeReferenceModel(f.spec, *f.weights);
  ASSERT_TRUE(lm.ok());
  auto g = GreedyGenerate(**lm, DefaultPrompt(), 2000000000);
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(g.status().message(), HasSubstr("max_new_tokens"));
  EXPECT_GT(HostMemoryBudget(), 0);
  EXPECT_TRUE(CheckHostMemory(1 << 20, "x", "y").ok());
  EXPECT_EQ(CheckHostMemory(INT64_MAX, "x", "y").code(), StatusCode::kInvalidArgument);
}

// Issue 26: NaN weights decoded to tokens 0,0,0,0 and an I8 tensor was an internal error.
TEST(Checkpoint, NonFiniteAndNonFloatWeightsAreNamedErrors) {
  const ModelSpec spec = Qwen2();
  SyntheticWeightSource syn(spec, 7);
  std::vector<std::vector<uint8_t>> store;
  std::vector<TensorToWrite> ts;
  for (const HfTensor& t : HfTensorInventory(spec)) {
    store.emplace_back(t.bytes());
    ASSERT_TRUE(syn.Read(t.name, Region::Full(t.shape), t.dtype, store.back().data()).ok());
    ts.push_back({t.name, t.dtype, t.shape, store.back()});
  }
  const std::string victim = "model.layers.1.mlp.up_proj.weight";
  size_t vi = 0;
  while (ts[vi].name != victim) ++vi;
  TempDir dir;
  auto open_and_load = [&]() {
    EXPECT_TRUE(WriteSafetensors(dir / "model.safetensors", ts).ok());
    auto ckpt = CheckpointWeightSource::Open(dir.path());
    EXPECT_TRUE(ckpt.ok());
    return MakeReferenceModel(spec, **ckpt).status();
  };
  uint16_t nan_bf16 = 0x7fc0;
  std::memcpy(store[vi].data() + 10, &nan_bf16, 2);  // element 5
  Status s = open_and_load();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(victim));
  EXPECT_THAT(s.message(), HasSubstr("element 5"));
  std::vector<uint8_t> i8(store[vi].size() / 2, 1);
  ts[vi] = {victim, DType::kI8, ts[vi].shape, i8};
  s = open_and_load();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(victim));
  EXPECT_THAT(s.message(), HasSubstr("I8"));
}

// Issue 37: finite but huge weights (1e30 in every bf16 element) overflow the forward pass to
// inf / NaN logits; generation used to go on and exit 0. It is an error naming the step.
TEST(Checkpoint, HugeFiniteWeightsGiveANamedErrorNotNaNTokens) {
  const ModelSpec spec = Qwen2();
  std::vector<std::vector<uint8_t>> store;
  std::vector<TensorToWrite> ts;
  const uint16_t huge_bf16 = 0x7149;  // about 1e30: finite
  for (const HfTensor& t : HfTensorInventory(spec)) {
    store.emplace_back(t.bytes());
    ASSERT_EQ(t.dtype, DType::kBF16);
    for (size_t i = 0; i + 1 < store.back().size(); i += 2) {
      std::memcpy(store.back().data() + i, &huge_bf16, 2);
    }
    ts.push_back({t.name, t.dtype, t.shape, store.back()});
  }
  TempDir dir;
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", ts).ok());
  auto ckpt = CheckpointWeightSource::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  auto lm = MakeReferenceModel(spec, **ckpt);
  ASSERT_TRUE(lm.ok()) << lm.status().ToString();  // every weight is finite
  auto g = GreedyGenerate(**lm, DefaultPrompt(), 4);
  EXPECT_EQ(g.status().code(), StatusCode::kFailedPrecondition) << g.status().ToString();
  EXPECT_THAT(g.status().message(), HasSubstr("logits are not finite"));
}

TEST(Checkpoint, SafetensorsCheckpointGivesTheSyntheticModelsLogits) {
  const ModelSpec spec = Qwen3();
  SyntheticWeightSource syn(spec, 7);
  std::vector<std::vector<uint8_t>> store;
  std::vector<TensorToWrite> ts;
  for (const HfTensor& t : HfTensorInventory(spec)) {
    store.emplace_back(t.bytes());
    ASSERT_TRUE(syn.Read(t.name, Region::Full(t.shape), t.dtype, store.back().data()).ok());
    ts.push_back({t.name, t.dtype, t.shape, store.back()});
  }
  TempDir dir;
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", ts).ok());
  auto ckpt = CheckpointWeightSource::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  auto a = MakeReferenceModel(spec, syn);
  auto b = MakeReferenceModel(spec, **ckpt);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ga = GreedyGenerate(**a, DefaultPrompt(), 4);
  auto gb = GreedyGenerate(**b, DefaultPrompt(), 4);
  ASSERT_TRUE(ga.ok() && gb.ok());
  EXPECT_EQ(ga->tokens, gb->tokens);
  EXPECT_EQ(ga->step_logits, gb->step_logits);  // bit-identical: same bf16 values
  // A checkpoint missing a tensor is a named error.
  ts.pop_back();
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", ts).ok());
  auto short_ckpt = CheckpointWeightSource::Open(dir.path());
  ASSERT_TRUE(short_ckpt.ok());
  auto bad = MakeReferenceModel(spec, **short_ckpt);
  EXPECT_EQ(bad.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(bad.status().message(), HasSubstr("model.norm.weight"));
}

TEST(Generate, KvCacheDecodingEqualsFullRecompute) {
  // Decoding token by token with the cache gives the logits of a fresh run on the whole prefix.
  const ModelSpec spec = Llama();
  SyntheticWeightSource syn(spec, 3);
  auto lm = MakeReferenceModel(spec, syn);
  ASSERT_TRUE(lm.ok());
  auto g = GreedyGenerate(**lm, DefaultPrompt(), 3);
  ASSERT_TRUE(g.ok());
  std::vector<int64_t> all = DefaultPrompt();
  all.insert(all.end(), g->tokens.begin(), g->tokens.end() - 1);
  (*lm)->Reset();
  auto full = (*lm)->Forward(all);
  ASSERT_TRUE(full.ok());
  const auto& cached = g->step_logits.back();
  for (size_t i = 0; i < full->size(); ++i) EXPECT_NEAR((*full)[i], cached[i], 1e-4);
}

// ---- kernels ----

TEST(Kernels, RopeIsHfRotateHalf) {
  ModelSpec s;
  s.head_dim = 4;
  s.rope_theta = 100.0;
  auto rope = refengine::Rope::Make(s);
  ASSERT_TRUE(rope.ok());
  float x[4] = {1.f, 2.f, 3.f, 4.f};
  rope->Apply(x, 1, 3);
  // inv_freq = [1, 100^-0.5 = 0.1]; pairs (0, 2) and (1, 3).
  const double a0 = 3.0, a1 = 0.3;
  EXPECT_NEAR(x[0], 1 * std::cos(a0) - 3 * std::sin(a0), 1e-5);
  EXPECT_NEAR(x[2], 3 * std::cos(a0) + 1 * std::sin(a0), 1e-5);
  EXPECT_NEAR(x[1], 2 * std::cos(a1) - 4 * std::sin(a1), 1e-5);
  EXPECT_NEAR(x[3], 4 * std::cos(a1) + 2 * std::sin(a1), 1e-5);
}

TEST(Kernels, RouteTopKRenormalised) {
  const float logits[4] = {0.f, 2.f, 1.f, 2.f};
  auto r = refengine::Route(logits, 2, true);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].first, 1);  // tie between 1 and 3: lower id first
  EXPECT_EQ(r[1].first, 3);
  EXPECT_NEAR(r[0].second + r[1].second, 1.f, 1e-6);
  auto raw = refengine::Route(logits, 2, false);
  const double z = 1 + 2 * std::exp(2.0) + std::exp(1.0);
  EXPECT_NEAR(raw[0].second, std::exp(2.0) / z, 1e-6);
}

TEST(Kernels, AttentionIsCausal) {
  refengine::KvCache c{1, 2, 0, {}, {}};
  const float k[4] = {1, 0, 0, 1}, v[4] = {5, 6, 7, 8};
  c.Append(k, v, 2);
  const float q[4] = {10, 0, 0, 10};
  float out[4];
  refengine::Attend(q, 2, 1, c, out);
  EXPECT_FLOAT_EQ(out[0], 5);  // position 0 sees only itself
  EXPECT_FLOAT_EQ(out[1], 6);
  EXPECT_GT(out[2], 6.9f);  // position 1 attends mostly to key 1
}

}  // namespace
}  // namespace shardsync
