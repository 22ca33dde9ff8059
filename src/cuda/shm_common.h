// Helpers of the cuda layer's shared-memory records that any process of a job on one host may
// open (gpu_turnstile.h, gpu_launch_board.h): owner tokens, liveness, segment names.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "shardsync/status.h"

namespace shardsync::gpu::internal {

// pid << 32 | a per-process instance number: two instances in one process are different owners.
inline uint64_t NewShmToken() {
  static std::atomic<uint32_t> next{2};
  return (static_cast<uint64_t>(static_cast<uint32_t>(getpid())) << 32) | next.fetch_add(1);
}
inline int TokenPid(uint64_t token) { return static_cast<int>(token >> 32); }
// pid <= 0 counts as alive (no owner to check).
inline bool PidAlive(int pid) { return pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH; }

inline uint64_t ShmFnv(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// "/<kind>_<uid>_<job hash>_<gpu>": one POSIX name component (the GPU id's ':' and '.' become
// '_'), per user, job (transport prefix) and GPU.
inline std::string GpuShmName(const char* kind, const std::string& prefix,
                              const std::string& gpu_id) {
  std::string gpu;
  for (char c : gpu_id) gpu += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  char buf[112];
  std::snprintf(buf, sizeof(buf), "/%s_%u_%016llx_%.40s", kind, static_cast<unsigned>(getuid()),
                static_cast<unsigned long long>(ShmFnv(prefix)), gpu.c_str());
  return buf;
}

// Opens the shared segment `name` of `len` bytes that this user's processes share: created with
// O_EXCL (mode 0600, sized here) or, when it exists, opened only if it is a regular file this
// user owns, closed to everyone else and of `len` (or 0: its creator is sizing it) bytes, so a
// segment another user planted under the name (their /dev/shm file: the sticky directory keeps
// it there) is refused, never joined. `what` names it in errors. The descriptor, or Unavailable.
inline Result<int> OpenOwnShm(const std::string& name, size_t len, const std::string& what) {
  auto err = [&](const std::string& step) {
    return UnavailableError(what + " " + step + " " + name + ": " + std::strerror(errno));
  };
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd >= 0) {
    if (ftruncate(fd, static_cast<off_t>(len)) != 0) {
      const Status s = err("ftruncate");
      close(fd);
      shm_unlink(name.c_str());
      return s;
    }
    return fd;
  }
  if (errno != EEXIST) return err("shm_open");
  fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) return err("shm_open");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const Status s = err("fstat");
    close(fd);
    return s;
  }
  std::string wrong;
  if (!S_ISREG(st.st_mode))
    wrong = "is not a regular file";
  else if (st.st_uid != geteuid())
    wrong = "is owned by uid " + std::to_string(st.st_uid);
  else if ((st.st_mode & 077) != 0)
    wrong = "is open to other users";
  else if (st.st_size != 0 && st.st_size != static_cast<off_t>(len)) {
    wrong = "has " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(len);
  }
  if (!wrong.empty()) {
    close(fd);
    return UnavailableError(what + " " + name + " " + wrong +
                            " (not ours: refused; remove it as its owner)");
  }
  // Its creator sizes it right after creating it: an opener between the two sizes it the same.
  if (st.st_size == 0 && ftruncate(fd, static_cast<off_t>(len)) != 0) {
    const Status s = err("ftruncate");
    close(fd);
    return s;
  }
  return fd;
}

}  // namespace shardsync::gpu::internal
