// Small POSIX socket helpers shared by the store server and client.
#pragma once

#include <chrono>
#include <string>

#include "shardsync/status.h"

namespace shardsync::store_net {

using Clock = std::chrono::steady_clock;

// Longest wait honoured (30 days): larger timeouts would overflow clock arithmetic.
inline constexpr std::chrono::milliseconds kMaxWait{int64_t{30} * 24 * 3600 * 1000};
inline std::chrono::milliseconds ClampWait(std::chrono::milliseconds t) {
  return t < kMaxWait ? t : kMaxWait;
}

// Status from errno, naming the operation.
Status ErrnoStatus(StatusCode code, const std::string& what, int err);
Status SetNonBlocking(int fd);
// Milliseconds left until `deadline` (0 if past), clamped for poll().
int MillisLeft(Clock::time_point deadline);
// Compares in time independent of where the strings differ (token check).
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace shardsync::store_net
