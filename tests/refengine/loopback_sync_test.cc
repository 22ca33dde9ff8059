// End to end: trainer ranks (FSDP shards of synthetic weights) sync into engine ranks over the
// in-process loopback transport, one thread per sync rank; the sharded forward then runs on the
// buffers the receivers filled and must generate what the unsharded trainer model generates.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "shardsync/plan.h"
#include "shardsync/refengine.h"
#include "shardsync/session.h"
#include "shardsync/store.h"
#include "shardsync/transport.h"

namespace shardsync {
namespace {

ModelSpec Parse(const std::string& json) {
  auto s = ParseModelConfig(json, "loopback-test-config");
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : ModelSpec{};
}

// Syncs `spec` from `trainer` into one engine replica of `shard`, returns the engine buffers in
// ShardMap::ranks order.
std::vector<EngineBuffers> SyncOverLoopback(const ModelSpec& spec, const std::string& trainer,
                                            const ShardSpec& shard, const WeightSource& weights) {
  PlanInputs in;
  in.model = spec;
  auto t = ParseTrainerSpec(trainer);
  EXPECT_TRUE(t.ok());
  in.trainer = *t;
  in.rollout.dp = 1;
  in.rollout.shard = shard;
  in.options.wire_dtype = DType::kBF16;
  in.options.bucket_bytes = 16 << 10;  // many buckets
  in.trainer_dtype = DType::kF32;

  auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  if (!server.ok()) return {};
  auto hub = NewLoopbackHub();
  const int world = SyncWorldSize(in);
  const int trainers = in.trainer.world();
  std::vector<std::unique_ptr<StoreClient>> stores(world);
  std::vector<std::unique_ptr<Transport>> txs(world);
  std::vector<std::unique_ptr<SyncSession>> sessions(world);
  std::vector<std::vector<std::vector<float>>> sources(world);
  std::vector<EngineBuffers> received(world - trainers);
  for (int r = 0; r < world; ++r) {
    auto c = StoreClient::Connect((*server)->address(), "test-token-0123456789", Millis(5000));
    EXPECT_TRUE(c.ok());
    if (!c.ok()) return {};
    stores[r] = std::move(c).value();
    txs[r] = NewLoopbackTransport(hub);
    SessionOptions o;
    o.connect_timeout = Millis(10000);
    o.sync_timeout = Millis(10000);
    auto s = SyncSession::Create(in, r, *stores[r], *txs[r], o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return {};
    sessions[r] = std::move(s).value();
    if (r < trainers) {
      // The trainer holds its FSDP region of every HF tensor, in fp32 (bf16-exact values).
      for (const HfTensor& h : HfTensorInventory(spec)) {
        const Region held = TrainerHeldRegion(in.trainer, r, h.shape);
        if (held.empty()) continue;
        sources[r].emplace_back(held.numel());
        EXPECT_TRUE(weights.Read(h.name, held, DType::kF32, sources[r].back().data()).ok());
        EXPECT_TRUE(
            sessions[r]->BindSource({h.name, sources[r].back().data(), DType::kF32, held}).ok());
      }
    } else {
      // Engine parameters start as garbage: every byte the forward reads must have been synced.
      EngineBuffers& bufs = received[r - trainers];
      for (const EngineParam& p : sessions[r]->ExpectedParams()) {
        HostTensor& h = bufs[p.name];
        h.dtype = DType::kBF16;
        h.shape = p.shape;
        h.data.assign(p.numel() * 2, 0x7f);
        EXPECT_TRUE(sessions[r]->BindDest({p.name, h.data.data(), DType::kBF16, p.shape}).ok());
      }
    }
  }
  auto all = [&](auto fn) {
    std::vector<Status> st(world);
    std::vector<std::thread> ts;
    for (int r = 0; r < world; ++r) ts.emplace_back([&, r] { st[r] = fn(r); });
    for (auto& th : ts) th.join();
    for (int r = 0; r < world; ++r)
      EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
  };
  all([&](int r) { return sessions[r]->Connect(); });
  all([&](int r) { return sessions[r]->Sync(1).status(); });
  // Sync world order of one replica (pp * tp + tp_rank) is ShardMap::ranks order.
  return received;
}

void ExpectGenerationAfterSync(const std::string& config, const std::string& trainer,
                               const ShardSpec& shard) {
  const ModelSpec spec = Parse(config);
  SyntheticWeightSource weights(spec, 11);
  auto map = BuildShardMap(spec, shard);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  std::vector<EngineBuffers> received = SyncOverLoopback(spec, trainer, shard, weights);
  ASSERT_EQ(received.size(), map->ranks.size());
  auto c = CheckGeneration(*map, received, weights, DefaultPrompt(), 6);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->match) << "max diff " << c->max_logit_diff << " tol " << c->tolerance;
  EXPECT_EQ(c->reference_tokens, c->engine_tokens);
}

TEST(LoopbackSyncGeneration, Qwen2TiedUnevenFsdpIntoTp2Pp3) {
  ExpectGenerationAfterSync(
      R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":64,"num_attention_heads":4,)"
      R"("num_key_value_heads":2,"num_hidden_layers":4,"intermediate_size":128,)"
      R"("vocab_size":200,"tie_word_embeddings":true,"rms_norm_eps":1e-6,"rope_theta":10000.0,)"
      R"("torch_dtype":"bfloat16"})",
      "fsdp=3", ShardSpec{EngineKind::kSglang, 2, 3, 1, {}});
}

TEST(LoopbackSyncGeneration, Qwen3MoeIntoTp4Ep2) {
  ExpectGenerationAfterSync(
      R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,"num_attention_heads":4,)"
      R"("num_key_value_heads":2,"head_dim":16,"num_hidden_layers":3,"intermediate_size":128,)"
      R"("vocab_size":200,"tie_word_embeddings":false,"rms_norm_eps":1e-6,"rope_theta":10000.0,)"
      R"("num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":32,)"
      R"("norm_topk_prob":true,"decoder_sparse_step":1,"mlp_only_layers":[1],)"
      R"("torch_dtype":"bfloat16"})",
      "fsdp=2", ShardSpec{EngineKind::kSglang, 4, 1, 2, {}});
}

TEST(LoopbackSyncGeneration, LlamaIntoVllmTp2Pp2) {
  ExpectGenerationAfterSync(
      R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,"num_attention_heads":4,)"
      R"("num_key_value_heads":2,"num_hidden_layers":3,"intermediate_size":128,)"
      R"("vocab_size":200,"tie_word_embeddings":false,"rms_norm_eps":1e-6,"rope_theta":10000.0,)"
      R"("torch_dtype":"bfloat16"})",
      "fsdp=2", ShardSpec{EngineKind::kVllm, 2, 2, 1, {}});
}

}  // namespace
}  // namespace shardsync
