// The session's prepared-pair protocol (what device transports use), driven on the CPU: a fake
// transport registered for host memory whose pairs pack, "send" and unpack with the CPU packer
// through an in-process wire, reached through the routed transport. Checks that a prepared sync
// is element-exact, that a corrupted bucket is DataLoss naming its parameters and a clean sync
// clears the poison, and that a sender that never delivers fails every rank within the timeout
// with the receivers' pairs cancelled, after which a re-connected job syncs again.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "shardsync/checksum.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"
#include "sync_expect.h"

namespace shardsync {
namespace {

using ::testing::HasSubstr;

// The in-process wire and the fault switches, shared by every fake pair.
struct Wire {
  std::mutex mu;
  std::map<std::tuple<int, int, uint64_t>, std::vector<std::vector<unsigned char>>> msgs;
  std::atomic<int> flip_from{-1};  // this sender flips a byte of its first bucket to flip_to
  std::atomic<int> flip_to{-1};
  std::atomic<int> silent_from{-1};       // this sender never delivers
  std::atomic<bool> deliver_sums{false};  // pairs made now carry the packed sums with the data
  std::atomic<bool> signal_ready{false};  // senders made now wait for their receiver's Post
  std::set<std::tuple<int, int, uint64_t>> ready;  // (sender, receiver, version) posted
  std::map<std::tuple<int, int, uint64_t>, std::vector<uint64_t>> sums;
  std::atomic<int> posts{0}, cancels{0};
};
Wire& TheWire() {
  static Wire w;
  return w;
}

class FakePair final : public PreparedPair {
 public:
  FakePair(int self, PairSpec spec)
      : self_(self),
        spec_(std::move(spec)),
        deliver_(TheWire().deliver_sums),
        signal_(TheWire().signal_ready) {}

  Status Post(uint64_t version) override {
    if (cancelled_) return AbortedError("fake pair cancelled");
    ++TheWire().posts;
    version_ = version;
    posted_ = true;
    if (!spec_.send) {
      std::lock_guard<std::mutex> lk(TheWire().mu);
      TheWire().ready.insert({spec_.peer, self_, version});
      return OkStatus();
    }
    sums_.packed.clear();
    std::vector<std::vector<unsigned char>> msg;
    for (const PairBucket& b : spec_.buckets) {
      std::vector<unsigned char> bytes(static_cast<size_t>(b.bytes));
      SS_ASSIGN_OR_RETURN(uint64_t sum, packer_->Pack(b.local, spec_.wire, bytes.data(), b.bytes));
      sums_.packed.push_back(sum);
      msg.push_back(std::move(bytes));
    }
    if (TheWire().flip_from == self_ && TheWire().flip_to == spec_.peer)
      msg[0][msg[0].size() / 2] ^= 0x40;
    if (TheWire().silent_from == self_) return OkStatus();
    held_ = std::move(msg);
    return Deliver();
  }
  // Puts the held message on the wire, unless it waits for the receiver's Post (signal_).
  Status Deliver() {
    std::lock_guard<std::mutex> lk(TheWire().mu);
    if (held_.empty()) return OkStatus();
    if (signal_ && !TheWire().ready.count({self_, spec_.peer, version_})) return OkStatus();
    TheWire().msgs[{self_, spec_.peer, version_}] = std::move(held_);
    held_.clear();
    if (deliver_) TheWire().sums[{self_, spec_.peer, version_}] = sums_.packed;
    return OkStatus();
  }
  Result<XferState> Poll() override {
    if (posted_ && spec_.send) {
      SS_RETURN_IF_ERROR(Deliver());
      if (!held_.empty()) return XferState::kInProgress;
    }
    if (!posted_ || spec_.send) {
      posted_ = false;
      return XferState::kDone;
    }
    std::vector<std::vector<unsigned char>> msg;
    {
      std::lock_guard<std::mutex> lk(TheWire().mu);
      auto it = TheWire().msgs.find({spec_.peer, self_, version_});
      if (it == TheWire().msgs.end()) return XferState::kInProgress;
      msg = std::move(it->second);
      TheWire().msgs.erase(it);
      sums_.packed.clear();
      if (deliver_) {
        sums_.packed = TheWire().sums[{spec_.peer, self_, version_}];
        TheWire().sums.erase({spec_.peer, self_, version_});
      }
    }
    sums_.landed.clear();
    for (size_t b = 0; b < spec_.buckets.size(); ++b) {
      const PairBucket& pb = spec_.buckets[b];
      SS_RETURN_IF_ERROR(packer_->Unpack(msg[b].data(), spec_.wire, pb.bytes, pb.local));
      SS_ASSIGN_OR_RETURN(uint64_t sum, packer_->ChecksumLanded(pb.local, pb.bytes));
      sums_.landed.push_back(sum);
    }
    posted_ = false;
    return XferState::kDone;
  }
  Result<PairSums> Sums() override { return sums_; }
  bool DeliversSums() const override { return deliver_ && spec_.send; }
  bool SignalsReady() const override { return signal_ && spec_.send; }
  void Cancel() override {
    if (!posted_) return;
    cancelled_ = true;
    ++TheWire().cancels;
  }
  std::string Describe() const override { return "fake pair"; }

 private:
  int self_;
  PairSpec spec_;
  std::unique_ptr<Packer> packer_ = MakeCpuPacker();
  PairSums sums_;
  std::vector<std::vector<unsigned char>> held_;  // the sender's message, until it may go
  bool deliver_, signal_;
  uint64_t version_ = 0;
  bool posted_ = false, cancelled_ = false;
};

// Loopback for everything else (connect, flushes), prepared pairs on host memory.
class FakePreparedTransport final : public Transport {
 public:
  explicit FakePreparedTransport(std::unique_ptr<Transport> inner) : in_(std::move(inner)) {}
  std::string_view name() const override { return "fake_prepared"; }
  TransportCaps caps() const override {
    TransportCaps c = in_->caps();
    c.prepared = true;
    return c;
  }
  bool CanConnect(const PeerInfo& a, const PeerInfo& b) const override {
    return in_->CanConnect(a, b);
  }
  Result<uint32_t> RegisterMemory(const MemRegion& r) override { return in_->RegisterMemory(r); }
  Status Connect(StoreClient&, const std::string&, int rank, const std::vector<int>& peers,
                 Millis t) override {
    rank_ = rank;
    return ConnectLoopbackDirect(*in_, rank, peers, t);
  }
  Result<XferId> PostPut(int peer, const void* src, size_t n, uint32_t r, uint64_t o) override {
    return in_->PostPut(peer, src, n, r, o);
  }
  Result<XferId> PostFlush(int peer) override { return in_->PostFlush(peer); }
  Result<XferId> PostSend(int peer, uint64_t tag, const void* b, size_t n) override {
    return in_->PostSend(peer, tag, b, n);
  }
  Result<XferId> PostRecv(int peer, uint64_t tag, void* b, size_t n) override {
    return in_->PostRecv(peer, tag, b, n);
  }
  Result<XferState> Poll(XferId id) override { return in_->Poll(id); }
  void Abort() override { in_->Abort(); }
  Result<std::unique_ptr<PreparedPair>> Prepare(StoreClient&, const PairSpec& spec,
                                                Millis) override {
    return std::unique_ptr<PreparedPair>(new FakePair(rank_, spec));
  }

 private:
  std::unique_ptr<Transport> in_;
  int rank_ = -1;
};

void RegisterFake() {
  static const bool once = [] {
    TransportEntry e;
    e.name = "fake_prepared";
    e.priority = 900;
    e.auto_select = false;
    e.can_connect = [](const PeerInfo& a, const PeerInfo& b) {
      return a.mem == MemKind::kHost && b.mem == MemKind::kHost;
    };
    e.factory = [](const TransportOptions& o) -> Result<std::unique_ptr<Transport>> {
      return std::unique_ptr<Transport>(
          new FakePreparedTransport(NewLoopbackTransport(o.loopback_hub)));
    };
    EXPECT_TRUE(RegisterTransport(std::move(e)).ok());
    return true;
  }();
  (void)once;
}

// Every rank of a job on routed transports that pick the fake for every pair.
class RoutedJob {
 public:
  RoutedJob(JobSpec spec, const std::string& prefix, Millis timeout)
      : spec_(std::move(spec)), world_(SyncWorldSize(spec_.inputs)), ranks_(world_) {
    RegisterFake();
    {  // an earlier job's failed sync may have left messages for the same (ranks, version)
      std::lock_guard<std::mutex> lk(TheWire().mu);
      TheWire().msgs.clear();
      TheWire().sums.clear();
      TheWire().ready.clear();
    }
    auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
    EXPECT_TRUE(server.ok());
    server_ = std::move(server).value();
    auto hub = NewLoopbackHub();
    for (int r = 0; r < world_; ++r) {
      Rank& k = ranks_[r];
      k.store =
          std::move(StoreClient::Connect(server_->address(), "test-token-0123456789", Millis(5000)))
              .value();
      RouteOptions ro;
      ro.self = LocalPeerInfo(r);
      ro.hint = "fake_prepared";
      ro.options.loopback_hub = hub;
      k.tx = std::move(NewRoutedTransport(ro)).value();
      SessionOptions o;
      o.prefix = prefix;
      o.sync_timeout = timeout;
      o.connect_timeout = Millis(5000);
      auto s = SyncSession::Create(spec_.inputs, r, *k.store, *k.tx, o);
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      k.session = std::move(s).value();
    }
  }

  std::vector<Status> All(const std::function<Status(int)>& fn) {
    return testing::RunOnAll(world_, fn);
  }
  std::vector<Status> BindAndConnect() {
    return All([&](int r) -> Status {
      Rank& k = ranks_[r];
      if (k.session->is_trainer()) {
        SS_ASSIGN_OR_RETURN(k.shards, job_internal::FillTrainerShards(spec_, r));
        for (auto& b : k.shards.bindings) SS_RETURN_IF_ERROR(k.session->BindSource(b));
      } else {
        SS_ASSIGN_OR_RETURN(k.params,
                            job_internal::AllocateEngineParams(k.session->ExpectedParams(),
                                                               spec_.inputs.options.wire_dtype));
        for (auto& b : k.params.bindings) SS_RETURN_IF_ERROR(k.session->BindDest(b));
      }
      return k.session->Connect();
    });
  }
  std::vector<Status> Sync(uint64_t v) {
    return All([&](int r) { return ranks_[r].session->Sync(v).status(); });
  }
  int64_t Mismatches() { return testing::EngineMismatches(spec_, ranks_); }
  int world() const { return world_; }
  int trainers() const { return spec_.inputs.trainer.world(); }
  SyncSession& session(int r) { return *ranks_[r].session; }
  StoreClient& store(int r) { return *ranks_[r].store; }
  Transport& transport(int r) { return *ranks_[r].tx; }

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
  std::unique_ptr<StoreServer> server_;
  std::vector<Rank> ranks_;
};

JobSpec TinyJob() {
  return testing::Job(testing::TinyQwen2(4), "fsdp=2", "dp=1,tp=2,pp=2", "sglang", 16 << 10);
}

// Sync `version` with a byte flipped on the wire from trainer `from` to every engine rank: every
// rank fails, one with DataLoss naming that trainer.
void ExpectFlipIsDataLoss(RoutedJob& job, int from, uint64_t version) {
  TheWire().flip_from = from;
  TheWire().flip_to = job.trainers();
  const auto st = job.Sync(version);
  TheWire().flip_from = -1;
  testing::ExpectOneDataLossFrom(job, st, from);
}

TEST(PreparedPairs, SyncThroughTheRouterIsElementExact) {
  RoutedJob job(TinyJob(), "p1/", Millis(5000));
  testing::ExpectAllOk(job.BindAndConnect());
  EXPECT_EQ(job.transport(0).PeerTransport(job.trainers()), "fake_prepared");
  const int posts0 = TheWire().posts;
  testing::ExpectAllOk(job.Sync(1));
  EXPECT_GT(TheWire().posts, posts0);  // the pairs carried the sync, not the host path
  EXPECT_EQ(job.Mismatches(), 0);
  SyncReport rep;
  testing::ExpectAllOk(job.All([&](int r) -> Status {
    SS_ASSIGN_OR_RETURN(SyncReport x, job.session(r).Sync(2));
    if (r == 0) rep = x;
    return OkStatus();
  }));
  EXPECT_GT(rep.checksums_total, 0);
  EXPECT_EQ(rep.checksums_ok, rep.checksums_total);
  EXPECT_EQ(job.Mismatches(), 0);
}

// Pairs whose transport delivers the packed sums with the data (cuda_ipc) skip the store; the
// comparison, and a corrupted bucket's DataLoss, are the same.
TEST(PreparedPairs, SumsDeliveredWithTheDataSkipTheStore) {
  for (bool deliver : {false, true}) {
    SCOPED_TRACE(deliver ? "delivered" : "through the store");
    TheWire().deliver_sums = deliver;
    const std::string prefix = deliver ? "p4d/" : "p4s/";
    RoutedJob job(TinyJob(), prefix, Millis(5000));
    testing::ExpectAllOk(job.BindAndConnect());  // pairs are made at connect
    TheWire().deliver_sums = false;
    testing::ExpectAllOk(job.Sync(1));
    EXPECT_EQ(job.Mismatches(), 0);
    int in_store = 0;
    for (int t = 0; t < job.trainers(); ++t) {
      for (int r = job.trainers(); r < job.world(); ++r) {
        const std::string key = testing::JobRoot(job.store(0), prefix) + "v1/sums/" +
                                std::to_string(t) + "_" + std::to_string(r);
        in_store += job.store(0).Get(key, Millis(0)).ok();
      }
    }
    if (deliver) {
      EXPECT_EQ(in_store, 0);
    } else {
      EXPECT_GT(in_store, 0);
    }
    ExpectFlipIsDataLoss(job, 0, 2);
    testing::ExpectAllOk(job.Sync(3));
    EXPECT_EQ(job.Mismatches(), 0);
  }
}

// Senders whose pairs hold their writes until the receiver's pair is posted (cuda_ipc) skip the
// ready keys: a receiver entering late is still waited for, and one that refuses the version
// fails the job within the timeout.
TEST(PreparedPairs, PairsThatSignalReadinessNeedNoReadyKeys) {
  TheWire().signal_ready = true;
  RoutedJob job(TinyJob(), "p5/", Millis(2000));
  testing::ExpectAllOk(job.BindAndConnect());
  TheWire().signal_ready = false;
  const int late = job.world() - 1;
  for (uint64_t v = 1; v <= 2; ++v) {
    testing::ExpectAllOk(job.All([&](int r) -> Status {
      if (r == late) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return job.session(r).Sync(v).status();
    }));
    EXPECT_EQ(job.Mismatches(), 0);
  }
  // The late receiver refuses version 2 again (stale): nobody waits past the timeout.
  const auto t0 = std::chrono::steady_clock::now();
  const auto st = job.All([&](int r) { return job.session(r).Sync(r == late ? 2 : 3).status(); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int r = 0; r < job.world(); ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r;
  EXPECT_LT(s, 5.0);
}

TEST(PreparedPairs, CorruptedBucketIsDataLossThenACleanSyncClearsThePoison) {
  RoutedJob job(TinyJob(), "p2/", Millis(5000));
  testing::ExpectAllOk(job.BindAndConnect());
  ExpectFlipIsDataLoss(job, 1, 1);
  testing::ExpectAllOk(job.Sync(2));
  for (int r = job.trainers(); r < job.world(); ++r) EXPECT_FALSE(job.session(r).IsPoisoned());
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST(PreparedPairs, SilentSenderFailsEveryRankInTimeAndReconnectWorks) {
  {
    RoutedJob job(TinyJob(), "p3/", Millis(1500));
    testing::ExpectAllOk(job.BindAndConnect());
    TheWire().silent_from = 0;
    const int cancels0 = TheWire().cancels;
    const auto t0 = std::chrono::steady_clock::now();
    const auto st = job.Sync(1);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TheWire().silent_from = -1;
    for (int r = 0; r < job.world(); ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r;
    EXPECT_LT(s, 5.0);                       // each rank's own bound is the 1.5 s sync timeout
    EXPECT_GT(TheWire().cancels, cancels0);  // receivers gave up their pairs
    // A cancelled pair stays cancelled: the job must re-connect.
    bool aborted = false;
    for (const Status& x : job.Sync(2)) aborted |= x.code() == StatusCode::kAborted;
    EXPECT_TRUE(aborted);
  }
  RoutedJob again(TinyJob(), "p3r/", Millis(5000));
  testing::ExpectAllOk(again.BindAndConnect());
  testing::ExpectAllOk(again.Sync(1));
  EXPECT_EQ(again.Mismatches(), 0);
}

}  // namespace
}  // namespace shardsync
