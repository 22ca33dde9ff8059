// The plan's JSON report and heatmap title, shared by `shardsync plan --json` / `--svg` and the
// Python Plan.cost_model() / Plan.svg(): one rendering, so both always agree.
#include <fmt/format.h>
#include <algorithm>
#include <nlohmann/json.hpp>

#include "plan/planner.h"
#include "shardsync/plan.h"

namespace shardsync {
namespace {

using plan_internal::Stats;

}  // namespace

std::string PlanReportJson(const PlanInputs& in, const DetailedSummary& ds,
                           const Placement& placement) {
  const PlanSummary& s = ds.summary;
  nlohmann::json j;
  j["model"] = in.model.name;
  j["trainer"] = in.trainer.ToString();
  j["rollout"] = {{"dp", in.rollout.dp},
                  {"tp", in.rollout.shard.tp},
                  {"pp", in.rollout.shard.pp},
                  {"ep", in.rollout.shard.ep},
                  {"engine", std::string(EngineKindName(in.rollout.shard.engine))}};
  j["wire_dtype"] = std::string(DTypeName(in.options.wire_dtype));
  j["trainer_dtype"] = std::string(DTypeName(in.trainer_dtype));
  j["bucket_bytes"] = in.options.bucket_bytes;
  j["plan_hash"] = s.plan_hash;
  j["plan_seconds"] = s.plan_seconds;
  j["ops"] = s.ops;
  j["messages"] = s.messages;
  j["total_bytes"] = s.total_bytes;
  j["broadcast_recv_bytes_per_rank"] = s.broadcast_recv_bytes_per_rank;
  j["model_bytes"] = ds.cost.model_bytes;
  const auto tsend = Stats(s.trainer_ranks, [](const auto& t) { return t.send_bytes; });
  j["trainer_send_bytes"] = {{"min", tsend.min},
                             {"mean", tsend.mean},
                             {"max", tsend.max},
                             {"max_over_mean", tsend.mean > 0 ? tsend.max / tsend.mean : 0.0}};
  nlohmann::json tr = nlohmann::json::array();
  for (size_t i = 0; i < s.trainer_ranks.size(); ++i) {
    const auto& t = s.trainer_ranks[i];
    const auto& x = ds.trainer_traffic[i];
    tr.push_back({{"rank", t.rank},
                  {"send_bytes", t.send_bytes},
                  {"ops", x.ops},
                  {"messages", x.messages},
                  {"intra_node_bytes", x.intra_node_bytes},
                  {"node", ds.placement.TrainerNode(t.rank)}});
  }
  j["trainer_ranks"] = std::move(tr);
  nlohmann::json er = nlohmann::json::array();
  const int S = in.trainer.world();
  for (size_t i = 0; i < s.engine_ranks.size(); ++i) {
    const auto& e = s.engine_ranks[i];
    const auto& x = ds.engine_traffic[i];
    er.push_back({{"sync_rank", S + static_cast<int>(i)},
                  {"replica", e.replica},
                  {"tp_rank", e.tp_rank},
                  {"pp_rank", e.pp_rank},
                  {"recv_bytes", e.recv_bytes},
                  {"owned_bytes", e.owned_bytes},
                  {"ops", x.ops},
                  {"messages", x.messages},
                  {"intra_node_bytes", x.intra_node_bytes},
                  {"node", ds.placement.EngineNode(static_cast<int>(i), S)}});
  }
  j["engine_ranks"] = std::move(er);
  // Non-zero (trainer node, engine node) byte totals.
  nlohmann::json np = nlohmann::json::array();
  const int N = ds.placement.nodes;
  for (size_t i = 0; i < ds.node_pair_bytes.size(); ++i) {
    if (ds.node_pair_bytes[i] > 0) {
      np.push_back({{"src_node", static_cast<int>(i) / N},
                    {"dst_node", static_cast<int>(i) % N},
                    {"bytes", ds.node_pair_bytes[i]}});
    }
  }
  j["node_pairs"] = std::move(np);
  j["placement"] = {{"nodes", ds.placement.nodes},
                    {"gpus_per_node", ds.placement.gpus_per_node},
                    {"colocated", ds.placement.colocated}};
  j["estimates"] = {{"intra_node_gbps", placement.intra_node_gbps},
                    {"inter_node_gbps", placement.inter_node_gbps},
                    {"plan_seconds", ds.cost.seconds},
                    {"broadcast_seconds", ds.cost.broadcast_seconds},
                    {"lower_bound_seconds", ds.cost.lower_bound_seconds}};
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string PlanHeatmapTitle(const PlanInputs& in) {
  return fmt::format("{}: {} -> dp={},tp={},pp={} ({})", in.model.name, in.trainer.ToString(),
                     in.rollout.dp, in.rollout.shard.tp, in.rollout.shard.pp,
                     EngineKindName(in.rollout.shard.engine));
}

}  // namespace shardsync
