// Sync session: replays one rank's plan per version with checksums on both sides, collects one
// job-wide report through the store (or a shared-memory board when every rank is on one host),
// and fails every rank fast when one fails.
//
// The session composes parts with one job each (docs/architecture.md walks a sync through them):
// identity.h (the job this rank joins), bindings.h (bindings and their checks), connect.h
// (agreement at Connect), pairs.h (prepared device pairs), host_send.h / host_recv.h (the host
// data path and bucket verification, with the plan's codec: codec.h), verdicts.h (the job-wide
// report) and guard.h (every wait, the abort key, the peers' liveness).
#include "shardsync/session.h"

#include <chrono>
#include <functional>
#include <map>

#include "shardsync/settings.h"

#include "sync/bindings.h"
#include "sync/codec.h"
#include "sync/connect.h"
#include "sync/context.h"
#include "sync/guard.h"
#include "sync/harness.h"
#include "sync/host_recv.h"
#include "sync/host_send.h"
#include "sync/identity.h"
#include "sync/pairs.h"
#include "sync/presence.h"
#include "sync/staging.h"
#include "sync/verdicts.h"

namespace shardsync {
namespace {

using sync_internal::Clock;
using sync_internal::Trace;

class SessionImpl final : public SyncSession {
 public:
  SessionImpl(PlanInputs in, int rank, SyncRank who, RankPlan plan, StoreClient& store,
              Transport& tx, SessionOptions opt, LaunchId launch, HarnessHooks hooks)
      : ctx_(std::move(in), rank, who, std::move(plan), store, tx, std::move(opt),
             std::move(launch)),
        hooks_(std::move(hooks)),
        codec_(sync_internal::MakeCodec(ctx_)),
        identity_(ctx_),
        presence_(ctx_),
        bindings_(ctx_),
        shapes_(ctx_),
        guard_(ctx_),
        verdicts_(ctx_, guard_),
        pairs_(ctx_, guard_, *codec_, staged_),  // staged_ is read from Connect on
        host_send_(ctx_, guard_, *codec_),
        host_recv_(ctx_, guard_, *codec_, staged_),  // staged_ is read from Connect on
        staged_(ctx_, guard_) {}
  ~SessionImpl() override {
    identity_.Leave();
    presence_.Leave();
  }

  Status Init() {
    SS_RETURN_IF_ERROR(bindings_.Init());
    presence_.Announce();  // peers see this rank from now on, and a failure of it before connect
    return OkStatus();
  }

  int rank() const override { return ctx_.rank; }
  bool is_trainer() const override { return ctx_.who.is_trainer; }
  const std::string& job_id() const override { return ctx_.launch.id; }
  const RankPlan& plan() const override { return ctx_.plan; }
  const std::vector<EngineParam>& ExpectedParams() const override { return bindings_.expected(); }
  const std::vector<TrainerParam>& ExpectedSources() const override {
    return bindings_.expected_sources();
  }
  // Staged: a failed sync poisons only staging; the live parameters only by a broken commit.
  bool IsPoisoned() const override { return staged_.on() ? staged_.live_poisoned() : poisoned_; }
  uint64_t last_good_version() const override { return last_good_; }
  int64_t staging_bytes() const override { return staged_.bytes(); }
  uint64_t committed_version() const override {
    return staged_.on() ? staged_.committed() : last_good_;
  }
  std::string keep_previous() const override { return connected_ ? staged_.keep() : ""; }

  Result<CommitReport> Commit(uint64_t version) override {
    if (!connected_) {
      return FailedPreconditionError("sync rank " + std::to_string(ctx_.rank) +
                                     ": Commit before Connect");
    }
    if (ctx_.opt.commit != SessionOptions::Commit::kStaged) {
      return FailedPreconditionError("sync rank " + std::to_string(ctx_.rank) +
                                     ": Commit is for staged sessions (commit staged); in place, "
                                     "a verified sync is already live");
    }
    if (ctx_.who.is_trainer) return CommitReport{version, 0, 0, 0, ""};  // nothing to commit
    return staged_.Commit(version, last_good_);
  }

  Status Rollback() override {
    if (!connected_) {
      return FailedPreconditionError("sync rank " + std::to_string(ctx_.rank) +
                                     ": Rollback before Connect");
    }
    // As Commit: a no-op on the trainer ranks of a staged job (callers may call every rank).
    if (ctx_.who.is_trainer && ctx_.opt.commit == SessionOptions::Commit::kStaged) {
      return OkStatus();
    }
    return staged_.Rollback();
  }

  Status BindSource(const SourceBinding& b) override {
    if (connected_) {
      return FailedPreconditionError("BindSource(" + (b.local.empty() ? b.hf_name : b.local) +
                                     "): already connected");
    }
    return FailIfBad(bindings_.BindSource(b));
  }

  Status BindDest(const DestBinding& b) override {
    if (connected_) return FailedPreconditionError("BindDest(" + b.name + "): already connected");
    return FailIfBad(bindings_.BindDest(b));
  }

  void FailBeforeConnect(const std::string& why) override {
    if (!connected_) presence_.Fail(why);
  }

  void FailSync(uint64_t version, const std::string& why) override {
    if (!connected_) return FailBeforeConnect(why);
    // The version's abort key, which every rank of that sync watches (SyncGuard::CheckAbort).
    ctx_.store
        .Set(ctx_.Key("v" + std::to_string(version) + "/abort"),
             "sync rank " + std::to_string(ctx_.rank) + " failed: " + why)
        .IgnoreError();
  }

  Status Connect() override {
    if (connected_) {
      return FailedPreconditionError("sync rank " + std::to_string(ctx_.rank) +
                                     ": already connected");
    }
    Status s = ConnectSteps();
    // Peers waiting on this rank learn now, not at their timeout (a retry joins again).
    if (!s.ok()) identity_.Abandon(s);
    return presence_.ExplainTimeout(std::move(s));
  }

  // A failed bind is this rank's end before connect: peers waiting for it learn at once.
  Status FailIfBad(Status s) {
    if (!s.ok()) presence_.Fail(s.ToString());
    return s;
  }

  Status ConnectSteps() {
    SS_RETURN_IF_ERROR(ctx_.packer->Quiesce());  // registered memory is final before peers see it
    const auto deadline = Clock::now() + ctx_.opt.connect_timeout;
    presence_.Connecting();
    // Any store wait at Connect (the transport's and the prepared pairs' included) fails at once
    // when a peer is gone: before the job exists, by its presence key (presence.h: a bind error,
    // an exit before connect); once every rank joined, by its liveness key too.
    struct StopWatching {
      sync_internal::WatchedStore& w;
      ~StopWatching() { w.Watch({}, nullptr); }
    } stop{ctx_.watched};
    ctx_.watched.Watch(presence_.OthersKeys(),
                       [this](const Status& s) { return presence_.PeerFailed(s); });
    // 0. The job: rank 0 claims the prefix, the others join its claim; every key below is the
    // job's own.
    SS_RETURN_IF_ERROR(identity_.Join(deadline));
    // 1. Plan hashes: every rank must hold the same plan before any byte moves.
    SS_RETURN_IF_ERROR(sync_internal::AgreeOnPlan(ctx_, guard_, deadline));
    std::vector<std::string> watched = guard_.OthersAlive();
    for (std::string& k : presence_.OthersKeys()) watched.push_back(std::move(k));
    ctx_.watched.Watch(std::move(watched), [this](const Status& s) {
      std::vector<int> others;
      for (int r = 0; r < ctx_.world; ++r) {
        if (r != ctx_.rank) others.push_back(r);
      }
      // A joined rank that is gone says so (its liveness key); one that failed before it joined
      // only by its presence key.
      Status gone = guard_.GonePeer(others, false, s);
      return gone.message() != s.message() ? gone : presence_.PeerFailed(s);
    });
    // 2. Bindings against the plan.
    SS_RETURN_IF_ERROR(bindings_.Check());
    // Staged commit: parameters land in staging (registered below in their place).
    SS_RETURN_IF_ERROR(staged_.Prepare(bindings_));
    // 3. Receive memory, registered once: senders put straight into the parameters (and into a
    // block-FP8 receiver's device staging).
    SS_ASSIGN_OR_RETURN(const MemRegion* staging, pairs_.AllocStaging(bindings_));
    SS_RETURN_IF_ERROR(sync_internal::RegisterParams(ctx_, bindings_, staging));
    if (hooks_.before_transport_connect) {
      SS_RETURN_IF_ERROR(hooks_.before_transport_connect(ctx_.tx));
    }
    // 4. Transport, and where each receiver's parameters are.
    guard_.set_peers(sync_internal::TransportPeers(ctx_, hooks_.extra_peers));
    SS_RETURN_IF_ERROR(sync_internal::ConnectTransport(ctx_, guard_.peers(), deadline));
    SS_ASSIGN_OR_RETURN(auto regbase, sync_internal::ReadRegionBases(ctx_, guard_, deadline));
    // 5. Prepared pairs, the verdict board, the host path.
    SS_RETURN_IF_ERROR(pairs_.Prepare(bindings_, shapes_, regbase, deadline));
    SS_RETURN_IF_ERROR(verdicts_.Open(deadline));
    guard_.set_board(verdicts_.board());
    SS_RETURN_IF_ERROR(host_send_.Prepare(bindings_, shapes_, pairs_, std::move(regbase)));
    SS_RETURN_IF_ERROR(host_recv_.Prepare(bindings_, pairs_));
    // 6. Nobody contested the job while it connected (identity.h): it is whole.
    SS_RETURN_IF_ERROR(identity_.Seal(guard_, deadline));
    connected_ = true;
    return OkStatus();
  }

  Result<SyncReport> Sync(uint64_t version) override {
    if (!connected_) {
      return FailedPreconditionError("sync rank " + std::to_string(ctx_.rank) +
                                     ": Sync before Connect");
    }
    if (version == 0 || version > kMaxSyncVersion) {
      // Refused before anything, the guard's version included: peers get the same refusal.
      return InvalidArgumentError("sync rank " + std::to_string(ctx_.rank) + ": version " +
                                  std::to_string(version) + " outside 1.." +
                                  std::to_string(kMaxSyncVersion) + " (kMaxSyncVersion)");
    }
    const auto t0 = Clock::now();
    Trace(ctx_.rank, version, [] { return "called"; });
    guard_.Begin(version, t0);
    RankSyncStats st;
    st.rank = ctx_.rank;
    Status s;
    if (version <= last_good_ || version <= last_attempted_) {
      // Nothing is touched: a refused version leaves the parameters (and poison state) as is.
      s = FailedPreconditionError("sync rank " + std::to_string(ctx_.rank) + ": version " +
                                  std::to_string(version) + " is stale (last successful version " +
                                  std::to_string(last_good_) + ", last attempted " +
                                  std::to_string(last_attempted_) + "; use a newer version)");
      // Tell peers that may be waiting on this version; its store keys belong to an earlier
      // attempt, so no verdict is posted.
      if (version > last_good_) guard_.PostAbort(s);
      return s;
    }
    last_attempted_ = version;
    if (ctx_.rank == 0) attempted_.push_back(version);
    if (!ctx_.who.is_trainer) poisoned_ = true;  // bytes are about to be overwritten
    staged_.BeginSync();
    s = ctx_.packer->Quiesce();  // the caller's pending writes to bound memory land first
    // (Each rank says it entered, its `cur` key, off its critical path: a receiver once its
    // prepared pairs are posted (RunReceiver), a sender while they run (RunSender).)
    Trace(ctx_.rank, version, [] { return "entered"; });
    if (s.ok()) s = ctx_.who.is_trainer ? RunSender(st) : RunReceiver(st);
    st.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    st.ok = s.ok();
    Trace(ctx_.rank, version, [&] { return s.ok() ? "synced" : "failed: " + s.ToString(); });
    if (!s.ok()) {
      st.error = s.message();
      guard_.PostAbort(s);
      pairs_.CancelAll();
    }
    // Everyone posts a verdict, failed or not, so peers learn the cause rather than time out.
    verdicts_.Post(st);
    if (!s.ok()) return s;
    auto report = verdicts_.Gather(st);
    if (!report.ok()) return Fail(report.status());
    Trace(ctx_.rank, version, [] { return "gathered every verdict"; });
    last_good_ = version;
    poisoned_ = false;
    DropFinishedVersions(version);
    return report;
  }

 private:
  Status Fail(const Status& s) {
    guard_.PostAbort(s);
    if (!ctx_.who.is_trainer) poisoned_ = true;
    return s;
  }

  // Rank 0, after `version` succeeded: every rank posted its verdict of it, so every rank is
  // done with every version before it and their keys can go (the store's key count stays flat).
  // In one round trip every kDropEvery versions, after this rank's report: nothing per sync on
  // anyone's critical path.
  void DropFinishedVersions(uint64_t version) {
    constexpr size_t kDropEvery = 16;
    if (ctx_.rank != 0 || attempted_.size() < kDropEvery) return;
    std::vector<std::string> prefixes;
    for (uint64_t v : attempted_) {
      if (v == version) continue;
      // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "v" + to_string.
      std::string k = "v";
      k += std::to_string(v);
      k += '/';
      prefixes.push_back(ctx_.Key(k));
    }
    Status s = ctx_.store.DeletePrefixes(prefixes);
    Trace(ctx_.rank, version, [&] {
      return "dropped " + std::to_string(prefixes.size()) +
             " finished versions' keys: " + s.ToString();
    });
    attempted_.assign(1, version);
  }

  // This rank's `cur` key: the version it is in (peers' CheckAbort compare theirs).
  Status SetCurrent() {
    return ctx_.store.Set(ctx_.Key("cur/" + std::to_string(ctx_.rank)),
                          std::to_string(guard_.version()));
  }

  Status RunSender(RankSyncStats& st) {
    const RankPlan& plan = ctx_.plan;
    // Pairs that hold their writes until their receiver is in this sync go first (cuda_ipc:
    // they launch the moment the last receiver's pair is posted); every other receiver is waited
    // for through its ready key.
    auto signals = [&](size_t mi) { return pairs_.SignalsReady(mi); };
    // This rank's `cur` key costs a store round trip: set while the prepared pairs run when
    // they are all there is to wait for, else before the first wait on the store.
    bool entered = false;
    auto enter = [&]() -> Status {
      if (entered) return OkStatus();
      entered = true;
      return SetCurrent();
    };
    // Block FP8 with blocks shared by trainer ranks whose prepared pairs quantize them (cuda_ipc):
    // the holders agree on the blocks' scales before the pairs launch, which read them (a rank's
    // pairs launch as one kernel, so none goes earlier). Plans without such pairs skip this.
    const bool exchange_first = host_send_.exchanges() && codec_->pairs_read_exchange();
    if (exchange_first) {
      SS_RETURN_IF_ERROR(enter());
      SS_RETURN_IF_ERROR(host_send_.Exchange());
    }
    SS_RETURN_IF_ERROR(pairs_.PostSends(signals));
    std::vector<std::string> ready;
    std::vector<int> waited;
    for (size_t mi = 0; mi < plan.sends.size(); ++mi) {
      if (signals(mi)) continue;
      ready.push_back(ctx_.Key(guard_.VKey("ready/") + std::to_string(plan.sends[mi].dst)));
      waited.push_back(plan.sends[mi].dst);
    }
    // Block FP8 with blocks shared by trainer ranks: their holders agree on the blocks' scales
    // first (one store value per holder), while the receivers get ready.
    if (host_send_.exchanges() && !exchange_first) {
      SS_RETURN_IF_ERROR(enter());
      SS_RETURN_IF_ERROR(host_send_.Exchange());
    }
    if (!ready.empty()) SS_RETURN_IF_ERROR(enter());
    SS_ASSIGN_OR_RETURN(const std::vector<std::string> ready_values,
                        guard_.GetManyUntil(
                            ready, guard_.deadline(),
                            [&](size_t i) {
                              return "sync rank " + std::to_string(waited[i]) +
                                     " to enter version " + std::to_string(guard_.version());
                            },
                            /*watch_abort=*/true));
    // Delta encoding: what each receiver holds, per bucket (delta_path.h).
    for (size_t i = 0; i < waited.size(); ++i) {
      SS_RETURN_IF_ERROR(host_send_.SetReceiverBases(waited[i], ready_values[i]));
    }
    Trace(ctx_.rank, guard_.version(),
          [&] { return std::to_string(ready.size()) + " ready keys in"; });
    // Prepared pairs (device memory) go first: their device work overlaps the host path below.
    SS_RETURN_IF_ERROR(pairs_.PostSends([&](size_t mi) { return !signals(mi); }));
    if (host_send_.has_buckets()) {
      SS_RETURN_IF_ERROR(enter());
    }
    SS_RETURN_IF_ERROR(host_send_.Send(st));
    SS_RETURN_IF_ERROR(pairs_.FinishSends(st, enter));
    SS_RETURN_IF_ERROR(enter());
    // A send can complete here while its protocol tail (e.g. a rendezvous put's completion
    // message) is still queued on this side: flush before this rank stops driving progress.
    std::vector<XferId> flushes;
    for (size_t mi = 0; mi < plan.sends.size(); ++mi) {
      if (pairs_.sends(mi)) continue;
      SS_ASSIGN_OR_RETURN(XferId id, ctx_.tx.PostFlush(plan.sends[mi].dst));
      flushes.push_back(id);
    }
    return guard_.WaitAll(flushes, "flushing to the receivers");
  }

  Status RunReceiver(RankSyncStats& st) {
    const RankPlan& plan = ctx_.plan;
    // Padding rows are the engine's zeros, not the trainer's bytes.
    const std::vector<EngineParam>& params = bindings_.expected();
    for (size_t i = 0; i < params.size(); ++i) {
      const DestBinding& d = bindings_.dest(static_cast<int>(i));
      for (const ZeroFill& z : params[i].zero_fills) {
        SS_RETURN_IF_ERROR(ctx_.packer->ZeroFill(d.data, d.dtype, d.shape, z.dst));
      }
    }
    SS_RETURN_IF_ERROR(pairs_.PostRecvs());
    // A receiver inside Sync(v) is paused for v: only then may senders write into its memory
    // (one-sided puts would otherwise land while it still reads the previous version). Its
    // prepared pairs were posted first: those that signal readiness themselves are faster.
    // Its value: "1", or under the delta encoding the base this rank holds per bucket.
    SS_ASSIGN_OR_RETURN(std::string ready_value, host_recv_.ReadyValue());
    SS_RETURN_IF_ERROR(ctx_.store.SetMany(
        {{ctx_.Key("cur/" + std::to_string(ctx_.rank)), std::to_string(guard_.version())},
         {ctx_.Key(guard_.VKey("ready/") + std::to_string(ctx_.rank)), std::move(ready_value)}}));
    SS_RETURN_IF_ERROR(host_recv_.Receive(st));
    SS_RETURN_IF_ERROR(pairs_.FinishRecvs(st, bindings_));
    // The codec's step after verification (block FP8: bands staged over device pairs are
    // quantized from verified bytes only).
    SS_RETURN_IF_ERROR(pairs_.AfterVerified());
    // Completing a receive can leave protocol messages to the sender (e.g. a rendezvous ack)
    // queued on this side; flush them out before this rank stops driving the transport.
    std::vector<XferId> flushes;
    for (size_t mi = 0; mi < plan.recvs.size(); ++mi) {
      if (pairs_.recvs(mi)) continue;
      SS_ASSIGN_OR_RETURN(XferId id, ctx_.tx.PostFlush(plan.recvs[mi].src));
      flushes.push_back(id);
    }
    SS_RETURN_IF_ERROR(guard_.WaitAll(flushes, "flushing to the senders"));
    // Staged, kArea: the served version kept for a rollback of the next commit.
    return staged_.AfterVerified();
  }

  // Declaration order is construction order: every part refers to ctx_ (and most to guard_).
  sync_internal::SessionContext ctx_;
  HarnessHooks hooks_;
  // What the session does with the plan's encodings (codec.h): the host path's pack and land
  // steps, the pairs' buckets.
  std::unique_ptr<sync_internal::Codec> codec_;
  sync_internal::JobIdentity identity_;
  sync_internal::Presence presence_;
  sync_internal::Bindings bindings_;
  sync_internal::PeerShapes shapes_;
  sync_internal::SyncGuard guard_;
  sync_internal::VerdictExchange verdicts_;
  sync_internal::PreparedPairs pairs_;
  // The host path: one loop each way, with the plan's codec.
  sync_internal::HostSender host_send_;
  sync_internal::HostReceiver host_recv_;
  sync_internal::StagedCommit staged_;
  bool connected_ = false;
  bool poisoned_ = false;
  uint64_t last_good_ = 0;
  uint64_t last_attempted_ = 0;
  std::vector<uint64_t> attempted_;  // rank 0: versions whose keys are still in the store
};

}  // namespace

Result<std::unique_ptr<SyncSession>> CreateHarnessSession(const PlanInputs& inputs, int rank,
                                                          StoreClient& store, Transport& transport,
                                                          SessionOptions options,
                                                          HarnessHooks hooks) {
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(inputs, rank));
  SS_ASSIGN_OR_RETURN(RankPlan plan, PlanForRank(inputs, rank));
  // Every knob parses before any is read: one read deep in a GPU path has no error to return.
  SS_RETURN_IF_ERROR(CheckKnobs());
  LaunchId launch;
  if (options.job_id) {
    SS_RETURN_IF_ERROR(CheckJobId(*options.job_id, "job_id"));
    launch = {*options.job_id, options.job_id->empty() ? "" : "job_id", ""};
  } else {
    SS_ASSIGN_OR_RETURN(launch, LaunchIdFromEnvironment());
  }
  if (options.job_secret) {
    if (!options.job_secret->empty())
      SS_RETURN_IF_ERROR(CheckJobSecret(*options.job_secret, "job_secret"));
    launch.secret = *options.job_secret;
  } else if (options.job_id) {
    // An explicit id without an explicit secret: the environment's secret belongs to the
    // environment's launch, which may be another.
    auto env = LaunchIdFromEnvironment();
    if (env.ok() && env->id == launch.id) launch.secret = env->secret;
  }
  auto s = std::make_unique<SessionImpl>(inputs, rank, who, std::move(plan), store, transport,
                                         std::move(options), std::move(launch), std::move(hooks));
  SS_RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<SyncSession>(std::move(s));
}

Result<std::unique_ptr<SyncSession>> SyncSession::Create(const PlanInputs& inputs, int rank,
                                                         StoreClient& store, Transport& transport,
                                                         SessionOptions options) {
  return CreateHarnessSession(inputs, rank, store, transport, std::move(options), {});
}

}  // namespace shardsync
