#include <gtest/gtest.h>

#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

TEST(ShardMapBasic, DenseAndMoeValidate) {
  for (const char* name : {"qwen2.5-7b", "qwen3-30b-a3b", "llama-3.1-8b", "qwen3-0.6b"}) {
    auto m = LoadModelSpec(name);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    for (auto engine : {EngineKind::kSglang, EngineKind::kVllm}) {
      ShardSpec spec;
      spec.engine = engine;
      spec.tp = 4;
      spec.pp = 2;
      auto map = BuildShardMap(*m, spec);
      ASSERT_TRUE(map.ok()) << name << ": " << map.status().ToString();
      Status st = ValidateShardMap(*map);
      EXPECT_TRUE(st.ok()) << name << ": " << st.ToString();
    }
  }
}

}  // namespace
}  // namespace shardsync
