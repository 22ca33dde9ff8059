// cuda_ipc and nccl transports. In-process: two transports in two threads behind one store (the
// IPC transport maps a same-process peer directly; the multi-process path with real IPC handles is
// exercised by scripts/device_gpu_tests.sh through `shardsync bench --device cuda`). NCCL needs two
// GPUs.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "gpu_test_util.h"
#include "shardsync/gpu.h"
#include "shardsync/store.h"
#include "shardsync/transport.h"

namespace shardsync::gpu {
namespace {

struct StoreFixture {
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<StoreClient> Client() {
    auto c = StoreClient::Connect(server->address(), "test-token-0123456789", Millis(10000));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
};

StoreFixture StartStore() {
  StoreFixture f;
  auto s = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (s.ok()) f.server = std::move(s).value();
  return f;
}

TEST(CudaIpcTransport, PutFlushAndControlMessages) {
  SS_REQUIRE_GPU();
  StoreFixture store = StartStore();
  ASSERT_TRUE(store.server);
  auto sender = MakeCudaIpcTransport(0);
  auto receiver = MakeCudaIpcTransport(0);
  ASSERT_TRUE(sender && receiver);
  EXPECT_TRUE(sender->caps().one_sided_put);
  PeerInfo a{0, "h", MemKind::kCuda, 0, ""}, b{1, "h", MemKind::kCuda, 0, ""},
      c{1, "other", MemKind::kCuda, 0, ""};
  EXPECT_TRUE(sender->CanConnect(a, b));
  EXPECT_FALSE(sender->CanConnect(a, c));

  const size_t kBytes = (1 << 20) + 13;
  SS_ASSERT_OK_AND_ASSIGN(auto dst, DeviceBuffer::Allocate(2 * kBytes, 0));
  SS_ASSERT_OK(Memset(dst->data(), 0, 2 * kBytes));
  // Region 1 starts inside the allocation: the export must carry its offset.
  MemRegion r1{static_cast<unsigned char*>(dst->data()) + kBytes, kBytes, MemKind::kCuda, 0};
  SS_ASSERT_OK_AND_ASSIGN(uint32_t id0, receiver->RegisterMemory(dst->region()));
  SS_ASSERT_OK_AND_ASSIGN(uint32_t id1, receiver->RegisterMemory(r1));
  EXPECT_EQ(id0, 0u);
  EXPECT_EQ(id1, 1u);
  EXPECT_EQ(receiver->RegisterMemory({nullptr, 8, MemKind::kHost, -1}).status().code(),
            StatusCode::kInvalidArgument);

  auto cs = store.Client();
  auto cr = store.Client();
  Status ss, sr;
  std::thread t1([&] { ss = sender->Connect(*cs, "t/", 0, {1}, Millis(10000)); });
  std::thread t2([&] { sr = receiver->Connect(*cr, "t/", 1, {0}, Millis(10000)); });
  t1.join();
  t2.join();
  SS_ASSERT_OK(ss);
  SS_ASSERT_OK(sr);

  std::vector<unsigned char> host(kBytes);
  for (size_t i = 0; i < kBytes; ++i) host[i] = static_cast<unsigned char>(i * 7 + 1);
  SS_ASSERT_OK_AND_ASSIGN(auto src, DeviceBuffer::Allocate(kBytes, 0));
  SS_ASSERT_OK(CopyToDevice(src->data(), host.data(), kBytes));
  SS_ASSERT_OK_AND_ASSIGN(XferId put, sender->PostPut(1, src->data(), kBytes - 100, 1, 100));
  SS_ASSERT_OK_AND_ASSIGN(XferId flush, sender->PostFlush(1));
  SS_ASSERT_OK(WaitXfer(*sender, put, Millis(10000), "put"));
  SS_ASSERT_OK(WaitXfer(*sender, flush, Millis(10000), "flush"));
  std::vector<unsigned char> got(kBytes);
  SS_ASSERT_OK(CopyToHost(got.data(), r1.base, kBytes));
  EXPECT_TRUE(std::all_of(got.begin(), got.begin() + 100, [](unsigned char v) { return v == 0; }));
  EXPECT_EQ(std::memcmp(got.data() + 100, host.data(), kBytes - 100), 0);
  // Remote pointer for kernels writing straight into the peer, bounds-checked.
  SS_ASSERT_OK_AND_ASSIGN(void* rp, CudaIpcRemotePointer(*sender, 1, 1, 8, 16));
  EXPECT_EQ(rp, static_cast<unsigned char*>(r1.base) + 8);
  EXPECT_EQ(CudaIpcRemotePointer(*sender, 1, 1, kBytes - 4, 8).status().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(sender->PostPut(1, src->data(), 16, 7, 0).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(sender->PostPut(5, src->data(), 16, 0, 0).status().code(),
            StatusCode::kInvalidArgument);

  // Control messages: out of tag order, matched by tag; a device buffer works too.
  uint64_t a_val = 41, b_val = 42, ra = 0, rb = 0;
  SS_ASSERT_OK_AND_ASSIGN(XferId sa, sender->PostSend(1, 7, &a_val, 8));
  SS_ASSERT_OK_AND_ASSIGN(XferId sb, sender->PostSend(1, 9, &b_val, 8));
  SS_ASSERT_OK_AND_ASSIGN(XferId rvb, receiver->PostRecv(0, 9, &rb, 8));
  SS_ASSERT_OK_AND_ASSIGN(XferId rva, receiver->PostRecv(0, 7, &ra, 8));
  SS_ASSERT_OK(WaitAllXfers(*sender, {sa, sb}, Millis(10000), "send"));
  SS_ASSERT_OK(WaitAllXfers(*receiver, {rvb, rva}, Millis(10000), "recv"));
  EXPECT_EQ(ra, 41u);
  EXPECT_EQ(rb, 42u);
  EXPECT_EQ(sender->PostSend(1, 1, host.data(), 1 << 20).status().code(),
            StatusCode::kInvalidArgument);

  // Peer abort: a pending receive fails (Unavailable), not hangs; the aborted side fails fast.
  SS_ASSERT_OK_AND_ASSIGN(XferId pending, receiver->PostRecv(0, 99, &ra, 8));
  sender->Abort();
  const Status dead = WaitXfer(*receiver, pending, Millis(5000), "recv from aborted peer");
  EXPECT_EQ(dead.code(), StatusCode::kUnavailable) << dead.ToString();
  EXPECT_EQ(sender->PostFlush(1).status().code(), StatusCode::kAborted);
}

TEST(CudaIpcTransport, ConnectTimesOutWithoutPeer) {
  SS_REQUIRE_GPU();
  StoreFixture store = StartStore();
  ASSERT_TRUE(store.server);
  auto t = MakeCudaIpcTransport(0);
  auto c = store.Client();
  const auto start = std::chrono::steady_clock::now();
  const Status s = t->Connect(*c, "lonely/", 0, {1}, Millis(300));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("peer rank 1"), std::string::npos) << s.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(NcclTransport, TwoGpusSendRecvAndDeadPeer) {
  SS_REQUIRE_GPUS(2);
  auto v = NcclVersion();
  if (!v.ok()) GTEST_SKIP() << "GPU test skipped: " << v.status().ToString();
  StoreFixture store = StartStore();
  ASSERT_TRUE(store.server);
  std::unique_ptr<Transport> t[2] = {MakeNcclTransport({0}), MakeNcclTransport({1})};
  EXPECT_FALSE(t[0]->caps().one_sided_put);
  PeerInfo g0{0, "h", MemKind::kCuda, 0, ""}, g1{1, "h", MemKind::kCuda, 1, ""};
  EXPECT_TRUE(t[0]->CanConnect(g0, g1));
  EXPECT_FALSE(t[0]->CanConnect(g0, g0));  // NCCL refuses two ranks on one GPU
  auto c0 = store.Client();
  auto c1 = store.Client();
  Status s0, s1;
  std::thread a([&] { s0 = t[0]->Connect(*c0, "n/", 0, {1}, Millis(60000)); });
  std::thread b([&] { s1 = t[1]->Connect(*c1, "n/", 1, {0}, Millis(60000)); });
  a.join();
  b.join();
  SS_ASSERT_OK(s0);
  SS_ASSERT_OK(s1);

  const size_t kBytes = (8 << 20) + 6;
  std::vector<unsigned char> host(kBytes);
  for (size_t i = 0; i < kBytes; ++i) host[i] = static_cast<unsigned char>(i * 13 + 5);
  SS_ASSERT_OK(SetDevice(0));
  SS_ASSERT_OK_AND_ASSIGN(auto src, DeviceBuffer::Allocate(kBytes, 0));
  SS_ASSERT_OK(CopyToDevice(src->data(), host.data(), kBytes));
  SS_ASSERT_OK_AND_ASSIGN(auto dst, DeviceBuffer::Allocate(kBytes, 1));
  SS_ASSERT_OK(SetDevice(1));
  SS_ASSERT_OK(Memset(dst->data(), 0, kBytes));
  // Data (device) and a control message (host, bounced) in one group each side.
  uint64_t ctl = 0xFEEDull, ctl_in = 0;
  Status r0, r1;
  std::thread ta([&] {
    SetDevice(0).IgnoreError();
    auto x = t[0]->PostSend(1, 0, src->data(), kBytes);
    auto y = t[0]->PostSend(1, 1, &ctl, 8);
    r0 = x.ok() && y.ok() ? WaitAllXfers(*t[0], {*x, *y}, Millis(30000), "send")
                          : (x.ok() ? y.status() : x.status());
  });
  std::thread tb([&] {
    SetDevice(1).IgnoreError();
    auto x = t[1]->PostRecv(0, 0, dst->data(), kBytes);
    auto y = t[1]->PostRecv(0, 1, &ctl_in, 8);
    r1 = x.ok() && y.ok() ? WaitAllXfers(*t[1], {*x, *y}, Millis(30000), "recv")
                          : (x.ok() ? y.status() : x.status());
  });
  ta.join();
  tb.join();
  SS_ASSERT_OK(r0);
  SS_ASSERT_OK(r1);
  std::vector<unsigned char> got(kBytes);
  SS_ASSERT_OK(CopyToHost(got.data(), dst->data(), kBytes));
  EXPECT_EQ(got, host);
  EXPECT_EQ(ctl_in, 0xFEEDull);
  EXPECT_EQ(t[0]->PostPut(1, src->data(), 8, 0, 0).status().code(), StatusCode::kUnimplemented);

  // Dead peer: rank 0 never sends; rank 1's receive times out, then Abort returns promptly.
  SS_ASSERT_OK_AND_ASSIGN(XferId stuck, t[1]->PostRecv(0, 2, dst->data(), kBytes));
  const auto start = std::chrono::steady_clock::now();
  const Status late = WaitXfer(*t[1], stuck, Millis(1500), "recv from silent peer");
  EXPECT_EQ(late.code(), StatusCode::kDeadlineExceeded) << late.ToString();
  t[1]->Abort();
  t[0]->Abort();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_EQ(t[1]->PostRecv(0, 3, dst->data(), 8).status().code(), StatusCode::kAborted);
}

TEST(NcclTransport, SendToSelfOnOneGpu) {
  SS_REQUIRE_GPU();
  auto v = NcclVersion();
  if (!v.ok()) GTEST_SKIP() << "GPU test skipped: " << v.status().ToString();
  StoreFixture store = StartStore();
  ASSERT_TRUE(store.server);
  auto t = MakeNcclTransport({0});
  auto c = store.Client();
  SS_ASSERT_OK(t->Connect(*c, "self/", 3, {3}, Millis(60000)));
  const size_t kBytes = (4 << 20) + 2;
  std::vector<unsigned char> host(kBytes);
  for (size_t i = 0; i < kBytes; ++i) host[i] = static_cast<unsigned char>(i * 31 + 3);
  SS_ASSERT_OK_AND_ASSIGN(auto src, DeviceBuffer::Allocate(kBytes, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto dst, DeviceBuffer::Allocate(kBytes, 0));
  SS_ASSERT_OK(CopyToDevice(src->data(), host.data(), kBytes));
  SS_ASSERT_OK(Memset(dst->data(), 0, kBytes));
  uint64_t ctl = 77, ctl_in = 0;
  // Posted together, issued as one group: a send-to-self only completes that way.
  SS_ASSERT_OK_AND_ASSIGN(XferId s1, t->PostSend(3, 0, src->data(), kBytes));
  SS_ASSERT_OK_AND_ASSIGN(XferId r1, t->PostRecv(3, 0, dst->data(), kBytes));
  SS_ASSERT_OK_AND_ASSIGN(XferId s2, t->PostSend(3, 1, &ctl, 8));
  SS_ASSERT_OK_AND_ASSIGN(XferId r2, t->PostRecv(3, 1, &ctl_in, 8));
  SS_ASSERT_OK_AND_ASSIGN(XferId fl, t->PostFlush(3));
  SS_ASSERT_OK(WaitAllXfers(*t, {s1, r1, s2, r2, fl}, Millis(30000), "self"));
  std::vector<unsigned char> got(kBytes);
  SS_ASSERT_OK(CopyToHost(got.data(), dst->data(), kBytes));
  EXPECT_EQ(got, host);
  EXPECT_EQ(ctl_in, 77u);
  EXPECT_EQ(t->PostSend(4, 0, src->data(), 8).status().code(), StatusCode::kInvalidArgument);
  t->Abort();
  EXPECT_EQ(t->PostSend(3, 0, src->data(), 8).status().code(), StatusCode::kAborted);
}

TEST(GpuTransports, RegisteredByName) {
  SS_ASSERT_OK(RegisterGpuTransports());
  SS_ASSERT_OK(RegisterGpuTransports());  // idempotent
  const auto names = RegisteredTransports();
#ifdef SHARDSYNC_HAVE_CUDA
  EXPECT_EQ(std::count(names.begin(), names.end(), "cuda_ipc"), 1);
  EXPECT_EQ(std::count(names.begin(), names.end(), "nccl"), 1);
#else
  EXPECT_EQ(std::count(names.begin(), names.end(), "cuda_ipc"), 0);
#endif
  SS_REQUIRE_GPU();
  PeerInfo g0{0, "h", MemKind::kCuda, 0, ""}, g0b{1, "h", MemKind::kCuda, 0, ""};
  auto pick = SelectTransport(g0, g0b);
  ASSERT_TRUE(pick.ok()) << pick.status().ToString();
  EXPECT_EQ(*pick, "cuda_ipc");
  TransportOptions o;
  o.params["device"] = "0";
  auto t = CreateTransport("nccl", o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->name(), "nccl");
}

// Emulated nodes (SHARDSYNC_HOST_ID, `--emulate-nodes`): two ranks on one GPU of different host
// identities take nccl, not cuda_ipc, and nccl connects only when NCCL sees the same node
// (NCCL_HOSTID), since NCCL refuses two ranks of one host on one GPU. No GPU needed: the check
// comes before NCCL is loaded.
TEST(GpuTransports, EmulatedNodesTakeNcclAndNeedNcclsHostId) {
#ifndef SHARDSYNC_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#endif
  SS_ASSERT_OK(RegisterGpuTransports());
  PeerInfo a{0, "box/node0", MemKind::kCuda, 0, "0000:18:00.0"};
  PeerInfo b{1, "box/node1", MemKind::kCuda, 0, "0000:18:00.0"};
  auto pick = SelectTransport(a, b);
  ASSERT_TRUE(pick.ok()) << pick.status().ToString();
  EXPECT_EQ(*pick, "nccl");
  b.hostname = a.hostname;
  EXPECT_EQ(*SelectTransport(a, b), "cuda_ipc");

  auto saved = [](const char* n) -> std::optional<std::string> {
    const char* v = std::getenv(n);
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
  const auto host_id = saved("SHARDSYNC_HOST_ID"), nccl_id = saved("NCCL_HOSTID");
  StoreFixture store = StartStore();
  ASSERT_TRUE(store.server);
  auto client = store.Client();
  ASSERT_TRUE(client);
  std::vector<Status> got;
  setenv("SHARDSYNC_HOST_ID", "box/node0", 1);
  for (const char* theirs : {static_cast<const char*>(nullptr), "box/node1"}) {
    if (theirs) {
      setenv("NCCL_HOSTID", theirs, 1);
    } else {
      unsetenv("NCCL_HOSTID");
    }
    TransportOptions o;
    o.params["device"] = "0";
    auto t = CreateTransport("nccl", o);
    got.push_back(t.ok() ? (*t)->Connect(*client, "emu/", 0, {1}, Millis(1000)) : t.status());
  }
  for (const auto& [name, v] :
       {std::pair{"SHARDSYNC_HOST_ID", host_id}, {"NCCL_HOSTID", nccl_id}}) {
    if (v) {
      setenv(name, v->c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].code(), StatusCode::kFailedPrecondition) << got[0].ToString();
  EXPECT_NE(got[0].message().find("NCCL_HOSTID=unset"), std::string::npos) << got[0].ToString();
  EXPECT_EQ(got[1].code(), StatusCode::kFailedPrecondition) << got[1].ToString();
  EXPECT_NE(got[1].message().find("'box/node1'"), std::string::npos) << got[1].ToString();
}

}  // namespace
}  // namespace shardsync::gpu
