// `shardsync shards`: which bytes of which HF tensor every engine rank (tp, pp) owns, under the
// SGLang or vLLM loading rules.
#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "command.h"
#include "shardsync/shard_map.h"

namespace shardsync::cli {
namespace {

struct ShardsOptions {
  std::string model;
  std::string engine;
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
  CLI::Option* quant_opt = nullptr;
};

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

Registration reg({"shards", [](CLI::App& app) {
                    auto o = std::make_shared<ShardsOptions>();
                    auto* sub = app.add_subcommand(
                        "shards",
                        "Which bytes of which HF tensor every engine rank (tp, pp) owns, under the "
                        "SGLang or vLLM loading rules");
                    sub->add_option("--model", o->model,
                                    "Embedded model name (qwen3-8b, ...) or a config.json path or "
                                    "directory")
                        ->required();
                    sub->add_option("--engine", o->engine, "sglang | vllm")->required();
                    sub->add_option("--tp", o->tp, "Tensor-parallel size (default 1)");
                    sub->add_option("--pp", o->pp, "Pipeline-parallel size (default 1)");
                    sub->add_option("--ep", o->ep,
                                    "Expert-parallel size (SGLang --ep-size; vLLM: 1, or tp with "
                                    "--enable-expert-parallel); default 1");
                    o->pp_partition_opt =
                        sub->add_option("--pp-partition", o->pp_partition,
                                        "Explicit layers per stage, e.g. 9,10,9 "
                                        "(SGLANG_PP_LAYER_PARTITION / VLLM_PP_LAYER_PARTITION)");
                    o->quant_opt = sub->add_option(
                        "--quant", o->quant,
                        "Engine weights: fp8-block128 (block-FP8 weight + weight_scale_inv, "
                        "overriding the config's quantization_config) | none (the model dtype)");
                    auto* json = sub->add_flag("--json", o->json,
                                               "Print one JSON object (schema: docs/cli.md)");
                    o->rank_opt = sub->add_option("--rank", o->rank, "Only rank TP_RANK,PP_RANK");
                    o->explain_opt =
                        sub->add_option("--explain", o->explain,
                                        "Say where every byte of this engine parameter comes from")
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
