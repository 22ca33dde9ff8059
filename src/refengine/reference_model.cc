// The unsharded Hugging Face forward pass (modeling_llama / qwen2 / qwen3 / qwen3_moe), fp32.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "refengine/kernels.h"
#include "shardsync/refengine.h"

namespace shardsync {
namespace {

using refengine::KvCache;
using refengine::MatMulT;
using refengine::RmsNorm;
using refengine::Rope;

class ReferenceModel : public CausalLm {
 public:
  ReferenceModel(ModelSpec spec, Rope rope) : s_(std::move(spec)), rope_(std::move(rope)) {
    caches_.resize(s_.num_hidden_layers);
    for (auto& c : caches_) {
      c.n_kv = s_.num_key_value_heads;
      c.head_dim = s_.head_dim;
    }
  }

  Status Load(const WeightSource& src) {
    const std::vector<HfTensor> inv = HfTensorInventory(s_);
    std::vector<std::vector<float>*> dst;
    for (const HfTensor& t : inv) {
      SS_ASSIGN_OR_RETURN(TensorInfo info, src.Describe(t.name));
      if (info.shape != t.shape) {
        return InvalidArgumentError(fmt::format("tensor '{}' has shape {}, the config implies {}",
                                                t.name, ShapeToString(info.shape),
                                                ShapeToString(t.shape)));
      }
      auto [it, inserted] = w_.emplace(t.name, std::vector<float>(t.numel()));
      dst.push_back(&it->second);
    }
    // Reading and converting a checkpoint (or generating synthetic values) dominates start-up:
    // spread the tensors over all cores.
    std::vector<Status> status(inv.size());
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i = next++; i < inv.size(); i = next++) {
        status[i] = src.Read(inv[i].name, Region::Full(inv[i].shape), DType::kF32, dst[i]->data());
      }
    };
    const size_t n_threads =
        std::min<size_t>(inv.size(), std::max(1u, std::thread::hardware_concurrency()));
    std::vector<std::thread> threads;
    for (size_t i = 1; i < n_threads; ++i) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
    for (const Status& st : status) SS_RETURN_IF_ERROR(st);
    return OkStatus();
  }

  int64_t vocab_size() const override { return s_.vocab_size; }
  void Reset() override {
    for (auto& c : caches_) c.Clear();
    pos_ = 0;
  }

  Result<std::vector<float>> Forward(std::span<const int64_t> tokens) override {
    const int64_t T = static_cast<int64_t>(tokens.size()), H = s_.hidden_size;
    const int64_t V = s_.vocab_size, d = s_.head_dim;
    const int64_t nq = s_.num_attention_heads, nkv = s_.num_key_value_heads;
    SS_RETURN_IF_ERROR(CheckHostMemory(refengine::ForwardBytes(s_, T, 1), "model '" + s_.name + "'",
                                       fmt::format("a forward of {} tokens", T)));
    if (T == 0) return InvalidArgumentError("forward: no tokens");
    std::vector<float> x(T * H);
    const float* emb = W("model.embed_tokens.weight");
    for (int64_t t = 0; t < T; ++t) {
      if (tokens[t] < 0 || tokens[t] >= V) {
        return InvalidArgumentError(
            fmt::format("token id {} is outside the vocabulary [0, {})", tokens[t], V));
      }
      std::copy_n(emb + tokens[t] * H, H, x.data() + t * H);
    }
    std::vector<float> xn(T * H), q(T * nq * d), k(T * nkv * d), v(T * nkv * d);
    std::vector<float> attn(T * nq * d), delta(T * H);
    for (int64_t l = 0; l < s_.num_hidden_layers; ++l) {
      const std::string p = fmt::format("model.layers.{}.", l);
      xn = x;
      RmsNorm(xn.data(), T, H, W(p + "input_layernorm.weight"), s_.rms_norm_eps);
      MatMulT(xn.data(), T, H, W(p + "self_attn.q_proj.weight"), nq * d,
              Opt(p + "self_attn.q_proj.bias"), q.data());
      MatMulT(xn.data(), T, H, W(p + "self_attn.k_proj.weight"), nkv * d,
              Opt(p + "self_attn.k_proj.bias"), k.data());
      MatMulT(xn.data(), T, H, W(p + "self_attn.v_proj.weight"), nkv * d,
              Opt(p + "self_attn.v_proj.bias"), v.data());
      refengine::NormAndRotate(q.data(), T, nq, d, Opt(p + "self_attn.q_norm.weight"),
                               s_.rms_norm_eps, rope_, pos_);
      refengine::NormAndRotate(k.data(), T, nkv, d, Opt(p + "self_attn.k_norm.weight"),
                               s_.rms_norm_eps, rope_, pos_);
      caches_[l].Append(k.data(), v.data(), T);
      refengine::Attend(q.data(), T, nq, caches_[l], attn.data());
      MatMulT(attn.data(), T, nq * d, W(p + "self_attn.o_proj.weight"), H,
              Opt(p + "self_attn.o_proj.bias"), delta.data());
      for (int64_t i = 0; i < T * H; ++i) x[i] += delta[i];

      xn = x;
      RmsNorm(xn.data(), T, H, W(p + "post_attention_layernorm.weight"), s_.rms_norm_eps);
      if (s_.IsMoeLayer(l)) {
        Moe(p, xn.data(), T, delta.data());
      } else {
        refengine::SwiGluMlp(xn.data(), T, H, s_.intermediate_size, W(p + "mlp.gate_proj.weight"),
                             W(p + "mlp.up_proj.weight"), W(p + "mlp.down_proj.weight"),
                             delta.data());
      }
      for (int64_t i = 0; i < T * H; ++i) x[i] += delta[i];
    }
    pos_ += T;
    std::vector<float> last(x.end() - H, x.end());
    RmsNorm(last.data(), 1, H, W("model.norm.weight"), s_.rms_norm_eps);
    const float* head = s_.tie_word_embeddings ? emb : W("lm_head.weight");
    std::vector<float> logits(V);
    MatMulT(last.data(), 1, H, head, V, nullptr, logits.data());
    return logits;
  }

 private:
  const float* W(const std::string& name) const { return w_.at(name).data(); }
  const float* Opt(const std::string& name) const {
    auto it = w_.find(name);
    return it == w_.end() ? nullptr : it->second.data();
  }

  void Moe(const std::string& p, const float* xn, int64_t T, float* out) {
    const int64_t H = s_.hidden_size, E = s_.num_experts, I = s_.moe_intermediate_size;
    std::vector<float> logits(T * E), y(H);
    MatMulT(xn, T, H, W(p + "mlp.gate.weight"), E, nullptr, logits.data());
    std::fill(out, out + T * H, 0.f);
    for (int64_t t = 0; t < T; ++t) {
      for (auto [e, w] : refengine::Route({logits.data() + t * E, static_cast<size_t>(E)},
                                          s_.num_experts_per_tok, s_.norm_topk_prob)) {
        const std::string ex = fmt::format("{}mlp.experts.{}.", p, e);
        refengine::SwiGluMlp(xn + t * H, 1, H, I, W(ex + "gate_proj.weight"),
                             W(ex + "up_proj.weight"), W(ex + "down_proj.weight"), y.data());
        for (int64_t i = 0; i < H; ++i) out[t * H + i] += w * y[i];
      }
    }
  }

  ModelSpec s_;
  Rope rope_;
  std::map<std::string, std::vector<float>> w_;
  std::vector<KvCache> caches_;
  int64_t pos_ = 0;
};

}  // namespace

Result<std::unique_ptr<CausalLm>> MakeReferenceModel(const ModelSpec& spec,
                                                     const WeightSource& weights) {
  // Before anything sized from the config is allocated (RoPE tables included).
  SS_RETURN_IF_ERROR(CheckHostMemory(refengine::SatMul(ModelNumElements(spec), 4),
                                     "model '" + spec.name + "'",
                                     "the unsharded reference engine's fp32 weights"));
  SS_ASSIGN_OR_RETURN(Rope rope, Rope::Make(spec));
  auto m = std::make_unique<ReferenceModel>(spec, std::move(rope));
  SS_RETURN_IF_ERROR(m->Load(weights));
  return std::unique_ptr<CausalLm>(std::move(m));
}

}  // namespace shardsync
