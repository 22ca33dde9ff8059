// Every worked example of ../shared/reference/engine-layouts.md sections 2-3.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "sharding/test_util.h"
#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

using testing::MustBuild;
using testing::MustFind;
using testing::MustLoad;
using testing::Spec;

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

Ranges AllRanges(EngineKind e, int64_t layers, int pp, const std::vector<int64_t>& part = {}) {
  Ranges out;
  for (int r = 0; r < pp; ++r) {
    auto range = PpLayerRange(e, layers, r, pp, part);
    EXPECT_TRUE(range.ok()) << range.status().ToString();
    if (range.ok()) out.push_back(*range);
  }
  return out;
}

std::vector<int64_t> Counts(const Ranges& rs) {
  std::vector<int64_t> c;
  for (auto [a, b] : rs) c.push_back(b - a);
  return c;
}

TEST(PpPartition, WorkedExamples) {
  const auto S = EngineKind::kSglang, V = EngineKind::kVllm;
  EXPECT_EQ(AllRanges(S, 28, 3), (Ranges{{0, 9}, {9, 18}, {18, 28}}));
  EXPECT_EQ(AllRanges(V, 28, 3), (Ranges{{0, 9}, {9, 19}, {19, 28}}));
  EXPECT_EQ(AllRanges(S, 36, 4), (Ranges{{0, 9}, {9, 18}, {18, 27}, {27, 36}}));
  EXPECT_EQ(AllRanges(V, 36, 4), AllRanges(S, 36, 4));
  EXPECT_EQ(AllRanges(S, 61, 8),
            (Ranges{{0, 7}, {7, 14}, {14, 21}, {21, 29}, {29, 37}, {37, 45}, {45, 53}, {53, 61}}));
  EXPECT_EQ(AllRanges(V, 61, 8),
            (Ranges{{0, 7}, {7, 14}, {14, 22}, {22, 30}, {30, 38}, {38, 46}, {46, 54}, {54, 61}}));
  EXPECT_EQ(Counts(AllRanges(S, 61, 2)), (std::vector<int64_t>{30, 31}));
  EXPECT_EQ(Counts(AllRanges(V, 61, 2)), (std::vector<int64_t>{31, 30}));
  EXPECT_EQ(Counts(AllRanges(S, 61, 4)), (std::vector<int64_t>{15, 15, 15, 16}));
  EXPECT_EQ(Counts(AllRanges(V, 61, 4)), (std::vector<int64_t>{15, 15, 16, 15}));
  EXPECT_EQ(Counts(AllRanges(S, 94, 4)), (std::vector<int64_t>{23, 23, 24, 24}));
  EXPECT_EQ(Counts(AllRanges(V, 94, 4)), (std::vector<int64_t>{23, 24, 24, 23}));
  // vLLM's own goldens (tests/distributed/test_pipeline_partition.py).
  EXPECT_EQ(AllRanges(V, 3, 2), (Ranges{{0, 2}, {2, 3}}));
  EXPECT_EQ(AllRanges(V, 4, 3), (Ranges{{0, 1}, {1, 3}, {3, 4}}));
  EXPECT_EQ(AllRanges(V, 5, 3), (Ranges{{0, 2}, {2, 4}, {4, 5}}));
}

TEST(PpPartition, ExplicitPartitionOverridesBothEngines) {
  for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
    EXPECT_EQ(AllRanges(e, 28, 3, {9, 10, 9}), (Ranges{{0, 9}, {9, 19}, {19, 28}}));
  }
  auto parsed = ParsePpPartition("9,10,9");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(*parsed, (std::vector<int64_t>{9, 10, 9}));
}

TEST(PpPartition, ShardMapStagesFollowTheEngine) {
  ModelSpec m = MustLoad("qwen2.5-7b");  // 28 layers
  for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
    ShardMap map = MustBuild(m, Spec(e, 1, 3));
    const int64_t split = e == EngineKind::kSglang ? 18 : 19;
    EXPECT_EQ(map.rank(0, 1).layer_end, split);
    EXPECT_EQ(map.rank(0, 2).layer_start, split);
    // Global layer index kept in names.
    EXPECT_EQ(map.rank(0, 2).params.front().name,
              "model.layers." + std::to_string(split) + ".input_layernorm.weight");
  }
}

struct VocabCase {
  int64_t vocab;
  int tp;
  int64_t padded, per_rank;
  int64_t last_real_start, last_real_rows, last_zero_rows;
};

TEST(Vocab, WorkedExamples) {
  const std::vector<VocabCase> cases = {
      {151936, 4, 151936, 37984, 113952, 37984, 0},
      {151936, 8, 151936, 18992, 151936 - 18992, 18992, 0},
      {128256, 8, 128256, 16032, 128256 - 16032, 16032, 0},
      {32001, 4, 32064, 8016, 24048, 7953, 63},
      {152064, 4, 152064, 38016, 3 * 38016, 38016, 0},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(PaddedVocabSize(c.vocab), c.padded);
    for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
      ModelSpec m = testing::SmallDense(8, 8, c.vocab);
      ShardMap map = MustBuild(m, Spec(e, c.tp));
      for (int r = 0; r < c.tp; ++r) {
        const EngineParam& p = MustFind(map.rank(r, 0), "model.embed_tokens.weight");
        EXPECT_EQ(p.shape, (Shape{c.per_rank, 64}));
        ASSERT_EQ(p.pieces.size(), 1u);
        EXPECT_EQ(p.pieces[0].source, "model.embed_tokens.weight");
        if (r == c.tp - 1) {
          EXPECT_EQ(p.pieces[0].src, Region::Make({c.last_real_start, 0}, {c.last_real_rows, 64}));
          EXPECT_EQ(p.pieces[0].dst, Region::Make({0, 0}, {c.last_real_rows, 64}));
          if (c.last_zero_rows > 0) {
            ASSERT_EQ(p.zero_fills.size(), 1u);
            EXPECT_EQ(p.zero_fills[0].dst,
                      Region::Make({c.last_real_rows, 0}, {c.last_zero_rows, 64}));
          } else {
            EXPECT_TRUE(p.zero_fills.empty());
          }
        } else {
          EXPECT_EQ(p.pieces[0].src, Region::Make({r * c.per_rank, 0}, {c.per_rank, 64}));
          EXPECT_TRUE(p.zero_fills.empty());
        }
      }
    }
  }
}

TEST(Vocab, RankEntirelyInPaddingIsAllZeroFill) {
  // V = 65 -> 128 padded; tp 4: 32 rows per rank, rank 3 starts at 96 > 65.
  ModelSpec m = testing::SmallDense(8, 8, 65);
  ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 4));
  const EngineParam& p2 = MustFind(map.rank(2, 0), "model.embed_tokens.weight");
  ASSERT_EQ(p2.pieces.size(), 1u);
  EXPECT_EQ(p2.pieces[0].src, Region::Make({64, 0}, {1, 64}));
  const EngineParam& p3 = MustFind(map.rank(3, 0), "model.embed_tokens.weight");
  EXPECT_TRUE(p3.pieces.empty());
  ASSERT_EQ(p3.zero_fills.size(), 1u);
  EXPECT_EQ(p3.zero_fills[0].dst, Region::Make({0, 0}, {32, 64}));
}

void ExpectQkv(const EngineParam& p, const std::string& att, int64_t H, int64_t q_rows,
               int64_t q_src, int64_t kv_rows, int64_t kv_src) {
  EXPECT_EQ(p.shape, (Shape{q_rows + 2 * kv_rows, H}));
  ASSERT_EQ(p.pieces.size(), 3u);
  EXPECT_EQ(p.pieces[0].source, att + "q_proj.weight");
  EXPECT_EQ(p.pieces[0].src, Region::Make({q_src, 0}, {q_rows, H}));
  EXPECT_EQ(p.pieces[0].dst, Region::Make({0, 0}, {q_rows, H}));
  EXPECT_EQ(p.pieces[1].source, att + "k_proj.weight");
  EXPECT_EQ(p.pieces[1].src, Region::Make({kv_src, 0}, {kv_rows, H}));
  EXPECT_EQ(p.pieces[1].dst, Region::Make({q_rows, 0}, {kv_rows, H}));
  EXPECT_EQ(p.pieces[2].source, att + "v_proj.weight");
  EXPECT_EQ(p.pieces[2].src, Region::Make({kv_src, 0}, {kv_rows, H}));
  EXPECT_EQ(p.pieces[2].dst, Region::Make({q_rows + kv_rows, 0}, {kv_rows, H}));
}

TEST(Qkv, Qwen25_7B_Tp4) {
  ModelSpec m = MustLoad("qwen2.5-7b");
  for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
    ShardMap map = MustBuild(m, Spec(e, 4));
    for (int r = 0; r < 4; ++r) {
      const std::string att = "model.layers.5.self_attn.";
      ExpectQkv(MustFind(map.rank(r, 0), att + "qkv_proj.weight"), att, 3584, 896, 896 * r, 128,
                128 * r);
      const EngineParam& b = MustFind(map.rank(r, 0), att + "qkv_proj.bias");
      EXPECT_EQ(b.shape, (Shape{1152}));
      ASSERT_EQ(b.pieces.size(), 3u);
      EXPECT_EQ(b.pieces[0].src, Region::Make({896 * r}, {896}));
      EXPECT_EQ(b.pieces[1].src, Region::Make({128 * r}, {128}));
      EXPECT_EQ(b.pieces[2].dst, Region::Make({1024}, {128}));
      // Qwen2: no o_proj bias; o_proj is row-parallel (column slice).
      EXPECT_EQ(FindParam(map.rank(r, 0), att + "o_proj.bias"), nullptr);
      const EngineParam& o = MustFind(map.rank(r, 0), att + "o_proj.weight");
      EXPECT_EQ(o.shape, (Shape{3584, 896}));
      EXPECT_EQ(o.pieces[0].src, Region::Make({0, 896 * r}, {3584, 896}));
      // gate_up and down.
      const EngineParam& gu = MustFind(map.rank(r, 0), "model.layers.5.mlp.gate_up_proj.weight");
      EXPECT_EQ(gu.shape, (Shape{2 * 4736, 3584}));
      EXPECT_EQ(gu.pieces[1].source, "model.layers.5.mlp.up_proj.weight");
      EXPECT_EQ(gu.pieces[1].src, Region::Make({4736 * r, 0}, {4736, 3584}));
      EXPECT_EQ(gu.pieces[1].dst, Region::Make({4736, 0}, {4736, 3584}));
      const EngineParam& dn = MustFind(map.rank(r, 0), "model.layers.5.mlp.down_proj.weight");
      EXPECT_EQ(dn.pieces[0].src, Region::Make({0, 4736 * r}, {3584, 4736}));
    }
  }
}

TEST(Qkv, Qwen3_8B_Tp16_ReplicatesKvHeads) {
  ModelSpec m = MustLoad("qwen3-8b");
  ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 16));
  for (int r = 0; r < 16; ++r) {
    const std::string att = "model.layers.0.self_attn.";
    ExpectQkv(MustFind(map.rank(r, 0), att + "qkv_proj.weight"), att, 4096, 256, 256 * r, 128,
              128 * (r / 2));
    EXPECT_EQ(MustFind(map.rank(r, 0), att + "q_norm.weight").shape, (Shape{128}));
    EXPECT_EQ(MustFind(map.rank(r, 0), att + "k_norm.weight").pieces[0].src,
              Region::Make({0}, {128}));
  }
}

TEST(Qkv, Qwen3_30B_A3B_Tp8) {
  ModelSpec m = MustLoad("qwen3-30b-a3b");
  ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 8));
  for (int r = 0; r < 8; ++r) {
    const std::string att = "model.layers.47.self_attn.";
    const EngineParam& p = MustFind(map.rank(r, 0), att + "qkv_proj.weight");
    EXPECT_EQ(p.shape, (Shape{768, 2048}));
    ExpectQkv(p, att, 2048, 512, 512 * r, 128, 128 * (r / 2));
  }
}

// Checks the FusedMoE params of one rank: experts [first, first + count), intermediate slice
// [mtp * ip, (mtp + 1) * ip).
void ExpectExperts(const EngineRankShards& rank, int64_t first, int64_t count, int64_t ip,
                   int64_t mtp) {
  const int64_t H = 2048;
  const std::string pre = "model.layers.3.mlp.";
  const EngineParam& gate = MustFind(rank, pre + "gate.weight");
  EXPECT_EQ(gate.shape, (Shape{128, H}));
  const EngineParam& w13 = MustFind(rank, pre + "experts.w13_weight");
  const EngineParam& w2 = MustFind(rank, pre + "experts.w2_weight");
  EXPECT_EQ(w13.shape, (Shape{count, 2 * ip, H}));
  EXPECT_EQ(w2.shape, (Shape{count, H, ip}));
  ASSERT_EQ(w13.pieces.size(), static_cast<size_t>(2 * count));
  ASSERT_EQ(w2.pieces.size(), static_cast<size_t>(count));
  for (int64_t le = 0; le < count; ++le) {
    const std::string ex = pre + "experts." + std::to_string(first + le) + ".";
    const Piece& g = w13.pieces[2 * le];
    const Piece& u = w13.pieces[2 * le + 1];
    EXPECT_EQ(g.source, ex + "gate_proj.weight");
    EXPECT_EQ(g.src, Region::Make({mtp * ip, 0}, {ip, H}));
    EXPECT_EQ(g.dst, Region::Make({le, 0, 0}, {1, ip, H}));
    EXPECT_EQ(u.source, ex + "up_proj.weight");
    EXPECT_EQ(u.src, Region::Make({mtp * ip, 0}, {ip, H}));
    EXPECT_EQ(u.dst, Region::Make({le, ip, 0}, {1, ip, H}));
    const Piece& d = w2.pieces[le];
    EXPECT_EQ(d.source, ex + "down_proj.weight");
    EXPECT_EQ(d.src, Region::Make({0, mtp * ip}, {H, ip}));
    EXPECT_EQ(d.dst, Region::Make({le, 0, 0}, {1, H, ip}));
  }
}

TEST(Moe, Qwen3_30B_A3B_Tp4Ep1) {
  ModelSpec m = MustLoad("qwen3-30b-a3b");
  for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
    ShardMap map = MustBuild(m, Spec(e, 4, 1, 1));
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(map.rank(r, 0).moe_ep_rank, 0);
      EXPECT_EQ(map.rank(r, 0).moe_tp_rank, r);
      ExpectExperts(map.rank(r, 0), 0, 128, 192, r);
    }
  }
}

TEST(Moe, Qwen3_30B_A3B_Tp4Ep4) {
  ModelSpec m = MustLoad("qwen3-30b-a3b");
  for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
    ShardMap map = MustBuild(m, Spec(e, 4, 1, 4));
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(map.rank(r, 0).moe_ep_rank, r);
      EXPECT_EQ(map.rank(r, 0).moe_tp_rank, 0);
      ExpectExperts(map.rank(r, 0), 32 * r, 32, 768, 0);
    }
  }
}

TEST(Moe, Qwen3_30B_A3B_Tp8Ep2) {
  ModelSpec m = MustLoad("qwen3-30b-a3b");
  ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 8, 1, 2));
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(map.rank(r, 0).moe_ep_rank, r / 4);
    EXPECT_EQ(map.rank(r, 0).moe_tp_rank, r % 4);
    ExpectExperts(map.rank(r, 0), 64 * (r / 4), 64, 192, r % 4);
  }
  // vLLM has no partial EP.
  auto v = BuildShardMap(m, Spec(EngineKind::kVllm, 8, 1, 2));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("--ep 2"), std::string::npos) << v.status().message();
}

TEST(Moe, DenseLayersOfAMoeModelUseTheDenseMlp) {
  ModelSpec m = MustLoad("qwen3-30b-a3b");
  m.num_hidden_layers = 4;
  m.mlp_only_layers = {0};
  m.decoder_sparse_step = 2;  // sparse: layers 1, 3 (layer 0 listed as mlp-only anyway)
  ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 2));
  const auto& r = map.rank(1, 0);
  EXPECT_NE(FindParam(r, "model.layers.0.mlp.gate_up_proj.weight"), nullptr);
  EXPECT_NE(FindParam(r, "model.layers.2.mlp.down_proj.weight"), nullptr);
  EXPECT_NE(FindParam(r, "model.layers.1.mlp.experts.w13_weight"), nullptr);
  EXPECT_EQ(FindParam(r, "model.layers.1.mlp.gate_up_proj.weight"), nullptr);
  EXPECT_EQ(MustFind(r, "model.layers.2.mlp.gate_up_proj.weight").shape, (Shape{6144, 2048}));
}

TEST(Embeddings, TiedUnderPipelineParallelPerEngine) {
  ModelSpec m = MustLoad("qwen3-0.6b");  // tied
  ASSERT_TRUE(m.tie_word_embeddings);
  const std::string embed = "model.embed_tokens.weight";
  {
    ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 2, 2));
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(FindParam(map.rank(r, 0), embed), nullptr);
      EXPECT_EQ(FindParam(map.rank(r, 0), "lm_head.weight"), nullptr);
      EXPECT_EQ(FindParam(map.rank(r, 1), embed), nullptr);
      const EngineParam& head = MustFind(map.rank(r, 1), "lm_head.weight");
      ASSERT_EQ(head.pieces.size(), 1u);
      EXPECT_EQ(head.pieces[0].source, embed);
      EXPECT_EQ(head.pieces[0].src, Region::Make({75968 * r, 0}, {75968, 1024}));
      EXPECT_EQ(map.rank(r, 1).params.back().name, "lm_head.weight");
    }
  }
  {
    ShardMap map = MustBuild(m, Spec(EngineKind::kVllm, 2, 2));
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(FindParam(map.rank(r, 0), embed), nullptr);
      EXPECT_NE(FindParam(map.rank(r, 1), embed), nullptr);
      EXPECT_EQ(FindParam(map.rank(r, 1), "lm_head.weight"), nullptr);
      EXPECT_NE(FindParam(map.rank(r, 1), "model.norm.weight"), nullptr);
      EXPECT_EQ(FindParam(map.rank(r, 0), "model.norm.weight"), nullptr);
    }
  }
  for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
    ShardMap map = MustBuild(m, Spec(e, 2, 1));
    EXPECT_NE(FindParam(map.rank(0, 0), embed), nullptr);
    EXPECT_EQ(FindParam(map.rank(0, 0), "lm_head.weight"), nullptr);
  }
}

TEST(Embeddings, UntiedLmHeadOnLastStage) {
  ModelSpec m = MustLoad("llama-3.1-8b");
  for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
    ShardMap map = MustBuild(m, Spec(e, 8, 2));
    const EngineParam& head = MustFind(map.rank(7, 1), "lm_head.weight");
    EXPECT_EQ(head.pieces[0].source, "lm_head.weight");
    EXPECT_EQ(head.pieces[0].src, Region::Make({7 * 16032, 0}, {16032, 4096}));
    EXPECT_EQ(FindParam(map.rank(7, 0), "lm_head.weight"), nullptr);
    EXPECT_EQ(FindParam(map.rank(7, 1), "model.embed_tokens.weight"), nullptr);
  }
}

TEST(Biases, LlamaAttentionBiasReplicatesOProjBias) {
  ModelSpec m = testing::SmallDense();
  m.attention_bias = true;
  ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 4));
  for (int r = 0; r < 4; ++r) {
    const EngineParam& ob = MustFind(map.rank(r, 0), "model.layers.1.self_attn.o_proj.bias");
    EXPECT_EQ(ob.shape, (Shape{64}));
    EXPECT_EQ(ob.pieces[0].src, Region::Make({0}, {64}));
    EXPECT_NE(FindParam(map.rank(r, 0), "model.layers.1.self_attn.qkv_proj.bias"), nullptr);
  }
}

TEST(ShardMap, EveryEmbeddedModelValidatesAtCommonLayouts) {
  for (const auto& name : EmbeddedModelNames()) {
    ModelSpec m = MustLoad(name);
    for (auto e : {EngineKind::kSglang, EngineKind::kVllm}) {
      for (int tp : {1, 2}) {
        for (int pp : {1, 3}) {
          auto map = BuildShardMap(m, Spec(e, tp, pp));
          ASSERT_TRUE(map.ok()) << name << ": " << map.status().ToString();
          Status st = ValidateShardMap(*map);
          EXPECT_TRUE(st.ok()) << name << ": " << st.ToString();
          // Replicated tensors counted tp times; the rest exactly once (tied: embedding twice
          // under pp > 1), plus vocab padding: bytes add up.
          int64_t elems = 0;
          for (const auto& r : map->ranks) {
            for (const auto& p : r.params) elems += p.numel();
          }
          EXPECT_GE(elems, ModelNumElements(m));
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardsync
