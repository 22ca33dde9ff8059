// The store's key-value state, apart from sockets: plain keys, ephemeral keys bound to the
// connection that set them (etcd leases, ZooKeeper ephemeral nodes), and dead keys: an ephemeral
// key whose connection closed, or a key a client marked dead, is removed and remembered with the
// reason, so a request that names it fails at once instead of waiting out its timeout.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardsync/status.h"

namespace shardsync::store_kv {

// A connection's id; 0 is nobody (plain keys).
using OwnerId = uint64_t;

class Kv {
 public:
  explicit Kv(size_t max_bytes) : max_bytes_(max_bytes) {}

  // Sets `key`; `ephemeral` binds it to `who`. A key held by another live owner is refused
  // (FailedPrecondition); setting a dead key revives it. OutOfRange past the byte quota.
  Status Set(const std::string& key, std::string value, OwnerId who, bool ephemeral);
  // Sets `key` unless it exists (alive); returns the value it holds afterwards.
  Result<std::string> SetIfAbsent(const std::string& key, std::string value, OwnerId who,
                                  bool ephemeral);
  // Adds `delta` to an integer key (absent or dead: 0); returns the new value.
  Result<int64_t> Add(const std::string& key, int64_t delta, OwnerId who);
  // Deletes every key and dead-key record starting with `prefix`; returns the keys deleted.
  int64_t DeletePrefix(std::string_view prefix);
  // Removes `key` (present or not) and records it dead with `reason`.
  void MarkDead(const std::string& key, std::string reason);
  // `who` went away: every key it held becomes dead with `reason`. Returns how many.
  size_t ReleaseOwner(OwnerId who, const std::string& reason);

  // The live value of `key`, nullptr when absent or dead.
  const std::string* Find(const std::string& key) const;
  // Why `key` is dead, nullptr when it is not.
  const std::string* DeadReason(const std::string& key) const;
  size_t bytes() const { return bytes_; }

 private:
  struct Entry {
    std::string value;
    OwnerId owner = 0;  // 0: plain key
  };
  static size_t Cost(const std::string& key, const std::string& value) {
    return key.size() + value.size();
  }
  // FailedPrecondition when `key` is ephemeral and held by another owner than `who`.
  Status CheckWritable(const std::string& key, OwnerId who) const;
  // Erases `key` and its ownership; true if it existed.
  bool Erase(const std::string& key);

  size_t max_bytes_;
  size_t bytes_ = 0;
  std::map<std::string, Entry> kv_;
  std::map<std::string, std::string> dead_;
  std::unordered_map<OwnerId, std::set<std::string>> owned_;
};

}  // namespace shardsync::store_kv
