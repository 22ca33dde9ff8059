// Every divisibility the engines assert, and every bad layout input, is rejected up front with
// InvalidArgument naming the flag and the field.
#include <gtest/gtest.h>

#include <string>

#include "sharding/test_util.h"
#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

using testing::MustLoad;
using testing::Spec;

void ExpectRejected(const ModelSpec& m, const ShardSpec& s,
                    std::initializer_list<const char*> words) {
  auto r = BuildShardMap(m, s);
  ASSERT_FALSE(r.ok()) << "accepted tp " << s.tp << " pp " << s.pp << " ep " << s.ep;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  for (const char* w : words) {
    EXPECT_NE(r.status().message().find(w), std::string::npos)
        << "'" << w << "' not in: " << r.status().message();
  }
}

TEST(Rejections, HeadsNotDivisibleByTp) {
  ExpectRejected(MustLoad("qwen2.5-7b"), Spec(EngineKind::kSglang, 3),
                 {"--tp 3", "num_attention_heads 28 is not divisible by tp"});
  ExpectRejected(MustLoad("qwen2.5-7b"), Spec(EngineKind::kVllm, 8),
                 {"--tp 8", "num_attention_heads"});
}

TEST(Rejections, KvHeads) {
  // tp < kv heads: kv heads must divide.
  ExpectRejected(testing::SmallDense(12, 6), Spec(EngineKind::kSglang, 4),
                 {"--tp 4", "num_key_value_heads 6 is not divisible by tp"});
  // tp > kv heads: tp must be a multiple.
  ExpectRejected(testing::SmallDense(24, 4), Spec(EngineKind::kVllm, 6),
                 {"--tp 6", "not a multiple of num_key_value_heads 4"});
}

TEST(Rejections, PaddedVocab) {
  ModelSpec m = testing::SmallDense(24, 3, 151936);
  m.intermediate_size = 96;
  ExpectRejected(m, Spec(EngineKind::kSglang, 3), {"--tp 3", "padded vocab 151936"});
}

TEST(Rejections, IntermediateSize) {
  ModelSpec m = testing::SmallDense(8, 8);
  m.intermediate_size = 100;
  ExpectRejected(m, Spec(EngineKind::kVllm, 8), {"--tp 8", "intermediate_size 100"});
}

TEST(Rejections, Moe) {
  ModelSpec m = MustLoad("qwen3-30b-a3b");
  ExpectRejected(m, Spec(EngineKind::kSglang, 4, 1, 3), {"--ep 3", "tp 4 is not divisible by ep"});
  ExpectRejected(m, Spec(EngineKind::kVllm, 4, 1, 2), {"--ep 2", "ep == tp"});
  ModelSpec small = m;
  small.num_experts = 6;
  small.num_experts_per_tok = 2;
  ExpectRejected(small, Spec(EngineKind::kSglang, 4, 1, 4), {"--ep 4", "num_experts 6"});
  ExpectRejected(small, Spec(EngineKind::kVllm, 4, 1, 4), {"--ep 4", "num_experts 6"});
  ExpectRejected(small, Spec(EngineKind::kSglang, 8), {"--tp 8", "num_experts 6"});
  ModelSpec odd = m;
  odd.moe_intermediate_size = 100;
  ExpectRejected(odd, Spec(EngineKind::kSglang, 8, 1, 1), {"--ep 1", "moe_intermediate_size 100"});
  // Expert parallelism on a dense model.
  ExpectRejected(MustLoad("qwen3-8b"), Spec(EngineKind::kSglang, 2, 1, 2),
                 {"--ep 2", "no experts"});
}

TEST(Rejections, PipelineAndSizes) {
  ModelSpec m = testing::SmallDense();  // 4 layers
  ExpectRejected(m, Spec(EngineKind::kSglang, 1, 5), {"--pp 5", "num_hidden_layers 4"});
  ExpectRejected(m, Spec(EngineKind::kSglang, 0), {"--tp"});
  ExpectRejected(m, Spec(EngineKind::kSglang, 1, 0), {"--pp"});
  ExpectRejected(m, Spec(EngineKind::kSglang, 1, 1, 0), {"--ep"});
  ShardSpec s = Spec(EngineKind::kVllm, 1, 2);
  s.pp_partition = {1, 2};
  ExpectRejected(m, s, {"--pp-partition", "sum to 3", "num_hidden_layers is 4"});
  s.pp_partition = {4};
  ExpectRejected(m, s, {"--pp-partition", "1 entries"});
  s.pp_partition = {5, -1};
  ExpectRejected(m, s, {"--pp-partition", "entry 0"});
  s.pp_partition = {4, 0};  // an empty stage
  ExpectRejected(m, s, {"--pp-partition", "entry 1 is 0"});
}

TEST(Rejections, ParsePpPartition) {
  for (const char* bad : {"", "9,,9", "a,b", "9;10", "-1,5", "1.5,2", "9,0"}) {
    auto r = ParsePpPartition(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.status().message().find("--pp-partition"), std::string::npos);
    }
  }
}

TEST(Rejections, EngineName) {
  auto e = ParseEngineKind("trtllm");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--engine"), std::string::npos);
  EXPECT_EQ(*ParseEngineKind("vllm"), EngineKind::kVllm);
}

// The validator must catch a broken map: overlap, gap, out-of-range source, unknown source.
TEST(Validate, CatchesCorruption) {
  ModelSpec m = MustLoad("qwen2.5-0.5b");
  auto good = BuildShardMap(m, Spec(EngineKind::kSglang, 2));
  ASSERT_TRUE(good.ok());
  ASSERT_TRUE(ValidateShardMap(*good).ok());
  auto find = [](ShardMap& map, const char* name) {
    for (auto& p : map.ranks[1].params) {
      if (p.name == name) return &p;
    }
    return static_cast<EngineParam*>(nullptr);
  };
  const char* qkv = "model.layers.3.self_attn.qkv_proj.weight";
  {
    ShardMap map = *good;
    EngineParam* p = find(map, qkv);
    p->pieces[1].dst.offset[0] -= 1;  // overlaps q, leaves a gap at the end of k
    Status st = ValidateShardMap(map);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find(qkv), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("overlap"), std::string::npos) << st.message();
  }
  {
    ShardMap map = *good;
    find(map, qkv)->pieces.pop_back();
    Status st = ValidateShardMap(map);
    EXPECT_NE(st.message().find("gap"), std::string::npos) << st.message();
  }
  {
    ShardMap map = *good;
    EngineParam* p = find(map, qkv);
    p->pieces[0].src.offset[0] = 10000;  // outside q_proj [896, 896]
    Status st = ValidateShardMap(map);
    EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.ToString();
  }
  {
    ShardMap map = *good;
    find(map, qkv)->pieces[0].source = "model.layers.3.self_attn.nope.weight";
    EXPECT_EQ(ValidateShardMap(map).code(), StatusCode::kNotFound);
  }
  {
    ShardMap map = *good;
    EngineParam* p = find(map, qkv);
    p->pieces[0].src.extent[1] -= 1;  // element counts differ
    EXPECT_FALSE(ValidateShardMap(map).ok());
  }
  {
    ShardMap map = *good;
    std::swap(map.ranks[0], map.ranks[1]);
    EXPECT_FALSE(ValidateShardMap(map).ok());
  }
  {
    ShardMap map = *good;
    map.ranks[1].params.push_back(map.ranks[1].params.front());
    EXPECT_NE(ValidateShardMap(map).message().find("appears twice"), std::string::npos);
  }
}

TEST(Validate, CatchesWrongStageLayers) {
  ModelSpec m = MustLoad("qwen2.5-0.5b");  // 24 layers
  auto good = BuildShardMap(m, Spec(EngineKind::kVllm, 2, 3));
  ASSERT_TRUE(good.ok());
  ASSERT_TRUE(ValidateShardMap(*good).ok());
  {
    ShardMap map = *good;
    map.ranks[3].layer_end -= 1;  // (tp 1, pp 1) disagrees with tp 0 of the stage
    EXPECT_FALSE(ValidateShardMap(map).ok());
  }
  {
    ShardMap map = *good;
    for (int t = 0; t < 2; ++t) map.ranks[2 + t].layer_start += 1;  // layer 8 unowned
    Status st = ValidateShardMap(map);
    EXPECT_NE(st.message().find("do not continue"), std::string::npos) << st.message();
  }
  {
    ShardMap map = *good;
    // A layer-0 param on stage 1.
    map.ranks[2].params.push_back(map.ranks[0].params[1]);
    Status st = ValidateShardMap(map);
    EXPECT_NE(st.message().find("belongs to layer 0"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace shardsync
