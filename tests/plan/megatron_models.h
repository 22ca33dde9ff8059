// Small models with the real configs' structure (architecture, qk-norm, tying, MoE flags) for the
// Megatron tests: the plan's round trip (tests/plan) and the sessions' (tests/sync).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "shardsync/model.h"

namespace shardsync::testing {

inline ModelSpec ShrunkModel(const std::string& name, int64_t heads, int64_t kv, int64_t head_dim,
                             int64_t vocab) {
  ModelSpec m = LoadModelSpec(name).value();
  m.hidden_size = 32;
  m.num_attention_heads = heads;
  m.num_key_value_heads = kv;
  m.head_dim = head_dim;  // heads*head_dim != hidden: o_proj and qkv widths differ from hidden
  m.num_hidden_layers = 8;
  m.intermediate_size = 48;
  m.vocab_size = vocab;  // not a multiple of 64: both sides pad
  if (m.is_moe()) {
    m.num_experts = 8;
    m.num_experts_per_tok = 2;
    m.moe_intermediate_size = 16;
    m.mlp_only_layers = {1};  // one dense layer among the MoE ones
  }
  EXPECT_TRUE(ValidateModelSpec(m).ok()) << name;
  return m;
}

inline ModelSpec SmallQwen3_8B() { return ShrunkModel("qwen3-8b", 8, 4, 8, 203); }
inline ModelSpec SmallLlama31_8B() { return ShrunkModel("llama-3.1-8b", 8, 2, 4, 190); }
inline ModelSpec SmallQwen3_30B_A3B() { return ShrunkModel("qwen3-30b-a3b", 8, 2, 4, 150); }
inline ModelSpec SmallQwen3_06B_Tied() { return ShrunkModel("qwen3-0.6b", 8, 4, 4, 170); }

}  // namespace shardsync::testing
