// A job's flags, arguments and results as text: JobSpecFromFlags (validation, errors name the
// flag), the arguments that reproduce a job in a child process, and RankResult as JSON.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/gpu.h"
#include "shardsync/transport.h"

namespace shardsync {

namespace {

std::string_view KeepName(SessionOptions::Keep k) {
  switch (k) {
    case SessionOptions::Keep::kArea:
      return "area";
    case SessionOptions::Keep::kSwap:
      return "swap";
    case SessionOptions::Keep::kNone:
      return "none";
    default:
      return "auto";
  }
}

// --commit, --staging, --commit-scope, --keep-previous.
Status CommitFromFlags(const JobFlags& f, JobSpec& job) {
  if (f.commit == "staged") {
    job.commit = SessionOptions::Commit::kStaged;
  } else if (f.commit != "inplace") {
    return InvalidArgumentError("--commit: '" + f.commit + "', expected inplace or staged");
  }
  const bool staged = job.staged();
  auto staged_only = [&](const char* flag, bool set) -> Status {
    if (set && !staged) {
      return InvalidArgumentError(std::string(flag) + ": only with --commit staged");
    }
    return OkStatus();
  };
  if (f.staging == "device") {
    job.staging = MemKind::kCuda;
  } else if (f.staging == "host") {
    job.staging = MemKind::kHost;
  } else if (f.staging != "auto") {
    return InvalidArgumentError("--staging: '" + f.staging + "', expected auto, device or host");
  }
  SS_RETURN_IF_ERROR(staged_only("--staging", f.staging != "auto"));
  // The transports land where the parameters are (session.h SessionOptions::staging).
  if (job.staging && (*job.staging == MemKind::kCuda) != (job.device == "cuda")) {
    return InvalidArgumentError(
        "--staging " + f.staging + ": the engine parameters are in " +
        (job.device == "cuda" ? "device" : "host") + " memory (--device " + job.device +
        ") and the transports land only there; staging must be in the same memory");
  }
  if (f.commit_scope == "replica") {
    job.commit_scope = SessionOptions::Scope::kReplica;
  } else if (f.commit_scope != "job") {
    return InvalidArgumentError("--commit-scope: '" + f.commit_scope +
                                "', expected job or replica");
  }
  SS_RETURN_IF_ERROR(staged_only("--commit-scope", f.commit_scope != "job"));
  const std::pair<const char*, SessionOptions::Keep> keeps[] = {
      {"auto", SessionOptions::Keep::kAuto},
      {"area", SessionOptions::Keep::kArea},
      {"swap", SessionOptions::Keep::kSwap},
      {"none", SessionOptions::Keep::kNone}};
  bool known = false;
  for (const auto& [name, k] : keeps) {
    if (f.keep_previous == name) {
      job.keep_previous = k;
      known = true;
    }
  }
  if (!known) {
    return InvalidArgumentError("--keep-previous: '" + f.keep_previous +
                                "', expected auto, area, swap or none");
  }
  return staged_only("--keep-previous", f.keep_previous != "auto");
}

}  // namespace

void ApplyCommitOptions(const JobSpec& job, SessionOptions& opt) {
  opt.commit = job.commit;
  opt.staging = job.staging;
  opt.commit_scope = job.commit_scope;
  opt.keep_previous = job.keep_previous;
}

std::vector<std::string> JobSpecToArgs(const JobSpec& job) {
  const PlanInputs& in = job.inputs;
  const ShardSpec& sh = in.rollout.shard;
  std::string rollout = "dp=" + std::to_string(in.rollout.dp) + ",tp=" + std::to_string(sh.tp) +
                        ",pp=" + std::to_string(sh.pp);
  if (sh.ep != 1) rollout += ",ep=" + std::to_string(sh.ep);
  std::vector<std::string> a = {
      "--model",         in.model.name,
      "--trainer",       in.trainer.ToString(),
      "--rollout",       rollout,
      "--engine",        std::string(EngineKindName(sh.engine)),
      "--wire-dtype",    std::string(DTypeName(in.options.wire_dtype)),
      "--trainer-dtype", std::string(DTypeName(in.trainer_dtype)),
      "--bucket-bytes",  std::to_string(in.options.bucket_bytes),
      "--seed",          std::to_string(job.seed),
      "--syncs",         std::to_string(job.syncs),
      "--transport",     job.transport,
      "--timeout-ms",    std::to_string(job.timeout.count()),
      "--mode",          job.mode == JobMode::kBench ? "bench" : "sync",
      "--warmup",        std::to_string(job.bench_warmup),
      "--reps",          std::to_string(job.bench_reps),
      "--prefix",        job.prefix,
  };
  if (job.bench_update > 0) {
    char u[32];
    snprintf(u, sizeof(u), "%.17g", job.bench_update);
    a.push_back("--update-fraction");
    a.push_back(u);
  }
  a.push_back("--setup-timeout-s");
  a.push_back(std::to_string(job.setup_timeout.count() / 1000));
  if (!sh.pp_partition.empty()) {
    std::string p;
    for (size_t i = 0; i < sh.pp_partition.size(); ++i) {
      if (i) p += ',';  // not `"," + to_string(...)`: GCC 12 -Wrestrict false positive
      p += std::to_string(sh.pp_partition[i]);
    }
    a.push_back("--pp-partition");
    a.push_back(p);
  }
  if (job.device != "cpu") {
    a.push_back("--device");
    a.push_back(job.device);
    a.push_back("--gpus");
    a.push_back(std::to_string(job.gpus));
  }
  // The child re-reads config.json: say what the engine weights are either way, so a flag that
  // overrode or dropped a quantization_config reaches it.
  if (!in.model.quant || in.model.quant->origin == "--quant") {
    a.push_back("--quant");
    a.push_back(in.model.quant ? "fp8-block128" : "none");
  }
  if (in.options.encoding != WireEncoding::kFull) {
    a.push_back("--encoding");
    a.push_back(std::string(WireEncodingName(in.options.encoding)));
  }
  if (in.model.quant) {
    a.push_back("--fp8-split");
    a.push_back(std::string(EncodingName(in.options.straddle)));  // --fp8-split: amax | stage
  }
  if (job.staged()) {
    a.insert(a.end(), {"--commit", "staged", "--commit-scope",
                       job.commit_scope == SessionOptions::Scope::kJob ? "job" : "replica",
                       "--keep-previous", std::string(KeepName(job.keep_previous))});
    if (job.staging) {
      a.push_back("--staging");
      a.push_back(*job.staging == MemKind::kCuda ? "device" : "host");
    }
  }
  if (!job.verify) a.push_back("--no-verify");
  if (!job.dump_dir.empty()) {
    a.push_back("--dump-dir");
    a.push_back(job.dump_dir);
  }
  return a;
}

namespace {

// The delta encoding's figures of a sync (session.h DeltaSyncStats; zeros under encoding full).
nlohmann::json DeltaToJson(const DeltaSyncStats& d) {
  return {{"wire_bytes", d.wire_bytes},
          {"full_bytes", d.full_bytes},
          {"changed", d.changed},
          {"elements", d.elements},
          {"density", d.elements ? static_cast<double>(d.changed) / d.elements : 0.0},
          {"buckets_delta", d.buckets_delta},
          {"buckets_full", d.buckets_full},
          {"fallback_no_image", d.fallback_no_image},
          {"fallback_version", d.fallback_version},
          {"fallback_checksum", d.fallback_checksum},
          {"full_by_size", d.full_by_size},
          {"full_by_cost", d.full_by_cost},
          {"full_by_auto", d.full_by_auto},
          {"encode_seconds", d.encode_seconds},
          {"decode_seconds", d.decode_seconds},
          {"first_fallback", d.first_fallback},
          {"held_bytes", d.held_bytes}};
}

void DeltaFromJson(const nlohmann::json& j, DeltaSyncStats& d) {
  d.wire_bytes = j.at("wire_bytes");
  d.full_bytes = j.at("full_bytes");
  d.changed = j.at("changed");
  d.elements = j.at("elements");
  d.buckets_delta = j.at("buckets_delta");
  d.buckets_full = j.at("buckets_full");
  d.fallback_no_image = j.at("fallback_no_image");
  d.fallback_version = j.at("fallback_version");
  d.fallback_checksum = j.at("fallback_checksum");
  d.full_by_size = j.at("full_by_size");
  d.full_by_cost = j.at("full_by_cost");
  d.full_by_auto = j.at("full_by_auto");
  d.encode_seconds = j.at("encode_seconds");
  d.decode_seconds = j.at("decode_seconds");
  d.first_fallback = j.at("first_fallback");
  d.held_bytes = j.value("held_bytes", int64_t{0});
}

}  // namespace

std::string RankResultToJson(const RankResult& r) {
  nlohmann::json ranks = nlohmann::json::array();
  nlohmann::json j = {
      {"rank", r.rank},
      {"is_trainer", r.is_trainer},
      {"replica", r.replica},
      {"tp_rank", r.tp_rank},
      {"pp_rank", r.pp_rank},
      {"trainer_rank", r.trainer_rank},
      {"ok", r.ok},
      {"error", r.error},
      {"version", r.report.version},
      {"bytes", r.report.bytes},
      {"seconds", r.report.seconds},
      {"gbps", r.report.gbps},
      {"slowest_rank", r.report.slowest_rank},
      {"checksums_ok", r.report.checksums_ok},
      {"checksums_total", r.report.checksums_total},
      {"local_send_bytes", r.report.local.send_bytes},
      {"local_recv_bytes", r.report.local.recv_bytes},
      {"local_seconds", r.report.local.seconds},
      {"elements_checked", r.elements_checked},
      {"element_mismatches", r.element_mismatches},
      {"first_mismatch", r.first_mismatch},
      {"peak_rss_bytes", r.peak_rss_bytes},
      {"poisoned", r.poisoned},
      {"setup_seconds", r.setup_seconds},
      {"device", r.device},
      {"routes", r.routes},
      {"host_id", r.host_id},
      {"transfer_seconds", r.transfer_seconds},
      {"stall_seconds", r.stall_seconds},
      {"staging_bytes", r.staging_bytes},
      {"committed_version", r.committed_version},
      {"keep_previous", r.keep_previous},
      {"live_hash", r.live_hash},
      {"live_hash_after", r.live_hash_after},
      {"live_intact", r.live_intact},
      {"failed_in", r.failed_in},
      {"delta", DeltaToJson(r.report.delta)},
      {"local_delta", DeltaToJson(r.report.local.delta)},
      {"bench",
       {{"sharded", r.bench.sharded},
        {"broadcast", r.bench.broadcast},
        {"raw", r.bench.raw},
        {"raw_nccl", r.bench.raw_nccl},
        {"stall", r.bench.stall},
        {"commit_raw", r.bench.commit_raw},
        {"commit_copy", r.bench.commit_copy},
        {"decode_idle_ms", r.bench.decode_idle_ms},
        {"decode_transfer_ms", r.bench.decode_transfer_ms},
        {"decode_commit_ms", r.bench.decode_commit_ms},
        {"bytes", r.bench.bytes},
        {"verified", r.bench.verified}}},
  };
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Result<RankResult> RankResultFromJson(const std::string& text) {
  try {
    auto j = nlohmann::json::parse(text);
    RankResult r;
    r.rank = j.at("rank");
    r.is_trainer = j.at("is_trainer");
    r.replica = j.at("replica");
    r.tp_rank = j.at("tp_rank");
    r.pp_rank = j.at("pp_rank");
    r.trainer_rank = j.at("trainer_rank");
    r.ok = j.at("ok");
    r.error = j.at("error");
    r.report.version = j.at("version");
    r.report.bytes = j.at("bytes");
    r.report.seconds = j.at("seconds");
    r.report.gbps = j.at("gbps");
    r.report.slowest_rank = j.at("slowest_rank");
    r.report.checksums_ok = j.at("checksums_ok");
    r.report.checksums_total = j.at("checksums_total");
    r.report.local.send_bytes = j.at("local_send_bytes");
    r.report.local.recv_bytes = j.at("local_recv_bytes");
    r.report.local.seconds = j.at("local_seconds");
    if (j.contains("delta")) DeltaFromJson(j.at("delta"), r.report.delta);
    if (j.contains("local_delta")) DeltaFromJson(j.at("local_delta"), r.report.local.delta);
    r.elements_checked = j.at("elements_checked");
    r.element_mismatches = j.at("element_mismatches");
    r.first_mismatch = j.at("first_mismatch");
    r.peak_rss_bytes = j.at("peak_rss_bytes");
    r.poisoned = j.at("poisoned");
    r.setup_seconds = j.at("setup_seconds");
    const auto& b = j.at("bench");
    r.bench.sharded = b.at("sharded").get<std::vector<double>>();
    r.bench.broadcast = b.at("broadcast").get<std::vector<double>>();
    r.bench.raw = b.at("raw").get<std::vector<double>>();
    r.bench.raw_nccl = b.at("raw_nccl").get<std::vector<double>>();
    r.bench.stall = b.at("stall").get<std::vector<double>>();
    r.bench.commit_raw = b.at("commit_raw").get<std::vector<double>>();
    r.bench.commit_copy = b.at("commit_copy").get<std::vector<double>>();
    r.bench.decode_idle_ms = b.at("decode_idle_ms");
    r.bench.decode_transfer_ms = b.at("decode_transfer_ms");
    r.bench.decode_commit_ms = b.at("decode_commit_ms");
    r.transfer_seconds = j.at("transfer_seconds");
    r.stall_seconds = j.at("stall_seconds");
    r.staging_bytes = j.at("staging_bytes");
    r.committed_version = j.at("committed_version");
    r.keep_previous = j.at("keep_previous");
    r.live_hash = j.at("live_hash");
    r.live_hash_after = j.at("live_hash_after");
    r.live_intact = j.at("live_intact");
    r.failed_in = j.at("failed_in");
    r.device = j.at("device");
    r.routes = j.at("routes");
    r.host_id = j.at("host_id");
    r.bench.bytes = b.at("bytes");
    r.bench.verified = b.at("verified");
    return r;
  } catch (const std::exception& e) {
    return DataLossError(std::string("rank result is malformed: ") + e.what());
  }
}

std::string DefaultTransport() {
  for (const std::string& n : RegisteredTransports()) {
    if (n == "ucx") return "ucx";
  }
  return "loopback";
}

namespace {

// The flags that define the plan (--model ... --bucket-bytes), in the order they are checked.
Status PlanInputsFromFlags(const JobFlags& f, PlanInputs& in) {
  SS_ASSIGN_OR_RETURN(in.model, LoadModelSpec(f.model));  // errors name --model
  if (!f.quant.empty()) {
    SS_ASSIGN_OR_RETURN(in.model.quant, ParseQuantFlag(f.quant));  // errors name --quant
  }
  SS_ASSIGN_OR_RETURN(EngineKind engine, ParseEngineKind(f.engine, "--engine"));
  // The parsers name the flag (--trainer ..., --rollout ...).
  SS_ASSIGN_OR_RETURN(in.trainer, ParseTrainerSpec(f.trainer));
  SS_ASSIGN_OR_RETURN(in.rollout, ParseRolloutSpec(f.rollout, engine));
  if (!f.pp_partition.empty()) {
    std::vector<int64_t> parts;
    std::string_view rest = f.pp_partition;
    while (!rest.empty()) {
      const size_t c = rest.find(',');
      const std::string item(rest.substr(0, c));
      char* end = nullptr;
      const long long v = std::strtoll(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || v <= 0) {
        return InvalidArgumentError("--pp-partition: '" + item + "' is not a positive layer count");
      }
      parts.push_back(v);
      rest = c == std::string_view::npos ? std::string_view() : rest.substr(c + 1);
    }
    in.rollout.shard.pp_partition = parts;
  }
  SS_ASSIGN_OR_RETURN(in.options.wire_dtype, ParseDType(f.wire_dtype, "--wire-dtype"));
  SS_ASSIGN_OR_RETURN(in.trainer_dtype, ParseDType(f.trainer_dtype, "--trainer-dtype"));
  SS_ASSIGN_OR_RETURN(in.options.straddle, ParseFp8Split(f.fp8_split));
  SS_ASSIGN_OR_RETURN(in.options.encoding, ParseWireEncoding(f.encoding));
  SS_RETURN_IF_ERROR(job_internal::CheckFloatDType(in.options.wire_dtype, "--wire-dtype"));
  SS_RETURN_IF_ERROR(job_internal::CheckFloatDType(in.trainer_dtype, "--trainer-dtype"));
  if (f.bucket_bytes < 0) {
    return InvalidArgumentError("--bucket-bytes: must be at least 8, got " +
                                std::to_string(f.bucket_bytes));
  }
  if (f.bucket_bytes > 0) {
    in.options.bucket_bytes = f.bucket_bytes;
  } else {
    if (!(f.bucket_mb > 0) || f.bucket_mb > 1e6) {
      return InvalidArgumentError("--bucket-mb: must be in (0, 1e6], got " +
                                  std::to_string(f.bucket_mb));
    }
    in.options.bucket_bytes = static_cast<int64_t>(f.bucket_mb * (1 << 20));
  }
  if (in.options.bucket_bytes < 8) {
    return InvalidArgumentError("--bucket-bytes: must be at least 8, got " +
                                std::to_string(in.options.bucket_bytes));
  }
  return OkStatus();
}

// --device and --gpus; a CUDA job also needs a device, the GPU transports and bf16 on the wire.
Status DeviceFromFlags(const JobFlags& f, JobSpec& job) {
  const PlanInputs& in = job.inputs;
  if (f.device != "cpu" && f.device != "cuda") {
    return InvalidArgumentError("--device: '" + f.device + "', expected cpu or cuda");
  }
  job.device = f.device;
  if (f.gpus < 0 || f.gpus > 4096) {
    return InvalidArgumentError("--gpus: must be in [0, 4096] (0: every visible GPU), got " +
                                std::to_string(f.gpus));
  }
  job.gpus = f.gpus;
  if (job.device == "cuda") {
    std::string why;
    if (!gpu::Available(&why)) return InvalidArgumentError("--device cuda: " + why);
    SS_RETURN_IF_ERROR(gpu::RegisterGpuTransports());
    if (in.options.wire_dtype != DType::kBF16) {
      return InvalidArgumentError("--wire-dtype: --device cuda moves bf16 (got " +
                                  std::string(DTypeName(in.options.wire_dtype)) + ")");
    }
    if (in.trainer_dtype != DType::kF32 && in.trainer_dtype != DType::kBF16) {
      return InvalidArgumentError("--trainer-dtype: --device cuda holds f32 or bf16 shards");
    }
  }
  return OkStatus();
}

}  // namespace

Result<JobSpec> JobSpecFromFlags(const JobFlags& f, bool all_local) {
  JobSpec job;
  PlanInputs& in = job.inputs;
  SS_RETURN_IF_ERROR(PlanInputsFromFlags(f, in));
  job.seed = f.seed;
  if (f.syncs < 1 || f.syncs > 1000000) {
    return InvalidArgumentError("--syncs: must be in [1, 1000000], got " + std::to_string(f.syncs));
  }
  job.syncs = f.syncs;
  SS_RETURN_IF_ERROR(DeviceFromFlags(f, job));
  // Device ranks route every pair (cuda_ipc / nccl); a named transport is the hint.
  job.transport = f.transport != "auto"  ? f.transport
                  : job.device == "cuda" ? "auto"
                  : all_local            ? "shm"
                                         : DefaultTransport();
  if (job.transport != "loopback" && job.transport != "auto") {
    bool known = false;
    for (const std::string& n : RegisteredTransports()) known |= n == job.transport;
    if (!known) {
      return InvalidArgumentError("--transport: '" + f.transport +
                                  "' is not available in this build (ucx needs libucx-dev at "
                                  "build time); use loopback");
    }
  }
  if (f.timeout_ms < 1 || f.timeout_ms > 86400000) {
    return InvalidArgumentError("--timeout-ms: must be in [1, 86400000], got " +
                                std::to_string(f.timeout_ms));
  }
  job.timeout = Millis(f.timeout_ms);
  if (f.timeout_auto && all_local) {
    // Every rank of a local job shares this host's cores: a sync on 8 ranks over 2 busy cores
    // takes several times what it takes with a core each (issue 36: the default bench's first
    // sync outlasted 60 s at load 20 on 2 cores).
    const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
    const int64_t per_core = (SyncWorldSize(in) + cores - 1) / cores;
    job.timeout = Millis(std::min<int64_t>(f.timeout_ms * per_core, 86400000));
  }
  if (f.setup_timeout_s < 1 || f.setup_timeout_s > 86400) {
    return InvalidArgumentError("--setup-timeout-s: must be in [1, 86400], got " +
                                std::to_string(f.setup_timeout_s));
  }
  job.setup_timeout = Millis(f.setup_timeout_s * 1000);
  if (f.mode == "sync") {
    job.mode = JobMode::kSync;
  } else if (f.mode == "bench") {
    job.mode = JobMode::kBench;
  } else {
    return InvalidArgumentError("--mode: '" + f.mode + "', expected sync or bench");
  }
  if (f.warmup < 0 || f.warmup > 1000) {
    return InvalidArgumentError("--warmup: must be in [0, 1000], got " + std::to_string(f.warmup));
  }
  if (f.reps < 1 || f.reps > 1000) {
    return InvalidArgumentError("--reps: must be in [1, 1000], got " + std::to_string(f.reps));
  }
  job.bench_warmup = f.warmup;
  job.bench_reps = f.reps;
  if (!(f.update_fraction >= 0 && f.update_fraction <= 0.5)) {
    return InvalidArgumentError("--update-fraction: must be in [0, 0.5], got " +
                                std::to_string(f.update_fraction));
  }
  job.bench_update = f.update_fraction;
  job.verify = !f.no_verify;
  if (f.prefix.empty()) return InvalidArgumentError("--prefix: must not be empty");
  job.prefix = f.prefix;
  job.dump_dir = f.dump_dir;
  // Engine ranks write <dir>/rank-<R>.safetensors once they synced: a directory that is not
  // there fails them all after the sync (and stalls a bench's other ranks at its next barrier).
  std::error_code ec;
  if (!f.dump_dir.empty() && !std::filesystem::is_directory(f.dump_dir, ec)) {
    return InvalidArgumentError("--dump-dir: '" + f.dump_dir + "' is not a directory");
  }
  SS_RETURN_IF_ERROR(CommitFromFlags(f, job));
  // The plan must exist: fail here, naming the field (for block FP8: a layout off the 128 grid
  // names the tensor), rather than in every rank.
  if (in.model.quant) {
    // Bands straddling trainer ranks: quantized by their holders after the amax exchange (the
    // host path and cuda_ipc pairs), or staged (`--fp8-split stage`). nccl pairs carry neither;
    // with the nccl hint, pairs across GPUs are nccl.
    SS_ASSIGN_OR_RETURN(PlanSummary fp8, SummarizePlan(in));
    if (job.device == "cuda" && job.transport == "nccl" && fp8.amax_elements > 0) {
      return InvalidArgumentError("--trainer " + in.trainer.ToString() + ": " +
                                  std::to_string(fp8.amax_blocks) +
                                  " blocks of block-FP8 weights are shared by trainer ranks (FSDP "
                                  "chunks off the 128-row grid) and --transport nccl cannot "
                                  "quantize them with the amax exchange; " +
                                  kAmaxOnDevice + " (--transport auto)");
    }
  } else {
    SS_RETURN_IF_ERROR(SummarizePlan(in).status());
  }
  return job;
}

int RankSteps(const JobSpec& job) {
  // allocated, connected, one per sync (bench: one per variant), verified.
  return 3 + (job.mode == JobMode::kBench ? 3 : job.syncs);
}

}  // namespace shardsync
