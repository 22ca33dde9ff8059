// Multi-process jobs through the local launcher: one `shardsync run` process per sync rank over
// each host transport (ucx, shm), the launch contract (SHARDSYNC_STORE, RANK, WORLD_SIZE,
// SHARDSYNC_TOKEN), and a trainer process SIGKILLed mid-job: every other rank must fail on its own
// within its timeout, engine ranks poisoned, no child left behind.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "job/launcher.h"
#include "test_util.h"

namespace shardsync {
namespace {

using ::testing::HasSubstr;

class SyncProcesses : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "ucx" && DefaultTransport() != "ucx") GTEST_SKIP() << "built without UCX";
  }
  JobSpec Job(int syncs, int64_t timeout_ms) const {
    JobSpec j =
        testing::Job(testing::TinyQwen2(2, true), "fsdp=2", "dp=1,tp=2,pp=2", "sglang", 16 << 10);
    j.transport = GetParam();
    j.syncs = syncs;
    j.timeout = Millis(timeout_ms);
    return j;
  }
};

INSTANTIATE_TEST_SUITE_P(HostTransports, SyncProcesses, ::testing::Values("ucx", "shm"),
                         [](const auto& info) { return info.param; });

TEST_P(SyncProcesses, JobVerifiesEveryElement) {
  LocalJobOptions o;
  o.job = Job(3, 20000);
  o.mode = LocalJobOptions::Mode::kProcesses;
  o.exe = SHARDSYNC_CLI_PATH;
  o.job_timeout = Millis(50000);
  auto r = RunLocalJob(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->ok()) << r->FirstError();
  ASSERT_EQ(static_cast<int>(r->ranks.size()), 6);
  for (const RankResult& rr : r->ranks) {
    EXPECT_EQ(rr.report.version, 3u);
    EXPECT_EQ(rr.report.checksums_ok, rr.report.checksums_total);
    EXPECT_FALSE(rr.poisoned);
    if (!rr.is_trainer) {
      EXPECT_GT(rr.elements_checked, 0);
      EXPECT_EQ(rr.element_mismatches, 0);
    }
  }
}

TEST_P(SyncProcesses, KilledTrainerFailsEveryRankWithinTheTimeout) {
  LocalJobOptions o;
  o.job = Job(100000, 2000);  // far more syncs than run before the kill
  o.mode = LocalJobOptions::Mode::kProcesses;
  o.exe = SHARDSYNC_CLI_PATH;
  o.job_timeout = Millis(45000);  // a hang would end here as DeadlineExceeded
  const int world = 6;
  o.kill_rank = 1;
  o.kill_at_progress = world * 2 + 4 * world;  // every rank connected, a few syncs done
  auto r = RunLocalJob(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(static_cast<int>(r->ranks.size()), world);
  EXPECT_FALSE(r->ok());
  EXPECT_THAT(r->ranks[1].error, HasSubstr("signal 9"));
  for (const RankResult& rr : r->ranks) {
    EXPECT_FALSE(rr.ok) << "sync rank " << rr.rank << " reported success";
    EXPECT_FALSE(rr.error.empty());
    if (!rr.is_trainer) {
      EXPECT_TRUE(rr.poisoned) << "sync rank " << rr.rank;
    }
  }
}

}  // namespace
}  // namespace shardsync
