// Megatron-Core layouts: parsing, rank coordinates, the layers of each model chunk, the sizes
// Megatron derives from a model, and who holds a piece. Facts from Megatron-Core 0.11 through 0.19
// (NVIDIA/Megatron-LM main of 2026-08, d98e8a6; the expert grid and uneven stages arrived in 0.11,
// num_query_groups < tp in 0.16); each rule names its file and function.
#include <fmt/format.h>

#include <charconv>

#include "plan/megatron.h"

namespace shardsync {
namespace {

using plan_internal::kMaxRanks;

Result<int64_t> ParseCount(std::string_view text, std::string_view key) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size()) {
    return InvalidArgumentError(
        fmt::format("--trainer megatron {}: expected a positive integer, got '{}'", key, text));
  }
  if (v <= 0 || v > kMaxRanks) {
    return InvalidArgumentError(
        fmt::format("--trainer megatron {}: must be in [1, {}], got {}", key, kMaxRanks, v));
  }
  return v;
}

}  // namespace

std::string MegatronLayout::ToString() const {
  std::string s = fmt::format("megatron=tp={},pp={}", tp, pp);
  if (vpp != 1) s += fmt::format(",vpp={}", vpp);
  if (ep != 1) s += fmt::format(",ep={}", ep);
  if (etp != tp) s += fmt::format(",etp={}", etp);
  if (cp != 1) s += fmt::format(",cp={}", cp);
  if (dp != 1) s += fmt::format(",dp={}", dp);
  if (first != 0) s += fmt::format(",first={}", first);
  if (last != 0) s += fmt::format(",last={}", last);
  if (vocab_div != 128) s += fmt::format(",vocab_div={}", vocab_div);
  // The local spec implies SequentialMLP (the parser refuses grouped with it).
  if (sequential_experts && !local_norms) s += ",experts=sequential";
  if (local_norms) s += ",norms=local";
  if (glu_interleave != 0) s += fmt::format(",glu_interleave={}", glu_interleave);
  return s;
}

// parallel_state.py RankGenerator / generate_masked_orthogonal_rank_groups, default order
// "tp-cp-ep-dp-pp": the first token varies fastest. The dense generator has ep = 1, the expert
// generator has tp = expert_tensor_parallel_size, cp = 1 and dp = expert data parallel.
MegatronCoords MegatronRankCoords(const MegatronLayout& m, int rank) {
  MegatronCoords c;
  int r = rank;
  c.tp = r % m.tp;
  r /= m.tp;
  c.cp = r % m.cp;
  r /= m.cp;
  c.dp = r % m.dp;
  c.pp = r / m.dp;
  r = rank;
  c.etp = r % m.etp;
  r /= m.etp;
  c.ep = r % m.ep;
  c.edp = (r / m.ep) % m.expert_dp();
  return c;
}

int MegatronDenseRank(const MegatronLayout& m, int tp, int cp, int dp, int pp) {
  return tp + m.tp * (cp + m.cp * (dp + m.dp * pp));
}

int MegatronExpertRank(const MegatronLayout& m, int etp, int ep, int edp, int pp) {
  return etp + m.etp * (ep + m.ep * (edp + m.expert_dp() * pp));
}

int64_t MegatronPaddedVocab(const MegatronLayout& m, int64_t vocab_size) {
  // megatron/core/tokenizers/utils/build_tokenizer.py vocab_size_with_padding.
  const int64_t multiple = int64_t{m.vocab_div} * m.tp;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

Result<std::pair<int64_t, int64_t>> MegatronChunkLayers(const MegatronLayout& m, int64_t num_layers,
                                                        int pp_rank, int chunk) {
  const int P = m.pp, V = m.vpp;
  if (pp_rank < 0 || pp_rank >= P || chunk < 0 || chunk >= V) {
    return OutOfRangeError(fmt::format("megatron: pipeline rank {} / chunk {} outside pp={} vpp={}",
                                       pp_rank, chunk, P, V));
  }
  if (P == 1) return std::make_pair(int64_t{0}, num_layers);
  const std::string f = m.ToString();
  if (m.first == 0 && m.last == 0) {
    // transformer_block.py get_num_layers_to_build: num_layers % pp == 0 and, interleaved,
    // (num_layers / pp) % vpp == 0; transformer_layer.py get_transformer_layer_offset:
    // vp_stage * (L / vpp) + pp_rank * (L / pp / vpp).
    if (num_layers % P != 0) {
      return InvalidArgumentError(fmt::format(
          "--trainer {}: num_hidden_layers {} is not divisible by pp (Megatron's even split; set "
          "first=/last= for uneven stages)",
          f, num_layers));
    }
    const int64_t per = num_layers / P;
    if (per % V != 0) {
      return InvalidArgumentError(fmt::format(
          "--trainer {} vpp: {} layers per pipeline rank are not divisible by vpp", f, per));
    }
    const int64_t per_v = per / V;
    const int64_t start = chunk * (num_layers / V) + pp_rank * per_v;
    return std::make_pair(start, start + per_v);
  }
  // Uneven first / last stages (transformer_config.py __post_init__ checks,
  // get_num_layers_to_build, get_transformer_layer_offset).
  const int64_t first = m.first, last = m.last;
  const int mid_stages = P - (first > 0 ? 1 : 0) - (last > 0 ? 1 : 0);
  const int64_t mid_layers = num_layers - first - last;
  if (mid_layers < 0 || (mid_layers > 0) != (mid_stages > 0)) {
    return InvalidArgumentError(fmt::format(
        "--trainer {} first/last: {} layers remain for {} middle stages (num_hidden_layers {})", f,
        mid_layers, mid_stages, num_layers));
  }
  if (mid_stages > 0 && mid_layers % mid_stages != 0) {
    return InvalidArgumentError(fmt::format(
        "--trainer {} first/last: the {} middle layers are not divisible by the {} middle stages",
        f, mid_layers, mid_stages));
  }
  const int64_t per_mid = mid_stages > 0 ? mid_layers / mid_stages : 0;
  // transformer_config.py: first, last and each middle stage's count divisible by vpp.
  for (const auto& [what, n] : {std::pair<const char*, int64_t>{"first", first},
                                {"last", last},
                                {"middle stage", per_mid}}) {
    if (n > 0 && n % V != 0) {
      return InvalidArgumentError(fmt::format(
          "--trainer {} vpp: the {} layer count {} is not divisible by vpp", f, what, n));
    }
  }
  const int64_t count = (pp_rank == 0 && first > 0)      ? first
                        : (pp_rank == P - 1 && last > 0) ? last
                                                         : per_mid;
  const int mid_rank = first > 0 ? pp_rank - 1 : pp_rank;
  int64_t start = 0;
  if (V > 1) {
    const int64_t f_v = first / V, l_v = last / V, m_v = mid_layers / V;
    const int64_t total = f_v + m_v + l_v;
    if (pp_rank == 0) {
      start = chunk * total;
    } else {
      // Megatron divides by the middle stage count here: with none (pp 2, first and last set)
      // it raises ZeroDivisionError, so that layout is refused.
      if (mid_stages == 0) {
        return InvalidArgumentError(fmt::format(
            "--trainer {}: vpp with first and last set needs a middle stage (Megatron's "
            "get_transformer_layer_offset divides by the middle stage count)",
            f));
      }
      start = chunk * total + f_v + mid_rank * (m_v / mid_stages);
    }
    return std::make_pair(start, start + count / V);
  }
  start = pp_rank == 0 ? 0 : mid_rank * per_mid + first;
  return std::make_pair(start, start + count);
}

namespace plan_internal {

Result<MegatronLayout> ParseMegatronLayout(std::string_view s) {
  MegatronLayout m;
  bool seen_etp = false, seen_experts = false;
  std::vector<std::string_view> seen;
  if (s.empty()) {
    return InvalidArgumentError("--trainer megatron: expected tp=T,pp=P[,...], got ''");
  }
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string_view::npos) comma = s.size();
    const std::string_view kv = s.substr(pos, comma - pos);
    pos = comma + 1;
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgumentError(fmt::format(
          "--trainer megatron: expected key=value (tp, pp, vpp, ep, etp, cp, dp, first, last, "
          "vocab_div, experts, norms, glu_interleave), got '{}'",
          kv));
    }
    const std::string_view key = kv.substr(0, eq), val = kv.substr(eq + 1);
    for (std::string_view k : seen) {
      if (k == key)
        return InvalidArgumentError(fmt::format("--trainer megatron {}: given twice", key));
    }
    seen.push_back(key);
    if (key == "experts") {
      if (val != "grouped" && val != "sequential") {
        return InvalidArgumentError(
            fmt::format("--trainer megatron experts: expected grouped (TEGroupedMLP) or sequential "
                        "(SequentialMLP), got '{}'",
                        val));
      }
      m.sequential_experts = val == "sequential";
      seen_experts = true;
      continue;
    }
    if (key == "norms") {
      if (val != "te" && val != "local") {
        return InvalidArgumentError(fmt::format(
            "--trainer megatron norms: expected te (fused layer_norm_weight) or local, got '{}'",
            val));
      }
      m.local_norms = val == "local";
      continue;
    }
    int* small = key == "tp"               ? &m.tp
                 : key == "pp"             ? &m.pp
                 : key == "vpp"            ? &m.vpp
                 : key == "ep"             ? &m.ep
                 : key == "etp"            ? &m.etp
                 : key == "cp"             ? &m.cp
                 : key == "dp"             ? &m.dp
                 : key == "vocab_div"      ? &m.vocab_div
                 : key == "glu_interleave" ? &m.glu_interleave
                                           : nullptr;
    int64_t* layers = key == "first" ? &m.first : key == "last" ? &m.last : nullptr;
    if (small == nullptr && layers == nullptr) {
      return InvalidArgumentError(fmt::format(
          "--trainer megatron: unknown field '{}' (expected tp, pp, vpp, ep, etp, cp, dp, first, "
          "last, vocab_div, experts, norms, glu_interleave)",
          key));
    }
    SS_ASSIGN_OR_RETURN(int64_t v, ParseCount(val, key));
    if (small != nullptr) {
      *small = static_cast<int>(v);
    } else {
      *layers = v;
    }
    if (key == "etp") seen_etp = true;
  }
  // parallel_state.py initialize_model_parallel: expert_tensor_parallel_size defaults to tp.
  if (!seen_etp) m.etp = m.tp;
  if (m.local_norms) {
    // models/backends.py LocalSpecProvider.grouped_mlp_modules: the local spec builds
    // SequentialMLP (core 0.17+ always; 0.13-0.16 without moe_grouped_gemm, and with it the
    // legacy GroupedMLP, whose experts.weight1 / weight2 hold the experts transposed).
    if (seen_experts && !m.sequential_experts) {
      return InvalidArgumentError(
          "--trainer megatron experts: experts=grouped (TEGroupedMLP) needs the Transformer-Engine "
          "spec; the local spec (norms=local) builds SequentialMLP (models/backends.py "
          "LocalSpecProvider), or on core 0.13-0.16 with moe_grouped_gemm the legacy GroupedMLP "
          "(experts.weight1 / weight2), which is not supported");
    }
    m.sequential_experts = true;
    // transformer/dot_product_attention.py DotProductAttention.__init__ asserts
    // context_parallel_size == 1 ("Context parallelism is only supported by
    // TEDotProductAttention!").
    if (m.cp > 1) {
      return InvalidArgumentError(fmt::format(
          "--trainer {} cp: the local spec (norms=local) uses DotProductAttention, which refuses "
          "context parallelism (only TEDotProductAttention supports it)",
          m.ToString()));
    }
  }
  // transformer/moe/experts.py: only TEGroupedMLP reads moe_mlp_glu_interleave_size
  // (_remove_glu_interleaving in its forward); SequentialMLP's experts are plain MLPs.
  if (m.glu_interleave > 0 && m.sequential_experts) {
    return InvalidArgumentError(
        fmt::format("--trainer {} glu_interleave: only TEGroupedMLP (experts=grouped) "
                    "interleaves gate and up rows; SequentialMLP ignores "
                    "moe_mlp_glu_interleave_size",
                    m.ToString()));
  }
  const int64_t world = int64_t{m.tp} * m.cp * m.dp * m.pp;
  if (world > kMaxRanks) {
    return InvalidArgumentError(fmt::format("--trainer {}: world tp*cp*dp*pp = {} exceeds {} ranks",
                                            m.ToString(), world, kMaxRanks));
  }
  // parallel_state.py: world_size must be divisible by etp*ep*pp (RuntimeError otherwise).
  const int64_t expert_mp = int64_t{m.etp} * m.ep * m.pp;
  if (world % expert_mp != 0) {
    return InvalidArgumentError(fmt::format(
        "--trainer {} ep/etp: world tp*cp*dp*pp = {} is not divisible by etp*ep*pp = {} (raise "
        "dp)",
        m.ToString(), world, expert_mp));
  }
  // arguments.py validate_args: the interleaved schedule needs pp > 1.
  if (m.vpp > 1 && m.pp == 1) {
    return InvalidArgumentError(
        fmt::format("--trainer {} vpp: virtual pipeline stages need pp > 1", m.ToString()));
  }
  if ((m.first > 0 || m.last > 0) && m.pp == 1) {
    return InvalidArgumentError(
        fmt::format("--trainer {} first/last: uneven stages need pp > 1", m.ToString()));
  }
  return m;
}

Result<MegatronDims> ComputeMegatronDims(const ModelSpec& m, const MegatronLayout& l) {
  SS_RETURN_IF_ERROR(ValidateModelSpec(m));
  const std::string f = l.ToString();
  MegatronDims d;
  if (m.attention_bias) {
    // Megatron adds q/k/v/o biases only through add_bias_linear, which also adds MLP biases the
    // HF model does not have: no exact Megatron counterpart.
    return UnimplementedError(fmt::format(
        "--trainer {}: model {} has attention_bias (q/k/v/o biases); Megatron's add_bias_linear "
        "would add MLP biases it lacks",
        f, m.name));
  }
  const int64_t tp = l.tp, np = m.num_attention_heads, ng = m.num_key_value_heads, hn = m.head_dim;
  // transformer_config.py TransformerConfig.__post_init__.
  if (np % tp != 0) {
    return InvalidArgumentError(
        fmt::format("--trainer {} tp: num_attention_heads {} is not divisible by tp", f, np));
  }
  // Core 0.16+ accepts ng < tp when tp % ng == 0 (earlier releases required ng % tp == 0).
  if (ng % tp != 0 && tp % ng != 0) {
    return InvalidArgumentError(fmt::format(
        "--trainer {} tp: num_query_groups (num_key_value_heads) {} is neither a multiple nor a "
        "divisor of tp",
        f, ng));
  }
  d.heads_per_group = np / ng;
  d.group_rows = (d.heads_per_group + 2) * hn;
  d.qkv_rows = ng * d.group_rows;
  // tensor_parallel/layers.py ColumnParallelLinear: divide(output_size, world_size).
  if (d.qkv_rows % tp != 0) {
    return InvalidArgumentError(
        fmt::format("--trainer {} tp: linear_qkv rows {} are not divisible by tp", f, d.qkv_rows));
  }
  d.qkv_per_rank = d.qkv_rows / tp;
  d.proj_cols = np * hn / tp;
  d.padded_vocab = MegatronPaddedVocab(l, m.vocab_size);
  d.vocab_per_rank = d.padded_vocab / tp;
  bool any_dense = false;
  for (int64_t i = 0; i < m.num_hidden_layers && !any_dense; ++i) any_dense = !m.IsMoeLayer(i);
  // layers.py RowParallelLinear: divide(input_size, world_size) for linear_fc2.
  if (any_dense && m.intermediate_size % tp != 0) {
    return InvalidArgumentError(fmt::format(
        "--trainer {} tp: intermediate_size {} is not divisible by tp", f, m.intermediate_size));
  }
  d.ffn_per_rank = m.intermediate_size / tp;
  if (m.is_moe()) {
    // moe/moe_layer.py MoELayer: num_moe_experts % ep_size == 0.
    if (m.num_experts % l.ep != 0) {
      return InvalidArgumentError(
          fmt::format("--trainer {} ep: num_experts {} is not divisible by ep", f, m.num_experts));
    }
    if (m.moe_intermediate_size % l.etp != 0) {
      return InvalidArgumentError(
          fmt::format("--trainer {} etp: moe_intermediate_size {} is not divisible by etp", f,
                      m.moe_intermediate_size));
    }
    d.experts_per_rank = m.num_experts / l.ep;
    d.moe_ffn_per_rank = m.moe_intermediate_size / l.etp;
    // experts.py TEGroupedMLP._remove_glu_interleaving reshapes each rank's fc1 output into
    // [.., per / G, 2, G]: G must divide the rank's moe_ffn rows.
    if (l.glu_interleave > 0 && d.moe_ffn_per_rank % l.glu_interleave != 0) {
      return InvalidArgumentError(fmt::format(
          "--trainer {} glu_interleave: moe_intermediate_size / etp = {} rows per rank are not "
          "divisible by {}",
          f, d.moe_ffn_per_rank, l.glu_interleave));
    }
  } else if (l.glu_interleave > 0) {
    return InvalidArgumentError(fmt::format(
        "--trainer {} glu_interleave: model {} has no MoE layers (moe_mlp_glu_interleave_size "
        "only changes TEGroupedMLP experts)",
        f, m.name));
  }
  for (int p = 0; p < l.pp; ++p) {
    for (int v = 0; v < l.vpp; ++v) {
      SS_ASSIGN_OR_RETURN(auto range, MegatronChunkLayers(l, m.num_hidden_layers, p, v));
      if (range.second <= range.first || range.second > m.num_hidden_layers) {
        return InvalidArgumentError(
            fmt::format("--trainer {}: pipeline rank {} chunk {} gets layers [{}, {}) of {}", f, p,
                        v, range.first, range.second, m.num_hidden_layers));
      }
    }
  }
  return d;
}

int64_t HolderCount(const MegatronLayout& l, const HolderSet& h) {
  switch (h.kind) {
    case HoldKind::kTpSplit:
      return int64_t{l.cp} * l.dp;
    case HoldKind::kReplicated:
      return int64_t{l.tp} * l.cp * l.dp;
    case HoldKind::kExpert:
      return l.expert_dp();
  }
  return 0;
}

int HolderRank(const MegatronLayout& l, const HolderSet& h, int64_t k) {
  const int per_stage = l.tp * l.cp * l.dp;
  switch (h.kind) {
    case HoldKind::kTpSplit:  // k = cp + C*dp
      return h.tp + l.tp * static_cast<int>(k) + per_stage * h.pp;
    case HoldKind::kReplicated:  // k = tp + T*(cp + C*dp)
      return static_cast<int>(k) + per_stage * h.pp;
    case HoldKind::kExpert:  // k = edp
      return MegatronExpertRank(l, h.etp, h.ep, static_cast<int>(k), h.pp);
  }
  return -1;
}

int64_t HolderIndex(const MegatronLayout& l, const HolderSet& h, int rank) {
  const MegatronCoords c = MegatronRankCoords(l, rank);
  if (c.pp != h.pp) return -1;
  switch (h.kind) {
    case HoldKind::kTpSplit:
      return c.tp == h.tp ? c.cp + int64_t{l.cp} * c.dp : -1;
    case HoldKind::kReplicated:
      return c.tp + int64_t{l.tp} * (c.cp + int64_t{l.cp} * c.dp);
    case HoldKind::kExpert:
      return c.ep == h.ep && c.etp == h.etp ? c.edp : -1;
  }
  return -1;
}

}  // namespace plan_internal
}  // namespace shardsync
