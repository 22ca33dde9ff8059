// ParseModelConfig on real, edited and malformed config.json texts: every error is
// InvalidArgument naming the source and the field; nothing throws.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "shardsync/model.h"

namespace shardsync {
namespace {

using json = nlohmann::json;

json Base(const char* name = "qwen3-8b") {
  auto text = EmbeddedModelConfig(name);
  EXPECT_TRUE(text.ok());
  return json::parse(*text);
}

Result<ModelSpec> Parse(const json& j) { return ParseModelConfig(j.dump(), "cfg.json"); }

void ExpectError(const Result<ModelSpec>& r, std::initializer_list<const char*> words) {
  ASSERT_FALSE(r.ok()) << "accepted";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("cfg.json"), std::string::npos) << r.status().message();
  for (const char* w : words) {
    EXPECT_NE(r.status().message().find(w), std::string::npos)
        << "'" << w << "' not in: " << r.status().message();
  }
}

TEST(ConfigParse, AllEmbeddedModelsParseWithRealDimensions) {
  struct Want {
    const char* name;
    int64_t hidden, heads, kv, head_dim, layers, inter, vocab;
    bool tied;
  };
  const Want wants[] = {
      {"qwen2.5-0.5b", 896, 14, 2, 64, 24, 4864, 151936, true},
      {"qwen2.5-7b", 3584, 28, 4, 128, 28, 18944, 152064, false},
      {"qwen3-0.6b", 1024, 16, 8, 128, 28, 3072, 151936, true},
      {"qwen3-8b", 4096, 32, 8, 128, 36, 12288, 151936, false},
      {"qwen3-32b", 5120, 64, 8, 128, 64, 25600, 151936, false},
      {"qwen3-30b-a3b", 2048, 32, 4, 128, 48, 6144, 151936, false},
      {"qwen3-235b-a22b", 4096, 64, 4, 128, 94, 12288, 151936, false},
      {"llama-3.1-8b", 4096, 32, 8, 128, 32, 14336, 128256, false},
      {"llama-3.1-70b", 8192, 64, 8, 128, 80, 28672, 128256, false},
  };
  EXPECT_EQ(EmbeddedModelNames().size(), std::size(wants));
  for (const auto& w : wants) {
    auto s = LoadModelSpec(w.name);
    ASSERT_TRUE(s.ok()) << w.name << ": " << s.status().ToString();
    EXPECT_EQ(s->name, w.name);
    EXPECT_EQ(s->hidden_size, w.hidden) << w.name;
    EXPECT_EQ(s->num_attention_heads, w.heads) << w.name;
    EXPECT_EQ(s->num_key_value_heads, w.kv) << w.name;
    EXPECT_EQ(s->head_dim, w.head_dim) << w.name;
    EXPECT_EQ(s->num_hidden_layers, w.layers) << w.name;
    EXPECT_EQ(s->intermediate_size, w.inter) << w.name;
    EXPECT_EQ(s->vocab_size, w.vocab) << w.name;
    EXPECT_EQ(s->tie_word_embeddings, w.tied) << w.name;
    EXPECT_EQ(s->dtype, DType::kBF16) << w.name;
  }
  auto big = LoadModelSpec("qwen3-235b-a22b");
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->moe_intermediate_size, 1536);
  EXPECT_EQ(big->num_experts, 128);
  // Parameter counts as published: Qwen3-235B-A22B 235.1B, Qwen3-30B-A3B 30.5B, Llama-3.1-8B 8.03B.
  EXPECT_EQ(ModelNumElements(*big), 235093634560);
  EXPECT_EQ(ModelNumElements(*LoadModelSpec("qwen3-30b-a3b")), 30532122624);
  EXPECT_EQ(ModelNumElements(*LoadModelSpec("llama-3.1-8b")), 8030261248);
}

TEST(ConfigParse, ArchitectureSpecificFields) {
  auto q2 = LoadModelSpec("qwen2.5-7b");
  ASSERT_TRUE(q2.ok());
  EXPECT_TRUE(q2->qkv_bias);
  EXPECT_FALSE(q2->attention_bias);
  EXPECT_FALSE(q2->qk_norm);
  auto q3 = LoadModelSpec("qwen3-8b");
  ASSERT_TRUE(q3.ok());
  EXPECT_TRUE(q3->qk_norm);
  EXPECT_FALSE(q3->qkv_bias);
  auto l = LoadModelSpec("llama-3.1-8b");
  ASSERT_TRUE(l.ok());
  ASSERT_TRUE(l->rope_scaling.has_value());
  EXPECT_EQ(l->rope_scaling->type, "llama3");
  EXPECT_DOUBLE_EQ(l->rope_scaling->factor, 8.0);
  EXPECT_EQ(l->rope_scaling->original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(l->rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(l->rms_norm_eps, 1e-5);
  EXPECT_EQ(l->max_position_embeddings, 131072);
  // Llama with attention_bias: q/k/v/o biases in the inventory.
  json j = Base("llama-3.1-8b");
  j["attention_bias"] = true;
  auto lb = Parse(j);
  ASSERT_TRUE(lb.ok()) << lb.status().ToString();
  EXPECT_TRUE(lb->attention_bias);
  int biases = 0;
  for (const auto& t : HfTensorInventory(*lb)) {
    if (t.name.rfind("model.layers.0.", 0) == 0 && t.name.size() > 5 &&
        t.name.compare(t.name.size() - 5, 5, ".bias") == 0) {
      ++biases;
    }
  }
  EXPECT_EQ(biases, 4);
}

TEST(ConfigParse, DefaultsAndAlternateSpellings) {
  json j = Base("llama-3.1-8b");
  j.erase("num_key_value_heads");
  j.erase("torch_dtype");
  j["dtype"] = "float16";  // transformers 5 spelling
  j["architectures"] = {"MistralForCausalLM"};
  auto s = Parse(j);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->arch, Architecture::kMistral);
  EXPECT_EQ(s->num_key_value_heads, 32);
  EXPECT_EQ(s->head_dim, 128);
  EXPECT_EQ(s->dtype, DType::kF16);
  // head_dim: null means "derive it" (Mistral configs write that).
  j["head_dim"] = nullptr;
  EXPECT_TRUE(Parse(j).ok());
  // transformers 5 rope_parameters.
  json t5 = Base("llama-3.1-8b");
  t5.erase("rope_theta");
  t5.erase("rope_scaling");
  t5["rope_parameters"] = {{"rope_theta", 500000.0},  {"rope_type", "llama3"},
                           {"factor", 8.0},           {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  auto s5 = Parse(t5);
  ASSERT_TRUE(s5.ok()) << s5.status().ToString();
  EXPECT_DOUBLE_EQ(s5->rope_theta, 500000.0);
  ASSERT_TRUE(s5->rope_scaling.has_value());
  EXPECT_EQ(s5->rope_scaling->type, "llama3");
  // MoE with dense layers.
  json moe = Base("qwen3-30b-a3b");
  moe["mlp_only_layers"] = {0, 47};
  moe["decoder_sparse_step"] = 2;
  auto sm = Parse(moe);
  ASSERT_TRUE(sm.ok()) << sm.status().ToString();
  EXPECT_FALSE(sm->IsMoeLayer(0));
  EXPECT_TRUE(sm->IsMoeLayer(1));
  EXPECT_FALSE(sm->IsMoeLayer(2));
  EXPECT_FALSE(sm->IsMoeLayer(47));
  // transformers 5 writes the expert count as num_local_experts.
  json t5moe = Base("qwen3-30b-a3b");
  t5moe.erase("num_experts");
  t5moe["num_local_experts"] = 128;
  auto s5m = Parse(t5moe);
  ASSERT_TRUE(s5m.ok()) << s5m.status().ToString();
  EXPECT_EQ(s5m->num_experts, 128);
  t5moe["num_local_experts"] = 0;
  ExpectError(Parse(t5moe), {"num_local_experts"});
}

TEST(ConfigParse, MalformedJson) {
  auto text = *EmbeddedModelConfig("qwen3-8b");
  for (size_t cut : {size_t{0}, size_t{1}, text.size() / 2, text.size() - 2}) {
    auto r = ParseModelConfig(text.substr(0, cut), "cfg.json");
    ASSERT_FALSE(r.ok()) << "cut " << cut;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("cfg.json: invalid JSON"), std::string::npos)
        << r.status().message();
  }
  ExpectError(ParseModelConfig("[1, 2]", "cfg.json"), {"JSON object"});
  ExpectError(ParseModelConfig("null", "cfg.json"), {"JSON object"});
  ExpectError(ParseModelConfig(std::string(100000, '['), "cfg.json"), {"invalid JSON"});
}

// Issue 26: a config path may be a symlink to a file the user cannot otherwise read; the JSON
// error gives the position, never the bytes nlohmann last read.
TEST(ConfigParse, JsonErrorsDoNotEchoTheFile) {
  for (const char* text : {"SECRET-hunter2", "{\"a\": SECRET-hunter2}", "[1, SECRETx]"}) {
    auto r = ParseModelConfig(text, "cfg.json");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("line 1, column"), std::string::npos)
        << r.status().message();
    EXPECT_EQ(r.status().message().find("SECRET"), std::string::npos) << r.status().message();
  }
}

TEST(ConfigParse, FieldErrorsNameTheField) {
  struct Case {
    const char* field;
    json value;
    const char* words;
  };
  const Case cases[] = {
      {"hidden_size", "4096", "expected an integer"},
      {"hidden_size", 0, "must be positive"},
      {"hidden_size", -4096, "must be positive"},
      {"hidden_size", 4096.5, "expected an integer"},
      {"hidden_size", 1e300, "expected an integer"},
      {"hidden_size", json::array(), "expected an integer"},
      {"hidden_size", 18446744073709551615ull, "too large"},
      {"num_attention_heads", true, "expected an integer"},
      {"num_key_value_heads", 5, "does not divide num_attention_heads"},
      {"num_hidden_layers", -1, "must be positive"},
      {"num_hidden_layers", 1000000, "exceeds the limit"},
      {"vocab_size", int64_t{1} << 41, "too large"},
      {"tie_word_embeddings", "false", "expected true or false"},
      {"rms_norm_eps", 0, "must be positive"},
      {"rms_norm_eps", "1e-6", "expected a number"},
      {"rope_theta", -1.0, "must be positive"},
      {"torch_dtype", "int8", "not a weight dtype"},
      {"torch_dtype", "bfloat17", "unknown dtype"},
      {"torch_dtype", 16, "expected a string"},
      {"architectures", "Qwen3ForCausalLM", "non-empty list"},
      {"architectures", {"GPT2LMHeadModel"}, "unsupported architecture 'GPT2LMHeadModel'"},
      {"architectures", json::array(), "non-empty list"},
      {"mlp_bias", true, "not supported"},
      {"attention_bias", true, "not supported for Qwen3"},
      {"rope_scaling", "yes", "expected an object"},
  };
  for (const auto& c : cases) {
    json j = Base();
    j[c.field] = c.value;
    SCOPED_TRACE(std::string(c.field) + " = " + c.value.dump());
    ExpectError(Parse(j), {c.field, c.words});
  }
  for (const char* required : {"hidden_size", "num_attention_heads", "num_hidden_layers",
                               "vocab_size", "intermediate_size", "architectures"}) {
    json j = Base();
    j.erase(required);
    SCOPED_TRACE(required);
    ExpectError(Parse(j), {required, "missing"});
  }
}

TEST(ConfigParse, InconsistentAndOverflowingDimensions) {
  json j = Base("llama-3.1-8b");
  j["num_attention_heads"] = 30;  // 4096 % 30 != 0, no head_dim
  j["num_key_value_heads"] = 10;
  ExpectError(Parse(j), {"num_attention_heads", "does not divide hidden_size"});
  // Each dimension within limits but the product overflows int64.
  json big = Base("qwen3-8b");
  big["vocab_size"] = int64_t{1} << 39;
  big["hidden_size"] = int64_t{1} << 39;
  ExpectError(Parse(big), {"vocab_size", "overflows int64"});
  json big2 = Base("qwen3-8b");
  big2["head_dim"] = int64_t{1} << 30;
  big2["hidden_size"] = int64_t{1} << 30;
  ExpectError(Parse(big2), {"overflows int64"});
  json moe = Base("qwen3-30b-a3b");
  moe["num_experts_per_tok"] = 200;
  ExpectError(Parse(moe), {"num_experts_per_tok", "exceeds num_experts 128"});
  moe = Base("qwen3-30b-a3b");
  moe["mlp_only_layers"] = {48};
  ExpectError(Parse(moe), {"mlp_only_layers", "outside [0, 48)"});
  moe = Base("qwen3-30b-a3b");
  moe["mlp_only_layers"] = "0";
  ExpectError(Parse(moe), {"mlp_only_layers", "list"});
  moe = Base("qwen3-30b-a3b");
  moe.erase("num_experts");
  ExpectError(Parse(moe), {"num_experts", "missing"});
  moe = Base("qwen3-30b-a3b");
  moe["num_experts"] = 60000;
  moe["num_hidden_layers"] = 60000;
  ExpectError(Parse(moe), {"num_experts"});
  // A dense layer in a MoE model needs intermediate_size.
  moe = Base("qwen3-30b-a3b");
  moe.erase("intermediate_size");
  EXPECT_TRUE(Parse(moe).ok());
  moe["mlp_only_layers"] = {3};
  ExpectError(Parse(moe), {"intermediate_size"});
}

TEST(ConfigParse, LoadFromPathAndDirectory) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("shardsync_model_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream out(dir / "config.json");
    out << *EmbeddedModelConfig("qwen2.5-0.5b");
  }
  auto by_dir = LoadModelSpec(dir.string());
  ASSERT_TRUE(by_dir.ok()) << by_dir.status().ToString();
  EXPECT_EQ(by_dir->hidden_size, 896);
  auto by_file = LoadModelSpec((dir / "config.json").string());
  ASSERT_TRUE(by_file.ok());
  EXPECT_EQ(by_file->name, (dir / "config.json").string());
  {
    std::ofstream out(dir / "config.json");
    out << "{\"architectures\": [\"Qwen2ForCausalLM\"], \"hidden_size\": ";
  }
  auto bad = LoadModelSpec(dir.string());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("config.json: invalid JSON"), std::string::npos);
  auto missing = LoadModelSpec((dir / "nope").string());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("qwen3-8b"), std::string::npos);  // lists names
  fs::remove_all(dir);
  EXPECT_EQ(EmbeddedModelConfig("gpt-5").status().code(), StatusCode::kNotFound);
}

TEST(LayerIndex, ParsesGlobalLayer) {
  EXPECT_EQ(LayerIndexOf("model.layers.17.mlp.experts.3.up_proj.weight"), 17);
  EXPECT_EQ(LayerIndexOf("model.layers.0.input_layernorm.weight"), 0);
  EXPECT_EQ(LayerIndexOf("model.embed_tokens.weight"), std::nullopt);
  EXPECT_EQ(LayerIndexOf("lm_head.weight"), std::nullopt);
  EXPECT_EQ(LayerIndexOf("model.layers.x.foo"), std::nullopt);
}

}  // namespace
}  // namespace shardsync
