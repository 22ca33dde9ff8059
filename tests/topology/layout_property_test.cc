// Property test over many random valid specs (seeded, so a failure reproduces).
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "shardsync/layout.h"

namespace shardsync {
namespace {

struct Case {
  Cluster cluster;
  RolloutLayoutSpec spec;
};

std::string Describe(const Case& c) {
  std::string s = "nodes=[";
  for (int g : c.cluster.node_gpus) s += std::to_string(g) + ",";
  s += "] dp=" + std::to_string(c.spec.dp) + " tp=" + std::to_string(c.spec.tp) +
       " pp=" + std::to_string(c.spec.pp) +
       " engine=" + std::string(EngineConventionName(c.spec.engine)) +
       (c.spec.allow_multinode ? " multinode" : "");
  return s;
}

// Single-node replicas: every node holds a whole number of replicas.
Case RandomSingleNode(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Case c;
  c.spec.tp = pick(1, 8);
  c.spec.pp = pick(1, 4);
  c.spec.engine = pick(0, 1) ? EngineConvention::kVllm : EngineConvention::kSglang;
  const int TP = c.spec.tp * c.spec.pp;
  int replicas = 0;
  const int nodes = pick(1, 4);
  std::vector<int> gpus;
  for (int n = 0; n < nodes; ++n) {
    const int k = pick(1, 3);
    replicas += k;
    gpus.push_back(k * TP);
  }
  c.spec.dp = replicas;
  c.cluster = Cluster::PerNode(gpus);
  return c;
}

// Multi-node replicas: equal nodes of tp*pp/nnodes GPUs under a split the engines accept.
Case RandomMultiNode(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (;;) {
    Case c;
    c.spec.allow_multinode = true;
    c.spec.tp = pick(1, 16);
    c.spec.pp = pick(1, 8);
    c.spec.engine = pick(0, 1) ? EngineConvention::kVllm : EngineConvention::kSglang;
    const int nnodes = pick(2, 8);
    const int P = c.spec.pp, T = c.spec.tp;
    if (P % nnodes != 0 && nnodes % P != 0) continue;
    const int per_pp = std::max(nnodes / P, 1);
    if (T % per_pp != 0) continue;
    if ((T * P) % nnodes != 0) continue;
    c.spec.dp = pick(1, 3);
    c.cluster = Cluster::PerNode(std::vector<int>(c.spec.dp * nnodes, T * P / nnodes));
    return c;
  }
}

void CheckProperties(const Case& c) {
  SCOPED_TRACE(Describe(c));
  auto l = ComputeLayout(c.cluster, c.spec);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const int T = c.spec.tp, P = c.spec.pp, TP = T * P, R = c.spec.dp;
  ASSERT_EQ(static_cast<int>(l->replicas.size()), R);

  // Heads are exactly the pp0/tp0 workers, and every worker points at its replica's head.
  std::set<int> heads;
  for (const LayoutWorker& w : l->workers) {
    EXPECT_EQ(w.role == WorkerRole::kHead, w.pp == 0 && w.tp == 0);
    if (w.role == WorkerRole::kHead) heads.insert(w.rank);
    EXPECT_EQ(w.head, l->replicas[w.dp].head);
    EXPECT_EQ(l->workers[w.head].role, WorkerRole::kHead);
  }
  std::vector<int> hv = l->HeadWorkers();
  EXPECT_EQ(std::set<int>(hv.begin(), hv.end()), heads);

  // Every GPU hosts exactly one engine rank, and engine rank (tp, pp) of replica d lands on the
  // GPU of worker (d, pp, tp).
  std::map<std::pair<int, int>, int> hosted;
  std::set<int64_t> broadcast_ranks;
  std::set<int64_t> sync_ranks;
  const int S = 3;
  for (const ReplicaLayout& r : l->replicas) {
    ASSERT_EQ(static_cast<int>(r.engine_ranks.size()), TP);
    for (const EngineRankPlacement& e : r.engine_ranks) {
      ++hosted[{e.node, e.gpu}];
      const LayoutWorker& w = l->workers[r.dp * TP + e.pp * T + e.tp];
      EXPECT_EQ(w.dp, r.dp);
      EXPECT_EQ(w.pp, e.pp);
      EXPECT_EQ(w.tp, e.tp);
      EXPECT_EQ(e.node, w.node);
      EXPECT_EQ(e.gpu, w.gpu);
      EXPECT_EQ(e.worker, w.rank);
      EXPECT_EQ(r.nodes[e.node_rank].node, e.node);
      EXPECT_EQ(r.nodes[e.node_rank].cuda_visible_devices.at(e.gpu_index), e.gpu);
      // Broadcast ranks stay inside the replica's slice [rank_offset, rank_offset + T*P).
      EXPECT_GE(e.broadcast_rank, r.rank_offset);
      EXPECT_LT(e.broadcast_rank, r.rank_offset + TP);
      broadcast_ranks.insert(e.broadcast_rank);
      sync_ranks.insert(*SyncEngineRank(c.spec, S, r.dp, e.pp, e.tp));
    }
    if (r.nodes.size() == 1 && !c.spec.allow_multinode) {
      EXPECT_EQ(r.cuda_visible_devices.size(), static_cast<size_t>(TP));
    }
  }
  EXPECT_EQ(hosted.size(), l->workers.size());
  for (const auto& [gpu, n] : hosted)
    EXPECT_EQ(n, 1) << "node " << gpu.first << " gpu " << gpu.second;

  // rank_offsets partition the broadcast world [1, world).
  int64_t next = 1;
  for (const ReplicaLayout& r : l->replicas) {
    EXPECT_EQ(r.rank_offset, next);
    next += TP;
  }
  EXPECT_EQ(next, l->broadcast_world_size);
  // vLLM's ranks fill the world exactly; SGLang's collide iff pp > 1.
  if (c.spec.engine == EngineConvention::kVllm) {
    EXPECT_EQ(static_cast<int64_t>(broadcast_ranks.size()), l->broadcast_world_size - 1);
    EXPECT_FALSE(l->broadcast_rank_collision);
  } else {
    EXPECT_EQ(static_cast<int>(broadcast_ranks.size()), R * T);
    EXPECT_EQ(l->broadcast_rank_collision, P > 1);
  }
  // The sync world: engine ranks are exactly [S, S + R*T*P).
  EXPECT_EQ(static_cast<int64_t>(sync_ranks.size()), int64_t{R} * TP);
  EXPECT_EQ(*sync_ranks.begin(), S);
  EXPECT_EQ(*sync_ranks.rbegin(), *SyncWorldSize(c.spec, S) - 1);
}

TEST(LayoutProperty, RandomSingleNodeSpecs) {
  std::mt19937 rng(20260529);
  for (int i = 0; i < 400; ++i) {
    CheckProperties(RandomSingleNode(rng));
    if (HasFailure()) return;
  }
}

TEST(LayoutProperty, RandomMultiNodeSpecs) {
  std::mt19937 rng(490502);
  for (int i = 0; i < 300; ++i) {
    CheckProperties(RandomMultiNode(rng));
    if (HasFailure()) return;
  }
}

// Any single-node spec whose replicas do not fit the nodes is rejected, never laid out wrong.
TEST(LayoutProperty, RandomInvalidSpecsAreRejectedWithTheFieldNamed) {
  std::mt19937 rng(503);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int rejected = 0;
  for (int i = 0; i < 500; ++i) {
    RolloutLayoutSpec s;
    s.dp = pick(1, 6);
    s.tp = pick(1, 8);
    s.pp = pick(1, 4);
    s.engine = pick(0, 1) ? EngineConvention::kVllm : EngineConvention::kSglang;
    Cluster c = Cluster::Uniform(pick(1, 4), pick(1, 16));
    auto l = ComputeLayout(c, s);
    if (l.ok()) {
      // Accepted only if every replica sits on one node.
      for (const ReplicaLayout& r : l->replicas) EXPECT_EQ(r.nodes.size(), 1u);
      continue;
    }
    ++rejected;
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(l.status().message().rfind("--", 0), 0u) << l.status().message();
  }
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace shardsync
