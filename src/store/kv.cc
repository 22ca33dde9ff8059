#include "store/kv.h"

#include <charconv>

namespace shardsync::store_kv {

Status Kv::CheckWritable(const std::string& key, OwnerId who) const {
  auto it = kv_.find(key);
  if (it != kv_.end() && it->second.owner != 0 && it->second.owner != who) {
    return FailedPreconditionError("store: key '" + key +
                                   "' is an ephemeral key held by another live connection");
  }
  return OkStatus();
}

bool Kv::Erase(const std::string& key) {
  auto it = kv_.find(key);
  if (it == kv_.end()) return false;
  if (it->second.owner != 0) {
    auto o = owned_.find(it->second.owner);
    if (o != owned_.end()) {
      o->second.erase(key);
      if (o->second.empty()) owned_.erase(o);
    }
  }
  bytes_ -= Cost(key, it->second.value);
  kv_.erase(it);
  return true;
}

bool Kv::EraseDead(const std::string& key) {
  auto d = dead_.find(key);
  if (d == dead_.end()) return false;
  bytes_ -= Cost(key, d->second);
  dead_.erase(d);
  return true;
}

Status Kv::Set(const std::string& key, std::string value, OwnerId who, bool ephemeral) {
  SS_RETURN_IF_ERROR(CheckWritable(key, who));
  auto it = kv_.find(key);
  auto d = dead_.find(key);
  const size_t old = (it == kv_.end() ? 0 : Cost(key, it->second.value)) +
                     (d == dead_.end() ? 0 : Cost(key, d->second));
  const size_t now = Cost(key, value);
  if (now > old && now - old > Room()) {
    return OutOfRangeError("store set '" + key.substr(0, 200) +
                           "': the store would hold more than its quota of " +
                           std::to_string(max_bytes_) +
                           " bytes (keys, values, dead keys' reasons and requests in flight)");
  }
  // Allocate before changing anything else: a bad_alloc leaves the store as it was.
  bool inserted = false;
  if (it == kv_.end()) {
    it = kv_.emplace(key, Entry{}).first;
    inserted = true;
  }
  try {
    if (ephemeral) owned_[who].insert(key);
  } catch (...) {
    if (inserted) kv_.erase(it);
    throw;
  }
  EraseDead(key);
  Entry& e = it->second;
  if (e.owner != 0 && !ephemeral) {
    // The owner re-set its key as plain: the key no longer dies with the connection.
    auto o = owned_.find(e.owner);
    if (o != owned_.end()) {
      o->second.erase(key);
      if (o->second.empty()) owned_.erase(o);
    }
  }
  e.owner = ephemeral ? who : 0;
  bytes_ -= e.value.size() + (inserted ? 0 : key.size() + kEntryOverhead);
  e.value = std::move(value);
  bytes_ += now;
  return OkStatus();
}

Result<std::string> Kv::SetIfAbsent(const std::string& key, std::string value, OwnerId who,
                                    bool ephemeral) {
  if (const std::string* v = Find(key)) return *v;
  SS_RETURN_IF_ERROR(Set(key, value, who, ephemeral));
  return value;
}

Result<int64_t> Kv::Add(const std::string& key, int64_t delta, OwnerId who) {
  SS_RETURN_IF_ERROR(CheckWritable(key, who));
  int64_t cur = 0;
  auto it = kv_.find(key);
  if (it != kv_.end()) {
    const std::string& v = it->second.value;
    auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), cur);
    if (ec != std::errc() || ptr != v.data() + v.size()) {
      return InvalidArgumentError("store add: key '" + key + "' holds a non-integer value");
    }
  }
  int64_t next = 0;
  if (__builtin_add_overflow(cur, delta, &next)) {
    return OutOfRangeError("store add: key '" + key + "' overflows");
  }
  const bool ephemeral = it != kv_.end() && it->second.owner != 0;
  SS_RETURN_IF_ERROR(Set(key, std::to_string(next), who, ephemeral));
  return next;
}

int64_t Kv::DeletePrefix(std::string_view prefix) {
  int64_t n = 0;
  for (auto it = kv_.lower_bound(std::string(prefix));
       it != kv_.end() && std::string_view(it->first).starts_with(prefix);) {
    const std::string key = (it++)->first;
    Erase(key);
    ++n;
  }
  for (auto it = dead_.lower_bound(std::string(prefix));
       it != dead_.end() && std::string_view(it->first).starts_with(prefix);) {
    bytes_ -= Cost(it->first, it->second);
    it = dead_.erase(it);
  }
  return n;
}

Status Kv::MarkDead(const std::string& key, std::string reason) {
  if (reason.size() > kMaxReasonBytes) reason.resize(kMaxReasonBytes);
  auto it = kv_.find(key);
  auto d = dead_.find(key);
  const size_t old = (it == kv_.end() ? 0 : Cost(key, it->second.value)) +
                     (d == dead_.end() ? 0 : Cost(key, d->second));
  const size_t now = Cost(key, reason);
  if (now > old && now - old > Room()) {
    return OutOfRangeError("store mark-dead '" + key.substr(0, 200) +
                           "': the store would hold more than its quota of " +
                           std::to_string(max_bytes_) + " bytes");
  }
  std::string& slot = dead_[key];  // allocates before anything changes
  Erase(key);
  bytes_ = bytes_ - (d == dead_.end() ? 0 : Cost(key, slot)) + now;
  slot = std::move(reason);
  return OkStatus();
}

size_t Kv::ReleaseOwner(OwnerId who, const std::string& reason) {
  auto o = owned_.find(who);
  if (o == owned_.end()) return 0;
  const std::set<std::string> keys = std::move(o->second);
  owned_.erase(o);
  size_t n = 0;
  for (const std::string& k : keys) {
    auto it = kv_.find(k);
    if (it == kv_.end() || it->second.owner != who) continue;
    bytes_ -= Cost(k, it->second.value);
    kv_.erase(it);
    // A closing connection's keys always die (the reason is the server's, ~100 bytes a key).
    // (A live key has no dead record: Set erased it.)
    dead_[k] = reason;
    bytes_ += Cost(k, reason);
    ++n;
  }
  return n;
}

const std::string* Kv::Find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second.value;
}

const std::string* Kv::DeadReason(const std::string& key) const {
  auto it = dead_.find(key);
  return it == dead_.end() ? nullptr : &it->second;
}

}  // namespace shardsync::store_kv
