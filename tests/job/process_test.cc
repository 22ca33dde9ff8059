// Multi-process jobs through the local launcher: one `shardsync run` process per sync rank over
// each host transport (ucx, shm), the launch contract (SHARDSYNC_STORE, RANK, WORLD_SIZE,
// SHARDSYNC_TOKEN, SHARDSYNC_JOB_ID), a trainer process SIGKILLed mid-job: every other rank must
// fail on its own within its timeout, engine ranks poisoned, no child left behind; a rank killed
// before it connects: the others fail at once, naming it; UCX listening on loopback only.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "job/internal.h"
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

namespace shardsync {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// Issue 24: a rank killed before it connects used to cost every other rank its whole connect
// timeout. The launcher marks it dead in the store; the others fail at once, naming it.
TEST(LocalLauncher, RankKilledBeforeConnectFailsTheOthersAtOnce) {
  for (int dead : {2, 0}) {
    SCOPED_TRACE("killed rank " + std::to_string(dead));
    LocalJobOptions o;
    o.job =
        testing::Job(testing::TinyQwen2(2, true), "fsdp=2", "dp=1,tp=2,pp=2", "sglang", 16 << 10);
    o.job.transport = "shm";
    o.job.syncs = 2;
    o.job.timeout = Millis(30000);  // connect timeout 30 s: a wait for it would show
    o.mode = LocalJobOptions::Mode::kProcesses;
    o.exe = SHARDSYNC_CLI_PATH;
    o.job_timeout = Millis(60000);
    o.kill_rank = dead;
    o.kill_at_progress = 0;  // as soon as it is started
    const auto t0 = Clock::now();
    auto r = RunLocalJob(o);
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::printf("rank %d killed at start: the job ended in %.2f s\n", dead, secs);
    EXPECT_LT(secs, 10.0) << "the others waited for their connect timeout";
    for (const RankResult& rr : r->ranks) {
      EXPECT_FALSE(rr.ok) << "sync rank " << rr.rank;
      if (rr.rank == dead) continue;
      EXPECT_THAT(rr.error, HasSubstr("sync rank " + std::to_string(dead))) << rr.error;
      // Why: the launcher's word (killed by signal 9) when it marked the rank dead first; the
      // store's when the rank had joined and its connection closed first (a loaded machine).
      EXPECT_THAT(rr.error, AnyOf(HasSubstr("signal 9"), HasSubstr("store connection")))
          << rr.error;
    }
  }
}

// The launcher's children: the launch contract replaced, the launch id, and UCX's listeners on
// loopback unless the user named devices.
TEST(LocalLauncher, ChildEnvironment) {
  auto env = job_internal::ChildEnvironment(
      {"PATH=/bin", "RANK=7", "SHARDSYNC_JOB_ID=old", "SHARDSYNC_TOKEN=x"}, "127.0.0.1:5", 4, "tok",
      "launch-1");
  auto has = [&](const std::string& v) { return std::count(env.begin(), env.end(), v) == 1; };
  EXPECT_TRUE(has("PATH=/bin"));
  EXPECT_TRUE(has("SHARDSYNC_STORE=127.0.0.1:5"));
  EXPECT_TRUE(has("WORLD_SIZE=4"));
  EXPECT_TRUE(has("SHARDSYNC_TOKEN=tok"));
  EXPECT_TRUE(has("SHARDSYNC_JOB_ID=launch-1"));
  EXPECT_TRUE(has("SHARDSYNC_UCX_NET_DEVICES=loopback"));
  EXPECT_FALSE(has("RANK=7"));
  EXPECT_FALSE(has("SHARDSYNC_JOB_ID=old"));
  for (const char* mine : {"UCX_NET_DEVICES=mlx5_0:1", "SHARDSYNC_UCX_NET_DEVICES=eth1"}) {
    auto kept = job_internal::ChildEnvironment({mine}, "127.0.0.1:5", 4, "tok", "l");
    EXPECT_EQ(std::count(kept.begin(), kept.end(), "SHARDSYNC_UCX_NET_DEVICES=loopback"), 0);
    EXPECT_EQ(std::count(kept.begin(), kept.end(), mine), 1);
  }
}

// --emulate-nodes: each child its own node, for shardsync's routing and NCCL's, replacing any the
// parent set; refused where it cannot apply (threads, a one-host transport).
TEST(LocalLauncher, EmulatedNodeEnvironment) {
  std::vector<std::string> env = {"PATH=/bin", "SHARDSYNC_HOST_ID=mine", "NCCL_HOSTID=theirs"};
  job_internal::EmulateNode(env, "box", 3);
  EXPECT_EQ(env, (std::vector<std::string>{"PATH=/bin", "SHARDSYNC_HOST_ID=box/node3",
                                           "NCCL_HOSTID=box/node3"}));
  JobSpec job;
  job.transport = "loopback";
  using Mode = LocalJobOptions::Mode;
  EXPECT_EQ(CheckEmulateNodes(job, Mode::kAuto).code(), StatusCode::kInvalidArgument);
  job.transport = "shm";
  EXPECT_THAT(CheckEmulateNodes(job, Mode::kProcesses).message(), HasSubstr("--transport shm"));
  job.transport = "ucx";
  EXPECT_TRUE(CheckEmulateNodes(job, Mode::kAuto).ok());
  EXPECT_THAT(CheckEmulateNodes(job, Mode::kThreads).message(), HasSubstr("threads"));
  job.device = "cuda";
  job.transport = "auto";  // the routing hint: pairs between nodes take nccl
  EXPECT_TRUE(CheckEmulateNodes(job, Mode::kProcesses).ok());
  LocalJobOptions o;
  o.job.transport = "shm";
  o.emulate_nodes = true;
  o.mode = Mode::kProcesses;
  EXPECT_EQ(RunLocalJob(o).status().code(), StatusCode::kInvalidArgument);
}

// A host job over ucx with every rank its own node: the children report the node they were
// given and the job verifies (UCX between nodes: peer-failure mode, off shared memory).
TEST(LocalLauncher, EmulatedNodesJobVerifies) {
  if (DefaultTransport() != "ucx") GTEST_SKIP() << "built without UCX";
  LocalJobOptions o;
  o.job = testing::Job(testing::TinyQwen2(2, true), "fsdp=2", "dp=1,tp=2,pp=1", "sglang", 16 << 10);
  o.job.transport = "ucx";
  o.job.timeout = Millis(20000);
  o.mode = LocalJobOptions::Mode::kProcesses;
  o.exe = SHARDSYNC_CLI_PATH;
  o.job_timeout = Millis(50000);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  for (bool emulate : {false, true}) {
    SCOPED_TRACE(emulate ? "emulated nodes" : "one host");
    o.emulate_nodes = emulate;
    o.job.prefix = emulate ? "ss/nodes/" : "ss/host/";
    auto r = RunLocalJob(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_TRUE(r->ok()) << r->FirstError();
    for (const RankResult& rr : r->ranks) {
      EXPECT_EQ(rr.host_id, emulate ? std::string(host) + "/node" + std::to_string(rr.rank)
                                    : std::string(host));
      if (!rr.is_trainer) {
        EXPECT_EQ(rr.element_mismatches, 0);
      }
    }
  }
}

// TCP listeners ("addr:port" in /proc/net/tcp{,6} hex) of the processes whose parent is this one.
std::set<std::string> ChildListeners(int* children) {
  std::set<std::string> inodes;
  *children = 0;
  for (const auto& p : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = p.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(p.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream f(line.substr(close + 2));
    std::string state;
    long ppid = 0;
    f >> state >> ppid;
    if (ppid != getpid()) continue;
    ++*children;
    std::error_code ec;
    for (const auto& fd : std::filesystem::directory_iterator(p.path() / "fd", ec)) {
      const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
      if (!ec && target.rfind("socket:[", 0) == 0) {
        inodes.insert(target.substr(8, target.size() - 9));
      }
    }
  }
  std::set<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
      f >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode)) out.insert(local);
    }
  }
  return out;
}

bool IsLoopback(const std::string& hex_addr) {
  const std::string addr = hex_addr.substr(0, hex_addr.find(':'));
  if (addr.size() == 8) return addr.substr(6) == "7F";  // 127.x.x.x, little-endian
  return addr == "00000000000000000000000001000000" ||  // ::1
         (addr.rfind("0000000000000000FFFF0000", 0) == 0 && addr.substr(30) == "7F");
}

// Issue 26: UCX ranks of a local job listened on the routable interface, which the store token
// does not cover. The launcher's ranks now listen on loopback only: looked at while every rank is
// connected and syncing.
TEST(LocalLauncher, LocalUcxJobListensOnLoopbackOnly) {
  if (DefaultTransport() != "ucx") GTEST_SKIP() << "built without UCX";
  LocalJobOptions o;
  o.job = testing::Job(testing::TinyQwen2(2, true), "fsdp=2", "dp=1,tp=2,pp=1", "sglang", 16 << 10);
  o.job.transport = "ucx";
  o.job.syncs = 100000;  // runs until the check below is done, then a rank is killed
  o.job.timeout = Millis(20000);
  o.mode = LocalJobOptions::Mode::kProcesses;
  o.exe = SHARDSYNC_CLI_PATH;
  o.job_timeout = Millis(45000);
  const int world = 4;
  std::set<std::string> listeners;
  int children = 0;
  bool checked = false;
  o.on_progress = [&](int done, int) {
    if (checked || done < world * 2 + world * 3) return;  // connected, three syncs in
    listeners = ChildListeners(&children);
    checked = true;
  };
  o.kill_rank = 0;
  o.kill_at_progress = world * 2 + world * 6;
  auto r = RunLocalJob(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(checked) << r->FirstError();
  EXPECT_EQ(children, world);
  std::printf("%d rank processes listen on %zu TCP sockets\n", children, listeners.size());
  for (const std::string& l : listeners) EXPECT_TRUE(IsLoopback(l)) << "listening on " << l;
}

}  // namespace
}  // namespace shardsync
