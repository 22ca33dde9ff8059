// ShardSpec::expert_naming: vLLM >= 0.24 keeps stacked experts on a RoutedExperts child
// ("...mlp.experts.routed_experts.w13_weight"); every other byte of the map is unchanged.
#include <gtest/gtest.h>

#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

ShardSpec Spec(EngineKind engine, ExpertNaming naming) {
  ShardSpec s;
  s.engine = engine;
  s.tp = 2;
  s.pp = 2;
  s.expert_naming = naming;
  return s;
}

TEST(ExpertNaming, RoutedRenamesOnlyTheExpertStacks) {
  auto m = LoadModelSpec("qwen3-30b-a3b");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto fused = BuildShardMap(*m, Spec(EngineKind::kVllm, ExpertNaming::kFusedMoe));
  auto routed = BuildShardMap(*m, Spec(EngineKind::kVllm, ExpertNaming::kRoutedExperts));
  ASSERT_TRUE(fused.ok()) << fused.status().ToString();
  ASSERT_TRUE(routed.ok()) << routed.status().ToString();
  ASSERT_TRUE(ValidateShardMap(*routed).ok());
  ASSERT_EQ(fused->ranks.size(), routed->ranks.size());
  int renamed = 0;
  for (size_t r = 0; r < fused->ranks.size(); ++r) {
    const auto& a = fused->ranks[r].params;
    const auto& b = routed->ranks[r].params;
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      std::string want = a[i].name;
      const auto pos = want.find(".mlp.experts.w");
      if (pos != std::string::npos) {
        want.insert(pos + std::string(".mlp.experts.").size(), "routed_experts.");
        ++renamed;
      }
      EXPECT_EQ(b[i].name, want);
      EXPECT_EQ(b[i].shape, a[i].shape) << want;
      ASSERT_EQ(b[i].pieces.size(), a[i].pieces.size()) << want;
      for (size_t k = 0; k < a[i].pieces.size(); ++k) {
        EXPECT_EQ(b[i].pieces[k].source, a[i].pieces[k].source);
      }
    }
  }
  // Two stacks (w13, w2) per MoE layer on every rank.
  EXPECT_EQ(renamed, 2 * m->num_hidden_layers * 2);
  EXPECT_NE(FindParam(routed->rank(0, 0), "model.layers.0.mlp.experts.routed_experts.w13_weight"),
            nullptr);
  EXPECT_EQ(FindParam(routed->rank(0, 0), "model.layers.0.mlp.experts.w13_weight"), nullptr);
}

TEST(ExpertNaming, SglangRefusesRoutedNaming) {
  auto m = LoadModelSpec("qwen3-30b-a3b");
  ASSERT_TRUE(m.ok());
  auto map = BuildShardMap(*m, Spec(EngineKind::kSglang, ExpertNaming::kRoutedExperts));
  ASSERT_FALSE(map.ok());
  EXPECT_NE(map.status().message().find("expert_naming 'routed_experts'"), std::string::npos)
      << map.status().ToString();
}

TEST(ExpertNaming, ParseAndName) {
  EXPECT_EQ(*ParseExpertNaming("routed_experts"), ExpertNaming::kRoutedExperts);
  EXPECT_EQ(*ParseExpertNaming("fused_moe"), ExpertNaming::kFusedMoe);
  EXPECT_EQ(ExpertNamingName(ExpertNaming::kRoutedExperts), "routed_experts");
  auto bad = ParseExpertNaming("routed", "--expert-naming");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--expert-naming: unknown expert naming 'routed'"),
            std::string::npos);
}

}  // namespace
}  // namespace shardsync
