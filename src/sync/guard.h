// Every wait of a session, bounded and abortable: the store waits of connect and sync, the
// transport polls of the host path, the job's abort key, the peers' versions and their liveness.
// A failing rank posts the abort key; every waiting rank polls it (at most every 50 ms) and fails
// within its own timeout (session.h "Failure"). A rank that is gone (its liveness key
// `alive/<rank>` dead: its store connection closed, its session ended, or a launcher marked it)
// fails every rank waiting on it at once at Connect (the waits name its liveness key) and within
// kAlivePollInterval in a Sync.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "sync/context.h"
#include "sync/verdict_board.h"

namespace shardsync::sync_internal {

class SyncGuard {
 public:
  explicit SyncGuard(const SessionContext& ctx) : ctx_(ctx) {}

  // Connect: the transport peers (their `cur` keys are polled, flushes drive progress), and the
  // verdict board when the job has one (null: verdicts through the store).
  void set_peers(std::vector<int> peers) { peers_ = std::move(peers); }
  const std::vector<int>& peers() const { return peers_; }
  void set_board(const VerdictBoard* board) { board_ = board; }

  // A rank's liveness key (identity.h), and every other rank's.
  std::string AliveKey(int rank) const;
  std::vector<std::string> OthersAlive() const;
  // Connect's waits: `keys` (what(i) names key i) until `deadline`, watching the liveness of
  // `ranks` in the same round trips, so a rank that is gone fails the wait at once, named.
  Result<std::vector<std::string>> GetFromRanks(
      const std::vector<std::string>& keys, const std::vector<int>& ranks,
      Clock::time_point deadline, const std::function<std::string(size_t)>& what,
      const std::pair<std::string, std::string>* set_first = nullptr);
  // Unavailable naming the first of `ranks` whose liveness key is dead and that has not posted
  // its verdict of this sync (`in_sync`); `fallback` when there is none.
  Status GonePeer(const std::vector<int>& ranks, bool in_sync, const Status& fallback);

  // Starts the waits of Sync(version) at t0: its deadline is t0 + sync_timeout. The first abort
  // poll (a store round trip per peer) waits: a sync that completes within the poll interval
  // pays none on its critical path, and peers' failures reach it anyway through its pairs, the
  // abort key and the gathered verdicts.
  void Begin(uint64_t version, Clock::time_point t0);
  uint64_t version() const { return version_; }
  Clock::time_point deadline() const { return deadline_; }
  // Key `k` of this version ("v<version>/k", before the job prefix).
  std::string VKey(const std::string& k) const;

  // Blocks for a key until `deadline`, in short slices so the abort key is seen meanwhile.
  Result<std::string> GetUntil(const std::string& key, Clock::time_point deadline,
                               const std::string& what, bool watch_abort = false);
  // Several keys in one store round trip, in short slices when `watch_abort`; on timeout the
  // error names the first key still missing (`what(i)` describes key i). `set_first` is set in
  // the first round trip.
  Result<std::vector<std::string>> GetManyUntil(
      const std::vector<std::string>& keys, Clock::time_point deadline,
      const std::function<std::string(size_t)>& what, bool watch_abort = false,
      const std::pair<std::string, std::string>* set_first = nullptr);

  // Polls the job's abort key and the peers' current versions (at most every 50 ms), and every
  // other rank's liveness (at most every kAlivePollInterval).
  Status CheckAbort(bool force = false);
  // DeadlineExceeded naming `what` past this sync's deadline, else CheckAbort.
  Status CheckDeadline(const std::string& what);
  // The same, naming who(i) only when it fails (not built on every poll).
  Status CheckDeadline(size_t i, const std::function<std::string(size_t)>& who);
  // Drives the transport until every id completed, the deadline passed or the job aborted.
  Status WaitAll(std::vector<XferId>& ids, const std::string& what);
  // Posts this version's abort key with `s` as the cause (unless it only echoes another's).
  void PostAbort(const Status& s);
  // Drives the transport's progress engine while waiting on the store (peers may still need
  // this rank's side of a protocol exchange). Errors are left to the transfers that own them.
  void Progress();

  // Busy-polls briefly, then sleeps: ranks share few cores with the peers they wait for.
  static void Backoff(bool progressed, int& idle);
  // Device pairs finish within milliseconds and every rank waits on the last one: yield-spin
  // (a sleep costs 60-80 us of wake-up latency on Linux, measured in the traced syncs of
  // docs/benchmarks.md) for 50 ms of idling, then sleep in short steps.
  static void PairBackoff(bool progressed, Clock::time_point& idle_since);

 private:
  // Whether peer `p` posted its verdict for this version.
  bool PostedVerdict(int p);

  // Fails naming a gone rank when one of the others' liveness keys is dead.
  Status CheckAlive();

  const SessionContext& ctx_;
  std::vector<int> peers_;
  std::vector<int> others_;                // every rank but this one
  std::vector<std::string> others_alive_;  // their liveness keys (set at the first check)
  const VerdictBoard* board_ = nullptr;
  uint64_t version_ = 0;
  Clock::time_point deadline_;
  Clock::time_point next_abort_check_;
  Clock::time_point next_alive_check_;
};

}  // namespace shardsync::sync_internal
