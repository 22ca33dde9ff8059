// GpuTurnstile is host code (built with or without CUDA): one holder at a time, a dead holder
// replaced, a holder kept too long bypassed, the name gone with its last user. Runs everywhere.
#include "cuda/gpu_turnstile.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <thread>

namespace shardsync::gpu::internal {
namespace {

using Turn = GpuTurnstile::Turn;

std::string TestName(const std::string& what) {
  return GpuTurnstile::Name("test/" + what + "/" + std::to_string(getpid()) + "/", "0000:1B:00.0");
}

bool NameExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return false;
  close(fd);
  return true;
}

TEST(GpuTurnstile, NameIsOnePosixComponentPerJobAndGpu) {
  const std::string a = GpuTurnstile::Name("job/a/", "0000:1B:00.0");
  EXPECT_EQ(a.rfind('/'), 0u) << a;
  EXPECT_EQ(a.find(':'), std::string::npos) << a;
  EXPECT_EQ(a, GpuTurnstile::Name("job/a/", "0000:1B:00.0"));
  EXPECT_NE(a, GpuTurnstile::Name("job/b/", "0000:1B:00.0"));
  EXPECT_NE(a, GpuTurnstile::Name("job/a/", "0000:2C:00.0"));
}

TEST(GpuTurnstile, OneHolderAtATime) {
  const std::string name = TestName("one");
  auto a = GpuTurnstile::Open(name);
  auto b = GpuTurnstile::Open(name);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*a)->HolderPid(), 0);
  EXPECT_EQ((*a)->TryTake(), Turn::kMine);
  EXPECT_EQ((*a)->TryTake(), Turn::kMine);  // taken already
  EXPECT_EQ((*a)->HolderPid(), getpid());
  EXPECT_EQ((*b)->TryTake(), Turn::kBusy);  // same process, another instance
  EXPECT_FALSE((*b)->held());
  (*b)->Give();  // not its turn: changes nothing
  EXPECT_EQ((*b)->TryTake(), Turn::kBusy);
  (*a)->Give();
  EXPECT_FALSE((*a)->held());
  EXPECT_EQ((*b)->TryTake(), Turn::kMine);
  EXPECT_EQ((*a)->TryTake(), Turn::kBusy);
  b->reset();  // leaving gives the turn back
  EXPECT_EQ((*a)->TryTake(), Turn::kMine);
}

TEST(GpuTurnstile, DeadHolderIsReplaced) {
  const std::string name = TestName("dead");
  auto a = GpuTurnstile::Open(name);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // takes the turn and dies holding it
    auto c = GpuTurnstile::Open(name);
    const bool took = c.ok() && (*c)->TryTake() == Turn::kMine;
    _exit(took ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ((*a)->HolderPid(), child);
  EXPECT_EQ((*a)->TryTake(), Turn::kMine);
  EXPECT_EQ((*a)->HolderPid(), getpid());
}

TEST(GpuTurnstile, HolderKeptTooLongIsBypassed) {
  const std::string name = TestName("long");
  auto a = GpuTurnstile::Open(name);
  auto b = GpuTurnstile::Open(name, std::chrono::milliseconds(20));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ((*a)->TryTake(), Turn::kMine);
  EXPECT_EQ((*b)->TryTake(), Turn::kBusy);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ((*b)->TryTake(), Turn::kBypassed);
  EXPECT_FALSE((*b)->held());
  EXPECT_EQ((*a)->HolderPid(), getpid());  // still a's: bypassing takes nothing
  (*a)->Give();
  EXPECT_EQ((*b)->TryTake(), Turn::kMine);
}

TEST(GpuTurnstile, LastUserRemovesTheName) {
  const std::string name = TestName("last");
  auto a = GpuTurnstile::Open(name);
  auto b = GpuTurnstile::Open(name);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(NameExists(name));
  a->reset();
  EXPECT_TRUE(NameExists(name));
  b->reset();
  EXPECT_FALSE(NameExists(name));
}

TEST(GpuTurnstile, ForeignSegmentIsRefused) {
  const std::string name = TestName("foreign");
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 100), 0);
  close(fd);
  auto t = GpuTurnstile::Open(name);
  EXPECT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("not ours"), std::string::npos) << t.status().ToString();
  shm_unlink(name.c_str());
}

}  // namespace
}  // namespace shardsync::gpu::internal
