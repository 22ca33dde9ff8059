#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "shardsync/transport.h"
#include "transport/transport_conformance.h"

namespace shardsync::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(
    Loopback, TransportConformance,
    ::testing::Values(TransportParam{"loopback",
                                     [](const auto& hub) { return NewLoopbackTransport(hub); }},
                      TransportParam{"fault_passthrough_loopback",
                                     [](const auto& hub) -> std::unique_ptr<Transport> {
                                       return NewFaultTransport(NewLoopbackTransport(hub));
                                     }}),
    ParamName);

// Two loopback ranks connected directly through the hub (no store).
struct Pair {
  std::shared_ptr<LoopbackHub> hub = NewLoopbackHub();
  std::unique_ptr<Transport> a = NewLoopbackTransport(hub);
  std::unique_ptr<Transport> b = NewLoopbackTransport(hub);
  void Connect() {
    std::thread t([&] { ASSERT_TRUE(ConnectLoopbackDirect(*b, 1, {0}, 5000ms).ok()); });
    ASSERT_TRUE(ConnectLoopbackDirect(*a, 0, {1}, 5000ms).ok());
    t.join();
  }
};

TEST(Loopback, DirectConnectPutAndSend) {
  Pair p;
  std::vector<char> dst(16, 0);
  ASSERT_EQ(*p.b->RegisterMemory({dst.data(), dst.size()}), 0u);
  p.Connect();
  EXPECT_EQ(p.b->RegisterMemory({dst.data(), 1}).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(WaitXfer(*p.a, *p.a->PostPut(1, "hello", 5, 0, 3), 1000ms, "put").ok());
  EXPECT_EQ(std::string(dst.data() + 3, 5), "hello");
  // Send before the receive is posted: buffered, then matched.
  ASSERT_TRUE(WaitXfer(*p.a, *p.a->PostSend(1, 4, "xy", 2), 1000ms, "send").ok());
  char got[2] = {};
  ASSERT_TRUE(WaitXfer(*p.b, *p.b->PostRecv(0, 4, got, 2), 1000ms, "recv").ok());
  EXPECT_EQ(std::string(got, 2), "xy");
  EXPECT_EQ(p.a->Poll(12345).status().code(), StatusCode::kInvalidArgument);
}

TEST(Loopback, DuplicateRankAndForeignTransportRefused) {
  Pair p;
  p.Connect();
  auto c = NewLoopbackTransport(p.hub);
  EXPECT_EQ(ConnectLoopbackDirect(*c, 0, {1}, 100ms).code(), StatusCode::kInvalidArgument);
  auto f = NewFaultTransport(NewLoopbackTransport(p.hub));
  EXPECT_EQ(ConnectLoopbackDirect(*f, 2, {0}, 100ms).code(), StatusCode::kInvalidArgument);
}

TEST(Loopback, StoreConnectDetectsDifferentHubs) {
  auto server = *StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
  auto a = NewLoopbackTransport(NewLoopbackHub());
  auto b = NewLoopbackTransport(NewLoopbackHub());
  Status sa, sb;
  std::thread t([&] {
    auto c = *StoreClient::Connect(server->address(), "test-token-0123456789", 1000ms);
    sb = b->Connect(*c, "p", 1, {0}, 2000ms);
  });
  auto c = *StoreClient::Connect(server->address(), "test-token-0123456789", 1000ms);
  sa = a->Connect(*c, "p", 0, {1}, 2000ms);
  t.join();
  EXPECT_EQ(sa.code(), StatusCode::kFailedPrecondition) << sa.ToString();
  EXPECT_NE(sa.message().find("different hub"), std::string::npos);
}

// A fault wrapper over rank 0 of a loopback pair (connected before wrapping).
struct FaultPair {
  std::shared_ptr<LoopbackHub> hub = NewLoopbackHub();
  std::unique_ptr<FaultTransport> a;
  std::unique_ptr<Transport> b = NewLoopbackTransport(hub);
  std::vector<char> dst = std::vector<char>(64, 0);
  explicit FaultPair(FaultConfig cfg) {
    auto inner = NewLoopbackTransport(hub);
    EXPECT_TRUE(b->RegisterMemory({dst.data(), dst.size()}).ok());
    std::thread t([&] { ASSERT_TRUE(ConnectLoopbackDirect(*b, 1, {0}, 5000ms).ok()); });
    EXPECT_TRUE(ConnectLoopbackDirect(*inner, 0, {1}, 5000ms).ok());
    t.join();
    a = NewFaultTransport(std::move(inner), cfg);
  }
};

TEST(Fault, FailsTheNthPost) {
  FaultConfig cfg;
  cfg.fail_post = 2;
  cfg.fail_code = StatusCode::kInternal;
  FaultPair p(cfg);
  char x = 1;
  EXPECT_TRUE(p.a->PostPut(1, &x, 1, 0, 0).ok());
  auto second = p.a->PostPut(1, &x, 1, 0, 1);
  EXPECT_EQ(second.status().code(), StatusCode::kInternal);
  EXPECT_NE(second.status().message().find("#2"), std::string::npos);
  EXPECT_TRUE(p.a->PostPut(1, &x, 1, 0, 2).ok());
  EXPECT_EQ(p.a->counters().failed, 1);
}

TEST(Fault, DroppedCompletionTimesOut) {
  FaultConfig cfg;
  cfg.drop_completion = 1;
  FaultPair p(cfg);
  char x = 1;
  auto id = p.a->PostPut(1, &x, 1, 0, 0);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(WaitXfer(*p.a, *id, 100ms, "dropped put").code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(WaitXfer(*p.a, *p.a->PostFlush(1), 1000ms, "flush").ok());
  EXPECT_EQ(p.a->counters().dropped, 1);
}

TEST(Fault, DelayedCompletionStillCompletes) {
  FaultConfig cfg;
  cfg.completion_delay = 50ms;
  FaultPair p(cfg);
  char x = 1;
  auto id = p.a->PostPut(1, &x, 1, 0, 0);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(*p.a->Poll(*id), XferState::kInProgress);
  EXPECT_EQ(WaitXfer(*p.a, *id, 10ms, "early").code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(WaitXfer(*p.a, *id, 5000ms, "late").ok());
}

TEST(Fault, CorruptsOneByteOfACopy) {
  FaultConfig cfg;
  cfg.corrupt_data_post = 2;
  cfg.corrupt_byte = 3;
  FaultPair p(cfg);
  std::string msg = "abcdefgh";
  ASSERT_TRUE(WaitXfer(*p.a, *p.a->PostFlush(1), 1000ms, "flush").ok());  // not a data post
  ASSERT_TRUE(WaitXfer(*p.a, *p.a->PostPut(1, msg.data(), 8, 0, 0), 1000ms, "put1").ok());
  EXPECT_EQ(std::string(p.dst.data(), 8), msg);
  ASSERT_TRUE(WaitXfer(*p.a, *p.a->PostPut(1, msg.data(), 8, 0, 8), 1000ms, "put2").ok());
  std::string want = msg;
  want[3] ^= static_cast<char>(0xFF);
  EXPECT_EQ(std::string(p.dst.data() + 8, 8), want);
  EXPECT_EQ(msg, "abcdefgh");  // the caller's buffer is untouched
  // A send is corrupted the same way when it is the chosen data post.
  p.a->set_config(FaultConfig{.corrupt_data_post = 3, .corrupt_byte = 100});
  ASSERT_TRUE(WaitXfer(*p.a, *p.a->PostSend(1, 1, msg.data(), 8), 1000ms, "send").ok());
  char got[8];
  ASSERT_TRUE(WaitXfer(*p.b, *p.b->PostRecv(0, 1, got, 8), 1000ms, "recv").ok());
  want = msg;
  want[7] ^= static_cast<char>(0xFF);  // index clamped to the last byte
  EXPECT_EQ(std::string(got, 8), want);
  EXPECT_EQ(p.a->counters().corrupted, 2);
}

TEST(Fault, InjectedPeerDeath) {
  FaultConfig cfg;
  cfg.die_after_posts = 1;
  FaultPair p(cfg);
  char x = 1;
  auto id = p.a->PostPut(1, &x, 1, 0, 0);
  ASSERT_TRUE(id.ok());
  EXPECT_TRUE(WaitXfer(*p.a, *id, 1000ms, "first").ok());
  EXPECT_EQ(p.a->PostPut(1, &x, 1, 0, 0).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(p.a->Poll(*id).status().code(), StatusCode::kUnavailable);
}

TEST(Registry, BuiltinsAndSelection) {
  auto names = RegisteredTransports();
  EXPECT_NE(std::find(names.begin(), names.end(), "loopback"), names.end());
  PeerInfo a = LocalPeerInfo(0), b = LocalPeerInfo(1);
  EXPECT_FALSE(a.hostname.empty());
  // Loopback is never picked automatically, only by hint.
  auto hinted = SelectTransport(a, b, "loopback");
  ASSERT_TRUE(hinted.ok()) << hinted.status().ToString();
  EXPECT_EQ(*hinted, "loopback");
  EXPECT_EQ(SelectTransport(a, b, "nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(CreateTransport("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(CreateTransport("loopback").status().code(), StatusCode::kInvalidArgument);
  TransportOptions o;
  o.loopback_hub = NewLoopbackHub();
  auto t = CreateTransport("loopback", o);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->name(), "loopback");
}

TEST(Registry, RegisteredTransportWinsByPriority) {
  TransportEntry e;
  e.name = "test_gpu_first";
  e.priority = 1;
  // Only peers on a made-up host: the registry is process-wide, and a stand-in that fit every
  // GPU pair would take over the routed-transport tests run later in this binary.
  e.can_connect = [](const PeerInfo& s, const PeerInfo& p) {
    return s.device >= 0 && p.device >= 0 && s.hostname == "registry-test" &&
           p.hostname == "registry-test";
  };
  e.factory = [](const TransportOptions&) -> Result<std::unique_ptr<Transport>> {
    return UnimplementedError("test transport");
  };
  ASSERT_TRUE(RegisterTransport(e).ok());
  EXPECT_EQ(RegisterTransport(e).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RegisteredTransports().front(), "test_gpu_first");
  PeerInfo g0 = LocalPeerInfo(0, MemKind::kCuda, 0), g1 = LocalPeerInfo(1, MemKind::kCuda, 1);
  g0.hostname = g1.hostname = "registry-test";
  EXPECT_EQ(*SelectTransport(g0, g1), "test_gpu_first");
  PeerInfo h0 = LocalPeerInfo(0), h1 = LocalPeerInfo(1);
  auto host = SelectTransport(h0, h1);
  if (host.ok()) {
    EXPECT_NE(*host, "test_gpu_first");
  } else {
    EXPECT_NE(host.status().message().find("rank 0"), std::string::npos);
  }
}

}  // namespace
}  // namespace shardsync::testing
