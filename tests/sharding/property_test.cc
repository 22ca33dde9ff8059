// Property test over random small configs and layouts: every accepted shard map is an exact cover
// (checked element by element, independently of ValidateShardMap's region algebra), and summed over
// a replica's ranks every HF element is owned by exactly the expected number of ranks.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "sharding/test_util.h"
#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

template <typename T>
T Pick(std::mt19937& rng, const std::vector<T>& v) {
  return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
}

int64_t Uniform(std::mt19937& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

ModelSpec RandomModel(std::mt19937& rng) {
  ModelSpec m;
  m.name = "random";
  m.arch = Pick(rng, std::vector<Architecture>{Architecture::kLlama, Architecture::kMistral,
                                               Architecture::kQwen2, Architecture::kQwen3,
                                               Architecture::kQwen3Moe});
  m.num_attention_heads = Pick(rng, std::vector<int64_t>{1, 2, 3, 4, 6, 8, 12});
  std::vector<int64_t> kv_choices;
  for (int64_t k = 1; k <= m.num_attention_heads; ++k) {
    if (m.num_attention_heads % k == 0) kv_choices.push_back(k);
  }
  m.num_key_value_heads = Pick(rng, kv_choices);
  m.head_dim = Pick(rng, std::vector<int64_t>{1, 2, 4});
  m.hidden_size = Pick(rng, std::vector<int64_t>{4, 6, 8, 12});
  m.num_hidden_layers = Uniform(rng, 1, 6);
  m.intermediate_size = Pick(rng, std::vector<int64_t>{4, 6, 8, 12, 24});
  m.vocab_size = Uniform(rng, 1, 300);
  m.tie_word_embeddings = Uniform(rng, 0, 1) == 1;
  m.qkv_bias = m.arch == Architecture::kQwen2;
  m.attention_bias = (m.arch == Architecture::kLlama || m.arch == Architecture::kMistral) &&
                     Uniform(rng, 0, 1) == 1;
  m.qk_norm = m.arch == Architecture::kQwen3 || m.arch == Architecture::kQwen3Moe;
  if (m.arch == Architecture::kQwen3Moe) {
    m.num_experts = Pick(rng, std::vector<int64_t>{1, 2, 4, 6, 8, 12});
    m.moe_intermediate_size = Pick(rng, std::vector<int64_t>{2, 4, 6, 8, 12});
    m.num_experts_per_tok = Uniform(rng, 1, m.num_experts);
    m.decoder_sparse_step = Uniform(rng, 1, 2);
    for (int64_t l = 0; l < m.num_hidden_layers; ++l) {
      if (Uniform(rng, 0, 3) == 0) m.mlp_only_layers.push_back(l);
    }
  }
  return m;
}

ShardSpec RandomSpec(std::mt19937& rng, const ModelSpec& m) {
  ShardSpec s;
  s.engine = Uniform(rng, 0, 1) ? EngineKind::kSglang : EngineKind::kVllm;
  s.tp = static_cast<int>(Pick(rng, std::vector<int64_t>{1, 2, 3, 4, 6, 8}));
  s.pp = static_cast<int>(Uniform(rng, 1, std::min<int64_t>(4, m.num_hidden_layers)));
  if (m.is_moe()) {
    std::vector<int64_t> eps;
    for (int e = 1; e <= s.tp; ++e) {
      if (s.tp % e == 0) eps.push_back(e);
    }
    s.ep = static_cast<int>(s.engine == EngineKind::kVllm ? Pick(rng, std::vector<int64_t>{1, s.tp})
                                                          : Pick(rng, eps));
  }
  if (Uniform(rng, 0, 4) == 0) {
    // An explicit partition: random non-negative counts summing to the layer count.
    std::vector<int64_t> part(s.pp, 0);
    for (int64_t l = 0; l < m.num_hidden_layers; ++l) part[Uniform(rng, 0, s.pp - 1)]++;
    s.pp_partition = part;
  }
  return s;
}

// Expected owners of each element of an HF tensor across one replica.
int64_t ExpectedOwners(const std::string& name, const ModelSpec& m, const ShardSpec& s) {
  auto ends_with = [&](const char* suffix) {
    const std::string x(suffix);
    return name.size() >= x.size() && name.compare(name.size() - x.size(), x.size(), x) == 0;
  };
  if (name == "model.embed_tokens.weight") return (m.tie_word_embeddings && s.pp > 1) ? 2 : 1;
  if (ends_with("layernorm.weight") || ends_with("q_norm.weight") || ends_with("k_norm.weight") ||
      name == "model.norm.weight" || ends_with("o_proj.bias") || ends_with("mlp.gate.weight")) {
    return s.tp;
  }
  if (ends_with("k_proj.weight") || ends_with("v_proj.weight") || ends_with("k_proj.bias") ||
      ends_with("v_proj.bias")) {
    return s.tp >= m.num_key_value_heads ? s.tp / m.num_key_value_heads : 1;
  }
  return 1;
}

TEST(ShardMapProperty, ExactCoverAndOwnershipOverRandomConfigs) {
  std::mt19937 rng(20260529);
  int accepted = 0, accepted_moe = 0, accepted_tied_pp = 0, rejected = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    const ModelSpec m = RandomModel(rng);
    ASSERT_TRUE(ValidateModelSpec(m).ok()) << ValidateModelSpec(m).ToString();
    const ShardSpec s = RandomSpec(rng, m);
    auto built = BuildShardMap(m, s);
    if (!built.ok()) {
      EXPECT_EQ(built.status().code(), StatusCode::kInvalidArgument) << built.status().ToString();
      EXPECT_EQ(built.status().message().rfind("--", 0), 0u) << built.status().message();
      ++rejected;
      continue;
    }
    ++accepted;
    accepted_moe += m.is_moe() ? 1 : 0;
    accepted_tied_pp += (m.tie_word_embeddings && s.pp > 1) ? 1 : 0;
    const ShardMap& map = *built;
    const std::string ctx = "iter " + std::to_string(iter) + " tp " + std::to_string(s.tp) +
                            " pp " + std::to_string(s.pp) + " ep " + std::to_string(s.ep) + " " +
                            std::string(EngineKindName(s.engine));
    Status v = ValidateShardMap(map);
    ASSERT_TRUE(v.ok()) << ctx << ": " << v.ToString();

    std::map<std::string, std::vector<int>> owners;
    std::map<std::string, Shape> shapes;
    for (const auto& t : HfTensorInventory(m)) {
      owners[t.name].assign(static_cast<size_t>(t.numel()), 0);
      shapes[t.name] = t.shape;
    }
    std::map<std::string, size_t> inventory_index;
    for (const auto& t : HfTensorInventory(m))
      inventory_index.emplace(t.name, inventory_index.size());
    int64_t layers_seen = 0;
    for (const auto& rank : map.ranks) {
      if (rank.tp_rank == 0) layers_seen += rank.layer_end - rank.layer_start;
      // Order: HF inventory order of the first source (lm_head last, whatever it is filled from).
      size_t prev = 0;
      for (const auto& p : rank.params) {
        if (p.pieces.empty() || p.name == "lm_head.weight") continue;
        const size_t idx = inventory_index.at(p.pieces.front().source);
        EXPECT_GE(idx, prev) << ctx << " " << p.name;
        prev = idx;
      }
      if (!rank.params.empty() && FindParam(rank, "lm_head.weight") != nullptr) {
        EXPECT_EQ(rank.params.back().name, "lm_head.weight") << ctx;
      }
      for (const auto& p : rank.params) {
        if (auto l = LayerIndexOf(p.name)) {
          EXPECT_GE(*l, rank.layer_start) << ctx << " " << p.name;
          EXPECT_LT(*l, rank.layer_end) << ctx << " " << p.name;
        }
        // Destination: every element written exactly once (element by element).
        std::vector<int> hits(static_cast<size_t>(p.numel()), 0);
        auto mark = [&](const Region& r) {
          ForEachRun(r, p.shape, [&](int64_t off, int64_t n) {
            for (int64_t i = 0; i < n; ++i) hits[off + i]++;
          });
        };
        for (const auto& pc : p.pieces) {
          mark(pc.dst);
          auto& o = owners.at(pc.source);
          ForEachRun(pc.src, shapes.at(pc.source), [&](int64_t off, int64_t n) {
            for (int64_t i = 0; i < n; ++i) o[off + i]++;
          });
        }
        for (const auto& z : p.zero_fills) mark(z.dst);
        for (size_t i = 0; i < hits.size(); ++i) {
          ASSERT_EQ(hits[i], 1) << ctx << " " << p.name << " element " << i;
        }
      }
    }
    EXPECT_EQ(layers_seen, m.num_hidden_layers) << ctx;
    for (const auto& [name, counts] : owners) {
      const int64_t want = ExpectedOwners(name, m, s);
      for (size_t i = 0; i < counts.size(); ++i) {
        ASSERT_EQ(counts[i], want) << ctx << " " << name << " element " << i;
      }
    }
  }
  // The generator must exercise the interesting cases, not only rejections.
  EXPECT_GT(accepted, 300);
  EXPECT_GT(accepted_moe, 50);
  EXPECT_GT(accepted_tied_pp, 50);
  EXPECT_GT(rejected, 50);
}

}  // namespace
}  // namespace shardsync
