// The rank programs' setup barrier (internal.h SetupBarrier): every rank allocates and fills its
// synthetic weights before any rank connects, so --timeout-ms bounds what it names (connect and
// each sync) and not the fills. Issue 36: on a loaded 2-core machine `bench`'s rank 0, which fills
// the whole model for the broadcast-all baseline, reached Connect after the other ranks' 60 s
// connect timeout had run out, and every default `bench` failed.
#include <algorithm>
#include <chrono>

#include "job/internal.h"

namespace shardsync::job_internal {
namespace {

using Clock = std::chrono::steady_clock;

std::string SetupKey(const std::string& prefix, const std::string& launch, const char* what,
                     int rank) {
  // Scoped by the launch: a store shared by successive launches (torchrun's) keeps one launch's
  // dead keys from failing the next.
  return prefix + "setup/" + (launch.empty() ? "-" : launch) + "/" + what + "/" +
         std::to_string(rank);
}

std::string SetupKey(const JobSpec& job, const LaunchId& launch, const char* what, int rank) {
  return SetupKey(job.prefix, launch.id, what, rank);
}

}  // namespace

std::string SetupAliveKey(const std::string& prefix, const std::string& launch, int rank) {
  return SetupKey(prefix, launch, "alive", rank);
}

Status SetupBarrier::Begin() {
  SS_ASSIGN_OR_RETURN(launch_, LaunchIdFromEnvironment());
  return store_.SetEphemeral(SetupKey(job_, launch_, "alive", rank_), "1");
}

Status SetupBarrier::Fail(const Status& why) {
  store_
      .MarkDead(SetupKey(job_, launch_, "alive", rank_),
                "sync rank " + std::to_string(rank_) + " failed in setup: " + why.ToString())
      .IgnoreError();
  return why;
}

// A rank whose setup key is dead, with its reason: the first that is not itself an echo (a rank
// that stopped because another's key died marks its own with kEcho, and its exit would otherwise
// show as "store connection closed" ahead of the rank that caused it all). Marks this rank's key
// as an echo of it, for the ranks still waiting.
Status SetupBarrier::PeerGone(const Status& first, int world) {
  constexpr std::string_view kEcho = "stopped waiting for the others' setup: ";
  std::string cause;
  for (int r = 0; r < world; ++r) {
    if (r == rank_) continue;
    auto v = store_.Get(SetupKey(job_, launch_, "alive", r), Millis(0));
    if (v.ok() || v.status().code() != StatusCode::kUnavailable) continue;
    std::string why = v.status().message();
    const size_t at = why.find("is dead: ");
    if (at != std::string::npos) why = why.substr(at + 9);
    if (why.find(kEcho) != std::string::npos) continue;
    if (why.find("sync rank " + std::to_string(r)) == std::string::npos) {
      why = "sync rank " + std::to_string(r) + ": " + why;  // a closed connection names nobody
    }
    cause = why;
    break;
  }
  Status s =
      UnavailableError("sync rank " + std::to_string(rank_) + " waiting for every rank's setup: " +
                       (cause.empty() ? first.message() : cause));
  store_
      .MarkDead(SetupKey(job_, launch_, "alive", rank_),
                "sync rank " + std::to_string(rank_) + " " + std::string(kEcho) + s.message())
      .IgnoreError();
  return s;
}

Status SetupBarrier::Wait() {
  const int world = SyncWorldSize(job_.inputs);
  SS_RETURN_IF_ERROR(store_.Set(SetupKey(job_, launch_, "ready", rank_), "1"));
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(SetupKey(job_, launch_, "ready", r));
  for (int r = 0; r < world; ++r) keys.push_back(SetupKey(job_, launch_, "alive", r));
  const auto t0 = Clock::now();
  const auto deadline = t0 + job_.setup_timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    // Slices, so the error can say which ranks are still setting up.
    auto got = store_.GetMany(keys, std::clamp(left, Millis(1), Millis(1000)));
    if (got.ok()) break;
    if (got.status().code() == StatusCode::kUnavailable) {
      // A rank that is ready may end (its connection closes) before this one reads: only the
      // alive keys of ranks not yet ready still matter.
      std::vector<std::string> still = std::vector<std::string>(keys.begin(), keys.begin() + world);
      for (int r = 0; r < world; ++r) {
        if (!store_.Get(keys[r], Millis(0)).ok())
          still.push_back(SetupKey(job_, launch_, "alive", r));
      }
      if (still.size() == keys.size()) return PeerGone(got.status(), world);
      keys = std::move(still);
      continue;
    }
    if (got.status().code() != StatusCode::kDeadlineExceeded) {
      return got.status().Annotate("sync rank " + std::to_string(rank_) +
                                   " waiting for every rank's setup");
    }
    // A rank that never began its setup (no alive key) is not slow but absent (not started, a
    // wrong --store or --rank): --timeout-ms bounds the wait for it, as it bounds connect, so a
    // lone `run` rank fails in seconds rather than after --setup-timeout-s.
    if (Clock::now() - t0 >= job_.timeout) {
      std::string absent;
      for (int r = 0; r < world; ++r) {
        if (r == rank_ || store_.Get(keys[r], Millis(0)).ok()) continue;
        if (store_.Get(SetupKey(job_, launch_, "alive", r), Millis(0)).status().code() ==
            StatusCode::kDeadlineExceeded) {
          absent += (absent.empty() ? "" : ", ") + std::to_string(r);
        }
      }
      if (!absent.empty()) {
        return DeadlineExceededError(
            "sync rank " + std::to_string(rank_) + ": no sign of sync rank " + absent +
            " within --timeout-ms " + std::to_string(job_.timeout.count()) +
            ": never began setup (not launched, or launched with another --store / --rank)");
      }
    }
    if (Clock::now() < deadline) continue;
    std::string missing;
    for (int r = 0; r < world; ++r) {
      if (!store_.Get(keys[r], Millis(0)).ok()) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    return DeadlineExceededError("sync rank " + std::to_string(rank_) + ": timed out after " +
                                 std::to_string(job_.setup_timeout.count() / 1000) +
                                 " s waiting for sync ranks " + missing +
                                 " to allocate and fill their weights (raise --setup-timeout-s)");
  }
  seconds_ = std::chrono::duration<double>(Clock::now() - t0).count();
  return OkStatus();
}

}  // namespace shardsync::job_internal
