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
  // Bytes a key, a value or a dead key's reason costs beyond its characters: its map node and
  // string headers, so that many tiny keys count what they hold.
  static constexpr size_t kEntryOverhead = 96;
  // A dead key's reason is cut to this many bytes (a client's MARK_DEAD names any length).
  static constexpr size_t kMaxReasonBytes = 1024;

  // `reserved` (may be null): bytes held elsewhere for requests (the server's connections:
  // buffered input, parked key lists, unread replies), counted against the same quota.
  explicit Kv(size_t max_bytes, const size_t* reserved = nullptr)
      : max_bytes_(max_bytes), reserved_(reserved) {}

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
  // Removes `key` (present or not) and records it dead with `reason` (cut to kMaxReasonBytes).
  // OutOfRange past the byte quota (the key stays as it was).
  Status MarkDead(const std::string& key, std::string reason);
  // `who` went away: every key it held becomes dead with `reason`. Returns how many.
  size_t ReleaseOwner(OwnerId who, const std::string& reason);

  // The live value of `key`, nullptr when absent or dead.
  const std::string* Find(const std::string& key) const;
  // Why `key` is dead, nullptr when it is not.
  const std::string* DeadReason(const std::string& key) const;
  // Keys, values and dead keys' reasons, with kEntryOverhead each.
  size_t bytes() const { return bytes_; }
  size_t max_bytes() const { return max_bytes_; }
  size_t keys() const { return kv_.size(); }
  size_t dead_keys() const { return dead_.size(); }

 private:
  struct Entry {
    std::string value;
    OwnerId owner = 0;  // 0: plain key
  };
  static size_t Cost(const std::string& key, const std::string& value) {
    return key.size() + value.size() + kEntryOverhead;
  }
  // Bytes the quota has room for beyond what `bytes_` and the reservations hold.
  size_t Room() const {
    const size_t used = bytes_ + (reserved_ != nullptr ? *reserved_ : 0);
    return used >= max_bytes_ ? 0 : max_bytes_ - used;
  }
  // Forgets `key`'s dead record; true if there was one.
  bool EraseDead(const std::string& key);
  // FailedPrecondition when `key` is ephemeral and held by another owner than `who`.
  Status CheckWritable(const std::string& key, OwnerId who) const;
  // Erases `key` and its ownership; true if it existed.
  bool Erase(const std::string& key);

  size_t max_bytes_;
  const size_t* reserved_;
  size_t bytes_ = 0;
  std::map<std::string, Entry> kv_;
  std::map<std::string, std::string> dead_;
  std::unordered_map<OwnerId, std::set<std::string>> owned_;
};

}  // namespace shardsync::store_kv
