// Greedy decoding and the sharded-vs-reference generation check.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "refengine/kernels.h"
#include "shardsync/refengine.h"

namespace shardsync {

std::vector<int64_t> DefaultPrompt() { return {1, 17, 42, 5, 33, 8}; }

Result<Generation> GreedyGenerate(CausalLm& lm, std::span<const int64_t> prompt,
                                  int max_new_tokens) {
  if (prompt.empty()) return InvalidArgumentError("prompt: no token ids");
  if (max_new_tokens < 0) {
    return InvalidArgumentError(
        fmt::format("max_new_tokens: must be non-negative, got {}", max_new_tokens));
  }
  // Every step's logits are kept (vocab_size floats each).
  SS_RETURN_IF_ERROR(CheckHostMemory(
      refengine::SatMul(refengine::SatMul(int64_t{max_new_tokens} + 1, lm.vocab_size()), 4),
      fmt::format("max_new_tokens {}", max_new_tokens),
      fmt::format("keeping the logits of every step (vocabulary {})", lm.vocab_size())));
  lm.Reset();
  Generation g;
  // Finite weights can still overflow (1e30 everywhere gives inf, then NaN): argmax over a NaN is
  // meaningless, so such a step is an error naming it, never a token.
  auto finite = [](const std::vector<float>& l, int step) -> Status {
    for (size_t v = 0; v < l.size(); ++v) {
      if (!std::isfinite(l[v])) {
        return FailedPreconditionError(fmt::format(
            "generate: step {}'s logits are not finite (token {} is {}): the weights overflow "
            "float32 in the forward pass",
            step, v, l[v]));
      }
    }
    return OkStatus();
  };
  SS_ASSIGN_OR_RETURN(std::vector<float> logits, lm.Forward(prompt));
  SS_RETURN_IF_ERROR(finite(logits, 0));
  for (int i = 0; i < max_new_tokens; ++i) {
    // argmax; max_element keeps the first (lowest id) of equal values, as torch.argmax does.
    const int64_t next = std::max_element(logits.begin(), logits.end()) - logits.begin();
    g.tokens.push_back(next);
    g.step_logits.push_back(std::move(logits));
    if (i + 1 == max_new_tokens) return g;
    const int64_t one[1] = {next};
    SS_ASSIGN_OR_RETURN(logits, lm.Forward(one));
    SS_RETURN_IF_ERROR(finite(logits, i + 1));
  }
  g.step_logits.push_back(std::move(logits));  // max_new_tokens == 0: the prompt's logits
  return g;
}

Result<GenerationCheck> CheckGeneration(const ShardMap& map,
                                        const std::vector<EngineBuffers>& per_rank,
                                        const WeightSource& reference,
                                        std::span<const int64_t> prompt, int n_tokens,
                                        double tolerance) {
  GenerationCheck c;
  c.prompt.assign(prompt.begin(), prompt.end());
  Generation ref, eng;
  {
    // A block-FP8 engine computes with the quantized weights: run the reference on the same.
    std::unique_ptr<QuantizedWeightSource> fp8;
    std::unique_ptr<DequantizedWeightSource> dq;
    const WeightSource* src = &reference;
    if (map.model.quant) {
      fp8 = std::make_unique<QuantizedWeightSource>(reference, map.model);
      dq = std::make_unique<DequantizedWeightSource>(*fp8, map.model);
      src = dq.get();
    }
    SS_ASSIGN_OR_RETURN(auto lm, MakeReferenceModel(map.model, *src));
    SS_ASSIGN_OR_RETURN(ref, GreedyGenerate(*lm, prompt, n_tokens));
  }
  {
    SS_ASSIGN_OR_RETURN(auto lm, MakeShardedModel(map, per_rank));
    SS_ASSIGN_OR_RETURN(eng, GreedyGenerate(*lm, prompt, n_tokens));
  }
  c.reference_tokens = ref.tokens;
  c.engine_tokens = eng.tokens;
  c.tokens_identical = ref.tokens == eng.tokens;
  double max_ref = 0, max_diff = 0;
  // Compare each step while both runs have the same history (logits that chose token i depend
  // on tokens[0..i-1]).
  for (size_t i = 0; i < ref.step_logits.size() && i < eng.step_logits.size(); ++i) {
    const auto& a = ref.step_logits[i];
    const auto& b = eng.step_logits[i];
    for (size_t j = 0; j < a.size() && j < b.size(); ++j) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(a[j])));
      const double diff = std::fabs(static_cast<double>(a[j]) - b[j]);
      // NaN never compares greater: count it as an infinite difference.
      max_diff = std::isnan(diff) ? INFINITY : std::max(max_diff, diff);
    }
    if (i < ref.tokens.size() && i < eng.tokens.size() && ref.tokens[i] != eng.tokens[i]) break;
  }
  c.max_logit_diff = max_diff;
  c.tolerance = tolerance >= 0 ? tolerance : kLogitAbsTolerance + kLogitRelTolerance * max_ref;
  c.match = c.tokens_identical && c.max_logit_diff <= c.tolerance;
  return c;
}

}  // namespace shardsync
