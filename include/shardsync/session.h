// Verified sync sessions: one per sync rank. A trainer rank binds its source shards and sends; an
// engine rank binds its destination parameters and receives straight into them (zero copy). Every
// sync replays the rank's plan, checksums every bucket on both sides, and returns one report that
// every rank of the job agrees on (DESIGN.md "Sync protocol").
//
// Life cycle: Create -> Bind* -> Connect (joins the job: rank 0 claims the key prefix, every other
// rank joins that claim; plan hash check across all ranks, binding check, memory registration,
// transport connect) -> Sync(version) repeatedly. Threading: a session, its store client and its
// transport are driven by one thread at a time.
//
// One job is one job: every key, the verdict board and every control message carry the job's
// nonce, so two jobs on one store and prefix never merge; the second fails at Connect, naming the
// prefix and the job holding it (docs/security.md "Job identity").
//
// Failure: any error on any rank (peer death, timeout, checksum mismatch, stale or differing
// version) makes every rank return an error within `sync_timeout`: the failing rank posts an abort
// key the others poll. A rank whose session or process ended (its store connection closed, or a
// launcher called MarkSyncRankDead) fails every rank waiting on it within about a second, naming
// it. A receiver is poisoned from the start of a sync until that sync succeeds, so a failed sync
// leaves it poisoned until a later full sync succeeds.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/pack.h"
#include "shardsync/plan.h"
#include "shardsync/region.h"
#include "shardsync/status.h"
#include "shardsync/store.h"
#include "shardsync/transport.h"

namespace shardsync {

// Blocks shared by FSDP trainer ranks under the amax exchange (PlanOptions::straddle kAmax, the
// default) are quantized on the host path and over one-sided device pairs (cuda_ipc); two-sided
// pairs (nccl) refuse them with this tail.
inline constexpr char kAmaxOnDevice[] =
    "the amax exchange of shared blocks runs on the host path and over cuda_ipc pairs (the GPUs "
    "of one node, their default route), not over nccl pairs: use an FSDP size whose chunks fall "
    "on the 128 grid (`shardsync plan` shows the exchanged blocks), cuda_ipc for this pair (no "
    "nccl hint), or host memory";

// The host-memory packer (bf16/f16/f32 casts). Single-threaded.
std::unique_ptr<Packer> MakeCpuPacker();

struct SessionOptions {
  std::string prefix = "ss/";  // store key namespace of this job (every rank uses the same)
  // The launch this rank belongs to (store.h LaunchId): a rank refuses to join a job of another
  // launch on its prefix. nullopt: from the environment (LaunchIdFromEnvironment); "": none. Ranks
  // of one job started by different launchers (trainer under torchrun, engines under SGLang)
  // must pass one id, or none.
  std::optional<std::string> job_id;
  // The launch's secret (store.h LaunchId::secret), which every rank of the job proves to claim
  // its slot: a process without it is refused, whatever id it gives. nullopt: from the
  // environment (SHARDSYNC_JOB_SECRET); "": none. A rank with neither an id nor a secret in a job
  // of several ranks refuses to connect (docs/security.md "Job identity").
  std::optional<std::string> job_secret;
  Millis connect_timeout{60000};
  Millis sync_timeout{60000};  // bounds every wait of one Sync on this rank
  // Pluggable packer (device memory); nullptr: the CPU packer.
  Packer* packer = nullptr;
  // Ranks that all map one shared-memory segment (one host) exchange their per-sync verdicts
  // through it instead of the store (a store round trip and fan-out less at the end of every
  // sync). Used only when every rank agrees at Connect; SHARDSYNC_VERDICT_BOARD=0 turns it off.
  bool shared_memory_verdicts = true;

  // Staged commit (docs/staged-commit.md): kStaged engine ranks receive every sync into a staging
  // area of their own while the engine keeps serving from the live parameters, verify it as an
  // in-place sync does, and copy it into the live parameters only in Commit(version), once every
  // engine rank of `commit_scope` verified. A sync that fails leaves the live parameters as they
  // were. kInPlace (the default): bytes land in the bound parameters.
  enum class Commit { kInPlace, kStaged } commit = Commit::kInPlace;
  // Where staging lives: the packer's memory (device memory beside the parameters for a device
  // packer, host memory for the CPU packer). Host staging of device parameters is refused: the
  // device transports land only in device memory.
  std::optional<MemKind> staging;  // nullopt: the bound parameters' memory
  // Ranks that agree before any commits: every engine rank of the job, or of this rank's replica.
  enum class Scope { kJob, kReplica } commit_scope = Scope::kJob;
  // How Rollback() gets the previous committed version back. kArea: a second area the live
  // parameters are copied into after each verified sync (while the engine still serves; the
  // commit stall stays one copy). kSwap: the commit exchanges staging and live parameters
  // (no second area, a stall of two copies' traffic). kNone: no rollback. kAuto: kArea when it
  // fits in the packer's free memory beside staging, else kSwap.
  enum class Keep { kAuto, kArea, kSwap, kNone } keep_previous = Keep::kAuto;
};

// What Commit returns on an engine rank (zeros on a trainer rank).
struct CommitReport {
  uint64_t version = 0;
  int64_t bytes = 0;          // copied from staging into the live parameters
  double stall_seconds = 0;   // Commit's call to return: the agreement and the copy
  double copy_seconds = 0;    // the copy alone
  std::string keep_previous;  // "area", "swap" or "none": how a rollback restores
};

// What a trainer rank hands over, stored row-major with `region`'s extents as its shape. Either
// its shard of one HF tensor (`hf_name`, `region` of the HF tensor: FSDP / HSDP / replicate /
// single), or one of its local parameters (`local` non-empty: Megatron-Core trainers, whose
// parameters are not slabs of HF tensors). A local parameter is named as the rank's trainer map
// names it (BuildTrainerParams, `Plan.trainer_params(rank)`): Megatron's local name inside model
// chunk `chunk` ("decoder.layers.0.self_attention.linear_qkv.weight"); for FSDP-like layouts the
// HF name with chunk 0. Its `region` is the whole parameter, Region::Full(local shape);
// `hf_name` is unused. Elements no trainer-map piece covers (padded vocab rows) are never read.
struct SourceBinding {
  std::string hf_name;
  const void* data = nullptr;
  DType dtype = DType::kF32;
  Region region;
  MemKind mem = MemKind::kHost;
  int device = -1;
  std::string local = {};  // local parameter name (empty: an HF shard)
  int chunk = 0;           // its model chunk (virtual pipeline stage; 0 without VPP)
};

// An engine rank's parameter, row-major.
struct DestBinding {
  std::string name;  // engine name ("model.layers.3.self_attn.qkv_proj.weight")
  void* data = nullptr;
  DType dtype = DType::kBF16;
  Shape shape;
  MemKind mem = MemKind::kHost;
  int device = -1;
};

// The delta encoding's figures of one sync (PlanOptions::encoding delta / auto, host path;
// docs/delta.md). A sender counts the buckets it sent, a receiver the buckets it landed; all
// zero under encoding full. `changed` / `elements` is the delta density of the buckets compared.
struct DeltaSyncStats {
  int64_t wire_bytes = 0;     // bytes the buckets took on the wire (delta forms or whole)
  int64_t full_bytes = 0;     // the same buckets whole
  int64_t changed = 0;        // wire elements that changed since the base (compared buckets)
  int64_t elements = 0;       // wire elements compared
  int64_t buckets_delta = 0;  // sent / applied as deltas
  int64_t buckets_full = 0;   // sent / landed whole, for any of the reasons below
  // Why a bucket went whole. Fallbacks (the receiver's base is not the image the sender kept):
  int64_t fallback_no_image = 0;  // the sender kept no image (its first sync of the bucket)
  int64_t fallback_version = 0;   // the receiver's base is of another version (a failed or
                                  // uncommitted sync, a rollback, a re-created engine)
  int64_t fallback_checksum = 0;  // same version, other bytes (a corrupted or restored base)
  // Decisions: the delta was not smaller (delta.h's size rule), or did not pay at the link speed
  // (encoding auto: EstimateDeltaCost at SHARDSYNC_DELTA_LINK_MBPS).
  int64_t full_by_size = 0;
  int64_t full_by_cost = 0;
  // Encoding auto where no delta can pay at the knobs' speeds (DeltaCanPay): the rank ran its
  // host path / pairs as encoding full, every bucket whole without the delta steps.
  int64_t full_by_auto = 0;
  double encode_seconds = 0;  // sender: packing the image aside, diffing, encoding
  double decode_seconds = 0;  // receiver: base read, checks, decode and landing
  // This rank's first fallback in words ("to sync rank 3, bucket 0: base checksum differs ...");
  // local only (not in other ranks' copies of the report).
  std::string first_fallback;
  // Host memory this rank's delta steps hold after the sync, beyond encoding full's path (local
  // only, like first_fallback; docs/delta.md "Memory and cost"). A trainer rank: its kept images
  // plus its staging (a 1 MiB chunk, or one slot of its largest bucket: delta_send.h). An engine
  // rank: the resident bytes of its receive slots (whole buckets land in place, so only the deltas'
  // payloads, at most the largest per slot), measured with mincore; an image codec (block FP8) adds
  // the images it rebuilt for its advertisement.
  int64_t held_bytes = 0;
  int64_t fallbacks() const { return fallback_no_image + fallback_version + fallback_checksum; }
  void Add(const DeltaSyncStats& o);
};

// What one rank posts after a sync; gathered into every rank's SyncReport.
struct RankSyncStats {
  int rank = 0;
  bool ok = false;
  std::string error;
  int64_t send_bytes = 0;
  int64_t recv_bytes = 0;
  double seconds = 0;
  int64_t checksums_ok = 0;
  int64_t checksums_total = 0;
  DeltaSyncStats delta;
};

// One report per sync, identical on every rank (except `local`).
struct SyncReport {
  uint64_t version = 0;
  int64_t bytes = 0;   // bytes landed in engine parameters, job-wide
  double seconds = 0;  // the slowest rank's sync time
  double gbps = 0;     // bytes / seconds / 1e9
  int slowest_rank = -1;
  int64_t checksums_ok = 0;
  int64_t checksums_total = 0;
  RankSyncStats local;
  std::vector<RankSyncStats> ranks;  // by sync rank
  // The senders' delta figures summed (what crossed the wire); zero under encoding full.
  DeltaSyncStats delta;
};

// Largest version Sync accepts: versions are 1 .. 2^63 - 1 (InvalidArgument naming the version
// above it), so a version meant as "last" (2^64 - 1) cannot block every later one and a version
// fits a signed 64-bit integer (JSON, Python, torch) on every rank.
inline constexpr uint64_t kMaxSyncVersion = (uint64_t{1} << 63) - 1;

class SyncSession {
 public:
  // `store` and `transport` must outlive the session. Fails on an invalid rank or plan.
  static Result<std::unique_ptr<SyncSession>> Create(const PlanInputs& inputs, int rank,
                                                     StoreClient& store, Transport& transport,
                                                     SessionOptions options = {});
  virtual ~SyncSession() = default;

  virtual int rank() const = 0;
  virtual bool is_trainer() const = 0;
  // The launch id this session uses ("" for none): SessionOptions::job_id or the environment's.
  virtual const std::string& job_id() const = 0;
  virtual const RankPlan& plan() const = 0;

  // Trainer ranks: one binding per HF tensor the rank holds (region must equal
  // TrainerHeldRegion, dtype the plan's trainer dtype), or one per local parameter
  // (SourceBinding::local; Megatron trainers bind only these: shape and dtype as
  // ExpectedSources says). Checked fully at Connect: every tensor or local parameter the plan
  // reads must be bound.
  virtual Status BindSource(const SourceBinding& b) = 0;
  // Engine ranks: one binding per parameter of this engine rank (shape as the shard map says,
  // dtype equal to the wire dtype so bytes land without a copy). Checked fully at Connect.
  virtual Status BindDest(const DestBinding& b) = 0;
  // A failed BindSource / BindDest ends this rank before connect, and so does this call (for an
  // error of the caller's own, e.g. an exception in the framework code that prepares the
  // tensors): the rank's presence key (created with the session) is marked dead with `why`, and
  // every peer waiting at Connect fails at once naming this rank and `why`. No-op once connected.
  virtual void FailBeforeConnect(const std::string& why) = 0;
  // This rank will not run sync `version`: a check of the caller's own failed before it (e.g. a
  // bound tensor whose memory moved). Every peer in or entering that sync fails at once with
  // Aborted naming this rank and `why`, instead of at its sync timeout; the version is spent (as
  // any failed one). Before Connect: FailBeforeConnect.
  virtual void FailSync(uint64_t version, const std::string& why) = 0;
  // The engine parameters this rank must bind (empty for trainer ranks).
  virtual const std::vector<EngineParam>& ExpectedParams() const = 0;
  // Trainer ranks: the local parameters this rank holds (its trainer map, BuildTrainerParams:
  // name, chunk, local shape, dtype and the HF bytes each holds); empty for engine ranks.
  virtual const std::vector<TrainerParam>& ExpectedSources() const = 0;

  // Collective over the sync world: publishes this rank's plan hash and checks every other
  // rank's (FailedPrecondition naming both hashes and the rank), checks the bindings against the
  // plan, registers receive memory once and connects the transport.
  virtual Status Connect() = 0;

  // Replays the plan for `version`, which must exceed every version this rank attempted before
  // (a failed version is not retried: use a newer one) and equal every peer's. Returns the
  // job-wide report, or the first error seen anywhere. A refused version (stale, 0 or above
  // kMaxSyncVersion: InvalidArgument) touches nothing.
  virtual Result<SyncReport> Sync(uint64_t version) = 0;

  // True while a receiver's parameters may hold a partial or unverified sync. Staged commit:
  // the live parameters (a failed sync poisons only staging; a commit that failed after its copy
  // and could not roll back poisons them).
  virtual bool IsPoisoned() const = 0;
  virtual uint64_t last_good_version() const = 0;

  // ---- Staged commit (SessionOptions::commit kStaged) ----
  // Bytes of the staging area this engine rank needs (its parameters as bound), known from the
  // plan before anything is bound; 0 on trainer ranks. Connect refuses (FailedPrecondition naming
  // the rank, the bytes and the free bytes) when they do not fit the packer's free memory.
  virtual int64_t staging_bytes() const = 0;
  // Collective over the engine ranks of SessionOptions::commit_scope (the engine is paused):
  // once every one of them verified `version` (the last successful Sync) and is in Commit, each
  // copies its staging into its live parameters, then all agree it was done. A rank that cannot
  // commit (it did not verify `version`, its copy failed, it is gone or late past sync_timeout)
  // makes every other rank of the scope fail and roll back to the version they served (when
  // they already copied: keep_previous kArea / kSwap; kNone leaves them poisoned). No-op on
  // trainer ranks.
  virtual Result<CommitReport> Commit(uint64_t version) = 0;
  // Engine ranks, local: restores the version committed before the last commit, bit for bit
  // (keep_previous kArea / kSwap). Available from a commit until the next sync replaces what was
  // kept (kArea: the next verified sync; kSwap: the next sync); FailedPrecondition otherwise.
  // No-op on the trainer ranks of a staged session.
  virtual Status Rollback() = 0;
  // The version the live parameters hold (0: whatever they held before the first commit).
  // In-place sessions: last_good_version().
  virtual uint64_t committed_version() const = 0;
  // How Rollback restores ("area", "swap", "none"; "" before Connect or in place).
  virtual std::string keep_previous() const = 0;
};

// Bytes of the staging area engine sync rank `rank` needs under a staged commit: its parameters
// in the dtypes it binds them (the wire dtype; block-FP8 weights and scales in theirs), from the
// plan alone; 0 for trainer ranks. SyncSession::staging_bytes says the same once created.
Result<int64_t> StagingBytes(const PlanInputs& inputs, int rank);

// For a launcher that saw sync rank `rank` of launch `job_id` (its SHARDSYNC_JOB_ID) exit: every
// rank of that launch waiting on it at Connect or in a Sync fails within about a second, naming it
// with `reason` ("(pid 1234) exited (killed by signal 9)"), instead of at its timeout. Returns
// whether the launch's job was already claimed on `prefix` (its ranks inside it were told); until
// then only ranks waiting for the claim are, so call it again while the job runs.
Result<bool> MarkSyncRankDead(StoreClient& store, const std::string& prefix,
                              const std::string& job_id, int rank, std::string_view reason);

}  // namespace shardsync
