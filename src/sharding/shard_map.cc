// BuildShardMap: the SGLang / vLLM weight-loading rules for TP x PP (x EP) as region algebra
// (../shared/reference/engine-layouts.md sections 2-3). One table-driven place: if an engine
// changes a rule, this file changes.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "sharding/fp8_shard_map.h"
#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

constexpr int kMaxTp = 1 << 12;
constexpr int kMaxPp = 1 << 12;

Region R1(int64_t o, int64_t e) { return Region::Make({o}, {e}); }
Region R2(int64_t o0, int64_t e0, int64_t o1, int64_t e1) {
  return Region::Make({o0, o1}, {e0, e1});
}
Region R3(int64_t o0, int64_t e0, int64_t o1, int64_t e1, int64_t o2, int64_t e2) {
  return Region::Make({o0, o1, o2}, {e0, e1, e2});
}

std::string LayerPrefix(int64_t l) { return fmt::format("model.layers.{}.", l); }

// Builds the parameters of one (tp_rank, pp_rank).
class RankBuilder {
 public:
  RankBuilder(const ModelSpec& m, const ShardSpec& s, const ShardDims& d, int tp_rank)
      : m_(m), s_(s), d_(d), r_(tp_rank) {}

  void Vocab(std::vector<EngineParam>* out, const std::string& name, const std::string& source) {
    // VocabParallelEmbedding / ParallelLMHead: padded rows [r*per, (r+1)*per); real rows up to V
    // are loaded into param[:n], the rest zero-filled.
    const int64_t H = m_.hidden_size, V = m_.vocab_size, per = d_.vocab_per_rank;
    const int64_t start = r_ * per;
    const int64_t n = std::clamp<int64_t>(V - start, 0, per);
    EngineParam p = Param(name, {per, H});
    if (n > 0) p.pieces.push_back(Piece{source, R2(start, n, 0, H), R2(0, n, 0, H)});
    if (n < per) p.zero_fills.push_back(ZeroFill{R2(n, per - n, 0, H)});
    out->push_back(std::move(p));
  }

  void Replicated(std::vector<EngineParam>* out, const std::string& name, const Shape& shape) {
    EngineParam p = Param(name, shape);
    p.pieces.push_back(Piece{name, Region::Full(shape), Region::Full(shape)});
    out->push_back(std::move(p));
  }

  void Layer(std::vector<EngineParam>* out, int64_t l) {
    const std::string pre = LayerPrefix(l);
    const int64_t H = m_.hidden_size, hd = m_.head_dim;
    Replicated(out, pre + "input_layernorm.weight", {H});
    // QKVParallelLinear: [q | k | v], kv head s = r / replicas.
    const int64_t q_local = d_.q_heads_per_rank * hd, kv_local = d_.kv_heads_per_rank * hd;
    const int64_t q_src = r_ * q_local, kv_src = (r_ / d_.kv_head_replicas) * kv_local;
    const std::string att = pre + "self_attn.";
    {
      EngineParam p = Param(att + "qkv_proj.weight", {q_local + 2 * kv_local, H});
      p.pieces.push_back(
          Piece{att + "q_proj.weight", R2(q_src, q_local, 0, H), R2(0, q_local, 0, H)});
      p.pieces.push_back(
          Piece{att + "k_proj.weight", R2(kv_src, kv_local, 0, H), R2(q_local, kv_local, 0, H)});
      p.pieces.push_back(Piece{att + "v_proj.weight", R2(kv_src, kv_local, 0, H),
                               R2(q_local + kv_local, kv_local, 0, H)});
      out->push_back(std::move(p));
    }
    if (m_.attention_bias || m_.qkv_bias) {
      EngineParam p = Param(att + "qkv_proj.bias", {q_local + 2 * kv_local});
      p.pieces.push_back(Piece{att + "q_proj.bias", R1(q_src, q_local), R1(0, q_local)});
      p.pieces.push_back(Piece{att + "k_proj.bias", R1(kv_src, kv_local), R1(q_local, kv_local)});
      p.pieces.push_back(
          Piece{att + "v_proj.bias", R1(kv_src, kv_local), R1(q_local + kv_local, kv_local)});
      out->push_back(std::move(p));
    }
    // RowParallelLinear: columns [r*in/tp, (r+1)*in/tp); bias replicated.
    RowParallel(out, att + "o_proj.weight", H, m_.num_attention_heads * hd, s_.tp);
    if (m_.attention_bias) Replicated(out, att + "o_proj.bias", {H});
    if (m_.qk_norm) {
      Replicated(out, att + "q_norm.weight", {hd});
      Replicated(out, att + "k_norm.weight", {hd});
    }
    Replicated(out, pre + "post_attention_layernorm.weight", {H});
    if (m_.IsMoeLayer(l)) {
      Moe(out, pre);
    } else {
      // MergedColumnParallelLinear [gate | up].
      const int64_t I = m_.intermediate_size, Ip = I / s_.tp;
      EngineParam p = Param(pre + "mlp.gate_up_proj.weight", {2 * Ip, H});
      p.pieces.push_back(
          Piece{pre + "mlp.gate_proj.weight", R2(r_ * Ip, Ip, 0, H), R2(0, Ip, 0, H)});
      p.pieces.push_back(
          Piece{pre + "mlp.up_proj.weight", R2(r_ * Ip, Ip, 0, H), R2(Ip, Ip, 0, H)});
      out->push_back(std::move(p));
      RowParallel(out, pre + "mlp.down_proj.weight", H, I, s_.tp);
    }
  }

 private:
  EngineParam Param(std::string name, Shape shape) {
    EngineParam p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.dtype = m_.dtype;
    return p;
  }

  void RowParallel(std::vector<EngineParam>* out, const std::string& name, int64_t rows,
                   int64_t cols, int64_t tp) {
    const int64_t c = cols / tp;
    EngineParam p = Param(name, {rows, c});
    p.pieces.push_back(Piece{name, R2(0, rows, r_ * c, c), R2(0, rows, 0, c)});
    out->push_back(std::move(p));
  }

  // FusedMoE: router replicated; expert e lives on moe_ep_rank e / E_local; w13 [E_local, 2*Ip, H]
  // = [gate rows | up rows] of the moe_tp_rank slice; w2 [E_local, H, Ip] = down_proj columns.
  void Moe(std::vector<EngineParam>* out, const std::string& pre) {
    const int64_t H = m_.hidden_size, E = m_.num_experts;
    Replicated(out, pre + "mlp.gate.weight", {E, H});
    const int64_t El = d_.experts_per_rank, Ip = m_.moe_intermediate_size / d_.moe_tp;
    const int64_t ep_rank = r_ / d_.moe_tp, mtp_rank = r_ % d_.moe_tp;
    const std::string stack = s_.expert_naming == ExpertNaming::kRoutedExperts
                                  ? pre + "mlp.experts.routed_experts."
                                  : pre + "mlp.experts.";
    EngineParam w13 = Param(stack + "w13_weight", {El, 2 * Ip, H});
    EngineParam w2 = Param(stack + "w2_weight", {El, H, Ip});
    w13.pieces.reserve(2 * El);
    w2.pieces.reserve(El);
    for (int64_t le = 0; le < El; ++le) {
      const std::string ex = fmt::format("{}mlp.experts.{}.", pre, ep_rank * El + le);
      w13.pieces.push_back(
          Piece{ex + "gate_proj.weight", R2(mtp_rank * Ip, Ip, 0, H), R3(le, 1, 0, Ip, 0, H)});
      w13.pieces.push_back(
          Piece{ex + "up_proj.weight", R2(mtp_rank * Ip, Ip, 0, H), R3(le, 1, Ip, Ip, 0, H)});
      w2.pieces.push_back(
          Piece{ex + "down_proj.weight", R2(0, H, mtp_rank * Ip, Ip), R3(le, 1, 0, H, 0, Ip)});
    }
    out->push_back(std::move(w13));
    out->push_back(std::move(w2));
  }

  const ModelSpec& m_;
  const ShardSpec& s_;
  const ShardDims& d_;
  const int64_t r_;
};

std::string TpField(const ShardSpec& s) { return fmt::format("--tp {}", s.tp); }

}  // namespace

// A switch over every EngineKind, -Wswitch an error: an engine added to the enum does not compile
// until it has a name here (the plan hash and every message spell engines with it, so two engines
// must never share one).
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
std::string_view EngineKindName(EngineKind e) {
  switch (e) {
    case EngineKind::kSglang:
      return "sglang";
    case EngineKind::kVllm:
      return "vllm";
  }
  return "invalid-engine";  // not an EngineKind value
}
#pragma GCC diagnostic pop

Result<EngineKind> ParseEngineKind(std::string_view s, std::string_view field) {
  if (s == "sglang") return EngineKind::kSglang;
  if (s == "vllm") return EngineKind::kVllm;
  return InvalidArgumentError(
      fmt::format("{}: unknown engine '{}', expected 'sglang' or 'vllm'", field, s));
}

std::string_view ExpertNamingName(ExpertNaming n) {
  return n == ExpertNaming::kRoutedExperts ? "routed_experts" : "fused_moe";
}

Result<ExpertNaming> ParseExpertNaming(std::string_view s, std::string_view field) {
  if (s == "fused_moe") return ExpertNaming::kFusedMoe;
  if (s == "routed_experts") return ExpertNaming::kRoutedExperts;
  return InvalidArgumentError(fmt::format(
      "{}: unknown expert naming '{}', expected 'fused_moe' or 'routed_experts'", field, s));
}

int64_t PaddedVocabSize(int64_t vocab_size) {
  constexpr int64_t kPad = 64;  // DEFAULT_VOCAB_PADDING_SIZE in both engines
  if (vocab_size <= 0) return 0;
  return (vocab_size + kPad - 1) / kPad * kPad;
}

Result<std::pair<int64_t, int64_t>> PpLayerRange(EngineKind engine, int64_t num_layers, int pp_rank,
                                                 int pp, const std::vector<int64_t>& partition) {
  if (pp <= 0) return InvalidArgumentError(fmt::format("--pp: must be positive, got {}", pp));
  if (pp_rank < 0 || pp_rank >= pp) {
    return InvalidArgumentError(fmt::format("pp_rank {} is outside [0, {})", pp_rank, pp));
  }
  if (num_layers < pp) {
    // make_layers asserts num_hidden_layers >= pp_size in both engines.
    return InvalidArgumentError(
        fmt::format("--pp {}: num_hidden_layers {} is smaller than pp", pp, num_layers));
  }
  if (!partition.empty()) {
    if (static_cast<int64_t>(partition.size()) != pp) {
      return InvalidArgumentError(
          fmt::format("--pp-partition: has {} entries, --pp is {}", partition.size(), pp));
    }
    int64_t sum = 0;
    for (size_t i = 0; i < partition.size(); ++i) {
      // Every stage holds at least one decoder layer (the planner, `plan` and `run` always
      // required it; `shards` and `generate` used to accept an empty stage).
      if (partition[i] < 1 || partition[i] > num_layers) {
        return InvalidArgumentError(fmt::format(
            "--pp-partition: entry {} is {}, outside [1, {}] (every stage needs a layer)", i,
            partition[i], num_layers));
      }
      sum += partition[i];
    }
    if (sum != num_layers) {
      return InvalidArgumentError(fmt::format(
          "--pp-partition: entries sum to {}, num_hidden_layers is {}", sum, num_layers));
    }
    int64_t start = 0;
    for (int i = 0; i < pp_rank; ++i) start += partition[i];
    return std::make_pair(start, start + partition[pp_rank]);
  }
  const int64_t base = num_layers / pp, rem = num_layers % pp;
  if (engine == EngineKind::kSglang) {
    // The last `rem` stages get one extra layer.
    if (pp_rank >= pp - rem) {
      const int64_t start = pp_rank * (base + 1) - (pp - rem);
      return std::make_pair(start, start + base + 1);
    }
    return std::make_pair(pp_rank * base, pp_rank * base + base);
  }
  // vLLM: parts[-i] += 1 for i in 2..rem+1: stages pp-2, pp-3, ..., pp-1-rem get one extra.
  int64_t start = 0;
  auto count = [&](int i) { return base + ((i <= pp - 2 && i >= pp - 1 - rem) ? 1 : 0); };
  for (int i = 0; i < pp_rank; ++i) start += count(i);
  return std::make_pair(start, start + count(pp_rank));
}

Result<ShardDims> ComputeShardDims(const ModelSpec& m, const ShardSpec& s) {
  SS_RETURN_IF_ERROR(ValidateModelSpec(m));
  if (s.tp <= 0 || s.tp > kMaxTp) {
    return InvalidArgumentError(fmt::format("--tp: must be in [1, {}], got {}", kMaxTp, s.tp));
  }
  if (s.pp <= 0 || s.pp > kMaxPp) {
    return InvalidArgumentError(fmt::format("--pp: must be in [1, {}], got {}", kMaxPp, s.pp));
  }
  if (s.ep <= 0) return InvalidArgumentError(fmt::format("--ep: must be positive, got {}", s.ep));
  if (s.expert_naming == ExpertNaming::kRoutedExperts && s.engine != EngineKind::kVllm) {
    // Only vLLM >= 0.24 has the RoutedExperts child; SGLang keeps experts on FusedMoE.
    return InvalidArgumentError(fmt::format(
        "expert_naming 'routed_experts' is vLLM's (>= 0.24) naming; engine {} names its experts "
        "'...mlp.experts.w13_weight' (fused_moe)",
        EngineKindName(s.engine)));
  }
  ShardDims d;
  const int64_t tp = s.tp;
  const std::string tpf = TpField(s);
  if (m.num_attention_heads % tp != 0) {
    return InvalidArgumentError(fmt::format("{}: num_attention_heads {} is not divisible by tp",
                                            tpf, m.num_attention_heads));
  }
  d.q_heads_per_rank = m.num_attention_heads / tp;
  const int64_t nkv = m.num_key_value_heads;
  if (tp >= nkv) {
    if (tp % nkv != 0) {
      return InvalidArgumentError(fmt::format(
          "{}: tp is not a multiple of num_key_value_heads {} (needed to replicate kv heads)", tpf,
          nkv));
    }
    d.kv_heads_per_rank = 1;
    d.kv_head_replicas = tp / nkv;
  } else {
    if (nkv % tp != 0) {
      return InvalidArgumentError(
          fmt::format("{}: num_key_value_heads {} is not divisible by tp", tpf, nkv));
    }
    d.kv_heads_per_rank = nkv / tp;
  }
  d.padded_vocab = PaddedVocabSize(m.vocab_size);
  if (d.padded_vocab % tp != 0) {
    return InvalidArgumentError(
        fmt::format("{}: padded vocab {} (vocab_size {} padded to 64) is not divisible by tp", tpf,
                    d.padded_vocab, m.vocab_size));
  }
  d.vocab_per_rank = d.padded_vocab / tp;
  bool any_dense = false;
  for (int64_t l = 0; l < m.num_hidden_layers && !any_dense; ++l) any_dense = !m.IsMoeLayer(l);
  if (any_dense && m.intermediate_size % tp != 0) {
    return InvalidArgumentError(
        fmt::format("{}: intermediate_size {} is not divisible by tp", tpf, m.intermediate_size));
  }
  d.moe_ep = s.ep;
  if (!m.is_moe()) {
    if (s.ep != 1) {
      return InvalidArgumentError(fmt::format(
          "--ep {}: expert parallelism needs an MoE model; {} has no experts", s.ep, m.name));
    }
    return d;
  }
  const int64_t E = m.num_experts;
  if (tp > E) {
    // Qwen3MoE raises when tp_size > num_experts (both engines).
    return InvalidArgumentError(fmt::format("{}: tp is larger than num_experts {}", tpf, E));
  }
  if (s.engine == EngineKind::kSglang) {
    if (tp % s.ep != 0) {
      return InvalidArgumentError(fmt::format("--ep {}: tp {} is not divisible by ep", s.ep, tp));
    }
    d.moe_tp = tp / s.ep;
  } else {
    // vLLM expert parallelism is all-or-nothing: --enable-expert-parallel makes ep = tp.
    if (s.ep != 1 && s.ep != tp) {
      return InvalidArgumentError(
          fmt::format("--ep {}: vLLM supports ep 1 (MoE tensor parallel) or ep == tp {} "
                      "(--enable-expert-parallel)",
                      s.ep, tp));
    }
    d.moe_tp = s.ep == 1 ? tp : 1;
  }
  if (E % s.ep != 0) {
    // SGLang asserts it; for vLLM's linear placement an uneven split is legal upstream but not
    // supported here.
    return InvalidArgumentError(
        fmt::format("--ep {}: num_experts {} is not divisible by ep", s.ep, E));
  }
  d.experts_per_rank = E / s.ep;
  if (m.moe_intermediate_size % d.moe_tp != 0) {
    return InvalidArgumentError(fmt::format(
        "--ep {}: moe_intermediate_size {} is not divisible by the MoE tp size {} (tp / ep)", s.ep,
        m.moe_intermediate_size, d.moe_tp));
  }
  return d;
}

Result<ShardMap> BuildShardMap(const ModelSpec& model, const ShardSpec& spec) {
  SS_ASSIGN_OR_RETURN(ShardDims d, ComputeShardDims(model, spec));
  ShardMap map;
  map.spec = spec;
  map.model = model;
  map.ranks.reserve(static_cast<size_t>(spec.tp) * spec.pp);
  const bool tied = model.tie_word_embeddings;
  for (int pp_rank = 0; pp_rank < spec.pp; ++pp_rank) {
    SS_ASSIGN_OR_RETURN(auto range, PpLayerRange(spec.engine, model.num_hidden_layers, pp_rank,
                                                 spec.pp, spec.pp_partition));
    const bool first = pp_rank == 0, last = pp_rank == spec.pp - 1;
    for (int tp_rank = 0; tp_rank < spec.tp; ++tp_rank) {
      EngineRankShards rs;
      rs.tp_rank = tp_rank;
      rs.pp_rank = pp_rank;
      rs.moe_ep_rank = model.is_moe() ? static_cast<int>(tp_rank / d.moe_tp) : 0;
      rs.moe_tp_rank = model.is_moe() ? static_cast<int>(tp_rank % d.moe_tp) : 0;
      rs.layer_start = range.first;
      rs.layer_end = range.second;
      RankBuilder b(model, spec, d, tp_rank);
      const std::string embed = "model.embed_tokens.weight";
      // vLLM's last stage of a tied model owns its own embed_tokens (the head ties to it).
      if (first || (last && tied && spec.engine == EngineKind::kVllm))
        b.Vocab(&rs.params, embed, embed);
      for (int64_t l = range.first; l < range.second; ++l) b.Layer(&rs.params, l);
      if (last) {
        b.Replicated(&rs.params, "model.norm.weight", {model.hidden_size});
        if (!tied) {
          b.Vocab(&rs.params, "lm_head.weight", "lm_head.weight");
        } else if (spec.pp > 1 && spec.engine == EngineKind::kSglang) {
          // SGLang pp > 1 + tied: a separate ParallelLMHead filled from the embedding.
          b.Vocab(&rs.params, "lm_head.weight", embed);
        }
      }
      map.ranks.push_back(std::move(rs));
    }
  }
  // Block-FP8 engines: weight + weight_scale_inv per quantized parameter (fp8_shard_map.cc).
  if (model.quant) SS_RETURN_IF_ERROR(internal::QuantizeShardMap(&map));
  return map;
}

int64_t EngineRankShards::bytes() const {
  int64_t n = 0;
  for (const auto& p : params) n += p.bytes();
  return n;
}

const EngineParam* FindParam(const EngineRankShards& rank, std::string_view name) {
  for (const auto& p : rank.params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

Result<std::vector<int64_t>> ParsePpPartition(std::string_view csv, std::string_view field) {
  std::vector<int64_t> out;
  if (csv.empty()) return InvalidArgumentError(fmt::format("{}: empty", field));
  size_t pos = 0;
  while (pos <= csv.size()) {
    size_t comma = csv.find(',', pos);
    if (comma == std::string_view::npos) comma = csv.size();
    std::string_view tok = csv.substr(pos, comma - pos);
    while (!tok.empty() && tok.front() == ' ') tok.remove_prefix(1);
    while (!tok.empty() && tok.back() == ' ') tok.remove_suffix(1);
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    if (tok.empty() || ec != std::errc() || ptr != tok.data() + tok.size() || v < 1) {
      return InvalidArgumentError(
          fmt::format("{}: '{}' is not a positive layer count (expected e.g. 9,10,9)", field, tok));
    }
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

}  // namespace shardsync
