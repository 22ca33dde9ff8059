// The reference engine on block-FP8 parameters: the sharded forward dequantizes e4m3 weights with
// their weight_scale_inv, the unsharded reference runs the same quantized weights, and generation
// matches; scales are really used; an FP8 safetensors checkpoint on disk works the same way.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/fp8_reference.h"
#include "shardsync/fp8.h"
#include "shardsync/refengine.h"

namespace shardsync {
namespace {

ModelSpec TinyQwen3Fp8() {
  ModelSpec m;
  m.name = "tiny-qwen3-fp8";
  m.arch = Architecture::kQwen3;
  m.hidden_size = 256;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.head_dim = 128;
  m.num_hidden_layers = 2;
  m.intermediate_size = 512;
  m.vocab_size = 300;
  m.qk_norm = true;
  m.quant = QuantConfig{};
  m.quant->origin = "--quant";
  return m;
}

ModelSpec TinyQwen3MoeFp8() {
  ModelSpec m = TinyQwen3Fp8();
  m.name = "tiny-qwen3-moe-fp8";
  m.arch = Architecture::kQwen3Moe;
  m.num_hidden_layers = 3;
  m.num_experts = 4;
  m.moe_intermediate_size = 256;
  m.num_experts_per_tok = 2;
  m.mlp_only_layers = {1};
  return m;
}

ShardSpec Spec(EngineKind e, int tp, int pp, int ep = 1) {
  ShardSpec s;
  s.engine = e;
  s.tp = tp;
  s.pp = pp;
  s.ep = ep;
  return s;
}

TEST(Fp8RefEngine, ShardedFp8GenerationMatchesTheQuantizedReference) {
  struct Case {
    ModelSpec (*model)();
    ShardSpec spec;
  } cases[] = {{TinyQwen3Fp8, Spec(EngineKind::kSglang, 2, 2)},
               {TinyQwen3MoeFp8, Spec(EngineKind::kVllm, 2, 1, 2)},
               {TinyQwen3MoeFp8, Spec(EngineKind::kSglang, 2, 2)}};
  for (const Case& c : cases) {
    const ModelSpec m = c.model();
    auto map = BuildShardMap(m, c.spec);
    ASSERT_TRUE(map.ok()) << map.status().ToString();
    SyntheticWeightSource values(m, 3);
    QuantizedWeightSource fp8(values, m);
    auto buffers = CutEngineShards(*map, fp8);
    ASSERT_TRUE(buffers.ok()) << buffers.status().ToString();
    EXPECT_EQ((*buffers)[0].at("model.layers.0.self_attn.qkv_proj.weight").dtype, DType::kF8E4M3);
    auto g = CheckGeneration(*map, *buffers, values, DefaultPrompt(), 6);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_TRUE(g->match) << m.name << ": max logit diff " << g->max_logit_diff << " tolerance "
                          << g->tolerance;
    EXPECT_EQ(g->engine_tokens.size(), 6u);
  }
}

TEST(Fp8RefEngine, QuantizationChangesTheLogitsAndTheScalesAreUsed) {
  const ModelSpec m = TinyQwen3Fp8();
  ModelSpec plain = m;
  plain.quant.reset();
  SyntheticWeightSource values(m, 5);
  QuantizedWeightSource fp8(values, m);
  DequantizedWeightSource dq(fp8, m);
  auto ref_fp8 = MakeReferenceModel(m, dq);
  auto ref_bf16 = MakeReferenceModel(plain, values);
  ASSERT_TRUE(ref_fp8.ok() && ref_bf16.ok());
  auto a = GreedyGenerate(**ref_fp8, DefaultPrompt(), 1);
  auto b = GreedyGenerate(**ref_bf16, DefaultPrompt(), 1);
  ASSERT_TRUE(a.ok() && b.ok());
  double diff = 0;
  for (size_t i = 0; i < a->step_logits[0].size(); ++i) {
    diff = std::max(diff, std::fabs(double(a->step_logits[0][i]) - b->step_logits[0][i]));
  }
  EXPECT_GT(diff, 1e-3);  // e4m3 rounding is visible in the logits
  // A wrong scale in one engine buffer changes the sharded model's logits.
  auto map = BuildShardMap(m, Spec(EngineKind::kSglang, 2, 1));
  ASSERT_TRUE(map.ok());
  auto buffers = CutEngineShards(*map, fp8);
  ASSERT_TRUE(buffers.ok());
  HostTensor& s = (*buffers)[1].at("model.layers.0.mlp.gate_up_proj.weight_scale_inv");
  float v;
  std::memcpy(&v, s.data.data(), 4);
  v *= 2;
  std::memcpy(s.data.data(), &v, 4);
  auto g = CheckGeneration(*map, *buffers, values, DefaultPrompt(), 2);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_FALSE(g->match);
  // A missing scale is an error naming it.
  (*buffers)[1].erase("model.layers.0.mlp.gate_up_proj.weight_scale_inv");
  auto missing = MakeShardedModel(*map, *buffers);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("gate_up_proj.weight_scale_inv"), std::string::npos)
      << missing.status().message();
}

TEST(Fp8RefEngine, QuantizedSourceReadsAnyRegionLikeTheWholeTensor) {
  const ModelSpec m = TinyQwen3Fp8();
  SyntheticWeightSource values(m, 9);
  QuantizedWeightSource fp8(values, m);
  const std::string w = "model.layers.1.mlp.down_proj.weight";  // [256, 512]
  auto info = fp8.Describe(w);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->dtype, DType::kF8E4M3);
  std::vector<float> x(256 * 512);
  ASSERT_TRUE(values.Read(w, Region::Full({256, 512}), DType::kF32, x.data()).ok());
  const auto want = fp8_reference::QuantizeMatrix(x.data(), 256, 512);
  std::vector<uint8_t> q(256 * 512);
  ASSERT_TRUE(fp8.Read(w, Region::Full({256, 512}), DType::kF8E4M3, q.data()).ok());
  EXPECT_EQ(q, want.q);
  std::vector<uint8_t> sub(100 * 70);
  ASSERT_TRUE(fp8.Read(w, Region::Make({37, 300}, {100, 70}), DType::kF8E4M3, sub.data()).ok());
  for (int64_t r = 0; r < 100; ++r) {
    for (int64_t c = 0; c < 70; ++c) ASSERT_EQ(sub[r * 70 + c], want.q[(37 + r) * 512 + 300 + c]);
  }
  float s[2];
  ASSERT_TRUE(fp8.Read(WeightScaleName(w), Region::Make({1, 2}, {1, 2}), DType::kF32, s).ok());
  EXPECT_EQ(fp8_reference::Bits(s[0]), fp8_reference::Bits(want.scales[1 * 4 + 2]));
  EXPECT_EQ(fp8_reference::Bits(s[1]), fp8_reference::Bits(want.scales[1 * 4 + 3]));
  EXPECT_EQ(fp8.Read(w, Region::Full({256, 512}), DType::kBF16, q.data()).code(),
            StatusCode::kInvalidArgument);
  // Unquantized tensors pass through.
  auto norm = fp8.Describe("model.norm.weight");
  ASSERT_TRUE(norm.ok());
  EXPECT_EQ(norm->dtype, m.dtype);
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/ss_fp8_refengine_XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(Fp8RefEngine, AnFp8CheckpointOnDiskRunsShardedAndUnsharded) {
  // An FP8 checkpoint as published (F8_E4M3 weights + F32 weight_scale_inv, config.json with
  // quantization_config), written from the quantized synthetic weights.
  const ModelSpec m = TinyQwen3Fp8();
  SyntheticWeightSource values(m, 11);
  QuantizedWeightSource fp8(values, m);
  TempDir dir;
  std::vector<std::vector<uint8_t>> storage;
  std::vector<TensorToWrite> tensors;
  for (const HfTensor& t : HfCheckpointInventory(m)) {
    storage.emplace_back(static_cast<size_t>(t.bytes()));
    ASSERT_TRUE(fp8.Read(t.name, Region::Full(t.shape), t.dtype, storage.back().data()).ok())
        << t.name;
  }
  size_t i = 0;
  for (const HfTensor& t : HfCheckpointInventory(m)) {
    tensors.push_back({t.name, t.dtype, t.shape, storage[i++]});
  }
  ASSERT_TRUE(WriteSafetensors(dir.path() + "/model.safetensors", tensors, {}).ok());
  nlohmann::json cfg = {{"architectures", {"Qwen3ForCausalLM"}},
                        {"hidden_size", m.hidden_size},
                        {"num_attention_heads", m.num_attention_heads},
                        {"num_key_value_heads", m.num_key_value_heads},
                        {"head_dim", m.head_dim},
                        {"num_hidden_layers", m.num_hidden_layers},
                        {"intermediate_size", m.intermediate_size},
                        {"vocab_size", m.vocab_size},
                        {"torch_dtype", "bfloat16"},
                        {"quantization_config",
                         {{"quant_method", "fp8"},
                          {"activation_scheme", "dynamic"},
                          {"fmt", "e4m3"},
                          {"weight_block_size", {128, 128}}}}};
  std::ofstream(dir.path() + "/config.json") << cfg.dump();
  auto spec = LoadModelSpec(dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  ASSERT_TRUE(spec->quant.has_value());
  auto ckpt = CheckpointWeightSource::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_TRUE(HoldsFp8Weights(**ckpt, *spec));
  EXPECT_FALSE(HoldsFp8Weights(values, *spec));
  // Engine shards cut from the checkpoint equal the ones quantized from the values.
  auto map = BuildShardMap(*spec, Spec(EngineKind::kVllm, 2, 2));
  ASSERT_TRUE(map.ok());
  auto from_disk = CutEngineShards(*map, **ckpt);
  auto from_values = CutEngineShards(*map, fp8);
  ASSERT_TRUE(from_disk.ok() && from_values.ok()) << from_disk.status().ToString();
  for (size_t r = 0; r < from_disk->size(); ++r) {
    for (const auto& [name, t] : (*from_disk)[r])
      EXPECT_EQ(t.data, (*from_values)[r].at(name).data) << name;
  }
  // The unsharded reference on the dequantized checkpoint generates what the sharded model does.
  DequantizedWeightSource dq(**ckpt, *spec);
  auto ref = MakeReferenceModel(*spec, dq);
  auto eng = MakeShardedModel(*map, *from_disk);
  ASSERT_TRUE(ref.ok() && eng.ok()) << ref.status().ToString() << eng.status().ToString();
  auto a = GreedyGenerate(**ref, DefaultPrompt(), 5);
  auto b = GreedyGenerate(**eng, DefaultPrompt(), 5);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  // A bf16 checkpoint whose config claims FP8 is refused naming the tensor.
  DequantizedWeightSource wrong(values, *spec);
  std::vector<float> out(512 * 256);
  Status st = wrong.Read("model.layers.0.self_attn.q_proj.weight", Region::Full({512, 256}),
                         DType::kF32, out.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("q_proj.weight"), std::string::npos);
}

}  // namespace
}  // namespace shardsync
