// The store as a session's parts and its transport use it: while `watch` is set (Connect), every
// blocking wait also watches the peers' liveness keys, so a transport or a prepared pair waiting
// at Connect for an address a dead peer will never publish fails within kWatchSlice, naming the
// peer, instead of at its timeout. Outside Connect it forwards every call unchanged (the sync
// path's waits watch their peers through SyncGuard::CheckAbort, off the critical path).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "shardsync/store.h"

namespace shardsync::sync_internal {

class WatchedStore final : public StoreClient {
 public:
  // How often a blocked wait looks at the watched keys.
  static constexpr Millis kWatchSlice{100};

  explicit WatchedStore(StoreClient& inner) : inner_(inner) {}

  // Starts watching `keys` (every one must exist: a wait fails when one is dead); `on_dead` turns
  // the store's Unavailable into the error the caller sees. Empty `keys`: stop watching.
  void Watch(std::vector<std::string> keys, std::function<Status(const Status&)> on_dead) {
    watch_ = std::move(keys);
    on_dead_ = std::move(on_dead);
  }

  Status Set(const std::string& key, std::string_view value) override {
    return inner_.Set(key, value);
  }
  Result<std::string> Get(const std::string& key, Millis timeout) override;
  Result<int64_t> Add(const std::string& key, int64_t delta) override {
    return inner_.Add(key, delta);
  }
  Status Wait(const std::vector<std::string>& keys, Millis timeout) override;
  Result<std::vector<std::string>> GetMany(const std::vector<std::string>& keys,
                                           Millis timeout) override;
  Status SetMany(const std::vector<std::pair<std::string, std::string>>& kvs) override {
    return inner_.SetMany(kvs);
  }
  Result<std::vector<std::string>> SetThenGetMany(const std::string& key, std::string_view value,
                                                  const std::vector<std::string>& keys,
                                                  Millis timeout) override;
  Status Barrier(const std::string& name, int world, Millis timeout) override {
    return inner_.Barrier(name, world, timeout);
  }
  Result<int64_t> DeletePrefix(const std::string& prefix) override {
    return inner_.DeletePrefix(prefix);
  }
  Status DeletePrefixes(const std::vector<std::string>& prefixes) override {
    return inner_.DeletePrefixes(prefixes);
  }
  Status SetEphemeral(const std::string& key, std::string_view value) override {
    return inner_.SetEphemeral(key, value);
  }
  Result<std::string> SetIfAbsent(const std::string& key, std::string_view value,
                                  bool ephemeral) override {
    return inner_.SetIfAbsent(key, value, ephemeral);
  }
  Status MarkDead(const std::string& key, std::string_view reason) override {
    return inner_.MarkDead(key, reason);
  }

 private:
  // Runs `wait(slice)` in slices of kWatchSlice up to `timeout`; between slices, fails with
  // on_dead_ when a watched key is dead.
  template <typename R>
  R Sliced(Millis timeout, const std::function<R(Millis)>& wait);
  // on_dead_'s error when a watched key is dead, else OK.
  Status CheckWatched();

  StoreClient& inner_;
  std::vector<std::string> watch_;
  std::function<Status(const Status&)> on_dead_;
  std::chrono::steady_clock::time_point next_check_{};
};

}  // namespace shardsync::sync_internal
