#include "store/net.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace shardsync::store_net {

Status ErrnoStatus(StatusCode code, const std::string& what, int err) {
  return Status(code, what + ": " + std::strerror(err));
}

Status SetNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return ErrnoStatus(StatusCode::kInternal, "fcntl(O_NONBLOCK)", errno);
  }
  return OkStatus();
}

int MillisLeft(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  // Round up so a poll never returns just before the deadline and spins.
  int64_t ms = left.count() + 1;
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // Walks max(len) bytes regardless of the first mismatch; the length difference is folded in.
  size_t n = std::max(a.size(), b.size());
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | (x ^ y);
  }
  return diff == 0;
}

}  // namespace shardsync::store_net
