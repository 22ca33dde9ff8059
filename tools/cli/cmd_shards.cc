// `shardsync shards`: which bytes of which HF tensor every engine rank (tp, pp) owns, under the
// SGLang or vLLM loading rules; with --trainer, which bytes every trainer rank holds and where in
// its local parameters (Megatron-Core layouts: docs/megatron.md).
#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "command.h"
#include "shardsync/plan.h"
#include "shardsync/shard_map.h"

namespace shardsync::cli {
namespace {

struct ShardsOptions {
  std::string model;
  std::string engine;
  std::string trainer, trainer_dtype = "fp32";
  int tp = 1;
  int pp = 1;
  int ep = 1;
  std::string pp_partition;
  bool json = false;
  std::string rank;
  std::string explain;
  std::string quant;
  // Given flags, by count: an explicitly empty value is an error, not "flag absent".
  CLI::Option* pp_partition_opt = nullptr;
  CLI::Option* rank_opt = nullptr;
  CLI::Option* explain_opt = nullptr;
  CLI::Option* engine_opt = nullptr;
  CLI::Option* trainer_opt = nullptr;
  CLI::Option* quant_opt = nullptr;
  std::vector<CLI::Option*> engine_only;  // --tp, --pp, --ep, --pp-partition, --quant
};

// --trainer: every (or one) trainer rank's local parameters and the HF bytes they hold.
Result<std::string> RunTrainer(const ShardsOptions& o) {
  for (const CLI::Option* opt : o.engine_only) {
    if (opt->count() > 0) {
      return InvalidArgumentError(fmt::format(
          "{}: an engine flag; with --trainer the layout is the trainer spec", opt->get_name()));
    }
  }
  SS_ASSIGN_OR_RETURN(ModelSpec model, LoadModelSpec(o.model));
  SS_ASSIGN_OR_RETURN(TrainerSpec t, ParseTrainerSpec(o.trainer));
  SS_ASSIGN_OR_RETURN(DType dtype, ParseDType(o.trainer_dtype, "--trainer-dtype"));
  SS_RETURN_IF_ERROR(CheckTrainerLayout(model, t));
  int first = 0, last = t.world();
  if (o.rank_opt->count() > 0) {
    int r = -1;
    char tail = 0;
    if (std::sscanf(o.rank.c_str(), "%d%c", &r, &tail) != 1 || r < 0 || r >= t.world()) {
      return InvalidArgumentError(fmt::format("--rank: '{}' is not a trainer rank of {} (world {})",
                                              o.rank, t.ToString(), t.world()));
    }
    first = r;
    last = r + 1;
  }
  std::vector<TrainerRankParams> ranks;
  for (int r = first; r < last; ++r) {
    SS_ASSIGN_OR_RETURN(TrainerRankParams p, BuildTrainerParams(model, t, r, dtype));
    ranks.push_back(std::move(p));
  }
  if (o.explain_opt->count() > 0) return ExplainTrainerParam(ranks, o.explain);
  if (o.json) return TrainerMapToJson(model, t, ranks);
  return TrainerMapToTable(model, t, ranks);
}

// "--rank 1,0" -> (tp 1, pp 0).
Result<std::pair<int, int>> ParseRank(const std::string& s, const ShardSpec& spec) {
  const auto comma = s.find(',');
  int tp = -1, pp = -1;
  char tail = 0;
  if (comma == std::string::npos || std::sscanf(s.c_str(), "%d,%d%c", &tp, &pp, &tail) != 2) {
    return InvalidArgumentError(fmt::format("--rank: '{}' is not TP_RANK,PP_RANK (e.g. 1,0)", s));
  }
  if (tp < 0 || tp >= spec.tp || pp < 0 || pp >= spec.pp) {
    return InvalidArgumentError(
        fmt::format("--rank {}: outside tp [0, {}) x pp [0, {})", s, spec.tp, spec.pp));
  }
  return std::make_pair(tp, pp);
}

Result<std::string> Run(const ShardsOptions& o) {
  if (o.trainer_opt->count() > 0) {
    if (o.engine_opt->count() > 0) {
      return InvalidArgumentError("--engine: give --engine (engine ranks) or --trainer, not both");
    }
    return RunTrainer(o);
  }
  if (o.engine_opt->count() == 0) {
    return InvalidArgumentError("--engine: required (or --trainer for trainer ranks)");
  }
  SS_ASSIGN_OR_RETURN(ModelSpec model, LoadModelSpec(o.model));
  if (o.quant_opt->count() > 0) {
    SS_ASSIGN_OR_RETURN(model.quant, ParseQuantFlag(o.quant));
    SS_RETURN_IF_ERROR(ValidateModelSpec(model));
  }
  ShardSpec spec;
  SS_ASSIGN_OR_RETURN(spec.engine, ParseEngineKind(o.engine, "--engine"));
  spec.tp = o.tp;
  spec.pp = o.pp;
  spec.ep = o.ep;
  if (o.pp_partition_opt->count() > 0) {
    SS_ASSIGN_OR_RETURN(spec.pp_partition, ParsePpPartition(o.pp_partition, "--pp-partition"));
  }
  SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(model, spec));
  std::vector<const EngineRankShards*> ranks;
  if (o.rank_opt->count() > 0) {
    SS_ASSIGN_OR_RETURN(auto tp_pp, ParseRank(o.rank, spec));
    ranks.push_back(&map.rank(tp_pp.first, tp_pp.second));
  } else {
    ranks = AllRanks(map);
  }
  if (o.explain_opt->count() > 0) return ExplainParamOnRanks(map, ranks, o.explain);
  if (o.json) return ShardMapToJson(map, ranks);
  return ShardMapToTable(map, ranks);
}

Registration reg(
    {"shards", [](CLI::App& app) {
       auto o = std::make_shared<ShardsOptions>();
       auto* sub = app.add_subcommand(
           "shards",
           "Which bytes of which HF tensor every engine rank (tp, pp) owns, under the "
           "SGLang or vLLM loading rules; with --trainer, what every trainer rank "
           "holds and where in its local parameters");
       sub->add_option("--model", o->model,
                       "Embedded model name (qwen3-8b, ...) or a config.json path or "
                       "directory")
           ->required();
       o->engine_opt =
           sub->add_option("--engine", o->engine, "sglang | vllm (engine ranks; or --trainer)");
       o->trainer_opt =
           sub->add_option("--trainer", o->trainer,
                           "Trainer layout instead of an engine: megatron=tp=T,pp=P[,...] | fsdp=S "
                           "| hsdp=RxS | replicate=S | single");
       sub->add_option("--trainer-dtype", o->trainer_dtype,
                       "Dtype the trainer holds (with --trainer)")
           ->capture_default_str();
       o->engine_only.push_back(sub->add_option("--tp", o->tp, "Tensor-parallel size (default 1)"));
       o->engine_only.push_back(
           sub->add_option("--pp", o->pp, "Pipeline-parallel size (default 1)"));
       o->engine_only.push_back(
           sub->add_option("--ep", o->ep,
                           "Expert-parallel size (SGLang --ep-size; vLLM: 1, or tp with "
                           "--enable-expert-parallel); default 1"));
       o->pp_partition_opt =
           sub->add_option("--pp-partition", o->pp_partition,
                           "Explicit layers per stage, e.g. 9,10,9 "
                           "(SGLANG_PP_LAYER_PARTITION / VLLM_PP_LAYER_PARTITION)");
       o->engine_only.push_back(o->pp_partition_opt);
       o->quant_opt = sub->add_option(
           "--quant", o->quant,
           "Engine weights: fp8-block128 (block-FP8 weight + weight_scale_inv, overriding the "
           "config's quantization_config) | none (the model dtype)");
       o->engine_only.push_back(o->quant_opt);
       auto* json = sub->add_flag("--json", o->json, "Print one JSON object (schema: docs/cli.md)");
       o->rank_opt = sub->add_option(
           "--rank", o->rank, "Only engine rank TP_RANK,PP_RANK (with --trainer: trainer rank R)");
       o->explain_opt = sub->add_option("--explain", o->explain,
                                        "Say where every byte of this engine (or trainer local) "
                                        "parameter comes from")
                            ->excludes(json);
       return [o] {
         Result<std::string> out = Run(*o);
         if (!out.ok()) return ReportError(out.status());
         std::fwrite(out->data(), 1, out->size(), stdout);
         return kExitOk;
       };
     }});

}  // namespace
}  // namespace shardsync::cli
