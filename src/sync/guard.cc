#include "sync/guard.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace shardsync::sync_internal {
namespace {

// How often a waiting rank polls the abort key and its peers' versions.
constexpr std::chrono::milliseconds kAbortPollInterval{50};
// How often a waiting rank looks at every other rank's liveness key (one GetMany of them all;
// a sync that completes sooner pays none).
constexpr std::chrono::milliseconds kAlivePollInterval{200};

}  // namespace

void SyncGuard::Begin(uint64_t version, Clock::time_point t0) {
  deadline_ = t0 + ctx_.opt.sync_timeout;
  version_ = version;
  next_abort_check_ = t0 + kAbortPollInterval;
  next_alive_check_ = t0 + kAlivePollInterval;
}

std::string SyncGuard::AliveKey(int rank) const {
  return ctx_.Key("alive/" + std::to_string(rank));
}

std::vector<std::string> SyncGuard::OthersAlive() const {
  std::vector<std::string> keys;
  for (int r = 0; r < ctx_.world; ++r) {
    if (r != ctx_.rank) keys.push_back(AliveKey(r));
  }
  return keys;
}

Result<std::vector<std::string>> SyncGuard::GetFromRanks(
    const std::vector<std::string>& keys, const std::vector<int>& ranks, Clock::time_point deadline,
    const std::function<std::string(size_t)>& what,
    const std::pair<std::string, std::string>* set_first) {
  std::vector<std::string> all = keys;
  for (int r : ranks) all.push_back(AliveKey(r));
  auto named = [&](size_t i) {
    return i < keys.size()
               ? what(i)
               : "sync rank " + std::to_string(ranks[i - keys.size()]) + " to join the job";
  };
  auto got = GetManyUntil(all, deadline, named, /*watch_abort=*/false, set_first);
  if (!got.ok()) {
    if (got.status().code() == StatusCode::kUnavailable) {
      return GonePeer(ranks, /*in_sync=*/false, got.status());
    }
    return got.status();
  }
  got->resize(keys.size());
  return got;
}

Status SyncGuard::GonePeer(const std::vector<int>& ranks, bool in_sync, const Status& fallback) {
  for (int p : ranks) {
    auto a = ctx_.store.Get(AliveKey(p), Millis(0));
    if (a.ok() || a.status().code() != StatusCode::kUnavailable) continue;
    // A rank that posted its verdict of this sync may have closed since: it is done with it.
    if (in_sync && PostedVerdict(p)) continue;
    return UnavailableError("sync rank " + std::to_string(ctx_.rank) + ": sync rank " +
                            std::to_string(p) + " is gone (" + a.status().message() + ")" +
                            (in_sync ? " during version " + std::to_string(version_) : ""));
  }
  return fallback;
}

Status SyncGuard::CheckAlive() {
  if (others_.empty() && ctx_.world > 1) {
    for (int r = 0; r < ctx_.world; ++r) {
      if (r != ctx_.rank) others_.push_back(r);
    }
    others_alive_ = OthersAlive();
  }
  if (others_.empty()) return OkStatus();
  auto a = ctx_.store.GetMany(others_alive_, Millis(0));
  if (a.ok() || a.status().code() != StatusCode::kUnavailable) return OkStatus();
  return GonePeer(others_, /*in_sync=*/true, OkStatus());
}

std::string SyncGuard::VKey(const std::string& k) const {
  // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "v" + to_string(..).
  std::string key = "v";
  key += std::to_string(version_);
  key += '/';
  key += k;
  return key;
}

Result<std::string> SyncGuard::GetUntil(const std::string& key, Clock::time_point deadline,
                                        const std::string& what, bool watch_abort) {
  SS_ASSIGN_OR_RETURN(std::vector<std::string> v,
                      GetManyUntil(
                          {key}, deadline, [&](size_t) { return what; }, watch_abort));
  return std::move(v[0]);
}

Result<std::vector<std::string>> SyncGuard::GetManyUntil(
    const std::vector<std::string>& keys, Clock::time_point deadline,
    const std::function<std::string(size_t)>& what, bool watch_abort,
    const std::pair<std::string, std::string>* set_first) {
  StoreClient& store = ctx_.store;
  if (set_first && keys.empty()) {
    SS_RETURN_IF_ERROR(store.Set(set_first->first, set_first->second));
    return std::vector<std::string>{};
  }
  while (true) {
    auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (left <= Millis(0)) {
      if (set_first) SS_RETURN_IF_ERROR(store.Set(set_first->first, set_first->second));
      set_first = nullptr;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (!store.Get(keys[i], Millis(0)).ok()) {
          return DeadlineExceededError("sync rank " + std::to_string(ctx_.rank) +
                                       ": timed out waiting for " + what(i));
        }
      }
      left = Millis(0);  // every key arrived at the last moment: take them
    }
    const Millis slice = std::min(left, Millis(watch_abort ? 5 : 1000));
    auto r = set_first ? store.SetThenGetMany(set_first->first, set_first->second, keys, slice)
                       : store.GetMany(keys, slice);
    set_first = nullptr;
    if (r.ok()) return r;
    if (r.status().code() != StatusCode::kDeadlineExceeded) return r.status();
    if (left <= Millis(0)) continue;
    if (watch_abort) {
      Progress();
      SS_RETURN_IF_ERROR(CheckAbort());
    }
  }
}

Status SyncGuard::CheckAbort(bool force) {
  const auto now = Clock::now();
  if (!force && now < next_abort_check_) return OkStatus();
  next_abort_check_ = now + kAbortPollInterval;
  StoreClient& store = ctx_.store;
  auto a = store.Get(ctx_.Key(VKey("abort")), Millis(0));
  if (a.ok())
    return AbortedError("sync rank " + std::to_string(ctx_.rank) + ": version " +
                        std::to_string(version_) + " aborted: " + *a);
  for (int p : peers_) {
    auto v = store.Get(ctx_.Key("cur/" + std::to_string(p)), Millis(0));
    if (!v.ok()) continue;
    const uint64_t pv = std::strtoull(v->c_str(), nullptr, 10);
    // A peer that already posted its verdict for this version may legitimately have moved on
    // (it gathered every verdict, ours included, while we still wait for a slower rank's).
    if (pv > version_ && !PostedVerdict(p)) {
      Status s = FailedPreconditionError(
          "sync rank " + std::to_string(ctx_.rank) + ": version " + std::to_string(version_) +
          " differs from peer sync rank " + std::to_string(p) + "'s version " + v.value());
      // The peer is waiting on its own version: tell it too.
      store
          .Set(ctx_.Key("v" + v.value() + "/abort"),
               "sync rank " + std::to_string(ctx_.rank) + " failed: " + s.ToString())
          .IgnoreError();
      return s;
    }
  }
  // Last: a failed rank's abort key names the cause, a dead one's liveness key only its death.
  if (force || now >= next_alive_check_) {
    next_alive_check_ = now + kAlivePollInterval;
    SS_RETURN_IF_ERROR(CheckAlive());
  }
  return OkStatus();
}

Status SyncGuard::CheckDeadline(const std::string& what) {
  if (Clock::now() > deadline_) {
    return DeadlineExceededError("sync rank " + std::to_string(ctx_.rank) + ": version " +
                                 std::to_string(version_) + " timed out after " +
                                 std::to_string(ctx_.opt.sync_timeout.count()) + " ms " + what);
  }
  return CheckAbort();
}

Status SyncGuard::CheckDeadline(size_t i, const std::function<std::string(size_t)>& who) {
  if (Clock::now() > deadline_) return CheckDeadline(who(i));
  return CheckAbort();
}

Status SyncGuard::WaitAll(std::vector<XferId>& ids, const std::string& what) {
  int idle = 0;
  while (!ids.empty()) {
    // In posting order, stopping at the first transfer still in flight.
    size_t done = 0;
    for (; done < ids.size(); ++done) {
      auto st = ctx_.tx.Poll(ids[done]);
      if (!st.ok()) {
        Status e = st.status();
        return e.Annotate("sync rank " + std::to_string(ctx_.rank) + ": " + what);
      }
      if (*st == XferState::kInProgress) break;
    }
    const bool progressed = done > 0;
    ids.erase(ids.begin(), ids.begin() + done);
    if (ids.empty()) break;
    SS_RETURN_IF_ERROR(CheckDeadline(what));
    Backoff(progressed, idle);
  }
  return OkStatus();
}

void SyncGuard::PostAbort(const Status& s) {
  // Aborted is usually someone else's failure, already posted (keep its cause); but a pair
  // cancelled by an earlier failure also fails with Aborted, and peers must hear of it.
  StoreClient& store = ctx_.store;
  const std::string key = ctx_.Key(VKey("abort"));
  if (s.code() == StatusCode::kAborted && store.Get(key, Millis(0)).ok()) return;
  store.Set(key, "sync rank " + std::to_string(ctx_.rank) + " failed: " + s.ToString())
      .IgnoreError();
}

void SyncGuard::Progress() {
  // The transport's own step (transport.h Progress), no longer a flush posted to a peer and
  // polled for the same effect: it drives UCX's worker over TCP, where a peer's flush or
  // rendezvous tail completes only while this side progresses.
  if (!peers_.empty()) ctx_.tx.Progress();
}

bool SyncGuard::PostedVerdict(int p) {
  if (board_) {
    std::string text;
    return board_->Get(p, version_, &text) != VerdictBoard::Lookup::kMissing;
  }
  return ctx_.store.Get(ctx_.Key(VKey("done/") + std::to_string(p)), Millis(0)).ok();
}

void SyncGuard::Backoff(bool progressed, int& idle) {
  if (progressed) {
    idle = 0;
    return;
  }
  if (++idle < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(idle < 1024 ? 20 : 200));
  }
}

void SyncGuard::PairBackoff(bool progressed, Clock::time_point& idle_since) {
  const auto now = Clock::now();
  if (progressed) idle_since = now;
  if (now - idle_since < Millis(50)) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace shardsync::sync_internal
