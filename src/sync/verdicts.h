// The end of every sync: each rank posts its verdict (failed or not, so peers learn the cause
// rather than time out) and gathers every other rank's into one report that every rank agrees
// on. Through a shared-memory board when every rank of the job mapped the same one
// (verdict_board.h; agreed at Connect), else through the store.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sync/context.h"
#include "sync/guard.h"
#include "sync/verdict_board.h"
#include "sync/verdict_codec.h"

namespace shardsync::sync_internal {

class VerdictExchange {
 public:
  VerdictExchange(const SessionContext& ctx, SyncGuard& guard) : ctx_(ctx), guard_(guard) {}

  // Connect: rank 0 creates the board and publishes its nonce; every rank says whether it
  // mapped it, and only a unanimous job uses it (a rank on the store path would leave the others
  // waiting on the board). Rank 0 then removes the name: no segment outlives the job.
  Status Open(Clock::time_point deadline);
  const VerdictBoard* board() const { return board_.get(); }

  // Posts this rank's verdict of the current sync: on the board when the job has one, and a
  // failed one on the store too (its whole text). A good one goes to the store (no board) in the
  // same round trip as Gather's wait for everyone else's.
  void Post(const RankSyncStats& st);
  // Every rank's verdict of the current sync as one report; an error if any rank failed.
  Result<SyncReport> Gather(const RankSyncStats& local);

 private:
  // Verdicts of `others` for this version from the board, polled like a pair wait (ranks finish
  // microseconds apart); `what(i)` names entry i for errors.
  Result<std::vector<std::string>> BoardVerdicts(const std::vector<int>& others,
                                                 const std::function<std::string(size_t)>& what);

  // Rank 0 creates the board (when `want`) and publishes its nonce, or "none"; the others read
  // it and map the same board. Returns what rank 0 published; *mapped: this rank's mapping.
  Result<std::string> MapBoard(Clock::time_point deadline, bool want,
                               std::unique_ptr<VerdictBoard>* mapped);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  std::unique_ptr<VerdictBoard> board_;         // null: verdicts through the store
  std::pair<std::string, std::string> posted_;  // this sync's verdict: store key, text
};

}  // namespace shardsync::sync_internal
