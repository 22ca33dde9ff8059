// GpuLaunchBoard is host code (built with or without CUDA): a launcher surveys, claims and
// completes other senders' slots; withdrawn, unshareable, stale and orphaned slots are handled.
// Runs everywhere.
#include "cuda/gpu_launch_board.h"
#include "cuda/gpu_turnstile.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace shardsync::gpu::internal {
namespace {

using Outcome = GpuLaunchBoard::Outcome;
using Peer = GpuLaunchBoard::Peer;

std::string TestName(const std::string& what) {
  return GpuLaunchBoard::Name("test/" + what + "/" + std::to_string(getpid()) + "/",
                              "0000:1B:00.0");
}

std::unique_ptr<GpuLaunchBoard> MustOpen(const std::string& name, int rank) {
  auto b = GpuLaunchBoard::Open(name, rank);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  return b.ok() ? std::move(b).value() : nullptr;
}

bool Exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) close(fd);
  return fd >= 0;
}

// Issue 37: another user's board planted under the name was joined and its claims forged. A
// segment that exists is opened only if this user owns it and no one else may open it; one open
// to others (what another user's pre-created file would have to be for us to open it) is refused,
// and so is a turnstile's, and neither is changed.
TEST(GpuLaunchBoard, APlantedSegmentOpenToOthersIsRefused) {
  for (const std::string& name :
       {TestName("planted"),
        GpuTurnstile::Name("test/planted/" + std::to_string(getpid()) + "/", "0000:1B:00.0")}) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << name;
    ASSERT_EQ(fchmod(fd, 0666), 0);
    close(fd);
    const bool board = name.find("ssgpb") != std::string::npos;
    const Status s = board ? GpuLaunchBoard::Open(name, 0).status()
                           : GpuTurnstile::Open(name, std::chrono::milliseconds(100)).status();
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << name;
    EXPECT_NE(s.message().find("is open to other users"), std::string::npos) << s.ToString();
    struct stat st {};
    ASSERT_EQ(stat(("/dev/shm" + name).c_str(), &st), 0);
    EXPECT_EQ(st.st_size, 0) << "refused, and left as it was";
    shm_unlink(name.c_str());
  }
}

// A killed job never unlinks its board (its last user out would): the next board opened on the
// host sweeps boards whose every slot is dead, and leaves a board with a live slot alone.
TEST(GpuLaunchBoard, BoardsOfKilledJobsAreSweptAndLiveOnesKept) {
  const std::string dead = TestName("killed"), live = TestName("alive");
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // a sender that dies holding its slot
    auto b = GpuLaunchBoard::Open(dead, 1);
    if (b.ok()) b.value().release();  // no destructor: as after SIGKILL
    _exit(b.ok() ? 0 : 1);
  }
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  auto held = MustOpen(live, 0);
  ASSERT_TRUE(held);
  ASSERT_TRUE(Exists(dead));
  // (Only these two: other tests' boards may be in creation at this moment.)
  EXPECT_EQ(GpuLaunchBoard::SweepStale(std::chrono::hours(1), dead), 0);  // too young to judge
  EXPECT_TRUE(Exists(dead));
  EXPECT_EQ(GpuLaunchBoard::SweepStale(std::chrono::seconds(0), live), 0);  // a live slot
  EXPECT_EQ(GpuLaunchBoard::SweepStale(std::chrono::seconds(0), dead), 1);
  EXPECT_FALSE(Exists(dead));
  EXPECT_TRUE(Exists(live));
}

TEST(GpuLaunchBoard, LauncherClaimsAndCompletesAReadySender) {
  const std::string name = TestName("claim");
  auto a = MustOpen(name, 0), b = MustOpen(name, 1);
  ASSERT_TRUE(a && b);
  EXPECT_NE(a->slot(), b->slot());
  std::vector<Peer> ready;
  int pending = -1;
  a->Survey(5, &ready, &pending);
  EXPECT_TRUE(ready.empty());
  EXPECT_EQ(pending, 1);  // b may still publish
  ASSERT_TRUE(b->Publish("spec-of-b", 3).ok());
  a->Survey(5, &ready, &pending);
  EXPECT_TRUE(ready.empty());
  EXPECT_EQ(pending, 1);  // published, not ready for 5
  b->PostReady(5);
  a->Survey(5, &ready, &pending);
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(pending, 0);
  EXPECT_EQ(ready[0].rank, 1);
  EXPECT_EQ(ready[0].buckets, 3u);
  EXPECT_EQ(a->Spec(ready[0]), "spec-of-b");
  EXPECT_FALSE(b->ClaimedFor(5));
  EXPECT_FALSE(a->Claim(ready[0], 6));  // not ready for 6
  ASSERT_TRUE(a->Claim(ready[0], 5));
  int rank = -1, pid = -1;
  EXPECT_TRUE(b->ClaimedFor(5, &rank, &pid));
  EXPECT_EQ(rank, 0);
  EXPECT_EQ(pid, getpid());
  std::vector<uint64_t> packed, landed;
  EXPECT_EQ(b->Collect(5, &packed, &landed), Outcome::kPending);
  a->Survey(5, &ready, &pending);  // claimed: neither ready nor pending
  EXPECT_TRUE(ready.empty());
  EXPECT_EQ(pending, 0);
  const uint64_t p[3] = {11, 12, 13}, l[3] = {21, 22, 23};
  a->Complete(Peer{b->slot(), 1, b->token(), 1, 3}, 5, p, l);
  ASSERT_EQ(b->Collect(5, &packed, &landed), Outcome::kDone);
  EXPECT_EQ(packed, (std::vector<uint64_t>{11, 12, 13}));
  EXPECT_EQ(landed, (std::vector<uint64_t>{21, 22, 23}));
  // The next version starts over.
  b->PostReady(6);
  a->Survey(6, &ready, &pending);
  ASSERT_EQ(ready.size(), 1u);
  ASSERT_TRUE(a->Claim(ready[0], 6));
  a->Fail(ready[0], 6);
  EXPECT_EQ(b->Collect(6, &packed, &landed), Outcome::kFailed);
}

TEST(GpuLaunchBoard, WithdrawnAndUnshareableSendersAreNotWaitedFor) {
  const std::string name = TestName("withdraw");
  auto a = MustOpen(name, 0), b = MustOpen(name, 1), c = MustOpen(name, 2);
  ASSERT_TRUE(a && b && c);
  ASSERT_TRUE(b->Publish("b", 1).ok());
  b->PostReady(7);
  b->Withdraw(7);
  c->MarkUnshareable();
  std::vector<Peer> ready;
  int pending = -1;
  a->Survey(7, &ready, &pending);
  EXPECT_TRUE(ready.empty());
  EXPECT_EQ(pending, 1);  // b: published, not ready; c: never shared
  b->PostReady(8);
  b->Withdraw(7);  // another version's withdrawal changes nothing
  a->Survey(8, &ready, &pending);
  EXPECT_EQ(ready.size(), 1u);
  EXPECT_EQ(pending, 0);
}

// The owner's Withdraw and a launcher's Claim of one post: exactly one of them wins.
TEST(GpuLaunchBoard, ClaimAndWithdrawExcludeEachOther) {
  const std::string name = TestName("race");
  auto a = MustOpen(name, 0), b = MustOpen(name, 1);
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(b->Publish("b", 2).ok());
  const Peer pb{b->slot(), 1, b->token(), 1, 2};
  EXPECT_TRUE(b->Withdraw(4));    // never posted: nothing to claim
  EXPECT_FALSE(a->Claim(pb, 4));  // not ready for 4
  b->PostReady(4);
  ASSERT_TRUE(a->Claim(pb, 4));
  EXPECT_FALSE(a->Claim(pb, 4));  // claimed once
  EXPECT_FALSE(b->Withdraw(4));   // too late: the launcher packs it
  EXPECT_TRUE(b->ClaimedFor(4));
  b->PostReady(5);
  EXPECT_TRUE(b->Withdraw(5));    // taken back first
  EXPECT_FALSE(a->Claim(pb, 5));  // so no launcher packs it
  EXPECT_FALSE(b->ClaimedFor(5));
  std::vector<Peer> ready;
  int pending = -1;
  a->Survey(5, &ready, &pending);
  EXPECT_TRUE(ready.empty());
  EXPECT_EQ(pending, 1);
}

// The launcher is stable: the live sender of lowest sync rank that may share.
TEST(GpuLaunchBoard, LeaderIsTheLowestRankThatMayShare) {
  const std::string name = TestName("leader");
  auto c = MustOpen(name, 3), a = MustOpen(name, 1), b = MustOpen(name, 2);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(c->Leader(), a->slot());
  EXPECT_TRUE(a->IsLeader());
  EXPECT_FALSE(b->IsLeader());
  a->MarkUnshareable();  // e.g. a block-FP8 batch: launches alone
  EXPECT_EQ(c->Leader(), b->slot());
  EXPECT_FALSE(c->LaunchedFor(b->slot(), 7));
  b->ClaimOwn(7);
  EXPECT_TRUE(c->LaunchedFor(b->slot(), 7));
  EXPECT_FALSE(c->LaunchedFor(b->slot(), 8));
  b.reset();
  EXPECT_EQ(c->Leader(), c->slot());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // a rank-0 sender that exits: no one's launcher
    auto d = GpuLaunchBoard::Open(name, 0);
    _exit(d.ok() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(c->Leader(), c->slot());
}

TEST(GpuLaunchBoard, PublishLimits) {
  const std::string name = TestName("limits");
  auto a = MustOpen(name, 0);
  ASSERT_TRUE(a);
  EXPECT_FALSE(a->Publish("x", 0).ok());
  EXPECT_FALSE(a->Publish("x", GpuLaunchBoard::kMaxBuckets + 1).ok());
  EXPECT_FALSE(a->Publish(std::string(GpuLaunchBoard::kSpecBytes + 1, 'x'), 1).ok());
  EXPECT_TRUE(a->Publish(std::string(GpuLaunchBoard::kSpecBytes, 'x'), 1).ok());
}

TEST(GpuLaunchBoard, LauncherThatExitsIsSeen) {
  const std::string name = TestName("gone");
  auto b = MustOpen(name, 1);
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->Publish("b", 2).ok());
  b->PostReady(3);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // claims b, then dies before completing
    auto a = GpuLaunchBoard::Open(name, 0);
    if (!a.ok()) _exit(1);
    std::vector<Peer> ready;
    int pending = 0;
    (*a)->Survey(3, &ready, &pending);
    _exit(ready.size() == 1 && (*a)->Claim(ready[0], 3) ? 0 : 2);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  int rank = -1, pid = -1;
  EXPECT_TRUE(b->ClaimedFor(3, &rank, &pid));
  EXPECT_EQ(pid, child);
  std::vector<uint64_t> packed, landed;
  EXPECT_EQ(b->Collect(3, &packed, &landed), Outcome::kLauncherGone);
}

TEST(GpuLaunchBoard, SlotOfAnExitedSenderIsReusedClean) {
  const std::string name = TestName("reuse");
  auto a = MustOpen(name, 0);
  ASSERT_TRUE(a);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // publishes, posts ready, dies holding its slot
    auto c = GpuLaunchBoard::Open(name, 5);
    if (!c.ok() || !(*c)->Publish("c", 1).ok()) _exit(1);
    (*c)->PostReady(9);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::vector<Peer> ready;
  int pending = -1;
  a->Survey(9, &ready, &pending);  // the dead sender is no one
  EXPECT_TRUE(ready.empty());
  EXPECT_EQ(pending, 0);
  auto d = MustOpen(name, 6);  // takes the free slot (the first is a's or the dead one's)
  ASSERT_TRUE(d);
  a->Survey(9, &ready, &pending);
  EXPECT_TRUE(ready.empty());  // nothing stale: d has published nothing
  EXPECT_EQ(pending, 1);
}

TEST(GpuLaunchBoard, LastUserRemovesTheName) {
  const std::string name = TestName("last");
  auto a = MustOpen(name, 0), b = MustOpen(name, 1);
  ASSERT_TRUE(a && b);
  a.reset();
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  EXPECT_GE(fd, 0);
  if (fd >= 0) close(fd);
  b.reset();
  fd = shm_open(name.c_str(), O_RDWR, 0600);
  EXPECT_LT(fd, 0);
  if (fd >= 0) close(fd);
}

}  // namespace
}  // namespace shardsync::gpu::internal
