// Helpers of the cuda layer's shared-memory records that any process of a job on one host may
// open (gpu_turnstile.h, gpu_launch_board.h): owner tokens, liveness, segment names.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string>

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

}  // namespace shardsync::gpu::internal
