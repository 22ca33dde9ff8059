// ParseModelConfig / LoadModelSpec / HfTensorInventory: a Hugging Face config.json reduced to the
// dimensions sharding needs, checked field by field (every error names the field and the source).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/embedded_configs.h"
#include "model/quant_config.h"
#include "shardsync/model.h"

namespace shardsync {
namespace {

using json = nlohmann::json;

// Sanity limits, far above any real model, so a hostile config cannot make the inventory (one
// entry per tensor) exhaust memory. Element counts are checked separately for int64 overflow.
constexpr int64_t kMaxDim = int64_t{1} << 40;
constexpr int64_t kMaxLayers = 1 << 16;
constexpr int64_t kMaxExperts = 1 << 16;
constexpr int64_t kMaxTensors = 1 << 22;

bool MulOk(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool AddOk(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

class Reader {
 public:
  Reader(const json& j, std::string_view source) : j_(j), source_(source) {}

  Status Error(std::string_view field, std::string_view what) const {
    return InvalidArgumentError(fmt::format("{}: field '{}': {}", source_, field, what));
  }

  // nullptr when absent or JSON null (HF writes null for unset optional fields).
  const json* Find(std::string_view field) const {
    auto it = j_.find(std::string(field));
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  Result<int64_t> Int(std::string_view field, std::optional<int64_t> def = std::nullopt) const {
    const json* v = Find(field);
    if (v == nullptr) {
      if (def) return *def;
      return Error(field, "missing");
    }
    return AsInt(*v, field);
  }

  Result<int64_t> AsInt(const json& v, std::string_view field) const {
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(kMaxDim)) {
        return Error(field, fmt::format("{} is too large (limit {})", u, kMaxDim));
      }
      return static_cast<int64_t>(u);
    }
    if (v.is_number_integer()) {
      const int64_t i = v.get<int64_t>();
      if (i > kMaxDim) return Error(field, fmt::format("{} is too large (limit {})", i, kMaxDim));
      return i;
    }
    if (v.is_number_float()) {
      // Some exporters write 4096.0; accept exact integers only.
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) <= static_cast<double>(kMaxDim)) {
        return static_cast<int64_t>(d);
      }
      return Error(field, fmt::format("expected an integer, got {}", v.dump()));
    }
    return Error(field, fmt::format("expected an integer, got {} {}", v.type_name(), Dump(v)));
  }

  Result<int64_t> PositiveInt(std::string_view field,
                              std::optional<int64_t> def = std::nullopt) const {
    SS_ASSIGN_OR_RETURN(int64_t v, Int(field, def));
    if (v <= 0) return Error(field, fmt::format("must be positive, got {}", v));
    return v;
  }

  Result<double> Double(std::string_view field, double def) const {
    const json* v = Find(field);
    if (v == nullptr) return def;
    if (!v->is_number()) {
      return Error(field, fmt::format("expected a number, got {} {}", v->type_name(), Dump(*v)));
    }
    const double d = v->get<double>();
    if (!std::isfinite(d)) return Error(field, "must be finite");
    return d;
  }

  Result<double> PositiveDouble(std::string_view field, double def) const {
    SS_ASSIGN_OR_RETURN(double d, Double(field, def));
    if (!(d > 0)) return Error(field, fmt::format("must be positive, got {}", d));
    return d;
  }

  Result<bool> Bool(std::string_view field, bool def) const {
    const json* v = Find(field);
    if (v == nullptr) return def;
    if (!v->is_boolean()) {
      return Error(field,
                   fmt::format("expected true or false, got {} {}", v->type_name(), Dump(*v)));
    }
    return v->get<bool>();
  }

  Result<std::string> String(std::string_view field) const {
    const json* v = Find(field);
    if (v == nullptr) return Error(field, "missing");
    if (!v->is_string()) {
      return Error(field, fmt::format("expected a string, got {} {}", v->type_name(), Dump(*v)));
    }
    return v->get<std::string>();
  }

  static std::string Dump(const json& v) {
    std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
    if (s.size() > 40) s = s.substr(0, 37) + "...";
    return s;
  }

 private:
  const json& j_;
  std::string_view source_;
};

Result<Architecture> ParseArchitecture(const Reader& r) {
  static const std::pair<std::string_view, Architecture> kArchs[] = {
      {"LlamaForCausalLM", Architecture::kLlama},
      {"MistralForCausalLM", Architecture::kMistral},
      {"Qwen2ForCausalLM", Architecture::kQwen2},
      {"Qwen3ForCausalLM", Architecture::kQwen3},
      {"Qwen3MoeForCausalLM", Architecture::kQwen3Moe},
  };
  const json* a = r.Find("architectures");
  if (a == nullptr) return r.Error("architectures", "missing");
  if (!a->is_array() || a->empty()) {
    return r.Error("architectures", "expected a non-empty list of architecture names");
  }
  const json& first = (*a)[0];
  if (!first.is_string()) {
    return r.Error("architectures", fmt::format("expected a string, got {}", Reader::Dump(first)));
  }
  const std::string name = first.get<std::string>();
  for (const auto& [n, arch] : kArchs) {
    if (n == name) return arch;
  }
  return r.Error("architectures",
                 fmt::format("unsupported architecture '{}' (supported: LlamaForCausalLM, "
                             "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                             "Qwen3MoeForCausalLM)",
                             name));
}

Result<std::optional<RopeScaling>> ParseRopeScaling(const json* rs, std::string_view field,
                                                    const Reader& outer) {
  if (rs == nullptr) return std::optional<RopeScaling>();
  if (!rs->is_object()) {
    return outer.Error(field, fmt::format("expected an object or null, got {}", Reader::Dump(*rs)));
  }
  const std::string prefix = std::string(field) + ".";
  Reader r(*rs, "");
  RopeScaling s;
  const json* type = r.Find("rope_type");
  if (type == nullptr) type = r.Find("type");
  if (type == nullptr || !type->is_string()) {
    return outer.Error(prefix + "rope_type", "missing or not a string");
  }
  s.type = type->get<std::string>();
  if (s.type == "default") return std::optional<RopeScaling>();
  auto wrap = [&](Status st, std::string_view sub) {
    return outer.Error(prefix + std::string(sub),
                       st.message().substr(st.message().find(':', 2) + 2));
  };
  auto get_double = [&](std::string_view sub, double def, double* out) -> Status {
    auto d = r.Double(sub, def);
    if (!d.ok()) return wrap(d.status(), sub);
    *out = *d;
    return OkStatus();
  };
  SS_RETURN_IF_ERROR(get_double("factor", 1.0, &s.factor));
  if (!(s.factor > 0)) return outer.Error(prefix + "factor", "must be positive");
  SS_RETURN_IF_ERROR(get_double("low_freq_factor", 1.0, &s.low_freq_factor));
  SS_RETURN_IF_ERROR(get_double("high_freq_factor", 4.0, &s.high_freq_factor));
  auto omp = r.Int("original_max_position_embeddings", int64_t{8192});
  if (!omp.ok()) return wrap(omp.status(), "original_max_position_embeddings");
  s.original_max_position_embeddings = *omp;
  if (s.type == "llama3") {
    if (!(s.high_freq_factor > s.low_freq_factor) || s.low_freq_factor <= 0) {
      return outer.Error(
          prefix + "high_freq_factor",
          fmt::format("llama3 needs high_freq_factor ({}) > low_freq_factor ({}) > 0",
                      s.high_freq_factor, s.low_freq_factor));
    }
    if (s.original_max_position_embeddings <= 0) {
      return outer.Error(prefix + "original_max_position_embeddings", "must be positive");
    }
  }
  return std::optional<RopeScaling>(s);
}

Result<ModelSpec> ParseJson(const json& j, std::string_view source) {
  Reader r(j, source);
  if (!j.is_object()) {
    return InvalidArgumentError(
        fmt::format("{}: expected a JSON object at the top level, got {}", source, j.type_name()));
  }
  ModelSpec s;
  s.name = std::string(source);
  SS_ASSIGN_OR_RETURN(s.arch, ParseArchitecture(r));
  SS_ASSIGN_OR_RETURN(s.hidden_size, r.PositiveInt("hidden_size"));
  SS_ASSIGN_OR_RETURN(s.num_attention_heads, r.PositiveInt("num_attention_heads"));
  SS_ASSIGN_OR_RETURN(s.num_key_value_heads,
                      r.PositiveInt("num_key_value_heads", s.num_attention_heads));
  if (r.Find("head_dim") != nullptr) {
    SS_ASSIGN_OR_RETURN(s.head_dim, r.PositiveInt("head_dim"));
  } else {
    if (s.hidden_size % s.num_attention_heads != 0) {
      return r.Error("num_attention_heads",
                     fmt::format("{} does not divide hidden_size {} (and no head_dim is given)",
                                 s.num_attention_heads, s.hidden_size));
    }
    s.head_dim = s.hidden_size / s.num_attention_heads;
  }
  SS_ASSIGN_OR_RETURN(s.num_hidden_layers, r.PositiveInt("num_hidden_layers"));
  SS_ASSIGN_OR_RETURN(s.vocab_size, r.PositiveInt("vocab_size"));
  SS_ASSIGN_OR_RETURN(s.tie_word_embeddings, r.Bool("tie_word_embeddings", false));
  if (s.arch == Architecture::kQwen2) {
    s.qkv_bias = true;  // Qwen2Attention: q/k/v with bias, o_proj without, unconditionally.
  } else {
    SS_ASSIGN_OR_RETURN(s.attention_bias, r.Bool("attention_bias", false));
    // HF Qwen3 gives o_proj a bias with attention_bias, the engines' Qwen3 models do not: no
    // consistent layout exists, and no released Qwen3 sets it.
    if (s.attention_bias && (s.arch == Architecture::kQwen3 || s.arch == Architecture::kQwen3Moe)) {
      return r.Error("attention_bias", "true is not supported for Qwen3 models");
    }
  }
  s.qk_norm = s.arch == Architecture::kQwen3 || s.arch == Architecture::kQwen3Moe;
  SS_ASSIGN_OR_RETURN(bool mlp_bias, r.Bool("mlp_bias", false));
  if (mlp_bias) return r.Error("mlp_bias", "true is not supported (no engine rule for MLP biases)");
  SS_ASSIGN_OR_RETURN(s.rms_norm_eps, r.PositiveDouble("rms_norm_eps", 1e-6));
  SS_ASSIGN_OR_RETURN(s.max_position_embeddings, r.PositiveInt("max_position_embeddings", 4096));

  // Rope: transformers <= 4 writes rope_theta + rope_scaling; transformers 5 folds both into
  // rope_parameters {rope_theta, rope_type, ...}.
  const json* rope_params = r.Find("rope_parameters");
  if (rope_params != nullptr) {
    if (!rope_params->is_object()) {
      return r.Error("rope_parameters",
                     fmt::format("expected an object, got {}", Reader::Dump(*rope_params)));
    }
    Reader rp(*rope_params, source);
    auto theta = rp.PositiveDouble("rope_theta", 10000.0);
    if (!theta.ok()) return r.Error("rope_parameters.rope_theta", "must be a positive number");
    s.rope_theta = *theta;
    SS_ASSIGN_OR_RETURN(s.rope_scaling, ParseRopeScaling(rope_params, "rope_parameters", r));
  } else {
    SS_ASSIGN_OR_RETURN(s.rope_theta, r.PositiveDouble("rope_theta", 10000.0));
    SS_ASSIGN_OR_RETURN(s.rope_scaling,
                        ParseRopeScaling(r.Find("rope_scaling"), "rope_scaling", r));
  }

  // dtype: torch_dtype (transformers <= 4) or dtype (transformers 5). HF's own default when
  // neither is written is the checkpoint's dtype, which every model here ships as bfloat16.
  const char* dtype_field = r.Find("torch_dtype") != nullptr ? "torch_dtype" : "dtype";
  if (r.Find(dtype_field) != nullptr) {
    SS_ASSIGN_OR_RETURN(std::string d, r.String(dtype_field));
    auto dt = ParseDType(d, dtype_field);
    if (!dt.ok()) return r.Error(dtype_field, fmt::format("unknown dtype '{}'", d));
    if (*dt != DType::kBF16 && *dt != DType::kF16 && *dt != DType::kF32) {
      return r.Error(dtype_field,
                     fmt::format("'{}' is not a weight dtype (bfloat16, float16 or float32)", d));
    }
    s.dtype = *dt;
  }

  if (s.arch == Architecture::kQwen3Moe) {
    // transformers 5 writes Qwen3-MoE's expert count as num_local_experts only.
    const char* experts_field =
        r.Find("num_experts") == nullptr && r.Find("num_local_experts") != nullptr
            ? "num_local_experts"
            : "num_experts";
    SS_ASSIGN_OR_RETURN(s.num_experts, r.PositiveInt(experts_field));
    SS_ASSIGN_OR_RETURN(s.moe_intermediate_size, r.PositiveInt("moe_intermediate_size"));
    SS_ASSIGN_OR_RETURN(s.num_experts_per_tok, r.PositiveInt("num_experts_per_tok"));
    SS_ASSIGN_OR_RETURN(s.norm_topk_prob, r.Bool("norm_topk_prob", false));
    SS_ASSIGN_OR_RETURN(s.decoder_sparse_step, r.PositiveInt("decoder_sparse_step", int64_t{1}));
    if (const json* mol = r.Find("mlp_only_layers"); mol != nullptr) {
      if (!mol->is_array()) {
        return r.Error("mlp_only_layers",
                       fmt::format("expected a list of layer indices, got {}", Reader::Dump(*mol)));
      }
      if (static_cast<int64_t>(mol->size()) > kMaxLayers) {
        return r.Error("mlp_only_layers", "more entries than layers");
      }
      for (size_t i = 0; i < mol->size(); ++i) {
        SS_ASSIGN_OR_RETURN(int64_t l, r.AsInt((*mol)[i], "mlp_only_layers"));
        s.mlp_only_layers.push_back(l);
      }
    }
    // intermediate_size only matters when some layer is dense.
    if (r.Find("intermediate_size") != nullptr) {
      SS_ASSIGN_OR_RETURN(s.intermediate_size, r.PositiveInt("intermediate_size"));
    }
  } else {
    SS_ASSIGN_OR_RETURN(s.intermediate_size, r.PositiveInt("intermediate_size"));
  }
  SS_ASSIGN_OR_RETURN(s.quant,
                      internal::ParseQuantizationConfig(r.Find("quantization_config"), source));
  Status st = ValidateModelSpec(s);
  if (!st.ok()) return InvalidArgumentError(fmt::format("{}: {}", source, st.message()));
  return s;
}

}  // namespace

std::string_view ArchitectureName(Architecture a) {
  switch (a) {
    case Architecture::kLlama:
      return "LlamaForCausalLM";
    case Architecture::kMistral:
      return "MistralForCausalLM";
    case Architecture::kQwen2:
      return "Qwen2ForCausalLM";
    case Architecture::kQwen3:
      return "Qwen3ForCausalLM";
    case Architecture::kQwen3Moe:
      return "Qwen3MoeForCausalLM";
  }
  return "?";
}

bool ModelSpec::IsMoeLayer(int64_t layer) const {
  if (num_experts <= 0 || decoder_sparse_step <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

Status ValidateModelSpec(const ModelSpec& s) {
  auto err = [](std::string_view field, std::string what) {
    return InvalidArgumentError(fmt::format("field '{}': {}", field, what));
  };
  auto positive = [&](std::string_view field, int64_t v) -> Status {
    if (v <= 0) return err(field, fmt::format("must be positive, got {}", v));
    if (v > kMaxDim) return err(field, fmt::format("{} is too large (limit {})", v, kMaxDim));
    return OkStatus();
  };
  SS_RETURN_IF_ERROR(positive("hidden_size", s.hidden_size));
  SS_RETURN_IF_ERROR(positive("num_attention_heads", s.num_attention_heads));
  SS_RETURN_IF_ERROR(positive("num_key_value_heads", s.num_key_value_heads));
  SS_RETURN_IF_ERROR(positive("head_dim", s.head_dim));
  SS_RETURN_IF_ERROR(positive("num_hidden_layers", s.num_hidden_layers));
  SS_RETURN_IF_ERROR(positive("vocab_size", s.vocab_size));
  if (s.num_hidden_layers > kMaxLayers) {
    return err("num_hidden_layers",
               fmt::format("{} exceeds the limit {}", s.num_hidden_layers, kMaxLayers));
  }
  if (s.num_attention_heads % s.num_key_value_heads != 0) {
    return err("num_key_value_heads", fmt::format("{} does not divide num_attention_heads {}",
                                                  s.num_key_value_heads, s.num_attention_heads));
  }
  if (!(s.rms_norm_eps > 0)) return err("rms_norm_eps", "must be positive");
  if (!(s.rope_theta > 0)) return err("rope_theta", "must be positive");
  int64_t moe_layers = 0;
  if (s.is_moe()) {
    if (s.num_experts > kMaxExperts) {
      return err("num_experts", fmt::format("{} exceeds the limit {}", s.num_experts, kMaxExperts));
    }
    SS_RETURN_IF_ERROR(positive("moe_intermediate_size", s.moe_intermediate_size));
    SS_RETURN_IF_ERROR(positive("num_experts_per_tok", s.num_experts_per_tok));
    SS_RETURN_IF_ERROR(positive("decoder_sparse_step", s.decoder_sparse_step));
    if (s.num_experts_per_tok > s.num_experts) {
      return err("num_experts_per_tok",
                 fmt::format("{} exceeds num_experts {}", s.num_experts_per_tok, s.num_experts));
    }
    for (int64_t l : s.mlp_only_layers) {
      if (l < 0 || l >= s.num_hidden_layers) {
        return err("mlp_only_layers",
                   fmt::format("layer {} is outside [0, {})", l, s.num_hidden_layers));
      }
    }
    for (int64_t l = 0; l < s.num_hidden_layers; ++l) moe_layers += s.IsMoeLayer(l) ? 1 : 0;
    if (moe_layers * s.num_experts * 3 > kMaxTensors) {  // both <= 2^16: no overflow
      return err("num_experts", fmt::format("{} experts x {} MoE layers is more than {} tensors",
                                            s.num_experts, moe_layers, kMaxTensors));
    }
  } else if (s.moe_intermediate_size != 0 || s.num_experts_per_tok != 0) {
    return err("num_experts", "is 0 but MoE fields are set");
  }
  const int64_t dense_layers = s.num_hidden_layers - moe_layers;
  if (dense_layers > 0) SS_RETURN_IF_ERROR(positive("intermediate_size", s.intermediate_size));

  // Every tensor's element count, and the checkpoint's total bytes, must fit in int64.
  int64_t total = 0;
  auto add = [&](std::string_view what, std::initializer_list<int64_t> dims,
                 int64_t count) -> Status {
    int64_t n = 1;
    for (int64_t d : dims) {
      if (!MulOk(n, d, &n)) return err(what, "tensor element count overflows int64");
    }
    int64_t bytes = 0, all = 0;
    if (!MulOk(n, DTypeSize(s.dtype), &bytes) || !MulOk(bytes, count, &all) ||
        !AddOk(total, all, &total)) {
      return err(what, "model size in bytes overflows int64");
    }
    return OkStatus();
  };
  const int64_t L = s.num_hidden_layers;
  int64_t q_rows = 0;
  if (!MulOk(s.num_attention_heads, s.head_dim, &q_rows)) {
    return err("head_dim", "num_attention_heads * head_dim overflows int64");
  }
  const int64_t kv_rows = s.num_key_value_heads * s.head_dim;  // <= q_rows
  // Engines pad the vocabulary to a multiple of 64; the padded table must fit too.
  const int64_t padded_vocab = (s.vocab_size + 63) / 64 * 64;
  SS_RETURN_IF_ERROR(
      add("vocab_size", {padded_vocab, s.hidden_size}, s.tie_word_embeddings ? 1 : 2));
  SS_RETURN_IF_ERROR(add("head_dim", {q_rows, s.hidden_size}, 2 * L));
  SS_RETURN_IF_ERROR(add("num_key_value_heads", {kv_rows, s.hidden_size}, 2 * L));
  SS_RETURN_IF_ERROR(add("hidden_size", {s.hidden_size}, 4 * L + 1));  // norms and biases
  SS_RETURN_IF_ERROR(add("head_dim", {q_rows}, 3 * L));                // q/k/v biases, q/k norms
  SS_RETURN_IF_ERROR(
      add("intermediate_size", {s.intermediate_size, s.hidden_size}, 3 * dense_layers));
  SS_RETURN_IF_ERROR(add("num_experts", {s.num_experts, s.hidden_size}, moe_layers));
  SS_RETURN_IF_ERROR(add("moe_intermediate_size", {s.moe_intermediate_size, s.hidden_size},
                         3 * moe_layers * s.num_experts));
  return internal::ValidateQuantConfig(s);
}

Result<ModelSpec> ParseModelConfig(std::string_view json_text, std::string_view source) {
  try {
    json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/true,
                         /*ignore_comments=*/false);
    return ParseJson(j, source);
  } catch (const json::parse_error& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 3, column 1: ...;
    // last read: '<bytes>'": keep the position, drop the file's bytes (a config path may be a
    // symlink to a file the user cannot otherwise read; issue 26).
    std::string what = e.what();
    if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    if (auto p = what.find("; last read"); p != std::string::npos) what.resize(p);
    return InvalidArgumentError(fmt::format("{}: invalid JSON: {}", source, what));
  } catch (const std::exception& e) {
    return InvalidArgumentError(fmt::format("{}: malformed config: {}", source, e.what()));
  }
}

std::vector<std::string> EmbeddedModelNames() {
  std::vector<std::string> names;
  for (const auto& c : internal::EmbeddedConfigs()) names.emplace_back(c.name);
  return names;
}

Result<std::string> EmbeddedModelConfig(std::string_view name) {
  for (const auto& c : internal::EmbeddedConfigs()) {
    if (c.name == name) return std::string(c.json);
  }
  std::string known;
  for (const auto& c : internal::EmbeddedConfigs()) {
    known += known.empty() ? "" : ", ";
    known += c.name;
  }
  return NotFoundError(fmt::format("no embedded model '{}' (known: {})", name, known));
}

Result<ModelSpec> LoadModelSpec(std::string_view name_or_path) {
  for (const auto& c : internal::EmbeddedConfigs()) {
    if (c.name == name_or_path) {
      SS_ASSIGN_OR_RETURN(ModelSpec s, ParseModelConfig(c.json, c.name));
      return s;
    }
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p{std::string(name_or_path)};
  if (fs::is_directory(p, ec)) p /= "config.json";
  if (!fs::is_regular_file(p, ec)) {
    std::string known;
    for (const auto& c : internal::EmbeddedConfigs()) {
      known += known.empty() ? "" : ", ";
      known += c.name;
    }
    return NotFoundError(fmt::format(
        "--model '{}': neither an embedded model ({}) nor a config.json file or a directory "
        "holding one",
        name_or_path, known));
  }
  const auto size = fs::file_size(p, ec);
  if (ec || size > (64u << 20)) {
    return InvalidArgumentError(fmt::format("{}: unreadable or larger than 64 MiB", p.string()));
  }
  std::ifstream in(p, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("{}: cannot open", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelConfig(ss.str(), p.string());
}

std::vector<HfTensor> HfTensorInventory(const ModelSpec& s) {
  std::vector<HfTensor> out;
  const int64_t H = s.hidden_size, d = s.head_dim;
  const int64_t q_rows = s.num_attention_heads * d, kv_rows = s.num_key_value_heads * d;
  auto add = [&](std::string name, Shape shape) {
    out.push_back(HfTensor{std::move(name), std::move(shape), s.dtype});
  };
  add("model.embed_tokens.weight", {s.vocab_size, H});
  for (int64_t l = 0; l < s.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    add(p + "input_layernorm.weight", {H});
    const bool qkv_bias = s.attention_bias || s.qkv_bias;
    for (const auto& [proj, rows] : {std::pair<const char*, int64_t>{"q_proj", q_rows},
                                     {"k_proj", kv_rows},
                                     {"v_proj", kv_rows}}) {
      add(p + "self_attn." + proj + ".weight", {rows, H});
      if (qkv_bias) add(p + "self_attn." + proj + ".bias", {rows});
    }
    add(p + "self_attn.o_proj.weight", {H, q_rows});
    if (s.attention_bias) add(p + "self_attn.o_proj.bias", {H});
    if (s.qk_norm) {
      add(p + "self_attn.q_norm.weight", {d});
      add(p + "self_attn.k_norm.weight", {d});
    }
    add(p + "post_attention_layernorm.weight", {H});
    if (s.IsMoeLayer(l)) {
      const int64_t I = s.moe_intermediate_size;
      add(p + "mlp.gate.weight", {s.num_experts, H});
      for (int64_t e = 0; e < s.num_experts; ++e) {
        const std::string ep = fmt::format("{}mlp.experts.{}.", p, e);
        add(ep + "gate_proj.weight", {I, H});
        add(ep + "up_proj.weight", {I, H});
        add(ep + "down_proj.weight", {H, I});
      }
    } else {
      const int64_t I = s.intermediate_size;
      add(p + "mlp.gate_proj.weight", {I, H});
      add(p + "mlp.up_proj.weight", {I, H});
      add(p + "mlp.down_proj.weight", {H, I});
    }
  }
  add("model.norm.weight", {H});
  if (!s.tie_word_embeddings) add("lm_head.weight", {s.vocab_size, H});
  return out;
}

int64_t ModelNumElements(const ModelSpec& spec) {
  int64_t n = 0;
  for (const auto& t : HfTensorInventory(spec)) n += t.numel();
  return n;
}

int64_t ModelBytes(const ModelSpec& spec) { return ModelNumElements(spec) * DTypeSize(spec.dtype); }

std::optional<int64_t> LayerIndexOf(std::string_view name) {
  constexpr std::string_view kPrefix = "layers.";
  size_t pos = 0;
  while ((pos = name.find(kPrefix, pos)) != std::string_view::npos) {
    if (pos == 0 || name[pos - 1] == '.') {
      size_t i = pos + kPrefix.size();
      int64_t v = 0;
      size_t digits = 0;
      while (i < name.size() && name[i] >= '0' && name[i] <= '9' && digits < 12) {
        v = v * 10 + (name[i] - '0');
        ++i;
        ++digits;
      }
      if (digits > 0 && (i == name.size() || name[i] == '.')) return v;
    }
    pos += kPrefix.size();
  }
  return std::nullopt;
}

}  // namespace shardsync
