// The conformance tests; instantiated per transport (see transport_conformance.h).
#include "transport/transport_conformance.h"

namespace shardsync::testing {

GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TransportConformance);

namespace {

// Runs the role named by SHARDSYNC_TEST_CHILD (see SpawnChild) before any test, then exits.
// An environment, not a static initializer: roles registered by other files must exist first.
class ChildDispatch : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* role = std::getenv("SHARDSYNC_TEST_CHILD");
    if (role == nullptr) return;
    alarm(120);  // a child never outlives a stuck parent by long
    auto it = ChildRoles().find(role);
    _exit(it == ChildRoles().end() ? 99 : it->second());
  }
};
[[maybe_unused]] ::testing::Environment* const child_dispatch =
    ::testing::AddGlobalTestEnvironment(new ChildDispatch);

// Peer of PeerLeavingIsAnErrorWithinTimeout: connects as rank 1 under SS_CHILD_PREFIX (GPU
// transports: on SS_CHILD_DEVICE, read by their RegisterChildTransport), then progresses until
// killed.
RegisterChildRole conformance_peer("conformance_peer", [] {
  auto it = ChildTransports().find(ChildEnv("SS_CHILD_TRANSPORT"));
  if (it == ChildTransports().end()) return 2;
  const std::string prefix =
      ChildEnv("SS_CHILD_PREFIX").empty() ? std::string("death") : ChildEnv("SS_CHILD_PREFIX");
  auto t = it->second();
  auto c = StoreClient::Connect(ChildEnv("SS_CHILD_STORE"), kToken, 5000ms);
  if (!t || !c.ok()) return 3;
  if (!t->Connect(**c, prefix, 1, {0}, kTimeout).ok()) return 4;
  if (!(*c)->Set(prefix + "/child_ready", "1").ok()) return 5;
  char b[1];  // the exact size of the parent's hello (order-matched transports need it)
  auto id = t->PostRecv(0, 1, b, sizeof(b));
  auto end = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < end) {
    if (id.ok()) t->Poll(*id).status().IgnoreError();
    usleep(1000);
  }
  return 6;
});

}  // namespace

// Transports without one-sided puts must refuse them cleanly (and still flush).
TEST_P(TransportConformance, PutRefusedCleanlyWithoutOneSidedCaps) {
  if (Caps().one_sided_put) GTEST_SKIP() << "one-sided put: PutVariousSizesThenFlush covers it";
  TestBuffer dst = Buffer(1, 100);
  auto ts = World(2, {{}, {dst.region()}});
  char src[4] = {};
  auto put = ts[0]->PostPut(1, src, 4, 0, 0);
  EXPECT_FALSE(put.ok());
  EXPECT_TRUE(put.status().code() == StatusCode::kFailedPrecondition ||
              put.status().code() == StatusCode::kUnimplemented)
      << put.status().ToString();
}

TEST_P(TransportConformance, PutVariousSizesThenFlush) {
  if (!Caps().one_sided_put) GTEST_SKIP() << "no one-sided put (see PutRefusedCleanly)";
  constexpr size_t kRegion = (4 << 20) + 64;
  TestBuffer dst0 = Buffer(1, kRegion), dst1 = Buffer(1, 1000);
  auto ts = World(2, {{}, {dst0.region(), dst1.region()}});
  const std::vector<std::pair<size_t, size_t>> puts = {
      // (offset, bytes) into region 0
      {0, 0}, {3, 1}, {5, 7}, {17, 4096 + 3}, {8192 + 1, 65537}, {131072 + 3, (4 << 20) - 131072}};
  // Sources in rank 0's memory (device memory for GPU transports: their data path).
  std::vector<std::vector<char>> want;
  std::vector<TestBuffer> srcs;
  for (size_t i = 0; i < puts.size(); ++i) {
    want.push_back(Pattern(puts[i].second, static_cast<int>(i)));
    srcs.push_back(Buffer(0, puts[i].second));
    srcs.back().Write(0, want.back());
  }
  const std::vector<char> small = Pattern(999, 99);
  TestBuffer small_src = Buffer(0, small.size());
  small_src.Write(0, small);
  ParallelRanks(2, [&](int r) {
    if (r == 0) {
      std::vector<XferId> ids;
      for (size_t i = 0; i < puts.size(); ++i) {
        auto id = ts[0]->PostPut(1, srcs[i].data(), puts[i].second, 0, puts[i].first);
        ASSERT_TRUE(id.ok()) << id.status().ToString();
        ids.push_back(*id);
      }
      auto id = ts[0]->PostPut(1, small_src.data() + 1, 998, 1, 2);  // unaligned src and dst
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      ids.push_back(*id);
      ASSERT_TRUE(WaitAllXfers(*ts[0], ids, kTimeout, "puts").ok());
      auto fl = ts[0]->PostFlush(1);
      ASSERT_TRUE(fl.ok()) << fl.status().ToString();
      Status fs = WaitXfer(*ts[0], *fl, kTimeout, "flush");
      ASSERT_TRUE(fs.ok()) << fs.ToString();
      char done = 1;
      auto s = ts[0]->PostSend(1, 7, &done, 1);
      ASSERT_TRUE(s.ok());
      ASSERT_TRUE(WaitXfer(*ts[0], *s, kTimeout, "done").ok());
    } else {
      char done = 0;
      auto id = ts[1]->PostRecv(0, 7, &done, 1);
      ASSERT_TRUE(id.ok());
      Status s = WaitXfer(*ts[1], *id, kTimeout, "done");
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(done, 1);
    }
  });
  const std::vector<char> got0 = dst0.Read(), got1 = dst1.Read();
  for (size_t i = 0; i < puts.size(); ++i) {
    EXPECT_TRUE(SameBytes(got0.data() + puts[i].first, want[i].data(), puts[i].second))
        << "put " << i;
  }
  EXPECT_EQ(std::memcmp(got1.data() + 2, small.data() + 1, 998), 0);
  EXPECT_EQ(got1[0], 0);
  EXPECT_EQ(got1[1], 0);
}

TEST_P(TransportConformance, PutOutsideRegionRefused) {
  if (!Caps().one_sided_put) GTEST_SKIP() << "no one-sided put (see PutRefusedCleanly)";
  TestBuffer dst = Buffer(1, 100);
  auto ts = World(2, {{}, {dst.region()}});
  char src[200] = {};  // refused before any byte moves, so host memory serves every transport
  EXPECT_EQ(ts[0]->PostPut(1, src, 101, 0, 0).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ts[0]->PostPut(1, src, 1, 0, 100).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ts[0]->PostPut(1, src, 1, 1, 0).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ts[0]->PostPut(5, src, 1, 0, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ts[0]->PostSend(0, 1, src, 1).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(TransportConformance, SendRecvMatchesBySourceAndTag) {
  if (!Caps().tag_matching) {
    GTEST_SKIP() << "caps().tag_matching is false: messages match by order per pair "
                    "(PairMessagesCompleteInPostingOrder covers it)";
  }
  const std::vector<size_t> sizes = {0, 1, 13, 8192 + 5, Msg(1 << 20)};
  auto ts = World(3, {{}, {}, {}});
  ParallelRanks(3, [&](int r) {
    Transport& t = *ts[r];
    if (r == 0 || r == 1) {
      // Both senders use the same tags; the receiver tells them apart by source.
      std::vector<std::vector<char>> bufs;
      std::vector<XferId> ids;
      for (size_t i = 0; i < sizes.size(); ++i) bufs.push_back(Pattern(sizes[i], r * 10 + i));
      for (size_t i = 0; i < sizes.size(); ++i) {
        auto id = t.PostSend(2, 100 + i, bufs[i].data(), sizes[i]);
        ASSERT_TRUE(id.ok()) << id.status().ToString();
        ids.push_back(*id);
      }
      Status s = WaitAllXfers(t, ids, kTimeout, "sends");
      EXPECT_TRUE(s.ok()) << s.ToString();
    } else {
      // Receives posted in reverse tag order and interleaved by source.
      std::vector<std::vector<char>> got(2 * sizes.size());
      std::vector<XferId> ids;
      for (size_t k = 0; k < sizes.size(); ++k) {
        size_t i = sizes.size() - 1 - k;
        for (int src = 0; src < 2; ++src) {
          auto& g = got[src * sizes.size() + i];
          g.assign(sizes[i], 0);  // larger buffers: RecvBufferLargerThanMessageIsFine
          auto id = t.PostRecv(src, 100 + i, g.data(), g.size());
          ASSERT_TRUE(id.ok()) << id.status().ToString();
          ids.push_back(*id);
        }
      }
      Status s = WaitAllXfers(t, ids, kTimeout, "recvs");
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (int src = 0; src < 2; ++src) {
        for (size_t i = 0; i < sizes.size(); ++i) {
          auto want = Pattern(sizes[i], src * 10 + i);
          EXPECT_TRUE(SameBytes(got[src * sizes.size() + i].data(), want.data(), sizes[i]))
              << "from rank " << src << " size " << sizes[i];
        }
      }
    }
  });
}

// Messages that arrive before their receive is posted (UCX: unexpected eager and rendezvous).
TEST_P(TransportConformance, SendBeforeRecvIsPosted) {
  auto ts = World(2, {{}, {}});
  const std::vector<size_t> sizes = {0, 100, Msg(4 << 20)};
  ParallelRanks(2, [&](int r) {
    auto store = Store();
    if (r == 0) {
      std::vector<std::vector<char>> bufs;
      std::vector<XferId> ids;
      for (size_t i = 0; i < sizes.size(); ++i) {
        bufs.push_back(Pattern(sizes[i], 40 + i));
        auto id = ts[0]->PostSend(1, 500 + i, bufs[i].data(), sizes[i]);
        ASSERT_TRUE(id.ok()) << id.status().ToString();
        ids.push_back(*id);
      }
      ASSERT_TRUE(store->Set("sent", "1").ok());
      Status s = WaitAllXfers(*ts[0], ids, kTimeout, "early sends");
      EXPECT_TRUE(s.ok()) << s.ToString();
    } else {
      ASSERT_TRUE(store->Get("sent", kTimeout).ok());
      for (size_t i = 0; i < sizes.size(); ++i) {
        std::vector<char> got(sizes[i]);
        auto id = ts[1]->PostRecv(0, 500 + i, got.data(), got.size());
        ASSERT_TRUE(id.ok());
        Status s = WaitXfer(*ts[1], *id, kTimeout, "late recv");
        ASSERT_TRUE(s.ok()) << s.ToString();
        auto want = Pattern(sizes[i], 40 + i);
        EXPECT_TRUE(SameBytes(got.data(), want.data(), sizes[i])) << sizes[i];
      }
    }
  });
}

// One tag, one pair: FIFO (on order-matched transports this is their whole matching rule).
TEST_P(TransportConformance, SameTagIsFifo) {
  auto ts = World(2, {{}, {}});
  ParallelRanks(2, [&](int r) {
    constexpr int kN = 20;
    if (r == 0) {
      std::vector<int> vals(kN);
      std::iota(vals.begin(), vals.end(), 0);
      std::vector<XferId> ids;
      for (int i = 0; i < kN; ++i) ids.push_back(*ts[0]->PostSend(1, 9, &vals[i], sizeof(int)));
      EXPECT_TRUE(WaitAllXfers(*ts[0], ids, kTimeout, "sends").ok());
    } else {
      for (int i = 0; i < kN; ++i) {
        int v = -1;
        auto id = ts[1]->PostRecv(0, 9, &v, sizeof(v));
        ASSERT_TRUE(id.ok());
        ASSERT_TRUE(WaitXfer(*ts[1], *id, kTimeout, "recv").ok());
        EXPECT_EQ(v, i);
      }
    }
  });
}

// Messages of one pair posted in the same order on both sides land in that order. Where
// messages match by order (caps().tag_matching false: nccl) that is the matching rule, and a
// receive completes only after every receive from the same peer posted before it; the
// receives go out in two batches (nccl: two groups) to check that across batches too. Tags are
// distinct, so tag-matching transports pair the same messages (their completion order is free:
// UCX finishes a small eager message before an earlier rendezvous one).
TEST_P(TransportConformance, PairMessagesCompleteInPostingOrder) {
  const bool by_order = !Caps().tag_matching;
  const std::vector<size_t> sizes = {1, Msg(1 << 20), 7, Msg(65536 + 3), 0, 100, Msg(256 << 10), 4};
  const size_t n = sizes.size();
  auto ts = World(2, {{}, {}});
  ParallelRanks(2, [&](int r) {
    Transport& t = *ts[r];
    if (r == 0) {
      std::vector<std::vector<char>> bufs;
      std::vector<XferId> ids;
      for (size_t i = 0; i < n; ++i) bufs.push_back(Pattern(sizes[i], 60 + static_cast<int>(i)));
      for (size_t i = 0; i < n; ++i) {
        auto id = t.PostSend(1, 300 + i, bufs[i].data(), sizes[i]);
        ASSERT_TRUE(id.ok()) << id.status().ToString();
        ids.push_back(*id);
      }
      Status s = WaitAllXfers(t, ids, kTimeout, "sends");
      EXPECT_TRUE(s.ok()) << s.ToString();
      return;
    }
    std::vector<std::vector<char>> got(n);
    std::vector<XferId> ids;
    std::vector<bool> done(n, false);
    auto post = [&](size_t i) {
      got[i].assign(sizes[i], 0);
      auto id = t.PostRecv(0, 300 + i, got[i].data(), got[i].size());
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      ids.push_back(*id);
    };
    // One Poll of receive i (ids are released once done, so never polled again).
    auto poll = [&](size_t i) -> Status {
      if (done[i]) return OkStatus();
      auto st = t.Poll(ids[i]);
      if (!st.ok()) return st.status();
      done[i] = *st == XferState::kDone;
      return OkStatus();
    };
    auto wait = [&](size_t i) -> Status {
      const auto deadline = std::chrono::steady_clock::now() + kTimeout;
      while (!done[i]) {
        SS_RETURN_IF_ERROR(poll(i));
        if (!done[i] && std::chrono::steady_clock::now() > deadline) {
          return DeadlineExceededError("receive " + std::to_string(i));
        }
      }
      return OkStatus();
    };
    for (size_t i = 0; i < n / 2; ++i) post(i);
    if (HasFatalFailure()) return;
    Status s0 = poll(0);  // starts the first batch (nccl issues queued operations on Poll)
    ASSERT_TRUE(s0.ok()) << s0.ToString();
    for (size_t i = n / 2; i < n; ++i) post(i);
    if (HasFatalFailure()) return;
    Status last = wait(n - 1);
    ASSERT_TRUE(last.ok()) << last.ToString();
    for (size_t i = 0; i + 1 < n; ++i) {
      if (by_order) {
        Status s = poll(i);
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(done[i]) << "receive " << i << " not done after receive " << n - 1
                             << ", posted later, completed";
      }
      Status s = wait(i);
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
    for (size_t i = 0; i < n; ++i) {
      auto want = Pattern(sizes[i], 60 + static_cast<int>(i));
      EXPECT_TRUE(SameBytes(got[i].data(), want.data(), sizes[i])) << "message " << i;
    }
  });
}

// A receive buffer larger than the message is fine (transport.h).
TEST_P(TransportConformance, RecvBufferLargerThanMessageIsFine) {
  if (GetParam().exact_recv_size) GTEST_SKIP() << "receives must have the message's exact size";
  const std::vector<size_t> sizes = {0, 1, 13, 8192 + 5, Msg(1 << 20)};
  auto ts = World(2, {{}, {}});
  ParallelRanks(2, [&](int r) {
    Transport& t = *ts[r];
    std::vector<std::vector<char>> bufs(sizes.size());
    std::vector<XferId> ids;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (r == 0) {
        bufs[i] = Pattern(sizes[i], 80 + static_cast<int>(i));
        auto id = t.PostSend(1, 400 + i, bufs[i].data(), sizes[i]);
        ASSERT_TRUE(id.ok()) << id.status().ToString();
        ids.push_back(*id);
      } else {
        bufs[i].assign(sizes[i] + 8, 0);
        auto id = t.PostRecv(0, 400 + i, bufs[i].data(), bufs[i].size());
        ASSERT_TRUE(id.ok()) << id.status().ToString();
        ids.push_back(*id);
      }
    }
    Status s = WaitAllXfers(t, ids, kTimeout, r == 0 ? "sends" : "larger receives");
    ASSERT_TRUE(s.ok()) << s.ToString();
    if (r == 1) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        auto want = Pattern(sizes[i], 80 + static_cast<int>(i));
        EXPECT_TRUE(SameBytes(bufs[i].data(), want.data(), sizes[i])) << "size " << sizes[i];
      }
    }
  });
}

TEST_P(TransportConformance, ManyOutstandingOps) {
  constexpr int kN = 256;
  constexpr size_t kMsg = 4096 + 1;
  const bool puts = Caps().one_sided_put;
  // Data in the transport's memory: puts into a registered region, or device-to-device messages.
  TestBuffer dst = Buffer(1, kN * kMsg), src = Buffer(0, kN * kMsg);
  const std::vector<char> want = Pattern(kN * kMsg, 5);
  src.Write(0, want);
  auto ts = World(2, {{}, {dst.region()}});
  ParallelRanks(2, [&](int r) {
    if (r == 0) {
      std::vector<XferId> ids;
      for (int i = 0; i < kN; ++i) {
        auto id = puts ? ts[0]->PostPut(1, src.data() + i * kMsg, kMsg, 0, i * kMsg)
                       : ts[0]->PostSend(1, 1000 + i, src.data() + i * kMsg, kMsg);
        ASSERT_TRUE(id.ok()) << i << ": " << id.status().ToString();
        ids.push_back(*id);
      }
      if (puts) ids.push_back(*ts[0]->PostFlush(1));
      Status s = WaitAllXfers(*ts[0], ids, kTimeout, "many");
      ASSERT_TRUE(s.ok()) << s.ToString();
      int done = 1;
      ASSERT_TRUE(
          WaitXfer(*ts[0], *ts[0]->PostSend(1, 1, &done, sizeof(done)), kTimeout, "d").ok());
    } else {
      std::vector<XferId> ids;
      if (!puts) {
        for (int i = 0; i < kN; ++i) {
          ids.push_back(*ts[1]->PostRecv(0, 1000 + i, dst.data() + i * kMsg, kMsg));
        }
      }
      int done = 0;
      ids.push_back(*ts[1]->PostRecv(0, 1, &done, sizeof(done)));
      Status s = WaitAllXfers(*ts[1], ids, kTimeout, "many");
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
  });
  EXPECT_TRUE(dst.Read() == want);
}

TEST_P(TransportConformance, RecvBufferTooSmallFails) {
  if (GetParam().exact_recv_size) {
    GTEST_SKIP() << "receives must have the message's exact size; a mismatch is undefined";
  }
  auto ts = World(2, {{}, {}});
  ParallelRanks(2, [&](int r) {
    if (r == 0) {
      std::vector<char> big(1000, 1);
      auto id = ts[0]->PostSend(1, 3, big.data(), big.size());
      ASSERT_TRUE(id.ok());
      // The sender may or may not learn about the truncation; it must not hang.
      WaitXfer(*ts[0], *id, 3000ms, "send").IgnoreError();
    } else {
      std::vector<char> small(10);
      auto id = ts[1]->PostRecv(0, 3, small.data(), small.size());
      ASSERT_TRUE(id.ok());
      Status s = WaitXfer(*ts[1], *id, kTimeout, "recv");
      EXPECT_FALSE(s.ok());
      EXPECT_NE(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
    }
  });
}

TEST_P(TransportConformance, UnmatchedRecvTimesOut) {
  auto ts = World(2, {{}, {}});
  char buf[8];
  auto id = ts[1]->PostRecv(0, 42, buf, sizeof(buf));
  ASSERT_TRUE(id.ok());
  auto start = std::chrono::steady_clock::now();
  Status s = WaitXfer(*ts[1], *id, 200ms, "recv tag 42");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("recv tag 42"), std::string::npos);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 200ms);
}

TEST_P(TransportConformance, PollAfterAbortFails) {
  auto ts = World(2, {{}, {}});
  char buf[8];
  auto id = ts[1]->PostRecv(0, 42, buf, sizeof(buf));
  ASSERT_TRUE(id.ok());
  ts[1]->Abort();
  auto st = ts[1]->Poll(*id);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), StatusCode::kAborted) << st.status().ToString();
  EXPECT_FALSE(ts[1]->PostSend(0, 1, buf, 1).ok());
  EXPECT_FALSE(ts[1]->PostRecv(0, 1, buf, 1).ok());
  ts[1]->Abort();  // idempotent
}

TEST_P(TransportConformance, ConnectTimesOutWithoutPeer) {
  auto t = Make();
  auto store = Store();
  Status s = t->Connect(*store, Prefix("lonely"), 0, {1}, 300ms);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  // Nothing can be posted to a peer that never connected.
  char b = 0;
  EXPECT_FALSE(t->PostSend(1, 1, &b, 1).ok());
  EXPECT_NE(s.message().find("1"), std::string::npos);
}

TEST_P(TransportConformance, PeerLeavingIsAnErrorWithinTimeout) {
  if (GetParam().multiprocess) {
    // A peer process connects, then is killed; the survivor's operations must fail in time.
    ASSERT_TRUE(ChildTransports().count(GetParam().name)) << "no RegisterChildTransport";
    const std::string prefix = Prefix("death");
    // The child re-executes this binary before touching anything (CUDA included).
    pid_t pid = SpawnChild("conformance_peer", {{"SS_CHILD_STORE", server_->address()},
                                                {"SS_CHILD_TRANSPORT", GetParam().name},
                                                {"SS_CHILD_PREFIX", prefix},
                                                {"SS_CHILD_DEVICE", std::to_string(Device(1))}});
    ASSERT_GT(pid, 0);
    struct Reaper {  // never leave the child behind, whatever assertion fails
      pid_t pid;
      bool reaped = false;
      ~Reaper() {
        if (!reaped) WaitChild(pid, 0ms);
      }
    } reaper{pid};
    auto t = Make();
    auto store = Store();
    Status cs = t->Connect(*store, prefix, 0, {1}, kTimeout);
    ASSERT_TRUE(cs.ok()) << cs.ToString();
    ASSERT_TRUE(store->Get(prefix + "/child_ready", kTimeout).ok());
    char small = 1;
    ASSERT_TRUE(WaitXfer(*t, *t->PostSend(1, 1, &small, 1), kTimeout, "hello").ok());
    kill(pid, SIGKILL);
    WaitChild(pid, kTimeout);
    reaper.reaped = true;
    char buf[64];
    auto id = t->PostRecv(1, 77, buf, sizeof(buf));
    Status s = id.ok() ? WaitXfer(*t, *id, 5000ms, "recv from dead rank 1") : id.status();
    // Unavailable (the death was detected), not merely the wait's own deadline.
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    std::vector<char> big(Msg(1 << 20), 3);
    auto sid = t->PostSend(1, 78, big.data(), big.size());
    Status s2 = sid.ok() ? WaitXfer(*t, *sid, 5000ms, "send to dead rank 1") : sid.status();
    EXPECT_EQ(s2.code(), StatusCode::kUnavailable) << s2.ToString();
    return;
  }
  auto ts = World(2, {{}, {}});
  char buf[8];
  auto id = ts[0]->PostRecv(1, 5, buf, sizeof(buf));
  ASSERT_TRUE(id.ok());
  ts[1].reset();
  Status s = WaitXfer(*ts[0], *id, 5000ms, "recv from rank 1");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  auto sid = ts[0]->PostSend(1, 5, buf, 1);
  Status s2 = sid.ok() ? WaitXfer(*ts[0], *sid, 5000ms, "send") : sid.status();
  EXPECT_FALSE(s2.ok());
}

}  // namespace shardsync::testing
