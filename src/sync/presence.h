// A rank's presence before it joins its job (issue 36): a key each Session holds from its
// creation, so that a rank which fails before or while it connects is seen by its peers at once,
// named, with its own error, instead of at their connect timeout ("timed out waiting for plan
// hash of sync rank 2").
//
// `<prefix>presence/<scope>/<rank>/session`: ephemeral (it dies with the rank's store connection,
// so a process that exits or is killed before connect() is seen as gone), set at Session creation
// to "created", at connect() to "connecting"; a bind error (or the Python layer's
// fail_before_connect) marks it dead with the error; a closed session deletes it (a clean end is no
// failure). The scope is the launch id (SHARDSYNC_JOB_ID, torchrun's run id, SLURM's job.step),
// else the plan hash: keys of another launch are never read, and without a launch id only a crashed
// earlier job of the same plan on the same store and prefix could be mistaken for this one's rank
// (until that rank's new Session replaces its key).
//
// Kept apart from identity.h (the job a rank joins at Connect, keyed by the job's nonce, which
// does not exist before rank 0 claims the prefix).
#pragma once

#include <string>
#include <vector>

#include "sync/context.h"

namespace shardsync::sync_internal {

class Presence {
 public:
  explicit Presence(SessionContext& ctx) : ctx_(ctx) {}

  std::string Key(int rank) const;
  std::vector<std::string> OthersKeys() const;

  // At Session creation. Best effort: a key another live process holds (a second job with no
  // launch id on this prefix, which Connect refuses, named) is left alone and not watched by it.
  void Announce();
  // connect() started: the key says so (for timeouts that name who never got there).
  void Connecting();
  // This rank cannot connect (a bind error): every peer waiting at Connect fails now, naming
  // this rank and `why`. Idempotent; the first error stays.
  void Fail(const std::string& why);
  // The session closed: the key goes (not dead: a clean end fails nobody).
  void Leave();

  // `s` (the store's Unavailable of a watched dead key) as the error a peer sees: Aborted naming
  // the rank whose presence key is dead and why; `s` itself when none is.
  Status PeerFailed(const Status& s) const;
  // A connect deadline `s`, with the ranks that never reached connect() named (their Session
  // not created, or created and connect() not called); `s` unchanged when every rank did.
  Status ExplainTimeout(Status s) const;

 private:
  std::string Scope() const;
  std::string RankFolder(int rank) const;

  SessionContext& ctx_;
  bool announced_ = false;
  bool failed_ = false;
};

}  // namespace shardsync::sync_internal
