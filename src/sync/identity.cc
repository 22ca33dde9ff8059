#include "sync/identity.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <random>
#include <thread>

#include "sync/launch_mac.h"

namespace shardsync::sync_internal {
namespace {

constexpr std::string_view kClaimVersion = "ssjob2";
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

std::vector<std::string_view> Fields(std::string_view text) {
  std::vector<std::string_view> f;
  for (size_t at = 0; at <= text.size();) {
    const size_t sp = std::min(text.find(' ', at), text.size());
    f.push_back(text.substr(at, sp - at));
    at = sp + 1;
  }
  return f;
}

std::string ThisProcess() {
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  host[sizeof(host) - 1] = 0;
  return std::to_string(getpid()) + "@" + host;
}

// Proof messages: a tag, then the fields, newline-separated (no field holds a newline: prefixes
// are the caller's but ids, hashes and hex never do; the tag keeps the three proofs apart).
std::string ProofMessage(std::initializer_list<std::string_view> parts) {
  std::string m;
  for (std::string_view p : parts) m.append(p).push_back('\n');
  return m;
}

}  // namespace

std::string EncodeClaim(const JobClaim& c) {
  // Space-separated: job ids hold no spaces (CheckJobId), plan hashes are hex; "-" is no launch.
  return std::string(kClaimVersion) + " " + Hex(c.nonce) + " " + c.plan_hash + " " +
         (c.launch.empty() ? "-" : c.launch) + " " +
         (c.launch_source.empty() ? "-" : c.launch_source) + " " + (c.mac.empty() ? "-" : c.mac);
}

std::string ClaimMac(const std::string& secret, const std::string& prefix, const JobClaim& c) {
  return LaunchMac(secret, ProofMessage({"shardsync claim", prefix, Hex(c.nonce), c.plan_hash,
                                         c.launch, c.launch_source}));
}

std::string MemberMac(const std::string& secret, const std::string& prefix, uint64_t nonce,
                      int rank, std::string_view member, std::string_view where) {
  return LaunchMac(secret, ProofMessage({"shardsync member", prefix, Hex(nonce),
                                         std::to_string(rank), member, where}));
}

std::string SealText(const std::string& secret, const std::string& prefix, uint64_t nonce) {
  if (secret.empty()) return std::string(kSealed);
  return std::string(kSealed) + " " +
         LaunchMac(secret, ProofMessage({"shardsync seal", prefix, Hex(nonce)}));
}

std::string EncodeMember(const MemberRecord& m) {
  return m.id + " " + (m.where.empty() ? "-" : m.where) + " " + (m.mac.empty() ? "-" : m.mac);
}

MemberRecord ParseMember(std::string_view text) {
  const auto f = Fields(text);
  MemberRecord m;
  m.id = std::string(f[0]);
  if (f.size() > 1 && f[1] != "-") m.where = std::string(f[1]);
  if (f.size() > 2 && f[2] != "-") m.mac = std::string(f[2]);
  return m;
}

Result<JobClaim> ParseClaim(std::string_view text, const std::string& key) {
  const auto f = Fields(text);
  auto nonce = f.size() == 6 && f[0] == kClaimVersion ? ParseHex(f[1]) : Result<uint64_t>(0);
  if (f.size() != 6 || f[0] != kClaimVersion || !nonce.ok() || f[2].empty()) {
    return DataLossError("store key '" + key +
                         "' holds no shardsync job claim (another program or version uses this "
                         "key prefix)");
  }
  JobClaim c;
  c.nonce = *nonce;
  c.plan_hash = std::string(f[2]);
  if (f[3] != "-") c.launch = std::string(f[3]);
  if (f[4] != "-") c.launch_source = std::string(f[4]);
  if (f[5] != "-") c.mac = std::string(f[5]);
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
  if (!c.mac.empty()) s += ", keyed by its launch secret";
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
    : ctx_(ctx), nonce_(Random64()), member_(Hex(Random64())), where_(ThisProcess()) {}

std::string JobIdentity::Me() const { return "sync rank " + std::to_string(ctx_.rank); }

Status JobIdentity::CheckLaunch() {
  if (ctx_.launch.id.empty()) return OkStatus();
  auto r = ctx_.store.Get(LaunchKey(ctx_.opt.prefix, ctx_.launch.id), Millis(0));
  if (r.ok() || r.status().code() != StatusCode::kUnavailable) return OkStatus();
  return UnavailableError(Me() + ": launch '" + ctx_.launch.id +
                          "' ended before this rank joined its job (" + r.status().message() + ")");
}

Status JobIdentity::NoLaunchIdentity() const {
  return FailedPreconditionError(
      Me() + " of " + std::to_string(ctx_.world) +
      ": no launch identity, so nothing tells this job's ranks from another job's on key prefix '" +
      ctx_.opt.prefix +
      "' and two jobs could merge; start the ranks with `shardsync run`, torchrun "
      "(--standalone or --rdzv-id), srun or Ray, or give every rank of the job one id and "
      "secret: Session(job_id=, job_secret=) from shardsync.new_launch() in the parent process "
      "(multiprocessing), SessionOptions::job_id / job_secret, or SHARDSYNC_JOB_ID and "
      "SHARDSYNC_JOB_SECRET");
}

bool JobIdentity::SameLaunch(const JobClaim& c) const {
  if (!ctx_.launch.secret.empty()) {
    return LaunchMacEquals(c.mac, ClaimMac(ctx_.launch.secret, ctx_.opt.prefix, c));
  }
  return c.mac.empty() && !ctx_.launch.id.empty() && c.launch == ctx_.launch.id;
}

Status JobIdentity::CheckClaimProof(const JobClaim& c) const {
  const bool have = !ctx_.launch.secret.empty();
  if (!have && c.mac.empty()) return OkStatus();
  const std::string held =
      Me() + ": key prefix '" + ctx_.opt.prefix + "' is held by " + DescribeClaim(c);
  if (!have) {
    return FailedPreconditionError(
        held +
        ", which proves a launch secret this rank was not given: every rank of the job needs "
        "it (job_secret=, SessionOptions::job_secret, SHARDSYNC_JOB_SECRET)");
  }
  if (SameLaunch(c)) return OkStatus();
  return FailedPreconditionError(
      held + ", which does not prove this rank's launch secret" +
      (c.launch == ctx_.launch.id && !c.launch.empty()
           ? ": a process that knows the launch id but not its secret claimed the prefix (an "
             "id is no proof)"
           : ": another job") +
      "; this rank does not join it");
}

std::string JobIdentity::DescribeMember(std::string_view text, const JobClaim& c, int rank) const {
  const MemberRecord m = ParseMember(text);
  std::string s = "process " + (m.where.empty() ? std::string("?") : m.where) + " (member " + m.id;
  if (!ctx_.launch.secret.empty()) {
    const bool proven = LaunchMacEquals(
        m.mac, MemberMac(ctx_.launch.secret, ctx_.opt.prefix, c.nonce, rank, m.id, m.where));
    s += proven ? ", proves the launch secret" : ", does not prove the launch secret";
  }
  return s + ")";
}

Status JobIdentity::DoubleClaim(const JobClaim& c, int rank, std::string_view held) {
  const std::string root = JobRoot(ctx_.opt.prefix, c.nonce);
  const std::string r = std::to_string(rank);
  const std::string mine = EncodeMember(
      {member_, where_,
       MemberMac(ctx_.launch.secret, ctx_.opt.prefix, c.nonce, rank, member_, where_)});
  const std::string why = "sync rank " + r + " of " + DescribeClaim(c) + " on key prefix '" +
                          ctx_.opt.prefix + "' was claimed twice: first by " +
                          DescribeMember(held, c, rank) + ", then by " +
                          DescribeMember(mine, c, rank);
  auto state = ctx_.store.SetIfAbsent(root + "state", "was contested: " + why, false).value_or("");
  // The job must not go on with a slot two processes claim: before the seal the contest fails
  // it there; every rank's liveness key dies with the reason, so ranks waiting at Connect fail
  // now, and a sealed job fails at its next wait that looks at them (a sync's after 200 ms).
  for (int i = 0; i < ctx_.world; ++i) {
    ctx_.store.MarkDead(root + "alive/" + std::to_string(i), "job failed: " + why).IgnoreError();
  }
  const std::string outcome = state.starts_with(kSealed)
                                  ? "; the job had sealed and is now failed on every rank"
                                  : "; the job fails on every rank";
  return FailedPreconditionError(Me() + ": " + why + outcome +
                                 "; give each job its own prefix and each launch its own id and "
                                 "secret (job_id, job_secret, SHARDSYNC_JOB_ID/_SECRET)");
}

Status JobIdentity::Join(Clock::time_point deadline) {
  if (ctx_.world > 1 && !ctx_.launch.any()) return NoLaunchIdentity();
  SS_RETURN_IF_ERROR(CheckLaunch());
  return ctx_.rank == 0 ? Claim(deadline) : WaitForClaim(deadline);
}

Status JobIdentity::Claim(Clock::time_point deadline) {
  const std::string key = ClaimKey(ctx_.opt.prefix);
  JobClaim mine{nonce_, ctx_.plan.plan_hash, ctx_.launch.id, ctx_.launch.source, ""};
  mine.mac = ClaimMac(ctx_.launch.secret, ctx_.opt.prefix, mine);
  const std::string text = EncodeClaim(mine);
  SS_ASSIGN_OR_RETURN(std::string held, ctx_.store.SetIfAbsent(key, text, /*ephemeral=*/true));
  if (held != text) {
    SS_ASSIGN_OR_RETURN(JobClaim other, ParseClaim(held, key));
    // Rank 0 of this very launch holds it: slot 0 claimed twice.
    if (SameLaunch(other)) {
      auto first = ctx_.store.Get(JobRoot(ctx_.opt.prefix, other.nonce) + "member/0", Millis(0));
      return DoubleClaim(other, 0, first.ok() ? *first : "? (no member key yet)");
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
    SS_RETURN_IF_ERROR(CheckClaimProof(c));
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
  const std::string mine = EncodeMember(
      {member_, where_,
       MemberMac(ctx_.launch.secret, ctx_.opt.prefix, c.nonce, ctx_.rank, member_, where_)});
  SS_ASSIGN_OR_RETURN(std::string held,
                      ctx_.store.SetIfAbsent(root + "member/" + r, mine, /*ephemeral=*/false));
  if (held != mine) {
    // Its holder sets the liveness key right after the member key: absent means it is between
    // the two (wait for it), dead means it is gone (the claim is a finished job's).
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    auto alive = ctx_.store.Get(root + "alive/" + r, std::clamp(left, Millis(0), kMemberSettle));
    if (!alive.ok()) return Entry::kStale;
    return DoubleClaim(c, ctx_.rank, held);
  }
  Status s = ctx_.store.SetEphemeral(root + "alive/" + r, member_);
  if (!s.ok()) return s.Annotate(Me() + ": joining " + DescribeClaim(c));
  ctx_.root = root;
  ctx_.job_tag = c.nonce;
  claim_ = c;
  joined_ = true;
  return Entry::kJoined;
}

Status JobIdentity::CheckMembers(SyncGuard& guard, Clock::time_point deadline) {
  if (ctx_.launch.secret.empty() || ctx_.world < 2) return OkStatus();
  std::vector<std::string> keys;
  std::vector<int> ranks;
  for (int i = 1; i < ctx_.world; ++i) {
    keys.push_back(ctx_.Key("member/" + std::to_string(i)));
    ranks.push_back(i);
  }
  SS_ASSIGN_OR_RETURN(auto held, guard.GetFromRanks(keys, ranks, deadline, [](size_t) {
    return std::string("the job's member keys");
  }));
  for (size_t i = 0; i < held.size(); ++i) {
    const int rank = ranks[i];
    const MemberRecord m = ParseMember(held[i]);
    if (LaunchMacEquals(m.mac, MemberMac(ctx_.launch.secret, ctx_.opt.prefix, claim_.nonce, rank,
                                         m.id, m.where))) {
      continue;
    }
    const std::string why = "sync rank " + std::to_string(rank) + " was claimed by " +
                            DescribeMember(held[i], claim_, rank) +
                            ", a process without the launch's secret";
    ctx_.store.SetIfAbsent(ctx_.Key("state"), "was contested: " + why, false)
        .status()
        .IgnoreError();
    return FailedPreconditionError(Me() + ": " + DescribeClaim(claim_) + " on key prefix '" +
                                   ctx_.opt.prefix + "': " + why +
                                   "; the job is not sealed and no byte moved");
  }
  return OkStatus();
}

Status JobIdentity::Seal(SyncGuard& guard, Clock::time_point deadline) {
  const std::string key = ctx_.Key("state");
  const std::string sealed = SealText(ctx_.launch.secret, ctx_.opt.prefix, claim_.nonce);
  std::string state;
  if (ctx_.rank == 0) {
    SS_RETURN_IF_ERROR(CheckMembers(guard, deadline));
    SS_ASSIGN_OR_RETURN(state, ctx_.store.SetIfAbsent(key, sealed, false));
  } else {
    SS_ASSIGN_OR_RETURN(auto v, guard.GetFromRanks({key}, {0}, deadline, [](size_t) {
      return std::string("sync rank 0 to seal the job");
    }));
    state = std::move(v[0]);
  }
  if (state == sealed) return OkStatus();
  if (state.starts_with(kSealed)) state = "was sealed by a process without the launch's secret";
  return FailedPreconditionError(Me() + ": " + DescribeClaim(claim_) + " on key prefix '" +
                                 ctx_.opt.prefix + "' " + state +
                                 "; no byte moved: give each job its own prefix and each launch "
                                 "its own id and secret (job_id, job_secret, SHARDSYNC_JOB_ID)");
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
  // The last rank to leave deletes the job's keys, dead ones included: a finished job leaves
  // nothing in the store (its rank 0's claim below is one dead key per prefix, replaced by the
  // next job's).
  auto left = ctx_.store.Add(ctx_.Key("left"), 1);
  if (left.ok() && *left == ctx_.world) ctx_.store.DeletePrefix(ctx_.root).status().IgnoreError();
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
