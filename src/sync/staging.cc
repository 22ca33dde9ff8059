// Staged commit (staging.h): staging area, commit agreement, rollback.
#include "sync/staging.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "shardsync/shard_map.h"
#include "sync/codec.h"

namespace shardsync {
namespace {

// Each parameter's staging starts on this boundary (the device kernels' vector loads, and the
// same alignment the engines' own allocators give).
constexpr int64_t kAlign = 256;

// Offsets of `params` in one area, in the dtypes they are bound in; returns the area's bytes.
int64_t Layout(const std::vector<EngineParam>& params, const PlanInputs& in,
               std::vector<int64_t>* offsets) {
  int64_t at = 0;
  for (const EngineParam& p : params) {
    if (offsets) offsets->push_back(at);
    const DType t = sync_internal::BoundDType(in, p);
    at += (p.numel() * DTypeSize(t) + kAlign - 1) / kAlign * kAlign;
  }
  return at;
}

std::string Gb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB", static_cast<double>(bytes) / 1e9);
  return buf;
}

}  // namespace

Result<int64_t> StagingBytes(const PlanInputs& inputs, int rank) {
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(inputs, rank));
  if (who.is_trainer) return int64_t{0};
  SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(inputs.model, inputs.rollout.shard));
  return Layout(map.rank(who.tp_rank, who.pp_rank).params, inputs, nullptr);
}

namespace sync_internal {

using Keep = SessionOptions::Keep;

std::string StagedCommit::Who() const {
  return "sync rank " + std::to_string(ctx_.rank) + " (engine replica " +
         std::to_string(ctx_.who.replica) + " tp " + std::to_string(ctx_.who.tp_rank) + " pp " +
         std::to_string(ctx_.who.pp_rank) + ")";
}

std::string StagedCommit::keep() const {
  if (!on()) return "";
  switch (keep_) {
    case Keep::kArea:
      return "area";
    case Keep::kSwap:
      return "swap";
    default:
      return "none";
  }
}

int64_t StagedCommit::bytes() const {
  if (ctx_.who.is_trainer) return 0;
  auto b = StagingBytes(ctx_.in, ctx_.rank);
  return b.ok() ? *b : 0;
}

Status StagedCommit::Prepare(Bindings& bindings) {
  if (!on()) return OkStatus();
  live_ = bindings.dests();
  offsets_.clear();
  total_ = Layout(bindings.expected(), ctx_.in, &offsets_);
  const MemKind mem = live_.empty() ? MemKind::kHost : live_[0].mem;
  const std::string kind = mem == MemKind::kCuda ? "device" : "host";
  if (ctx_.opt.staging && *ctx_.opt.staging != mem) {
    // The transports land where the rank's parameters are (device pairs write device memory,
    // the host path host memory): staging elsewhere would need a transport that crosses.
    return InvalidArgumentError(
        Who() + ": --staging " + (*ctx_.opt.staging == MemKind::kCuda ? "device" : "host") +
        ", but its parameters are in " + kind +
        " memory and the transports land only in the memory the parameters are in (use "
        "--staging " +
        kind + ")");
  }
  SS_ASSIGN_OR_RETURN(int64_t free_bytes, ctx_.packer->FreeBytes());
  const std::string where = mem == MemKind::kCuda
                                ? "device " + std::to_string(live_.empty() ? -1 : live_[0].device)
                                : "this host";
  if (total_ > free_bytes) {
    return FailedPreconditionError(
        Who() + ": a staged commit needs " + std::to_string(total_) + " bytes (" + Gb(total_) +
        ") of " + kind + " staging for its " + std::to_string(live_.size()) + " parameters, but " +
        where + " has " + std::to_string(free_bytes) + " bytes (" + Gb(free_bytes) +
        ") free (use --commit inplace, or more ranks per replica)");
  }
  keep_ = ctx_.opt.keep_previous;
  if (keep_ == Keep::kAuto) keep_ = 2 * total_ <= free_bytes ? Keep::kArea : Keep::kSwap;
  if (keep_ == Keep::kArea && 2 * total_ > free_bytes) {
    return FailedPreconditionError(
        Who() + ": keeping the previous version in a second area needs " +
        std::to_string(2 * total_) + " bytes (" + Gb(2 * total_) + ") of " + kind +
        " memory with staging, but " + where + " has " + std::to_string(free_bytes) + " (" +
        Gb(free_bytes) + ") free (use keep_previous swap or none)");
  }
  SS_ASSIGN_OR_RETURN(staging_, ctx_.packer->AllocStaging(static_cast<size_t>(total_)));
  if (keep_ == Keep::kArea) {
    SS_ASSIGN_OR_RETURN(previous_, ctx_.packer->AllocStaging(static_cast<size_t>(total_)));
  }
  for (size_t i = 0; i < live_.size(); ++i) {
    bindings.RedirectDest(static_cast<int>(i), staging_.get() + offsets_[i]);
  }
  return OkStatus();
}

Status StagedCommit::Move(bool from_staging, bool swap) {
  std::vector<Packer::AreaCopy> copies;
  copies.reserve(live_.size());
  unsigned char* area = from_staging ? staging_.get() : previous_.get();
  for (size_t i = 0; i < live_.size(); ++i) {
    const DestBinding& d = live_[i];
    int64_t n = DTypeSize(d.dtype);
    for (int64_t e : d.shape) n *= e;
    copies.push_back({d.data, area + offsets_[i], n});
  }
  return ctx_.packer->CopyAreas(copies, swap);
}

void StagedCommit::BeginSync() {
  // kSwap keeps the previous version in staging, which this sync overwrites.
  if (on() && keep_ == Keep::kSwap) can_rollback_ = false;
}

Status StagedCommit::AfterVerified() {
  if (!on() || keep_ != Keep::kArea || area_is_live_) return OkStatus();
  // The live parameters only change in Commit / Rollback, and the engine only reads them, so
  // this copy runs while it serves; the version it keeps is what the next commit replaces.
  std::vector<Packer::AreaCopy> copies;
  for (size_t i = 0; i < live_.size(); ++i) {
    const DestBinding& d = live_[i];
    int64_t n = DTypeSize(d.dtype);
    for (int64_t e : d.shape) n *= e;
    copies.push_back({previous_.get() + offsets_[i], d.data, n});
  }
  SS_RETURN_IF_ERROR(ctx_.packer->CopyAreas(copies, /*swap=*/false)
                         .Annotate(Who() + ": keeping the live parameters for a rollback"));
  area_is_live_ = true;
  area_version_ = committed_;
  can_rollback_ = false;  // what it held (the version before the last commit) is gone
  return OkStatus();
}

std::vector<int> StagedCommit::ScopeRanks() const {
  const int s = ctx_.in.trainer.world();
  const int per_replica = ctx_.in.rollout.shard.tp * ctx_.in.rollout.shard.pp;
  std::vector<int> out;
  if (ctx_.opt.commit_scope == SessionOptions::Scope::kReplica) {
    for (int j = 0; j < per_replica; ++j) out.push_back(s + ctx_.who.replica * per_replica + j);
  } else {
    for (int r = s; r < ctx_.world; ++r) out.push_back(r);
  }
  return out;
}

Status StagedCommit::Agree(uint64_t version, const std::string& step, const std::string& state,
                           Clock::time_point deadline) {
  // Each attempt at a version has keys of its own: a commit retried after a failed one must not
  // read the earlier attempt's states (every rank of the scope counts its attempts alike).
  std::string base = "v";  // piece by piece: GCC 12 -Wrestrict false positive on "v" + ...
  base += std::to_string(version);
  base += "/commit/";
  base += std::to_string(attempt_);
  base += '/';
  base += step;
  base += '/';
  std::vector<std::string> keys;
  std::vector<int> ranks;
  for (int r : ScopeRanks()) {
    if (r == ctx_.rank) continue;
    keys.push_back(ctx_.Key(base + std::to_string(r)));
    ranks.push_back(r);
  }
  const std::pair<std::string, std::string> mine{ctx_.Key(base + std::to_string(ctx_.rank)), state};
  // One round trip posts this rank's state and reads the others' (and their liveness: a rank
  // that is gone fails the wait at once, named).
  auto got = guard_.GetFromRanks(
      keys, ranks, deadline,
      [&](size_t i) {
        return "sync rank " + std::to_string(ranks[i]) + " to " +
               (step == "ready" ? "be ready to commit version " : "finish its commit of version ") +
               std::to_string(version);
      },
      &mine);
  if (!got.ok()) return got.status();
  for (size_t i = 0; i < got->size(); ++i) {
    if ((*got)[i] != "ok") {
      return AbortedError("sync rank " + std::to_string(ranks[i]) + " cannot commit version " +
                          std::to_string(version) + ": " + (*got)[i]);
    }
  }
  return OkStatus();
}

Result<CommitReport> StagedCommit::Commit(uint64_t version, uint64_t verified) {
  const auto t0 = Clock::now();
  attempt_ = version == attempt_version_ ? attempt_ + 1 : 1;
  attempt_version_ = version;
  CommitReport rep;
  rep.version = version;
  rep.keep_previous = keep();
  Status local;
  if (version != verified) {
    local = FailedPreconditionError(Who() + ": version " + std::to_string(version) +
                                    " is not the last version it verified (" +
                                    std::to_string(verified) + ")");
  } else if (version <= committed_) {
    local = FailedPreconditionError(Who() + ": version " + std::to_string(version) +
                                    " is not newer than the committed version " +
                                    std::to_string(committed_));
  }
  const auto deadline = t0 + ctx_.opt.sync_timeout;
  const std::string held = "; its live parameters still hold version " + std::to_string(committed_);
  // Round 1: every rank of the scope verified and is in Commit (paused), before anyone copies.
  Status s = Agree(version, "ready", local.ok() ? "ok" : local.message(), deadline);
  Trace(ctx_.rank, version, [&] { return "commit: every rank ready: " + s.ToString(); });
  if (!local.ok()) return local;
  if (!s.ok()) return Status(s.code(), s.message() + held);
  // The copy. kSwap exchanges, so staging then holds what the live parameters served.
  const auto c0 = Clock::now();
  // The engine's own queued work on the parameters (torch's default stream) finishes first.
  Status copied = ctx_.packer->Quiesce();
  if (copied.ok()) copied = Move(/*from_staging=*/true, /*swap=*/keep_ == Keep::kSwap);
  rep.copy_seconds = std::chrono::duration<double>(Clock::now() - c0).count();
  // Round 2: every rank copied. A rank whose copy failed (or that is gone) rolls every other back.
  s = Agree(version, "done", copied.ok() ? "ok" : copied.message(), deadline);
  Trace(ctx_.rank, version, [&] {
    return "commit: copied (" + copied.ToString() + "), every rank done: " + s.ToString();
  });
  if (copied.ok() && s.ok()) {
    rollback_to_ = keep_ == Keep::kArea ? area_version_ : committed_;
    can_rollback_ = keep_ != Keep::kNone;
    area_is_live_ = false;
    live_poisoned_ = false;
    committed_ = version;
    rep.bytes = 0;
    for (const DestBinding& d : live_) {
      int64_t n = DTypeSize(d.dtype);
      for (int64_t e : d.shape) n *= e;
      rep.bytes += n;
    }
    rep.stall_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return rep;
  }
  Status cause = copied.ok() ? s : copied.Annotate(Who() + ": commit copy");
  // The copy may have written part of the live parameters: put the served version back.
  Status undo = OkStatus();
  if (!copied.ok() && keep_ == Keep::kSwap) {
    undo = DataLossError("a partial exchange cannot be undone");
  } else if (keep_ == Keep::kArea) {
    undo = Move(/*from_staging=*/false, /*swap=*/false);
  } else if (keep_ == Keep::kSwap) {
    undo = Move(/*from_staging=*/true, /*swap=*/true);
  } else {
    undo = FailedPreconditionError("keep_previous none: nothing to restore from");
  }
  if (!undo.ok()) {
    live_poisoned_ = true;
    return Status(cause.code(), cause.message() + "; rolling back failed (" + undo.message() +
                                    "): the live parameters are poisoned until a commit succeeds");
  }
  return Status(cause.code(), cause.message() + "; rolled back: its live parameters hold version " +
                                  std::to_string(committed_));
}

Status StagedCommit::Rollback() {
  if (!on()) {
    return FailedPreconditionError("sync rank " + std::to_string(ctx_.rank) +
                                   ": Rollback is for engine ranks of a staged session");
  }
  if (keep_ == Keep::kNone) {
    return FailedPreconditionError(Who() +
                                   ": keep_previous none keeps no previous version to restore");
  }
  if (!can_rollback_) {
    return FailedPreconditionError(
        Who() + ": no previous version is kept (a rollback is possible from a commit until the " +
        (keep_ == Keep::kArea ? "next verified sync" : "next sync") + ")");
  }
  // kArea: the previous area holds it; kSwap: staging does (the commit exchanged them).
  SS_RETURN_IF_ERROR(Move(/*from_staging=*/keep_ == Keep::kSwap, keep_ == Keep::kSwap)
                         .Annotate(Who() + ": rollback"));
  committed_ = rollback_to_;
  can_rollback_ = false;
  area_is_live_ = keep_ == Keep::kArea;
  live_poisoned_ = false;
  return OkStatus();
}

}  // namespace sync_internal
}  // namespace shardsync
