// Rollout layout planner: workers, replica heads, and the engines' own rank -> GPU formulas.
#include "shardsync/layout.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace shardsync {

std::string_view EngineConventionName(EngineConvention e) {
  switch (e) {
    case EngineConvention::kSglang:
      return "sglang";
    case EngineConvention::kVllm:
      return "vllm";
  }
  return "unknown";
}

Result<EngineConvention> ParseEngineConvention(std::string_view s, std::string_view field) {
  if (s == "sglang") return EngineConvention::kSglang;
  if (s == "vllm") return EngineConvention::kVllm;
  return InvalidArgumentError(
      fmt::format("{}: unknown engine '{}', expected 'sglang' or 'vllm'", field, s));
}

std::string_view WorkerRoleName(WorkerRole r) { return r == WorkerRole::kHead ? "head" : "shell"; }

std::vector<int> Layout::HeadWorkers() const {
  std::vector<int> heads;
  heads.reserve(replicas.size());
  for (const auto& r : replicas) heads.push_back(r.head);
  return heads;
}

Result<std::vector<int>> ClusterNodeGpus(const Cluster& cluster) {
  std::vector<int> gpus;
  if (!cluster.node_gpus.empty()) {
    int64_t total = 0;
    for (size_t i = 0; i < cluster.node_gpus.size(); ++i) {
      if (cluster.node_gpus[i] <= 0) {
        return InvalidArgumentError(fmt::format(
            "--gpus-per-node-list[{}]: must be positive, got {}", i, cluster.node_gpus[i]));
      }
      total += cluster.node_gpus[i];
      if (total > kMaxLayoutGpus) {
        return InvalidArgumentError(fmt::format(
            "--gpus-per-node-list: more than {} GPUs in total is not supported", kMaxLayoutGpus));
      }
    }
    return cluster.node_gpus;
  }
  if (cluster.nodes <= 0) {
    return InvalidArgumentError(fmt::format("--nodes: must be positive, got {}", cluster.nodes));
  }
  if (cluster.gpus_per_node <= 0) {
    return InvalidArgumentError(
        fmt::format("--gpus-per-node: must be positive, got {}", cluster.gpus_per_node));
  }
  if (int64_t{cluster.nodes} * cluster.gpus_per_node > kMaxLayoutGpus) {
    return InvalidArgumentError(
        fmt::format("--nodes x --gpus-per-node: {} x {} exceeds the supported {} GPUs",
                    cluster.nodes, cluster.gpus_per_node, kMaxLayoutGpus));
  }
  gpus.assign(static_cast<size_t>(cluster.nodes), cluster.gpus_per_node);
  return gpus;
}

SglangRankRanges SglangCalculateRankRanges(int nnodes, int pp_size, int tp_size, int node_rank) {
  // Port of sglang engine.py `_calculate_rank_ranges`; Python // on non-negative ints.
  SglangRankRanges r;
  r.pp_size_per_node = std::max(pp_size / nnodes, 1);
  r.nnodes_per_pp_rank = std::max(nnodes / pp_size, 1);
  r.pp_begin = r.pp_size_per_node * (node_rank / r.nnodes_per_pp_rank);
  r.pp_end = r.pp_size_per_node * (node_rank / r.nnodes_per_pp_rank + 1);
  r.tp_size_per_node = tp_size / r.nnodes_per_pp_rank;
  r.tp_begin = r.tp_size_per_node * (node_rank % r.nnodes_per_pp_rank);
  r.tp_end = r.tp_size_per_node * (node_rank % r.nnodes_per_pp_rank + 1);
  return r;
}

int SglangLocalGpuId(int base_gpu_id, int gpu_id_step, int pp_rank, int tp_rank,
                     int pp_size_per_node, int tp_size_per_node) {
  // Port of sglang `compute_local_gpu_id`: gpu_id_step scales only the TP offset (engine quirk).
  return base_gpu_id + (pp_rank % pp_size_per_node) * tp_size_per_node +
         (tp_rank % tp_size_per_node) * gpu_id_step;
}

namespace {

Status ValidateSpec(const RolloutLayoutSpec& s) {
  if (s.dp <= 0) return InvalidArgumentError(fmt::format("--dp: must be positive, got {}", s.dp));
  if (s.tp <= 0) return InvalidArgumentError(fmt::format("--tp: must be positive, got {}", s.tp));
  if (s.pp <= 0) return InvalidArgumentError(fmt::format("--pp: must be positive, got {}", s.pp));
  if (s.base_gpu_id < 0) {
    return InvalidArgumentError(
        fmt::format("--base-gpu-id: must be zero or positive, got {}", s.base_gpu_id));
  }
  if (s.gpu_id_step <= 0) {
    return InvalidArgumentError(
        fmt::format("--gpu-id-step: must be positive, got {}", s.gpu_id_step));
  }
  if (s.rollout_gpus && *s.rollout_gpus <= 0) {
    return InvalidArgumentError(
        fmt::format("--rollout-gpus: must be positive, got {}", *s.rollout_gpus));
  }
  if (s.engine == EngineConvention::kVllm) {
    // vLLM's multiproc executor uses cuda:local_rank; it has no base id or step to set.
    if (s.base_gpu_id != 0) {
      return InvalidArgumentError(fmt::format(
          "--base-gpu-id: vLLM places rank r on cuda:local_rank and has no base GPU id; "
          "got {} with --engine vllm",
          s.base_gpu_id));
    }
    if (s.gpu_id_step != 1) {
      return InvalidArgumentError(
          fmt::format("--gpu-id-step: vLLM places ranks contiguously and has no GPU id step; "
                      "got {} with --engine vllm",
                      s.gpu_id_step));
    }
  }
  return OkStatus();
}

// Where one engine rank is spawned: node_rank within the replica and device index there.
struct Spawn {
  int node_rank = -1;
  int gpu_index = -1;
};

// Per replica: the engine's own placement of every (pp, tp), indexed pp*T + tp.
Result<std::vector<Spawn>> PlaceEngineRanks(const RolloutLayoutSpec& s, int replica, int nnodes,
                                            ReplicaLayout& out) {
  const int T = s.tp, P = s.pp, TP = T * P;
  std::vector<Spawn> spawn(static_cast<size_t>(TP));
  std::vector<int> times(static_cast<size_t>(TP), 0);
  if (s.engine == EngineConvention::kSglang) {
    if (nnodes > 1) {
      if (P % nnodes != 0 && nnodes % P != 0) {
        return InvalidArgumentError(fmt::format(
            "--pp: replica {} spans {} nodes with pp={}; SGLang's _calculate_rank_ranges needs "
            "pp % nnodes == 0 or nnodes % pp == 0 and would silently never spawn some pipeline "
            "ranks",
            replica, nnodes, P));
      }
      const int nnodes_per_pp_rank = std::max(nnodes / P, 1);
      if (T % nnodes_per_pp_rank != 0) {
        return InvalidArgumentError(fmt::format(
            "--tp: replica {} spans {} nodes, so SGLang splits each TP group over {} nodes, but "
            "tp={} is not divisible by {}",
            replica, nnodes, nnodes_per_pp_rank, T, nnodes_per_pp_rank));
      }
    }
    for (int r = 0; r < nnodes; ++r) {
      const SglangRankRanges rr = SglangCalculateRankRanges(nnodes, P, T, r);
      if (r == 0) {
        out.pp_size_per_node = rr.pp_size_per_node;
        out.nnodes_per_pp_rank = rr.nnodes_per_pp_rank;
        out.tp_size_per_node = rr.tp_size_per_node;
      }
      for (int pp = rr.pp_begin; pp < rr.pp_end; ++pp) {
        for (int tp = rr.tp_begin; tp < rr.tp_end; ++tp) {
          if (pp >= P || tp >= T) continue;  // the formula names ranks that do not exist
          const int g = pp * T + tp;
          ++times[g];
          spawn[g] = {r, SglangLocalGpuId(s.base_gpu_id, s.gpu_id_step, pp, tp, rr.pp_size_per_node,
                                          rr.tp_size_per_node)};
        }
      }
    }
  } else {
    // vLLM multiproc executor: global_rank = local_world_size * node_rank + local_rank,
    // device cuda:local_rank.
    if (TP % nnodes != 0) {
      return InvalidArgumentError(fmt::format(
          "--tp x --pp: replica {} spans {} nodes but vLLM needs tp*pp ({}) divisible by the "
          "number of nodes",
          replica, nnodes, TP));
    }
    const int local_world = TP / nnodes;
    out.pp_size_per_node = std::max(P / nnodes, 1);
    out.nnodes_per_pp_rank = std::max(nnodes / P, 1);
    out.tp_size_per_node = T / out.nnodes_per_pp_rank;
    for (int g = 0; g < TP; ++g) {
      ++times[g];
      spawn[g] = {g / local_world, g % local_world};
    }
  }
  for (int g = 0; g < TP; ++g) {
    if (times[g] != 1) {
      return InvalidArgumentError(fmt::format(
          "--pp / --tp: {} spawns engine rank (pp={}, tp={}) of replica {} {} times over {} "
          "node(s); every rank must be spawned exactly once",
          EngineConventionName(s.engine), g / T, g % T, replica, times[g], nnodes));
    }
  }
  return spawn;
}

// The flag most likely at fault when the engine formula misplaces a rank.
std::string_view GpuFormulaField(const RolloutLayoutSpec& s) {
  if (s.gpu_id_step != 1) return "--gpu-id-step";
  if (s.base_gpu_id != 0) return "--base-gpu-id";
  return "--tp / --pp";
}

}  // namespace

Result<Layout> ComputeLayout(const Cluster& cluster, const RolloutLayoutSpec& spec) {
  SS_ASSIGN_OR_RETURN(std::vector<int> node_gpus, ClusterNodeGpus(cluster));
  SS_RETURN_IF_ERROR(ValidateSpec(spec));
  int64_t total = 0;
  for (int g : node_gpus) total += g;

  // dp, tp, pp are each >= 1, so a factor above the GPU total already means a mismatch; below
  // it, the product of three fits in int64 (kMaxLayoutGpus^3 < 2^63).
  const __int128 want = static_cast<__int128>(spec.dp) * spec.tp * spec.pp;
  const std::string want_str = fmt::format("{}x{}x{}", spec.dp, spec.tp, spec.pp);
  if (spec.rollout_gpus && want != *spec.rollout_gpus) {
    return InvalidArgumentError(fmt::format(
        "--rollout-gpus: the configured {} rollout GPUs disagree with --dp x --tp x --pp = {}; a "
        "weight-update group of the wrong size would be formed",
        *spec.rollout_gpus, want_str));
  }
  if (want != total) {
    return InvalidArgumentError(fmt::format(
        "--dp x --tp x --pp: {} = {} workers needed but the cluster has {} GPUs ({} node(s): {})",
        want_str, static_cast<int64_t>(want), total, node_gpus.size(), fmt::join(node_gpus, ",")));
  }

  const int T = spec.tp, P = spec.pp, TP = T * P, R = spec.dp;
  Layout layout;
  layout.spec = spec;
  layout.node_gpus = node_gpus;
  layout.workers.reserve(static_cast<size_t>(total));
  for (int n = 0; n < static_cast<int>(node_gpus.size()); ++n) {
    for (int g = 0; g < node_gpus[n]; ++g) {
      const int i = static_cast<int>(layout.workers.size());
      LayoutWorker w;
      w.rank = i;
      w.node = n;
      w.gpu = g;
      w.tp = i % T;
      w.pp = (i / T) % P;
      w.dp = i / TP;
      w.role = (w.tp == 0 && w.pp == 0) ? WorkerRole::kHead : WorkerRole::kShell;
      w.head = w.dp * TP;
      layout.workers.push_back(w);
    }
  }

  layout.replicas.reserve(static_cast<size_t>(R));
  for (int d = 0; d < R; ++d) {
    ReplicaLayout rep;
    rep.dp = d;
    rep.head = d * TP;
    rep.node = layout.workers[rep.head].node;
    rep.rank_offset = static_cast<int64_t>(d) * TP + 1;
    // The replica's workers grouped by node; worker order is PP-major (pp, tp).
    std::vector<std::vector<int>> node_workers;
    for (int k = 0; k < TP; ++k) {
      const LayoutWorker& w = layout.workers[rep.head + k];
      if (rep.nodes.empty() || rep.nodes.back().node != w.node) {
        rep.nodes.push_back({w.node, static_cast<int>(rep.nodes.size()), {}});
        node_workers.emplace_back();
      }
      rep.nodes.back().cuda_visible_devices.push_back(w.gpu);
      node_workers.back().push_back(w.rank);
    }
    const int nnodes = static_cast<int>(rep.nodes.size());
    if (nnodes > 1 && !spec.allow_multinode) {
      return InvalidArgumentError(fmt::format(
          "--allow-multinode: replica {} (workers {}..{}) straddles nodes {}..{}; one engine "
          "cannot span nodes unless multi-node replicas are allowed (or choose tp*pp that "
          "divides each node's GPU count)",
          d, rep.head, rep.head + TP - 1, rep.nodes.front().node, rep.nodes.back().node));
    }
    rep.cuda_visible_devices = rep.nodes.front().cuda_visible_devices;

    SS_ASSIGN_OR_RETURN(std::vector<Spawn> spawn, PlaceEngineRanks(spec, d, nnodes, rep));

    // Per node: the engine's device indices must cover the visible list exactly once.
    std::vector<std::vector<int>> owner(static_cast<size_t>(nnodes));
    for (int r = 0; r < nnodes; ++r) owner[r].assign(rep.nodes[r].cuda_visible_devices.size(), -1);
    // Counts first: an uneven multi-node split is the root cause of any misplacement after it.
    std::vector<int> spawned_on(static_cast<size_t>(nnodes), 0);
    for (const Spawn& sp : spawn) ++spawned_on[sp.node_rank];
    for (int r = 0; r < nnodes; ++r) {
      const size_t visible = rep.nodes[r].cuda_visible_devices.size();
      if (static_cast<size_t>(spawned_on[r]) != visible) {
        return InvalidArgumentError(fmt::format(
            "--gpus-per-node-list / --tp / --pp: replica {} has {} GPUs on node {} (node_rank "
            "{}) but {} places {} engine ranks there; a multi-node replica needs the same GPU "
            "count on each of its nodes",
            d, visible, rep.nodes[r].node, r, EngineConventionName(spec.engine), spawned_on[r]));
      }
    }

    for (int g = 0; g < TP; ++g) {
      const Spawn& sp = spawn[g];
      const ReplicaNode& rn = rep.nodes[sp.node_rank];
      if (sp.gpu_index < 0 || sp.gpu_index >= static_cast<int>(rn.cuda_visible_devices.size())) {
        return InvalidArgumentError(fmt::format(
            "{}: {} puts engine rank (pp={}, tp={}) of replica {} on GPU index {}, outside the {} "
            "GPUs visible on node {} (CUDA_VISIBLE_DEVICES={}; base_gpu_id={}, gpu_id_step={})",
            GpuFormulaField(spec), EngineConventionName(spec.engine), g / T, g % T, d, sp.gpu_index,
            rn.cuda_visible_devices.size(), rn.node, fmt::join(rn.cuda_visible_devices, ","),
            spec.base_gpu_id, spec.gpu_id_step));
      }
      int& o = owner[sp.node_rank][sp.gpu_index];
      if (o >= 0) {
        return InvalidArgumentError(fmt::format(
            "{}: {} puts engine ranks (pp={}, tp={}) and (pp={}, tp={}) of replica {} on the "
            "same GPU (index {} on node {}; base_gpu_id={}, gpu_id_step={}: SGLang's "
            "gpu_id_step scales only the TP offset)",
            GpuFormulaField(spec), EngineConventionName(spec.engine), o / T, o % T, g / T, g % T, d,
            sp.gpu_index, rn.node, spec.base_gpu_id, spec.gpu_id_step));
      }
      o = g;
    }
    for (int g = 0; g < TP; ++g) {
      const Spawn& sp = spawn[g];
      const ReplicaNode& rn = rep.nodes[sp.node_rank];
      EngineRankPlacement e;
      e.pp = g / T;
      e.tp = g % T;
      e.global_rank = g;
      e.node = rn.node;
      e.node_rank = sp.node_rank;
      e.gpu_index = sp.gpu_index;
      e.gpu = rn.cuda_visible_devices[sp.gpu_index];
      e.worker = node_workers[sp.node_rank][sp.gpu_index];
      // SGLang upstream: rank_offset + tp_rank (PP-unaware); vLLM: rank_offset + dp*T*P +
      // pp*T + tp with one DP server, i.e. rank_offset(i) + pp*T + tp with one server per replica.
      e.broadcast_rank =
          rep.rank_offset + (spec.engine == EngineConvention::kSglang ? e.tp : e.global_rank);
      rep.engine_ranks.push_back(e);
    }
    layout.replicas.push_back(std::move(rep));
  }
  layout.collecting_rank = 0;
  layout.broadcast_world_size = static_cast<int64_t>(R) * TP + 1;
  layout.broadcast_rank_collision = spec.engine == EngineConvention::kSglang && P > 1;
  return layout;
}

namespace {
Status CheckSyncArgs(const RolloutLayoutSpec& spec, int trainer_world) {
  SS_RETURN_IF_ERROR(ValidateSpec(spec));
  if (trainer_world <= 0) {
    return InvalidArgumentError(
        fmt::format("--trainer-world: must be positive, got {}", trainer_world));
  }
  return OkStatus();
}
}  // namespace

Result<int64_t> SyncEngineRank(const RolloutLayoutSpec& spec, int trainer_world, int dp, int pp,
                               int tp) {
  SS_RETURN_IF_ERROR(SyncWorldSize(spec, trainer_world));  // also bounds every rank below
  if (dp < 0 || dp >= spec.dp) {
    return OutOfRangeError(fmt::format("dp: replica {} outside [0, {})", dp, spec.dp));
  }
  if (pp < 0 || pp >= spec.pp) {
    return OutOfRangeError(fmt::format("pp: rank {} outside [0, {})", pp, spec.pp));
  }
  if (tp < 0 || tp >= spec.tp) {
    return OutOfRangeError(fmt::format("tp: rank {} outside [0, {})", tp, spec.tp));
  }
  const int64_t TP = int64_t{spec.tp} * spec.pp;
  return int64_t{trainer_world} + dp * TP + int64_t{pp} * spec.tp + tp;
}

Result<int64_t> SyncWorldSize(const RolloutLayoutSpec& spec, int trainer_world) {
  SS_RETURN_IF_ERROR(CheckSyncArgs(spec, trainer_world));
  const __int128 world =
      static_cast<__int128>(trainer_world) + static_cast<__int128>(spec.dp) * spec.tp * spec.pp;
  if (world > INT32_MAX) {
    return InvalidArgumentError(fmt::format(
        "--trainer-world / --dp / --tp / --pp: a sync world of more than {} ranks", INT32_MAX));
  }
  return static_cast<int64_t>(world);
}

}  // namespace shardsync
