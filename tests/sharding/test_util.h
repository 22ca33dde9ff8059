// Helpers shared by the sharding tests.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "shardsync/shard_map.h"

namespace shardsync::testing {

// A small dense Llama-like spec; callers override what a test needs.
inline ModelSpec SmallDense(int64_t heads = 8, int64_t kv = 8, int64_t vocab = 256) {
  ModelSpec m;
  m.name = "small";
  m.arch = Architecture::kLlama;
  m.hidden_size = 64;
  m.num_attention_heads = heads;
  m.num_key_value_heads = kv;
  m.head_dim = 8;
  m.num_hidden_layers = 4;
  m.intermediate_size = 96;
  m.vocab_size = vocab;
  return m;
}

inline ShardSpec Spec(EngineKind e, int tp, int pp = 1, int ep = 1) {
  ShardSpec s;
  s.engine = e;
  s.tp = tp;
  s.pp = pp;
  s.ep = ep;
  return s;
}

inline ShardMap MustBuild(const ModelSpec& m, const ShardSpec& s) {
  auto r = BuildShardMap(m, s);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return ShardMap{};
  Status v = ValidateShardMap(*r);
  EXPECT_TRUE(v.ok()) << v.ToString();
  return *std::move(r);
}

inline ModelSpec MustLoad(const std::string& name) {
  auto r = LoadModelSpec(name);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : ModelSpec{};
}

inline const EngineParam& MustFind(const EngineRankShards& r, const std::string& name) {
  const EngineParam* p = FindParam(r, name);
  EXPECT_NE(p, nullptr) << "no param " << name << " on tp " << r.tp_rank << " pp " << r.pp_rank;
  static const EngineParam kEmpty;
  return p ? *p : kEmpty;
}

}  // namespace shardsync::testing
