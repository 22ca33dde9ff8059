// cuda_ipc mailboxes are named under the shm transport's convention (creator's uid, pid namespace,
// pid), so a rank killed during Connect, before it unlinked its inboxes, leaves nothing behind for
// good: the next connect on the host sweeps them (issue 26). Host-only: no GPU needed.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#ifdef SHARDSYNC_HAVE_CUDA
#include "cuda/cuda_ipc/shm_mailbox.h"
#include "transport/shm_segment.h"

namespace shardsync::gpu::internal {
namespace {

bool Exists(const std::string& shm_name) {
  struct stat st {};
  return stat(("/dev/shm" + shm_name).c_str(), &st) == 0;
}

// Any connect on the host sweeps (ctest runs other tests' connects in parallel), so the inbox may
// be reclaimed by another process's sweep as soon as its creator is dead: existence is checked
// while the creator lives, and after its death only the outcome of our sweep is asserted.
TEST(CudaIpcMailbox, ADeadRanksInboxIsSweptByTheNextConnect) {
  int up[2], down[2];
  ASSERT_EQ(pipe(up), 0);
  ASSERT_EQ(pipe(down), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // a rank that creates its inbox and dies before unlinking it
    close(up[0]);
    close(down[1]);
    const std::string name = shm::OwnSegmentPrefix() + "ipc0-1_2";
    auto m = Mailbox::Create(name);
    const char ok = m.ok() ? 1 : 0;
    (void)!write(up[1], &ok, 1);
    (void)!write(up[1], name.data(), name.size());
    close(up[1]);
    char go = 0;
    (void)!read(down[0], &go, 1);  // stay alive until the parent has seen the inbox
    _exit(0);                      // no destructor: the segment stays, as after SIGKILL
  }
  close(up[1]);
  close(down[0]);
  char ok = 0;
  ASSERT_EQ(read(up[0], &ok, 1), 1);
  std::string name(256, '\0');
  const ssize_t n = read(up[0], name.data(), name.size());
  close(up[0]);
  ASSERT_GT(n, 0);
  name.resize(static_cast<size_t>(n));
  ASSERT_EQ(ok, 1);
  EXPECT_TRUE(Exists(name)) << name;  // its creator is alive: no sweep may take it
  close(down[1]);                     // let the child die
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  shm::SweepOrphanSegments();
  EXPECT_FALSE(Exists(name)) << name << " survived the sweep";
}

TEST(CudaIpcMailbox, ALiveRanksInboxIsLeftAlone) {
  const std::string name = shm::OwnSegmentPrefix() + "ipc0-3_4";
  auto m = Mailbox::Create(name);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  shm::SweepOrphanSegments();
  EXPECT_TRUE(Exists(name));
  delete *m;  // the owner unlinks it
  EXPECT_FALSE(Exists(name));
}

}  // namespace
}  // namespace shardsync::gpu::internal
#endif  // SHARDSYNC_HAVE_CUDA
