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

TEST(CudaIpcMailbox, ADeadRanksInboxIsSweptByTheNextConnect) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // a rank that creates its inbox and dies before unlinking it
    close(fds[0]);
    const std::string name = shm::OwnSegmentPrefix() + "ipc0-1_2";
    auto m = Mailbox::Create(name);
    const char ok = m.ok() ? 1 : 0;
    (void)!write(fds[1], &ok, 1);
    (void)!write(fds[1], name.data(), name.size());
    _exit(0);  // no destructor: the segment stays, as after SIGKILL
  }
  close(fds[1]);
  char ok = 0;
  ASSERT_EQ(read(fds[0], &ok, 1), 1);
  std::string name(256, '\0');
  const ssize_t n = read(fds[0], name.data(), name.size());
  close(fds[0]);
  ASSERT_GT(n, 0);
  name.resize(static_cast<size_t>(n));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_EQ(ok, 1);
  ASSERT_TRUE(Exists(name)) << name;
  EXPECT_GE(shm::SweepOrphanSegments(), 1);
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
