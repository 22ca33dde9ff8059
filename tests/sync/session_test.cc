// Session failure semantics on loopback, one thread per sync rank: checksum mismatch, a sender
// that stops mid-sync, a sender whose transport dies, a rank with a different plan, stale
// versions, and binding errors. Every failure must reach every rank within its timeout.
#include "shardsync/session.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include <chrono>
#include <functional>
#include <thread>

#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "session_harness.h"
#include "shardsync/transport.h"
#include "sync/verdict_board.h"
#include "sync_expect.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;
using ::testing::HasSubstr;

using Job = testing::SessionJob;

JobSpec Small() {
  // 2 trainer ranks, 4 engine ranks (tp 2 x pp 2), small buckets: many messages and buckets.
  return testing::Job(testing::TinyQwen2(4, true), "fsdp=2", "dp=1,tp=2,pp=2", "sglang", 16 << 10);
}

using testing::ExpectAllOk;

TEST(SyncSession, SyncsAndReportsTheSameOnEveryRank) {
  Job job(Small());
  job.BindAll();
  ExpectAllOk(job.Connect());
  std::vector<SyncReport> reps;
  ExpectAllOk(job.Sync(1, &reps));
  EXPECT_EQ(job.Mismatches(), 0);
  for (int r = 0; r < job.world(); ++r) {
    EXPECT_EQ(reps[r].version, 1u);
    EXPECT_EQ(reps[r].bytes, reps[0].bytes);
    EXPECT_EQ(reps[r].checksums_total, reps[0].checksums_total);
    EXPECT_EQ(reps[r].checksums_ok, reps[r].checksums_total);
    EXPECT_EQ(reps[r].slowest_rank, reps[0].slowest_rank);
    EXPECT_EQ(static_cast<int>(reps[r].ranks.size()), job.world());
    EXPECT_FALSE(job.session(r).IsPoisoned());
  }
  EXPECT_GT(reps[0].bytes, 0);
  // The element check itself catches one wrong byte.
  auto& b = job.params(job.world() - 1).bindings.back();
  static_cast<unsigned char*>(b.data)[1] ^= 0x10;
  EXPECT_EQ(job.Mismatches(), 1);
}

TEST(SyncSession, FlippedByteIsDataLossNamingTheParameter) {
  Job job(Small());
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(1));
  testing::ExpectFlippedByteIsDataLossThenRecovers(job);
}

TEST(SyncSession, SenderStoppingMidSyncFailsEveryRankWithinTheTimeout) {
  Job job(Small(), Millis(1500));
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(1));
  // Trainer rank 0's 4th post never completes: it hangs mid-sync like a killed process, posting
  // nothing. Its peers must fail on their own timeout.
  job.fault(0).set_config({.drop_completion = job.fault(0).counters().posts + 4});
  const auto t0 = Clock::now();
  auto st = job.Sync(2);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int r = 0; r < job.world(); ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    if (r >= job.trainers()) {
      EXPECT_TRUE(job.session(r).IsPoisoned()) << "rank " << r;
    }
  }
  EXPECT_LT(secs, 10.0);  // bounded: a hang would never return
  job.fault(0).set_config({});
  ExpectAllOk(job.Sync(3));
  for (int r = job.trainers(); r < job.world(); ++r) EXPECT_FALSE(job.session(r).IsPoisoned());
  EXPECT_EQ(job.Mismatches(), 0);
}

// A rank that will not run a version (a check of its own failed first) says so: every other
// rank's sync of that version fails with Aborted naming it and why (a peer that only timed out
// would say DeadlineExceeded); the next version syncs.
TEST(SyncSession, FailSyncFailsThePeersOfThatVersionAtOnceNamingTheRank) {
  Job job(Small(), Millis(30000));
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(1));
  auto st = job.All([&](int r) -> Status {
    if (r == 0) {
      job.session(0).FailSync(2, "source 'w' moved since it was bound");
      return OkStatus();
    }
    return job.session(r).Sync(2).status();
  });
  for (int r = 1; r < job.world(); ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kAborted) << "rank " << r << ": " << st[r].ToString();
    EXPECT_THAT(st[r].message(), HasSubstr("sync rank 0 failed: source 'w' moved"))
        << st[r].ToString();
  }
  ExpectAllOk(job.Sync(3));
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST(SyncSession, SenderTransportDeathFailsEveryRank) {
  Job job(Small(), Millis(5000));
  job.BindAll();
  ExpectAllOk(job.Connect());
  job.fault(1).set_config({.die_after_posts = 5});
  auto st = job.Sync(1);
  for (int r = 0; r < job.world(); ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    if (r >= job.trainers()) {
      EXPECT_TRUE(job.session(r).IsPoisoned());
    }
  }
  EXPECT_EQ(st[1].code(), StatusCode::kUnavailable) << st[1].ToString();
  for (int r = 2; r < job.world(); ++r) {
    EXPECT_THAT(st[r].message(), HasSubstr("sync rank 1 failed")) << st[r].ToString();
  }
  job.fault(1).set_config({});
  ExpectAllOk(job.Sync(2));
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST(SyncSession, DifferentPlanFailsAtConnectNamingBothHashesAndTheField) {
  JobSpec spec = Small();
  // Rank 3 plans with a different bucket cap: a different plan hash.
  PlanInputs other = spec.inputs;
  other.options.bucket_bytes = 8 << 10;
  const std::string h0 = PlanHash(spec.inputs), h1 = PlanHash(other);
  ASSERT_NE(h0, h1);
  auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
  ASSERT_TRUE(server.ok());
  auto hub = NewLoopbackHub();
  const int world = SyncWorldSize(spec.inputs);
  std::vector<Status> st(world);
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] {
      auto c = StoreClient::Connect((*server)->address(), "test-token-0123456789", Millis(5000));
      if (!c.ok()) {
        st[r] = c.status();
        return;
      }
      auto tx = NewLoopbackTransport(hub);
      SessionOptions o;
      o.connect_timeout = Millis(5000);
      auto s = SyncSession::Create(r == 3 ? other : spec.inputs, r, **c, *tx, o);
      if (!s.ok()) {
        st[r] = s.status();
        return;
      }
      // No bindings: the hash check must fail before bindings are even looked at.
      st[r] = (*s)->Connect();
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(st[r].code(), StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << st[r].ToString();
    EXPECT_THAT(st[r].message(), HasSubstr("plan hash mismatch"));
    EXPECT_THAT(st[r].message(), HasSubstr(h0));
    EXPECT_THAT(st[r].message(), HasSubstr(h1));
    EXPECT_THAT(st[r].message(), HasSubstr("sync rank 3"));
    // The field that differs, with both values, from the plans' published texts.
    const std::string mine = r == 3 ? "8192" : std::to_string(spec.inputs.options.bucket_bytes);
    const std::string theirs = r == 3 ? std::to_string(spec.inputs.options.bucket_bytes) : "8192";
    EXPECT_THAT(st[r].message(), HasSubstr("bucket_bytes is " + mine + " here and " + theirs))
        << st[r].ToString();
  }
}

TEST(SyncSession, StaleVersionIsRefusedWithoutTouchingAnything) {
  Job job(Small());
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(5));
  for (uint64_t v : {5u, 3u}) {
    auto st = job.Sync(v);
    for (int r = 0; r < job.world(); ++r) {
      EXPECT_EQ(st[r].code(), StatusCode::kFailedPrecondition) << st[r].ToString();
      EXPECT_THAT(st[r].message(), HasSubstr("stale"));
      EXPECT_FALSE(job.session(r).IsPoisoned());
    }
  }
  EXPECT_EQ(job.session(job.world() - 1).last_good_version(), 5u);
  ExpectAllOk(job.Sync(6));
  EXPECT_EQ(job.Mismatches(), 0);
}

// Issue 26: version 2^64 - 1 used to be accepted and then block every later version. Versions
// outside 1..kMaxSyncVersion are refused before anything is touched, naming the version and the
// bound; the next good version syncs.
TEST(SyncSession, VersionsOutsideTheRangeAreRefusedWithoutTouchingAnything) {
  Job job(Small());
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(1));
  for (uint64_t v : {kMaxSyncVersion + 1, ~uint64_t{0}, uint64_t{0}}) {
    auto st = job.Sync(v);
    for (int r = 0; r < job.world(); ++r) {
      EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << st[r].ToString();
      EXPECT_THAT(st[r].message(), HasSubstr("version " + std::to_string(v)));
      EXPECT_THAT(st[r].message(), HasSubstr(std::to_string(kMaxSyncVersion)));
      EXPECT_FALSE(job.session(r).IsPoisoned());
    }
  }
  ExpectAllOk(job.Sync(kMaxSyncVersion));  // the bound itself is a version
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST(SyncSession, RanksAtDifferentVersionsFail) {
  Job job(Small(), Millis(2000));
  job.BindAll();
  ExpectAllOk(job.Connect());
  auto st = job.All([&](int r) { return job.session(r).Sync(r == 0 ? 8 : 7).status(); });
  for (int r = 0; r < job.world(); ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r;
  ExpectAllOk(job.Sync(9));
}

TEST(SyncSession, BindingErrorsNameTheTensor) {
  JobSpec spec = Small();
  Job job(spec);
  const int engine = job.trainers();
  SyncSession& e = job.session(engine);
  const EngineParam& p = e.ExpectedParams().at(0);
  std::vector<unsigned char> buf(p.numel() * 2 + 64);
  Shape wrong = p.shape;
  wrong[0] += 1;
  Status s = e.BindDest({p.name, buf.data(), DType::kBF16, wrong});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(p.name));
  s = e.BindDest({"model.nonexistent.weight", buf.data(), DType::kBF16, p.shape});
  EXPECT_THAT(s.message(), HasSubstr("model.nonexistent.weight"));
  s = e.BindDest({p.name, buf.data(), DType::kF32, p.shape});
  EXPECT_THAT(s.message(), HasSubstr("wire dtype"));
  s = e.BindDest({p.name, buf.data(), DType::kBF16, p.shape, MemKind::kCuda, 0});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("device memory needs a packer"));
  // Issue 26: two parameters sharing bytes of one buffer are refused at bind, naming both.
  const EngineParam& q = e.ExpectedParams().at(1);
  std::vector<unsigned char> shared((p.numel() + q.numel()) * 2);
  ASSERT_TRUE(e.BindDest({p.name, shared.data(), DType::kBF16, p.shape}).ok());
  s = e.BindDest({q.name, shared.data() + p.numel() * 2 - 2, DType::kBF16, q.shape});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(q.name));
  EXPECT_THAT(s.message(), HasSubstr(p.name));
  EXPECT_THAT(s.message(), HasSubstr("overlaps"));
  EXPECT_TRUE(e.BindDest({q.name, shared.data() + p.numel() * 2, DType::kBF16, q.shape}).ok())
      << "adjacent, not overlapping";
  s = job.session(0).BindSource(
      {"model.embed_tokens.weight", buf.data(), DType::kF32, Region::Make({0, 0}, {1, 1})});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.embed_tokens.weight"));
  // Missing parameters are reported at Connect, naming one: this rank's own, or a peer's that
  // failed first (a rank that fails to connect, or failed a bind before it, fails its peers at
  // once, with its cause).
  auto st = job.Connect();
  EXPECT_TRUE(st[engine].code() == StatusCode::kNotFound ||
              st[engine].code() == StatusCode::kUnavailable ||
              st[engine].code() == StatusCode::kAborted)
      << st[engine].ToString();
  EXPECT_THAT(st[engine].message(),
              ::testing::AnyOf(HasSubstr("was not bound"), HasSubstr("failed before connect")));
}

// Issue 36: a rank that fails at bind (and never calls Connect) fails every peer waiting at
// Connect within seconds, not at its connect timeout, naming that rank and its own error.
TEST(SyncSession, ARankFailingAtBindFailsEveryPeerAtOnceNamingItAndItsError) {
  const int bad = 3;  // an engine rank
  Job job(Small(), Millis(3000), [](int, SessionOptions& o) { o.connect_timeout = Millis(30000); });
  job.BindAll();
  const EngineParam& p = job.session(bad).ExpectedParams().at(0);
  std::vector<unsigned char> buf(p.numel() * 2);
  Shape wrong = p.shape;
  wrong[0] += 1;
  std::vector<double> ended(job.world(), 0);
  const auto t0 = Clock::now();
  auto st = job.All([&](int r) {
    Status s;
    if (r == bad) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others wait in Connect
      s = job.session(r).BindDest({p.name, buf.data(), DType::kBF16, wrong});
    } else {
      s = job.session(r).Connect();
    }
    ended[r] = std::chrono::duration<double>(Clock::now() - t0).count();
    return s;
  });
  EXPECT_EQ(st[bad].code(), StatusCode::kInvalidArgument) << st[bad].ToString();
  for (int r = 0; r < job.world(); ++r) {
    if (r == bad) continue;
    // Aborted from its presence key, or Unavailable from a peer that saw it first and left
    // (its reason carries this one).
    EXPECT_TRUE(st[r].code() == StatusCode::kAborted || st[r].code() == StatusCode::kUnavailable)
        << "rank " << r << ": " << st[r].ToString();
    EXPECT_THAT(st[r].message(), HasSubstr("sync rank " + std::to_string(bad) +
                                           " failed before connect: invalid_argument"));
    EXPECT_THAT(st[r].message(), HasSubstr(p.name)) << "its own error, naming the tensor";
    EXPECT_LT(ended[r], 5.0) << "rank " << r;
  }
}

// Issue 36: a connect that times out names the ranks that never reached connect().
TEST(SyncSession, AConnectTimeoutNamesTheRanksThatNeverReachedConnect) {
  const int idle = 4;  // its Session exists; connect() is never called
  Job job(Small(), Millis(3000), [](int, SessionOptions& o) { o.connect_timeout = Millis(1500); });
  job.BindAll();
  auto st = job.All([&](int r) { return r == idle ? OkStatus() : job.session(r).Connect(); });
  int named = 0;
  for (int r = 0; r < job.world(); ++r) {
    if (r == idle) continue;
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    if (st[r].code() != StatusCode::kDeadlineExceeded) continue;  // a peer gone first
    EXPECT_THAT(st[r].message(),
                HasSubstr("never reached connect(): 4 (Session created, connect() not called)"))
        << st[r].ToString();
    ++named;
  }
  EXPECT_GT(named, 0);
}

}  // namespace
}  // namespace shardsync

namespace shardsync {
namespace {

// One-sided puts must not land in an engine that has not entered the version yet (it may still
// read the previous one): senders wait for each receiver's Sync(v). Here the engines never enter
// version 2, so the trainers time out and no engine byte may change.
TEST(SyncSession, SendersNeverWriteIntoAnEngineOutsideItsSync) {
  Job job(Small(), Millis(600));
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(1));
  // The engines "use" their parameters: garbage that any write of version 2 would overwrite.
  for (int r = job.trainers(); r < job.world(); ++r) {
    for (auto& b : job.params(r).bindings) {
      const int64_t bytes = NumElements(b.shape) * DTypeSize(b.dtype);
      std::memset(b.data, 0x5A, static_cast<size_t>(bytes));
    }
  }
  auto st = job.All([&](int r) -> Status {
    if (r >= job.trainers()) return OkStatus();  // engines stay outside Sync(2)
    return job.session(r).Sync(2).status();
  });
  for (int r = 0; r < job.trainers(); ++r) {
    ASSERT_FALSE(st[r].ok()) << "trainer " << r << " finished without its receivers";
    // Its own timeout, or the other trainer's abort when that one timed out first.
    EXPECT_TRUE(st[r].code() == StatusCode::kDeadlineExceeded ||
                st[r].code() == StatusCode::kAborted)
        << st[r].ToString();
    EXPECT_THAT(st[r].message(), HasSubstr("to enter version 2"));
  }
  for (int r = job.trainers(); r < job.world(); ++r) {
    for (auto& b : job.params(r).bindings) {
      const auto* p = static_cast<const unsigned char*>(b.data);
      const int64_t bytes = NumElements(b.shape) * DTypeSize(b.dtype);
      for (int64_t i = 0; i < bytes; ++i) ASSERT_EQ(p[i], 0x5A) << b.name << " byte " << i;
    }
  }
}

}  // namespace
}  // namespace shardsync

namespace shardsync {
namespace {

using testing::JobNonce;
std::string Root(StoreClient& store) { return testing::JobRoot(store); }

// Whether every rank's verdict of `version` went through the store.
bool VerdictsInStore(Job& job, uint64_t version) {
  for (int r = 0; r < job.world(); ++r) {
    const std::string key =
        Root(job.store(0)) + "v" + std::to_string(version) + "/done/" + std::to_string(r);
    if (!job.store(0).Get(key, Millis(0)).ok()) return false;
  }
  return true;
}

TEST(SyncSession, OneHostsVerdictsGoThroughSharedMemoryAndTheSegmentIsGoneAfterConnect) {
  Job job(Small());
  job.BindAll();
  ExpectAllOk(job.Connect());
  // Rank 0 published the board; every rank mapped it, so its name is already removed.
  const std::string root = Root(job.store(0));
  auto nonce = job.store(0).Get(root + "vboard", Millis(0));
  ASSERT_TRUE(nonce.ok());
  ASSERT_NE(*nonce, "none");
  for (int r = 0; r < job.world(); ++r) {
    auto m = job.store(0).Get(root + "vboard/" + *nonce + "/" + std::to_string(r), Millis(0));
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(*m, "1") << "rank " << r;
  }
  const uint64_t n = std::stoull(*nonce);
  EXPECT_FALSE(sync_internal::VerdictBoard::Open(sync_internal::VerdictBoardName(n), job.world(), n,
                                                 JobNonce(job.store(0)))
                   .ok());
  // Past the board's ring, with versions skipped by multiples of its size.
  for (uint64_t v : {1, 2, 3, 4, 5, 9, 13, 17, 21}) {
    ExpectAllOk(job.Sync(v));
    EXPECT_FALSE(VerdictsInStore(job, v)) << "version " << v;
  }
  EXPECT_EQ(job.Mismatches(), 0);
  // A failure reaches every rank through the board too, naming its cause.
  job.CorruptDataPost(1, 2, 3);
  testing::ExpectOneDataLossFrom(job, job.Sync(25), 1);
  job.fault(1).set_config({});
  ExpectAllOk(job.Sync(29));
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST(SyncSession, ARankWithoutTheBoardPutsEveryRanksVerdictsOnTheStore) {
  for (int off : {0, 3}) {
    Job job(Small(), Millis(3000), [off](int r, SessionOptions& o) {
      if (r == off) o.shared_memory_verdicts = false;
    });
    job.BindAll();
    ExpectAllOk(job.Connect());
    const std::string root = Root(job.store(0));
    auto nonce = job.store(0).Get(root + "vboard", Millis(0));
    ASSERT_TRUE(nonce.ok());
    if (off == 0) {
      EXPECT_EQ(*nonce, "none");  // rank 0 made no board: nobody asks
    } else {
      auto m = job.store(0).Get(root + "vboard/" + *nonce + "/" + std::to_string(off), Millis(0));
      ASSERT_TRUE(m.ok());
      EXPECT_EQ(*m, "0");
    }
    ExpectAllOk(job.Sync(1));
    ExpectAllOk(job.Sync(2));
    EXPECT_TRUE(VerdictsInStore(job, 2)) << "board off on rank " << off;
    EXPECT_EQ(job.Mismatches(), 0);
  }
}

}  // namespace
}  // namespace shardsync

namespace shardsync {
namespace {

// Issue 26: the store kept every version's keys (about 1 KB per sync for 4 ranks). Rank 0 drops
// the keys of every version all ranks have passed: over 200 syncs (store verdicts, so every
// per-version key kind is written) nothing older than the last 16 versions is left.
TEST(SyncSession, FinishedVersionsKeysAreDroppedSoTheStoreStaysFlat) {
  Job job(Small(), Millis(5000), [](int, SessionOptions& o) { o.shared_memory_verdicts = false; });
  job.BindAll();
  ExpectAllOk(job.Connect());
  const std::string root = testing::JobRoot(job.store(0));
  for (uint64_t v = 1; v <= 200; ++v) {
    ExpectAllOk(job.Sync(v));
    if (v > 17) {
      // Dropped already (deleting it again finds nothing).
      auto left = job.store(0).DeletePrefix(root + "v" + std::to_string(v - 17) + "/");
      ASSERT_TRUE(left.ok());
      ASSERT_EQ(*left, 0) << "version " << v - 17 << "'s keys are still in the store at " << v;
    }
  }
  EXPECT_EQ(job.Mismatches(), 0);
  // What is left: the versions since the last drop, each with the same few keys.
  auto last = job.store(0).DeletePrefix(root + "v200/");
  auto all = job.store(0).DeletePrefix(root + "v");
  ASSERT_TRUE(last.ok() && all.ok());
  EXPECT_GT(*last, 0);
  EXPECT_LE(*all, 16 * *last);
  std::printf("after 200 syncs: %lld per-version keys left (%lld per version)\n",
              static_cast<long long>(*all + *last), static_cast<long long>(*last));
}

}  // namespace
}  // namespace shardsync
