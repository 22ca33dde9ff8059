// Job identity (DESIGN.md "One job is one job"): Connect's first step, Join, and its last, Seal.
//
// Join: rank 0 claims the key prefix with SetIfAbsent of `<prefix>claim`, an ephemeral key (a
// dead job's claim dies with its rank 0's store connection) holding the job's random nonce, its
// plan hash and its launch id (LaunchId, SessionOptions::job_id). Every other rank waits for a
// claim, refuses one of another launch, and joins the job it names with its member key
// (`<root>member/<r>`: the session's random id) and its liveness key (`<root>alive/<r>`,
// ephemeral). Every later key of the session lives under the job's root `<prefix><nonce>/`, so
// two jobs on one prefix never read each other's keys; control messages and the verdict board
// carry the nonce too.
//
// A member key already held by another session means one of two things. Its holder is gone: the
// claim is stale (a finished job's rank 0 still holds it), and the rank waits for a new claim.
// Its holder is alive: two processes claim one rank of the job, i.e. two jobs with no launch id
// joined one claim. The job is then contested: `<root>state` records it, and every rank fails at
// Seal, where rank 0 sets the state to "sealed" unless a contest was recorded first (SetIfAbsent:
// exactly one of the two wins).
//
// The launch secret (store.h LaunchId::secret) makes those claims proofs: rank 0's claim, each
// member key and the seal carry an HMAC under the secret (launch_mac.h) over the prefix, the
// job's nonce and the slot. A rank with the secret joins only a claim that proves it, and rank 0
// seals only when every member key does; a rank without it refuses a job whose claim is keyed. So
// a process that knows the job's id but not its secret (ids are not secret), or replays a value
// it read from the store, never takes a slot of the job. A slot claimed twice by live processes
// fails the job naming both (before the seal: a contest; after it: every rank's liveness key dies
// with the reason), never seals with the first comer. A session with no launch identity at all
// (no id, no secret) in a job of more than one rank refuses to connect (NoLaunchIdentity).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sync/context.h"
#include "sync/guard.h"

namespace shardsync::sync_internal {

// Rank 0's claim of a key prefix.
struct JobClaim {
  uint64_t nonce = 0;
  std::string plan_hash;
  std::string launch;         // "" when the job has no launch id
  std::string launch_source;  // where rank 0 found it (for messages)
  std::string mac;            // ClaimMac under the launch secret; "" when the launch has none
};
// What each proof covers (domain-separated messages for LaunchMac).
std::string ClaimMac(const std::string& secret, const std::string& prefix, const JobClaim& c);
std::string MemberMac(const std::string& secret, const std::string& prefix, uint64_t nonce,
                      int rank, std::string_view member, std::string_view where);
std::string SealText(const std::string& secret, const std::string& prefix, uint64_t nonce);

// A rank's member key `<root>member/<rank>`: its session's id, where it runs ("pid@host", for
// messages naming claimants) and its MemberMac.
struct MemberRecord {
  std::string id;
  std::string where;
  std::string mac;  // "" without a secret
};
std::string EncodeMember(const MemberRecord& m);
MemberRecord ParseMember(std::string_view text);  // lenient: unparsed fields stay empty
std::string EncodeClaim(const JobClaim& c);
// DataLoss naming `key` when `text` is not a claim.
Result<JobClaim> ParseClaim(std::string_view text, const std::string& key);
// "job 0123456789abcdef (launch 'x' from SHARDSYNC_JOB_ID, plan <hash>)".
std::string DescribeClaim(const JobClaim& c);

std::string ClaimKey(const std::string& prefix);
std::string JobRoot(const std::string& prefix, uint64_t nonce);
// Dead (MarkSyncRankDead) once a launcher saw a rank of launch `launch` exit: ranks of that launch
// still waiting for rank 0's claim fail on it.
std::string LaunchKey(const std::string& prefix, const std::string& launch);
// A rank of launch `a` may join a claim of launch `b`: equal, or either has none (a rank without
// a launch id cannot tell launches apart; see the class comment for what protects it then).
bool LaunchesMayMatch(const std::string& a, const std::string& b);

class JobIdentity {
 public:
  explicit JobIdentity(SessionContext& ctx);

  // Connect's first step: claims (rank 0) or joins the job, then sets ctx.root and ctx.job_tag.
  // FailedPrecondition naming the prefix and the job holding it when it belongs to another job.
  Status Join(Clock::time_point deadline);
  // Connect's last step (see above): FailedPrecondition when the job was contested.
  Status Seal(SyncGuard& guard, Clock::time_point deadline);
  // Connect failed with `why`: the liveness key dies (peers waiting on this rank fail now,
  // naming it); a retried Connect joins again.
  void Abandon(const Status& why);
  // The session ends: its liveness key dies (peers still waiting on it fail at once) and rank 0
  // gives up its claim. Best effort; a no-op before Join.
  void Leave();

 private:
  enum class Entry { kJoined, kStale };
  // FailedPrecondition naming the ways to give one when a rank of a job of several has no launch
  // identity.
  Status NoLaunchIdentity() const;
  // OK when this rank may join `c` as far as the secret goes (both have none, or `c` proves this
  // rank's); FailedPrecondition otherwise.
  Status CheckClaimProof(const JobClaim& c) const;
  // `c` proves to be this rank's own launch (its secret, or without secrets its non-empty id).
  bool SameLaunch(const JobClaim& c) const;
  // "process 42@host (member 0123..., proves the launch secret)".
  std::string DescribeMember(std::string_view text, const JobClaim& c, int rank) const;
  // Slot `rank` of job `c` is held by the live member `held` while this rank claims it too: the
  // contest is recorded, a sealed job is failed on every rank; returns the error naming both.
  Status DoubleClaim(const JobClaim& c, int rank, std::string_view held);
  // Rank 0 at Seal: every member key proves the launch secret.
  Status CheckMembers(SyncGuard& guard, Clock::time_point deadline);
  Status Claim(Clock::time_point deadline);
  Status WaitForClaim(Clock::time_point deadline);
  // Takes this rank's member and liveness keys in the job `c` names.
  Result<Entry> Enter(const JobClaim& c, Clock::time_point deadline);
  // Unavailable when a launcher marked this rank's launch dead (LaunchKey).
  Status CheckLaunch();
  std::string Me() const;

  SessionContext& ctx_;
  const uint64_t nonce_;      // the job's, when this rank is rank 0
  const std::string member_;  // this session's member id
  const std::string where_;   // "pid@host"
  JobClaim claim_;            // the job this rank joined
  bool joined_ = false;
};

}  // namespace shardsync::sync_internal
