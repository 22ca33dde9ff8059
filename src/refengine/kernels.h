// Kernels shared by the reference and the sharded model: plain fp32 loops, the matmul split over
// all cores with std::thread. Correct and clear over fast.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "shardsync/model.h"
#include "shardsync/status.h"

namespace shardsync::refengine {

// y[t, o] = sum_i x[t, i] * w[o, i] (+ bias[o]) for t < T, o < out.
// x: [T, in], w: [out, in] (PyTorch linear layout), y: [T, out].
void MatMulT(const float* x, int64_t T, int64_t in, const float* w, int64_t out, const float* bias,
             float* y);

// In place, per row of `dim` values: x * rsqrt(mean(x^2) + eps) * weight.
void RmsNorm(float* x, int64_t rows, int64_t dim, const float* weight, double eps);

inline float Silu(float x) { return x / (1.f + __builtin_expf(-x)); }

// SwiGLU MLP: out[T, H] = down(silu(gate(x)) * up(x)); gate and up: [I, H], down: [H, I]
void SwiGluMlp(const float* x, int64_t T, int64_t H, int64_t I, const float* gate, const float* up,
               const float* down, float* out);

// Rotary embedding, Hugging Face rotate_half convention: pairs (i, i + d/2).
class Rope {
 public:
  static Result<Rope> Make(const ModelSpec& spec);
  // Rotates `n_heads` heads of head_dim values at absolute position `pos`.
  void Apply(float* heads, int64_t n_heads, int64_t pos) const;

 private:
  int64_t head_dim_ = 0;
  std::vector<double> inv_freq_;
};

// Keys and values of one attention layer on one rank: [len, n_kv, head_dim] each.
struct KvCache {
  int64_t n_kv = 0;
  int64_t head_dim = 0;
  int64_t len = 0;
  std::vector<float> k, v;
  void Append(const float* k_rows, const float* v_rows, int64_t T);  // [T, n_kv * head_dim]
  void Clear() {
    len = 0;
    k.clear();
    v.clear();
  }
};

// Causal attention of the last T positions of `cache` (queries q: [T, n_q * head_dim], already
// normed and rotated) against every cached position up to each query's own; q head h reads kv
// head h / (n_q / n_kv). out: [T, n_q * head_dim].
void Attend(const float* q, int64_t T, int64_t n_q, const KvCache& cache, float* out);

// Per-head RMSNorm (Qwen3 q_norm / k_norm) then RoPE for T rows of n_heads heads.
void NormAndRotate(float* rows, int64_t T, int64_t n_heads, int64_t head_dim,
                   const float* norm_weight, double eps, const Rope& rope, int64_t start_pos);

// Estimates of what an allocation sized from input will take: saturate at INT64_MAX instead of
// wrapping, so an absurd config never sneaks under the budget (CheckHostMemory, refengine.h).
inline int64_t SatMul(int64_t a, int64_t b) {
  int64_t r = 0;
  return a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}
inline int64_t SatAdd(int64_t a, int64_t b) {
  int64_t r = 0;
  return a < 0 || b < 0 || __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}
// Bytes one Forward of T tokens allocates beyond the weights: activations (hidden, attention,
// the widest MLP, the router) and the KV cache the T positions add, fp32.
int64_t ForwardBytes(const ModelSpec& spec, int64_t T, int64_t tp);

// Qwen3-MoE routing for one token: softmax over the router logits, top-k (ties: lower expert
// id first, as torch.topk on CPU), optionally renormalised. Returns (expert, weight) pairs.
std::vector<std::pair<int64_t, float>> Route(std::span<const float> router_logits, int64_t top_k,
                                             bool norm_topk_prob);

}  // namespace shardsync::refengine
