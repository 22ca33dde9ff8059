// Renderings of a Layout for `shardsync layout`: JSON (stable schema, docs/cli.md), a table for
// people, and per-replica engine launch lines.
#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "shardsync/layout.h"

namespace shardsync {
namespace {

using Json = nlohmann::ordered_json;

std::string_view BroadcastFormula(EngineConvention e) {
  return e == EngineConvention::kSglang ? "rank_offset + tp" : "rank_offset + pp*tp_size + tp";
}

std::string NodeSummary(const std::vector<int>& node_gpus) {
  const bool uniform = std::all_of(node_gpus.begin(), node_gpus.end(),
                                   [&](int g) { return g == node_gpus.front(); });
  int64_t total = 0;
  for (int g : node_gpus) total += g;
  if (uniform) {
    return fmt::format("{} node(s) x {} GPUs = {} GPUs", node_gpus.size(), node_gpus.front(),
                       total);
  }
  return fmt::format("{} nodes with {} GPUs = {} GPUs", node_gpus.size(), fmt::join(node_gpus, "+"),
                     total);
}

// Appends `line` without trailing blanks, then a newline.
void AppendTrimmed(std::string& out, const std::string& line) {
  const size_t end = line.find_last_not_of(' ');
  out.append(line, 0, end == std::string::npos ? 0 : end + 1);
  out += '\n';
}

}  // namespace

Result<std::string> LayoutToJson(const Layout& layout, int trainer_world) {
  const RolloutLayoutSpec& s = layout.spec;
  SS_ASSIGN_OR_RETURN(int64_t sync_world, SyncWorldSize(s, trainer_world));
  Json j;
  j["engine"] = std::string(EngineConventionName(s.engine));
  j["dp"] = s.dp;
  j["tp"] = s.tp;
  j["pp"] = s.pp;
  j["base_gpu_id"] = s.base_gpu_id;
  j["gpu_id_step"] = s.gpu_id_step;
  j["allow_multinode"] = s.allow_multinode;
  j["node_gpus"] = layout.node_gpus;
  j["num_gpus"] = layout.workers.size();
  j["collecting_rank"] = layout.collecting_rank;
  Json workers = Json::array();
  for (const LayoutWorker& w : layout.workers) {
    workers.push_back(Json{{"rank", w.rank},
                           {"node", w.node},
                           {"gpu", w.gpu},
                           {"dp", w.dp},
                           {"pp", w.pp},
                           {"tp", w.tp},
                           {"role", std::string(WorkerRoleName(w.role))},
                           {"head", w.head}});
  }
  j["workers"] = std::move(workers);
  Json replicas = Json::array();
  for (const ReplicaLayout& r : layout.replicas) {
    Json nodes = Json::array();
    for (const ReplicaNode& n : r.nodes) {
      nodes.push_back(Json{{"node", n.node},
                           {"node_rank", n.node_rank},
                           {"cuda_visible_devices", n.cuda_visible_devices}});
    }
    Json ranks = Json::array();
    for (const EngineRankPlacement& e : r.engine_ranks) {
      SS_ASSIGN_OR_RETURN(int64_t sync_rank, SyncEngineRank(s, trainer_world, r.dp, e.pp, e.tp));
      ranks.push_back(Json{{"tp", e.tp},
                           {"pp", e.pp},
                           {"gpu", e.gpu},
                           {"worker", e.worker},
                           {"global_rank", e.global_rank},
                           {"node", e.node},
                           {"node_rank", e.node_rank},
                           {"gpu_index", e.gpu_index},
                           {"broadcast_rank", e.broadcast_rank},
                           {"sync_rank", sync_rank}});
    }
    replicas.push_back(Json{{"dp", r.dp},
                            {"head", r.head},
                            {"node", r.node},
                            {"cuda_visible_devices", r.cuda_visible_devices},
                            {"nodes", std::move(nodes)},
                            {"rank_offset", r.rank_offset},
                            {"pp_size_per_node", r.pp_size_per_node},
                            {"nnodes_per_pp_rank", r.nnodes_per_pp_rank},
                            {"tp_size_per_node", r.tp_size_per_node},
                            {"engine_ranks", std::move(ranks)}});
  }
  j["replicas"] = std::move(replicas);
  j["broadcast_world_size"] = layout.broadcast_world_size;
  j["broadcast_rank_formula"] = std::string(BroadcastFormula(s.engine));
  j["broadcast_rank_collision"] = layout.broadcast_rank_collision;
  j["sync"] = Json{{"trainer_world", trainer_world},
                   {"world_size", sync_world},
                   {"engine_rank_formula", "trainer_world + dp*tp_size*pp_size + pp*tp_size + tp"}};
  return j.dump(2) + "\n";
}

Result<std::string> LayoutToTable(const Layout& layout, int trainer_world) {
  const RolloutLayoutSpec& s = layout.spec;
  SS_ASSIGN_OR_RETURN(int64_t sync_world, SyncWorldSize(s, trainer_world));
  const int T = s.tp, P = s.pp, TP = T * P;
  std::string out;
  auto it = std::back_inserter(out);
  fmt::format_to(it, "shardsync layout: engine {}, dp={} tp={} pp={}, {}\n",
                 EngineConventionName(s.engine), s.dp, s.tp, s.pp, NodeSummary(layout.node_gpus));
  if (s.engine == EngineConvention::kSglang) {
    fmt::format_to(it, "  base_gpu_id={} gpu_id_step={}\n", s.base_gpu_id, s.gpu_id_step);
  }
  fmt::format_to(it,
                 "{} replica(s) of {} GPUs. Each replica's head worker (pp0/tp0) runs the live "
                 "engine;\nthe other workers are shells. Results are collected from engine rank "
                 "{} (pp0/tp0).\n",
                 s.dp, TP, layout.collecting_rank);

  for (const ReplicaLayout& r : layout.replicas) {
    fmt::format_to(it, "\nreplica {}: head worker {} on node {}, rank_offset {}\n", r.dp, r.head,
                   r.node, r.rank_offset);
    const bool multi = r.nodes.size() > 1;
    for (const ReplicaNode& n : r.nodes) {
      fmt::format_to(it, "  {}CUDA_VISIBLE_DEVICES={}\n",
                     multi ? fmt::format("node {} (node_rank {}): ", n.node, n.node_rank) : "",
                     fmt::join(n.cuda_visible_devices, ","));
    }
    // Rows are pipeline stages; with many TP ranks and few stages, transpose so the grid stays
    // narrow enough to read.
    const bool tp_rows = T > 8 && P < T;
    fmt::format_to(it, "  engine rank -> {}GPU (worker), rows {}, columns {}:\n",
                   multi ? "node:" : "", tp_rows ? "tp" : "pp", tp_rows ? "pp" : "tp");
    std::vector<std::string> cells(static_cast<size_t>(TP));
    size_t width = 0;
    for (const EngineRankPlacement& e : r.engine_ranks) {
      std::string c = multi ? fmt::format("n{}:{} (w{})", e.node, e.gpu, e.worker)
                            : fmt::format("{} (w{})", e.gpu, e.worker);
      width = std::max(width, c.size());
      cells[e.global_rank] = std::move(c);
    }
    const std::string_view row_name = tp_rows ? "tp" : "pp", col_name = tp_rows ? "pp" : "tp";
    const int rows = tp_rows ? T : P, cols = tp_rows ? P : T;
    for (int c = 0; c < cols; ++c) width = std::max(width, fmt::format("{}{}", col_name, c).size());
    const size_t label = fmt::format("{}{}", row_name, rows - 1).size();
    std::string line = fmt::format("    {:<{}}", "", label);
    for (int c = 0; c < cols; ++c)
      line += fmt::format("  {:<{}}", fmt::format("{}{}", col_name, c), width);
    AppendTrimmed(out, line);
    for (int row = 0; row < rows; ++row) {
      line = fmt::format("    {:<{}}", fmt::format("{}{}", row_name, row), label);
      for (int c = 0; c < cols; ++c) {
        const int pp = tp_rows ? c : row, tp = tp_rows ? row : c;
        line += fmt::format("  {:<{}}", cells[pp * T + tp], width);
      }
      AppendTrimmed(out, line);
    }
  }

  fmt::format_to(it,
                 "\nweight-update accounting:\n"
                 "  engine broadcast group: world {}, trainer rank 0 sends, replica i has "
                 "rank_offset i*{}+1;\n  {} puts engine rank (pp, tp) at {}\n",
                 layout.broadcast_world_size, TP, EngineConventionName(s.engine),
                 BroadcastFormula(s.engine));
  if (layout.broadcast_rank_collision) {
    fmt::format_to(it,
                   "  WARNING: that rank is PP-unaware: the {} pipeline stages of a replica join "
                   "with the\n  same ranks (replica 0: {}..{}), which deadlocks or silently "
                   "mis-syncs; do not use SGLang's\n  broadcast update with pp > 1.\n",
                   P, layout.replicas.front().rank_offset,
                   layout.replicas.front().rank_offset + T - 1);
  }
  fmt::format_to(it,
                 "  shardsync sync world: {} = {} trainer rank(s) + {} engine ranks;\n"
                 "  engine rank (dp, pp, tp) = {} + dp*{} + pp*{} + tp\n",
                 sync_world, trainer_world, sync_world - trainer_world, trainer_world, TP, T);

  fmt::format_to(it, "\nworkers:\n  {:>5}  {:>4}  {:>3}  {:>3}  {:>3}  {:>3}  {:<5}  {:>4}\n",
                 "rank", "node", "gpu", "dp", "pp", "tp", "role", "head");
  for (const LayoutWorker& w : layout.workers) {
    fmt::format_to(it, "  {:>5}  {:>4}  {:>3}  {:>3}  {:>3}  {:>3}  {:<5}  {:>4}\n", w.rank, w.node,
                   w.gpu, w.dp, w.pp, w.tp, WorkerRoleName(w.role), w.head);
  }
  return out;
}

namespace {
Status CheckFormatEngine(const Layout& layout, EngineConvention want, std::string_view format) {
  if (layout.spec.engine != want) {
    return InvalidArgumentError(fmt::format("--format: {} needs --engine {}, got --engine {}",
                                            format, EngineConventionName(want),
                                            EngineConventionName(layout.spec.engine)));
  }
  return OkStatus();
}
}  // namespace

Result<std::string> LayoutToSglangLaunch(const Layout& layout) {
  SS_RETURN_IF_ERROR(CheckFormatEngine(layout, EngineConvention::kSglang, "sglang-launch"));
  const RolloutLayoutSpec& s = layout.spec;
  std::string out;
  auto it = std::back_inserter(out);
  fmt::format_to(
      it,
      "# shardsync layout: sglang dp={} tp={} pp={}: one server per replica, started "
      "by its head worker.\n# Set MODEL_PATH{}.\n",
      s.dp, s.tp, s.pp,
      s.allow_multinode ? "; DIST_INIT_ADDR_<d> = host:port on replica d's first node" : "");
  for (const ReplicaLayout& r : layout.replicas) {
    const bool multi = r.nodes.size() > 1;
    for (const ReplicaNode& n : r.nodes) {
      fmt::format_to(it, "\n# replica {}{}: run on node {} (head worker {})\n", r.dp,
                     multi ? fmt::format(", node_rank {}", n.node_rank) : "", n.node, r.head);
      fmt::format_to(it,
                     "CUDA_VISIBLE_DEVICES={} python -m sglang.launch_server --model-path "
                     "\"$MODEL_PATH\" --tp-size {} --pp-size {} --base-gpu-id {}",
                     fmt::join(n.cuda_visible_devices, ","), s.tp, s.pp, s.base_gpu_id);
      if (s.gpu_id_step != 1) fmt::format_to(it, " --gpu-id-step {}", s.gpu_id_step);
      if (multi) {
        fmt::format_to(it, " --nnodes {} --node-rank {} --dist-init-addr \"$DIST_INIT_ADDR_{}\"",
                       r.nodes.size(), n.node_rank, r.dp);
      }
      fmt::format_to(it, " --port {}\n", 30000 + r.dp);
    }
  }
  return out;
}

Result<std::string> LayoutToVllmLaunch(const Layout& layout) {
  SS_RETURN_IF_ERROR(CheckFormatEngine(layout, EngineConvention::kVllm, "vllm-launch"));
  const RolloutLayoutSpec& s = layout.spec;
  std::string out;
  auto it = std::back_inserter(out);
  fmt::format_to(
      it,
      "# shardsync layout: vllm dp={} tp={} pp={}: one server per replica, started "
      "by its head worker.\n# Set MODEL_PATH{}.\n",
      s.dp, s.tp, s.pp,
      s.allow_multinode
          ? "; MASTER_ADDR_<d> / MASTER_PORT_<d> = replica d's first node and a free port"
          : "");
  for (const ReplicaLayout& r : layout.replicas) {
    const bool multi = r.nodes.size() > 1;
    for (const ReplicaNode& n : r.nodes) {
      fmt::format_to(it, "\n# replica {}{}: run on node {} (head worker {})\n", r.dp,
                     multi ? fmt::format(", node_rank {}", n.node_rank) : "", n.node, r.head);
      fmt::format_to(it,
                     "CUDA_VISIBLE_DEVICES={} vllm serve \"$MODEL_PATH\" --tensor-parallel-size {} "
                     "--pipeline-parallel-size {}",
                     fmt::join(n.cuda_visible_devices, ","), s.tp, s.pp);
      if (multi) {
        fmt::format_to(it,
                       " --nnodes {} --node-rank {} --master-addr \"$MASTER_ADDR_{}\" "
                       "--master-port \"$MASTER_PORT_{}\"",
                       r.nodes.size(), n.node_rank, r.dp, r.dp);
      }
      if (n.node_rank > 0) {
        out += " --headless\n";
      } else {
        fmt::format_to(it, " --port {}\n", 8000 + r.dp);
      }
    }
  }
  return out;
}

}  // namespace shardsync
