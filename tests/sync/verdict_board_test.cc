// The shared-memory verdict board: posts and lookups, the ring, foreign segments, torn reads.
#include "sync/verdict_board.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

namespace shardsync::sync_internal {
namespace {

constexpr uint64_t kJob = 0x6a6f62;  // the job's nonce every board here is stamped with

using Lookup = VerdictBoard::Lookup;

// "v<version>" (built with append: GCC 12 warns falsely on operator+ with a literal, bug 105329).
std::string Named(uint64_t v) {
  std::string s = "v";
  s += std::to_string(v);
  return s;
}

uint64_t TestNonce(uint64_t salt) {
  return (static_cast<uint64_t>(getpid()) << 20) ^ (salt * 0x9E3779B97F4A7C15ull);
}

// The board is a same-host path: a rank of another emulated node (SHARDSYNC_HOST_ID) names
// another segment, finds none, and the job's verdicts go through the store.
TEST(VerdictBoard, AnotherHostIdentityFindsNoBoard) {
  const uint64_t nonce = TestNonce(11);
  std::optional<std::string> old;
  if (const char* v = std::getenv("SHARDSYNC_HOST_ID")) old = v;
  setenv("SHARDSYNC_HOST_ID", "box/node0", 1);
  const std::string node0 = VerdictBoardName(nonce);
  auto a = VerdictBoard::Create(node0, 2, nonce, kJob);
  setenv("SHARDSYNC_HOST_ID", "box/node1", 1);
  const std::string node1 = VerdictBoardName(nonce);
  auto b = VerdictBoard::Open(node1, 2, nonce, kJob);
  setenv("SHARDSYNC_HOST_ID", "box/node0", 1);
  auto c = VerdictBoard::Open(VerdictBoardName(nonce), 2, nonce, kJob);
  if (old) {
    setenv("SHARDSYNC_HOST_ID", old->c_str(), 1);
  } else {
    unsetenv("SHARDSYNC_HOST_ID");
  }
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_NE(node0, node1);
  EXPECT_FALSE(b.ok()) << "a rank of another node mapped the board";
  EXPECT_TRUE(c.ok()) << c.status().ToString();  // the same node's ranks do
}

TEST(VerdictBoard, PostThenGetAcrossMappings) {
  const uint64_t nonce = TestNonce(1);
  auto a = VerdictBoard::Create(VerdictBoardName(nonce), 3, nonce, kJob);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = VerdictBoard::Open(VerdictBoardName(nonce), 3, nonce, kJob);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  std::string t;
  EXPECT_EQ((*b)->Get(0, 1, &t), Lookup::kMissing);
  (*a)->Post(0, 1, "zero at one");
  (*b)->Post(2, 1, "two at one");
  ASSERT_EQ((*b)->Get(0, 1, &t), Lookup::kFound);
  EXPECT_EQ(t, "zero at one");
  ASSERT_EQ((*a)->Get(2, 1, &t), Lookup::kFound);
  EXPECT_EQ(t, "two at one");
  EXPECT_EQ((*a)->Get(1, 1, &t), Lookup::kMissing);
  EXPECT_EQ((*a)->Get(0, 2, &t), Lookup::kMissing);  // a later version: not posted yet
}

TEST(VerdictBoard, RingKeepsTheLastVersionsAndReportsOverwrites) {
  const uint64_t nonce = TestNonce(2);
  auto a = VerdictBoard::Create(VerdictBoardName(nonce), 2, nonce, kJob);
  ASSERT_TRUE(a.ok());
  for (uint64_t v = 1; v <= 10; ++v) (*a)->Post(1, v, Named(v));
  std::string t;
  for (uint64_t v = 10 - VerdictBoard::kRing + 1; v <= 10; ++v) {
    ASSERT_EQ((*a)->Get(1, v, &t), Lookup::kFound) << v;
    EXPECT_EQ(t, Named(v));
  }
  EXPECT_EQ((*a)->Get(1, 10 - VerdictBoard::kRing, &t), Lookup::kOverwritten);
  EXPECT_EQ((*a)->Get(1, 1, &t), Lookup::kOverwritten);
  EXPECT_EQ((*a)->Get(1, 11, &t), Lookup::kMissing);
}

TEST(VerdictBoard, SkippedVersionsKeepTheirEntries) {
  // Callers may skip versions (1, 5, 9, ...): the ring follows the posts, not version % kRing.
  const uint64_t nonce = TestNonce(6);
  auto a = VerdictBoard::Create(VerdictBoardName(nonce), 2, nonce, kJob);
  ASSERT_TRUE(a.ok());
  std::string t;
  for (uint64_t v = 1; v <= 1 + 4 * (VerdictBoard::kRing - 1); v += 4) {
    (*a)->Post(0, v, Named(v));
    for (uint64_t w = 1; w <= v; w += 4) {
      ASSERT_EQ((*a)->Get(0, w, &t), Lookup::kFound) << "version " << w << " after " << v;
      EXPECT_EQ(t, Named(w));
    }
  }
  (*a)->Post(0, 100, Named(100));  // the oldest (version 1) goes
  EXPECT_EQ((*a)->Get(0, 1, &t), Lookup::kOverwritten);
  ASSERT_EQ((*a)->Get(0, 5, &t), Lookup::kFound);
  EXPECT_EQ((*a)->Get(0, 7, &t), Lookup::kMissing);  // never posted, later ones are not all past it
}

TEST(VerdictBoard, LongTextsAreCut) {
  const uint64_t nonce = TestNonce(3);
  auto a = VerdictBoard::Create(VerdictBoardName(nonce), 1, nonce, kJob);
  ASSERT_TRUE(a.ok());
  const std::string long_text(VerdictBoard::kTextBytes + 77, 'x');
  (*a)->Post(0, 5, long_text);
  std::string t;
  ASSERT_EQ((*a)->Get(0, 5, &t), Lookup::kFound);
  EXPECT_EQ(t, long_text.substr(0, VerdictBoard::kTextBytes));
  (*a)->Post(0, 6, std::string("nul\0inside", 10));
  ASSERT_EQ((*a)->Get(0, 6, &t), Lookup::kFound);
  EXPECT_EQ(t, std::string("nul\0inside", 10));
}

TEST(VerdictBoard, ForeignOrMissingSegmentsAreRefused) {
  const uint64_t nonce = TestNonce(4);
  auto a = VerdictBoard::Create(VerdictBoardName(nonce), 4, nonce, kJob);
  ASSERT_TRUE(a.ok());
  auto wrong_nonce = VerdictBoard::Open(VerdictBoardName(nonce), 4, nonce + 1, kJob);
  EXPECT_FALSE(wrong_nonce.ok());
  EXPECT_NE(wrong_nonce.status().message().find("another job"), std::string::npos)
      << wrong_nonce.status().ToString();
  // Issue 26: a board of another job (same name and nonce) is refused too.
  auto wrong_job = VerdictBoard::Open(VerdictBoardName(nonce), 4, nonce, kJob + 1);
  EXPECT_FALSE(wrong_job.ok());
  EXPECT_NE(wrong_job.status().message().find("another job"), std::string::npos)
      << wrong_job.status().ToString();
  auto wrong_world = VerdictBoard::Open(VerdictBoardName(nonce), 5, nonce, kJob);
  EXPECT_FALSE(wrong_world.ok());
  EXPECT_NE(wrong_world.status().message().find("5 ranks"), std::string::npos)
      << wrong_world.status().ToString();
  EXPECT_FALSE(VerdictBoard::Open(VerdictBoardName(nonce + 99), 4, nonce + 99, kJob).ok());
  EXPECT_FALSE(VerdictBoard::Create(VerdictBoardName(nonce + 5), 0, nonce + 5, kJob).ok());
  EXPECT_FALSE(VerdictBoard::Create(VerdictBoardName(nonce + 6), VerdictBoard::kMaxWorld + 1,
                                    nonce + 6, kJob)
                   .ok());
  // Unlinked: the name is gone, the mappings stay.
  (*a)->Post(3, 1, "still here");
  (*a)->Unlink();
  EXPECT_FALSE(VerdictBoard::Open(VerdictBoardName(nonce), 4, nonce, kJob).ok());
  std::string t;
  EXPECT_EQ((*a)->Get(3, 1, &t), Lookup::kFound);
}

TEST(VerdictBoard, ReadersNeverSeeATornOrForeignText) {
  // A writer reposts versions as fast as it can while a reader looks them up: every text found
  // must be exactly the one posted for the version asked for.
  const uint64_t nonce = TestNonce(5);
  auto a = VerdictBoard::Create(VerdictBoardName(nonce), 1, nonce, kJob);
  ASSERT_TRUE(a.ok());
  auto b = VerdictBoard::Open(VerdictBoardName(nonce), 1, nonce, kJob);
  ASSERT_TRUE(b.ok());
  auto text_of = [](uint64_t v) {
    std::string s(100 + v % 800, static_cast<char>('a' + v % 26));
    s += Named(v);
    return s;
  };
  constexpr uint64_t kLast = 200000;
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (uint64_t v = 1; v <= kLast && !stop; ++v) (*a)->Post(0, v, text_of(v));
  });
  int64_t found = 0, wrong = 0;
  std::string t;
  for (uint64_t v = 1; v <= kLast; v += 7) {
    Lookup got;
    while ((got = (*b)->Get(0, v, &t)) == Lookup::kMissing) {
    }
    if (got == Lookup::kFound) {
      ++found;
      if (t != text_of(v)) ++wrong;
    }
  }
  stop = true;
  writer.join();
  EXPECT_EQ(wrong, 0) << "of " << found << " found";
  EXPECT_GT(found, 0);
}

}  // namespace
}  // namespace shardsync::sync_internal
