// PlanHash: one hash of everything that defines a plan, compared by every rank before any byte
// moves.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>

#include "plan/codec.h"
#include "plan/plan_hash.h"
#include "shardsync/plan.h"

namespace shardsync {

std::string PlanHashText(const PlanInputs& in) {
  // Canonical text of everything that defines the plan. The model's name/path is left out (ranks
  // may read the same config from different paths); mlp_only_layers is a set, so it is sorted.
  const ModelSpec& m = in.model;
  std::string s;
  auto kv = [&s](std::string_view k, const auto& v) { s += fmt::format("{}={}\n", k, v); };
  kv("planner", kPlannerVersion);
  kv("arch", static_cast<int>(m.arch));
  kv("hidden_size", m.hidden_size);
  kv("num_attention_heads", m.num_attention_heads);
  kv("num_key_value_heads", m.num_key_value_heads);
  kv("head_dim", m.head_dim);
  kv("num_hidden_layers", m.num_hidden_layers);
  kv("intermediate_size", m.intermediate_size);
  kv("vocab_size", m.vocab_size);
  kv("tie_word_embeddings", m.tie_word_embeddings);
  kv("attention_bias", m.attention_bias);
  kv("qkv_bias", m.qkv_bias);
  kv("qk_norm", m.qk_norm);
  kv("num_experts", m.num_experts);
  kv("moe_intermediate_size", m.moe_intermediate_size);
  kv("num_experts_per_tok", m.num_experts_per_tok);
  kv("decoder_sparse_step", m.decoder_sparse_step);
  std::vector<int64_t> mlp_only = m.mlp_only_layers;
  std::sort(mlp_only.begin(), mlp_only.end());
  mlp_only.erase(std::unique(mlp_only.begin(), mlp_only.end()), mlp_only.end());
  kv("mlp_only_layers", fmt::format("{}", fmt::join(mlp_only, ",")));
  kv("model_dtype", DTypeName(m.dtype));
  // The codec's planner version and options (codec.h HashFields): none for the copy codec, so
  // bf16 plans keep the hashes they had.
  plan_internal::CodecFor(in).HashFields(in, &s);
  // Fields that do not move bytes still identify the model the ranks must agree on.
  kv("rms_norm_eps", fmt::format("{:.17g}", m.rms_norm_eps));
  kv("rope_theta", fmt::format("{:.17g}", m.rope_theta));
  kv("max_position_embeddings", m.max_position_embeddings);
  kv("norm_topk_prob", m.norm_topk_prob);
  if (m.rope_scaling) {
    const RopeScaling& r = *m.rope_scaling;
    kv("rope_scaling",
       fmt::format("{};{:.17g};{:.17g};{:.17g};{}", r.type, r.factor, r.low_freq_factor,
                   r.high_freq_factor, r.original_max_position_embeddings));
  }
  kv("trainer", in.trainer.ToString());
  kv("trainer_dtype", DTypeName(in.trainer_dtype));
  // Each engine under its own name (EngineKindName: every EngineKind, or no build), so a new
  // engine's plans cannot hash as another's; sglang and vllm keep the bytes they always hashed.
  kv("engine", EngineKindName(in.rollout.shard.engine));
  kv("dp", in.rollout.dp);
  kv("tp", in.rollout.shard.tp);
  kv("pp", in.rollout.shard.pp);
  kv("ep", in.rollout.shard.ep);
  kv("pp_partition", fmt::format("{}", fmt::join(in.rollout.shard.pp_partition, ",")));
  // Only when not the default, so existing plans keep their hashes.
  if (in.rollout.shard.expert_naming != ExpertNaming::kFusedMoe) {
    kv("expert_naming", ExpertNamingName(in.rollout.shard.expert_naming));
  }
  kv("wire_dtype", DTypeName(in.options.wire_dtype));
  kv("bucket_bytes", in.options.bucket_bytes);
  // Only when not full, so existing plans keep their hashes; both ends must agree on it.
  if (in.options.encoding != WireEncoding::kFull)
    kv("encoding", WireEncodingName(in.options.encoding));
  return s;
}

std::string PlanHash(const PlanInputs& in) {
  const std::string s = PlanHashText(in);
  const XXH128_hash_t h = XXH3_128bits(s.data(), s.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

std::string FirstPlanDifference(std::string_view mine, std::string_view theirs,
                                std::string_view who) {
  // Both are "key=value\n" lines in one order; a key only one side has (a field added for
  // non-default values, e.g. quant) counts as a difference too.
  auto lines = [](std::string_view t) {
    std::vector<std::pair<std::string_view, std::string_view>> out;
    for (size_t at = 0; at < t.size();) {
      size_t nl = t.find('\n', at);
      if (nl == std::string_view::npos) nl = t.size();
      const std::string_view line = t.substr(at, nl - at);
      const size_t eq = line.find('=');
      out.emplace_back(line.substr(0, eq),
                       eq == std::string_view::npos ? std::string_view() : line.substr(eq + 1));
      at = nl + 1;
    }
    return out;
  };
  const auto a = lines(mine), b = lines(theirs);
  auto value_in = [](const auto& v, std::string_view k) -> std::string {
    for (const auto& [key, val] : v) {
      if (key == k) return std::string(val);
    }
    return "(absent)";
  };
  auto say = [&](std::string_view k) {
    return std::string(k) + " is " + value_in(a, k) + " here and " + value_in(b, k) + " on " +
           std::string(who);
  };
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i < a.size() && i < b.size() && a[i] == b[i]) continue;
    return say(i < a.size() ? a[i].first : b[i].first);
  }
  return "";
}

std::string_view EncodingName(Encoding e) {
  switch (e) {
    case Encoding::kCopy:
      return "copy";
    case Encoding::kQuantize:
      return "quantize";
    case Encoding::kStage:
      return "stage";
    case Encoding::kAmax:
      return "amax";
  }
  return "?";
}

std::string_view WireEncodingName(WireEncoding e) {
  return e == WireEncoding::kDelta ? "delta" : e == WireEncoding::kAuto ? "auto" : "full";
}

Result<WireEncoding> ParseWireEncoding(std::string_view s, std::string_view flag) {
  if (s == "full") return WireEncoding::kFull;
  if (s == "delta") return WireEncoding::kDelta;
  if (s == "auto") return WireEncoding::kAuto;
  return InvalidArgumentError(fmt::format("{}: '{}', expected full, delta or auto", flag, s));
}

}  // namespace shardsync
