// Issue 26 (job identity) and issue 24 (fail fast): two jobs on one store and one key prefix never
// merge, the second fails at Connect naming the prefix and the job holding it; a rank that is gone
// fails the ranks waiting on it within about a second, naming it. Ranks are threads of this
// process on the shm transport (the transport separate processes use), each with its own store
// connection, as separate processes would have.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"
#include "store/forked_store.h"
#include "sync/harness.h"
#include "sync/identity.h"
#include "sync_expect.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;
using ::testing::HasSubstr;

constexpr char kToken[] = "identity-test-token-0123456789";

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A 4-rank job: 2 trainer ranks (fsdp=2), 2 engine ranks (tp=2), weights from `seed`.
JobSpec FourRanks(uint64_t seed) {
  JobSpec j =
      testing::Job(testing::TinyQwen2(2, true), "fsdp=2", "dp=1,tp=2,pp=1", "sglang", 16 << 10);
  j.seed = seed;
  return j;
}

// What one rank saw.
struct Outcome {
  Status connect = InternalError("not run");
  Status sync = InternalError("not run");  // the first failed sync, else OK
  bool verified = false;                   // every sync returned a fully verified report
  int64_t mismatches = 0;  // engine ranks: elements that differ from this rank's own job's weights
  double connect_seconds = 0;  // store connection and Connect
};

Outcome Failed(const Status& s) {
  Outcome o;
  o.connect = s;
  return o;
}

// Runs sync rank `rank` of `spec` as its own process would: its own store connection and shm
// transport, bindings from spec.seed, Connect, `syncs` versions, then (engine ranks) the element
// check against spec.seed's weights. `start` (if set) is waited on before connecting; `hold` (if
// set) by a rank that connected, before its session closes, however it ends.
Outcome RunRank(const JobSpec& spec, int rank, const std::string& store, SessionOptions opt,
                int syncs, const std::function<void()>& start = nullptr,
                const std::function<void()>& hold = nullptr, HarnessHooks hooks = {}) {
  Outcome out;
  const auto t0 = Clock::now();
  auto client = StoreClient::Connect(store, kToken, Millis(5000));
  if (!client.ok()) return Failed(client.status());
  auto tx = CreateTransport("shm", {});
  if (!tx.ok()) return Failed(tx.status());
  auto s = CreateHarnessSession(spec.inputs, rank, **client, **tx, opt, std::move(hooks));
  if (!s.ok()) return Failed(s.status());
  SyncSession& session = **s;
  struct AtExit {  // declared after the session: runs before it closes
    const std::function<void()>& fn;
    bool connected = false;
    ~AtExit() {
      if (fn && connected) fn();
    }
  } at_exit{hold};
  job_internal::TrainerShards shards;
  job_internal::EngineParams params;
  auto who = DescribeSyncRank(spec.inputs, rank);
  if (who->is_trainer) {
    shards = std::move(job_internal::FillTrainerShards(spec, who->trainer_rank)).value();
    for (auto& b : shards.bindings) EXPECT_TRUE(session.BindSource(b).ok());
  } else {
    params = std::move(job_internal::AllocateEngineParams(session.ExpectedParams(),
                                                          spec.inputs.options.wire_dtype))
                 .value();
    for (auto& b : params.bindings) EXPECT_TRUE(session.BindDest(b).ok());
  }
  if (start) start();
  out.connect = session.Connect();
  out.connect_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!out.connect.ok()) return out;
  at_exit.connected = true;
  out.verified = true;
  out.sync = OkStatus();
  for (int v = 1; v <= syncs; ++v) {
    auto rep = session.Sync(static_cast<uint64_t>(v));
    if (!rep.ok()) {
      out.sync = rep.status();
      out.verified = false;
      break;
    }
    out.verified =
        out.verified && rep->checksums_total > 0 && rep->checksums_ok == rep->checksums_total;
  }
  if (!who->is_trainer) {
    RankResult rr;
    job_internal::VerifyEngineParams(spec, session.ExpectedParams(), params.bindings, rr);
    out.mismatches = rr.element_mismatches;
  }
  return out;
}

// A launch: its id, and a secret unless `secret` says otherwise ("" for none; nullopt: a fresh
// one drawn for this id, the same for every call naming it).
SessionOptions Options(std::optional<std::string> job_id, Millis connect = Millis(10000),
                       std::optional<std::string> secret = std::nullopt) {
  static std::mutex mu;
  static std::map<std::string, std::string> secrets;
  SessionOptions o;
  if (!secret && job_id) {
    std::lock_guard<std::mutex> lock(mu);
    auto [it, fresh] = secrets.emplace(*job_id, "");
    if (fresh) it->second = GenerateJobSecret().value();
    secret = it->second;
  }
  o.job_secret = std::move(secret);
  o.job_id = std::move(job_id);
  o.connect_timeout = connect;
  o.sync_timeout = Millis(10000);
  return o;
}

// What a launcher does when one of its ranks fails (the local launcher behind `shardsync run`;
// torchrun stops the whole group instead): marks it dead, so ranks of its launch still waiting
// for a claim their rank 0 will never make fail now.
void LauncherSawExit(const std::string& store, const SessionOptions& opt, int rank,
                     const Outcome& o) {
  if (o.connect.ok() || !opt.job_id || opt.job_id->empty()) return;
  auto c = StoreClient::Connect(store, kToken, Millis(5000));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(
      MarkSyncRankDead(**c, opt.prefix, *opt.job_id, rank, "(thread) exited (exit code 1)").ok());
}

// Two jobs started in the same instant on one store and the default prefix "ss/", each rank a
// thread released by one start signal. Returns each job's outcomes.
struct TwoJobs {
  std::vector<Outcome> a, b;
};
TwoJobs RunTwoJobs(const std::string& store, const JobSpec& a, const JobSpec& b,
                   const SessionOptions& oa, const SessionOptions& ob, int syncs) {
  const int world = SyncWorldSize(a.inputs);
  TwoJobs out{std::vector<Outcome>(world), std::vector<Outcome>(world)};
  std::atomic<int> ready{0}, done{0};
  auto start = [&] {
    ++ready;
    while (ready.load() < 2 * world) std::this_thread::yield();
  };
  // A connected rank keeps its session open until every rank of both jobs is done, so the jobs
  // overlap for their whole life (a job that closed before the other began would be no conflict:
  // its claim is gone). A rank that failed to connect counts as done once its launcher noticed.
  auto hold = [&] {
    ++done;
    const auto until = Clock::now() + std::chrono::seconds(60);
    while (done.load() < 2 * world && Clock::now() < until) std::this_thread::yield();
  };
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] {
      out.a[r] = RunRank(a, r, store, oa, syncs, start, hold);
      LauncherSawExit(store, oa, r, out.a[r]);
      if (!out.a[r].connect.ok()) ++done;
    });
    ts.emplace_back([&, r] {
      out.b[r] = RunRank(b, r, store, ob, syncs, start, hold);
      LauncherSawExit(store, ob, r, out.b[r]);
      if (!out.b[r].connect.ok()) ++done;
    });
  }
  for (auto& t : ts) t.join();
  return out;
}

bool AllConnected(const std::vector<Outcome>& job) {
  for (const Outcome& o : job) {
    if (!o.connect.ok()) return false;
  }
  return true;
}

// No rank of `job` reports a verified sync holding an element of another job's weights.
void ExpectNeverVerifiedWrong(const std::vector<Outcome>& job, const std::string& name) {
  for (size_t r = 0; r < job.size(); ++r) {
    if (job[r].verified) {
      EXPECT_EQ(job[r].mismatches, 0)
          << name << " sync rank " << r << " reported verified holding other weights";
    }
  }
}

// Issue 26: 200 idle unauthenticated connections to a store whose descriptor limit is 128 (the
// process holding all but 20) put its accept loop into an EMFILE busy loop and jobs failed with
// deadline_exceeded. Now a 4-rank job connects and syncs, verified, within a second, and the store
// stays quiet (tests/store/store_abuse_test.cc measures its CPU and log).
TEST(StoreFlood, AFourRankJobSyncsThroughAFloodedStoreWithinASecond) {
  rlimit own{};
  getrlimit(RLIMIT_NOFILE, &own);
  if (own.rlim_cur < 512) {
    if (own.rlim_max < 512) GTEST_SKIP() << "needs 512 descriptors in the test process";
    rlimit r{std::min<rlim_t>(own.rlim_max, 4096), own.rlim_max};
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &r), 0);
  }
  testing::ForkedStore store({.nofile = 128, .free_fds = 20}, kToken);
  ASSERT_TRUE(store.ok());
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    const int fd = testing::RawConnect(store.port());
    if (fd >= 0) idle.push_back(fd);
  }
  EXPECT_GE(idle.size(), 190u);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the store works through them
  const JobSpec job = FourRanks(7);
  const int world = SyncWorldSize(job.inputs);
  std::vector<Outcome> out(world);
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] { out[r] = RunRank(job, r, store.address(), Options("flood"), 2); });
  }
  for (auto& t : ts) t.join();
  const double secs = Since(t0);
  std::printf("[idle flood] 4-rank job: connect + 2 syncs in %.0f ms\n", secs * 1e3);
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(out[r].connect.ok()) << "rank " << r << ": " << out[r].connect.ToString();
    EXPECT_TRUE(out[r].sync.ok()) << "rank " << r << ": " << out[r].sync.ToString();
    EXPECT_TRUE(out[r].verified) << "rank " << r;
    EXPECT_EQ(out[r].mismatches, 0) << "rank " << r;
  }
  EXPECT_LT(secs, 1.0);
  EXPECT_TRUE(store.Alive());
  for (int fd : idle) close(fd);
}

// Issue 37's flood: threads that each keep up to 64 connections open to the store without a word,
// opening a new one whenever the store closes one (~3k/s from one thread on the dev VM).
class ReconnectingFlood {
 public:
  ReconnectingFlood(int port, int threads) {
    for (int t = 0; t < threads; ++t) {
      ts_.emplace_back([this, port] {
        std::vector<int> fds;
        while (!stop_.load()) {
          while (fds.size() < 64 && !stop_.load()) {
            const int fd = testing::RawConnect(port);
            if (fd < 0) break;
            fds.push_back(fd);
            ++opened_;
          }
          std::vector<pollfd> p;
          for (int fd : fds) p.push_back({fd, POLLIN, 0});
          if (poll(p.data(), p.size(), 5) <= 0) continue;
          std::vector<int> keep;
          for (const pollfd& q : p) {
            char b;
            if ((q.revents & (POLLIN | POLLHUP | POLLERR)) &&
                recv(q.fd, &b, 1, MSG_DONTWAIT) <= 0) {
              close(q.fd);
            } else {
              keep.push_back(q.fd);
            }
          }
          fds.swap(keep);
        }
        for (int fd : fds) close(fd);
      });
    }
  }
  ~ReconnectingFlood() {
    stop_ = true;
    for (auto& t : ts_) t.join();
  }
  uint64_t opened() const { return opened_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> opened_{0};
  std::vector<std::thread> ts_;
};

// One 4-rank job (connect + 2 syncs, verified) against `store`; its seconds, or -1 if a rank
// failed (printed).
double TimedJob(const std::string& store, const std::string& launch, double* connect = nullptr) {
  const JobSpec job = FourRanks(7);
  std::vector<Outcome> out(4);
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < 4; ++r) {
    ts.emplace_back([&, r] { out[r] = RunRank(job, r, store, Options(launch, Millis(20000)), 2); });
  }
  for (auto& t : ts) t.join();
  const double secs = Since(t0);
  if (connect) {
    *connect = 0;
    for (const Outcome& o : out) *connect = std::max(*connect, o.connect_seconds);
  }
  for (int r = 0; r < 4; ++r) {
    if (!out[r].connect.ok() || !out[r].sync.ok() || !out[r].verified || out[r].mismatches) {
      std::printf("rank %d failed: %s / %s\n", r, out[r].connect.ToString().c_str(),
                  out[r].sync.ToString().c_str());
      return -1;
    }
  }
  return secs;
}

bool RaiseOwnFdLimit() {
  rlimit own{};
  getrlimit(RLIMIT_NOFILE, &own);
  if (own.rlim_cur >= 4096) return true;
  if (own.rlim_max < 1024) return false;
  rlimit r{std::min<rlim_t>(own.rlim_max, 8192), own.rlim_max};
  return setrlimit(RLIMIT_NOFILE, &r) == 0;
}

// Issue 37: a reconnecting flood no longer evicts a job's connections before their hello is read
// (it failed both jobs at fd limit 128 before). Light for CI: one thread, one job, a generous
// bound; bench: StoreFloodBench below.
TEST(StoreFlood, AJobConnectsThroughAReconnectingFlood) {
  if (!RaiseOwnFdLimit()) GTEST_SKIP() << "needs 1024 descriptors in the test process";
  testing::ForkedStore store({.nofile = 128}, kToken);
  ASSERT_TRUE(store.ok());
  ReconnectingFlood flood(store.port(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const double secs = TimedJob(store.address(), "flooded");
  std::printf("[reconnecting flood] %llu connections opened; the job took %.0f ms\n",
              static_cast<unsigned long long>(flood.opened()), secs * 1e3);
  EXPECT_GE(secs, 0) << "the job failed under the flood";
  EXPECT_LT(secs, 15.0);
  EXPECT_TRUE(store.Alive());
}

// The measurement (run by hand: --gtest_also_run_disabled_tests): fd limits 128 and 1024,
// one and eight reconnecting threads, 10 jobs each; docs/security.md records the figures.
TEST(StoreFloodBench, DISABLED_FourRankJobsUnderReconnectingFloods) {
  if (!RaiseOwnFdLimit()) GTEST_SKIP() << "needs 1024 descriptors in the test process";
  for (rlim_t nofile : {rlim_t{128}, rlim_t{1024}}) {
    for (int threads : {1, 8}) {
      testing::ForkedStore store({.nofile = nofile}, kToken);
      ASSERT_TRUE(store.ok());
      ReconnectingFlood flood(store.port(), threads);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      double worst = 0, worst_connect = 0;
      int failed = 0, over = 0, connect_over = 0;
      const double cpu0 = store.CpuSeconds();
      const auto t0 = Clock::now();
      for (int run = 0; run < 10; ++run) {
        double connect = 0;
        const double s = TimedJob(store.address(),
                                  "bench-" + std::to_string(nofile) + "-" +
                                      std::to_string(threads) + "-" + std::to_string(run),
                                  &connect);
        if (s < 0) ++failed;
        worst = std::max(worst, s);
        over += s >= 1.0;
        worst_connect = std::max(worst_connect, connect);
        connect_over += connect >= 1.0;
      }
      std::printf(
          "[flood bench] fd limit %llu, %d thread(s): 10 jobs; connect worst %.0f ms (%d over "
          "1 s); connect + 2 syncs worst %.0f ms (%d over 1 s), %d failed; flood opened %.0f "
          "connections/s; store CPU %.0f%%\n",
          static_cast<unsigned long long>(nofile), threads, worst_connect * 1e3, connect_over,
          worst * 1e3, over, failed, flood.opened() / Since(t0),
          100 * (store.CpuSeconds() - cpu0) / Since(t0));
      EXPECT_EQ(failed, 0);
    }
  }
}

// The acceptance test of issue 26: 20 trials of two concurrent 4-rank jobs with different seeds
// on one store and the default prefix, launched as `shardsync run` / torchrun launch them (each
// with its launch id). Exactly one job syncs, verified with its own weights; every rank of the
// other fails at Connect naming the prefix and the job holding it.
TEST(JobIdentity, TwoConcurrentJobsOnOnePrefixNeverMerge) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const JobSpec a = FourRanks(11), b = FourRanks(22);
  const auto t0 = Clock::now();
  int a_won = 0;
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const std::string la = "job-a-" + std::to_string(trial), lb = "job-b-" + std::to_string(trial);
    TwoJobs t = RunTwoJobs((*server)->address(), a, b, Options(la), Options(lb), 2);
    ExpectNeverVerifiedWrong(t.a, "job a");
    ExpectNeverVerifiedWrong(t.b, "job b");
    ASSERT_NE(AllConnected(t.a), AllConnected(t.b)) << "exactly one job must connect";
    const bool a_wins = AllConnected(t.a);
    a_won += a_wins;
    const auto& winner = a_wins ? t.a : t.b;
    const auto& loser = a_wins ? t.b : t.a;
    const std::string holder = a_wins ? la : lb;
    for (size_t r = 0; r < winner.size(); ++r) {
      EXPECT_TRUE(winner[r].sync.ok()) << "winner rank " << r << ": " << winner[r].sync.ToString();
      EXPECT_TRUE(winner[r].verified) << "winner rank " << r;
      EXPECT_EQ(winner[r].mismatches, 0);
    }
    int named = 0;  // loser ranks that name the prefix and the job holding it
    for (size_t r = 0; r < loser.size(); ++r) {
      const Status& st = loser[r].connect;
      if (st.code() == StatusCode::kUnavailable) {
        // Another rank of its launch had failed and exited before it looked (its launcher said
        // so): e.g. it started after the winner gave the prefix back, its rank 0 refused earlier.
        EXPECT_THAT(st.message(), HasSubstr("(thread) exited (exit code 1)")) << st.ToString();
        continue;
      }
      EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition)
          << "loser rank " << r << ": " << st.ToString();
      EXPECT_THAT(st.message(), HasSubstr("key prefix 'ss/'"));
      EXPECT_THAT(st.message(), HasSubstr("launch '" + holder + "'"));
      ++named;
    }
    EXPECT_GT(named, 0) << "the first loser rank to look names the prefix and its holder";
  }
  std::printf("20 trials in %.2f s; job a won %d of them\n", Since(t0), a_won);
}

bool AnyVerifiedWrong(const std::vector<Outcome>& job) {
  return std::any_of(job.begin(), job.end(),
                     [](const Outcome& o) { return o.verified && o.mismatches != 0; });
}

// Issue 37: without any launch identity two jobs on one store and prefix cannot be told apart
// (issue 26's residual case: a rank starting after the other job sealed took its place), so a job
// of several ranks with neither an id nor a secret refuses to connect, naming the ways to give
// one. 24 trials of two such jobs started together: every rank refuses, none ever verifies.
TEST(JobIdentity, TwoJobsWithoutLaunchIdentityRefuseToConnectSoNeverMerge) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const JobSpec a = FourRanks(11), b = FourRanks(22);
  const SessionOptions none = Options("", Millis(2000), "");
  for (int trial = 0; trial < 24; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    TwoJobs t = RunTwoJobs((*server)->address(), a, b, none, none, 1);
    EXPECT_FALSE(AnyVerifiedWrong(t.a) || AnyVerifiedWrong(t.b));
    for (const auto* job : {&t.a, &t.b}) {
      for (const Outcome& o : *job) {
        EXPECT_EQ(o.connect.code(), StatusCode::kFailedPrecondition) << o.connect.ToString();
        EXPECT_THAT(o.connect.message(), HasSubstr("no launch identity"));
        EXPECT_THAT(o.connect.message(), HasSubstr("shardsync.new_launch()"));
        EXPECT_FALSE(o.verified);
      }
    }
  }
}

// Issue 26's residual case, now with launch identities: job b's ranks 0 and 1 and job a's ranks 2
// and 3 start first, as if each job's other half were late. a's ranks refuse b's claim (another
// launch), b's job never gets ranks 2 and 3: no rank of either ever syncs with the other's.
TEST(JobIdentity, EarlyRanksOfAnotherLaunchNeverFillAJobsSlots) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const JobSpec a = FourRanks(11), b = FourRanks(22);
  std::vector<Outcome> early(4);
  std::vector<std::thread> ts;
  for (int r = 0; r < 4; ++r) {
    ts.emplace_back([&, r] {
      early[r] = RunRank(r < 2 ? b : a, r, (*server)->address(),
                         Options(r < 2 ? "late-b" : "late-a", Millis(800)), 1);
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_FALSE(AnyVerifiedWrong(early));
  for (int r = 0; r < 4; ++r) {
    EXPECT_FALSE(early[r].connect.ok()) << "rank " << r;
  }
  for (int r = 2; r < 4; ++r) {
    EXPECT_EQ(early[r].connect.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(early[r].connect.message(), HasSubstr("held by another launch's job"));
  }
}

// How the lone process of issue 37 comes: no launch identity, the job's id (ids are not secret),
// the job's id with a secret of its own, another launch's id and secret.
enum class Intruder { kNoIdentity, kJobIdOnly, kJobIdWrongSecret, kOtherLaunch };
const char* IntruderName(Intruder i) {
  switch (i) {
    case Intruder::kNoIdentity:
      return "no identity";
    case Intruder::kJobIdOnly:
      return "the job's id";
    case Intruder::kJobIdWrongSecret:
      return "the job's id and a wrong secret";
    case Intruder::kOtherLaunch:
      return "another launch";
  }
  return "?";
}

// Issue 37: a 4-rank job whose trainer rank 1 starts late, and a lone process that claims rank 1
// first, with other weights (seed 99). Run by `IntruderTrial` for each kind of intruder: no rank of
// the job may report a verified sync holding the intruder's weights; the intruder is refused.
struct IntruderTrial {
  Outcome intruder;
  std::vector<Outcome> job;
};
IntruderTrial RunIntruderTrial(const std::string& store, Intruder kind, int trial) {
  const JobSpec mine = FourRanks(11), theirs = FourRanks(99);
  const std::string id =
      "intruded-" + std::to_string(trial) + "-" + std::to_string(static_cast<int>(kind));
  const SessionOptions opt = Options(id, Millis(4000));
  SessionOptions bad;
  switch (kind) {
    case Intruder::kNoIdentity:
      bad = Options("", Millis(4000), "");
      break;
    case Intruder::kJobIdOnly:
      bad = Options(id, Millis(4000), "");
      break;
    case Intruder::kJobIdWrongSecret:
      bad = Options(id, Millis(4000), GenerateJobSecret().value());
      break;
    case Intruder::kOtherLaunch:
      bad = Options("other-" + id, Millis(4000));
      break;
  }
  IntruderTrial t{Outcome{}, std::vector<Outcome>(4)};
  std::atomic<bool> intruder_done{false};
  std::vector<std::thread> ts;
  for (int r : {0, 2, 3}) {
    ts.emplace_back([&, r] { t.job[r] = RunRank(mine, r, store, opt, 2); });
  }
  ts.emplace_back([&] {
    t.intruder = RunRank(theirs, 1, store, bad, 2);
    intruder_done = true;
  });
  // The job's own rank 1 comes once the intruder had its chance (or after 300 ms).
  ts.emplace_back([&] {
    const auto until = Clock::now() + std::chrono::milliseconds(300);
    while (!intruder_done.load() && Clock::now() < until) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    t.job[1] = RunRank(mine, 1, store, opt, 2);
  });
  for (auto& th : ts) th.join();
  return t;
}

TEST(JobIdentity, ALoneProcessNeverTakesALateRanksSlot) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  int trial = 0;
  for (Intruder kind : {Intruder::kNoIdentity, Intruder::kJobIdOnly, Intruder::kJobIdWrongSecret,
                        Intruder::kOtherLaunch}) {
    for (int i = 0; i < 2; ++i, ++trial) {
      SCOPED_TRACE(std::string("intruder with ") + IntruderName(kind) + ", trial " +
                   std::to_string(i));
      IntruderTrial t = RunIntruderTrial((*server)->address(), kind, trial);
      EXPECT_FALSE(AnyVerifiedWrong(t.job));
      EXPECT_FALSE(t.intruder.connect.ok()) << "the intruder joined the job";
      EXPECT_EQ(t.intruder.connect.code(), StatusCode::kFailedPrecondition)
          << t.intruder.connect.ToString();
      for (int r = 0; r < 4; ++r) {
        // The intruder refused itself before taking anything: the job runs whole.
        EXPECT_TRUE(t.job[r].connect.ok()) << "rank " << r << ": " << t.job[r].connect.ToString();
        EXPECT_TRUE(t.job[r].verified) << "rank " << r;
        EXPECT_EQ(t.job[r].mismatches, 0) << "rank " << r;
      }
    }
  }
}

// A process that writes the store by hand (it holds the token, not the launch secret) takes rank
// 1's member and liveness keys before rank 1 comes: rank 1 finds its slot claimed twice and the job
// fails at Connect on every rank, naming both claimants and that the first proves no secret.
TEST(JobIdentity, AHandWrittenClaimOfASlotFailsTheJobNamingBothClaimants) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const std::string address = (*server)->address();
  const JobSpec spec = FourRanks(11);
  const SessionOptions opt = Options("hand-written", Millis(3000));
  auto intruder = StoreClient::Connect(address, kToken, Millis(5000));
  ASSERT_TRUE(intruder.ok());
  std::vector<Outcome> out(4);
  std::vector<std::thread> ts;
  std::atomic<bool> planted{false};
  for (int r : {0, 2, 3}) ts.emplace_back([&, r] { out[r] = RunRank(spec, r, address, opt, 1); });
  ts.emplace_back([&] {
    // Waits for rank 0's claim, then plants rank 1's keys as a raw store client would.
    uint64_t nonce = 0;
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (nonce == 0 && Clock::now() < until) {
      auto c = (*intruder)->Get(sync_internal::ClaimKey("ss/"), Millis(100));
      if (c.ok()) nonce = sync_internal::ParseClaim(*c, "claim").value().nonce;
    }
    const std::string root = sync_internal::JobRoot("ss/", nonce);
    EXPECT_TRUE((*intruder)->Set(root + "member/1", "0badc0de 666@elsewhere -").ok());
    EXPECT_TRUE((*intruder)->SetEphemeral(root + "alive/1", "0badc0de").ok());
    planted = true;
  });
  ts.emplace_back([&] {
    while (!planted.load()) std::this_thread::yield();
    out[1] = RunRank(spec, 1, address, opt, 1);
  });
  for (auto& t : ts) t.join();
  EXPECT_FALSE(AnyVerifiedWrong(out));
  for (int r = 0; r < 4; ++r) EXPECT_FALSE(out[r].connect.ok()) << "rank " << r;
  EXPECT_THAT(out[1].connect.message(), HasSubstr("was claimed twice"));
  EXPECT_THAT(out[1].connect.message(), HasSubstr("666@elsewhere"));
  EXPECT_THAT(out[1].connect.message(), HasSubstr("does not prove the launch secret"));
  EXPECT_THAT(out[0].connect.message(), HasSubstr("was claimed twice"));
}

// Rank 0 seals only when every member key proves the launch secret: here rank 1's is replaced
// (as a token holder could) after it joined; the job fails at the seal naming rank 1.
TEST(JobIdentity, RankZeroSealsOnlyWhenEveryMemberProvesTheSecret) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const std::string address = (*server)->address();
  const JobSpec spec = FourRanks(11);
  const SessionOptions opt = Options("swapped-member", Millis(3000));
  auto raw = StoreClient::Connect(address, kToken, Millis(5000));
  ASSERT_TRUE(raw.ok());
  HarnessHooks hooks;
  hooks.before_transport_connect = [&](Transport&) {
    EXPECT_TRUE((*raw)->Set(testing::JobRoot(**raw) + "member/1", "0badc0de 666@elsewhere -").ok());
    return OkStatus();
  };
  std::vector<Outcome> out(4);
  std::vector<std::thread> ts;
  for (int r = 0; r < 4; ++r) {
    ts.emplace_back([&, r] {
      out[r] = RunRank(spec, r, address, opt, 1, nullptr, nullptr, r == 0 ? hooks : HarnessHooks{});
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 4; ++r) EXPECT_FALSE(out[r].connect.ok()) << "rank " << r;
  EXPECT_THAT(out[0].connect.message(), HasSubstr("sync rank 1 was claimed by process "
                                                  "666@elsewhere"));
  EXPECT_THAT(out[0].connect.message(), HasSubstr("without the launch's secret"));
}

// A job whose sessions stay alive between calls: store connections, shm transports, sessions and
// their buffers, one per rank.
class LiveJob {
 public:
  LiveJob(const JobSpec& spec, const std::string& store, const SessionOptions& opt)
      : spec_(spec), world_(SyncWorldSize(spec.inputs)), ranks_(world_) {
    for (int r = 0; r < world_; ++r) {
      Rank& k = ranks_[r];
      k.store = std::move(StoreClient::Connect(store, kToken, Millis(5000))).value();
      k.tx = std::move(CreateTransport("shm", {})).value();
      k.session = std::move(SyncSession::Create(spec.inputs, r, *k.store, *k.tx, opt)).value();
      auto who = DescribeSyncRank(spec.inputs, r);
      if (who->is_trainer) {
        k.shards = std::move(job_internal::FillTrainerShards(spec, who->trainer_rank)).value();
        for (auto& b : k.shards.bindings) EXPECT_TRUE(k.session->BindSource(b).ok());
      } else {
        k.params = std::move(job_internal::AllocateEngineParams(k.session->ExpectedParams(),
                                                                spec.inputs.options.wire_dtype))
                       .value();
        for (auto& b : k.params.bindings) EXPECT_TRUE(k.session->BindDest(b).ok());
      }
    }
  }
  std::vector<Status> All(const std::function<Status(SyncSession&, int)>& fn) {
    return testing::RunOnAll(world_, [&](int r) { return fn(*ranks_[r].session, r); });
  }
  std::vector<Status> Connect() {
    return All([](SyncSession& s, int) { return s.Connect(); });
  }
  std::vector<Status> Sync(uint64_t v) {
    return All([v](SyncSession& s, int) { return s.Sync(v).status(); });
  }
  int64_t Mismatches() { return testing::EngineMismatches(spec_, ranks_); }
  StoreClient& store(int r) { return *ranks_[r].store; }
  SyncSession& session(int r) { return *ranks_[r].session; }
  // Ends rank r as a killed process would: its session and store connection go.
  void Drop(int r) {
    ranks_[r].session.reset();
    ranks_[r].store.reset();
  }
  int world() const { return world_; }

 private:
  struct Rank {
    std::unique_ptr<StoreClient> store;
    std::unique_ptr<Transport> tx;
    std::unique_ptr<SyncSession> session;
    job_internal::TrainerShards shards;
    job_internal::EngineParams params;
  };
  JobSpec spec_;
  int world_;
  std::vector<Rank> ranks_;
};

// A second job on a prefix another job holds fails at Connect on every rank, naming the prefix and
// the holder, at once; the first job goes on syncing.
TEST(JobIdentity, SecondJobFailsAtConnectAndTheFirstGoesOn) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const std::string address = (*server)->address();
  const JobSpec a = FourRanks(11), b = FourRanks(22);
  LiveJob first(a, address, Options("first"));
  testing::ExpectAllOk(first.Connect());
  testing::ExpectAllOk(first.Sync(1));
  const int world = first.world();
  std::vector<Outcome> second(world);
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] { second[r] = RunRank(b, r, address, Options("second"), 1); });
  }
  for (auto& t : ts) t.join();
  EXPECT_LT(Since(t0), 5.0) << "the second job must fail at once, not at its timeout";
  const std::string holder = "job " + sync_internal::Hex(testing::JobNonce(first.store(0)));
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(second[r].connect.code(), StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << second[r].connect.ToString();
    EXPECT_THAT(second[r].connect.message(), HasSubstr("key prefix 'ss/'"));
    EXPECT_THAT(second[r].connect.message(), HasSubstr(holder));
  }
  testing::ExpectAllOk(first.Sync(2));
  testing::ExpectAllOk(first.Sync(3));
  EXPECT_EQ(first.Mismatches(), 0);
}

// Issue 37: a slot claimed twice by processes that both hold the launch secret (a rank started
// twice) fails the job naming both, even after the seal: the sealed job must not go on with the
// first comer. The second claimant fails at Connect; the job's next sync fails on every rank.
TEST(JobIdentity, ASlotClaimedTwiceAfterTheSealFailsTheJobNamingBoth) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const std::string address = (*server)->address();
  const JobSpec spec = FourRanks(11);
  const SessionOptions opt = Options("twice", Millis(3000));
  LiveJob job(spec, address, opt);
  testing::ExpectAllOk(job.Connect());
  testing::ExpectAllOk(job.Sync(1));
  const Outcome second = RunRank(spec, 1, address, opt, 1);
  EXPECT_EQ(second.connect.code(), StatusCode::kFailedPrecondition) << second.connect.ToString();
  EXPECT_THAT(second.connect.message(), HasSubstr("sync rank 1 of job"));
  EXPECT_THAT(second.connect.message(), HasSubstr("was claimed twice"));
  EXPECT_THAT(second.connect.message(), HasSubstr("proves the launch secret"));
  EXPECT_THAT(second.connect.message(), HasSubstr("now failed on every rank"));
  // Every rank's liveness key died naming both claimants: the job's next wait that looks at
  // them (at once at Connect, after 200 ms in a sync) fails with that reason.
  for (int r = 0; r < job.world(); ++r) {
    auto alive =
        job.store(0).Get(testing::JobRoot(job.store(0)) + "alive/" + std::to_string(r), Millis(0));
    EXPECT_EQ(alive.status().code(), StatusCode::kUnavailable) << "rank " << r;
    EXPECT_THAT(alive.status().message(), HasSubstr("was claimed twice")) << "rank " << r;
  }
}

// Issue 37: a finished job leaves no key in the store: the last rank to close deletes the job's
// namespace (dead keys included); what stays is one dead claim key per prefix.
TEST(JobIdentity, AFinishedJobLeavesNoKeys) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const std::string address = (*server)->address();
  auto probe = StoreClient::Connect(address, kToken, Millis(5000));
  ASSERT_TRUE(probe.ok());
  for (int i = 0; i < 3; ++i) {
    std::string root;
    {
      LiveJob job(FourRanks(11), address, Options("finished-" + std::to_string(i)));
      testing::ExpectAllOk(job.Connect());
      testing::ExpectAllOk(job.Sync(1));
      root = testing::JobRoot(**probe);
    }
    // DeletePrefix counts the live keys it removed: none are left under the job's root.
    auto left = (*probe)->DeletePrefix(root);
    ASSERT_TRUE(left.ok());
    EXPECT_EQ(*left, 0) << "job " << i << " left keys under " << root;
    auto dead = (*probe)->Get(root + "alive/0", Millis(0));
    EXPECT_EQ(dead.status().code(), StatusCode::kDeadlineExceeded)
        << "its dead keys too: " << dead.status().ToString();
  }
}

// ---- fail fast (issue 24) ----

// The store of one rank that can be cut off as a killed process's would be: its connection closes
// (its ephemeral keys die on the server) and every later call fails.
class SeverableStore final : public StoreClient {
 public:
  explicit SeverableStore(std::unique_ptr<StoreClient> inner) : inner_(std::move(inner)) {}
  void Sever() {
    std::lock_guard<std::mutex> lock(mu_);
    inner_.reset();
  }
  Status Set(const std::string& k, std::string_view v) override {
    return Do([&](StoreClient& c) { return c.Set(k, v); });
  }
  Result<std::string> Get(const std::string& k, Millis t) override {
    return Do([&](StoreClient& c) { return c.Get(k, t); });
  }
  Result<int64_t> Add(const std::string& k, int64_t d) override {
    return Do([&](StoreClient& c) { return c.Add(k, d); });
  }
  Status Wait(const std::vector<std::string>& k, Millis t) override {
    return Do([&](StoreClient& c) { return c.Wait(k, t); });
  }
  Result<std::vector<std::string>> GetMany(const std::vector<std::string>& k, Millis t) override {
    return Do([&](StoreClient& c) { return c.GetMany(k, t); });
  }
  Status SetMany(const std::vector<std::pair<std::string, std::string>>& kv) override {
    return Do([&](StoreClient& c) { return c.SetMany(kv); });
  }
  Result<std::vector<std::string>> SetThenGetMany(const std::string& k, std::string_view v,
                                                  const std::vector<std::string>& keys,
                                                  Millis t) override {
    return Do([&](StoreClient& c) { return c.SetThenGetMany(k, v, keys, t); });
  }
  Status Barrier(const std::string& n, int w, Millis t) override {
    return Do([&](StoreClient& c) { return c.Barrier(n, w, t); });
  }
  Result<int64_t> DeletePrefix(const std::string& p) override {
    return Do([&](StoreClient& c) { return c.DeletePrefix(p); });
  }
  Status DeletePrefixes(const std::vector<std::string>& p) override {
    return Do([&](StoreClient& c) { return c.DeletePrefixes(p); });
  }
  Status SetEphemeral(const std::string& k, std::string_view v) override {
    return Do([&](StoreClient& c) { return c.SetEphemeral(k, v); });
  }
  Result<std::string> SetIfAbsent(const std::string& k, std::string_view v, bool e) override {
    return Do([&](StoreClient& c) { return c.SetIfAbsent(k, v, e); });
  }
  Status MarkDead(const std::string& k, std::string_view r) override {
    return Do([&](StoreClient& c) { return c.MarkDead(k, r); });
  }

 private:
  template <typename F>
  auto Do(F f) -> decltype(f(std::declval<StoreClient&>())) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!inner_) return UnavailableError("store connection severed");
    return f(*inner_);
  }
  std::mutex mu_;
  std::unique_ptr<StoreClient> inner_;
};

// Issue 24's acceptance test: a rank killed before it connects (here: never started; its
// launcher marks it dead as `shardsync run`'s does) fails every other rank in under 2 s, naming
// it, whether it is rank 0 (the others wait for its claim) or another (they wait in the job).
TEST(FailFast, RankDeadBeforeConnectFailsTheOthersNamingIt) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const JobSpec spec = FourRanks(5);
  const int world = SyncWorldSize(spec.inputs);
  for (int dead : {2, 0}) {
    SCOPED_TRACE("dead rank " + std::to_string(dead));
    const std::string launch = "failfast-" + std::to_string(dead);
    const std::string prefix = "ff" + std::to_string(dead) + "/";
    SessionOptions opt = Options(launch, Millis(30000));
    opt.prefix = prefix;
    std::vector<Outcome> out(world);
    std::vector<double> ended(world, 0);
    std::atomic<int> started{0};
    const auto t0 = Clock::now();
    std::vector<std::thread> ts;
    for (int r = 0; r < world; ++r) {
      if (r == dead) continue;
      ts.emplace_back([&, r] {
        out[r] = RunRank(spec, r, (*server)->address(), opt, 1, [&] { ++started; });
        ended[r] = Since(t0);
      });
    }
    while (started.load() < world - 1) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // they wait in Connect
    auto launcher = StoreClient::Connect((*server)->address(), kToken, Millis(5000));
    ASSERT_TRUE(launcher.ok());
    const double marked = Since(t0);
    // As the local launcher does: again until the job's claim exists.
    bool in_job = false;
    while (!in_job && Since(t0) < 10) {
      auto m = MarkSyncRankDead(**launcher, prefix, launch, dead,
                                "(pid 4242) exited (killed by signal 9)");
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      in_job = *m || dead == 0;
      if (!in_job) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (auto& t : ts) t.join();
    double slowest = 0;
    for (int r = 0; r < world; ++r) {
      if (r != dead) slowest = std::max(slowest, ended[r] - marked);
    }
    std::printf("rank %d marked dead: the others failed within %.3f s\n", dead, slowest);
    for (int r = 0; r < world; ++r) {
      if (r == dead) continue;
      EXPECT_FALSE(out[r].connect.ok()) << "rank " << r;
      EXPECT_THAT(out[r].connect.message(), HasSubstr("sync rank " + std::to_string(dead)))
          << "rank " << r;
      EXPECT_THAT(out[r].connect.message(), HasSubstr("killed by signal 9")) << "rank " << r;
      EXPECT_LT(ended[r] - marked, 2.0) << "rank " << r << ": " << out[r].connect.ToString();
    }
  }
}

// A rank whose store connection drops at Connect (the process died: no launcher told anyone)
// fails the ranks waiting on it, at once, naming it; and one that leaves in the middle of the
// job fails the next sync of every other rank within about a second, not at the sync timeout.
TEST(FailFast, RankWhoseConnectionDropsFailsTheOthersNamingIt) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  const JobSpec spec = FourRanks(6);
  const int world = SyncWorldSize(spec.inputs);
  const int victim = 3;
  std::vector<Status> st(world);
  std::vector<double> ended(world, 0);
  Clock::time_point severed_at{};
  std::mutex mu;
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] {
      auto inner = StoreClient::Connect((*server)->address(), kToken, Millis(5000));
      ASSERT_TRUE(inner.ok());
      SeverableStore store(std::move(*inner));
      auto tx = CreateTransport("shm", {});
      ASSERT_TRUE(tx.ok());
      HarnessHooks hooks;
      if (r == victim) {
        // Dies after joining the job (its liveness key set), before its transport connects.
        hooks.before_transport_connect = [&](Transport&) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          {
            std::lock_guard<std::mutex> lock(mu);
            severed_at = Clock::now();
          }
          store.Sever();
          return UnavailableError("killed");
        };
      }
      auto s = CreateHarnessSession(spec.inputs, r, store, **tx, Options("", Millis(30000)), hooks);
      ASSERT_TRUE(s.ok());
      auto who = DescribeSyncRank(spec.inputs, r);
      job_internal::TrainerShards shards;
      job_internal::EngineParams params;
      if (who->is_trainer) {
        shards = std::move(job_internal::FillTrainerShards(spec, who->trainer_rank)).value();
        for (auto& b : shards.bindings) ASSERT_TRUE((*s)->BindSource(b).ok());
      } else {
        params = std::move(job_internal::AllocateEngineParams((*s)->ExpectedParams(),
                                                              spec.inputs.options.wire_dtype))
                     .value();
        for (auto& b : params.bindings) ASSERT_TRUE((*s)->BindDest(b).ok());
      }
      st[r] = (*s)->Connect();
      ended[r] = Since(t0);
    });
  }
  for (auto& t : ts) t.join();
  const double severed = std::chrono::duration<double>(severed_at - t0).count();
  double slowest = 0;
  for (int r = 0; r < world; ++r) {
    if (r != victim) slowest = std::max(slowest, ended[r] - severed);
  }
  std::printf("rank %d's connection dropped at connect: the others failed within %.3f s\n", victim,
              slowest);
  for (int r = 0; r < world; ++r) {
    if (r == victim) continue;
    EXPECT_EQ(st[r].code(), StatusCode::kUnavailable) << "rank " << r << ": " << st[r].ToString();
    EXPECT_THAT(st[r].message(), HasSubstr("sync rank " + std::to_string(victim) + " is gone"));
    EXPECT_LT(ended[r] - severed, 2.0) << "rank " << r;
  }

  // In the middle of the job: rank 3's session and connection go between two syncs.
  LiveJob job(spec, (*server)->address(), Options("", Millis(30000)));
  testing::ExpectAllOk(job.Connect());
  testing::ExpectAllOk(job.Sync(1));
  job.Drop(victim);
  const auto t1 = Clock::now();
  auto sync2 = job.All([&](SyncSession& s, int r) -> Status {
    if (r == victim) return OkStatus();
    return s.Sync(2).status();
  });
  std::printf("rank %d left between syncs: the next sync failed everywhere in %.3f s\n", victim,
              Since(t1));
  EXPECT_LT(Since(t1), 2.0) << "the sync timeout is 10 s";
  for (int r = 0; r < world; ++r) {
    if (r == victim) continue;
    EXPECT_FALSE(sync2[r].ok()) << "rank " << r;
    // The first to notice names the rank; the others may echo its abort.
    EXPECT_THAT(sync2[r].message(), HasSubstr("sync rank " + std::to_string(victim)))
        << sync2[r].ToString();
  }
}

}  // namespace
}  // namespace shardsync
