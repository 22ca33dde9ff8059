// Worked examples of engine-layouts.md section 1, both engine conventions, and every rejection.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "shardsync/layout.h"

namespace shardsync {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

RolloutLayoutSpec Spec(int dp, int tp, int pp, EngineConvention e = EngineConvention::kSglang) {
  RolloutLayoutSpec s;
  s.dp = dp;
  s.tp = tp;
  s.pp = pp;
  s.engine = e;
  return s;
}

RolloutLayoutSpec MultiNode(RolloutLayoutSpec s) {
  s.allow_multinode = true;
  return s;
}

const EngineRankPlacement& Rank(const ReplicaLayout& r, int pp, int tp) {
  for (const auto& e : r.engine_ranks) {
    if (e.pp == pp && e.tp == tp) return e;
  }
  ADD_FAILURE() << "no engine rank pp=" << pp << " tp=" << tp;
  static EngineRankPlacement none;
  return none;
}

void ExpectRejected(const Result<Layout>& r, std::string_view field) {
  ASSERT_FALSE(r.ok()) << "expected a rejection naming " << field;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_THAT(r.status().message(), HasSubstr(field)) << r.status().ToString();
}

// ---- The SGLang port itself (engine.py _calculate_rank_ranges / compute_local_gpu_id) ----

struct RangeRow {
  int nnodes, pp, tp, node;
  int pp_begin, pp_end, tp_begin, tp_end;
};

TEST(SglangPort, CalculateRankRangesMatchesTheReferenceTable) {
  // engine-layouts.md 1.1 worked examples, one row per (config, node).
  const RangeRow rows[] = {
      {1, 2, 4, 0, 0, 2, 0, 4},                              // pp0/pp1 on one node
      {1, 3, 2, 0, 0, 3, 0, 2},                              //
      {2, 2, 8, 0, 0, 1, 0, 8},   {2, 2, 8, 1, 1, 2, 0, 8},  // one stage per node
      {4, 2, 16, 0, 0, 1, 0, 8},  {4, 2, 16, 1, 0, 1, 8, 16}, {4, 2, 16, 2, 1, 2, 0, 8},
      {4, 2, 16, 3, 1, 2, 8, 16}, {2, 4, 4, 0, 0, 2, 0, 4},   {2, 4, 4, 1, 2, 4, 0, 4},
  };
  for (const RangeRow& row : rows) {
    SCOPED_TRACE(testing::Message() << "nnodes=" << row.nnodes << " pp=" << row.pp
                                    << " tp=" << row.tp << " node=" << row.node);
    SglangRankRanges r = SglangCalculateRankRanges(row.nnodes, row.pp, row.tp, row.node);
    EXPECT_EQ(r.pp_begin, row.pp_begin);
    EXPECT_EQ(r.pp_end, row.pp_end);
    EXPECT_EQ(r.tp_begin, row.tp_begin);
    EXPECT_EQ(r.tp_end, row.tp_end);
  }
}

TEST(SglangPort, GpuIdStepScalesOnlyTheTpOffset) {
  // tp=2, pp=2, step=2 on one node: (pp,tp) (0,0)->0, (0,1)->2, (1,0)->2, (1,1)->4.
  EXPECT_EQ(SglangLocalGpuId(0, 2, 0, 0, 2, 2), 0);
  EXPECT_EQ(SglangLocalGpuId(0, 2, 0, 1, 2, 2), 2);
  EXPECT_EQ(SglangLocalGpuId(0, 2, 1, 0, 2, 2), 2);
  EXPECT_EQ(SglangLocalGpuId(0, 2, 1, 1, 2, 2), 4);
  EXPECT_EQ(SglangLocalGpuId(3, 1, 1, 1, 2, 2), 6);  // base shifts everything
}

TEST(SglangPort, UnsupportedNodeSplitSilentlyDropsPipelineRanks) {
  // nnodes=2, pp=3: node0 gets pp {0}, node1 pp {1}; pp 2 is never spawned by the engine.
  SglangRankRanges n0 = SglangCalculateRankRanges(2, 3, 1, 0);
  SglangRankRanges n1 = SglangCalculateRankRanges(2, 3, 1, 1);
  EXPECT_EQ(n0.pp_begin, 0);
  EXPECT_EQ(n0.pp_end, 1);
  EXPECT_EQ(n1.pp_begin, 1);
  EXPECT_EQ(n1.pp_end, 2);
}

// ---- ComputeLayout: the worked examples ----

TEST(Layout, SingleNodePp2Tp4) {
  auto l = ComputeLayout(Cluster::Uniform(1, 8), Spec(1, 4, 2));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const ReplicaLayout& r = l->replicas.at(0);
  EXPECT_THAT(r.cuda_visible_devices, ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(Rank(r, 0, t).gpu, t);      // pp0 -> 0..3
    EXPECT_EQ(Rank(r, 1, t).gpu, 4 + t);  // pp1 -> 4..7
  }
}

TEST(Layout, SingleNodePp3Tp2) {
  auto l = ComputeLayout(Cluster::Uniform(1, 6), Spec(1, 2, 3));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  for (int p = 0; p < 3; ++p) {
    for (int t = 0; t < 2; ++t) EXPECT_EQ(Rank(l->replicas[0], p, t).gpu, 2 * p + t);
  }
}

TEST(Layout, TwoNodesPp2Tp8OneStagePerNode) {
  auto l = ComputeLayout(Cluster::Uniform(2, 8), MultiNode(Spec(1, 8, 2)));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const ReplicaLayout& r = l->replicas[0];
  ASSERT_EQ(r.nodes.size(), 2u);
  EXPECT_EQ(r.pp_size_per_node, 1);
  EXPECT_EQ(r.nnodes_per_pp_rank, 1);
  EXPECT_EQ(r.tp_size_per_node, 8);
  for (int p = 0; p < 2; ++p) {
    for (int t = 0; t < 8; ++t) {
      EXPECT_EQ(Rank(r, p, t).node, p);
      EXPECT_EQ(Rank(r, p, t).node_rank, p);
      EXPECT_EQ(Rank(r, p, t).gpu, t);
    }
  }
}

TEST(Layout, FourNodesPp2Tp16SplitsEachTpGroupOverTwoNodes) {
  auto l = ComputeLayout(Cluster::Uniform(4, 8), MultiNode(Spec(1, 16, 2)));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const ReplicaLayout& r = l->replicas[0];
  EXPECT_EQ(r.nnodes_per_pp_rank, 2);
  EXPECT_EQ(r.tp_size_per_node, 8);
  for (int p = 0; p < 2; ++p) {
    for (int t = 0; t < 16; ++t) {
      // nodes 0,1,2,3 hold pp 0,0,1,1 and tp 0-7, 8-15, 0-7, 8-15; t -> t % 8.
      EXPECT_EQ(Rank(r, p, t).node, 2 * p + t / 8);
      EXPECT_EQ(Rank(r, p, t).gpu, t % 8);
    }
  }
}

TEST(Layout, TwoNodesPp4Tp4TwoStagesPerNode) {
  auto l = ComputeLayout(Cluster::Uniform(2, 8), MultiNode(Spec(1, 4, 4)));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  for (int p = 0; p < 4; ++p) {
    for (int t = 0; t < 4; ++t) {
      EXPECT_EQ(Rank(l->replicas[0], p, t).node, p / 2);
      EXPECT_EQ(Rank(l->replicas[0], p, t).gpu, (p % 2) * 4 + t);
    }
  }
}

TEST(Layout, IssueExampleDp4Tp2Pp2OnTwoNodes) {
  auto l = ComputeLayout(Cluster::Uniform(2, 8), Spec(4, 2, 2));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_THAT(l->HeadWorkers(), ElementsAre(0, 4, 8, 12));
  ASSERT_EQ(l->replicas.size(), 4u);
  EXPECT_EQ(l->replicas[2].node, 1);
  EXPECT_THAT(l->replicas[2].cuda_visible_devices, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(l->replicas[3].cuda_visible_devices, ElementsAre(4, 5, 6, 7));
  const LayoutWorker& w13 = l->workers[13];
  EXPECT_EQ(w13.node, 1);
  EXPECT_EQ(w13.gpu, 5);
  EXPECT_EQ(w13.dp, 3);
  EXPECT_EQ(w13.pp, 0);
  EXPECT_EQ(w13.tp, 1);
  EXPECT_EQ(w13.role, WorkerRole::kShell);
  EXPECT_EQ(w13.head, 12);
  EXPECT_EQ(Rank(l->replicas[3], 1, 1).worker, 15);
  // Broadcast accounting: rank_offset = i*T*P + 1, world = R*T*P + 1.
  EXPECT_EQ(l->replicas[0].rank_offset, 1);
  EXPECT_EQ(l->replicas[3].rank_offset, 13);
  EXPECT_EQ(l->broadcast_world_size, 17);
  EXPECT_EQ(l->collecting_rank, 0);
  // SGLang upstream: rank_offset + tp, so both pipeline stages join as ranks 13..14.
  EXPECT_EQ(Rank(l->replicas[3], 0, 1).broadcast_rank, 14);
  EXPECT_EQ(Rank(l->replicas[3], 1, 1).broadcast_rank, 14);
  EXPECT_TRUE(l->broadcast_rank_collision);
}

TEST(Layout, VllmConventionIsContiguousAndPpAwareInTheBroadcastGroup) {
  auto l = ComputeLayout(Cluster::Uniform(2, 8), Spec(4, 2, 2, EngineConvention::kVllm));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const ReplicaLayout& r = l->replicas[3];
  EXPECT_THAT(r.cuda_visible_devices, ElementsAre(4, 5, 6, 7));
  for (int p = 0; p < 2; ++p) {
    for (int t = 0; t < 2; ++t) {
      EXPECT_EQ(Rank(r, p, t).gpu_index, p * 2 + t);  // cuda:local_rank
      EXPECT_EQ(Rank(r, p, t).gpu, 4 + p * 2 + t);
      // rank_offset + dp*T*P + pp*T + tp with rank_offset 1 for one DP group.
      EXPECT_EQ(Rank(r, p, t).broadcast_rank, 1 + 3 * 4 + p * 2 + t);
    }
  }
  EXPECT_FALSE(l->broadcast_rank_collision);
}

TEST(Layout, VllmMultiNodeSplitsTheRankMeshByLocalWorldSize) {
  auto l =
      ComputeLayout(Cluster::Uniform(4, 8), MultiNode(Spec(1, 16, 2, EngineConvention::kVllm)));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  for (int p = 0; p < 2; ++p) {
    for (int t = 0; t < 16; ++t) {
      const int g = p * 16 + t;
      EXPECT_EQ(Rank(l->replicas[0], p, t).node_rank, g / 8);
      EXPECT_EQ(Rank(l->replicas[0], p, t).gpu, g % 8);
    }
  }
}

TEST(Layout, ExplicitPerNodeGpuCounts) {
  // Nodes of 8, 8 and 4 GPUs; replicas of 4 never straddle.
  auto l = ComputeLayout(Cluster::PerNode({8, 8, 4}), Spec(5, 4, 1));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->replicas[4].node, 2);
  EXPECT_THAT(l->replicas[4].cuda_visible_devices, ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(l->workers.back().node, 2);
  EXPECT_EQ(l->workers.back().gpu, 3);
}

TEST(Layout, GpuIdStepIsHarmlessWithoutTensorParallelism) {
  // The quirk reproduced: with tp=1, (tp % 1) * step == 0, so step=2 changes nothing.
  RolloutLayoutSpec s = Spec(1, 1, 2);
  s.gpu_id_step = 2;
  auto l = ComputeLayout(Cluster::Uniform(1, 2), s);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(Rank(l->replicas[0], 1, 0).gpu, 1);
}

TEST(Layout, ConfiguredRolloutGpuCountThatAgreesIsAccepted) {
  RolloutLayoutSpec s = Spec(2, 2, 1);
  s.rollout_gpus = 4;
  EXPECT_TRUE(ComputeLayout(Cluster::Uniform(1, 4), s).ok());
}

TEST(Layout, SyncWorldPutsTrainerRanksFirst) {
  RolloutLayoutSpec s = Spec(4, 2, 2);
  EXPECT_EQ(*SyncWorldSize(s, 8), 8 + 16);
  EXPECT_EQ(*SyncEngineRank(s, 8, 0, 0, 0), 8);
  EXPECT_EQ(*SyncEngineRank(s, 8, 3, 1, 1), 8 + 12 + 2 + 1);
  EXPECT_EQ(SyncEngineRank(s, 8, 4, 0, 0).status().code(), StatusCode::kOutOfRange);
  EXPECT_THAT(SyncEngineRank(s, 8, 0, 2, 0).status().message(), HasSubstr("pp"));
  EXPECT_THAT(SyncEngineRank(s, 8, 0, 0, -1).status().message(), HasSubstr("tp"));
  auto bad = SyncWorldSize(s, 0);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--trainer-world"));
}

// ---- Rejections: code and the field named ----

TEST(LayoutRejects, GpuIdStepQuirkCollision) {
  RolloutLayoutSpec s = Spec(1, 2, 2);
  s.gpu_id_step = 2;
  auto l = ComputeLayout(Cluster::Uniform(1, 4), s);
  ExpectRejected(l, "--gpu-id-step");
  EXPECT_THAT(l.status().message(), HasSubstr("same GPU"));
}

TEST(LayoutRejects, GpuIndexOutsideTheVisibleList) {
  RolloutLayoutSpec s = Spec(1, 4, 1);
  s.base_gpu_id = 1;
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), s), "--base-gpu-id");
  s = Spec(1, 2, 1);
  s.gpu_id_step = 2;  // tp 1 -> index 2 of 2 visible GPUs
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 2), s), "--gpu-id-step");
}

TEST(LayoutRejects, WorkerCountDiffersFromClusterGpus) {
  ExpectRejected(ComputeLayout(Cluster::Uniform(2, 8), Spec(3, 2, 2)), "--dp x --tp x --pp");
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 8), Spec(1 << 30, 1 << 30, 1 << 30)),
                 "--dp x --tp x --pp");
}

TEST(LayoutRejects, ReplicaStraddlingANode) {
  // 2 nodes x 6 GPUs, replicas of 4: replica 1 = node 0 GPUs 4,5 + node 1 GPUs 0,1.
  auto l = ComputeLayout(Cluster::Uniform(2, 6), Spec(3, 4, 1));
  ExpectRejected(l, "--allow-multinode");
  EXPECT_THAT(l.status().message(), HasSubstr("replica 1"));
  // Also a replica that spans whole nodes, without the flag.
  ExpectRejected(ComputeLayout(Cluster::Uniform(2, 8), Spec(1, 8, 2)), "--allow-multinode");
}

TEST(LayoutRejects, NonPositiveSizes) {
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), Spec(0, 4, 1)), "--dp");
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), Spec(1, -4, 1)), "--tp");
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), Spec(4, 1, 0)), "--pp");
  ExpectRejected(ComputeLayout(Cluster::Uniform(0, 4), Spec(1, 4, 1)), "--nodes");
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, -1), Spec(1, 4, 1)), "--gpus-per-node");
  ExpectRejected(ComputeLayout(Cluster::PerNode({4, 0}), Spec(1, 4, 1)), "--gpus-per-node-list[1]");
  RolloutLayoutSpec s = Spec(1, 4, 1);
  s.gpu_id_step = 0;
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), s), "--gpu-id-step");
  s = Spec(1, 4, 1);
  s.base_gpu_id = -1;
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), s), "--base-gpu-id");
  s = Spec(1, 4, 1);
  s.rollout_gpus = 0;
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), s), "--rollout-gpus");
}

TEST(LayoutRejects, ClusterTooLarge) {
  ExpectRejected(ComputeLayout(Cluster::Uniform(100000, 100000), Spec(1, 1, 1)), "--nodes");
  ExpectRejected(ComputeLayout(Cluster::PerNode({1 << 20, 1}), Spec(1, 1, 1)),
                 "--gpus-per-node-list");
}

TEST(LayoutRejects, ConfiguredRolloutGpuCountDisagrees) {
  RolloutLayoutSpec s = Spec(2, 2, 2);
  s.rollout_gpus = 16;
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 8), s), "--rollout-gpus");
}

TEST(LayoutRejects, SglangNodeSplitThatDropsPipelineRanks) {
  // nnodes=2, pp=3: the engine would never spawn pp 2.
  auto l = ComputeLayout(Cluster::Uniform(2, 3), MultiNode(Spec(1, 2, 3)));
  ExpectRejected(l, "--pp");
  EXPECT_THAT(l.status().message(), HasSubstr("_calculate_rank_ranges"));
  ExpectRejected(ComputeLayout(Cluster::Uniform(3, 2), MultiNode(Spec(1, 3, 2))), "--pp");
}

TEST(LayoutRejects, SglangTpNotDivisibleAcrossNodes) {
  // 3 GPUs over nodes of 2 and 1, tp=3: each TP group split over 2 nodes, 3 % 2 != 0.
  ExpectRejected(ComputeLayout(Cluster::PerNode({2, 1}), MultiNode(Spec(1, 3, 1))), "--tp");
}

TEST(LayoutRejects, UnevenNodesUnderAMultiNodeReplica) {
  ExpectRejected(ComputeLayout(Cluster::PerNode({4, 2}), MultiNode(Spec(1, 6, 1))),
                 "--gpus-per-node-list");
  ExpectRejected(
      ComputeLayout(Cluster::PerNode({4, 2}), MultiNode(Spec(1, 6, 1, EngineConvention::kVllm))),
      "--gpus-per-node-list");
}

TEST(LayoutRejects, VllmConstraints) {
  RolloutLayoutSpec s = Spec(1, 4, 1, EngineConvention::kVllm);
  s.base_gpu_id = 2;
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), s), "--base-gpu-id");
  s = Spec(1, 4, 1, EngineConvention::kVllm);
  s.gpu_id_step = 2;
  ExpectRejected(ComputeLayout(Cluster::Uniform(1, 4), s), "--gpu-id-step");
  // tp*pp = 3 over 2 nodes: not divisible.
  ExpectRejected(
      ComputeLayout(Cluster::PerNode({2, 1}), MultiNode(Spec(1, 3, 1, EngineConvention::kVllm))),
      "--tp x --pp");
}

TEST(LayoutRejects, UnknownEngine) {
  auto e = ParseEngineConvention("trtllm");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("--engine"));
  EXPECT_EQ(*ParseEngineConvention("vllm"), EngineConvention::kVllm);
  EXPECT_EQ(EngineConventionName(*ParseEngineConvention("sglang")), "sglang");
}

// ---- Renderings ----

TEST(LayoutRender, JsonCarriesTheDocumentedSchema) {
  auto l = ComputeLayout(Cluster::Uniform(2, 8), Spec(4, 2, 2));
  ASSERT_TRUE(l.ok());
  auto text = LayoutToJson(*l, 2);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  auto j = nlohmann::json::parse(*text);
  ASSERT_EQ(j["workers"].size(), 16u);
  const auto& w = j["workers"][13];
  EXPECT_EQ(w["rank"], 13);
  EXPECT_EQ(w["node"], 1);
  EXPECT_EQ(w["gpu"], 5);
  EXPECT_EQ(w["dp"], 3);
  EXPECT_EQ(w["pp"], 0);
  EXPECT_EQ(w["tp"], 1);
  EXPECT_EQ(w["role"], "shell");
  EXPECT_EQ(w["head"], 12);
  const auto& r = j["replicas"][3];
  EXPECT_EQ(r["dp"], 3);
  EXPECT_EQ(r["head"], 12);
  EXPECT_EQ(r["node"], 1);
  EXPECT_EQ(r["cuda_visible_devices"], nlohmann::json({4, 5, 6, 7}));
  EXPECT_EQ(r["rank_offset"], 13);
  const auto& e = r["engine_ranks"][3];  // (pp1, tp1)
  EXPECT_EQ(e["tp"], 1);
  EXPECT_EQ(e["pp"], 1);
  EXPECT_EQ(e["gpu"], 7);
  EXPECT_EQ(e["worker"], 15);
  EXPECT_EQ(e["global_rank"], 3);
  EXPECT_EQ(e["broadcast_rank"], 14);
  EXPECT_EQ(e["sync_rank"], 2 + 12 + 3);
  EXPECT_EQ(j["broadcast_world_size"], 17);
  EXPECT_EQ(j["broadcast_rank_collision"], true);
  EXPECT_EQ(j["sync"]["trainer_world"], 2);
  EXPECT_EQ(j["sync"]["world_size"], 18);

  auto m = ComputeLayout(Cluster::Uniform(4, 8), MultiNode(Spec(1, 16, 2)));
  ASSERT_TRUE(m.ok());
  auto mj = nlohmann::json::parse(*LayoutToJson(*m, 1));
  const auto& nodes = mj["replicas"][0]["nodes"];
  ASSERT_EQ(nodes.size(), 4u);
  EXPECT_EQ(nodes[3]["node"], 3);
  EXPECT_EQ(nodes[3]["node_rank"], 3);
  EXPECT_EQ(mj["replicas"][0]["engine_ranks"][31]["node"], 3);  // (pp1, tp15)
  EXPECT_EQ(mj["replicas"][0]["engine_ranks"][31]["gpu"], 7);
  EXPECT_EQ(mj["replicas"][0]["nnodes_per_pp_rank"], 2);
}

TEST(LayoutRender, TableNamesEveryReplicaAndWorker) {
  auto l = ComputeLayout(Cluster::Uniform(2, 8), Spec(4, 2, 2));
  ASSERT_TRUE(l.ok());
  auto t = LayoutToTable(*l, 1);
  ASSERT_TRUE(t.ok());
  EXPECT_THAT(*t, HasSubstr("replica 3: head worker 12 on node 1, rank_offset 13"));
  EXPECT_THAT(*t, HasSubstr("CUDA_VISIBLE_DEVICES=4,5,6,7"));
  EXPECT_THAT(*t, HasSubstr("pp1  6 (w14)  7 (w15)"));
  EXPECT_THAT(*t, HasSubstr("WARNING"));
  EXPECT_EQ(LayoutToTable(*l, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(LayoutRender, LaunchLines) {
  auto l = ComputeLayout(Cluster::Uniform(2, 8), MultiNode(Spec(1, 4, 4)));
  ASSERT_TRUE(l.ok());
  auto sg = LayoutToSglangLaunch(*l);
  ASSERT_TRUE(sg.ok());
  EXPECT_THAT(*sg,
              HasSubstr("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 python -m sglang.launch_server"));
  EXPECT_THAT(*sg, HasSubstr("--tp-size 4 --pp-size 4 --base-gpu-id 0 --nnodes 2 --node-rank 1 "
                             "--dist-init-addr \"$DIST_INIT_ADDR_0\""));
  auto vm =
      ComputeLayout(Cluster::Uniform(2, 8), MultiNode(Spec(1, 4, 4, EngineConvention::kVllm)));
  ASSERT_TRUE(vm.ok());
  auto vml = LayoutToVllmLaunch(*vm);
  ASSERT_TRUE(vml.ok());
  EXPECT_THAT(*vml, HasSubstr("--nnodes 2 --node-rank 0 --master-addr \"$MASTER_ADDR_0\" "
                              "--master-port \"$MASTER_PORT_0\" --port 8000\n"));
  EXPECT_THAT(*vml, HasSubstr("--nnodes 2 --node-rank 1 --master-addr \"$MASTER_ADDR_0\" "
                              "--master-port \"$MASTER_PORT_0\" --headless\n"));
  auto bad = LayoutToVllmLaunch(*l);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--format"));

  RolloutLayoutSpec s = Spec(2, 2, 1, EngineConvention::kVllm);
  auto v = ComputeLayout(Cluster::Uniform(1, 4), s);
  ASSERT_TRUE(v.ok());
  auto vl = LayoutToVllmLaunch(*v);
  ASSERT_TRUE(vl.ok());
  EXPECT_THAT(*vl, HasSubstr("CUDA_VISIBLE_DEVICES=2,3 vllm serve \"$MODEL_PATH\" "
                             "--tensor-parallel-size 2 --pipeline-parallel-size 1 --port 8001"));
}

}  // namespace
}  // namespace shardsync
