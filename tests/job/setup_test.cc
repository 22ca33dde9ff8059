// Issue 36: the rank programs' setup barrier (a rank's allocation and synthetic fill are not
// counted in --timeout-ms; a rank that fails or dies while setting up fails the others at once,
// naming it and its error; a setup that takes too long names who and the flag), and the
// launchers' failure report (every failing rank with its own last error, causes before echoes).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "job/internal.h"
#include "job/launcher.h"
#include "test_util.h"

namespace shardsync {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
constexpr char kToken[] = "test-token-0123456789";

JobSpec FourRanks() {  // fsdp=2 -> dp=1,tp=2,pp=1
  return testing::Job(testing::TinyQwen2(2, true), "fsdp=2", "dp=1,tp=2,pp=1", "sglang", 16 << 10);
}

// Runs `fn(rank, barrier)` on every rank, each with its own store connection.
std::vector<Status> OnEveryRank(const JobSpec& job, const std::string& address,
                                const std::function<Status(int, job_internal::SetupBarrier&)>& fn,
                                std::vector<double>* ended) {
  const int world = SyncWorldSize(job.inputs);
  std::vector<Status> st(world);
  ended->assign(world, 0);
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] {
      auto c = StoreClient::Connect(address, kToken, Millis(5000));
      if (!c.ok()) {
        st[r] = c.status();
        return;
      }
      job_internal::SetupBarrier b(job, r, **c);
      st[r] = b.Begin();
      if (st[r].ok()) st[r] = fn(r, b);
      (*ended)[r] = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  }
  for (auto& t : ts) t.join();
  return st;
}

TEST(SetupBarrier, ARankFailingInSetupFailsTheOthersAtOnceWithItsError) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  JobSpec job = FourRanks();
  job.setup_timeout = Millis(60000);
  std::vector<double> ended;
  auto st = OnEveryRank(
      job, (*server)->address(),
      [](int r, job_internal::SetupBarrier& b) {
        if (r != 1) return b.Wait();
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        return b.Fail(InvalidArgumentError("--trainer-dtype: F8_E4M3 is not supported"));
      },
      &ended);
  for (int r = 0; r < 4; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    if (r == 1) continue;
    EXPECT_THAT(st[r].message(), HasSubstr("sync rank 1 failed in setup")) << st[r].ToString();
    EXPECT_THAT(st[r].message(), HasSubstr("F8_E4M3 is not supported")) << st[r].ToString();
    EXPECT_LT(ended[r], 5.0) << "rank " << r;
  }
}

TEST(SetupBarrier, ASlowSetupIsNotCountedInTheTimeoutAndATooSlowOneNamesTheRanksAndTheFlag) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  JobSpec job = FourRanks();
  job.timeout = Millis(100);  // --timeout-ms does not bound setup
  job.setup_timeout = Millis(10000);
  std::vector<double> ended;
  auto ok = OnEveryRank(
      job, (*server)->address(),
      [](int r, job_internal::SetupBarrier& b) {
        if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(700));
        return b.Wait();
      },
      &ended);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(ok[r].ok()) << ok[r].ToString();

  job.prefix = "again/";
  job.setup_timeout = Millis(1000);
  auto late = OnEveryRank(
      job, (*server)->address(),
      [](int r, job_internal::SetupBarrier& b) {
        if (r == 3) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          return OkStatus();  // never reaches Wait in time
        }
        return b.Wait();
      },
      &ended);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(late[r].code(), StatusCode::kDeadlineExceeded) << late[r].ToString();
    EXPECT_THAT(late[r].message(), HasSubstr("waiting for sync ranks 3 to allocate"));
    EXPECT_THAT(late[r].message(), HasSubstr("--setup-timeout-s"));
  }
}

TEST(LocalJobResult, FailureReportListsEveryFailingRankCausesFirst) {
  LocalJobResult res;
  RankResult ok;
  ok.rank = 2;
  ok.ok = true;
  RankResult echo;
  echo.rank = 0;
  echo.is_trainer = true;
  echo.trainer_rank = 0;
  echo.error = "unavailable: sync rank 0: launch 'x' ended before this rank joined its job (...)";
  RankResult cause;
  cause.rank = 1;
  cause.is_trainer = true;
  cause.trainer_rank = 1;
  cause.error = "deadline_exceeded: sync rank 1: timed out (--timeout-ms 60000 bounds connect)";
  res.ranks = {echo, cause, ok};
  EXPECT_EQ(res.FirstError(), cause.error);
  const std::string report = res.FailureReport();
  EXPECT_THAT(report, HasSubstr("2 of 3 sync ranks failed"));
  const size_t c = report.find("sync rank 1 (trainer 1): deadline_exceeded");
  const size_t e = report.find("sync rank 0 (trainer 0), after another rank: unavailable");
  ASSERT_NE(c, std::string::npos) << report;
  ASSERT_NE(e, std::string::npos) << report;
  EXPECT_LT(c, e) << "the cause comes first";
  EXPECT_THAT(report, HasSubstr("--timeout-ms 60000"));
  res.ranks = {ok};
  EXPECT_EQ(res.FailureReport(), "");
}

TEST(JobFlags, TheDefaultTimeoutOfALocalJobScalesWithTheRanksPerCore) {
  JobFlags f;  // 8 ranks
  f.timeout_auto = true;
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  auto local = JobSpecFromFlags(f, /*all_local=*/true);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_EQ(local->timeout, Millis(60000 * std::max<int64_t>(1, (8 + cores - 1) / cores)));
  auto run = JobSpecFromFlags(f, /*all_local=*/false);  // `run`: ranks anywhere
  ASSERT_TRUE(run.ok());
  EXPECT_EQ(run->timeout, Millis(60000));
  f.timeout_auto = false;  // --timeout-ms given
  f.timeout_ms = 1234;
  auto given = JobSpecFromFlags(f, /*all_local=*/true);
  ASSERT_TRUE(given.ok());
  EXPECT_EQ(given->timeout, Millis(1234));
}

TEST(JobFlags, SetupTimeoutIsAFlagThatReachesTheChildren) {
  JobFlags f;
  f.setup_timeout_s = 0;
  auto bad = JobSpecFromFlags(f);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--setup-timeout-s"));
  f.setup_timeout_s = 1234;
  auto j = JobSpecFromFlags(f, /*all_local=*/true);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ(j->setup_timeout, Millis(1234000));
  const auto args = JobSpecToArgs(*j);
  auto at = std::find(args.begin(), args.end(), "--setup-timeout-s");
  ASSERT_NE(at, args.end());
  EXPECT_EQ(*(at + 1), "1234");
}

}  // namespace
}  // namespace shardsync
