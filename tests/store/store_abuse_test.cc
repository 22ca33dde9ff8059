// Issue 26: the store under abuse, served by a child process so each test can cap its
// descriptors or memory and measure its CPU time and log apart from the test's own.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shardsync/store.h"
#include "store/forked_store.h"
#include "store/frame.h"

namespace shardsync {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using testing::ForkedStore;
using testing::RawConnect;
using testing::StoreLimits;
constexpr const char* kToken = testing::kForkedStoreToken;

// What a job's ranks do at connect: publish an address, read every peer's, meet at a barrier.
Status Rendezvous(const std::string& address, int rank, int world) {
  SS_ASSIGN_OR_RETURN(auto c, StoreClient::Connect(address, kToken, 2000ms));
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back("job/addr/" + std::to_string(r));
  SS_RETURN_IF_ERROR(
      c->SetThenGetMany(keys[rank], "rank " + std::to_string(rank), keys, 2000ms).status());
  return c->Barrier("job/connected", world, 2000ms);
}

// The finding: with the descriptor limit below the connection cap, 200 idle
// connections put the accept loop into an EMFILE busy loop (82 % of a core, 82 MB of log in
// 14 s) and the job's ranks could not connect.
TEST(StoreAbuse, IdleFloodUnderALowDescriptorLimitLeavesTheStoreServing) {
  rlimit own{};
  getrlimit(RLIMIT_NOFILE, &own);
  if (own.rlim_cur < 512) {
    if (own.rlim_max < 512) GTEST_SKIP() << "needs 512 descriptors in the test process";
    rlimit r{std::min<rlim_t>(own.rlim_max, 4096), own.rlim_max};
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &r), 0);
  }
  // ulimit -n 128, and the rest of the process holding all but 20 of them: accept() hits EMFILE.
  ForkedStore store({.nofile = 128, .free_fds = 20});
  ASSERT_TRUE(store.ok());
  const auto t0 = Clock::now();
  const double cpu0 = store.CpuSeconds();
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    const int fd = RawConnect(store.port());
    if (fd >= 0) idle.push_back(fd);
  }
  EXPECT_GE(idle.size(), 190u);
  std::this_thread::sleep_for(200ms);  // the store works through the flood

  const auto job0 = Clock::now();
  std::vector<Status> st(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back([&, r] { st[r] = Rendezvous(store.address(), r, 4); });
  }
  for (auto& t : ranks) t.join();
  const auto job_time = Clock::now() - job0;
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
  EXPECT_LT(job_time, 1000ms);

  std::this_thread::sleep_for(1000ms);  // idle sockets still open: the store must sit still
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu = store.CpuSeconds() - cpu0;
  std::printf("[idle flood] job %.0f ms; store CPU %.3f s in %.2f s; log %zu bytes\n",
              std::chrono::duration<double, std::milli>(job_time).count(), cpu, wall,
              store.LogBytes());
  EXPECT_LT(cpu / wall, 0.10) << cpu << " s of CPU in " << wall << " s";
  EXPECT_LT(store.LogBytes(), 100u * 1024) << "log of " << store.LogBytes() << " bytes";
  EXPECT_TRUE(store.Alive());
  for (int fd : idle) close(fd);
}

// Issue 26: one byte every 10 ms from a peer that never authenticates kept the store's 20 ms
// busy-poll window open, so its thread spun on a core.
TEST(StoreAbuse, UnauthenticatedBytesDoNotKeepTheStoreSpinning) {
  ForkedStore store({});
  ASSERT_TRUE(store.ok());
  const int fd = RawConnect(store.port());
  ASSERT_GE(fd, 0);
  // A hello frame that announces 4000 payload bytes, sent a byte at a time: never complete.
  std::string header = store_wire::EncodeFrame({store_wire::Op::kHello, 0, {kToken}});
  const uint32_t len = 4000;
  std::memcpy(&header[8], &len, 4);
  const double cpu0 = store.CpuSeconds();
  const auto t0 = Clock::now();
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(send(fd, &header[i % header.size()], 1, MSG_NOSIGNAL), 1);
    std::this_thread::sleep_for(10ms);
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu = store.CpuSeconds() - cpu0;
  std::printf("[byte dribble] store CPU %.3f s in %.2f s\n", cpu, wall);
  EXPECT_LT(cpu / wall, 0.10) << cpu << " s of CPU in " << wall << " s";
  close(fd);
  auto c = StoreClient::Connect(store.address(), kToken, 2000ms);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE((*c)->Set("still", "serving").ok());
}

// Issue 26: a GET_MANY naming a 4 MiB value 512 times made the store build a 2 GiB reply and
// abort on std::bad_alloc, killing every job on it. Under a 1.5 GB address-space cap it must be
// refused with an error reply, and the store must go on serving.
TEST(StoreAbuse, AmplifiedGetManyUnderAMemoryCapIsAnErrorNotACrash) {
  ForkedStore store({.as_bytes = rlim_t{1536} << 20});
  ASSERT_TRUE(store.ok());
  auto c = StoreClient::Connect(store.address(), kToken, 2000ms);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->Set("big", std::string(4 << 20, 'v')).ok());
  const std::vector<std::string> keys(512, "big");
  auto r = (*c)->GetMany(keys, 5000ms);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange) << r.status().ToString();
  EXPECT_TRUE(store.Alive());
  EXPECT_TRUE((*c)->Set("after", "1").ok());
  auto other = StoreClient::Connect(store.address(), kToken, 2000ms);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto v = (*other)->Get("after", 1000ms);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, "1");
}

// Issue 24's primitive: a process holding an ephemeral key is SIGKILLed; a rank waiting on it
// fails within a second, naming the key.
TEST(StoreAbuse, KilledOwnerFailsItsWaitersWithinASecond) {
  ForkedStore store({});
  ASSERT_TRUE(store.ok());
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t owner = fork();
  if (owner == 0) {
    close(ready[0]);
    auto c = StoreClient::Connect(store.address(), kToken, 2000ms);
    if (!c.ok() || !(*c)->SetEphemeral("job/alive/1", "sync rank 1").ok()) _exit(2);
    char b = 1;
    if (write(ready[1], &b, 1) != 1) _exit(3);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char b = 0;
  ASSERT_EQ(read(ready[0], &b, 1), 1);
  close(ready[0]);
  Status waited;
  Clock::duration took{};
  std::thread waiter([&] {
    auto c = StoreClient::Connect(store.address(), kToken, 2000ms);
    if (!c.ok()) {
      waited = c.status();
      return;
    }
    const auto t0 = Clock::now();
    waited = (*c)->GetMany({"job/addr/1", "job/alive/1"}, 10000ms).status();
    took = Clock::now() - t0;
  });
  std::this_thread::sleep_for(200ms);
  kill(owner, SIGKILL);
  waitpid(owner, nullptr, 0);
  waiter.join();
  EXPECT_EQ(waited.code(), StatusCode::kUnavailable) << waited.ToString();
  EXPECT_NE(waited.message().find("job/alive/1"), std::string::npos) << waited.ToString();
  EXPECT_LT(took, 1200ms);  // 200 ms before the kill, then well under a second
}

}  // namespace
}  // namespace shardsync
