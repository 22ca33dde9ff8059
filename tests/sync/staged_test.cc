// Issue 33: staged commit. Engine ranks land every sync in staging while the live parameters stay
// as served; Commit copies a verified version in on every engine rank of the scope or on none;
// Rollback restores the previous version bit for bit. Loopback, one thread per sync rank.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>

#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "session_harness.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"
#include "sync_expect.h"

namespace shardsync {
namespace {

using testing::ExpectAllOk;
using ::testing::HasSubstr;
using Keep = SessionOptions::Keep;

// The CPU packer with faults: a free-memory figure, and a commit copy that fails.
class FaultyPacker final : public Packer {
 public:
  std::string_view name() const override { return "faulty-cpu"; }
  bool Supports(MemKind k) const override { return cpu_->Supports(k); }
  Result<uint64_t> Pack(const std::vector<PackRegion>& r, DType w, void* o, int64_t b) override {
    return cpu_->Pack(r, w, o, b);
  }
  Result<uint64_t> ChecksumLanded(const std::vector<PackRegion>& r, int64_t b) override {
    return cpu_->ChecksumLanded(r, b);
  }
  Status Unpack(const void* i, DType w, int64_t b, const std::vector<PackRegion>& r) override {
    return cpu_->Unpack(i, w, b, r);
  }
  Status ZeroFill(void* base, DType t, const Shape& s, const Region& r) override {
    return cpu_->ZeroFill(base, t, s, r);
  }
  Result<std::shared_ptr<unsigned char>> AllocStaging(size_t bytes) override {
    return cpu_->AllocStaging(bytes);
  }
  Result<int64_t> FreeBytes() override {
    if (free_bytes >= 0) return free_bytes;
    return cpu_->FreeBytes();
  }
  // The next `fail_copies` copies fail, each after writing half of its first area: the rollback
  // must undo that.
  Status CopyAreas(const std::vector<AreaCopy>& copies, bool swap) override {
    if (fail_copies > 0) {
      --fail_copies;
      if (!copies.empty()) std::memcpy(copies[0].dst, copies[0].src, copies[0].bytes / 2);
      return InternalError("injected commit copy failure");
    }
    return cpu_->CopyAreas(copies, swap);
  }

  int64_t free_bytes = -1;
  int fail_copies = 0;

 private:
  std::unique_ptr<Packer> cpu_ = MakeCpuPacker();
};

// Each rank's FaultyPacker: a base of StagedJob ahead of SessionJob, so made before the
// sessions that use them and gone after.
struct FaultyPackers {
  std::vector<std::unique_ptr<FaultyPacker>> packers;
};

// The harness's job with staged commit, each rank's packer a FaultyPacker.
class StagedJob : private FaultyPackers, public testing::SessionJob {
 public:
  explicit StagedJob(Keep keep = Keep::kAuto,
                     SessionOptions::Scope scope = SessionOptions::Scope::kJob,
                     const std::string& rollout = "dp=1,tp=2,pp=2")
      : SessionJob(testing::Job(testing::TinyQwen2(4, true), "fsdp=2", rollout, "sglang", 16 << 10),
                   Millis(3000), [this, keep, scope](int, SessionOptions& o) {
                     packers.push_back(std::make_unique<FaultyPacker>());
                     o.packer = packers.back().get();
                     o.commit = SessionOptions::Commit::kStaged;
                     o.keep_previous = keep;
                     o.commit_scope = scope;
                   }) {}

  void ConnectAll() {
    BindAll();
    ExpectAllOk(Connect());
  }
  // New trainer values for the next version (seed `seed`): each version's bytes differ.
  void Reseed(uint64_t seed) {
    JobSpec s = spec();
    s.seed = seed;
    for (int r = 0; r < trainers(); ++r) {
      auto fresh = job_internal::FillTrainerShards(s, r).value();
      for (size_t i = 0; i < fresh.bindings.size(); ++i) {
        const SourceBinding& b = fresh.bindings[i];
        std::memcpy(shards(r).buffers[i].get(), b.data,
                    static_cast<size_t>(b.region.numel() * DTypeSize(b.dtype)));
      }
    }
    spec().seed = seed;
  }
  // Every engine rank's live parameters, byte for byte.
  std::vector<std::vector<unsigned char>> Live() { return EngineBytes(); }
  FaultyPacker& packer(int r) { return *packers[r]; }
};

TEST(StagedCommit, SyncLandsInStagingAndCommitMakesItLive) {
  StagedJob job;
  job.ConnectAll();
  for (int r = job.trainers(); r < job.world(); ++r) {
    EXPECT_EQ(job.session(r).staging_bytes(), StagingBytes(job.spec().inputs, r).value());
    EXPECT_GT(job.session(r).staging_bytes(), 0);
    EXPECT_EQ(job.session(r).keep_previous(), "area");
  }
  EXPECT_EQ(job.session(0).staging_bytes(), 0);
  const auto before = job.Live();
  ExpectAllOk(job.Sync(1));
  // Verified, but not served: the live parameters are untouched until the commit.
  EXPECT_EQ(job.Live(), before);
  EXPECT_GT(job.Mismatches(), 0);
  ExpectAllOk(job.Commit(1));
  EXPECT_EQ(job.Mismatches(), 0);
  for (int r = job.trainers(); r < job.world(); ++r) {
    EXPECT_EQ(job.session(r).committed_version(), 1u);
    EXPECT_FALSE(job.session(r).IsPoisoned());
  }
}

TEST(StagedCommit, CorruptedByteFailsTheSyncAndLeavesLiveParametersUntouched) {
  StagedJob job;
  job.ConnectAll();
  ExpectAllOk(job.Sync(1));
  ExpectAllOk(job.Commit(1));
  const auto served = job.Live();
  job.Reseed(2);
  job.CorruptDataPost(1, 3, 5);
  auto st = job.Sync(2);
  EXPECT_EQ(job.fault(1).counters().corrupted, 1);
  for (int r = 0; r < job.world(); ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r;
  // Nothing of version 2 reached the live parameters, and they are not poisoned.
  EXPECT_EQ(job.Live(), served);
  for (int r = job.trainers(); r < job.world(); ++r) {
    EXPECT_FALSE(job.session(r).IsPoisoned());
    EXPECT_EQ(job.session(r).committed_version(), 1u);
  }
  // A failed version cannot be committed, on any rank.
  auto c = job.Commit(2);
  for (int r = job.trainers(); r < job.world(); ++r) EXPECT_FALSE(c[r].ok()) << "rank " << r;
  EXPECT_EQ(job.Live(), served);
  job.fault(1).set_config({});
  ExpectAllOk(job.Sync(3));
  ExpectAllOk(job.Commit(3));
  EXPECT_EQ(job.Mismatches(), 0);  // seed 2's values
}

class Rollback : public ::testing::TestWithParam<Keep> {};

TEST_P(Rollback, RestoresThePreviousVersionBitForBit) {
  StagedJob job(GetParam());
  job.ConnectAll();
  ExpectAllOk(job.Sync(1));
  ExpectAllOk(job.Commit(1));
  const auto v1 = job.Live();
  job.Reseed(7);
  ExpectAllOk(job.Sync(2));
  ExpectAllOk(job.Commit(2));
  EXPECT_EQ(job.Mismatches(), 0);
  EXPECT_NE(job.Live(), v1);
  ExpectAllOk(job.All([&](int r) { return job.session(r).Rollback(); }));
  EXPECT_EQ(job.Live(), v1);  // every element of every engine rank
  for (int r = job.trainers(); r < job.world(); ++r) {
    EXPECT_EQ(job.session(r).committed_version(), 1u);
    // One level: a second rollback has nothing left to restore.
    Status again = job.session(r).Rollback();
    EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(again.message(), HasSubstr("no previous version is kept"));
  }
  // The job goes on: the next version commits.
  ExpectAllOk(job.Sync(3));
  ExpectAllOk(job.Commit(3));
  EXPECT_EQ(job.Mismatches(), 0);
}

INSTANTIATE_TEST_SUITE_P(StagedCommit, Rollback, ::testing::Values(Keep::kArea, Keep::kSwap));

TEST(StagedCommit, ARankWhoseCopyFailsRollsBackEveryRankOfTheScope) {
  StagedJob job(Keep::kArea);
  job.ConnectAll();
  ExpectAllOk(job.Sync(1));
  ExpectAllOk(job.Commit(1));
  const auto served = job.Live();
  job.Reseed(3);
  ExpectAllOk(job.Sync(2));
  const int bad = job.world() - 1;
  job.packer(bad).fail_copies = 1;  // after half a parameter was written
  auto st = job.Commit(2);
  for (int r = job.trainers(); r < job.world(); ++r) {
    ASSERT_FALSE(st[r].ok()) << "rank " << r;
    EXPECT_THAT(st[r].message(), HasSubstr("rolled back"));
    if (r != bad) {
      EXPECT_THAT(st[r].message(), HasSubstr("sync rank " + std::to_string(bad)));
    }
  }
  EXPECT_EQ(job.Live(), served);  // every rank holds version 1 again, the failed one included
  for (int r = job.trainers(); r < job.world(); ++r) {
    EXPECT_EQ(job.session(r).committed_version(), 1u);
    EXPECT_FALSE(job.session(r).IsPoisoned());
  }
  // The same version again: a retried commit agrees afresh (not on the failed attempt's keys).
  ExpectAllOk(job.Commit(2));
  EXPECT_EQ(job.Mismatches(), 0);  // seed 3's values
  ExpectAllOk(job.Sync(3));
  ExpectAllOk(job.Commit(3));
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST(StagedCommit, ARankThatCannotRestoreIsPoisonedUntilACommitSucceeds) {
  StagedJob job(Keep::kArea);
  job.ConnectAll();
  ExpectAllOk(job.Sync(1));
  ExpectAllOk(job.Commit(1));
  ExpectAllOk(job.Sync(2));
  const int bad = job.world() - 1;
  job.packer(bad).fail_copies = 2;  // the commit's copy, then its undo
  auto st = job.Commit(2);
  EXPECT_THAT(st[bad].message(), HasSubstr("poisoned"));
  EXPECT_TRUE(job.session(bad).IsPoisoned());
  for (int r = job.trainers(); r < bad; ++r) EXPECT_FALSE(job.session(r).IsPoisoned());
  ExpectAllOk(job.Sync(3));
  ExpectAllOk(job.Commit(3));
  EXPECT_FALSE(job.session(bad).IsPoisoned());
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST(StagedCommit, ARankThatNeverCommitsFailsTheOthersWithoutACopy) {
  StagedJob job;
  job.ConnectAll();
  ExpectAllOk(job.Sync(1));
  const auto before = job.Live();
  const int absent = job.trainers();
  auto st = job.All([&](int r) {
    if (r == absent) return OkStatus();
    return job.session(r).Commit(1).status();
  });
  for (int r = job.trainers() + 1; r < job.world(); ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kDeadlineExceeded) << st[r].ToString();
    EXPECT_THAT(st[r].message(), HasSubstr("sync rank " + std::to_string(absent)));
  }
  EXPECT_EQ(job.Live(), before);
}

TEST(StagedCommit, ReplicaScopeCommitsOneReplicaAlone) {
  StagedJob job(Keep::kAuto, SessionOptions::Scope::kReplica, "dp=2,tp=2,pp=1");
  job.ConnectAll();
  ExpectAllOk(job.Sync(1));
  // Replica 0 (sync ranks 2, 3) commits; replica 1 keeps serving what it had.
  const int s = job.trainers();
  auto st = job.All([&](int r) {
    if (r < s || r >= s + 2) return OkStatus();
    return job.session(r).Commit(1).status();
  });
  ExpectAllOk(st);
  EXPECT_EQ(job.session(s).committed_version(), 1u);
  EXPECT_EQ(job.session(s + 2).committed_version(), 0u);
}

TEST(StagedCommit, StagingThatDoesNotFitIsRefusedAtConnectNamingTheRankAndNumbers) {
  StagedJob job;
  const int r = job.world() - 1;
  job.packer(r).free_bytes = 1000;
  job.BindAll();
  auto st = job.All([&](int k) { return job.session(k).Connect(); });
  EXPECT_EQ(st[r].code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(st[r].message(), HasSubstr("sync rank " + std::to_string(r)));
  EXPECT_THAT(st[r].message(),
              HasSubstr("needs " + std::to_string(job.session(r).staging_bytes()) + " bytes"));
  EXPECT_THAT(st[r].message(), HasSubstr("1000 bytes"));
  for (int k = 0; k < job.world(); ++k) EXPECT_FALSE(st[k].ok()) << "rank " << k;
}

TEST(StagedCommit, WithoutRoomForASecondAreaAutoKeepsThePreviousVersionBySwapping) {
  StagedJob job;
  const int r = job.world() - 1;
  job.packer(r).free_bytes = job.session(r).staging_bytes() + 1;
  job.ConnectAll();
  EXPECT_EQ(job.session(r).keep_previous(), "swap");
  EXPECT_EQ(job.session(job.trainers()).keep_previous(), "area");
}

TEST(StagedCommit, RollbackAndCommitAreRefusedWhereTheyMeanNothing) {
  StagedJob job(Keep::kNone);
  job.ConnectAll();
  const int e = job.trainers();
  EXPECT_EQ(job.session(e).Rollback().code(), StatusCode::kFailedPrecondition);
  ExpectAllOk(job.Sync(1));
  ExpectAllOk(job.Commit(1));
  Status s = job.session(e).Rollback();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("keep_previous none"));
  EXPECT_TRUE(job.session(0).Rollback().ok());  // a trainer rank: nothing to restore
}

}  // namespace
}  // namespace shardsync
