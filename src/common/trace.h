// SHARDSYNC_TRACE=1: timestamped steps on stderr for device debugging (the session, cuda_ipc and
// nccl transports write them; merge the ranks' logs by the timestamp). One switch and one clock
// for every layer, so the lines of different processes on a host sort into one timeline.
// SHARDSYNC_TRACE=buffered keeps the lines in memory and writes them at exit (or every MiB): a
// write to stderr costs a syscall, tens of microseconds on some hosts, which would sit between the
// very steps being timed. A process killed by a signal loses its buffered lines.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "shardsync/settings.h"

namespace shardsync::trace {

enum class Mode { kOff, kNow, kBuffered };

inline Mode GetMode() {
  static const Mode mode = [] {
    auto v = TextKnob("SHARDSYNC_TRACE");  // 0 | 1 | buffered (settings.cc)
    if (!v.ok()) ReportKnobError(v.status());
    if (!v.ok() || *v == "0") return Mode::kOff;
    return *v == "buffered" ? Mode::kBuffered : Mode::kNow;
  }();
  return mode;
}

// Read once: callers sit on every sync's path and build their text only when this is true.
inline bool On() { return GetMode() != Mode::kOff; }

// Seconds on the steady clock (CLOCK_MONOTONIC: comparable across processes on one host).
inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Buffer {
 public:
  ~Buffer() { Flush(); }
  void Add(const char* s, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    text_.append(s, n);
    if (text_.size() > (size_t{1} << 20)) FlushLocked();
  }
  void Flush() {
    std::lock_guard<std::mutex> lock(mu_);
    FlushLocked();
  }

 private:
  void FlushLocked() {
    if (text_.empty()) return;
    std::fwrite(text_.data(), 1, text_.size(), stderr);
    std::fflush(stderr);
    text_.clear();
  }
  std::mutex mu_;
  std::string text_;
};

inline Buffer& TheBuffer() {
  static Buffer b;
  return b;
}

// Writes what the buffered mode holds (before a process leaves through _exit).
inline void Flush() {
  if (GetMode() == Mode::kBuffered) TheBuffer().Flush();
}

// One line, "<seconds> <printf text>", when tracing is on.
[[gnu::format(printf, 1, 2)]] inline void Line(const char* fmt, ...) {
  const Mode mode = GetMode();
  if (mode == Mode::kOff) return;
  char buf[1024];
  int n = std::snprintf(buf, sizeof(buf), "%.6f ", Now());
  va_list ap;
  va_start(ap, fmt);
  const int m = std::vsnprintf(buf + n, sizeof(buf) - n, fmt, ap);
  va_end(ap);
  n = std::min<int>(n + std::max(m, 0), static_cast<int>(sizeof(buf)) - 2);
  buf[n++] = '\n';
  if (mode == Mode::kBuffered) {
    TheBuffer().Add(buf, static_cast<size_t>(n));
  } else {
    std::fwrite(buf, 1, static_cast<size_t>(n), stderr);
  }
}

}  // namespace shardsync::trace
