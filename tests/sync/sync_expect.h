// GoogleTest expectations shared by the in-process sync-session tests.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <thread>
#include <vector>

#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/status.h"
#include "sync/identity.h"

namespace shardsync::testing {

// The nonce of the job holding key prefix `prefix` (identity.h; 0 when none), and that job's
// key namespace "<prefix><nonce>/".
inline uint64_t JobNonce(StoreClient& store, const std::string& prefix = "ss/") {
  const std::string key = sync_internal::ClaimKey(prefix);
  auto claim = store.Get(key, Millis(0));
  EXPECT_TRUE(claim.ok()) << claim.status().ToString();
  if (!claim.ok()) return 0;
  auto c = sync_internal::ParseClaim(*claim, key);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? c->nonce : 0;
}
inline std::string JobRoot(StoreClient& store, const std::string& prefix = "ss/") {
  return sync_internal::JobRoot(prefix, JobNonce(store, prefix));
}

// Runs fn(rank) for ranks 0..world-1 concurrently (one thread each); their statuses.
inline std::vector<Status> RunOnAll(int world, const std::function<Status(int)>& fn) {
  std::vector<Status> out(world);
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) ts.emplace_back([&, r] { out[r] = fn(r); });
  for (auto& t : ts) t.join();
  return out;
}

// Element check of every engine rank of an in-process job: mismatches in total. `ranks` hold
// `session` (a SyncSession pointer) and `params` (job_internal::EngineParams).
template <typename Ranks>
int64_t EngineMismatches(const JobSpec& spec, Ranks& ranks) {
  int64_t m = 0;
  for (auto& k : ranks) {
    if (k.session->is_trainer()) continue;
    RankResult rr;
    job_internal::VerifyEngineParams(spec, k.session->ExpectedParams(), k.params.bindings, rr);
    EXPECT_GT(rr.elements_checked, 0);
    m += rr.element_mismatches;
  }
  return m;
}

inline void ExpectAllOk(const std::vector<Status>& st) {
  for (size_t r = 0; r < st.size(); ++r)
    EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
}

// A sync in which one transfer from sync rank `from` was corrupted: no rank reports success,
// exactly one reports DataLoss naming the sender and the parameters, and every engine rank is
// poisoned. `job` has world(), trainers() and session(r).IsPoisoned().
template <typename JobT>
void ExpectOneDataLossFrom(JobT& job, const std::vector<Status>& st, int from) {
  int data_loss = 0;
  for (int r = 0; r < job.world(); ++r) {
    ASSERT_FALSE(st[r].ok()) << "rank " << r << " reported success";
    if (st[r].code() == StatusCode::kDataLoss) {
      ++data_loss;
      EXPECT_THAT(st[r].message(), ::testing::HasSubstr("checksum mismatch"));
      EXPECT_THAT(st[r].message(), ::testing::HasSubstr("from sync rank " + std::to_string(from)));
      EXPECT_THAT(st[r].message(), ::testing::HasSubstr("parameters: model."));
    }
    if (r >= job.trainers()) {
      EXPECT_TRUE(job.session(r).IsPoisoned()) << "rank " << r;
    }
  }
  EXPECT_EQ(data_loss, 1);
}

}  // namespace shardsync::testing
