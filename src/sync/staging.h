// Staged commit (SessionOptions::commit kStaged, docs/staged-commit.md): an engine rank's
// parameters are bound to the session as usual, but the session lands every sync in a staging area
// of its own (Bindings::RedirectDest before Connect registers receive memory), so the host path,
// the prepared pairs and block FP8 work unchanged and the engine keeps serving from the live
// parameters. Commit(version) copies staging into them once every engine rank of the scope
// verified the version and is in Commit (two store rounds: ready, then done); Rollback restores
// the version committed before.
//
// What a rollback restores is kept one of two ways (SessionOptions::Keep): a second area the live
// parameters are copied into when a sync verified (the engine still serving: the commit's stall
// stays one copy), or by exchanging staging and live parameters at the commit (no second area;
// the stall moves twice the bytes).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sync/bindings.h"
#include "sync/context.h"
#include "sync/guard.h"

namespace shardsync::sync_internal {

class StagedCommit {
 public:
  StagedCommit(const SessionContext& ctx, SyncGuard& guard) : ctx_(ctx), guard_(guard) {}

  // An engine rank of a staged session.
  bool on() const {
    return !ctx_.who.is_trainer && ctx_.opt.commit == SessionOptions::Commit::kStaged;
  }
  // The staging bytes this rank needs (its parameters in the dtypes it binds them).
  int64_t bytes() const;

  // Connect, after the bindings were checked: memory check against the packer's free memory,
  // the staging area (and the previous version's, kArea) allocated, every parameter redirected.
  Status Prepare(Bindings& bindings);

  // Sync, before anything lands: staging is about to be overwritten (kSwap: it held the
  // version a rollback would restore).
  void BeginSync();
  // Sync, once this rank verified every byte (before its verdict goes out): kArea copies the live
  // parameters into the second area, so the next commit can be undone.
  Status AfterVerified();

  // SyncSession::Commit / Rollback (session.h). `verified`: the last version this rank synced
  // and verified.
  Result<CommitReport> Commit(uint64_t version, uint64_t verified);
  Status Rollback();

  uint64_t committed() const { return committed_; }
  // The bound (live) parameters, by parameter index, once prepared: the base of a delta.
  const std::vector<DestBinding>& live() const { return live_; }
  bool live_poisoned() const { return live_poisoned_; }
  std::string keep() const;

 private:
  // Copies from staging (`from_staging`) or the previous area into the live parameters; swap:
  // exchanges live and staging.
  Status Move(bool from_staging, bool swap);
  // The engine ranks that agree on a commit (SessionOptions::commit_scope), this one included.
  std::vector<int> ScopeRanks() const;
  // One agreement round: posts this rank's `state` ("ok" or the error) under `step`, then waits
  // for every other scope rank's; the first that is not "ok", gone or late is the error.
  Status Agree(uint64_t version, const std::string& step, const std::string& state,
               Clock::time_point deadline);
  std::string Who() const;

  const SessionContext& ctx_;
  SyncGuard& guard_;
  std::vector<DestBinding> live_;  // the bound parameters, by parameter index
  std::vector<int64_t> offsets_;   // of each parameter in staging (and the previous area)
  int64_t total_ = 0;
  std::shared_ptr<unsigned char> staging_, previous_;
  SessionOptions::Keep keep_ = SessionOptions::Keep::kNone;
  uint64_t committed_ = 0;
  bool area_is_live_ = false;  // kArea: the previous area equals the live parameters
  uint64_t area_version_ = 0;  // kArea: the version in the previous area
  bool can_rollback_ = false;
  uint64_t rollback_to_ = 0;
  bool live_poisoned_ = false;
  uint64_t attempt_version_ = 0;  // Commit's attempts at this version (its store keys)
  int attempt_ = 0;
};

}  // namespace shardsync::sync_internal
