// quantization_config and --quant: block FP8 honoured, everything else refused naming the field;
// which tensors are quantized; the FP8 checkpoint inventory.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "shardsync/model.h"

namespace shardsync {
namespace {

using json = nlohmann::json;

// Qwen3-8B-FP8's quantization_config as published.
json Fp8Config(const char* model = "qwen3-8b") {
  json j = json::parse(*EmbeddedModelConfig(model));
  j["quantization_config"] = {{"activation_scheme", "dynamic"},
                              {"fmt", "e4m3"},
                              {"quant_method", "fp8"},
                              {"weight_block_size", {128, 128}}};
  return j;
}

Result<ModelSpec> Parse(const json& j) { return ParseModelConfig(j.dump(), "cfg.json"); }

void ExpectRefused(const json& j, std::initializer_list<const char*> words) {
  auto r = Parse(j);
  ASSERT_FALSE(r.ok()) << "accepted " << j["quantization_config"].dump();
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  for (const char* w : words) {
    EXPECT_NE(r.status().message().find(w), std::string::npos)
        << "'" << w << "' not in: " << r.status().message();
  }
}

TEST(QuantConfig, BlockFp8IsHonoured) {
  auto s = Parse(Fp8Config());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(s->quant.has_value());
  EXPECT_EQ(s->quant->block_n, 128);
  EXPECT_EQ(s->quant->block_k, 128);
  EXPECT_EQ(s->quant->origin, "quantization_config");
  EXPECT_EQ(QuantConfigToString(*s->quant), "fp8 e4m3 128x128");
  // Without one, nothing is quantized.
  auto plain = LoadModelSpec("qwen3-8b");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->quant.has_value());
  EXPECT_FALSE(IsQuantizedWeight(*plain, "model.layers.0.self_attn.q_proj.weight"));
  // null is absent.
  json j = Fp8Config();
  j["quantization_config"] = nullptr;
  EXPECT_FALSE(Parse(j)->quant.has_value());
}

TEST(QuantConfig, EverythingElseIsRefusedNamingTheField) {
  auto with = [](const char* key, json v) {
    json j = Fp8Config();
    j["quantization_config"][key] = std::move(v);
    return j;
  };
  ExpectRefused(with("quant_method", "awq"),
                {"cfg.json", "quantization_config.quant_method", "awq"});
  ExpectRefused(with("quant_method", "mxfp8"), {"quantization_config.quant_method"});
  ExpectRefused(with("quant_method", 3), {"quantization_config.quant_method", "string"});
  ExpectRefused(with("activation_scheme", "static"), {"quantization_config.activation_scheme"});
  ExpectRefused(with("fmt", "e5m2"), {"quantization_config.fmt", "e5m2"});
  ExpectRefused(with("weight_block_size", json::array({64, 64})),
                {"quantization_config.weight_block_size", "[64, 64]"});
  ExpectRefused(with("weight_block_size", json::array({128})),
                {"quantization_config.weight_block_size"});
  ExpectRefused(with("weight_block_size", nullptr),
                {"quantization_config.weight_block_size", "per-tensor"});
  ExpectRefused(with("scale_fmt", "ue8m0"), {"quantization_config.scale_fmt", "ue8m0"});
  ExpectRefused(with("kv_cache_quant_algo", "FP8"), {"quantization_config.kv_cache_quant_algo"});
  ExpectRefused(with("group_size", 128), {"quantization_config.group_size", "unknown field"});
  ExpectRefused(with("modules_to_not_convert", "lm_head"),
                {"quantization_config.modules_to_not_convert"});
  json missing = Fp8Config();
  missing["quantization_config"].erase("activation_scheme");
  ExpectRefused(missing, {"quantization_config.activation_scheme", "missing"});
  json not_object = Fp8Config();
  not_object["quantization_config"] = "fp8";
  ExpectRefused(not_object, {"quantization_config", "object"});
}

TEST(QuantConfig, WhichTensorsAreQuantized) {
  json j = Fp8Config("qwen3-30b-a3b");
  auto s = Parse(j);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  for (const char* yes :
       {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.3.mlp.experts.7.gate_proj.weight",
        "model.layers.3.mlp.experts.7.up_proj.weight",
        "model.layers.47.mlp.experts.127.down_proj.weight"}) {
    EXPECT_TRUE(IsQuantizedWeight(*s, yes)) << yes;
  }
  for (const char* no :
       {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
        "model.layers.3.mlp.gate.weight", "model.layers.0.self_attn.q_proj.bias"}) {
    EXPECT_FALSE(IsQuantizedWeight(*s, no)) << no;
  }
  // The checkpoint the engine loads: e4m3 weights, each followed by its fp32 scale tensor.
  const auto inv = HfCheckpointInventory(*s);
  const auto plain = HfTensorInventory(*s);
  int64_t quantized = 0;
  for (const HfTensor& t : plain) quantized += IsQuantizedWeight(*s, t.name) ? 1 : 0;
  EXPECT_EQ(inv.size(), plain.size() + quantized);
  bool found = false;
  for (size_t i = 0; i + 1 < inv.size(); ++i) {
    if (inv[i].name == "model.layers.0.self_attn.q_proj.weight") {
      found = true;
      EXPECT_EQ(inv[i].dtype, DType::kF8E4M3);
      EXPECT_EQ(inv[i + 1].name, "model.layers.0.self_attn.q_proj.weight_scale_inv");
      EXPECT_EQ(inv[i + 1].dtype, DType::kF32);
      EXPECT_EQ(inv[i + 1].shape, (Shape{32, 16}));  // [4096/128, 2048/128]
    }
  }
  EXPECT_TRUE(found);
}

TEST(QuantConfig, ModulesToNotConvertMatchOnDotBoundaries) {
  json j = Fp8Config();
  j["quantization_config"]["modules_to_not_convert"] = {"lm_head", "layers.1.mlp",
                                                        "model.layers.2.self_attn.o_proj"};
  auto s = Parse(j);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE(IsQuantizedWeight(*s, "model.layers.1.mlp.gate_proj.weight"));
  EXPECT_FALSE(IsQuantizedWeight(*s, "model.layers.1.mlp.down_proj.weight"));
  EXPECT_TRUE(IsQuantizedWeight(*s, "model.layers.10.mlp.gate_proj.weight"));  // not "layers.1"
  EXPECT_TRUE(IsQuantizedWeight(*s, "model.layers.1.self_attn.q_proj.weight"));
  EXPECT_FALSE(IsQuantizedWeight(*s, "model.layers.2.self_attn.o_proj.weight"));
  EXPECT_TRUE(IsQuantizedWeight(*s, "model.layers.2.self_attn.q_proj.weight"));
  // ignored_layers (vLLM's key) works the same.
  json k = Fp8Config();
  k["quantization_config"]["ignored_layers"] = {"model.layers.0.mlp"};
  EXPECT_FALSE(IsQuantizedWeight(*Parse(k), "model.layers.0.mlp.up_proj.weight"));
}

TEST(QuantConfig, FusedProjectionsMustShareAPrecisionAndExpertsCannotBeSkipped) {
  json j = Fp8Config();
  j["quantization_config"]["modules_to_not_convert"] = {"model.layers.4.self_attn.k_proj"};
  ExpectRefused(j, {"modules_to_not_convert", "some but not all", "layers.4.self_attn.q_proj"});
  json g = Fp8Config();
  g["quantization_config"]["modules_to_not_convert"] = {"model.layers.0.mlp.up_proj"};
  ExpectRefused(g, {"modules_to_not_convert", "gate_proj"});
  json e = Fp8Config("qwen3-30b-a3b");
  e["quantization_config"]["modules_to_not_convert"] = {"model.layers.5.mlp.experts"};
  ExpectRefused(e, {"modules_to_not_convert", "experts of layer 5"});
}

TEST(QuantConfig, TheQuantFlag) {
  auto on = ParseQuantFlag("fp8-block128");
  ASSERT_TRUE(on.ok());
  ASSERT_TRUE(on->has_value());
  EXPECT_EQ((*on)->origin, "--quant");
  auto off = ParseQuantFlag("none");
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->has_value());
  auto bad = ParseQuantFlag("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--quant"), std::string::npos);
  // A spec built by hand with an unsupported block size fails validation naming the flag.
  auto s = LoadModelSpec("qwen3-0.6b");
  ASSERT_TRUE(s.ok());
  s->quant = **on;
  EXPECT_TRUE(ValidateModelSpec(*s).ok());
  s->quant->block_n = 64;
  auto st = ValidateModelSpec(*s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--quant.weight_block_size"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace shardsync
