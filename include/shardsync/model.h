// Model spec: a Hugging Face config.json reduced to what sharding, planning and the reference
// engine need, plus the HF tensor inventory (names, shapes, dtypes) it implies.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/region.h"
#include "shardsync/status.h"

namespace shardsync {

enum class Architecture { kLlama, kMistral, kQwen2, kQwen3, kQwen3Moe };

std::string_view ArchitectureName(Architecture a);  // "LlamaForCausalLM", ...

// Llama-3 style rope scaling ("rope_type": "llama3"); other types are kept by name only.
struct RopeScaling {
  std::string type;  // "llama3", "linear", "dynamic", "yarn", ...
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// Block-FP8 rollout weights (docs/fp8.md): every linear weight of attention and MLP (experts
// included) becomes float8_e4m3fn plus an fp32 `weight_scale_inv` per 128 x 128 block, the
// layout SGLang and vLLM load for `quantization_config: {quant_method: fp8, activation_scheme:
// dynamic, weight_block_size: [128, 128]}` (sglang srt/layers/quantization/fp8.py Fp8Config,
// vllm model_executor/layers/quantization/fp8.py Fp8Config). Embeddings, norms, biases, the MoE
// router gate and lm_head stay in the model dtype (the engines build them without the FP8
// method: VocabParallelEmbedding / ParallelLMHead get none, Qwen3-MoE's gate passes
// quant_config=None). The trainer keeps its unquantized weights; HfTensorInventory lists those.
struct QuantConfig {
  int64_t block_n = 128;  // weight_block_size[0]: output rows per block
  int64_t block_k = 128;  // weight_block_size[1]: input columns per block
  // modules_to_not_convert / ignored_layers as written: module names whose linears stay in the
  // model dtype, matched on dot boundaries ("lm_head", "model.layers.0.self_attn.q_proj",
  // "layers.3.mlp"), as SGLang's is_layer_skipped does since PR #23467.
  std::vector<std::string> ignored_modules;
  std::string origin;  // "quantization_config" (config.json) or "--quant"
};

struct ModelSpec {
  std::string name;  // embedded name or the path it was read from
  Architecture arch = Architecture::kLlama;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads
  int64_t head_dim = 0;             // config's head_dim, else hidden_size / num_attention_heads
  int64_t num_hidden_layers = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // Llama/Mistral: q/k/v/o biases
  bool qkv_bias = false;        // Qwen2: q/k/v biases (no o bias)
  bool qk_norm = false;         // Qwen3 / Qwen3-MoE: per-head q_norm / k_norm [head_dim]
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 4096;
  std::optional<RopeScaling> rope_scaling;
  // MoE (Qwen3-MoE); num_experts == 0 for dense models.
  int64_t num_experts = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_experts_per_tok = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  DType dtype = DType::kBF16;        // torch_dtype / dtype
  std::optional<QuantConfig> quant;  // engine weights in block FP8 (quantization_config)

  bool is_moe() const { return num_experts > 0; }
  // Qwen3-MoE rule: layer l is sparse iff l not in mlp_only_layers, num_experts > 0 and
  // (l + 1) % decoder_sparse_step == 0.
  bool IsMoeLayer(int64_t layer) const;
};

// Parses config.json text. `source` names the file in errors. Unknown architecture, a missing,
// mistyped, non-positive, overflowing or inconsistent field: InvalidArgument naming the field.
// A `quantization_config` is honoured (block FP8: ModelSpec::quant) or refused naming the field
// (any other method, block size, scale format or unknown key), never ignored.
Result<ModelSpec> ParseModelConfig(std::string_view json_text, std::string_view source);
// NAME (embedded, see EmbeddedModelNames) or PATH (a config.json, or a directory holding one).
Result<ModelSpec> LoadModelSpec(std::string_view name_or_path);
// Names usable with LoadModelSpec: qwen2.5-0.5b, qwen2.5-7b, qwen3-0.6b, qwen3-8b, qwen3-32b,
// qwen3-30b-a3b, qwen3-235b-a22b, llama-3.1-8b, llama-3.1-70b.
std::vector<std::string> EmbeddedModelNames();
// The embedded config.json text for a name (NotFound otherwise).
Result<std::string> EmbeddedModelConfig(std::string_view name);

// One tensor of the HF checkpoint.
struct HfTensor {
  std::string name;  // "model.layers.0.self_attn.q_proj.weight"
  Shape shape;       // PyTorch [out_features, in_features] for linear weights
  DType dtype = DType::kBF16;
  int64_t numel() const { return NumElements(shape); }
  int64_t bytes() const { return numel() * DTypeSize(dtype); }
};

// Every tensor of the HF checkpoint in a deterministic order: embed_tokens, then per layer
// (input_layernorm, q/k/v(/bias)/o, q_norm/k_norm, post_attention_layernorm, mlp: dense
// gate/up/down or MoE gate (router) then experts.{e}.gate_proj/up_proj/down_proj), then
// model.norm, then lm_head (absent when tied). All with the model's dtype.
// Exactly: q_proj.weight, q_proj.bias, k_proj.weight, k_proj.bias, v_proj.weight, v_proj.bias,
// o_proj.weight, o_proj.bias (biases only where the architecture has them).
std::vector<HfTensor> HfTensorInventory(const ModelSpec& spec);

// Consistency of a spec built by hand (ParseModelConfig already runs it): positive sizes,
// heads / kv heads / hidden divisibility, MoE fields, mlp_only_layers in range, and every tensor's
// element count and the model's byte total fit in int64. InvalidArgument naming the field.
Status ValidateModelSpec(const ModelSpec& spec);

// Global layer index of an HF or engine name ("model.layers.17.mlp..." -> 17), nullopt for
// names outside the layers (embed_tokens, norm, lm_head).
std::optional<int64_t> LayerIndexOf(std::string_view name);

// Total elements / bytes of the HF checkpoint (sum over HfTensorInventory).
int64_t ModelNumElements(const ModelSpec& spec);
int64_t ModelBytes(const ModelSpec& spec);

// ---- block FP8 (QuantConfig) ----

// `--quant`: "fp8-block128" (block FP8, overriding any quantization_config) or "none" (engine
// weights in the model dtype, dropping a config's quantization_config). InvalidArgument naming
// the flag otherwise.
Result<std::optional<QuantConfig>> ParseQuantFlag(std::string_view value);
// "fp8 e4m3 128x128" plus the ignored modules, for tables and the plan hash.
std::string QuantConfigToString(const QuantConfig& q);
// True when HF tensor `hf_name` is a weight the engine holds in FP8 (a linear of attention or the
// MLP / experts, not listed in ignored_modules). False for every tensor of an unquantized spec.
bool IsQuantizedWeight(const ModelSpec& spec, std::string_view hf_name);
// "…q_proj.weight" -> "…q_proj.weight_scale_inv" (the checkpoint's block-scale tensor).
std::string WeightScaleName(std::string_view weight_name);
// The tensors of the checkpoint the engine loads: HfTensorInventory with every quantized weight
// as float8_e4m3fn followed by its fp32 weight_scale_inv [ceil(out/128), ceil(in/128)]. Equals
// HfTensorInventory for an unquantized spec.
std::vector<HfTensor> HfCheckpointInventory(const ModelSpec& spec);

}  // namespace shardsync
