// `shardsync run`: one sync rank of a job, for launchers (torchrun, SLURM, Ray, the local
// launcher behind `demo` / `bench`). Prints the rank's result as one JSON line on stdout.
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "command.h"
#include "job/launcher.h"
#include "shardsync/plan.h"
#include "shardsync/settings.h"

namespace shardsync::cli {

// The job flags shared by run / demo / bench (declared in the other command files).
void AddJobFlags(CLI::App* sub, JobFlags* f) {
  sub->add_option("--model", f->model, "Embedded model name or config.json path")
      ->capture_default_str();
  sub->add_option("--trainer", f->trainer,
                  "Trainer layout: fsdp=S | hsdp=RxS | replicate=N | single | "
                  "megatron=tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,cp=C][,dp=D][,...] "
                  "(docs/megatron.md)")
      ->capture_default_str();
  sub->add_option("--rollout", f->rollout, "Rollout layout: dp=D,tp=T,pp=P[,ep=E]")
      ->capture_default_str();
  sub->add_option("--engine", f->engine, "Engine convention: sglang | vllm")->capture_default_str();
  sub->add_option("--pp-partition", f->pp_partition, "Layers per PP stage, e.g. 7,8,9");
  sub->add_option("--wire-dtype", f->wire_dtype, "Dtype on the wire and in engine parameters")
      ->capture_default_str();
  sub->add_option("--trainer-dtype", f->trainer_dtype, "Dtype of the trainer's shards")
      ->capture_default_str();
  sub->add_option(
         "--bucket-mb", f->bucket_mb,
         "Bucket cap in MiB (the unit of checksums and completion; host senders stage through a "
         "3 MiB ring, device packers hold 2 buckets)")
      ->capture_default_str();
  sub->add_option("--bucket-bytes", f->bucket_bytes, "Bucket cap in bytes (overrides --bucket-mb)");
  sub->add_option("--seed", f->seed, "Seed of the synthetic weights")
      ->check(NonNegativeInteger())
      ->capture_default_str();
  sub->add_option("--syncs", f->syncs, "Number of syncs (versions 1..N)")->capture_default_str();
  sub->add_option("--transport", f->transport,
                  "ucx | shm | loopback | cuda_ipc | nccl | auto (demo, bench: shm, every rank is "
                  "on this host; run: ucx; --device cuda: per pair, cuda_ipc on one node, nccl "
                  "across)")
      ->capture_default_str();
  f->timeout_auto = true;  // until --timeout-ms is given
  sub->add_option("--timeout-ms", f->timeout_ms,
                  "Timeout of connect and of every sync (each rank's setup is not counted); "
                  "demo and bench, whose ranks all run here, multiply the default by the ranks "
                  "per CPU core")
      ->capture_default_str()
      ->each([f](const std::string&) { f->timeout_auto = false; });
  sub->add_option("--setup-timeout-s", f->setup_timeout_s,
                  "How long ranks wait for every rank to allocate and fill its weights before "
                  "they connect")
      ->capture_default_str();
  sub->add_option("--mode", f->mode, "sync | bench")->capture_default_str();
  sub->add_option("--warmup", f->warmup, "Bench warm-up repetitions")->capture_default_str();
  sub->add_option("--reps", f->reps, "Bench measured repetitions (median)")->capture_default_str();
  sub->add_option("--update-fraction", f->update_fraction,
                  "Bench: the fraction of trainer elements changed before each "
                  "sync after the first, each scaled by 1 - 2^-6 or 1 - 2^-5 (alternating: a small "
                  "step, as an optimizer's; restored before the last, so the element check holds): "
                  "small updates for --encoding delta; 0 sends the same weights every sync")
      ->capture_default_str();
  sub->add_flag("--no-verify", f->no_verify, "Skip the element-by-element check");
  sub->add_option("--prefix", f->prefix, "Store key namespace of the job")->capture_default_str();
  sub->add_option("--dump-dir", f->dump_dir,
                  "Engine ranks write their received parameters to DIR/rank-<R>.safetensors");
  sub->add_option("--device", f->device,
                  "cpu (host memory) | cuda (GPU memory: the CUDA packer and prepared "
                  "cuda_ipc / nccl pairs; --transport is then the routing hint)")
      ->capture_default_str();
  sub->add_option("--gpus", f->gpus, "--device cuda: GPUs to place ranks on (0: all visible)")
      ->capture_default_str();
  sub->add_option("--quant", f->quant,
                  "Engine weights: fp8-block128 (block FP8, quantized at sync time; overrides the "
                  "config's quantization_config) | none (the model dtype; drops it)");
  sub->add_option("--commit", f->commit,
                  "inplace (bytes land in the live parameters; the engine must be idle for the "
                  "whole transfer) | staged (they land in staging while the engine serves; a "
                  "verified version is copied in by a short commit)")
      ->capture_default_str();
  sub->add_option("--staging", f->staging,
                  "--commit staged: auto (the parameters' memory) | device | host")
      ->capture_default_str();
  sub->add_option("--commit-scope", f->commit_scope,
                  "--commit staged: engine ranks that commit together: job | replica")
      ->capture_default_str();
  sub->add_option("--keep-previous", f->keep_previous,
                  "--commit staged, how a rollback restores: auto (area when it fits, else "
                  "swap) | area (a second copy, made while the engine serves) | swap (the "
                  "commit exchanges staging and parameters) | none")
      ->capture_default_str();
  sub->add_option("--encoding", f->encoding,
                  "How buckets travel each sync (host path, cuda_ipc and nccl pairs; bf16 and "
                  "block FP8, in place or staged): full (whole) | delta (only the wire elements "
                  "changed since the receiver's verified base, whole where the base differs: "
                  "docs/delta.md) | auto (delta where it pays over each pair's link at the delta "
                  "knobs' speeds, docs/environment.md; full where none can)")
      ->capture_default_str();
  sub->add_option("--fp8-split", f->fp8_split,
                  "Block FP8, blocks whose rows straddle FSDP trainer ranks: amax (their holders "
                  "exchange the block's amax, e4m3 on the wire; host path and cuda_ipc) | stage "
                  "(raw rows to a receiver staging buffer) (docs/fp8.md)")
      ->capture_default_str();
}

namespace {

struct RunFlags {
  JobFlags job;
  std::string role;
  std::optional<int> rank;
  std::optional<int> world_size;
  std::string store;
  std::string token;
  bool json = false;  // the output is JSON either way
};

int Run(const RunFlags& f) {
  auto job = JobSpecFromFlags(f.job);
  if (!job.ok()) return ReportError(job.status());
  // Flags override the launch contract's environment variables.
  const EnvLookup& process = ProcessEnvironment();
  auto lookup = [&](const std::string& name) -> std::optional<std::string> {
    if (name == "RANK" && f.rank) return std::to_string(*f.rank);
    if (name == "WORLD_SIZE" && f.world_size) return std::to_string(*f.world_size);
    if (name == "WORLD_SIZE" && !process("WORLD_SIZE") && !process("SLURM_NTASKS")) {
      return std::to_string(SyncWorldSize(job->inputs));  // implied by the plan flags
    }
    if (name == "SHARDSYNC_STORE" && !f.store.empty()) return f.store;
    if (name == "SHARDSYNC_TOKEN" && !f.token.empty()) return f.token;
    return process(name);
  };
  auto env = LaunchEnvFromLookup(lookup);
  if (!env.ok()) return ReportError(env.status());
  auto who = DescribeSyncRank(job->inputs, env->rank);
  if (!who.ok()) return ReportError(who.status());
  const std::string role = who->is_trainer ? "trainer" : "engine";
  if (f.role != role) {
    return ReportError(InvalidArgumentError("--role " + f.role + ": sync rank " +
                                            std::to_string(env->rank) + " is a " + role +
                                            " rank in this job"));
  }
  auto r = RunRankProcess(*job, *env);
  if (!r.ok()) return ReportError(r.status());
  std::printf("%s\n", RankResultToJson(*r).c_str());
  if (!r->ok) {
    std::fprintf(stderr, "shardsync: sync rank %d: %s\n", r->rank, r->error.c_str());
    return kExitFailure;
  }
  return kExitOk;
}

Registration reg({"run", [](CLI::App& app) {
                    auto f = std::make_shared<RunFlags>();
                    auto* sub = app.add_subcommand(
                        "run",
                        "Run one sync rank (trainer or engine) of a job; reads SHARDSYNC_STORE, "
                        "RANK, WORLD_SIZE, SHARDSYNC_TOKEN (flags override)");
                    sub->add_option("--role", f->role, "trainer | engine")
                        ->required()
                        ->check(CLI::IsMember({"trainer", "engine"}));
                    sub->add_option("--rank", f->rank, "Sync rank (else RANK)");
                    sub->add_option("--world-size", f->world_size,
                                    "Sync world size (else WORLD_SIZE, else implied by the plan)");
                    sub->add_option("--store", f->store, "Store host:port (else SHARDSYNC_STORE)");
                    sub->add_option("--token", f->token, "Store token (else SHARDSYNC_TOKEN)");
                    // run's result is one JSON line either way (launchers parse it); the flag is
                    // accepted so that every command that prints a result takes --json.
                    sub->add_flag("--json", f->json,
                                  "Print the rank's result as one JSON line (the default)");
                    AddJobFlags(sub, &f->job);
                    return [f] { return Run(*f); };
                  }});

}  // namespace
}  // namespace shardsync::cli
