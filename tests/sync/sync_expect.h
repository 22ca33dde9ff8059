// GoogleTest expectations shared by the in-process sync-session tests.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "shardsync/status.h"

namespace shardsync::testing {

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
