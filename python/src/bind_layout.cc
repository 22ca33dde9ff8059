// Rollout layout planner (layout.h): workers, heads / shells, engine rank placement.
#include <pybind11/stl.h>

#include "common.h"
#include "shardsync/layout.h"

namespace shardsync::py_bind {

void RegisterLayout(py::module_& m) {
  py::class_<LayoutWorker>(
      m, "LayoutWorker",
      "One rollout worker (one GPU): its node, GPU, (dp, pp, tp) coordinates and whether it is its "
      "replica's head (pp0/tp0, owns the engine object) or a shell.")
      .def_readonly("rank", &LayoutWorker::rank)
      .def_readonly("node", &LayoutWorker::node)
      .def_readonly("gpu", &LayoutWorker::gpu)
      .def_readonly("dp", &LayoutWorker::dp)
      .def_readonly("pp", &LayoutWorker::pp)
      .def_readonly("tp", &LayoutWorker::tp)
      .def_readonly("head", &LayoutWorker::head)
      .def_property_readonly(
          "role", [](const LayoutWorker& w) { return std::string(WorkerRoleName(w.role)); })
      .def_property_readonly("is_head",
                             [](const LayoutWorker& w) { return w.role == WorkerRole::kHead; })
      .def("__repr__", [](const LayoutWorker& w) {
        return "LayoutWorker(rank=" + std::to_string(w.rank) + ", node=" + std::to_string(w.node) +
               ", gpu=" + std::to_string(w.gpu) + ", dp=" + std::to_string(w.dp) +
               ", pp=" + std::to_string(w.pp) + ", tp=" + std::to_string(w.tp) + ", " +
               std::string(WorkerRoleName(w.role)) + ")";
      });
  py::class_<EngineRankPlacement>(m, "EngineRankPlacement",
                                  "Where the engine itself places one of its ranks (global rank, "
                                  "node, GPU), by the engine's own formula.")
      .def_readonly("tp", &EngineRankPlacement::tp)
      .def_readonly("pp", &EngineRankPlacement::pp)
      .def_readonly("global_rank", &EngineRankPlacement::global_rank)
      .def_readonly("node", &EngineRankPlacement::node)
      .def_readonly("node_rank", &EngineRankPlacement::node_rank)
      .def_readonly("gpu_index", &EngineRankPlacement::gpu_index)
      .def_readonly("gpu", &EngineRankPlacement::gpu)
      .def_readonly("worker", &EngineRankPlacement::worker)
      .def_readonly("broadcast_rank", &EngineRankPlacement::broadcast_rank);
  py::class_<ReplicaNode>(
      m, "ReplicaNode",
      "The part of a replica on one node: node rank and CUDA_VISIBLE_DEVICES there.")
      .def_readonly("node", &ReplicaNode::node)
      .def_readonly("node_rank", &ReplicaNode::node_rank)
      .def_readonly("cuda_visible_devices", &ReplicaNode::cuda_visible_devices);
  py::class_<ReplicaLayout>(m, "ReplicaLayout",
                            "One engine replica: its head worker, nodes, CUDA_VISIBLE_DEVICES "
                            "(PP-major) and engine rank placement.")
      .def_readonly("dp", &ReplicaLayout::dp)
      .def_readonly("head", &ReplicaLayout::head)
      .def_readonly("node", &ReplicaLayout::node)
      .def_readonly("cuda_visible_devices", &ReplicaLayout::cuda_visible_devices)
      .def_readonly("nodes", &ReplicaLayout::nodes)
      .def_readonly("engine_ranks", &ReplicaLayout::engine_ranks)
      .def_readonly("rank_offset", &ReplicaLayout::rank_offset);
  py::class_<Layout>(m, "Layout",
                     "The rollout layout of dp x tp x pp workers: workers, replicas, broadcast "
                     "rank accounting; `to_json()`, `to_table()`.")
      .def_property_readonly("dp", [](const Layout& l) { return l.spec.dp; })
      .def_property_readonly("tp", [](const Layout& l) { return l.spec.tp; })
      .def_property_readonly("pp", [](const Layout& l) { return l.spec.pp; })
      .def_property_readonly(
          "engine",
          [](const Layout& l) { return std::string(EngineConventionName(l.spec.engine)); })
      .def_readonly("node_gpus", &Layout::node_gpus)
      .def_readonly("workers", &Layout::workers)
      .def_readonly("replicas", &Layout::replicas)
      .def_readonly("collecting_rank", &Layout::collecting_rank)
      .def_readonly("broadcast_world_size", &Layout::broadcast_world_size)
      .def_readonly("broadcast_rank_collision", &Layout::broadcast_rank_collision)
      .def("head_workers", &Layout::HeadWorkers)
      .def(
          "to_json", [](const Layout& l, int tw) { return Unwrap(LayoutToJson(l, tw)); },
          py::arg("trainer_world") = 1)
      .def(
          "to_table", [](const Layout& l, int tw) { return Unwrap(LayoutToTable(l, tw)); },
          py::arg("trainer_world") = 1)
      .def("__repr__", [](const Layout& l) {
        return "Layout(engine=" + std::string(EngineConventionName(l.spec.engine)) +
               ", dp=" + std::to_string(l.spec.dp) + ", tp=" + std::to_string(l.spec.tp) +
               ", pp=" + std::to_string(l.spec.pp) +
               ", workers=" + std::to_string(l.workers.size()) + ")";
      });

  m.def(
      "compute_layout",
      [](int dp, int tp, int pp, const std::string& engine, std::vector<int> node_gpus,
         int base_gpu_id, int gpu_id_step, bool allow_multinode,
         std::optional<int64_t> rollout_gpus) {
        RolloutLayoutSpec spec;
        spec.dp = dp;
        spec.tp = tp;
        spec.pp = pp;
        spec.engine = Unwrap(ParseEngineConvention(engine));
        spec.base_gpu_id = base_gpu_id;
        spec.gpu_id_step = gpu_id_step;
        spec.allow_multinode = allow_multinode;
        spec.rollout_gpus = rollout_gpus;
        return Unwrap(ComputeLayout(Cluster::PerNode(std::move(node_gpus)), spec));
      },
      py::arg("dp"), py::arg("tp"), py::arg("pp"), py::arg("engine"), py::arg("node_gpus"),
      py::arg("base_gpu_id") = 0, py::arg("gpu_id_step") = 1, py::arg("allow_multinode") = false,
      py::arg("rollout_gpus") = py::none(),
      "The rollout layout on nodes of node_gpus[i] GPUs (layout.h ComputeLayout).");
  m.def(
      "sync_engine_rank",
      [](int dp, int tp, int pp, int trainer_world, int d, int p, int t) {
        RolloutLayoutSpec spec;
        spec.dp = dp;
        spec.tp = tp;
        spec.pp = pp;
        return Unwrap(SyncEngineRank(spec, trainer_world, d, p, t));
      },
      py::arg("dp"), py::arg("tp"), py::arg("pp"), py::arg("trainer_world"), py::arg("replica"),
      py::arg("pp_rank"), py::arg("tp_rank"),
      "Sync rank of engine rank (replica, pp_rank, tp_rank): S + replica*T*P + pp*T + tp.");
}

}  // namespace shardsync::py_bind
