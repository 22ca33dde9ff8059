// `shardsync layout`: which worker owns each rollout engine and where every engine rank lands.
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "command.h"
#include "shardsync/layout.h"

namespace shardsync::cli {
namespace {

struct LayoutOptions {
  int nodes = 1;
  int gpus_per_node = 0;
  std::string gpus_per_node_list;
  int dp = 0;
  int tp = 1;
  int pp = 1;
  std::string engine;
  int base_gpu_id = 0;
  int gpu_id_step = 1;
  bool allow_multinode = false;
  int trainer_world = 1;
  int64_t rollout_gpus = 0;
  bool json = false;
  std::string format;
  // Which flags were given (CLI11 options are looked up after parsing).
  CLI::Option* nodes_opt = nullptr;
  CLI::Option* gpn_opt = nullptr;
  CLI::Option* list_opt = nullptr;
  CLI::Option* rollout_opt = nullptr;
};

// "8,8,4" -> {8, 8, 4}. Parsed here rather than by CLI11, which silently drops empty entries
// ("8,,8" would become two nodes); every entry must be an integer (range checked by the planner).
Result<std::vector<int>> ParseGpuList(const std::string& csv) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= csv.size()) {
    size_t comma = csv.find(',', pos);
    if (comma == std::string::npos) comma = csv.size();
    const std::string tok = csv.substr(pos, comma - pos);
    int v = 0;
    auto [ptr, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    if (tok.empty() || ec != std::errc() || ptr != tok.data() + tok.size()) {
      return InvalidArgumentError("--gpus-per-node-list[" + std::to_string(out.size()) + "]: '" +
                                  tok + "' is not a GPU count (expected e.g. 8,8,4), in '" + csv +
                                  "'");
    }
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

Result<std::string> Run(const LayoutOptions& o) {
  Cluster cluster;
  if (o.list_opt->count() > 0) {
    SS_ASSIGN_OR_RETURN(std::vector<int> list, ParseGpuList(o.gpus_per_node_list));
    if (o.nodes_opt->count() > 0 && o.nodes != static_cast<int>(list.size())) {
      return InvalidArgumentError("--nodes: " + std::to_string(o.nodes) + " disagrees with the " +
                                  std::to_string(list.size()) + " entries of --gpus-per-node-list");
    }
    cluster = Cluster::PerNode(list);
  } else if (o.gpn_opt->count() > 0) {
    cluster = Cluster::Uniform(o.nodes, o.gpus_per_node);
  } else {
    return InvalidArgumentError("--gpus-per-node: required (or --gpus-per-node-list)");
  }
  RolloutLayoutSpec spec;
  SS_ASSIGN_OR_RETURN(spec.engine, ParseEngineConvention(o.engine, "--engine"));
  spec.dp = o.dp;
  spec.tp = o.tp;
  spec.pp = o.pp;
  spec.base_gpu_id = o.base_gpu_id;
  spec.gpu_id_step = o.gpu_id_step;
  spec.allow_multinode = o.allow_multinode;
  if (o.rollout_opt->count() > 0) spec.rollout_gpus = o.rollout_gpus;
  if (!o.format.empty() && o.format != "sglang-launch" && o.format != "vllm-launch") {
    return InvalidArgumentError("--format: unknown format '" + o.format +
                                "', expected 'sglang-launch' or 'vllm-launch'");
  }
  SS_ASSIGN_OR_RETURN(Layout layout, ComputeLayout(cluster, spec));
  if (o.format == "sglang-launch") return LayoutToSglangLaunch(layout);
  if (o.format == "vllm-launch") return LayoutToVllmLaunch(layout);
  if (o.json) return LayoutToJson(layout, o.trainer_world);
  return LayoutToTable(layout, o.trainer_world);
}

Registration reg(
    {"layout", [](CLI::App& app) {
       auto o = std::make_shared<LayoutOptions>();
       auto* sub = app.add_subcommand(
           "layout",
           "Plan the rollout layout: per DP replica the head worker that owns the engine, its "
           "CUDA_VISIBLE_DEVICES, and the GPU every engine rank (tp, pp) lands on");
       o->nodes_opt = sub->add_option("--nodes", o->nodes, "Number of nodes (default 1)");
       o->gpn_opt = sub->add_option("--gpus-per-node", o->gpus_per_node, "GPUs on every node");
       o->list_opt = sub->add_option("--gpus-per-node-list", o->gpus_per_node_list,
                                     "GPUs per node, comma-separated (e.g. 8,8,4)")
                         ->excludes(o->gpn_opt);
       sub->add_option("--dp", o->dp, "Data-parallel replicas (engines)")->required();
       sub->add_option("--tp", o->tp, "Tensor-parallel size per engine (default 1)");
       sub->add_option("--pp", o->pp, "Pipeline-parallel size per engine (default 1)");
       sub->add_option("--engine", o->engine, "Engine convention: sglang | vllm")->required();
       sub->add_option("--base-gpu-id", o->base_gpu_id, "SGLang --base-gpu-id (default 0)");
       sub->add_option("--gpu-id-step", o->gpu_id_step, "SGLang --gpu-id-step (default 1)");
       sub->add_flag(
           "--allow-multinode", o->allow_multinode,
           "Allow a replica to span nodes (SGLang _calculate_rank_ranges / vLLM --nnodes)");
       sub->add_option(
           "--trainer-world", o->trainer_world,
           "Trainer ranks before the engine ranks in the shardsync sync world (default 1)");
       o->rollout_opt =
           sub->add_option("--rollout-gpus", o->rollout_gpus,
                           "Configured rollout GPU count to cross-check against dp*tp*pp");
       auto* json = sub->add_flag("--json", o->json, "Print one JSON object (schema: docs/cli.md)");
       sub->add_option("--format", o->format, "Print launch commands: sglang-launch | vllm-launch")
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
