#include <sys/wait.h>

#include <cstdio>

#include <gtest/gtest.h>

#include "shardsync/transport.h"
#include "transport/transport_conformance.h"

namespace shardsync::testing {
namespace {

std::unique_ptr<Transport> MakeUcx(UcxMode mode, bool same_host_shm = true) {
  UcxOptions o;
  o.mode = mode;
  o.same_host_shm = same_host_shm;
  o.mode_from_env = false;
  auto t = NewUcxTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

INSTANTIATE_TEST_SUITE_P(
    Ucx, TransportConformance,
    ::testing::Values(
        TransportParam{"ucx_put", [](const auto&) { return MakeUcx(UcxMode::kPut); }, true},
        TransportParam{"ucx_tag", [](const auto&) { return MakeUcx(UcxMode::kTag); }, true},
        // The multi-node path: UCX peer-failure mode and keepalive instead of the process watch.
        TransportParam{"ucx_remote_path", [](const auto&) { return MakeUcx(UcxMode::kPut, false); },
                       true},
        TransportParam{"fault_passthrough_ucx",
                       [](const auto&) -> std::unique_ptr<Transport> {
                         return NewFaultTransport(MakeUcx(UcxMode::kPut));
                       },
                       true}),
    ParamName);

TEST(Ucx, TagModeRefusesPutAndModeMismatchFailsConnect) {
  auto tag = MakeUcx(UcxMode::kTag);
  EXPECT_FALSE(tag->caps().one_sided_put);
  auto server = *StoreServer::Start("127.0.0.1", 0, "t");
  auto put = MakeUcx(UcxMode::kPut);
  Status a, b;
  std::thread th([&] {
    auto c = *StoreClient::Connect(server->address(), "t", 1000ms);
    b = put->Connect(*c, "m", 1, {0}, 3000ms);
  });
  auto c = *StoreClient::Connect(server->address(), "t", 1000ms);
  a = tag->Connect(*c, "m", 0, {1}, 3000ms);
  th.join();
  EXPECT_EQ(a.code(), StatusCode::kFailedPrecondition) << a.ToString();
  EXPECT_NE(a.message().find("SHARDSYNC_UCX_MODE"), std::string::npos);
  EXPECT_EQ(tag->PostPut(1, "x", 1, 0, 0).status().code(), StatusCode::kFailedPrecondition);
}

TEST(Ucx, ModeFromEnvironmentValidated) {
  setenv("SHARDSYNC_UCX_MODE", "bogus", 1);
  auto t = NewUcxTransport();
  unsetenv("SHARDSYNC_UCX_MODE");
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("SHARDSYNC_UCX_MODE"), std::string::npos);
}

TEST(Ucx, RegistryCreatesUcx) {
  auto names = RegisteredTransports();
  EXPECT_NE(std::find(names.begin(), names.end(), "ucx"), names.end());
  EXPECT_EQ(*SelectTransport(LocalPeerInfo(0), LocalPeerInfo(1)), "ucx");
  auto t = CreateTransport("ucx");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->name(), "ucx");
}

}  // namespace
}  // namespace shardsync::testing

namespace shardsync::testing {
namespace {

// Raw UCX bandwidth between two processes (forked receiver), 64 MiB messages. Prints GB/s;
// speed is not asserted (bench/ owns speed), only that every transfer completed and landed.
void MeasureTwoProcess(UcxMode mode, const char* label) {
  constexpr size_t kBytes = size_t{64} << 20;
  constexpr int kIters = 8;
  auto server = *StoreServer::Start("127.0.0.1", 0, kToken);
  const std::string addr = server->address();
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::vector<char> dst(kBytes, 0);
    auto t = MakeUcx(mode);
    if (!t || !t->RegisterMemory({dst.data(), dst.size()}).ok()) _exit(2);
    auto c = StoreClient::Connect(addr, kToken, 5000ms);
    if (!c.ok() || !t->Connect(**c, "bw", 1, {0}, kTimeout).ok()) _exit(3);
    for (int i = 0; i < (mode == UcxMode::kTag ? kIters + 1 : 0); ++i) {
      auto id = t->PostRecv(0, 10 + i, dst.data(), dst.size());
      if (!id.ok() || !WaitXfer(*t, *id, kTimeout, "data").ok()) _exit(4);
    }
    char done = 0;
    auto id = t->PostRecv(0, 1, &done, 1);
    if (!id.ok() || !WaitXfer(*t, *id, kTimeout, "done").ok()) _exit(5);
    // The last byte of the last transfer must have landed.
    _exit(dst[kBytes - 1] == static_cast<char>(kIters) ? 0 : 6);
  }
  auto t = MakeUcx(mode);
  auto store = *StoreClient::Connect(addr, kToken, 5000ms);
  ASSERT_TRUE(t->Connect(*store, "bw", 0, {1}, kTimeout).ok());
  std::vector<char> src(kBytes, 0);
  auto one = [&](int i) -> Status {
    src[kBytes - 1] = static_cast<char>(i);
    if (mode == UcxMode::kPut) {
      SS_ASSIGN_OR_RETURN(XferId p, t->PostPut(1, src.data(), kBytes, 0, 0));
      SS_ASSIGN_OR_RETURN(XferId f, t->PostFlush(1));
      return WaitAllXfers(*t, {p, f}, kTimeout, "put");
    }
    SS_ASSIGN_OR_RETURN(XferId s, t->PostSend(1, 10 + i, src.data(), kBytes));
    return WaitXfer(*t, s, kTimeout, "send");
  };
  ASSERT_TRUE(one(0).ok());  // warm-up: wire-up and registration caches
  auto start = std::chrono::steady_clock::now();
  for (int i = 1; i <= kIters; ++i) ASSERT_TRUE(one(i).ok());
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  char done = 1;
  ASSERT_TRUE(WaitXfer(*t, *t->PostSend(1, 1, &done, 1), kTimeout, "done").ok());
  int wst = 0;
  waitpid(pid, &wst, 0);
  EXPECT_TRUE(WIFEXITED(wst) && WEXITSTATUS(wst) == 0) << "receiver exit " << wst;
  std::printf("[ucx bandwidth] %s: %d x 64 MiB in %.3f s = %.2f GB/s\n", label, kIters, secs,
              kIters * double(kBytes) / secs / 1e9);
}

TEST(UcxBandwidth, TwoProcessPut64MiB) { MeasureTwoProcess(UcxMode::kPut, "put+flush"); }
TEST(UcxBandwidth, TwoProcessTagSend64MiB) { MeasureTwoProcess(UcxMode::kTag, "tag send"); }

}  // namespace
}  // namespace shardsync::testing
