// Block-FP8 engine parameters: weight (float8_e4m3fn) + weight_scale_inv (fp32 per 128 x 128
// block), with exact ownership under TP / PP / EP. The engine rules, read from their source:
//  * Linear layers (sglang srt/layers/quantization/fp8.py Fp8LinearMethod.create_fp8_weight_,
//    vllm model_executor/layers/quantization/fp8.py Fp8LinearMethod.create_weights):
//    weight [out_per_partition, in_per_partition] e4m3, weight_scale_inv
//    [ceil(out_per_partition / 128), ceil(in_per_partition / 128)] fp32.
//  * Fused qkv_proj / gate_up_proj keep one scale row block per part: the loaders narrow the
//    checkpoint scale by ceil(shard_offset / block_n) and ceil(shard_size / block_n)
//    (QKVParallelLinear / MergedColumnParallelLinear weight_loader_v2 with a
//    BlockQuantScaleParameter), the kv head of a replicated kv rank included (tp_rank /
//    num_kv_head_replicas). Because every part is a multiple of 128 rows (checked below, as the
//    engines do), each engine block is exactly one 128 x 128 block of one HF tensor, and its
//    scale is that block's scale.
//  * FusedMoE (Fp8MoEMethod.create_fp8_moe_weight_): w13_weight_scale_inv
//    [E_local, 2 * ceil(I_p / 128), ceil(H / 128)], w2_weight_scale_inv
//    [E_local, ceil(H / 128), ceil(I_p / 128)].
//  * Checks (validate_block_quant_shapes, sglang and vllm alike): with tp > 1 a row-parallel
//    input_size_per_partition and a column-parallel output partition must be multiples of the
//    block, and every part of a merged weight must be, even at tp 1; FusedMoE requires
//    I_p % block_n == 0 always and I_p % block_k == 0 with moe tp > 1.
// Here all of those reduce to one rule per piece and per matrix dim: the source and destination
// offsets sit on the 128 grid, and the extent is a multiple of 128 unless it ends both tensors
// (the partial last block of an unsplit dim, e.g. o_proj rows of a model with hidden 1000).
#include "sharding/fp8_shard_map.h"

#include <fmt/format.h>

#include <unordered_map>

#include "shardsync/fp8.h"

namespace shardsync::internal {
namespace {

constexpr int64_t B = kFp8Block;

bool IsMoeParam(const EngineParam& p) { return p.shape.size() == 3; }

// The engines' error text for a misaligned dim of `p` (matrix dim 0 = output rows, 1 = input
// columns).
std::string EngineWording(const EngineParam& p, int dim, int64_t size) {
  if (IsMoeParam(p)) {
    const bool w13 = p.name.find("w13_weight") != std::string::npos;
    if (w13 && dim == 0) {
      return fmt::format(
          "The output_size of gate's and up's weight = {} is not divisible by weight "
          "quantization block_n = {}.",
          size, B);
    }
    return fmt::format(
        "The input_size of down's weight = {} is not divisible by weight quantization block_k = "
        "{}.",
        size, B);
  }
  return dim == 0 ? fmt::format(
                        "Weight output_partition_size = {} is not divisible by weight "
                        "quantization block_n = {}.",
                        size, B)
                  : fmt::format(
                        "Weight input_size_per_partition = {} is not divisible by weight "
                        "quantization block_k = {}.",
                        size, B);
}

// Scale-block region of a weight region of a tensor of `shape` (the last two dims are the
// matrix; leading dims are kept).
Region BlockRegion(const Region& r) {
  Region b = r;
  for (int i = r.ndim - 2; i < r.ndim; ++i) {
    b.offset[i] = r.offset[i] / B;
    b.extent[i] = CeilDiv(r.offset[i] + r.extent[i], B) - b.offset[i];
  }
  return b;
}

Shape BlockShape(const Shape& s) {
  Shape b = s;
  for (size_t i = s.size() - 2; i < s.size(); ++i) b[i] = CeilDiv(s[i], B);
  return b;
}

}  // namespace

Status QuantizeShardMap(ShardMap* map) {
  const ModelSpec& m = map->model;
  if (!m.quant) return OkStatus();
  const std::string field = m.is_moe() ? fmt::format("--tp {} --ep {}", map->spec.tp, map->spec.ep)
                                       : fmt::format("--tp {}", map->spec.tp);
  std::unordered_map<std::string, Shape> hf_shapes;
  for (const HfTensor& t : HfTensorInventory(m)) hf_shapes.emplace(t.name, t.shape);
  for (EngineRankShards& rank : map->ranks) {
    std::vector<EngineParam> out;
    out.reserve(rank.params.size() * 2);
    for (EngineParam& p : rank.params) {
      int quantized = 0;
      for (const Piece& pc : p.pieces) quantized += IsQuantizedWeight(m, pc.source) ? 1 : 0;
      if (quantized == 0) {
        out.push_back(std::move(p));
        continue;
      }
      const std::string where =
          fmt::format("engine parameter '{}' on {} rank (tp {}, pp {})", p.name,
                      EngineKindName(map->spec.engine), rank.tp_rank, rank.pp_rank);
      if (quantized != static_cast<int>(p.pieces.size()) || p.shape.size() < 2 ||
          !p.zero_fills.empty()) {
        return InternalError(fmt::format(
            "{}: mixes quantized and unquantized sources (quantization_config validation should "
            "have refused it)",
            where));
      }
      EngineParam scale;
      scale.name = WeightScaleName(p.name);
      scale.shape = BlockShape(p.shape);
      scale.dtype = DType::kF32;
      for (const Piece& pc : p.pieces) {
        const Shape& hf = hf_shapes.at(pc.source);
        const int off = pc.dst.ndim - pc.src.ndim;
        for (int d = 0; d < 2; ++d) {
          const int si = pc.src.ndim - 2 + d, di = si + off;
          const int64_t so = pc.src.offset[si], dof = pc.dst.offset[di], ext = pc.src.extent[si];
          const bool ends = so + ext == hf[si] && dof + ext == p.shape[di];
          if (so % B != 0 || dof % B != 0 || (ext % B != 0 && !ends)) {
            return InvalidArgumentError(fmt::format(
                "{}: {} takes {} [{}, {}) ({} dim) of '{}', which is not on the {}-element block "
                "grid of block-FP8 weights; SGLang and vLLM refuse this layout: \"{}\"",
                field, where, d == 0 ? "rows" : "columns", so, so + ext,
                d == 0 ? "output" : "input", pc.source, B, EngineWording(p, d, ext)));
          }
        }
        scale.pieces.push_back(
            Piece{WeightScaleName(pc.source), BlockRegion(pc.src), BlockRegion(pc.dst)});
      }
      p.dtype = DType::kF8E4M3;
      out.push_back(std::move(p));
      out.push_back(std::move(scale));
    }
    rank.params = std::move(out);
  }
  return OkStatus();
}

}  // namespace shardsync::internal
