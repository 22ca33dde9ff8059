// One job's sync ranks in this test process: a store server, a loopback hub, and per rank a store
// client, a fault transport around loopback and a session, each rank's calls on its own thread.
// Shared by the in-process session tests (session, staged, delta, fp8).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"
#include "sync_expect.h"

namespace shardsync::testing {

class SessionJob {
 public:
  // Adjusts rank r's session options / plan inputs before its session is created.
  using Tune = std::function<void(int, SessionOptions&)>;
  using Inputs = std::function<void(int, PlanInputs&)>;

  explicit SessionJob(JobSpec spec, Millis timeout = Millis(3000), const Tune& tune = nullptr,
                      const Inputs& inputs = nullptr)
      : spec_(std::move(spec)) {
    auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
    EXPECT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    hub_ = NewLoopbackHub();
    world_ = SyncWorldSize(spec_.inputs);
    ranks_.resize(world_);
    for (int r = 0; r < world_; ++r) {
      Rank& k = ranks_[r];
      auto c = StoreClient::Connect(server_->address(), "test-token-0123456789", Millis(5000));
      EXPECT_TRUE(c.ok()) << c.status().ToString();
      k.store = std::move(c).value();
      k.tx = NewFaultTransport(NewLoopbackTransport(hub_));
      SessionOptions o;
      o.sync_timeout = timeout;
      o.connect_timeout = Millis(5000);
      if (tune) tune(r, o);
      PlanInputs in = spec_.inputs;
      if (inputs) inputs(r, in);
      auto s = SyncSession::Create(in, r, *k.store, *k.tx, o);
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      k.session = std::move(s).value();
    }
  }

  // Trainer ranks bind the synthetic weights, engine ranks freshly allocated parameters.
  void BindAll() {
    for (int r = 0; r < world_; ++r) {
      Rank& k = ranks_[r];
      auto who = DescribeSyncRank(spec_.inputs, r);
      ASSERT_TRUE(who.ok()) << who.status().ToString();
      if (who->is_trainer) {
        auto t = job_internal::FillTrainerShards(spec_, who->trainer_rank);
        ASSERT_TRUE(t.ok()) << t.status().ToString();
        k.shards = std::move(t).value();
        for (auto& b : k.shards.bindings) {
          Status s = k.session->BindSource(b);
          ASSERT_TRUE(s.ok()) << s.ToString();
        }
      } else {
        auto p = job_internal::AllocateEngineParams(k.session->ExpectedParams(),
                                                    spec_.inputs.options.wire_dtype);
        ASSERT_TRUE(p.ok()) << p.status().ToString();
        k.params = std::move(p).value();
        for (auto& b : k.params.bindings) {
          Status s = k.session->BindDest(b);
          ASSERT_TRUE(s.ok()) << s.ToString();
        }
      }
    }
  }

  // Runs fn(rank) on every rank concurrently; returns the statuses.
  std::vector<Status> All(const std::function<Status(int)>& fn) { return RunOnAll(world_, fn); }
  std::vector<Status> Connect() {
    return All([&](int r) { return ranks_[r].session->Connect(); });
  }
  // Syncs `v` on every rank; with `reps`, their reports (default ones where a rank failed).
  std::vector<Status> Sync(uint64_t v, std::vector<SyncReport>* reps = nullptr) {
    if (reps) reps->assign(world_, {});
    return All([&](int r) {
      auto rep = ranks_[r].session->Sync(v);
      if (rep.ok() && reps) (*reps)[r] = *rep;
      return rep.status();
    });
  }
  std::vector<Status> Commit(uint64_t v) {
    return All([&](int r) { return ranks_[r].session->Commit(v).status(); });
  }

  // Element check of every engine rank: mismatches in total.
  int64_t Mismatches() { return EngineMismatches(spec_, ranks_); }

  // Every engine rank's parameters, byte for byte (one vector per engine rank).
  std::vector<std::vector<unsigned char>> EngineBytes() {
    std::vector<std::vector<unsigned char>> out;
    for (int r = trainers(); r < world_; ++r) {
      std::vector<unsigned char> all;
      for (const DestBinding& d : ranks_[r].params.bindings) {
        const auto* p = static_cast<const unsigned char*>(d.data);
        all.insert(all.end(), p, p + NumElements(d.shape) * DTypeSize(d.dtype));
      }
      out.push_back(std::move(all));
    }
    return out;
  }
  void SetEngineBytes(const std::vector<std::vector<unsigned char>>& img) {
    for (int r = trainers(); r < world_; ++r) {
      size_t at = 0;
      for (const DestBinding& d : ranks_[r].params.bindings) {
        const size_t n = static_cast<size_t>(NumElements(d.shape) * DTypeSize(d.dtype));
        std::memcpy(d.data, img[r - trainers()].data() + at, n);
        at += n;
      }
    }
  }

  // Flips byte `byte` of rank r's `nth` data put from now on (the fault counters are cumulative
  // over the transport's life).
  void CorruptDataPost(int r, int nth, size_t byte) {
    fault(r).set_config(
        {.corrupt_data_post = fault(r).counters().data_posts + nth, .corrupt_byte = byte});
  }

  // Ends rank r as a killed process would: its session and store connection go.
  void Drop(int r) {
    ranks_[r].session.reset();
    ranks_[r].store.reset();
  }

  int world() const { return world_; }
  int trainers() const { return spec_.inputs.trainer.world(); }
  JobSpec& spec() { return spec_; }
  SyncSession& session(int r) { return *ranks_[r].session; }
  FaultTransport& fault(int r) { return *ranks_[r].tx; }
  StoreClient& store(int r) { return *ranks_[r].store; }
  job_internal::TrainerShards& shards(int r) { return ranks_[r].shards; }
  job_internal::EngineParams& params(int r) { return ranks_[r].params; }

 private:
  struct Rank {
    std::unique_ptr<StoreClient> store;
    std::unique_ptr<FaultTransport> tx;
    std::unique_ptr<SyncSession> session;
    job_internal::TrainerShards shards;
    job_internal::EngineParams params;
  };
  JobSpec spec_;
  std::unique_ptr<StoreServer> server_;
  std::shared_ptr<LoopbackHub> hub_;
  int world_ = 0;
  std::vector<Rank> ranks_;
};

// `job` bound, connected and synced at version 1: version 2 with one byte of trainer rank 1's 3rd
// data put flipped is DataLoss naming it on one rank and poisons every engine rank; a clean full
// version 3 clears the poison and the parameters are right again.
inline void ExpectFlippedByteIsDataLossThenRecovers(SessionJob& job) {
  job.CorruptDataPost(1, 3, 5);
  auto st = job.Sync(2);
  EXPECT_EQ(job.fault(1).counters().corrupted, 1);
  ExpectOneDataLossFrom(job, st, 1);
  job.fault(1).set_config({});
  ExpectAllOk(job.Sync(3));
  for (int r = job.trainers(); r < job.world(); ++r) EXPECT_FALSE(job.session(r).IsPoisoned());
  EXPECT_EQ(job.Mismatches(), 0);
}

}  // namespace shardsync::testing
