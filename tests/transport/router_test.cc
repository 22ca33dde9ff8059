// The routed transport: each pair served by the transport its two PeerInfos choose (the same on
// both sides), the hint first where it can connect the pair, dispatch by peer, region ids that
// agree across sub-transports, and clear errors for a bad hint or a malformed peer record.
// Stand-ins "near" (same GPU) and "far" (other GPUs) are loopback transports on hubs of their own.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <thread>

#include "shardsync/store.h"
#include "shardsync/transport.h"

namespace shardsync {
namespace {

using ::testing::HasSubstr;

void RegisterStandIns() {
  static const bool once = [] {
    for (const char* name : {"test_near", "test_far"}) {
      auto hub = NewLoopbackHub();
      const bool near = std::string(name) == "test_near";
      TransportEntry e;
      e.name = name;
      e.priority = near ? 60 : 70;
      e.can_connect = [near](const PeerInfo& a, const PeerInfo& b) {
        return a.mem == MemKind::kCuda && b.mem == MemKind::kCuda && SameGpu(a, b) == near;
      };
      e.factory = [hub](const TransportOptions&) -> Result<std::unique_ptr<Transport>> {
        return NewLoopbackTransport(hub);
      };
      EXPECT_TRUE(RegisterTransport(std::move(e)).ok());
    }
    return true;
  }();
  (void)once;
}

PeerInfo OnGpu(int rank, const std::string& gpu) {
  PeerInfo p = LocalPeerInfo(rank, MemKind::kCuda, 0);  // same index, different physical GPUs
  p.gpu_id = gpu;
  return p;
}

struct Ranks {
  std::unique_ptr<StoreServer> server =
      std::move(StoreServer::Start("127.0.0.1", 0, "test-token-0123456789")).value();
  std::vector<std::unique_ptr<StoreClient>> stores;
  std::vector<std::unique_ptr<Transport>> tx;

  // Connects every rank to every other, rank r as `infos[r]`, all with `hint`.
  std::vector<Status> Connect(const std::vector<PeerInfo>& infos, const std::string& hint,
                              const std::string& prefix) {
    const int n = static_cast<int>(infos.size());
    std::vector<Status> st(n);
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r) {
      stores.push_back(
          std::move(StoreClient::Connect(server->address(), "test-token-0123456789", Millis(5000)))
              .value());
      tx.push_back(std::move(NewRoutedTransport({infos[r], hint, {}})).value());
    }
    for (int r = 0; r < n; ++r) {
      ts.emplace_back([&, r] {
        std::vector<int> peers;
        for (int p = 0; p < n; ++p) {
          if (p != r) peers.push_back(p);
        }
        static uint64_t region_bytes[4];
        auto id = tx[r]->RegisterMemory({region_bytes, sizeof(region_bytes), MemKind::kHost, -1});
        st[r] = id.ok() ? tx[r]->Connect(*stores[r], prefix, r, peers, Millis(3000)) : id.status();
      });
    }
    for (auto& t : ts) t.join();
    return st;
  }
};

TEST(RoutedTransport, EachPairTakesTheTransportThatFitsIt) {
  RegisterStandIns();
  Ranks k;
  // Ranks 0 and 1 share a GPU; rank 2 is on another.
  auto st = k.Connect({OnGpu(0, "A"), OnGpu(1, "A"), OnGpu(2, "B")}, "", "auto/");
  for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(k.tx[0]->PeerTransport(1), "test_near");
  EXPECT_EQ(k.tx[1]->PeerTransport(0), "test_near");
  EXPECT_EQ(k.tx[0]->PeerTransport(2), "test_far");
  EXPECT_EQ(k.tx[2]->PeerTransport(1), "test_far");
  EXPECT_EQ(k.tx[0]->PeerTransport(7), "none");
  // Messages dispatch by peer.
  uint64_t out = 42, in = 0;
  auto s = k.tx[0]->PostSend(2, 5, &out, sizeof(out));
  auto r = k.tx[2]->PostRecv(0, 5, &in, sizeof(in));
  ASSERT_TRUE(s.ok() && r.ok());
  ASSERT_TRUE(WaitXfer(*k.tx[2], *r, Millis(2000), "recv").ok());
  ASSERT_TRUE(WaitXfer(*k.tx[0], *s, Millis(2000), "send").ok());
  EXPECT_EQ(in, 42u);
  EXPECT_FALSE(k.tx[0]->PostSend(9, 5, &out, sizeof(out)).ok());
}

TEST(RoutedTransport, HintWinsWhereItCanConnectTheOthersFallBack) {
  RegisterStandIns();
  Ranks k;
  auto st = k.Connect({OnGpu(0, "A"), OnGpu(1, "A"), OnGpu(2, "B")}, "test_far", "hint/");
  for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(k.tx[0]->PeerTransport(2), "test_far");
  EXPECT_EQ(k.tx[0]->PeerTransport(1), "test_near");  // "far" cannot put two ranks on one GPU
}

TEST(RoutedTransport, SameGpuComparesThePhysicalGpuWhenKnown) {
  PeerInfo a = OnGpu(0, "0000:18:00.0"), b = OnGpu(1, "0000:18:00.0");
  b.device = 3;  // another CUDA_VISIBLE_DEVICES numbering, same GPU
  EXPECT_TRUE(SameGpu(a, b));
  b.gpu_id = "0000:2a:00.0";
  b.device = 0;
  EXPECT_FALSE(SameGpu(a, b));
  b.gpu_id.clear();  // unknown: fall back to the index
  EXPECT_TRUE(SameGpu(a, b));
  EXPECT_FALSE(SameGpu(a, LocalPeerInfo(1)));  // host memory is on no GPU
}

TEST(RoutedTransport, UnknownHintIsRefusedByName) {
  Ranks k;
  auto st = k.Connect({LocalPeerInfo(0), LocalPeerInfo(1)}, "warp_drive", "bad/");
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("'warp_drive' is not registered"));
  }
}

TEST(RoutedTransport, MalformedPeerRecordIsDataLossNamingThePeer) {
  auto server = std::move(StoreServer::Start("127.0.0.1", 0, "test-token-0123456789")).value();
  auto store =
      std::move(StoreClient::Connect(server->address(), "test-token-0123456789", Millis(5000)))
          .value();
  ASSERT_TRUE(store->Set("m/route/1", "1\thost\tquantum\t0\t").ok());
  auto tx = std::move(NewRoutedTransport({LocalPeerInfo(0), "", {}})).value();
  Status s = tx->Connect(*store, "m/", 0, {1}, Millis(1000));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("rank 1"));
}

TEST(RoutedTransport, MissingPeerTimesOutNamingIt) {
  auto server = std::move(StoreServer::Start("127.0.0.1", 0, "test-token-0123456789")).value();
  auto store =
      std::move(StoreClient::Connect(server->address(), "test-token-0123456789", Millis(5000)))
          .value();
  auto tx = std::move(NewRoutedTransport({LocalPeerInfo(0), "", {}})).value();
  Status s = tx->Connect(*store, "t/", 0, {3}, Millis(200));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("from rank 3"));
}

// SHARDSYNC_HOST_ID set for a scope (restored after, so a failed ASSERT leaves no node behind).
class HostIdGuard {
 public:
  explicit HostIdGuard(const char* id) {
    if (const char* old = std::getenv("SHARDSYNC_HOST_ID")) old_ = old;
    Set(id);
  }
  ~HostIdGuard() { Set(old_ ? old_->c_str() : nullptr); }
  static void Set(const char* id) {
    if (id) {
      setenv("SHARDSYNC_HOST_ID", id, 1);
    } else {
      unsetenv("SHARDSYNC_HOST_ID");
    }
  }

 private:
  std::optional<std::string> old_;
};

// Ranks on one machine with different host ids (`--emulate-nodes`) are different nodes to the
// router: host memory takes ucx between them where it took shm, and two ranks on one GPU are not
// the same GPU (the far transport, nccl in the product, where the near one, cuda_ipc, served).
TEST(RoutedTransport, HostIdentityMakesRanksOfOneMachineDifferentNodes) {
  RegisterStandIns();
  const auto names = RegisteredTransports();
  const bool ucx = std::find(names.begin(), names.end(), "ucx") != names.end();
  PeerInfo h0, h1, g0, g1;
  {
    HostIdGuard none(nullptr);
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    EXPECT_EQ(HostIdentity(), host);
    h0 = LocalPeerInfo(0);
    h1 = LocalPeerInfo(1);
  }
  PeerInfo e0, e1;
  {
    HostIdGuard node("box/node0");
    e0 = LocalPeerInfo(0);
    g0 = OnGpu(0, "0000:18:00.0");
  }
  {
    HostIdGuard node("box/node1");
    e1 = LocalPeerInfo(1);
    g1 = OnGpu(1, "0000:18:00.0");
  }
  EXPECT_EQ(e0.hostname, "box/node0");
  EXPECT_EQ(e1.hostname, "box/node1");
  EXPECT_EQ(*SelectTransport(h0, h1), "shm");
  auto across = SelectTransport(e0, e1);
  if (ucx) {
    EXPECT_EQ(*across, "ucx");
  } else {
    EXPECT_EQ(across.status().code(), StatusCode::kNotFound);
  }
  EXPECT_FALSE(SelectTransport(e0, e1, "shm").ok());  // shm cannot connect two nodes
  EXPECT_FALSE(SameGpu(g0, g1));
  g1.hostname = g0.hostname;
  EXPECT_TRUE(SameGpu(g0, g1));
  g1.hostname = "box/node1";

  // Connected through the router: the same choices on both sides.
  Ranks same;
  auto st = same.Connect({h0, h1}, "", "host-same/");
  for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(same.tx[0]->PeerTransport(1), "shm");
  EXPECT_EQ(same.tx[1]->PeerTransport(0), "shm");
  if (ucx) {
    Ranks nodes;
    st = nodes.Connect({e0, e1}, "", "host-nodes/");
    for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(nodes.tx[0]->PeerTransport(1), "ucx");
    EXPECT_EQ(nodes.tx[1]->PeerTransport(0), "ucx");
    // The hint shm cannot connect the pair: it falls back to the automatic choice.
    Ranks hinted;
    st = hinted.Connect({e0, e1}, "shm", "host-hinted/");
    for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(hinted.tx[0]->PeerTransport(1), "ucx");
  }
  Ranks gpus;
  st = gpus.Connect({g0, g1}, "", "gpu-nodes/");
  for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(gpus.tx[0]->PeerTransport(1), "test_far");
  EXPECT_EQ(gpus.tx[1]->PeerTransport(0), "test_far");
}

TEST(RoutedTransport, HostIdentityTheRecordCannotCarryIsRefused) {
  PeerInfo bad = LocalPeerInfo(0);
  bad.hostname = "box\tnode0";
  auto server = std::move(StoreServer::Start("127.0.0.1", 0, "test-token-0123456789")).value();
  auto store =
      std::move(StoreClient::Connect(server->address(), "test-token-0123456789", Millis(5000)))
          .value();
  auto tx = std::move(NewRoutedTransport({bad, "", {}})).value();
  Status s = tx->Connect(*store, "tab/", 0, {1}, Millis(1000));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("SHARDSYNC_HOST_ID"));
}

}  // namespace
}  // namespace shardsync
