// Resource limits of the store server: how many connections it may hold given the process's
// descriptor limit, and rate-limited logging (an abusive peer must not turn the log into the
// attack). Header-only so tests check the arithmetic directly.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace shardsync::store_limits {

// Hard ceiling whatever the descriptor limit: far above any job's ranks.
inline constexpr size_t kMaxConnections = 16384;
// Bytes the store holds for requests in all (etcd's --quota-backend-bytes idea): keys, values,
// dead keys' reasons, parked requests' keys, buffered requests and unread replies. A job keeps
// addresses, memory keys and verdicts there, kilobytes per rank. StoreServerOptions::max_bytes.
inline constexpr size_t kMaxStoreBytes = size_t{1} << 30;
// Longest key a request may name (keys are names: a job's are under 100 bytes).
inline constexpr size_t kMaxKeyBytes = 4096;
// Reply bytes a connection may have queued before the server stops reading its requests.
inline constexpr size_t kOutHighWater = size_t{16} << 20;

struct ConnLimits {
  size_t total = 0;            // open connections, authenticated or not
  size_t unauthenticated = 0;  // of which before a valid hello (the oldest is evicted past it)
  size_t per_source = 0;       // of which from one source address
};

// Connections for a process whose RLIMIT_NOFILE soft limit is `nofile`: a quarter of the limit
// (at least 32) stays free for the rest of the process (rank 0 serves the store beside its own
// transports and files), half of the rest may be unauthenticated, so a flood of idle sockets can
// never take the slots a job's ranks need.
inline ConnLimits ConnectionLimits(uint64_t nofile) {
  const uint64_t reserve = std::max<uint64_t>(32, nofile / 4);
  const uint64_t total = nofile > reserve + 8 ? nofile - reserve : 8;
  ConnLimits l;
  l.total = static_cast<size_t>(std::min<uint64_t>(total, kMaxConnections));
  l.unauthenticated = std::max<size_t>(4, l.total / 2);
  l.per_source = std::max<size_t>(4, l.unauthenticated / 4);
  return l;
}

// At most one line per `period`; the next allowed line reports how many were suppressed.
class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  LogLimiter() = default;
  explicit LogLimiter(Clock::duration period) : period_(period) {}
  // True if a line may be written at `now`; `*suppressed` is then the count dropped before it.
  bool Allow(Clock::time_point now, uint64_t* suppressed) {
    if (started_ && now < next_) {
      ++dropped_;
      return false;
    }
    started_ = true;
    next_ = now + period_;
    *suppressed = dropped_;
    dropped_ = 0;
    return true;
  }

 private:
  Clock::duration period_ = std::chrono::seconds(5);
  Clock::time_point next_{};
  bool started_ = false;
  uint64_t dropped_ = 0;
};

}  // namespace shardsync::store_limits
