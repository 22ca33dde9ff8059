// End-to-end syncs on loopback (one thread per sync rank): every engine parameter is compared
// element by element with the synthetic HF values it was cut from.
#include <gtest/gtest.h>

#include "job/launcher.h"
#include "job/test_util.h"

namespace shardsync {
namespace {

using testing::Job;

void ExpectVerified(const JobSpec& job) {
  LocalJobOptions o;
  o.job = job;
  o.mode = LocalJobOptions::Mode::kThreads;
  o.job_timeout = Millis(50000);
  auto r = RunLocalJob(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->ok()) << r->FirstError();
  int64_t checked = 0, engine_bytes = 0;
  for (const RankResult& rr : r->ranks) {
    EXPECT_EQ(rr.element_mismatches, 0) << rr.first_mismatch;
    checked += rr.elements_checked;
    if (!rr.is_trainer) {
      EXPECT_GT(rr.elements_checked, 0) << "engine rank " << rr.rank << " checked nothing";
      engine_bytes += rr.report.local.recv_bytes;
    }
    EXPECT_EQ(rr.report.version, static_cast<uint64_t>(job.syncs));
    EXPECT_EQ(rr.report.checksums_ok, rr.report.checksums_total);
    EXPECT_GT(rr.report.checksums_total, 0);
  }
  EXPECT_GT(checked, 0);
  // Wire bytes per engine rank equal owned bytes (from the planner's analytic summary).
  auto sum = SummarizePlan(job.inputs);
  ASSERT_TRUE(sum.ok());
  const int S = job.inputs.trainer.world();
  for (size_t i = 0; i < sum->engine_ranks.size(); ++i) {
    EXPECT_EQ(r->ranks[S + i].report.local.recv_bytes, sum->engine_ranks[i].owned_bytes)
        << "engine rank " << i;
  }
}

TEST(SyncLayouts, TiedEmbeddingsUnderPipelineParallel) {
  JobSpec j = Job(testing::TinyQwen2(4, true), "fsdp=3", "dp=1,tp=2,pp=2");
  j.syncs = 2;
  ExpectVerified(j);
}

TEST(SyncLayouts, UnevenPipelinePartition) {
  ExpectVerified(
      Job(testing::TinyQwen2(5, false), "fsdp=2", "dp=1,tp=1,pp=3", "sglang", 32 << 10, "1,3,1"));
}

TEST(SyncLayouts, KvReplicationTpAboveKvHeads) {
  // 2 KV heads, tp 4: each KV head replicated on two ranks.
  ExpectVerified(Job(testing::TinyQwen2(2, true), "fsdp=2", "dp=1,tp=4,pp=1"));
}

TEST(SyncLayouts, VllmTwoReplicasReplicatedTrainer) {
  ExpectVerified(Job(testing::TinyQwen2(3, false), "replicate=2", "dp=2,tp=2,pp=1", "vllm"));
}

TEST(SyncLayouts, MoeExpertParallel1) {
  ExpectVerified(Job(testing::TinyQwen3Moe(), "fsdp=2", "dp=1,tp=2,pp=1"));
}

TEST(SyncLayouts, MoeExpertParallel2) {
  ExpectVerified(Job(testing::TinyQwen3Moe(), "fsdp=3", "dp=1,tp=2,pp=1,ep=2"));
}

TEST(SyncLayouts, BucketLargerThanMessages) {
  ExpectVerified(
      Job(testing::TinyQwen2(2, true), "single", "dp=1,tp=2,pp=1", "sglang", int64_t{512} << 20));
}

}  // namespace
}  // namespace shardsync
