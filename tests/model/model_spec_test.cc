#include <gtest/gtest.h>

#include <string>

#include "shardsync/model.h"

namespace shardsync {
namespace {

TEST(ModelSpec, EmbeddedQwen3MoeDimensions) {
  auto s = LoadModelSpec("qwen3-30b-a3b");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->arch, Architecture::kQwen3Moe);
  EXPECT_EQ(s->hidden_size, 2048);
  EXPECT_EQ(s->num_attention_heads, 32);
  EXPECT_EQ(s->num_key_value_heads, 4);
  EXPECT_EQ(s->head_dim, 128);
  EXPECT_EQ(s->num_hidden_layers, 48);
  EXPECT_EQ(s->num_experts, 128);
  EXPECT_EQ(s->moe_intermediate_size, 768);
  EXPECT_EQ(s->num_experts_per_tok, 8);
  EXPECT_TRUE(s->norm_topk_prob);
  EXPECT_TRUE(s->qk_norm);
  EXPECT_FALSE(s->tie_word_embeddings);
  EXPECT_EQ(s->dtype, DType::kBF16);
  EXPECT_TRUE(s->IsMoeLayer(0));
  EXPECT_TRUE(s->IsMoeLayer(47));
}

TEST(ModelSpec, InventoryOrderAndShapes) {
  auto s = LoadModelSpec("qwen2.5-0.5b");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto inv = HfTensorInventory(*s);
  ASSERT_GE(inv.size(), 3u);
  EXPECT_EQ(inv[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(inv[0].shape, (Shape{151936, 896}));
  EXPECT_EQ(inv[1].name, "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(inv[2].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(inv[3].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(inv[4].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(inv[4].shape, (Shape{128, 896}));
  EXPECT_EQ(inv.back().name, "model.norm.weight");  // tied: no lm_head
  // 24 layers x 12 tensors + embed + norm.
  EXPECT_EQ(inv.size(), 24u * 12 + 2);
  // Qwen2.5-0.5B has ~494M parameters.
  EXPECT_EQ(ModelNumElements(*s), 494032768);
}

}  // namespace
}  // namespace shardsync
