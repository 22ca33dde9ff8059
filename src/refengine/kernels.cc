#include "refengine/kernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <thread>

#include <unistd.h>

namespace shardsync::refengine {
namespace {

// Dot product with 16 independent accumulators so the compiler vectorizes without reassociating.
inline float Dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

// Below this many multiply-adds a matmul runs on the calling thread (thread start-up dominates).
constexpr int64_t kParallelThreshold = int64_t{1} << 18;

}  // namespace

void MatMulT(const float* x, int64_t T, int64_t in, const float* w, int64_t out, const float* bias,
             float* y) {
  auto rows = [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      const float* wr = w + o * in;
      const float b = bias != nullptr ? bias[o] : 0.f;
      for (int64_t t = 0; t < T; ++t) y[t * out + o] = Dot(x + t * in, wr, in) + b;
    }
  };
  const int64_t work = T * in * out;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t n_threads =
      std::min<int64_t>({hw, out, std::max<int64_t>(1, work / kParallelThreshold)});
  if (n_threads <= 1) {
    rows(0, out);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(n_threads - 1);
  const int64_t chunk = (out + n_threads - 1) / n_threads;
  for (int64_t i = 1; i < n_threads; ++i) {
    const int64_t o0 = std::min(out, i * chunk), o1 = std::min(out, (i + 1) * chunk);
    threads.emplace_back(rows, o0, o1);
  }
  rows(0, std::min(out, chunk));
  for (auto& t : threads) t.join();
}

void SwiGluMlp(const float* x, int64_t T, int64_t H, int64_t I, const float* gate, const float* up,
               const float* down, float* out) {
  std::vector<float> g(T * I), u(T * I);
  MatMulT(x, T, H, gate, I, nullptr, g.data());
  MatMulT(x, T, H, up, I, nullptr, u.data());
  for (int64_t i = 0; i < T * I; ++i) g[i] = Silu(g[i]) * u[i];
  MatMulT(g.data(), T, I, down, H, nullptr, out);
}

void RmsNorm(float* x, int64_t rows, int64_t dim, const float* weight, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * dim;
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(v[i]) * v[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
    for (int64_t i = 0; i < dim; ++i) v[i] = weight[i] * (v[i] * inv);
  }
}

Result<Rope> Rope::Make(const ModelSpec& spec) {
  Rope r;
  r.head_dim_ = spec.head_dim;
  if (spec.head_dim <= 0 || spec.head_dim % 2 != 0) {
    return InvalidArgumentError(
        fmt::format("head_dim {} must be positive and even for RoPE", spec.head_dim));
  }
  const int64_t half = spec.head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    // HF computes inv_freq in fp32: 1 / theta^(2i / d).
    r.inv_freq_.push_back(static_cast<float>(
        1.0 / std::pow(spec.rope_theta, static_cast<double>(2 * i) / spec.head_dim)));
  }
  if (spec.rope_scaling.has_value() && spec.rope_scaling->type != "default") {
    const RopeScaling& s = *spec.rope_scaling;
    if (s.type == "linear") {
      for (double& f : r.inv_freq_) f /= s.factor;
    } else if (s.type == "llama3") {
      // transformers modeling_rope_utils._compute_llama3_parameters.
      const double old_len = static_cast<double>(s.original_max_position_embeddings);
      const double low_wavelen = old_len / s.low_freq_factor;
      const double high_wavelen = old_len / s.high_freq_factor;
      for (double& f : r.inv_freq_) {
        const double wavelen = 2 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          f = f / s.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth =
              (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1 - smooth) * f / s.factor + smooth * f;
        }
      }
    } else {
      return UnimplementedError(
          fmt::format("rope_scaling.rope_type '{}' is not supported by the reference engine "
                      "(default, linear, llama3)",
                      s.type));
    }
  }
  return r;
}

void Rope::Apply(float* heads, int64_t n_heads, int64_t pos) const {
  const int64_t half = head_dim_ / 2;
  for (int64_t i = 0; i < half; ++i) {
    // HF: freqs = pos * inv_freq in fp32, then cos/sin.
    const float angle = static_cast<float>(pos) * static_cast<float>(inv_freq_[i]);
    const float c = std::cos(angle), s = std::sin(angle);
    for (int64_t h = 0; h < n_heads; ++h) {
      float* x = heads + h * head_dim_;
      const float a = x[i], b = x[i + half];
      x[i] = a * c - b * s;
      x[i + half] = b * c + a * s;
    }
  }
}

void KvCache::Append(const float* k_rows, const float* v_rows, int64_t T) {
  const int64_t n = T * n_kv * head_dim;
  k.insert(k.end(), k_rows, k_rows + n);
  v.insert(v.end(), v_rows, v_rows + n);
  len += T;
}

void Attend(const float* q, int64_t T, int64_t n_q, const KvCache& cache, float* out) {
  const int64_t d = cache.head_dim, n_kv = cache.n_kv, group = n_q / n_kv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> p(cache.len);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = cache.len - T + t;  // this query's absolute position
    for (int64_t h = 0; h < n_q; ++h) {
      const float* qh = q + (t * n_q + h) * d;
      const int64_t kvh = h / group;
      float mx = -INFINITY;
      for (int64_t s = 0; s <= pos; ++s) {
        const float* kr = cache.k.data() + (s * n_kv + kvh) * d;
        float dot = 0.f;
        for (int64_t i = 0; i < d; ++i) dot += qh[i] * kr[i];
        p[s] = dot * scale;
        mx = std::max(mx, p[s]);
      }
      double sum = 0;
      for (int64_t s = 0; s <= pos; ++s) {
        p[s] = std::exp(p[s] - mx);
        sum += p[s];
      }
      float* o = out + (t * n_q + h) * d;
      std::fill(o, o + d, 0.f);
      for (int64_t s = 0; s <= pos; ++s) {
        const float w = static_cast<float>(p[s] / sum);
        const float* vr = cache.v.data() + (s * n_kv + kvh) * d;
        for (int64_t i = 0; i < d; ++i) o[i] += w * vr[i];
      }
    }
  }
}

void NormAndRotate(float* rows, int64_t T, int64_t n_heads, int64_t head_dim,
                   const float* norm_weight, double eps, const Rope& rope, int64_t start_pos) {
  for (int64_t t = 0; t < T; ++t) {
    float* r = rows + t * n_heads * head_dim;
    if (norm_weight != nullptr) RmsNorm(r, n_heads, head_dim, norm_weight, eps);
    rope.Apply(r, n_heads, start_pos + t);
  }
}

std::vector<std::pair<int64_t, float>> Route(std::span<const float> router_logits, int64_t top_k,
                                             bool norm_topk_prob) {
  const int64_t e = static_cast<int64_t>(router_logits.size());
  float mx = -INFINITY;
  for (float v : router_logits) mx = std::max(mx, v);
  std::vector<double> prob(e);
  double sum = 0;
  for (int64_t i = 0; i < e; ++i)
    sum += prob[i] = std::exp(static_cast<double>(router_logits[i]) - mx);
  std::vector<int64_t> idx(e);
  for (int64_t i = 0; i < e; ++i) idx[i] = i;
  const int64_t k = std::min(top_k, e);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
    return prob[a] != prob[b] ? prob[a] > prob[b] : a < b;
  });
  double top_sum = 0;
  for (int64_t i = 0; i < k; ++i) top_sum += prob[idx[i]] / sum;
  std::vector<std::pair<int64_t, float>> out;
  for (int64_t i = 0; i < k; ++i) {
    double w = prob[idx[i]] / sum;
    if (norm_topk_prob) w /= top_sum;
    out.emplace_back(idx[i], static_cast<float>(w));
  }
  return out;
}

}  // namespace shardsync::refengine
