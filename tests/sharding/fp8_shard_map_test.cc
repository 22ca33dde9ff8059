// Block-FP8 shard maps: weight (e4m3) + weight_scale_inv (fp32) per quantized engine parameter,
// per-part scale rows of fused projections, replicated kv heads, stacked experts, and the layouts
// the engines refuse.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "sharding/test_util.h"
#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

using testing::MustBuild;
using testing::MustFind;
using testing::MustLoad;
using testing::Spec;

ModelSpec Fp8(ModelSpec m) {
  m.quant = QuantConfig{};
  m.quant->origin = "--quant";
  return m;
}

TEST(Fp8ShardMap, Qwen3DenseSglangTp2Pp2) {
  const ModelSpec m = Fp8(MustLoad("qwen3-8b"));
  const ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 2, 2));
  for (const EngineRankShards& r : map.ranks) {
    const std::string l = fmt::format("model.layers.{}.", r.layer_start);
    const EngineParam& qkv = MustFind(r, l + "self_attn.qkv_proj.weight");
    EXPECT_EQ(qkv.dtype, DType::kF8E4M3);
    EXPECT_EQ(qkv.shape, (Shape{3072, 4096}));  // (16 q + 4 k + 4 v heads) x 128
    const EngineParam& qs = MustFind(r, l + "self_attn.qkv_proj.weight_scale_inv");
    EXPECT_EQ(qs.dtype, DType::kF32);
    EXPECT_EQ(qs.shape, (Shape{24, 32}));
    // One scale piece per part: q blocks [16 r, +16), k and v blocks [4 r, +4).
    ASSERT_EQ(qs.pieces.size(), 3u);
    EXPECT_EQ(qs.pieces[0].source, l + "self_attn.q_proj.weight_scale_inv");
    EXPECT_EQ(qs.pieces[0].src, Region::Make({16 * r.tp_rank, 0}, {16, 32}));
    EXPECT_EQ(qs.pieces[0].dst, Region::Make({0, 0}, {16, 32}));
    EXPECT_EQ(qs.pieces[1].source, l + "self_attn.k_proj.weight_scale_inv");
    EXPECT_EQ(qs.pieces[1].src, Region::Make({4 * r.tp_rank, 0}, {4, 32}));
    EXPECT_EQ(qs.pieces[1].dst, Region::Make({16, 0}, {4, 32}));
    EXPECT_EQ(qs.pieces[2].dst, Region::Make({20, 0}, {4, 32}));
    // Row parallel: scale columns follow the input split.
    const EngineParam& os = MustFind(r, l + "self_attn.o_proj.weight_scale_inv");
    EXPECT_EQ(os.shape, (Shape{32, 16}));
    EXPECT_EQ(os.pieces[0].src, Region::Make({0, 16 * r.tp_rank}, {32, 16}));
    const EngineParam& gu = MustFind(r, l + "mlp.gate_up_proj.weight_scale_inv");
    EXPECT_EQ(gu.shape, (Shape{96, 32}));  // 2 x 6144 / 128
    ASSERT_EQ(gu.pieces.size(), 2u);
    EXPECT_EQ(gu.pieces[1].dst, Region::Make({48, 0}, {48, 32}));
    // Unquantized: norms, embeddings, lm_head.
    EXPECT_EQ(MustFind(r, l + "input_layernorm.weight").dtype, DType::kBF16);
    EXPECT_EQ(FindParam(r, l + "self_attn.q_norm.weight_scale_inv"), nullptr);
    if (r.pp_rank == 0) {
      EXPECT_EQ(MustFind(r, "model.embed_tokens.weight").dtype, DType::kBF16);
    } else {
      EXPECT_EQ(MustFind(r, "lm_head.weight").dtype, DType::kBF16);
    }
  }
  // A bf16 map of the same layout has the same parameters minus the scales, fp8 weights 1 byte.
  const ShardMap bf16 = MustBuild(MustLoad("qwen3-8b"), Spec(EngineKind::kSglang, 2, 2));
  for (size_t i = 0; i < map.ranks.size(); ++i) {
    size_t scales = 0;
    for (const EngineParam& p : map.ranks[i].params) {
      if (p.dtype == DType::kF32) ++scales;
    }
    EXPECT_EQ(map.ranks[i].params.size(), bf16.ranks[i].params.size() + scales);
    EXPECT_LT(map.ranks[i].bytes(), bf16.ranks[i].bytes() * 6 / 10);
  }
}

TEST(Fp8ShardMap, ReplicatedKvHeadsShareTheirScaleRows) {
  // qwen3-8b tp16: 8 kv heads, each on 2 ranks.
  const ShardMap map = MustBuild(Fp8(MustLoad("qwen3-8b")), Spec(EngineKind::kVllm, 16));
  for (int r = 0; r < 16; ++r) {
    const EngineParam& s =
        MustFind(map.rank(r, 0), "model.layers.0.self_attn.qkv_proj.weight_scale_inv");
    EXPECT_EQ(s.shape, (Shape{4, 32}));
    EXPECT_EQ(s.pieces[1].src, Region::Make({r / 2, 0}, {1, 32})) << r;
  }
}

TEST(Fp8ShardMap, MoeExpertsStackedWithPerExpertScales) {
  const ModelSpec m = Fp8(MustLoad("qwen3-30b-a3b"));
  const ShardMap vllm = MustBuild(m, Spec(EngineKind::kVllm, 2, 1, 2));  // EP: moe_tp 1
  for (const EngineRankShards& r : vllm.ranks) {
    const EngineParam& w13 = MustFind(r, "model.layers.0.mlp.experts.w13_weight");
    EXPECT_EQ(w13.dtype, DType::kF8E4M3);
    EXPECT_EQ(w13.shape, (Shape{64, 1536, 2048}));
    const EngineParam& s13 = MustFind(r, "model.layers.0.mlp.experts.w13_weight_scale_inv");
    EXPECT_EQ(s13.shape, (Shape{64, 12, 16}));
    // Expert 64 r + 1's up_proj scale lands in stack slot 1, rows [6, 12).
    EXPECT_EQ(
        s13.pieces[3].source,
        fmt::format("model.layers.0.mlp.experts.{}.up_proj.weight_scale_inv", 64 * r.tp_rank + 1));
    EXPECT_EQ(s13.pieces[3].dst, Region::Make({1, 6, 0}, {1, 6, 16}));
    const EngineParam& s2 = MustFind(r, "model.layers.0.mlp.experts.w2_weight_scale_inv");
    EXPECT_EQ(s2.shape, (Shape{64, 16, 6}));
    EXPECT_EQ(MustFind(r, "model.layers.0.mlp.gate.weight").dtype, DType::kBF16);  // router
  }
  // SGLang tp2 ep1 (moe_tp 2): I_p = 384 = 3 blocks, columns of down_proj split.
  const ShardMap sg = MustBuild(m, Spec(EngineKind::kSglang, 2, 2));
  const EngineParam& s2 = MustFind(sg.rank(1, 0), "model.layers.0.mlp.experts.w2_weight_scale_inv");
  EXPECT_EQ(s2.shape, (Shape{128, 16, 3}));
  EXPECT_EQ(s2.pieces[0].src, Region::Make({0, 3}, {16, 3}));
}

void ExpectRefused(const ModelSpec& m, const ShardSpec& s,
                   std::initializer_list<const char*> words) {
  auto r = BuildShardMap(m, s);
  ASSERT_FALSE(r.ok()) << "accepted tp " << s.tp;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  for (const char* w : words) {
    EXPECT_NE(r.status().message().find(w), std::string::npos)
        << "'" << w << "' not in: " << r.status().message();
  }
}

TEST(Fp8ShardMap, LayoutsTheEnginesRefuseAreRefusedNamingTheTensor) {
  // qwen2.5-0.5b (head_dim 64): at tp 2 each rank holds 448 q rows.
  ExpectRefused(Fp8(MustLoad("qwen2.5-0.5b")), Spec(EngineKind::kSglang, 2),
                {"--tp 2", "model.layers.0.self_attn.qkv_proj.weight",
                 "model.layers.0.self_attn.q_proj.weight",
                 "Weight output_partition_size = 448 is not divisible by weight quantization "
                 "block_n = 128"});
  // Qwen3-30B-A3B with MoE tp 4: I_p = 192.
  ExpectRefused(Fp8(MustLoad("qwen3-30b-a3b")), Spec(EngineKind::kSglang, 4),
                {"--tp 4 --ep 1", "mlp.experts.w13_weight",
                 "The output_size of gate's and up's weight = 192 is not divisible by weight "
                 "quantization block_n = 128"});
  // The same model with EP keeps experts whole and is accepted.
  MustBuild(Fp8(MustLoad("qwen3-30b-a3b")), Spec(EngineKind::kSglang, 4, 1, 4));
  // A merged weight needs every part on the grid even at tp 1 (kv rows 64).
  ModelSpec small = testing::SmallDense(2, 1);
  small.hidden_size = 256;
  small.head_dim = 64;
  small.intermediate_size = 256;
  ExpectRefused(Fp8(small), Spec(EngineKind::kVllm, 1),
                {"--tp 1", "qkv_proj.weight", "block_n = 128"});
}

TEST(Fp8ShardMap, PartialLastBlocksOfUnsplitDimsAreAccepted) {
  // hidden 200: every input dim of q/k/v/gate/up ends in a partial block, as does o_proj's
  // output dim and down_proj's; unsplit, so the engines accept it.
  ModelSpec m = testing::SmallDense(2, 1);
  m.hidden_size = 200;
  m.head_dim = 128;
  m.intermediate_size = 384;
  const ShardMap map = MustBuild(Fp8(m), Spec(EngineKind::kSglang, 1, 2));
  const EngineParam& o =
      MustFind(map.rank(0, 0), "model.layers.0.self_attn.o_proj.weight_scale_inv");
  EXPECT_EQ(o.shape, (Shape{2, 2}));  // [ceil(200/128), 256/128]
  const EngineParam& qkv =
      MustFind(map.rank(0, 0), "model.layers.0.self_attn.qkv_proj.weight_scale_inv");
  EXPECT_EQ(qkv.shape, (Shape{4, 2}));
  // Split at tp 2, the down_proj input (192 columns) is off the grid: refused.
  ExpectRefused(Fp8(m), Spec(EngineKind::kSglang, 2), {"--tp 2", "gate_up_proj", "192"});
}

TEST(Fp8ShardMap, RenderingsShowTheDtypes) {
  const ShardMap map = MustBuild(Fp8(MustLoad("qwen3-0.6b")), Spec(EngineKind::kSglang, 2));
  const std::string table = ShardMapToTable(map, AllRanks(map));
  EXPECT_NE(table.find("block FP8 (fp8 e4m3 128x128, from --quant)"), std::string::npos) << table;
  const std::string json = ShardMapToJson(map, {&map.rank(0, 0)});
  EXPECT_NE(json.find("\"float8_e4m3fn\""), std::string::npos);
  auto ex = ExplainParam(map, map.rank(1, 0), "model.layers.0.self_attn.qkv_proj.weight_scale_inv");
  ASSERT_TRUE(ex.ok()) << ex.status().ToString();
  EXPECT_NE(ex->find("k_proj.weight_scale_inv[4:8, 0:8]"), std::string::npos) << *ex;
}

}  // namespace
}  // namespace shardsync
