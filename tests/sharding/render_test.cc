// The renderings behind `shardsync shards`: JSON schema (docs/cli.md), table rows, explanations.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "sharding/test_util.h"
#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

using testing::MustBuild;
using testing::MustLoad;
using testing::Spec;

TEST(Render, JsonFollowsTheDocumentedSchema) {
  // V = 32001 pads to 32064: the last rank has zero-fill rows.
  ModelSpec m = testing::SmallDense(8, 2, 32001);
  m.tie_word_embeddings = true;
  ShardMap map = MustBuild(m, Spec(EngineKind::kSglang, 4, 2));
  auto j = nlohmann::json::parse(ShardMapToJson(map, AllRanks(map)));
  EXPECT_EQ(j["engine"], "sglang");
  EXPECT_EQ(j["tp"], 4);
  EXPECT_EQ(j["pp"], 2);
  EXPECT_EQ(j["ep"], 1);
  ASSERT_EQ(j["ranks"].size(), 8u);
  const auto& last = j["ranks"][7];
  EXPECT_EQ(last["tp_rank"], 3);
  EXPECT_EQ(last["pp_rank"], 1);
  EXPECT_EQ(last["layers"], nlohmann::json::array({2, 4}));
  const auto& head = last["params"].back();
  EXPECT_EQ(head["name"], "lm_head.weight");
  EXPECT_EQ(head["shape"], nlohmann::json::array({8016, 64}));
  EXPECT_EQ(head["dtype"], "bfloat16");
  ASSERT_EQ(head["pieces"].size(), 1u);
  EXPECT_EQ(head["pieces"][0]["source"], "model.embed_tokens.weight");
  EXPECT_EQ(head["pieces"][0]["src_offset"], nlohmann::json::array({24048, 0}));
  EXPECT_EQ(head["pieces"][0]["dst_offset"], nlohmann::json::array({0, 0}));
  EXPECT_EQ(head["pieces"][0]["extent"], nlohmann::json::array({7953, 64}));
  ASSERT_EQ(head["zero_fill"].size(), 1u);
  EXPECT_EQ(head["zero_fill"][0]["offset"], nlohmann::json::array({7953, 0}));
  EXPECT_EQ(head["zero_fill"][0]["extent"], nlohmann::json::array({63, 64}));
  // A single selected rank.
  auto one = nlohmann::json::parse(ShardMapToJson(map, {&map.rank(1, 0)}));
  ASSERT_EQ(one["ranks"].size(), 1u);
  EXPECT_EQ(one["ranks"][0]["tp_rank"], 1);
}

TEST(Render, JsonExpertExtentsHaveTheDestinationRank) {
  ShardMap map = MustBuild(MustLoad("qwen3-30b-a3b"), Spec(EngineKind::kSglang, 4, 2, 2));
  auto j = nlohmann::json::parse(ShardMapToJson(map, {&map.rank(3, 1)}));
  const auto& r = j["ranks"][0];
  EXPECT_EQ(r["moe_ep_rank"], 1);
  EXPECT_EQ(r["moe_tp_rank"], 1);
  bool found = false;
  for (const auto& p : r["params"]) {
    if (p["name"] != "model.layers.30.mlp.experts.w13_weight") continue;
    found = true;
    EXPECT_EQ(p["shape"], nlohmann::json::array({64, 768, 2048}));
    const auto& up0 = p["pieces"][1];
    EXPECT_EQ(up0["source"], "model.layers.30.mlp.experts.64.up_proj.weight");
    EXPECT_EQ(up0["src_offset"], nlohmann::json::array({384, 0}));
    EXPECT_EQ(up0["dst_offset"], nlohmann::json::array({0, 384, 0}));
    EXPECT_EQ(up0["extent"], nlohmann::json::array({1, 384, 2048}));
  }
  EXPECT_TRUE(found);
}

TEST(Render, TableHasOneRowPerRank) {
  ShardMap map = MustBuild(MustLoad("qwen3-30b-a3b"), Spec(EngineKind::kSglang, 4, 2, 2));
  const std::string t = ShardMapToTable(map, AllRanks(map));
  EXPECT_NE(t.find("qwen3-30b-a3b"), std::string::npos);
  EXPECT_NE(t.find("moe_tp 2, 64 of 128 experts per rank"), std::string::npos) << t;
  EXPECT_NE(t.find("[24, 48)"), std::string::npos);
  int rows = 0;
  for (size_t p = t.find("%\n"); p != std::string::npos; p = t.find("%\n", p + 1)) ++rows;
  EXPECT_EQ(rows, 8) << t;
}

TEST(Render, ExplainParamAndHfTensor) {
  ShardMap map = MustBuild(MustLoad("qwen2.5-7b"), Spec(EngineKind::kVllm, 4));
  auto e = ExplainParamOnRanks(map, {&map.rank(1, 0)}, "model.layers.3.self_attn.qkv_proj.weight");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_NE(e->find("[0:896, 0:3584] <- model.layers.3.self_attn.q_proj.weight[896:1792, 0:3584]"),
            std::string::npos)
      << *e;
  EXPECT_NE(e->find("[1024:1152, 0:3584] <- model.layers.3.self_attn.v_proj.weight[128:256"),
            std::string::npos)
      << *e;
  auto all = ExplainParamOnRanks(map, AllRanks(map), "model.norm.weight");
  ASSERT_TRUE(all.ok());
  EXPECT_NE(all->find("rank (tp 3, pp 0)"), std::string::npos);
  auto hf = ExplainParamOnRanks(map, AllRanks(map), "model.layers.0.self_attn.k_proj.weight");
  ASSERT_TRUE(hf.ok());
  EXPECT_NE(hf->find("is an HF tensor"), std::string::npos);
  auto missing = ExplainParamOnRanks(map, AllRanks(map), "nope");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  // Zero-filled padding is explained too.
  ShardMap padded = MustBuild(testing::SmallDense(8, 8, 32001), Spec(EngineKind::kSglang, 4));
  auto z = ExplainParamOnRanks(padded, {&padded.rank(3, 0)}, "model.embed_tokens.weight");
  ASSERT_TRUE(z.ok());
  EXPECT_NE(z->find("[7953:8016, 0:64] <- zeros"), std::string::npos) << *z;
}

}  // namespace
}  // namespace shardsync
