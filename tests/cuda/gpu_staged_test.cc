// Issue 33 on the GPU: staged commit with device bindings (cuda_ipc pairs land in device
// staging, the CUDA packer copies or exchanges it into the live parameters), and rollback back
// to the previous version, every byte of every engine rank compared. In-process ranks.
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "gpu_test_util.h"
#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "shardsync/gpu.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"

namespace shardsync::gpu {
namespace {

struct Rank {
  std::unique_ptr<StoreClient> store;
  std::unique_ptr<Transport> tx;
  std::unique_ptr<Packer> packer;
  std::unique_ptr<SyncSession> session;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  job_internal::EngineParams host;  // engine ranks: the element check's host copies
  std::vector<SourceBinding> sources;
};

class StagedGpuJob {
 public:
  explicit StagedGpuJob(SessionOptions::Keep keep)
      : job_(testing::Job(testing::TinyQwen2(4), "fsdp=2", "dp=1,tp=2,pp=2", "sglang", 16 << 10)) {
    server_ = std::move(StoreServer::Start("127.0.0.1", 0, "test-token-0123456789")).value();
    world_ = SyncWorldSize(job_.inputs);
    ranks_.resize(world_);
    All([&](int r) { return SetUp(r, keep); });
  }

  void All(const std::function<Status(int)>& fn) {
    std::vector<Status> st(world_);
    std::vector<std::thread> ts;
    for (int r = 0; r < world_; ++r) ts.emplace_back([&, r] { st[r] = fn(r); });
    for (auto& t : ts) t.join();
    for (int r = 0; r < world_; ++r)
      ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
  }

  // Trainer shards of seed `seed` into the bound device buffers.
  Status Fill(int r, uint64_t seed) {
    JobSpec s = job_;
    s.seed = seed;
    SS_ASSIGN_OR_RETURN(auto shards, job_internal::FillTrainerShards(s, r));
    for (size_t i = 0; i < shards.bindings.size(); ++i) {
      const SourceBinding& b = shards.bindings[i];
      SS_RETURN_IF_ERROR(
          CopyToDevice(ranks_[r].bufs[i]->data(), b.data, b.region.numel() * DTypeSize(b.dtype)));
    }
    return OkStatus();
  }
  void set_seed(uint64_t seed) { job_.seed = seed; }

  // Every engine rank's live parameters, copied back.
  std::vector<std::vector<unsigned char>> Live() {
    std::vector<std::vector<unsigned char>> out;
    for (int r = trainers(); r < world_; ++r) {
      for (auto& b : ranks_[r].bufs) {
        out.emplace_back(b->bytes());
        EXPECT_TRUE(CopyToHost(out.back().data(), b->data(), b->bytes()).ok());
      }
    }
    return out;
  }

  int64_t Mismatches() {
    int64_t m = 0;
    for (int r = trainers(); r < world_; ++r) {
      Rank& k = ranks_[r];
      for (size_t i = 0; i < k.bufs.size(); ++i) {
        EXPECT_TRUE(
            CopyToHost(k.host.bindings[i].data, k.bufs[i]->data(), k.bufs[i]->bytes()).ok());
      }
      RankResult rr;
      job_internal::VerifyEngineParams(job_, k.session->ExpectedParams(), k.host.bindings, rr);
      EXPECT_GT(rr.elements_checked, 0);
      m += rr.element_mismatches;
    }
    return m;
  }

  int trainers() const { return job_.inputs.trainer.world(); }
  int world() const { return world_; }
  SyncSession& session(int r) { return *ranks_[r].session; }

 private:
  Status SetUp(int r, SessionOptions::Keep keep) {
    Rank& k = ranks_[r];
    SS_RETURN_IF_ERROR(RegisterGpuTransports());
    SS_ASSIGN_OR_RETURN(
        k.store, StoreClient::Connect(server_->address(), "test-token-0123456789", Millis(10000)));
    SS_ASSIGN_OR_RETURN(PeerInfo self, DevicePeerInfo(r, 0));
    RouteOptions ro{self, "", {}};
    ro.options.params["device"] = "0";
    SS_ASSIGN_OR_RETURN(k.tx, NewRoutedTransport(ro));
    k.packer = MakeCudaPacker(0, Millis(20000));
    SessionOptions o;
    o.packer = k.packer.get();
    o.sync_timeout = Millis(20000);
    o.connect_timeout = Millis(20000);
    o.commit = SessionOptions::Commit::kStaged;
    o.staging = MemKind::kCuda;
    o.keep_previous = keep;
    SS_ASSIGN_OR_RETURN(k.session, SyncSession::Create(job_.inputs, r, *k.store, *k.tx, o));
    if (k.session->is_trainer()) {
      SS_ASSIGN_OR_RETURN(auto shards, job_internal::FillTrainerShards(job_, r));
      for (SourceBinding b : shards.bindings) {
        const size_t n = b.region.numel() * DTypeSize(b.dtype);
        SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(n, 0));
        SS_RETURN_IF_ERROR(CopyToDevice(buf->data(), b.data, n));
        b.data = buf->data();
        b.mem = MemKind::kCuda;
        b.device = 0;
        SS_RETURN_IF_ERROR(k.session->BindSource(b));
        k.bufs.push_back(std::move(buf));
      }
    } else {
      SS_ASSIGN_OR_RETURN(k.host, job_internal::AllocateEngineParams(
                                      k.session->ExpectedParams(), job_.inputs.options.wire_dtype));
      for (DestBinding b : k.host.bindings) {
        const size_t n = NumElements(b.shape) * DTypeSize(b.dtype);
        SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(n, 0));
        SS_RETURN_IF_ERROR(Memset(buf->data(), 0xA5, n));
        b.data = buf->data();
        b.mem = MemKind::kCuda;
        b.device = 0;
        SS_RETURN_IF_ERROR(k.session->BindDest(b));
        k.bufs.push_back(std::move(buf));
      }
    }
    return k.session->Connect();
  }

  JobSpec job_;
  std::unique_ptr<StoreServer> server_;
  int world_ = 0;
  std::vector<Rank> ranks_;
};

class GpuStaged : public ::testing::TestWithParam<SessionOptions::Keep> {};

TEST_P(GpuStaged, CommitsOnDeviceAndRollsBackEveryElement) {
  SS_REQUIRE_GPU();
  StagedGpuJob job(GetParam());
  const auto garbage = job.Live();
  job.All([&](int r) { return job.session(r).Sync(1).status(); });
  EXPECT_EQ(job.Live(), garbage);  // verified in staging, not served yet
  job.All([&](int r) { return job.session(r).Commit(1).status(); });
  EXPECT_EQ(job.Mismatches(), 0);
  const auto v1 = job.Live();
  job.All([&](int r) { return r < job.trainers() ? job.Fill(r, 9) : OkStatus(); });
  job.set_seed(9);
  job.All([&](int r) { return job.session(r).Sync(2).status(); });
  job.All([&](int r) { return job.session(r).Commit(2).status(); });
  EXPECT_EQ(job.Mismatches(), 0);  // seed 9's values
  EXPECT_NE(job.Live(), v1);
  job.All([&](int r) { return r < job.trainers() ? OkStatus() : job.session(r).Rollback(); });
  EXPECT_EQ(job.Live(), v1);  // every byte of every engine rank
  for (int r = job.trainers(); r < job.world(); ++r) {
    EXPECT_EQ(job.session(r).committed_version(), 1u);
    EXPECT_EQ(job.session(r).keep_previous(),
              GetParam() == SessionOptions::Keep::kSwap ? "swap" : "area");
  }
}

INSTANTIATE_TEST_SUITE_P(Keep, GpuStaged,
                         ::testing::Values(SessionOptions::Keep::kArea,
                                           SessionOptions::Keep::kSwap));

}  // namespace
}  // namespace shardsync::gpu
