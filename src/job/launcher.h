// The rank program behind `shardsync run` (a trainer rank fills its shards with synthetic weights
// and sends; an engine rank allocates its parameters, receives, and checks every element against
// the synthetic HF values), and a local launcher that runs one job on this host: one process (or
// thread, for the in-process loopback transport) per sync rank around an in-process store.
// `demo` and `bench` are thin renderings of RunLocalJob. Internal to the job layer and the CLI: a
// library user calls session.h, not this.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shardsync/plan.h"
#include "shardsync/session.h"
#include "shardsync/status.h"
#include "shardsync/store.h"

namespace shardsync {

enum class JobMode { kSync, kBench };

// Everything that defines a job; every rank of a job gets the same JobSpec.
struct JobSpec {
  PlanInputs inputs;
  uint64_t seed = 1;                   // synthetic weights
  int syncs = 1;                       // sync mode: versions 1..syncs
  std::string transport = "loopback";  // "ucx" | "loopback" (in-process only)
  Millis timeout{60000};               // per connect / per sync
  // Bound of the wait for every rank's setup (allocation and synthetic fill) before connect
  // (job_internal::SetupBarrier): setup is not counted in `timeout`.
  Millis setup_timeout{900000};
  JobMode mode = JobMode::kSync;
  int bench_warmup = 1;
  int bench_reps = 5;
  // bench: the fraction of trainer elements changed before each sharded sync after the first
  // (every 1/fraction-th element of the trainer's weights, scaled by a small step alternating per
  // sync: job_internal::BenchUpdateFactor), restored before the last, so the delta encoding has
  // small updates to send and the element check holds.
  double bench_update = 0;
  bool verify = true;          // engine ranks check every element after the last sync
  std::string prefix = "ss/";  // store key namespace
  // The launch identity the ranks' sessions use (SessionOptions::job_id / job_secret); empty:
  // the environment's (a `shardsync run` child's). The in-process launcher draws one.
  LaunchId launch;
  // Engine ranks write the parameters they received (after the last sync) as
  // <dump_dir>/rank-<sync rank>.safetensors (refengine's WriteEngineDump); empty: no dump.
  std::string dump_dir;
  // "cuda": shards and parameters in GPU memory, bound as they are (the CUDA packer, prepared
  // cuda_ipc / nccl pairs over the routed transport; `transport` is then the routing hint, "auto"
  // for none). Trainer t on GPU t % gpus, engine rank j of a replica's T*P on GPU (d*T*P + j) %
  // gpus, as SGLang / vLLM place them; gpus 0: every visible GPU.
  std::string device = "cpu";
  int gpus = 0;
  // Staged commit (session.h SessionOptions): engine ranks land each sync in staging and commit
  // it after the job-wide verdict (`run` / `demo`: every sync; `bench`: the timed stall).
  SessionOptions::Commit commit = SessionOptions::Commit::kInPlace;
  std::optional<MemKind> staging;
  SessionOptions::Scope commit_scope = SessionOptions::Scope::kJob;
  SessionOptions::Keep keep_previous = SessionOptions::Keep::kAuto;
  bool staged() const { return commit == SessionOptions::Commit::kStaged; }
};
// The job's commit options on a session's options.
void ApplyCommitOptions(const JobSpec& job, SessionOptions& opt);

// The job flags shared by `run`, `demo` and `bench`, as typed.
struct JobFlags {
  std::string model = "qwen2.5-0.5b";  // embedded name or config.json path
  std::string trainer = "fsdp=4";
  std::string rollout = "dp=1,tp=2,pp=2";
  std::string engine = "sglang";
  std::string pp_partition;  // "7,8,9" (empty: the engine's rule)
  std::string wire_dtype = "bf16";
  std::string trainer_dtype = "fp32";
  double bucket_mb = 512;
  int64_t bucket_bytes = 0;  // exact, overrides bucket_mb when > 0
  uint64_t seed = 1;
  int syncs = 1;
  std::string transport = "auto";  // auto: see JobSpecFromFlags
  int64_t timeout_ms = 60000;
  // timeout_ms scaled to the job when every rank runs on this host (JobSpecFromFlags' all_local):
  // times the ranks per CPU core, since they share the cores. The CLI sets it unless
  // --timeout-ms was given.
  bool timeout_auto = false;
  int64_t setup_timeout_s = 900;
  std::string mode = "sync";
  int warmup = 1;
  int reps = 5;
  double update_fraction = 0;  // JobSpec::bench_update
  bool no_verify = false;
  std::string prefix = "ss/";
  std::string dump_dir;
  std::string device = "cpu";  // cpu | cuda
  int gpus = 0;
  // Engine weights: "fp8-block128" (block FP8, overriding the config's quantization_config),
  // "none" (the model dtype, dropping it), "" (as the config says).
  std::string quant;
  // Block FP8: blocks whose rows straddle trainer ranks, "amax" (exchanged amax, the default) or
  // "stage" (PlanOptions::fp8_split).
  std::string fp8_split = "amax";
  // How host buckets travel each sync: "full", "delta" or "auto" (PlanOptions::encoding).
  std::string encoding = "full";
  std::string commit = "inplace";      // inplace | staged
  std::string staging = "auto";        // auto (the parameters' memory) | device | host
  std::string commit_scope = "job";    // job | replica
  std::string keep_previous = "auto";  // auto | area | swap | none
};
// Validates and resolves the flags; errors name the flag. --transport auto resolves to "shm"
// when every rank runs on this host (`all_local`: demo, bench), else to DefaultTransport().
Result<JobSpec> JobSpecFromFlags(const JobFlags& flags, bool all_local = false);
// "ucx" when this build has it, else "loopback".
std::string DefaultTransport();

// Same flag set for `run`, `demo`, `bench`: the arguments that reproduce `job` on a child
// process (`shardsync run ...`).
std::vector<std::string> JobSpecToArgs(const JobSpec& job);

// Bench mode, one rank: this rank's seconds per measured repetition of each variant, from the
// store barrier that starts the repetition to this rank's end.
struct BenchNumbers {
  // raw: the transport's ceiling (host) or cudaMemcpy of the same bytes (device); raw_nccl
  // (device): NCCL send / recv of every nccl pair's bytes with the session's communicators.
  std::vector<double> sharded, broadcast, raw, raw_nccl;
  // --commit staged: per repetition this rank's commit stall (commit call to return, all engine
  // ranks starting together), and a cudaMemcpy / memcpy of this rank's parameter bytes, all
  // engine ranks together (the copy a commit cannot beat).
  std::vector<double> stall, commit_raw;
  std::vector<double> commit_copy;  // the copy inside each commit (stall less the agreement)
  // --device cuda --commit staged: a decode-like loop on engine ranks (a pass reading every
  // live parameter), its median step in ms while idle, during the transfer, during the commit.
  double decode_idle_ms = 0, decode_transfer_ms = 0, decode_commit_ms = 0;
  int64_t bytes = 0;      // bytes landed in engine parameters per repetition (engine ranks)
  bool verified = false;  // engine ranks: every element right after the sharded and broadcast runs
};

// One rank's outcome.
struct RankResult {
  int rank = 0;
  bool is_trainer = false;
  int replica = -1, tp_rank = -1, pp_rank = -1, trainer_rank = -1;
  bool ok = false;
  std::string error;
  SyncReport report;  // of the last sync
  int64_t elements_checked = 0;
  int64_t element_mismatches = 0;
  std::string first_mismatch;  // parameter and element of the first mismatch
  int64_t peak_rss_bytes = 0;
  bool poisoned = false;     // engine ranks: parameters not verified by a successful sync
  double setup_seconds = 0;  // allocate + synthetic fill
  BenchNumbers bench;        // bench mode: per rank timings (the job result takes the max)
  int device = -1;           // --device cuda: this rank's GPU
  std::string routes;        // "dst:transport ..." of the pairs this rank sends on
  std::string host_id;       // its host identity (HostIdentity; processes mode)
  // Staged commit (engine ranks): the last sync's transfer, the last commit's stall (commit call
  // to return) and this rank's staging bytes; the version its live parameters hold, their hash
  // when it was committed, and after a failure whether they still hash the same.
  double transfer_seconds = 0;
  double stall_seconds = 0;
  int64_t staging_bytes = 0;
  uint64_t committed_version = 0;
  std::string keep_previous;
  std::string live_hash;        // after the last commit (hex)
  std::string live_hash_after;  // when the rank ended (hex; staged engine ranks)
  bool live_intact = true;      // live_hash_after == live_hash
  std::string failed_in;        // "sync" | "commit" | "" (a staged rank's failure)
};
std::string RankResultToJson(const RankResult& r);
Result<RankResult> RankResultFromJson(const std::string& text);

// Called at milestones (allocated, connected, each sync, verified) so launchers can show
// progress; RankSteps(job) milestones per rank.
using ProgressFn = std::function<void()>;
int RankSteps(const JobSpec& job);

// Runs one rank of `job` on an already connected store and an unconnected transport. The error
// of a failed sync is returned in RankResult (ok=false), not as a Status: the rank still reports.
Result<RankResult> RunRank(const JobSpec& job, int rank, StoreClient& store, Transport& transport,
                           const ProgressFn& progress = nullptr);

// Entry point of `shardsync run`: reads the launch contract, connects to the store, creates the
// transport, runs the rank, posts its RankResult JSON under "result/<rank>" and returns it.
Result<RankResult> RunRankProcess(const JobSpec& job, const LaunchEnv& env);

struct LocalJobOptions {
  JobSpec job;
  // Processes (fork + exec of `exe run ...`, required for UCX) or threads in this process
  // (loopback). Default: threads for loopback, processes otherwise.
  enum class Mode { kAuto, kProcesses, kThreads } mode = Mode::kAuto;
  std::string exe = "/proc/self/exe";
  Millis job_timeout{300000};  // the whole job; every child is killed past it
  // Called from the launcher thread with (milestones done, milestones total).
  std::function<void(int, int)> on_progress;
  // Fault injection (processes mode): SIGKILL sync rank `kill_rank` once the job reached
  // `kill_at_progress` milestones (RankSteps per rank: allocated, connected, each sync,
  // verified). The other ranks must then fail on their own within their timeout.
  int kill_rank = -1;
  int kill_at_progress = 0;
  // Where each rank's stderr is kept while it runs (processes mode; "" = /tmp). A caller that
  // removes its own temporary directory on SIGINT / SIGTERM puts them there.
  std::string log_dir;
  // Each rank process its own node (job_internal::EmulateNode): cross-node paths on one machine,
  // nccl over NCCL's socket transport for --device cuda, UCX without shared memory for host
  // memory. CheckEmulateNodes says where it applies.
  bool emulate_nodes = false;
};

// Where LocalJobOptions::emulate_nodes applies: rank processes (not threads) whose transport
// routes by host identity, i.e. --device cuda (the router: nccl between nodes) or host memory
// over ucx; shm (one host's shared memory) and loopback (one process) cannot cross nodes.
// InvalidArgument naming --emulate-nodes otherwise. `mode` kAuto: as RunLocalJob resolves it.
Status CheckEmulateNodes(const JobSpec& job, LocalJobOptions::Mode mode);

struct LocalJobResult {
  std::vector<RankResult> ranks;  // by sync rank
  std::string store_address;
  bool ok() const;
  // The first failing rank's error that is not an echo of another's (an abort, a peer gone).
  std::string FirstError() const;
  // Every failing rank on its own line with its last error, root causes before echoes; "" when
  // every rank succeeded. What the launchers print.
  std::string FailureReport() const;
};

// The job-wide bench figures: per repetition the slowest rank's time, then the median.
struct BenchSummary {
  int64_t bytes = 0;  // landed in engine parameters per repetition, job-wide
  double sharded_seconds = 0, broadcast_seconds = 0, raw_seconds = 0;
  double sharded_gbps = 0, broadcast_gbps = 0, raw_transport_gbps = 0;
  double ratio_to_raw = 0;          // sharded_gbps / raw_transport_gbps
  double raw_nccl_seconds = 0;      // device: NCCL send / recv of the nccl pairs (0: none)
  double ratio_to_raw_nccl = 0;     // raw_nccl_seconds / sharded_seconds (0: no nccl pair)
  double speedup_vs_broadcast = 0;  // broadcast_seconds / sharded_seconds
  // --commit staged: the commit's stall (slowest engine rank per repetition, median) and the
  // copy of every engine rank's parameter bytes at once (memcpy / cudaMemcpy), the same way.
  double stall_seconds = 0, commit_raw_seconds = 0;
  double commit_copy_seconds = 0;  // the copy inside the commit, the same way
  bool verified = false;
};
struct LocalJobResult;
Result<BenchSummary> SummarizeBench(const LocalJobResult& job);

// Runs the whole job on this host. Never leaves a child behind: on failure or timeout every
// child still running is killed and reaped. A rank's own failure is in its RankResult (a child
// that died without posting one gets ok=false and how it ended); a Status error means the job
// could not run (launch failure, or the job timeout).
Result<LocalJobResult> RunLocalJob(const LocalJobOptions& options);

}  // namespace shardsync
