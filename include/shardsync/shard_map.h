// Shard map: exactly which bytes of which HF tensor every engine rank owns, under the SGLang or
// vLLM rules for TP x PP (x EP) (../shared/reference/engine-layouts.md sections 2-3).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/model.h"
#include "shardsync/region.h"
#include "shardsync/status.h"

namespace shardsync {

enum class EngineKind { kSglang, kVllm };
std::string_view EngineKindName(EngineKind e);  // "sglang" | "vllm"
Result<EngineKind> ParseEngineKind(std::string_view s, std::string_view field = "--engine");

// How the engine names its stacked expert parameters. vLLM >= 0.24 (PR #41184) moved them from
// FusedMoE onto a RoutedExperts child: "...mlp.experts.routed_experts.w13_weight"
// (vllm/model_executor/layers/fused_moe/routed_experts.py; model_loader/weight_utils.py
// maybe_remap_moe_expert_param_name). SGLang and older vLLM: "...mlp.experts.w13_weight".
enum class ExpertNaming { kFusedMoe, kRoutedExperts };
std::string_view ExpertNamingName(ExpertNaming n);  // "fused_moe" | "routed_experts"
Result<ExpertNaming> ParseExpertNaming(std::string_view s,
                                       std::string_view field = "expert_naming");

struct ShardSpec {
  EngineKind engine = EngineKind::kSglang;
  int tp = 1;
  int pp = 1;
  int ep = 1;  // SGLang ep_size (moe_tp = tp / ep); vLLM: 1 (off) or tp (--enable-expert-parallel)
  // Explicit per-stage layer counts (*_PP_LAYER_PARTITION); empty: the engine's default rule.
  std::vector<int64_t> pp_partition;
  // Expert parameter names (kRoutedExperts: vLLM only). Part of the plan hash when not default.
  ExpertNaming expert_naming = ExpertNaming::kFusedMoe;
};

// Bytes of HF tensor `source` that land in an engine parameter. `src` has the source tensor's
// rank; `dst` has the parameter's rank and the same number of elements (a 2-d expert matrix
// landing in a 3-d stack has a leading extent of 1 in `dst`).
struct Piece {
  std::string source;  // HF tensor name
  Region src;
  Region dst;
};

// Parameter elements the engine zero-fills (padded vocab rows).
struct ZeroFill {
  Region dst;
};

struct EngineParam {
  std::string
      name;     // engine name, global layer index kept: "model.layers.27.mlp.gate_up_proj.weight"
  Shape shape;  // local shape on this rank
  DType dtype = DType::kBF16;
  std::vector<Piece> pieces;
  std::vector<ZeroFill> zero_fills;
  int64_t numel() const { return NumElements(shape); }
  int64_t bytes() const { return numel() * DTypeSize(dtype); }
};

struct EngineRankShards {
  int tp_rank = 0;
  int pp_rank = 0;
  int moe_ep_rank = 0;      // for MoE: tp_rank / moe_tp
  int moe_tp_rank = 0;      // for MoE: tp_rank % moe_tp
  int64_t layer_start = 0;  // half-open range of global layer indices this stage owns
  int64_t layer_end = 0;
  // Deterministic, the engine's named_parameters order: embed_tokens, the layers in order (within
  // a layer, HF inventory order of each param's first source), model.norm, lm_head.
  std::vector<EngineParam> params;
  int64_t bytes() const;
};

// One replica's shard map. ranks[pp * tp + tp_rank] (the engines' global rank order).
struct ShardMap {
  ShardSpec spec;
  ModelSpec model;
  std::vector<EngineRankShards> ranks;
  const EngineRankShards& rank(int tp_rank, int pp_rank) const {
    return ranks[static_cast<size_t>(pp_rank) * spec.tp + tp_rank];
  }
};

// Half-open global layer range [start, end) of stage `pp_rank` under the engine's rule, or the
// explicit partition when given (must have pp entries summing to num_layers).
Result<std::pair<int64_t, int64_t>> PpLayerRange(EngineKind engine, int64_t num_layers, int pp_rank,
                                                 int pp,
                                                 const std::vector<int64_t>& partition = {});

// Padded vocabulary (multiple of 64) as the engines compute it.
int64_t PaddedVocabSize(int64_t vocab_size);

// Builds the shard map; checks up front every divisibility the engine asserts (InvalidArgument
// naming the field, e.g. "--tp 3: num_attention_heads 28 is not divisible by tp").
Result<ShardMap> BuildShardMap(const ModelSpec& model, const ShardSpec& spec);

// Exact cover: every parameter covered once by pieces and zero-fills; every source region inside
// its HF tensor. Error names the rank, parameter and region.
Status ValidateShardMap(const ShardMap& map);

// ---- helpers ----

// The parameter named `name` on a rank, or nullptr.
const EngineParam* FindParam(const EngineRankShards& rank, std::string_view name);

// "9,10,9" -> {9, 10, 9}; errors name `field`.
Result<std::vector<int64_t>> ParsePpPartition(std::string_view csv,
                                              std::string_view field = "--pp-partition");

// Derived per-engine sizes (what BuildShardMap uses), for callers that report them.
struct ShardDims {
  int64_t padded_vocab = 0;       // PaddedVocabSize(vocab_size)
  int64_t vocab_per_rank = 0;     // padded_vocab / tp
  int64_t q_heads_per_rank = 0;   // num_attention_heads / tp
  int64_t kv_heads_per_rank = 0;  // max(1, num_key_value_heads / tp)
  int64_t kv_head_replicas = 1;   // tp / num_key_value_heads when tp >= kv heads, else 1
  int64_t moe_tp = 1;             // SGLang: tp / ep; vLLM: tp (ep 1) or 1 (ep == tp)
  int64_t moe_ep = 1;             // ep
  int64_t experts_per_rank = 0;   // num_experts / ep
};
// Checks every divisibility the engine asserts (the same errors BuildShardMap returns).
Result<ShardDims> ComputeShardDims(const ModelSpec& model, const ShardSpec& spec);

// ---- renderings (`shardsync shards`; schema in docs/cli.md) ----

// Every rank of the map, in map order (the default selection for the renderers below).
std::vector<const EngineRankShards*> AllRanks(const ShardMap& map);
// Header (model, engine, factors) and one row per selected rank: layers, params, elements, bytes,
// percentage of the checkpoint; footer with the replica total.
std::string ShardMapToTable(const ShardMap& map, const std::vector<const EngineRankShards*>& ranks);
// {model, engine, tp, pp, ep, ranks: [{tp_rank, pp_rank, moe_ep_rank, moe_tp_rank, layers,
// params: [{name, shape, dtype, pieces: [{source, src_offset, dst_offset, extent}],
// zero_fill: [{offset, extent}]}]}]}, one line.
std::string ShardMapToJson(const ShardMap& map, const std::vector<const EngineRankShards*>& ranks);
// ExplainParam for every selected rank holding engine parameter `name`; given an HF tensor name
// instead, where its bytes land. NotFound if neither.
Result<std::string> ExplainParamOnRanks(const ShardMap& map,
                                        const std::vector<const EngineRankShards*>& ranks,
                                        std::string_view name);

// Human-readable account of where every byte of engine parameter `name` on `rank` comes from
// (one line per piece and zero-fill). NotFound if the rank has no such parameter.
Result<std::string> ExplainParam(const ShardMap& map, const EngineRankShards& rank,
                                 std::string_view name);

}  // namespace shardsync
