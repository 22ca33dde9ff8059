#include "sync/watched_store.h"

#include <algorithm>

namespace shardsync::sync_internal {
namespace {

using Clock = std::chrono::steady_clock;

const Status& StatusOf(const Status& s) { return s; }
template <typename T>
Status StatusOf(const Result<T>& r) {
  return r.status();
}

}  // namespace

Status WatchedStore::CheckWatched() {
  if (watch_.empty()) return OkStatus();
  auto r = inner_.GetMany(watch_, Millis(0));
  // Absent keys (DeadlineExceeded at once) are not this check's business: only a dead one is.
  if (r.ok() || r.status().code() != StatusCode::kUnavailable) return OkStatus();
  return on_dead_ ? on_dead_(r.status()) : r.status();
}

template <typename R>
R WatchedStore::Sliced(Millis timeout, const std::function<R(Millis)>& wait) {
  const auto deadline = Clock::now() + std::min(timeout, Millis(int64_t{30} * 24 * 3600 * 1000));
  while (true) {
    const auto left =
        std::max(Millis(0), std::chrono::duration_cast<Millis>(deadline - Clock::now()));
    R r = wait(std::min(left, kWatchSlice));
    if (StatusOf(r).code() != StatusCode::kDeadlineExceeded) return r;
    // Callers that poll with short waits of their own (a transport's connect loop) are checked
    // as often as long waits are.
    if (Clock::now() >= next_check_) {
      next_check_ = Clock::now() + kWatchSlice;
      Status dead = CheckWatched();
      if (!dead.ok()) return dead;
    }
    if (left <= kWatchSlice) {
      if (timeout <= kWatchSlice) return r;
      // The store's message names the last slice; the caller waited all of `timeout`.
      return DeadlineExceededError(StatusOf(r).message() + " (" + std::to_string(timeout.count()) +
                                   " ms in all)");
    }
  }
}

Result<std::string> WatchedStore::Get(const std::string& key, Millis timeout) {
  if (watch_.empty()) return inner_.Get(key, timeout);  // the sync path: no std::function
  return Sliced<Result<std::string>>(timeout, [&](Millis t) { return inner_.Get(key, t); });
}

Status WatchedStore::Wait(const std::vector<std::string>& keys, Millis timeout) {
  if (watch_.empty()) return inner_.Wait(keys, timeout);
  return Sliced<Status>(timeout, [&](Millis t) { return inner_.Wait(keys, t); });
}

Result<std::vector<std::string>> WatchedStore::GetMany(const std::vector<std::string>& keys,
                                                       Millis timeout) {
  if (watch_.empty()) return inner_.GetMany(keys, timeout);
  return Sliced<Result<std::vector<std::string>>>(
      timeout, [&](Millis t) { return inner_.GetMany(keys, t); });
}

Result<std::vector<std::string>> WatchedStore::SetThenGetMany(const std::string& key,
                                                              std::string_view value,
                                                              const std::vector<std::string>& keys,
                                                              Millis timeout) {
  if (watch_.empty()) return inner_.SetThenGetMany(key, value, keys, timeout);
  bool set = false;
  return Sliced<Result<std::vector<std::string>>>(timeout, [&](Millis t) {
    if (set) return inner_.GetMany(keys, t);
    set = true;
    return inner_.SetThenGetMany(key, value, keys, t);
  });
}

}  // namespace shardsync::sync_internal
