// Loggers of the store and transport layers: stderr, so a command's stdout (JSON, addresses)
// is never mixed with log lines. spdlog's default logger writes to stdout.
#pragma once

#include <memory>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace shardsync {

inline std::shared_ptr<spdlog::logger> StderrLogger(const std::string& name) {
  if (auto existing = spdlog::get(name)) return existing;
  try {
    return spdlog::stderr_color_mt(name);
  } catch (const spdlog::spdlog_ex&) {  // registered concurrently by another thread
    return spdlog::get(name);
  }
}

inline spdlog::logger& StoreLog() {
  static std::shared_ptr<spdlog::logger> log = StderrLogger("shardsync.store");
  return *log;
}

inline spdlog::logger& TransportLog() {
  static std::shared_ptr<spdlog::logger> log = StderrLogger("shardsync.transport");
  return *log;
}

}  // namespace shardsync
