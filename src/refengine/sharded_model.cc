// The engine's TP x PP (x EP) forward on engine-layout buffers, one simulated rank at a time.
// Every layout fact below is the engine's rule (../shared/reference/engine-layouts.md section 3),
// recomputed here on purpose rather than read from the shard map's pieces: the shard map is what
// is under test.
#include <fmt/format.h>

#include <algorithm>

#include "refengine/dequantize.h"
#include "refengine/kernels.h"
#include "shardsync/refengine.h"

namespace shardsync {
namespace {

using refengine::KvCache;
using refengine::MatMulT;
using refengine::RmsNorm;
using refengine::Rope;

struct LayerWeights {  // one layer on one TP rank; null = absent
  const float* in_norm = nullptr;
  const float* qkv = nullptr;
  const float* qkv_bias = nullptr;
  const float* o = nullptr;
  const float* o_bias = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* post_norm = nullptr;
  const float* gate_up = nullptr;  // dense: [2 * I/tp, H] = [gate | up]
  const float* down = nullptr;     // dense: [H, I/tp]
  const float* router = nullptr;   // MoE: [E, H], replicated
  const float* w13 = nullptr;      // MoE: [E_local, 2 * Ip, H], per expert [gate | up]
  const float* w2 = nullptr;       // MoE: [E_local, H, Ip]
};

class ShardedModel : public CausalLm {
 public:
  explicit ShardedModel(const ShardMap& map, Rope rope)
      : map_(map), m_(map.model), rope_(std::move(rope)) {}

  Status Init(const std::vector<EngineBuffers>& per_rank) {
    const ShardSpec& s = map_.spec;
    tp_ = s.tp;
    pp_ = s.pp;
    if (tp_ <= 0 || pp_ <= 0 || map_.ranks.size() != static_cast<size_t>(tp_) * pp_) {
      return InvalidArgumentError(
          fmt::format("shard map has {} ranks for tp {} x pp {}", map_.ranks.size(), tp_, pp_));
    }
    if (per_rank.size() != map_.ranks.size()) {
      return InvalidArgumentError(fmt::format("{} engine buffer sets for {} engine ranks",
                                              per_rank.size(), map_.ranks.size()));
    }
    SS_RETURN_IF_ERROR(ConvertBuffers(per_rank));
    SS_RETURN_IF_ERROR(ComputeDims());
    SS_RETURN_IF_ERROR(BindWeights());
    caches_.assign(m_.num_hidden_layers, std::vector<KvCache>(tp_));
    for (auto& layer : caches_) {
      for (auto& c : layer) {
        c.n_kv = kv_local_;
        c.head_dim = m_.head_dim;
      }
    }
    return OkStatus();
  }

  int64_t vocab_size() const override { return m_.vocab_size; }
  void Reset() override {
    for (auto& layer : caches_) {
      for (auto& c : layer) c.Clear();
    }
    pos_ = 0;
  }

  Result<std::vector<float>> Forward(std::span<const int64_t> tokens) override {
    const int64_t T = static_cast<int64_t>(tokens.size()), H = m_.hidden_size;
    const int64_t V = m_.vocab_size;
    if (T == 0) return InvalidArgumentError("forward: no tokens");
    for (int64_t t : tokens) {
      if (t < 0 || t >= V) {
        return InvalidArgumentError(
            fmt::format("token id {} is outside the vocabulary [0, {})", t, V));
      }
    }
    SS_RETURN_IF_ERROR(CheckHostMemory(refengine::ForwardBytes(m_, T, tp_),
                                       "model '" + m_.name + "'",
                                       fmt::format("a sharded forward of {} tokens", T)));
    // Vocab-parallel embedding on stage 0: each rank looks up the ids in its row range, the
    // others contribute 0, and the all-reduce sums.
    std::vector<float> x(T * H, 0.f);
    for (int r = 0; r < tp_; ++r) {
      const int64_t start = r * vocab_per_rank_;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t local = tokens[t] - start;
        if (local < 0 || local >= vocab_per_rank_) continue;
        const float* row = embed_[r] + local * H;
        for (int64_t i = 0; i < H; ++i) x[t * H + i] += row[i];
      }
    }
    // Stages in order; each runs the layers it owns (pipeline send of x between stages).
    for (int p = 0; p < pp_; ++p) {
      const EngineRankShards& st = map_.rank(0, p);
      for (int64_t l = st.layer_start; l < st.layer_end; ++l) Layer(l, x, T);
    }
    pos_ += T;
    // Last stage: final norm and vocab-parallel lm_head; the gathered logits keep the real rows.
    std::vector<float> logits;
    logits.reserve(vocab_per_rank_ * tp_);
    std::vector<float> local(vocab_per_rank_);
    for (int r = 0; r < tp_; ++r) {
      std::vector<float> last(x.end() - H, x.end());
      RmsNorm(last.data(), 1, H, final_norm_[r], m_.rms_norm_eps);
      MatMulT(last.data(), 1, H, head_[r], vocab_per_rank_, nullptr, local.data());
      logits.insert(logits.end(), local.begin(), local.end());
    }
    logits.resize(V);
    return logits;
  }

 private:
  // Converts every buffer to fp32 after checking it against the shard map (name, dtype, shape).
  Status ConvertBuffers(const std::vector<EngineBuffers>& per_rank) {
    w_.resize(per_rank.size());
    for (size_t i = 0; i < per_rank.size(); ++i) {
      const EngineRankShards& rs = map_.ranks[i];
      const std::string who = fmt::format("engine rank (tp {}, pp {})", rs.tp_rank, rs.pp_rank);
      for (const EngineParam& p : rs.params) {
        auto it = per_rank[i].find(p.name);
        if (it == per_rank[i].end()) {
          return NotFoundError(fmt::format("{}: parameter '{}' missing", who, p.name));
        }
        const HostTensor& t = it->second;
        if (t.dtype != p.dtype || t.shape != p.shape ||
            t.data.size() != static_cast<size_t>(p.numel()) * DTypeSize(p.dtype)) {
          return InvalidArgumentError(
              fmt::format("{}: parameter '{}' is {} {} ({} bytes), the shard map expects {} {}",
                          who, p.name, DTypeName(t.dtype), ShapeToString(t.shape), t.data.size(),
                          DTypeName(p.dtype), ShapeToString(p.shape)));
        }
        std::vector<float> f(p.numel());
        if (p.dtype == DType::kF8E4M3) {
          SS_RETURN_IF_ERROR(DequantizeEngineParam(per_rank[i], p, who, f.data()));
        } else {
          Status cs = ConvertElements(t.dtype, t.data.data(), DType::kF32, f.data(), p.numel());
          if (!cs.ok()) return cs.Annotate(fmt::format("{}: parameter '{}'", who, p.name));
        }
        w_[i].emplace(p.name, std::move(f));
      }
      for (const auto& [name, t] : per_rank[i]) {
        if (FindParam(rs, name) == nullptr) {
          return InvalidArgumentError(
              fmt::format("{}: parameter '{}' is not in the shard map", who, name));
        }
      }
    }
    return OkStatus();
  }

  Status ComputeDims() {
    const int64_t nq = m_.num_attention_heads, nkv = m_.num_key_value_heads;
    if (nq % tp_ != 0) {
      return InvalidArgumentError(
          fmt::format("num_attention_heads {} is not divisible by tp {}", nq, tp_));
    }
    q_local_ = nq / tp_;
    // QKVParallelLinear: tp >= nkv replicates one kv head per rank, else nkv / tp heads.
    if (tp_ >= nkv) {
      if (tp_ % nkv != 0) {
        return InvalidArgumentError(
            fmt::format("tp {} is not a multiple of num_key_value_heads {}", tp_, nkv));
      }
      kv_local_ = 1;
    } else {
      if (nkv % tp_ != 0) {
        return InvalidArgumentError(
            fmt::format("num_key_value_heads {} is not divisible by tp {}", nkv, tp_));
      }
      kv_local_ = nkv / tp_;
    }
    const int64_t padded = (m_.vocab_size + 63) / 64 * 64;
    if (padded % tp_ != 0) {
      return InvalidArgumentError(
          fmt::format("padded vocabulary {} is not divisible by tp {}", padded, tp_));
    }
    vocab_per_rank_ = padded / tp_;
    if (m_.is_moe()) {
      const int64_t E = m_.num_experts;
      const int ep = map_.spec.ep;
      expert_start_.assign(tp_, 0);
      experts_local_.assign(tp_, E);
      int64_t moe_tp = tp_;
      if (map_.spec.engine == EngineKind::kSglang) {
        // FusedMoE: moe_tp = tp / ep; moe_ep_rank = tp_rank / moe_tp owns E / ep experts.
        if (ep <= 0 || tp_ % ep != 0 || E % ep != 0) {
          return InvalidArgumentError(
              fmt::format("--ep {}: must divide tp {} and num_experts {}", ep, tp_, E));
        }
        moe_tp = tp_ / ep;
        for (int r = 0; r < tp_; ++r) {
          experts_local_[r] = E / ep;
          expert_start_[r] = (r / moe_tp) * (E / ep);
        }
      } else if (ep > 1) {
        // vLLM --enable-expert-parallel: ep = tp, moe_tp = 1, "linear" placement (the remainder
        // goes to the first ranks).
        if (ep != tp_) {
          return InvalidArgumentError(fmt::format("--ep {}: vLLM needs ep 1 or ep == tp", ep));
        }
        moe_tp = 1;
        const int64_t base = E / ep, rem = E % ep;
        for (int r = 0; r < tp_; ++r) {
          experts_local_[r] = base + (r < rem ? 1 : 0);
          expert_start_[r] = r * base + std::min<int64_t>(r, rem);
        }
      }
      if (m_.moe_intermediate_size % moe_tp != 0) {
        return InvalidArgumentError(
            fmt::format("moe_intermediate_size {} is not divisible by MoE tp {}",
                        m_.moe_intermediate_size, moe_tp));
      }
      moe_inter_local_ = m_.moe_intermediate_size / moe_tp;
    }
    dense_inter_local_ = m_.intermediate_size / tp_;
    return OkStatus();
  }

  // Looks up a parameter on rank `idx` and checks its local shape against the engine rule.
  Result<const float*> Get(size_t idx, const std::string& name, const Shape& shape,
                           bool optional = false) {
    const EngineRankShards& rs = map_.ranks[idx];
    auto it = w_[idx].find(name);
    if (it == w_[idx].end()) {
      if (optional) return static_cast<const float*>(nullptr);
      return NotFoundError(fmt::format("engine rank (tp {}, pp {}): parameter '{}' missing",
                                       rs.tp_rank, rs.pp_rank, name));
    }
    const EngineParam* p = FindParam(rs, name);
    if (p == nullptr || p->shape != shape) {
      return InvalidArgumentError(fmt::format(
          "engine rank (tp {}, pp {}): parameter '{}' has shape {}, the engine rule gives {}",
          rs.tp_rank, rs.pp_rank, name, p ? ShapeToString(p->shape) : "?", ShapeToString(shape)));
    }
    return static_cast<const float*>(it->second.data());
  }

  Status BindWeights() {
    const int64_t H = m_.hidden_size, d = m_.head_dim, L = m_.num_hidden_layers;
    const bool has_bias = m_.attention_bias || m_.qkv_bias;
    layers_.assign(L, std::vector<LayerWeights>(tp_));
    int64_t expect_start = 0;
    for (int p = 0; p < pp_; ++p) {
      const EngineRankShards& st = map_.rank(0, p);
      if (st.layer_start != expect_start || st.layer_end < st.layer_start || st.layer_end > L) {
        return InvalidArgumentError(
            fmt::format("stage {} owns layers [{}, {}), expected to start at {}", p, st.layer_start,
                        st.layer_end, expect_start));
      }
      expect_start = st.layer_end;
      for (int r = 0; r < tp_; ++r) {
        const size_t idx = static_cast<size_t>(p) * tp_ + r;
        const EngineRankShards& rs = map_.ranks[idx];
        if (rs.layer_start != st.layer_start || rs.layer_end != st.layer_end) {
          return InvalidArgumentError(
              fmt::format("engine rank (tp {}, pp {}) owns layers [{}, {}), its stage [{}, {})", r,
                          p, rs.layer_start, rs.layer_end, st.layer_start, st.layer_end));
        }
        for (int64_t l = st.layer_start; l < st.layer_end; ++l) {
          const std::string pre = fmt::format("model.layers.{}.", l);
          const std::string att = pre + "self_attn.";
          LayerWeights& w = layers_[l][r];
          const int64_t rows = (q_local_ + 2 * kv_local_) * d;
          SS_ASSIGN_OR_RETURN(w.in_norm, Get(idx, pre + "input_layernorm.weight", {H}));
          SS_ASSIGN_OR_RETURN(w.qkv, Get(idx, att + "qkv_proj.weight", {rows, H}));
          if (has_bias) {
            SS_ASSIGN_OR_RETURN(w.qkv_bias, Get(idx, att + "qkv_proj.bias", {rows}));
          }
          SS_ASSIGN_OR_RETURN(w.o, Get(idx, att + "o_proj.weight", {H, q_local_ * d}));
          if (m_.attention_bias) {
            SS_ASSIGN_OR_RETURN(w.o_bias, Get(idx, att + "o_proj.bias", {H}));
          }
          if (m_.qk_norm) {
            SS_ASSIGN_OR_RETURN(w.q_norm, Get(idx, att + "q_norm.weight", {d}));
            SS_ASSIGN_OR_RETURN(w.k_norm, Get(idx, att + "k_norm.weight", {d}));
          }
          SS_ASSIGN_OR_RETURN(w.post_norm, Get(idx, pre + "post_attention_layernorm.weight", {H}));
          if (m_.IsMoeLayer(l)) {
            const int64_t El = experts_local_[r], Ip = moe_inter_local_;
            SS_ASSIGN_OR_RETURN(w.router, Get(idx, pre + "mlp.gate.weight", {m_.num_experts, H}));
            SS_ASSIGN_OR_RETURN(w.w13, Get(idx, pre + "mlp.experts.w13_weight", {El, 2 * Ip, H}));
            SS_ASSIGN_OR_RETURN(w.w2, Get(idx, pre + "mlp.experts.w2_weight", {El, H, Ip}));
          } else {
            const int64_t Ip = dense_inter_local_;
            SS_ASSIGN_OR_RETURN(w.gate_up, Get(idx, pre + "mlp.gate_up_proj.weight", {2 * Ip, H}));
            SS_ASSIGN_OR_RETURN(w.down, Get(idx, pre + "mlp.down_proj.weight", {H, Ip}));
          }
        }
      }
    }
    if (expect_start != L) {
      return InvalidArgumentError(
          fmt::format("stages own layers [0, {}) of {} layers", expect_start, L));
    }
    // Embedding on the first stage; final norm and head on the last. The head is lm_head.weight
    // where the engine has one (untied, or SGLang tied with pp > 1), else the last stage's own
    // embed_tokens (tied: pp == 1, or vLLM's last stage).
    const Shape vocab_shape = {vocab_per_rank_, H};
    for (int r = 0; r < tp_; ++r) {
      const size_t first = static_cast<size_t>(r), last = static_cast<size_t>(pp_ - 1) * tp_ + r;
      const float* e = nullptr;
      SS_ASSIGN_OR_RETURN(e, Get(first, "model.embed_tokens.weight", vocab_shape));
      embed_.push_back(e);
      SS_ASSIGN_OR_RETURN(e, Get(last, "model.norm.weight", {H}));
      final_norm_.push_back(e);
      SS_ASSIGN_OR_RETURN(e, Get(last, "lm_head.weight", vocab_shape, /*optional=*/true));
      if (e == nullptr) {
        if (!m_.tie_word_embeddings) {
          return NotFoundError(fmt::format(
              "engine rank (tp {}, pp {}): parameter 'lm_head.weight' missing", r, pp_ - 1));
        }
        SS_ASSIGN_OR_RETURN(e, Get(last, "model.embed_tokens.weight", vocab_shape));
      }
      head_.push_back(e);
    }
    return OkStatus();
  }

  void Layer(int64_t l, std::vector<float>& x, int64_t T) {
    const int64_t H = m_.hidden_size, d = m_.head_dim;
    const int64_t qn = q_local_ * d, kn = kv_local_ * d, rows = qn + 2 * kn;
    std::vector<float> xn(T * H), qkv(T * rows), q(T * qn), k(T * kn), v(T * kn);
    std::vector<float> attn(T * qn), part(T * H), sum(T * H, 0.f);
    for (int r = 0; r < tp_; ++r) {
      const LayerWeights& w = layers_[l][r];
      xn.assign(x.begin(), x.end());
      RmsNorm(xn.data(), T, H, w.in_norm, m_.rms_norm_eps);
      MatMulT(xn.data(), T, H, w.qkv, rows, w.qkv_bias, qkv.data());
      for (int64_t t = 0; t < T; ++t) {  // local rows [q heads | k heads | v heads]
        const float* row = qkv.data() + t * rows;
        std::copy_n(row, qn, q.data() + t * qn);
        std::copy_n(row + qn, kn, k.data() + t * kn);
        std::copy_n(row + qn + kn, kn, v.data() + t * kn);
      }
      refengine::NormAndRotate(q.data(), T, q_local_, d, w.q_norm, m_.rms_norm_eps, rope_, pos_);
      refengine::NormAndRotate(k.data(), T, kv_local_, d, w.k_norm, m_.rms_norm_eps, rope_, pos_);
      caches_[l][r].Append(k.data(), v.data(), T);
      refengine::Attend(q.data(), T, q_local_, caches_[l][r], attn.data());
      // Row-parallel o_proj: partial sums; the replicated bias is added by rank 0 only.
      MatMulT(attn.data(), T, qn, w.o, H, r == 0 ? w.o_bias : nullptr, part.data());
      for (int64_t i = 0; i < T * H; ++i) sum[i] += part[i];
    }
    for (int64_t i = 0; i < T * H; ++i) x[i] += sum[i];

    std::fill(sum.begin(), sum.end(), 0.f);
    for (int r = 0; r < tp_; ++r) {
      const LayerWeights& w = layers_[l][r];
      xn.assign(x.begin(), x.end());
      RmsNorm(xn.data(), T, H, w.post_norm, m_.rms_norm_eps);
      if (w.router != nullptr) {
        MoePartial(w, r, xn.data(), T, part.data());
      } else {
        const int64_t Ip = dense_inter_local_;
        refengine::SwiGluMlp(xn.data(), T, H, Ip, w.gate_up, w.gate_up + Ip * H, w.down,
                             part.data());
      }
      for (int64_t i = 0; i < T * H; ++i) sum[i] += part[i];
    }
    for (int64_t i = 0; i < T * H; ++i) x[i] += sum[i];
  }

  // This rank's share of the MoE output: the selected experts it holds, its intermediate slice.
  void MoePartial(const LayerWeights& w, int r, const float* xn, int64_t T, float* out) {
    const int64_t H = m_.hidden_size, E = m_.num_experts, Ip = moe_inter_local_;
    std::vector<float> logits(T * E), y(H);
    MatMulT(xn, T, H, w.router, E, nullptr, logits.data());
    std::fill(out, out + T * H, 0.f);
    for (int64_t t = 0; t < T; ++t) {
      for (auto [e, weight] : refengine::Route({logits.data() + t * E, static_cast<size_t>(E)},
                                               m_.num_experts_per_tok, m_.norm_topk_prob)) {
        const int64_t le = e - expert_start_[r];
        if (le < 0 || le >= experts_local_[r]) continue;  // another EP rank holds it
        const float* w13 = w.w13 + le * 2 * Ip * H;
        const float* w2 = w.w2 + le * H * Ip;
        refengine::SwiGluMlp(xn + t * H, 1, H, Ip, w13, w13 + Ip * H, w2, y.data());
        for (int64_t i = 0; i < H; ++i) out[t * H + i] += weight * y[i];
      }
    }
  }

  ShardMap map_;  // a copy: the model outlives the caller's map
  ModelSpec m_;
  Rope rope_;
  int tp_ = 1, pp_ = 1;
  int64_t q_local_ = 0, kv_local_ = 0, vocab_per_rank_ = 0;
  int64_t dense_inter_local_ = 0, moe_inter_local_ = 0;
  std::vector<int64_t> expert_start_, experts_local_;
  std::vector<std::map<std::string, std::vector<float>>> w_;  // per rank, fp32
  std::vector<std::vector<LayerWeights>> layers_;             // [layer][tp_rank]
  std::vector<const float*> embed_, final_norm_, head_;       // [tp_rank]
  std::vector<std::vector<KvCache>> caches_;                  // [layer][tp_rank]
  int64_t pos_ = 0;
};

}  // namespace

Result<std::unique_ptr<CausalLm>> MakeShardedModel(const ShardMap& map,
                                                   const std::vector<EngineBuffers>& per_rank) {
  // Before anything sized from the config is allocated (RoPE tables included).
  int64_t elements = 0;
  for (const auto& r : map.ranks) {
    for (const auto& p : r.params) elements = refengine::SatAdd(elements, p.numel());
  }
  SS_RETURN_IF_ERROR(CheckHostMemory(refengine::SatMul(elements, 4),
                                     "model '" + map.model.name + "'",
                                     "the sharded engine's fp32 weights"));
  SS_ASSIGN_OR_RETURN(Rope rope, Rope::Make(map.model));
  auto m = std::make_unique<ShardedModel>(map, std::move(rope));
  SS_RETURN_IF_ERROR(m->Init(per_rank));
  return std::unique_ptr<CausalLm>(std::move(m));
}

}  // namespace shardsync
