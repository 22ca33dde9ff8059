// Reference engine: a CPU forward pass (fp32 math over bf16 / f16 / fp32 weights) that proves a
// sync put every byte where the inference engine's math expects it.
//
// Two models share the same kernels but not the same weights:
//  * MakeReferenceModel: the unsharded Hugging Face model, reading HF tensors by name from a
//    WeightSource (a safetensors checkpoint, or synthetic weights from a seed).
//  * MakeShardedModel: the engine's TP x PP (x EP) computation run directly on ENGINE-LAYOUT
//    buffers (what the receivers filled), one set per engine rank; it never reads HF tensors.
//    The layout of each buffer (q heads vs replicated kv heads inside qkv_proj, gate | up halves,
//    vocab rows per rank, local experts) is recomputed here from the engine's rules, not taken
//    from the shard map's pieces, so a wrong shard map or a wrong sync changes the tokens.
// Supported: Llama, Mistral (no sliding window: prompts must stay below it), Qwen2 (q/k/v bias),
// Qwen3 (q_norm / k_norm), Qwen3-MoE (softmax router, top-k, norm_topk_prob, dense layers per
// ModelSpec::IsMoeLayer). RoPE: default, "linear" and Llama-3 ("llama3") scaling; other scaling
// types are Unimplemented.
//
// Typical use (the demo's generation step):
//   SS_ASSIGN_OR_RETURN(auto buffers, LoadEngineDump(dump_dir, shard_map));
//   SyntheticWeightSource trainer(shard_map.model, seed);
//   SS_ASSIGN_OR_RETURN(GenerationCheck g, CheckGeneration(shard_map, buffers, trainer,
//                                                          DefaultPrompt(), 8));
//   print g.reference_tokens, g.engine_tokens, g.match
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/model.h"
#include "shardsync/region.h"
#include "shardsync/safetensors.h"
#include "shardsync/shard_map.h"
#include "shardsync/status.h"

namespace shardsync {

// One engine parameter held in host memory (row-major).
struct HostTensor {
  DType dtype = DType::kBF16;
  Shape shape;
  std::vector<uint8_t> data;
  int64_t numel() const { return NumElements(shape); }
};

// One engine rank's parameters: engine parameter name -> buffer.
using EngineBuffers = std::map<std::string, HostTensor>;

struct TensorInfo {
  DType dtype = DType::kBF16;
  Shape shape;
};

// HF tensors by name. Implementations are immutable after construction and thread-safe.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // dtype and shape of an HF tensor; NotFound naming it.
  virtual Result<TensorInfo> Describe(std::string_view hf_name) const = 0;
  // Writes region `r` (rank of the tensor) of `hf_name`, converted to `dtype`, row-major into
  // `out` (r.numel() * DTypeSize(dtype) bytes). OutOfRange if `r` is outside the tensor.
  virtual Status Read(std::string_view hf_name, const Region& r, DType dtype, void* out) const = 0;
};

// HF tensors from a safetensors checkpoint (file, directory, or sharded directory).
class CheckpointWeightSource : public WeightSource {
 public:
  static Result<std::unique_ptr<CheckpointWeightSource>> Open(const std::string& path);
  const SafetensorsCheckpoint& checkpoint() const { return *ckpt_; }
  Result<TensorInfo> Describe(std::string_view hf_name) const override;
  Status Read(std::string_view hf_name, const Region& r, DType dtype, void* out) const override;

 private:
  std::unique_ptr<SafetensorsCheckpoint> ckpt_;
};

// Synthetic weights (synthetic.h) for every tensor of HfTensorInventory(spec), with the model's
// dtype: values are rounded to spec.dtype first, so a bf16 engine copy and the fp32 reference
// see identical numbers.
class SyntheticWeightSource : public WeightSource {
 public:
  SyntheticWeightSource(const ModelSpec& spec, uint64_t seed);
  Result<TensorInfo> Describe(std::string_view hf_name) const override;
  Status Read(std::string_view hf_name, const Region& r, DType dtype, void* out) const override;

 private:
  uint64_t seed_;
  DType dtype_;
  std::map<std::string, Shape, std::less<>> shapes_;
};

// ---- Block FP8 (docs/fp8.md) ----

// The block-FP8 checkpoint view of unquantized HF values: every tensor with
// IsQuantizedWeight(spec, name) reads as float8_e4m3fn (the quantizer of fp8.h, 128 x 128 blocks
// aligned to the tensor) and "<name>_scale_inv" reads as its fp32 block scales
// [ceil(rows/128), ceil(cols/128)]; every other tensor passes through. These are the bytes a sync
// of `values` lands in a block-FP8 engine. `values` must outlive this source.
class QuantizedWeightSource : public WeightSource {
 public:
  QuantizedWeightSource(const WeightSource& values, ModelSpec spec);
  Result<TensorInfo> Describe(std::string_view hf_name) const override;
  // Quantized weights only as F8_E4M3 and scales only as F32 (InvalidArgument otherwise).
  Status Read(std::string_view hf_name, const Region& r, DType dtype, void* out) const override;

 private:
  const WeightSource& values_;
  ModelSpec spec_;
};

// The dequantized view of a block-FP8 checkpoint (a safetensors FP8 checkpoint, or a
// QuantizedWeightSource): each quantized weight reads, under its HF name and shape, as
// e4m3 value * its block's scale in fp32, the weight an FP8 engine computes with. Other tensors
// pass through. `fp8` must outlive this source.
class DequantizedWeightSource : public WeightSource {
 public:
  DequantizedWeightSource(const WeightSource& fp8, ModelSpec spec);
  Result<TensorInfo> Describe(std::string_view hf_name) const override;
  Status Read(std::string_view hf_name, const Region& r, DType dtype, void* out) const override;

 private:
  const WeightSource& fp8_;
  ModelSpec spec_;
};

// True when `weights` already holds float8_e4m3fn weights for the quantized spec (an FP8
// checkpoint) rather than unquantized values.
bool HoldsFp8Weights(const WeightSource& weights, const ModelSpec& spec);

// A causal LM with a KV cache.
class CausalLm {
 public:
  virtual ~CausalLm() = default;
  virtual int64_t vocab_size() const = 0;
  // Runs `tokens` at the next positions (appending to the KV cache) and returns the fp32 logits
  // (vocab_size values) of the last one. InvalidArgument for an empty list or a token id outside
  // [0, vocab_size).
  virtual Result<std::vector<float>> Forward(std::span<const int64_t> tokens) = 0;
  // Clears the KV cache.
  virtual void Reset() = 0;
};

// ---- Host memory budget ----
// What this process may allocate: 80% of physical memory, capped by what RLIMIT_AS and
// RLIMIT_DATA leave (`this_process` false: the host's 80% only, for work spread over several
// processes); -1 when unknown. Every allocation the reference engine sizes from its input
// (config dims, checkpoint shapes, token counts) is checked against it first.
int64_t HostMemoryBudget(bool this_process = true);
// InvalidArgument "<what>: <purpose>: N GiB needed, more than ..." when `bytes` exceed
// HostMemoryBudget(this_process) (pass INT64_MAX for an estimate that overflowed): an absurd but
// valid config is refused before anything is allocated instead of aborting on std::bad_alloc.
Status CheckHostMemory(int64_t bytes, std::string_view what, std::string_view purpose,
                       bool this_process = true);

// The unsharded HF model. Checks every tensor of HfTensorInventory(spec) exists with its shape
// (NotFound / InvalidArgument naming it); weights are converted to fp32 once. The weights, and
// each Forward's activations and KV cache, are checked against HostMemoryBudget() first.
// A checkpoint tensor in a dtype other than F32 / BF16 / F16 / F64, or holding a NaN or an
// infinity, is InvalidArgument naming it (CheckpointWeightSource).
Result<std::unique_ptr<CausalLm>> MakeReferenceModel(const ModelSpec& spec,
                                                     const WeightSource& weights);

// The engine's TP x PP (x EP) forward over engine-layout buffers. Block-FP8 parameters (an e4m3
// weight with its weight_scale_inv) are dequantized per block, as the engine's own
// block-dequantizing reference (block_quant_dequant) does. `per_rank[pp * tp + tp_rank]`
// (ShardMap::ranks order) holds that rank's parameters; every parameter of the shard map must be
// present with its dtype and local shape, and nothing else (errors name the rank and parameter).
// Row-parallel partial sums (o_proj, down_proj, MoE experts) are summed across TP ranks, biases
// of row-parallel layers added once (rank 0); embedding and lm_head are vocab-parallel with
// padding rows ignored; layers come from the stage that owns them (ranks' layer ranges).
Result<std::unique_ptr<CausalLm>> MakeShardedModel(const ShardMap& map,
                                                   const std::vector<EngineBuffers>& per_rank);

// Cuts engine-rank buffers out of HF weights by applying the shard map's pieces and zero-fills
// (the bytes a correct sync delivers). Used by `generate --tp/--pp` and tests.
Result<std::vector<EngineBuffers>> CutEngineShards(const ShardMap& map,
                                                   const WeightSource& weights);

struct Generation {
  std::vector<int64_t> tokens;                  // generated tokens (prompt excluded)
  std::vector<std::vector<float>> step_logits;  // [i]: logits that chose tokens[i]; [0] = last
                                                // prompt position (one entry if max_new == 0)
};
// Greedy decoding (argmax, lowest id on ties) with the KV cache; resets the model first.
Result<Generation> GreedyGenerate(CausalLm& lm, std::span<const int64_t> prompt,
                                  int max_new_tokens);

// The demo's fixed prompt (token ids valid for any vocabulary of at least 64 tokens).
std::vector<int64_t> DefaultPrompt();

struct GenerationCheck {
  std::vector<int64_t> prompt;
  std::vector<int64_t> reference_tokens;  // unsharded model on the reference (trainer) weights
  std::vector<int64_t> engine_tokens;     // sharded model on the engine buffers
  bool tokens_identical = false;
  // Max |reference - engine| over the logits of every step both runs took with the same history.
  double max_logit_diff = 0;
  double tolerance = 0;  // the bound max_logit_diff was held to
  bool match = false;    // tokens_identical && max_logit_diff <= tolerance
};

// Default bound on |logit difference| between the two models when the engine buffers hold the
// reference weights' exact values: fp32 math differing only in summation order (TP partial sums).
// kLogitAbsTolerance + kLogitRelTolerance * max |reference logit|.
inline constexpr double kLogitAbsTolerance = 1e-3;
inline constexpr double kLogitRelTolerance = 1e-4;

// Greedy-decodes `n_tokens` from `prompt` with the sharded model on `per_rank` and with the
// unsharded model on `reference` (the trainer's unquantized values; for a block-FP8 map the
// unsharded model runs them quantized with the same quantizer, QuantizedWeightSource then
// DequantizedWeightSource), and compares. A mismatch is a result (match == false), not an
// error; errors are bad inputs (missing parameters, wrong shapes, bad token ids). `tolerance`
// < 0: the default bound above.
Result<GenerationCheck> CheckGeneration(const ShardMap& map,
                                        const std::vector<EngineBuffers>& per_rank,
                                        const WeightSource& reference,
                                        std::span<const int64_t> prompt, int n_tokens,
                                        double tolerance = -1);

// Engine dumps: each engine process writes the parameters it received as one safetensors file
// (any name ending in .safetensors, e.g. "rank-<sync_rank>.safetensors") into a directory; the
// engine-rank identity is stored in the file's __metadata__ ("shardsync.replica",
// "shardsync.tp_rank", "shardsync.pp_rank"), so file names carry no meaning.
struct EngineDumpInfo {
  int replica = 0;
  int tp_rank = 0;
  int pp_rank = 0;
};
Status WriteEngineDump(const std::string& path, const std::vector<TensorToWrite>& params,
                       const EngineDumpInfo& info);
Status WriteEngineDump(const std::string& path, const EngineBuffers& params,
                       const EngineDumpInfo& info);
// Reads every dump of `replica` in `dir` into ShardMap::ranks order. NotFound naming the missing
// engine rank; InvalidArgument for two files claiming one rank or a rank outside the map.
Result<std::vector<EngineBuffers>> LoadEngineDump(const std::string& dir, const ShardMap& map,
                                                  int replica = 0);
// The proof that a sync's bytes landed where the engine's math expects them: CheckGeneration on
// replica `replica`'s dumps in `dir` against the synthetic HF weights of `seed` as the engines
// hold them (`wire_dtype`; for a block-FP8 map, quantized weights from the trainer's values in
// `trainer_dtype`), from DefaultPrompt().
Result<GenerationCheck> CheckGenerationOfDump(const ShardMap& map, const std::string& dir,
                                              int replica, uint64_t seed, DType wire_dtype,
                                              int n_tokens, DType trainer_dtype = DType::kF32);

}  // namespace shardsync
