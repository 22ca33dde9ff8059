// Block-FP8 quantization config: config.json's quantization_config and `--quant`, which tensors the
// engine holds in FP8, and the FP8 checkpoint's tensor inventory.
//
// What the engines accept (sglang srt/layers/quantization/fp8.py Fp8Config.from_config / __init__,
// vllm model_executor/layers/quantization/fp8.py Fp8Config, 2025-2026 mains): quant_method
// containing "fp8", activation_scheme required and "dynamic" for block quantization,
// weight_block_size of 2 entries, ignored_layers / modules_to_not_convert; slime's
// quantize_params additionally asserts fmt == "e4m3". shardsync syncs exactly the [128, 128]
// float8_e4m3fn + fp32 weight_scale_inv form and refuses the rest by name.
#include "model/quant_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>

#include "shardsync/fp8.h"

namespace shardsync {
namespace {

using json = nlohmann::json;

constexpr std::string_view kField = "quantization_config";

Status FieldError(std::string_view source, std::string_view key, std::string_view what) {
  return InvalidArgumentError(
      fmt::format("{}: field '{}{}{}': {}", source, kField, key.empty() ? "" : ".", key, what));
}

std::string Dump(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// True when `entry` names `module` or an ancestor of it on dot boundaries ("layers.1" matches
// "model.layers.1.mlp.gate_proj", not "model.layers.10.mlp.gate_proj").
bool ModuleMatches(std::string_view module, std::string_view entry) {
  if (entry.empty()) return false;
  for (size_t pos = module.find(entry); pos != std::string_view::npos;
       pos = module.find(entry, pos + 1)) {
    const size_t end = pos + entry.size();
    if ((pos == 0 || module[pos - 1] == '.') && (end == module.size() || module[end] == '.')) {
      return true;
    }
  }
  return false;
}

bool Ignored(const QuantConfig& q, std::string_view module) {
  for (const std::string& e : q.ignored_modules) {
    if (ModuleMatches(module, e)) return true;
  }
  return false;
}

// The module of a quantizable HF linear weight ("model.layers.3.mlp.experts.7.up_proj"), or
// empty: attention q/k/v/o and MLP gate/up/down (dense or expert) weights of a decoder layer.
std::string_view LinearModule(std::string_view hf_name) {
  constexpr std::string_view kWeight = ".weight";
  if (hf_name.size() <= kWeight.size() ||
      hf_name.substr(hf_name.size() - kWeight.size()) != kWeight) {
    return {};
  }
  const std::string_view module = hf_name.substr(0, hf_name.size() - kWeight.size());
  if (!LayerIndexOf(module)) return {};
  static constexpr std::array<std::string_view, 7> kLinears = {
      ".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.o_proj",
      "gate_proj",         "up_proj",           "down_proj"};
  for (std::string_view l : kLinears) {
    if (module.size() >= l.size() && module.substr(module.size() - l.size()) == l) {
      // gate/up/down must be a whole component (".mlp.gate_proj", ".experts.3.gate_proj").
      const size_t at = module.size() - l.size();
      if (l[0] == '.' || (at > 0 && module[at - 1] == '.')) return module;
    }
  }
  return {};
}

}  // namespace

namespace internal {

Result<std::optional<QuantConfig>> ParseQuantizationConfig(const json* q, std::string_view source) {
  if (q == nullptr) return std::optional<QuantConfig>();
  if (!q->is_object())
    return FieldError(source, "", fmt::format("expected an object, got {}", Dump(*q)));
  static constexpr std::array<std::string_view, 8> kKnown = {
      "quant_method",           "activation_scheme", "fmt",       "weight_block_size",
      "modules_to_not_convert", "ignored_layers",    "scale_fmt", "kv_cache_quant_algo"};
  for (auto it = q->begin(); it != q->end(); ++it) {
    if (std::find(kKnown.begin(), kKnown.end(), it.key()) == kKnown.end()) {
      return FieldError(source, it.key(),
                        "unknown field: shardsync syncs block-FP8 weights (quant_method, "
                        "activation_scheme, fmt, weight_block_size, modules_to_not_convert / "
                        "ignored_layers) and will not ignore a setting it does not model");
    }
  }
  auto str = [&](std::string_view key, bool required) -> Result<std::optional<std::string>> {
    auto it = q->find(std::string(key));
    if (it == q->end() || it->is_null()) {
      if (required) return FieldError(source, key, "missing");
      return std::optional<std::string>();
    }
    if (!it->is_string()) {
      return FieldError(source, key, fmt::format("expected a string, got {}", Dump(*it)));
    }
    return std::optional<std::string>(it->get<std::string>());
  };
  SS_ASSIGN_OR_RETURN(auto method, str("quant_method", true));
  if (*method != "fp8") {
    return FieldError(source, "quant_method",
                      fmt::format("'{}' is not supported: shardsync syncs block FP8 only "
                                  "(quant_method fp8, weight_block_size [128, 128])",
                                  *method));
  }
  // Both engines read activation_scheme with get_from_keys (required), and block quantization
  // raises unless it is "dynamic".
  SS_ASSIGN_OR_RETURN(auto act, str("activation_scheme", true));
  if (*act != "dynamic") {
    return FieldError(source, "activation_scheme",
                      fmt::format("'{}': block-wise FP8 needs the dynamic activation scheme "
                                  "(the engines raise for any other)",
                                  *act));
  }
  SS_ASSIGN_OR_RETURN(auto fmt_name, str("fmt", false));
  if (fmt_name && *fmt_name != "e4m3") {
    return FieldError(source, "fmt",
                      fmt::format("'{}' is not supported: block FP8 weights are e4m3", *fmt_name));
  }
  SS_ASSIGN_OR_RETURN(auto scale_fmt, str("scale_fmt", false));
  if (scale_fmt) {
    return FieldError(source, "scale_fmt",
                      fmt::format("'{}' is not supported: shardsync writes fp32 block scales "
                                  "(amax / 448), not power-of-two ({}) scales",
                                  *scale_fmt, *scale_fmt));
  }
  SS_ASSIGN_OR_RETURN(auto kv, str("kv_cache_quant_algo", false));
  if (kv) {
    return FieldError(source, "kv_cache_quant_algo",
                      fmt::format("'{}' is not supported (an FP8 KV cache adds scale parameters "
                                  "shardsync does not model)",
                                  *kv));
  }
  QuantConfig qc;
  qc.origin = std::string(kField);
  auto wbs = q->find("weight_block_size");
  if (wbs == q->end() || wbs->is_null()) {
    return FieldError(source, "weight_block_size",
                      "missing: per-tensor FP8 (no weight_block_size) is not supported, only "
                      "block FP8 [128, 128]");
  }
  if (!wbs->is_array() || wbs->size() != 2 || !(*wbs)[0].is_number_integer() ||
      !(*wbs)[1].is_number_integer()) {
    return FieldError(source, "weight_block_size",
                      fmt::format("expected two integers [block_n, block_k], got {}", Dump(*wbs)));
  }
  qc.block_n = (*wbs)[0].get<int64_t>();
  qc.block_k = (*wbs)[1].get<int64_t>();
  for (std::string_view key : {"modules_to_not_convert", "ignored_layers"}) {
    auto it = q->find(std::string(key));
    if (it == q->end() || it->is_null()) continue;
    if (!it->is_array()) {
      return FieldError(source, key,
                        fmt::format("expected a list of module names, got {}", Dump(*it)));
    }
    for (const json& e : *it) {
      if (!e.is_string() || e.get<std::string>().empty()) {
        return FieldError(source, key, fmt::format("expected module names, got {}", Dump(e)));
      }
      qc.ignored_modules.push_back(e.get<std::string>());
    }
  }
  return std::optional<QuantConfig>(std::move(qc));
}

Status ValidateQuantConfig(const ModelSpec& spec) {
  if (!spec.quant) return OkStatus();
  const QuantConfig& q = *spec.quant;
  const std::string field = q.origin == "--quant" ? "--quant" : std::string(kField);
  if (q.block_n != kFp8Block || q.block_k != kFp8Block) {
    return InvalidArgumentError(
        fmt::format("field '{}.weight_block_size': [{}, {}] is not supported, only [128, 128]",
                    field, q.block_n, q.block_k));
  }
  if (q.ignored_modules.empty()) return OkStatus();
  // Fused projections load into one engine parameter of one precision; the engines raise
  // "Detected some but not all shards of ... are quantized" (is_layer_skipped).
  for (int64_t l = 0; l < spec.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    const std::vector<std::vector<std::string>> fused = {
        {p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"},
        {p + "mlp.gate_proj", p + "mlp.up_proj"}};
    for (const auto& group : fused) {
      const bool first = Ignored(q, group[0]);
      for (const std::string& m : group) {
        if (Ignored(q, m) != first) {
          return InvalidArgumentError(fmt::format(
              "field '{}.modules_to_not_convert': lists some but not all of the modules fused "
              "into one engine parameter ({}): the engines require one precision for all of "
              "them",
              field, fmt::format("{}", fmt::join(group, ", "))));
        }
      }
    }
    if (spec.IsMoeLayer(l)) {
      const std::string e = p + "mlp.experts.0.gate_proj";
      if (Ignored(q, e) || Ignored(q, p + "mlp.experts")) {
        return InvalidArgumentError(fmt::format(
            "field '{}.modules_to_not_convert': leaves experts of layer {} unquantized; the "
            "engines disagree on how a listed FusedMoE loads (SGLang skips it, older vLLM does "
            "not), so shardsync does not support it",
            field, l));
      }
    }
  }
  return OkStatus();
}

}  // namespace internal

Result<std::optional<QuantConfig>> ParseQuantFlag(std::string_view value) {
  if (value == "none") return std::optional<QuantConfig>();
  if (value == "fp8-block128") {
    QuantConfig q;
    q.origin = "--quant";
    return std::optional<QuantConfig>(std::move(q));
  }
  return InvalidArgumentError(fmt::format(
      "--quant: unknown value '{}', expected fp8-block128 (block-FP8 engine weights) or none",
      value));
}

std::string QuantConfigToString(const QuantConfig& q) {
  std::string s = fmt::format("fp8 e4m3 {}x{}", q.block_n, q.block_k);
  if (!q.ignored_modules.empty())
    s += fmt::format(" (not converted: {})", fmt::join(q.ignored_modules, ","));
  return s;
}

bool IsQuantizedWeight(const ModelSpec& spec, std::string_view hf_name) {
  if (!spec.quant) return false;
  const std::string_view module = LinearModule(hf_name);
  return !module.empty() && !Ignored(*spec.quant, module);
}

std::string WeightScaleName(std::string_view weight_name) {
  return std::string(weight_name) + "_scale_inv";
}

std::vector<HfTensor> HfCheckpointInventory(const ModelSpec& spec) {
  std::vector<HfTensor> inv = HfTensorInventory(spec);
  if (!spec.quant) return inv;
  std::vector<HfTensor> out;
  out.reserve(inv.size() * 2);
  for (HfTensor& t : inv) {
    if (!IsQuantizedWeight(spec, t.name) || t.shape.size() != 2) {
      out.push_back(std::move(t));
      continue;
    }
    HfTensor scale{WeightScaleName(t.name),
                   {(t.shape[0] + spec.quant->block_n - 1) / spec.quant->block_n,
                    (t.shape[1] + spec.quant->block_k - 1) / spec.quant->block_k},
                   DType::kF32};
    t.dtype = DType::kF8E4M3;
    out.push_back(std::move(t));
    out.push_back(std::move(scale));
  }
  return out;
}

}  // namespace shardsync
