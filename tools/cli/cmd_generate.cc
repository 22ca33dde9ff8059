// `shardsync generate`: greedy decoding with the CPU reference engine, unsharded or through an
// engine layout (weights cut into engine shards by the shard map, then the sharded forward).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "command.h"
#include "shardsync/refengine.h"

namespace shardsync::cli {
namespace {

struct Args {
  std::string weights, model, prompt_ids, engine, pp_partition;
  std::string engine_dump;           // --engine-dump: replica 0's received parameters, checked
  std::optional<std::string> quant;  // --quant
  uint64_t seed = 0;
  bool seed_given = false;
  int max_new_tokens = 8;
  int tp = 1, pp = 1, ep = 1;
  bool json = false;
};

Result<std::vector<int64_t>> ParseIds(const std::string& s) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t c = s.find(',', pos);
    if (c == std::string::npos) c = s.size();
    const std::string tok = s.substr(pos, c - pos);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(tok.c_str(), &end, 10);
    if (tok.empty() || *end != '\0' || v < 0 || errno != 0) {
      return InvalidArgumentError(
          fmt::format("--prompt-ids: expected non-negative token ids like 1,2,3, got '{}'", s));
    }
    out.push_back(v);
    pos = c + 1;
  }
  if (out.size() > 4096) return InvalidArgumentError("--prompt-ids: more than 4096 tokens");
  return out;
}

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// --engine-dump: the engines' received parameters (one safetensors dump per engine rank, as
// WriteEngineDump writes them) run through the sharded forward, against the unsharded model on
// --weights / --model: the check `demo` makes after a sync, for dumps any client wrote.
int CheckDump(const Args& a, const ShardMap& map, const WeightSource& reference,
              const std::vector<int64_t>& prompt, const std::string& weights_desc) {
  auto buffers = LoadEngineDump(a.engine_dump, map, 0);
  if (!buffers.ok()) return ReportInputError(buffers.status(), "--engine-dump");
  auto g = CheckGeneration(map, *buffers, reference, prompt, a.max_new_tokens);
  if (!g.ok()) return ReportError(g.status());
  if (a.json) {
    nlohmann::json j;
    j["weights"] = weights_desc;
    j["engine_dump"] = a.engine_dump;
    j["layout"] = fmt::format("{} tp {} x pp {} (ep {})", a.engine, a.tp, a.pp, a.ep);
    j["prompt_ids"] = prompt;
    j["tokens"] = g->engine_tokens;
    j["reference_tokens"] = g->reference_tokens;
    j["max_logit_diff"] = g->max_logit_diff;
    j["logit_tolerance"] = g->tolerance;
    j["match"] = g->match;
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("engine  (%s tp %d x pp %d, dumps in %s): [%s]\n", a.engine.c_str(), a.tp, a.pp,
                a.engine_dump.c_str(),
                fmt::format("{}", fmt::join(g->engine_tokens, ", ")).c_str());
    std::printf("reference (unsharded, %s):       [%s]\n", weights_desc.c_str(),
                fmt::format("{}", fmt::join(g->reference_tokens, ", ")).c_str());
    std::printf("%s: max |logit diff| %.3g (tolerance %.3g)\n", g->match ? "MATCH" : "MISMATCH",
                g->max_logit_diff, g->tolerance);
  }
  return g->match ? kExitOk : 1;
}

int Run(const Args& a) {
  using Clock = std::chrono::steady_clock;
  if (a.weights.empty() == a.model.empty()) {
    return ReportError(InvalidArgumentError(
        "--weights DIR|FILE or --model NAME (synthetic weights): give exactly one"));
  }
  if (a.seed_given && a.model.empty()) {
    return ReportError(InvalidArgumentError("--seed: only with --model (synthetic weights)"));
  }
  if (a.max_new_tokens < 0 || a.max_new_tokens > 4096) {
    return ReportError(InvalidArgumentError(
        fmt::format("--max-new-tokens: must be in [0, 4096], got {}", a.max_new_tokens)));
  }
  const bool sharded = !a.engine.empty();
  if (!a.engine_dump.empty() && !sharded) {
    return ReportError(
        InvalidArgumentError("--engine-dump: needs --engine sglang|vllm and its "
                             "--tp/--pp/--ep (the layout the dumps were cut for)"));
  }
  if (!sharded && (a.tp != 1 || a.pp != 1 || a.ep != 1 || !a.pp_partition.empty())) {
    return ReportError(
        InvalidArgumentError("--tp/--pp/--ep/--pp-partition need --engine sglang|vllm"));
  }
  std::vector<int64_t> prompt = DefaultPrompt();
  if (!a.prompt_ids.empty()) {
    auto ids = ParseIds(a.prompt_ids);
    if (!ids.ok()) return ReportError(ids.status());
    prompt = *ids;
  }
  const auto t0 = Clock::now();
  ModelSpec spec;
  std::unique_ptr<WeightSource> weights;
  std::string weights_desc;
  if (!a.weights.empty()) {
    auto ck = CheckpointWeightSource::Open(a.weights);
    if (!ck.ok()) return ReportInputError(ck.status(), "--weights");
    auto s = LoadModelSpec((*ck)->checkpoint().directory());
    if (!s.ok()) {
      Status st = s.status();
      return ReportError(st.Annotate("--weights: config.json beside the safetensors"));
    }
    spec = *s;
    weights = std::move(ck).value();
    weights_desc = a.weights;
  } else {
    auto s = LoadModelSpec(a.model);
    if (!s.ok()) return ReportError(s.status());
    spec = *s;
    weights = std::make_unique<SyntheticWeightSource>(spec, a.seed);
    weights_desc = fmt::format("synthetic seed {}", a.seed);
  }
  // Block FP8: the engine runs e4m3 weights with their scales. An FP8 checkpoint serves them as
  // they are; unquantized weights are quantized here with the sync's quantizer.
  const std::optional<QuantConfig> config_quant = spec.quant;
  if (a.quant) {
    auto q = ParseQuantFlag(*a.quant);
    if (!q.ok()) return ReportError(q.status());
    spec.quant = *q;
    if (Status v = ValidateModelSpec(spec); !v.ok()) return ReportError(v);
  }
  std::unique_ptr<WeightSource> fp8_owned, dq_owned;
  const WeightSource* engine_weights = weights.get();     // what the sharded forward cuts
  const WeightSource* reference_weights = weights.get();  // what the unsharded forward reads
  if (spec.quant) {
    if (HoldsFp8Weights(*weights, spec)) {
      weights_desc += ", block-FP8 checkpoint";
    } else {
      fp8_owned = std::make_unique<QuantizedWeightSource>(*weights, spec);
      engine_weights = fp8_owned.get();
      weights_desc +=
          fmt::format(", quantized to block FP8 ({})", QuantConfigToString(*spec.quant));
    }
    dq_owned = std::make_unique<DequantizedWeightSource>(*engine_weights, spec);
    reference_weights = dq_owned.get();
  } else if (config_quant) {
    // --quant none on an FP8 checkpoint: run its dequantized weights in the model dtype.
    ModelSpec as_stored = spec;
    as_stored.quant = config_quant;
    if (HoldsFp8Weights(*weights, as_stored)) {
      dq_owned = std::make_unique<DequantizedWeightSource>(*weights, as_stored);
      engine_weights = reference_weights = dq_owned.get();
      weights_desc += ", block-FP8 checkpoint dequantized";
    }
  }
  for (int64_t id : prompt) {
    if (id >= spec.vocab_size) {
      return ReportError(InvalidArgumentError(fmt::format(
          "--prompt-ids: token id {} is outside the vocabulary [0, {})", id, spec.vocab_size)));
    }
  }
  std::unique_ptr<CausalLm> lm;
  std::string layout = "unsharded";
  if (sharded) {
    auto engine = ParseEngineKind(a.engine, "--engine");
    if (!engine.ok()) return ReportError(engine.status());
    ShardSpec ss{*engine, a.tp, a.pp, a.ep, {}};
    if (!a.pp_partition.empty()) {
      auto part = ParsePpPartition(a.pp_partition, "--pp-partition");
      if (!part.ok()) return ReportError(part.status());
      ss.pp_partition = *part;
    }
    auto map = BuildShardMap(spec, ss);
    if (!map.ok()) return ReportError(map.status());
    if (!a.engine_dump.empty()) return CheckDump(a, *map, *reference_weights, prompt, weights_desc);
    auto buffers = CutEngineShards(*map, *engine_weights);
    if (!buffers.ok()) return ReportError(buffers.status());
    auto m = MakeShardedModel(*map, *buffers);
    if (!m.ok()) return ReportError(m.status());
    lm = std::move(m).value();
    layout = fmt::format("{} tp {} x pp {} (ep {})", a.engine, a.tp, a.pp, a.ep);
  } else {
    auto m = MakeReferenceModel(spec, *reference_weights);
    if (!m.ok()) return ReportError(m.status());
    lm = std::move(m).value();
  }
  const double load_s = Since(t0);
  const auto t1 = Clock::now();
  auto g = GreedyGenerate(*lm, prompt, a.max_new_tokens);
  if (!g.ok()) return ReportError(g.status());
  const double gen_s = Since(t1);
  const std::vector<float>& logits = g->step_logits.front();
  if (a.json) {
    nlohmann::json j;
    j["model"] = spec.name;
    j["architecture"] = std::string(ArchitectureName(spec.arch));
    j["weights"] = weights_desc;
    j["layout"] = layout;
    j["prompt_ids"] = prompt;
    j["tokens"] = g->tokens;
    j["logits"] = logits;
    j["seconds"] = {{"load", load_s}, {"generate", gen_s}};
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("model:   %s (%s), weights %s\n", spec.name.c_str(),
                std::string(ArchitectureName(spec.arch)).c_str(), weights_desc.c_str());
    std::printf("layout:  %s\n", layout.c_str());
    std::printf("prompt:  %s\n", fmt::format("{}", fmt::join(prompt, ",")).c_str());
    std::printf("tokens:  %s\n", fmt::format("{}", fmt::join(g->tokens, ",")).c_str());
    std::printf("time:    load %.2f s, prefill + %d tokens %.2f s\n", load_s, a.max_new_tokens,
                gen_s);
  }
  return kExitOk;
}

Registration reg(
    {"generate", [](CLI::App& app) {
       auto a = std::make_shared<Args>();
       auto* sub = app.add_subcommand(
           "generate",
           "Greedy-decode with the CPU reference engine (unsharded, or through an "
           "engine's TP x PP x EP layout)");
       sub->add_option("--weights", a->weights, "safetensors FILE or DIR (config.json beside it)");
       sub->add_option("--model", a->model,
                       "embedded model NAME or config PATH, with synthetic weights");
       sub->add_option("--seed", a->seed, "synthetic weight seed (with --model)")
           ->check(NonNegativeInteger())
           ->each([a](const std::string&) { a->seed_given = true; });
       sub->add_option("--prompt-ids", a->prompt_ids,
                       "comma-separated prompt token ids (default 1,17,42,5,33,8)");
       sub->add_option("--max-new-tokens", a->max_new_tokens, "tokens to generate (default 8)");
       sub->add_option("--engine", a->engine, "sglang|vllm: run the sharded forward");
       sub->add_option("--tp", a->tp, "tensor-parallel size (default 1)");
       sub->add_option("--pp", a->pp, "pipeline-parallel size (default 1)");
       sub->add_option("--ep", a->ep, "expert-parallel size (default 1)");
       sub->add_option("--pp-partition", a->pp_partition, "explicit layers per stage, e.g. 10,9,9");
       sub->add_option("--engine-dump", a->engine_dump,
                       "DIR of engine dumps (replica 0, one safetensors per engine rank): run the "
                       "sharded forward on them and compare with the unsharded model (MATCH / "
                       "MISMATCH, exit 1 on a mismatch)");
       sub->add_flag("--json", a->json, "print {tokens, logits (last prompt position, fp32), ...}");
       auto quant = std::make_shared<std::string>();
       sub->add_option("--quant", *quant,
                       "fp8-block128: run block-FP8 engine weights (an FP8 checkpoint as stored, "
                       "other weights quantized here); none: the model dtype (overrides the "
                       "config's quantization_config)");
       return [a, sub, quant] {
         if (sub->count("--quant") > 0) a->quant = *quant;
         if (sub->count("--prompt-ids") > 0 && a->prompt_ids.empty()) {
           return ReportError(InvalidArgumentError("--prompt-ids: empty list of token ids"));
         }
         return Run(*a);
       };
     }});

}  // namespace
}  // namespace shardsync::cli
