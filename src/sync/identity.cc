#include "sync/identity.h"

#include <sys/random.h>

#include <algorithm>
#include <charconv>
#include <random>
#include <thread>

namespace shardsync::sync_internal {
namespace {

constexpr std::string_view kClaimVersion = "ssjob1";
constexpr std::string_view kSealed = "sealed";
// How often a rank looks again at a claim that is dead (a finished job's) or one it cannot join.
constexpr Millis kClaimPoll{20};
// How long a member key's holder may take to set its liveness key (one store round trip).
constexpr Millis kMemberSettle{1000};

uint64_t Random64() {
  uint64_t v = 0;
  if (getrandom(&v, sizeof(v), 0) == static_cast<ssize_t>(sizeof(v))) return v;
  std::random_device rd;  // getrandom fails only on ancient kernels
  return uint64_t{rd()} << 32 | rd();
}

Result<uint64_t> ParseHex(std::string_view s) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (s.size() != 16 || ec != std::errc() || end != s.data() + s.size()) {
    return InvalidArgumentError("not 16 hex digits");
  }
  return v;
}

}  // namespace

std::string EncodeClaim(const JobClaim& c) {
  // Space-separated: job ids hold no spaces (CheckJobId), plan hashes are hex; "-" is no launch.
  return std::string(kClaimVersion) + " " + Hex(c.nonce) + " " + c.plan_hash + " " +
         (c.launch.empty() ? "-" : c.launch) + " " +
         (c.launch_source.empty() ? "-" : c.launch_source);
}

Result<JobClaim> ParseClaim(std::string_view text, const std::string& key) {
  std::vector<std::string_view> f;
  for (size_t at = 0; at <= text.size();) {
    const size_t sp = std::min(text.find(' ', at), text.size());
    f.push_back(text.substr(at, sp - at));
    at = sp + 1;
  }
  auto nonce = f.size() == 5 && f[0] == kClaimVersion ? ParseHex(f[1]) : Result<uint64_t>(0);
  if (f.size() != 5 || f[0] != kClaimVersion || !nonce.ok() || f[2].empty()) {
    return DataLossError("store key '" + key +
                         "' holds no shardsync job claim (another program or version uses this "
                         "key prefix)");
  }
  JobClaim c;
  c.nonce = *nonce;
  c.plan_hash = std::string(f[2]);
  if (f[3] != "-") c.launch = std::string(f[3]);
  if (f[4] != "-") c.launch_source = std::string(f[4]);
  return c;
}

std::string DescribeClaim(const JobClaim& c) {
  std::string s = "job " + Hex(c.nonce) + " (";
  if (c.launch.empty()) {
    s += "no launch id";
  } else {
    s += "launch '" + c.launch + "'";
    if (!c.launch_source.empty()) s += " from " + c.launch_source;
  }
  return s + ", plan " + c.plan_hash + ")";
}

std::string ClaimKey(const std::string& prefix) { return prefix + "claim"; }
std::string JobRoot(const std::string& prefix, uint64_t nonce) { return prefix + Hex(nonce) + "/"; }
std::string LaunchKey(const std::string& prefix, const std::string& launch) {
  return prefix + "launch/" + launch;
}
bool LaunchesMayMatch(const std::string& a, const std::string& b) {
  return a.empty() || b.empty() || a == b;
}

JobIdentity::JobIdentity(SessionContext& ctx)
    : ctx_(ctx), nonce_(Random64()), member_(Hex(Random64())) {}

std::string JobIdentity::Me() const { return "sync rank " + std::to_string(ctx_.rank); }

Status JobIdentity::CheckLaunch() {
  if (ctx_.launch.id.empty()) return OkStatus();
  auto r = ctx_.store.Get(LaunchKey(ctx_.opt.prefix, ctx_.launch.id), Millis(0));
  if (r.ok() || r.status().code() != StatusCode::kUnavailable) return OkStatus();
  return UnavailableError(Me() + ": launch '" + ctx_.launch.id +
                          "' ended before this rank joined its job (" + r.status().message() + ")");
}

Status JobIdentity::Join(Clock::time_point deadline) {
  SS_RETURN_IF_ERROR(CheckLaunch());
  return ctx_.rank == 0 ? Claim(deadline) : WaitForClaim(deadline);
}

Status JobIdentity::Claim(Clock::time_point deadline) {
  const std::string key = ClaimKey(ctx_.opt.prefix);
  JobClaim mine{nonce_, ctx_.plan.plan_hash, ctx_.launch.id, ctx_.launch.source};
  const std::string text = EncodeClaim(mine);
  SS_ASSIGN_OR_RETURN(std::string held, ctx_.store.SetIfAbsent(key, text, /*ephemeral=*/true));
  if (held != text) {
    SS_ASSIGN_OR_RETURN(JobClaim other, ParseClaim(held, key));
    // Without telling launch ids apart, this job's other ranks may be joining that claim right
    // now: the holder must not seal a job they entered (Seal).
    if (LaunchesMayMatch(mine.launch, other.launch)) {
      ctx_.store
          .SetIfAbsent(JobRoot(ctx_.opt.prefix, other.nonce) + "state",
                       "was contested: a second job's sync rank 0 (" + DescribeClaim(mine) +
                           ") found it holding the prefix",
                       false)
          .status()
          .IgnoreError();
    }
    return FailedPreconditionError(
        Me() + ": key prefix '" + ctx_.opt.prefix + "' is held by another job, " +
        DescribeClaim(other) +
        ", which is still running; jobs sharing a store need distinct prefixes (prefix=, "
        "--prefix), or the earlier job's sessions must be closed first");
  }
  SS_ASSIGN_OR_RETURN(Entry e, Enter(mine, deadline));
  if (e != Entry::kJoined) {
    return InternalError(Me() + ": job " + Hex(nonce_) + " it just claimed has a sync rank 0");
  }
  return OkStatus();
}

Status JobIdentity::WaitForClaim(Clock::time_point deadline) {
  const std::string key = ClaimKey(ctx_.opt.prefix);
  bool skip = false;  // a claim this rank found taken for its rank: wait for the next one
  uint64_t skipped = 0;
  std::string last_seen;
  while (true) {
    SS_RETURN_IF_ERROR(CheckLaunch());
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (left <= Millis(0)) {
      return DeadlineExceededError(
          Me() + ": timed out after " + std::to_string(ctx_.opt.connect_timeout.count()) +
          " ms waiting for sync rank 0 to claim key prefix '" + ctx_.opt.prefix + "'" +
          (skip ? " for this job: the claim there, " + last_seen + ", is a job whose sync rank " +
                      std::to_string(ctx_.rank) + " is another process"
                : ""));
    }
    auto text = ctx_.store.Get(key, std::min(left, Millis(50)));
    if (!text.ok()) {
      // Absent: rank 0 has not claimed yet. Dead: a finished job's rank 0 left it behind.
      if (text.status().code() == StatusCode::kUnavailable) std::this_thread::sleep_for(kClaimPoll);
      if (text.status().code() == StatusCode::kUnavailable ||
          text.status().code() == StatusCode::kDeadlineExceeded) {
        continue;
      }
      return text.status();
    }
    SS_ASSIGN_OR_RETURN(JobClaim c, ParseClaim(*text, key));
    if (skip && c.nonce == skipped) {
      std::this_thread::sleep_for(kClaimPoll);
      continue;
    }
    if (!LaunchesMayMatch(ctx_.launch.id, c.launch)) {
      return FailedPreconditionError(
          Me() + " (launch '" + ctx_.launch.id + "' from " + ctx_.launch.source +
          "): key prefix '" + ctx_.opt.prefix + "' is held by another launch's job, " +
          DescribeClaim(c) +
          "; jobs sharing a store need distinct prefixes, and ranks of one job started by "
          "different launchers need one job_id (SHARDSYNC_JOB_ID)");
    }
    SS_ASSIGN_OR_RETURN(Entry e, Enter(c, deadline));
    if (e == Entry::kJoined) return OkStatus();
    skip = true;
    skipped = c.nonce;
    last_seen = DescribeClaim(c);
  }
}

Result<JobIdentity::Entry> JobIdentity::Enter(const JobClaim& c, Clock::time_point deadline) {
  const std::string root = JobRoot(ctx_.opt.prefix, c.nonce);
  const std::string r = std::to_string(ctx_.rank);
  SS_ASSIGN_OR_RETURN(std::string held,
                      ctx_.store.SetIfAbsent(root + "member/" + r, member_, /*ephemeral=*/false));
  if (held != member_) {
    // Its holder sets the liveness key right after the member key: absent means it is between
    // the two (wait for it), dead means it is gone (the claim is a finished job's).
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    auto alive = ctx_.store.Get(root + "alive/" + r, std::clamp(left, Millis(0), kMemberSettle));
    if (!alive.ok()) return Entry::kStale;
    const std::string why = "sync rank " + r +
                            " was claimed by two live processes (two jobs on "
                            "key prefix '" +
                            ctx_.opt.prefix + "' with no launch id)";
    auto state =
        ctx_.store.SetIfAbsent(root + "state", "was contested: " + why, false).value_or("");
    // Sealed before this rank came: without launch ids nothing told the two rank-r processes
    // apart, and the sealed job may run with the other job's rank r (docs/security.md, the
    // residual case). Say so where the operator looks.
    const std::string sealed =
        state == kSealed ? "; that job was already sealed, so if this rank's job started with it, "
                           "it may be running with this job's ranks in place of its own"
                         : "";
    return FailedPreconditionError(Me() + ": " + DescribeClaim(c) + " holding key prefix '" +
                                   ctx_.opt.prefix + "' already has a live sync rank " + r +
                                   ": a second job on this prefix" + sealed +
                                   "; give each job its own prefix or a launch id (job_id, "
                                   "SHARDSYNC_JOB_ID)");
  }
  Status s = ctx_.store.SetEphemeral(root + "alive/" + r, member_);
  if (!s.ok()) return s.Annotate(Me() + ": joining " + DescribeClaim(c));
  ctx_.root = root;
  ctx_.job_tag = c.nonce;
  claim_ = c;
  joined_ = true;
  return Entry::kJoined;
}

Status JobIdentity::Seal(SyncGuard& guard, Clock::time_point deadline) {
  const std::string key = ctx_.Key("state");
  std::string state;
  if (ctx_.rank == 0) {
    SS_ASSIGN_OR_RETURN(state, ctx_.store.SetIfAbsent(key, std::string(kSealed), false));
  } else {
    SS_ASSIGN_OR_RETURN(auto v, guard.GetFromRanks({key}, {0}, deadline, [](size_t) {
      return std::string("sync rank 0 to seal the job");
    }));
    state = std::move(v[0]);
  }
  if (state == kSealed) return OkStatus();
  return FailedPreconditionError(Me() + ": " + DescribeClaim(claim_) + " on key prefix '" +
                                 ctx_.opt.prefix + "' " + state +
                                 "; no byte moved: give each job its own prefix or a launch id "
                                 "(job_id, SHARDSYNC_JOB_ID)");
}

void JobIdentity::Abandon(const Status& why) {
  if (!joined_) return;
  joined_ = false;
  ctx_.store
      .MarkDead(ctx_.Key("alive/" + std::to_string(ctx_.rank)),
                Me() + " failed to connect: " + why.ToString())
      .IgnoreError();
}

void JobIdentity::Leave() {
  if (!joined_) return;
  joined_ = false;
  ctx_.store.MarkDead(ctx_.Key("alive/" + std::to_string(ctx_.rank)), Me() + " closed its session")
      .IgnoreError();
  if (ctx_.rank != 0) return;
  // Only this job's claim (it is ephemeral on this connection, so nobody else replaced it).
  const std::string key = ClaimKey(ctx_.opt.prefix);
  auto held = ctx_.store.Get(key, Millis(0));
  if (held.ok() && *held == EncodeClaim(claim_)) {
    ctx_.store.MarkDead(key, "job " + Hex(claim_.nonce) + " ended (its sync rank 0 closed)")
        .IgnoreError();
  }
}

}  // namespace shardsync::sync_internal

namespace shardsync {

Result<bool> MarkSyncRankDead(StoreClient& store, const std::string& prefix,
                              const std::string& job_id, int rank, std::string_view reason) {
  using namespace sync_internal;
  if (job_id.empty()) {
    return InvalidArgumentError(
        "MarkSyncRankDead: job_id is empty (only a launch with an id "
        "can tell its ranks apart from another job's)");
  }
  SS_RETURN_IF_ERROR(CheckJobId(job_id, "MarkSyncRankDead job_id"));
  const std::string why = "sync rank " + std::to_string(rank) + " " + std::string(reason);
  // Ranks of the launch still waiting for the claim; the first death's reason stays.
  const std::string launch = LaunchKey(prefix, job_id);
  auto l = store.Get(launch, Millis(0));
  if (l.ok() || l.status().code() != StatusCode::kUnavailable) {
    SS_RETURN_IF_ERROR(store.MarkDead(launch, why));
  }
  // Ranks inside the launch's job: the rank's liveness key, which they all watch.
  auto held = store.Get(ClaimKey(prefix), Millis(0));
  if (!held.ok()) return false;
  auto c = ParseClaim(*held, ClaimKey(prefix));
  if (!c.ok() || c->launch != job_id) return false;
  SS_RETURN_IF_ERROR(
      store.MarkDead(JobRoot(prefix, c->nonce) + "alive/" + std::to_string(rank), why));
  return true;
}

}  // namespace shardsync
