// The trainer map: each trainer rank's local parameters and the HF bytes they hold. Megatron's
// rules, each from Megatron-Core's own code (docs/megatron.md):
//  - local names per model chunk: models/gpt/gpt_model.py (embedding, decoder, output_layer),
//    transformer/transformer_block.py (decoder.layers.{i} with i local to the chunk,
//    final_layernorm), gpt_layer_specs.py get_gpt_layer_with_transformer_engine_submodules (TE
//    fused norms: linear_qkv.layer_norm_weight, mlp.linear_fc1.layer_norm_weight; MoE layers keep
//    pre_mlp_layernorm), attention.py SelfAttention (q_layernorm / k_layernorm);
//  - linear_qkv rows: ng groups of [np/ng q heads | k | v], hn rows per head
//    (attention.py get_query_key_value_tensors), ColumnParallel: tp rank r holds rows
//    [r*N/tp, (r+1)*N/tp) of that interleaved matrix, also when ng < tp (no KV replication);
//  - SwiGLU linear_fc1 per tp rank [gate_r; up_r] (mlp.py apply_swiglu_sharded_factory);
//    linear_proj / linear_fc2 RowParallel along dim 1 (tensor_parallel/layers.py);
//  - vocab padded to vocab_div*tp, rank r rows [r*Vp/tp, ...) (VocabUtility.
//    vocab_range_from_global_vocab_size); tied embeddings under PP: the last stage's
//    output_layer.weight is a copy (language_module.py setup_embeddings_and_output_layer);
//  - experts: global expert = ep_rank * num_local + i (moe_layer.py), TEGroupedMLP
//    linear_fc1.weight{i} / linear_fc2.weight{i}, SequentialMLP local_experts.{i}.linear_fc{1,2}
//    .weight (moe/experts.py), expert TP like dense TP over etp ranks; router replicated;
//    TEGroupedMLP with moe_mlp_glu_interleave_size G: fc1 rows in [gate G | up G] blocks.
#include <fmt/format.h>

#include <algorithm>

#include "plan/megatron.h"

namespace shardsync {
namespace plan_internal {
namespace {

Region R1(int64_t o, int64_t e) { return Region::Make({o}, {e}); }
Region Rows(int64_t o, int64_t e, int64_t cols) { return Region::Make({o, 0}, {e, cols}); }
Region Cols(int64_t rows, int64_t o, int64_t e) { return Region::Make({0, o}, {rows, e}); }

class StageBuilder {
 public:
  StageBuilder(const ModelSpec& m, const MegatronLayout& l, const MegatronDims& d, int tp, int ep,
               int etp, DType dtype, StageParams* out)
      : m_(m), l_(l), d_(d), tp_(tp), ep_(ep), etp_(etp), dtype_(dtype), out_(out) {}

  void Chunk(int chunk, int pp, int64_t start, int64_t end) {
    chunk_ = chunk;
    const int P = l_.pp, V = l_.vpp;
    const bool pre = pp == 0 && chunk == 0, post = pp == P - 1 && chunk == V - 1;
    const int64_t H = m_.hidden_size;
    if (pre) Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight");
    for (int64_t l = start; l < end; ++l) Layer(l, l - start);
    if (post) {
      Param("decoder.final_layernorm.weight", {H});
      Add("model.norm.weight", R1(0, H), R1(0, H), HoldKind::kReplicated);
      // gpt_model.py: output_layer skips its weight when pre_process and tied (pp 1); under pp
      // > 1 the last stage keeps a copy of the tied embedding.
      if (!m_.tie_word_embeddings) {
        Vocab("output_layer.weight", "lm_head.weight");
      } else if (!pre) {
        Vocab("output_layer.weight", "model.embed_tokens.weight");
      }
    }
  }

 private:
  void Param(std::string name, Shape shape) {
    TrainerParam p;
    p.name = std::move(name);
    p.chunk = chunk_;
    p.shape = std::move(shape);
    p.dtype = dtype_;
    out_->params.push_back(std::move(p));
    out_->kinds.emplace_back();
  }
  void Add(const std::string& source, const Region& src, const Region& local, HoldKind k) {
    if (src.empty()) return;
    out_->params.back().pieces.push_back(TrainerPiece{source, src, local});
    out_->kinds.back().push_back(k);
  }

  void Vocab(const std::string& name, const std::string& source) {
    const int64_t H = m_.hidden_size, per = d_.vocab_per_rank, start = tp_ * per;
    Param(name, {per, H});
    // Rows past vocab_size are padding: no HF byte.
    const int64_t n = std::clamp<int64_t>(m_.vocab_size - start, 0, per);
    Add(source, Rows(start, n, H), Rows(0, n, H), HoldKind::kTpSplit);
  }

  // Fused QKV (weight [N/tp, H] or bias [N/tp]): intersect the rank's slab of the interleaved
  // rows with every group's q / k / v block.
  void Qkv(const std::string& name, const std::string& att, const std::string& suffix, bool bias) {
    const int64_t H = m_.hidden_size, hn = m_.head_dim, G = d_.group_rows;
    const int64_t q = d_.heads_per_group * hn, per = d_.qkv_per_rank, lo = tp_ * per;
    Param(name, bias ? Shape{per} : Shape{per, H});
    const int64_t g0 = lo / G, g1 = (lo + per - 1) / G;
    for (int64_t g = g0; g <= g1; ++g) {
      const struct {
        const char* proj;
        int64_t row, rows, hf_row;
      } blocks[3] = {{"q_proj", g * G, q, g * q},
                     {"k_proj", g * G + q, hn, g * hn},
                     {"v_proj", g * G + q + hn, hn, g * hn}};
      for (const auto& b : blocks) {
        const int64_t a = std::max(lo, b.row), e = std::min(lo + per, b.row + b.rows);
        if (e <= a) continue;
        const std::string src = att + b.proj + suffix;
        const int64_t hf = b.hf_row + (a - b.row);
        if (bias) {
          Add(src, R1(hf, e - a), R1(a - lo, e - a), HoldKind::kTpSplit);
        } else {
          Add(src, Rows(hf, e - a, H), Rows(a - lo, e - a, H), HoldKind::kTpSplit);
        }
      }
    }
  }

  // SwiGLU fc1 [gate_r; up_r] over `ranks` (tp or etp) and RowParallel fc2 columns. With
  // `interleave` G > 0 (TEGroupedMLP, moe_mlp_glu_interleave_size) the local rows are blocks
  // [gate G rows | up G rows], block b holding rows [b*G, (b+1)*G) of the rank's gate_r and up_r
  // (experts.py TEGroupedMLP._remove_glu_interleaving: reshape(-1, per / G, 2, G), transpose).
  void Fc1(const std::string& name, const std::string& gate, const std::string& up, int64_t per,
           int rank, HoldKind k, int64_t interleave = 0) {
    const int64_t H = m_.hidden_size;
    Param(name, {2 * per, H});
    if (interleave == 0) {
      Add(gate, Rows(rank * per, per, H), Rows(0, per, H), k);
      Add(up, Rows(rank * per, per, H), Rows(per, per, H), k);
      return;
    }
    const int64_t G = interleave;
    for (int64_t b = 0; b < per / G; ++b) {
      Add(gate, Rows(rank * per + b * G, G, H), Rows(2 * b * G, G, H), k);
      Add(up, Rows(rank * per + b * G, G, H), Rows(2 * b * G + G, G, H), k);
    }
  }
  void Fc2(const std::string& name, const std::string& down, int64_t per, int rank, HoldKind k) {
    const int64_t H = m_.hidden_size;
    Param(name, {H, per});
    Add(down, Cols(H, rank * per, per), Cols(H, 0, per), k);
  }
  void Norm(const std::string& name, const std::string& source, int64_t n) {
    Param(name, {n});
    Add(source, R1(0, n), R1(0, n), HoldKind::kReplicated);
  }

  void Layer(int64_t l, int64_t i) {
    const std::string pre = fmt::format("decoder.layers.{}.", i);
    const std::string hf = fmt::format("model.layers.{}.", l), att = hf + "self_attn.";
    const int64_t H = m_.hidden_size, hn = m_.head_dim;
    const bool moe = m_.IsMoeLayer(l), te = !l_.local_norms;
    // transformer_layer.py registers input_layernorm, self_attention (core_attention,
    // linear_proj, then linear_qkv, q/k_layernorm), pre_mlp_layernorm, mlp.
    if (!te) Norm(pre + "input_layernorm.weight", hf + "input_layernorm.weight", H);
    Param(pre + "self_attention.linear_proj.weight", {H, d_.proj_cols});
    Add(att + "o_proj.weight", Cols(H, tp_ * d_.proj_cols, d_.proj_cols), Cols(H, 0, d_.proj_cols),
        HoldKind::kTpSplit);
    if (te) {
      Norm(pre + "self_attention.linear_qkv.layer_norm_weight", hf + "input_layernorm.weight", H);
    }
    Qkv(pre + "self_attention.linear_qkv.weight", att, ".weight", false);
    if (m_.qkv_bias) Qkv(pre + "self_attention.linear_qkv.bias", att, ".bias", true);
    if (m_.qk_norm) {
      Norm(pre + "self_attention.q_layernorm.weight", att + "q_norm.weight", hn);
      Norm(pre + "self_attention.k_layernorm.weight", att + "k_norm.weight", hn);
    }
    const std::string post_norm = hf + "post_attention_layernorm.weight";
    if (moe || !te) Norm(pre + "pre_mlp_layernorm.weight", post_norm, H);
    if (!moe) {
      const std::string mlp = hf + "mlp.";
      if (te) Norm(pre + "mlp.linear_fc1.layer_norm_weight", post_norm, H);
      Fc1(pre + "mlp.linear_fc1.weight", mlp + "gate_proj.weight", mlp + "up_proj.weight",
          d_.ffn_per_rank, tp_, HoldKind::kTpSplit);
      Fc2(pre + "mlp.linear_fc2.weight", mlp + "down_proj.weight", d_.ffn_per_rank, tp_,
          HoldKind::kTpSplit);
      return;
    }
    // moe/router.py TopKRouter: weight [num_experts, hidden], not split over tp.
    const Shape router = {m_.num_experts, H};
    Param(pre + "mlp.router.weight", router);
    Add(hf + "mlp.gate.weight", Region::Full(router), Region::Full(router), HoldKind::kReplicated);
    const int64_t n = d_.experts_per_rank, per = d_.moe_ffn_per_rank;
    auto ex = [&](int64_t i) { return fmt::format("{}mlp.experts.{}.", hf, ep_ * n + i); };
    if (l_.sequential_experts) {
      for (int64_t e = 0; e < n; ++e) {
        const std::string local = fmt::format("{}mlp.experts.local_experts.{}.", pre, e);
        Fc1(local + "linear_fc1.weight", ex(e) + "gate_proj.weight", ex(e) + "up_proj.weight", per,
            etp_, HoldKind::kExpert);
        Fc2(local + "linear_fc2.weight", ex(e) + "down_proj.weight", per, etp_, HoldKind::kExpert);
      }
      return;
    }
    for (int64_t e = 0; e < n; ++e) {
      Fc1(fmt::format("{}mlp.experts.linear_fc1.weight{}", pre, e), ex(e) + "gate_proj.weight",
          ex(e) + "up_proj.weight", per, etp_, HoldKind::kExpert, l_.glu_interleave);
    }
    for (int64_t e = 0; e < n; ++e) {
      Fc2(fmt::format("{}mlp.experts.linear_fc2.weight{}", pre, e), ex(e) + "down_proj.weight", per,
          etp_, HoldKind::kExpert);
    }
  }

  const ModelSpec& m_;
  const MegatronLayout& l_;
  const MegatronDims& d_;
  const int tp_, ep_, etp_;
  const DType dtype_;
  StageParams* out_;
  int chunk_ = 0;
};

}  // namespace

Result<StageParams> BuildStageParams(const ModelSpec& m, const MegatronLayout& l,
                                     const MegatronDims& d, int pp, int tp, int ep, int etp,
                                     DType dtype) {
  StageParams out;
  StageBuilder b(m, l, d, tp, ep, etp, dtype, &out);
  for (int v = 0; v < l.vpp; ++v) {
    SS_ASSIGN_OR_RETURN(auto range, MegatronChunkLayers(l, m.num_hidden_layers, pp, v));
    b.Chunk(v, pp, range.first, range.second);
  }
  return out;
}

}  // namespace plan_internal

Status CheckTrainerLayout(const ModelSpec& model, const TrainerSpec& t) {
  if (t.kind != TrainerSpec::Kind::kMegatron) return ValidateModelSpec(model);
  return plan_internal::ComputeMegatronDims(model, t.megatron).status();
}

Result<TrainerRankParams> BuildTrainerParams(const ModelSpec& model, const TrainerSpec& t, int rank,
                                             DType dtype) {
  if (rank < 0 || rank >= t.world()) {
    return OutOfRangeError(fmt::format("trainer rank {} outside the trainer world [0, {}) of {}",
                                       rank, t.world(), t.ToString()));
  }
  TrainerRankParams out;
  out.rank = rank;
  if (t.kind != TrainerSpec::Kind::kMegatron) {
    SS_RETURN_IF_ERROR(ValidateModelSpec(model));
    for (const HfTensor& h : HfTensorInventory(model)) {
      const Region held = TrainerHeldRegion(t, rank, h.shape);
      TrainerParam p;
      p.name = h.name;
      p.shape = held.extents();
      p.dtype = dtype;
      if (!held.empty()) p.pieces.push_back(TrainerPiece{h.name, held, Region::Full(p.shape)});
      out.params.push_back(std::move(p));
    }
    return out;
  }
  const MegatronLayout& l = t.megatron;
  SS_ASSIGN_OR_RETURN(plan_internal::MegatronDims d, plan_internal::ComputeMegatronDims(model, l));
  out.megatron = true;
  out.coords = MegatronRankCoords(l, rank);
  const MegatronCoords& c = out.coords;
  SS_ASSIGN_OR_RETURN(plan_internal::StageParams sp,
                      plan_internal::BuildStageParams(model, l, d, c.pp, c.tp, c.ep, c.etp, dtype));
  out.params = std::move(sp.params);
  return out;
}

}  // namespace shardsync
