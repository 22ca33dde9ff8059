// Rollout layout: which worker owns which engine, and on which GPU every engine rank lands.
//
// The rollout side runs one worker process per GPU, placed node by node; worker i has
// tp = i % T, pp = (i / T) % P, dp = i / (T*P). Per DP replica exactly one worker, the head at
// pp == 0 && tp == 0, starts a live engine that owns the replica's whole TP x PP topology; every
// other worker is a no-op shell (UniRL PR #502). The engine then spawns one process per
// (tp, pp) and puts each on a GPU by ITS OWN formula (SGLang `compute_local_gpu_id`, vLLM
// `cuda:local_rank`); this layer reproduces those formulas bit for bit, quirks included, and
// rejects any layout where the engine would double-book a GPU or leave one idle
// (../shared/reference/engine-layouts.md section 1).
//
// Everything here is a pure, deterministic function of its inputs. Error messages name the CLI
// flag at fault ("--tp: ...") so the same text works for the CLI and for library callers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/status.h"

namespace shardsync {

// How an engine places its ranks on GPUs. Defined here (not shard_map.h's EngineKind) because
// topology comes before the sharding layer.
enum class EngineConvention { kSglang, kVllm };
std::string_view EngineConventionName(EngineConvention e);  // "sglang" | "vllm"
Result<EngineConvention> ParseEngineConvention(std::string_view s,
                                               std::string_view field = "--engine");

// The rollout GPUs. Either `nodes` x `gpus_per_node`, or an explicit per-node list which, when
// non-empty, takes precedence.
struct Cluster {
  int nodes = 0;
  int gpus_per_node = 0;
  std::vector<int> node_gpus;

  static Cluster Uniform(int nodes, int gpus_per_node) { return Cluster{nodes, gpus_per_node, {}}; }
  static Cluster PerNode(std::vector<int> node_gpus) { return Cluster{0, 0, std::move(node_gpus)}; }
};

// Upper bound on cluster GPUs, so a typo cannot make the planner allocate gigabytes.
inline constexpr int64_t kMaxLayoutGpus = int64_t{1} << 20;

// GPU count of every node; InvalidArgument naming --nodes / --gpus-per-node /
// --gpus-per-node-list[i] when a count is not positive or the total exceeds kMaxLayoutGpus.
Result<std::vector<int>> ClusterNodeGpus(const Cluster& cluster);

struct RolloutLayoutSpec {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  EngineConvention engine = EngineConvention::kSglang;
  int base_gpu_id = 0;  // SGLang --base-gpu-id (vLLM has no analogue: must stay 0)
  int gpu_id_step = 1;  // SGLang --gpu-id-step (vLLM: must stay 1)
  // A replica whose tp*pp GPUs span several nodes is rejected unless this is set; then it is laid
  // out with the engine's multi-node rule (SGLang `_calculate_rank_ranges`).
  bool allow_multinode = false;
  // The framework's configured number of rollout GPUs; when set it must equal dp*tp*pp.
  std::optional<int64_t> rollout_gpus;
};

enum class WorkerRole { kHead, kShell };
std::string_view WorkerRoleName(WorkerRole r);  // "head" | "shell"

struct LayoutWorker {
  int rank = 0;  // worker index, node by node
  int node = 0;
  int gpu = 0;  // node-local GPU index
  int dp = 0;
  int pp = 0;
  int tp = 0;
  WorkerRole role = WorkerRole::kShell;
  int head = 0;  // rank of the replica's head worker
};

struct EngineRankPlacement {
  int tp = 0;
  int pp = 0;
  int global_rank = 0;  // engine-internal torch rank: pp*T + tp (SGLang compute_global_rank)
  int node = 0;         // cluster node
  int node_rank = 0;    // node index within the replica (SGLang/vLLM --node-rank)
  int gpu_index = 0;    // the engine's device index into that node's visible list
  int gpu = 0;          // node-local physical GPU: cuda_visible_devices[gpu_index]
  int worker = 0;       // the worker on that GPU
  // Rank in the engine's own weight-update group, by the engine's upstream formula.
  // SGLang: rank_offset + tp (PP-unaware, collides when pp > 1); vLLM: rank_offset + pp*T + tp.
  int64_t broadcast_rank = 0;
};

struct ReplicaNode {
  int node = 0;
  int node_rank = 0;
  // CUDA_VISIBLE_DEVICES for the engine process on this node: the replica's GPUs there in
  // worker order, which is PP-major (pp, tp).
  std::vector<int> cuda_visible_devices;
};

struct ReplicaLayout {
  int dp = 0;
  int head = 0;  // head worker (pp0/tp0); also the worker that collects results
  int node = 0;  // the head's node
  std::vector<int> cuda_visible_devices;          // the head node's list (== nodes[0])
  std::vector<ReplicaNode> nodes;                 // one per node the replica spans, by node_rank
  std::vector<EngineRankPlacement> engine_ranks;  // ordered by (pp, tp)
  int64_t rank_offset = 0;  // i*T*P + 1: first engine rank in the broadcast world
  // SGLang `_calculate_rank_ranges` values for this replica (nnodes = nodes.size()).
  int pp_size_per_node = 0;
  int nnodes_per_pp_rank = 0;
  int tp_size_per_node = 0;
};

struct Layout {
  RolloutLayoutSpec spec;
  std::vector<int> node_gpus;
  std::vector<LayoutWorker> workers;
  std::vector<ReplicaLayout> replicas;
  int collecting_rank = 0;  // engine rank (global_rank) whose output is collected: pp0/tp0
  // Broadcast-sync accounting for the engines' own update APIs: trainer rank 0 sends,
  // world = R*T*P + 1.
  int64_t broadcast_world_size = 0;
  // True when the engine's upstream broadcast rank formula gives two engine ranks one rank
  // (SGLang with pp > 1): a group formed that way deadlocks or silently mis-syncs.
  bool broadcast_rank_collision = false;

  std::vector<int> HeadWorkers() const;
};

// The layout, or InvalidArgument naming the field when: a size is zero or negative, dp*tp*pp
// differs from the cluster's GPUs or the configured rollout GPU count, a replica straddles a
// node (unless allow_multinode), the engine's multi-node rule would drop ranks, or the engine's
// GPU formula puts two ranks on one GPU, a rank outside the visible list, or leaves a GPU idle.
Result<Layout> ComputeLayout(const Cluster& cluster, const RolloutLayoutSpec& spec);

// shardsync's own sync world: trainer ranks [0, S) first, then every engine rank of every replica.
// Engine rank (dp, pp, tp) is S + dp*T*P + pp*T + tp; world = S + R*T*P.
Result<int64_t> SyncEngineRank(const RolloutLayoutSpec& spec, int trainer_world, int dp, int pp,
                               int tp);
Result<int64_t> SyncWorldSize(const RolloutLayoutSpec& spec, int trainer_world);

// Bit-exact ports of SGLang's rules (engine.py), unvalidated: they reproduce the quirks
// (silently dropped PP ranks, gpu_id_step on the TP offset only) so tests can show them.
struct SglangRankRanges {
  int pp_size_per_node = 0;
  int nnodes_per_pp_rank = 0;
  int tp_size_per_node = 0;
  int pp_begin = 0, pp_end = 0;  // half-open
  int tp_begin = 0, tp_end = 0;  // half-open
};
SglangRankRanges SglangCalculateRankRanges(int nnodes, int pp_size, int tp_size, int node_rank);
int SglangLocalGpuId(int base_gpu_id, int gpu_id_step, int pp_rank, int tp_rank,
                     int pp_size_per_node, int tp_size_per_node);

// Renderings used by `shardsync layout`. trainer_world sizes the sync world (>= 1).
// JSON schema: docs/cli.md, section "shardsync layout"; it is a stable interface.
Result<std::string> LayoutToJson(const Layout& layout, int trainer_world);
Result<std::string> LayoutToTable(const Layout& layout, int trainer_world);
// Shell lines that start each replica's engine (env + args), one block per replica and node.
// InvalidArgument naming --format when the layout was computed for the other engine.
Result<std::string> LayoutToSglangLaunch(const Layout& layout);
Result<std::string> LayoutToVllmLaunch(const Layout& layout);

}  // namespace shardsync
