// SHARDSYNC_TRACE=1: timestamped steps on stderr for device debugging (the session, cuda_ipc and
// nccl transports write them; merge the ranks' logs by the timestamp). One switch and one clock
// for every layer, so the lines of different processes on a host sort into one timeline.
#pragma once

#include <chrono>
#include <cstdlib>

namespace shardsync::trace {

// Read once: callers sit on every sync's path and build their text only when this is true.
inline bool On() {
  static const bool on = [] {
    const char* v = std::getenv("SHARDSYNC_TRACE");
    return v && *v && *v != '0';
  }();
  return on;
}

// Seconds on the steady clock (CLOCK_MONOTONIC: comparable across processes on one host).
inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace shardsync::trace
