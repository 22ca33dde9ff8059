// The knob registry (shardsync/settings.h): the table, its strict parsers, and the one getenv.
#include "shardsync/settings.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>

namespace shardsync {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

using T = KnobType;
constexpr KnobOrigin kOwn = KnobOrigin::kShardsync;
constexpr KnobOrigin kOther = KnobOrigin::kThirdParty;

// Sorted by name within each origin (a test keeps it so); docs/environment.md has one row each.
const Knob kKnobs[] = {
    // shardsync's own.
    {"SHARDSYNC_BENCH_CPU", T::kText, "", 0, 0, "", "job (bench)",
     "Diagnostic: append each bench rank's CPU seconds per repetition to this file", kOwn},
    {"SHARDSYNC_CHUNK_KIB", T::kInt, "256", 4, 1 << 20, "", "cuda (copy batch)",
     "Wire KiB per chunk of a GPU copy batch (experiment knob: the pages a launch's blocks touch "
     "at once)",
     kOwn},
    {"SHARDSYNC_DELTA_DECODE_MBPS", T::kInt, "4500", 1, 100000000, "", "sync (delta, auto)",
     "Encoding auto: the receiver's delta steps (advertisement and decode passes) in MB/s of "
     "bucket it prices deltas at",
     kOwn},
    {"SHARDSYNC_DELTA_DEVICE_DECODE_MBPS", T::kInt, "400000", 1, 100000000, "",
     "sync (delta, auto)",
     "Encoding auto over device pairs (cuda_ipc, nccl): the receiver's delta steps (advertisement, "
     "base gather, decode, landing, readback) in MB/s of bucket it prices deltas at",
     kOwn},
    {"SHARDSYNC_DELTA_DEVICE_ENCODE_MBPS", T::kInt, "400000", 1, 100000000, "",
     "sync (delta, auto)",
     "Encoding auto over device pairs (cuda_ipc, nccl): the sender's delta steps (pack, encode, "
     "kept copy) in MB/s of bucket it prices deltas at",
     kOwn},
    {"SHARDSYNC_DELTA_ENCODE_MBPS", T::kInt, "7000", 1, 100000000, "", "sync (delta, auto)",
     "Encoding auto: the sender's delta step (its encode pass) in MB/s of bucket it prices deltas "
     "at",
     kOwn},
    {"SHARDSYNC_DELTA_IPC_LINK_MBPS", T::kInt, "450000", 1, 100000000, "", "sync (delta, auto)",
     "Encoding auto over cuda_ipc pairs (one node): the link speed in MB/s a bucket crosses "
     "(default: one direction of an H200's NVLink, NVIDIA's 900 GB/s both ways; not measured "
     "here)",
     kOwn},
    {"SHARDSYNC_DELTA_LINK_MBPS", T::kInt, "25000", 1, 100000000, "", "sync (delta, auto)",
     "Encoding auto: the link speed in MB/s a bucket crosses (the host path, and nccl pairs: "
     "across nodes); a delta is sent where it pays, and where none can the path runs as encoding "
     "full",
     kOwn},
    {"SHARDSYNC_FP8_OVERLAP", T::kBool, "1", 0, 0, "", "cuda (FP8 batch)",
     "Run a block-FP8 batch's copies on a side stream beside the quantize kernel; 0 runs them in "
     "line (A/B)",
     kOwn},
    {"SHARDSYNC_FP8_STAGES", T::kInt, "2", 0, 4, "", "cuda (FP8 batch)",
     "Shared-memory stages of the pipelined FP8 quantize kernel; 0: one CTA per block (1 runs as "
     "2)",
     kOwn},
    {"SHARDSYNC_GPU_SHARED_LAUNCH", T::kChoice, "1", 0, 0, "0|1|2", "cuda (cuda_ipc)",
     "1: one kernel for every sender of a GPU; 2: one per sender from the launcher's stream "
     "(experiment); 0: each sender its own, in turn",
     kOwn},
    {"SHARDSYNC_GPU_TURNSTILE", T::kBool, "1", 0, 0, "", "cuda (cuda_ipc)",
     "Order the kernel launches of the processes sharing a GPU; 0 leaves them unordered", kOwn},
    {"SHARDSYNC_HOST_ID", T::kText, "", 0, 0, "", "transport (routing)",
     "This rank's host identity for routing (unset: the hostname); ranks with different ids are "
     "different nodes (no cuda_ipc / shm between them): `--emulate-nodes` sets it per rank",
     kOwn},
    {"SHARDSYNC_JOB_ID", T::kText, "", 0, 0, "", "store (launch id)",
     "This launch's id, scoping its store keys and shared memory; unset: TORCHELASTIC_RUN_ID, "
     "SLURM_JOB_ID[.SLURM_STEP_ID] or RAY_JOB_ID",
     kOwn},
    {"SHARDSYNC_JOB_SECRET", T::kText, "", 0, 0, "", "store (launch id)",
     "This launch's secret, the same on each of its ranks (docs/security.md, Job identity)", kOwn,
     /*secret=*/true},
    {"SHARDSYNC_NCCL_LIB", T::kText, "libnccl.so.2", 0, 0, "", "cuda (nccl)",
     "The NCCL library the nccl transport loads (dlopen)", kOwn},
    {"SHARDSYNC_RANK_LOG_DIR", T::kText, "", 0, 0, "", "job (launcher)",
     "Keep every launched rank's stderr as DIR/rank-<R>.log (GPU debugging)", kOwn},
    {"SHARDSYNC_REPLICA", T::kInt, "", 0, kIntMax, "", "python (hooks)",
     "This engine's DP replica when the hook's config names none (else vLLM's data_parallel_rank)",
     kOwn},
    {"SHARDSYNC_STORE", T::kText, "", 0, 0, "", "store (launch contract)",
     "The rendezvous store's host:port (Session.from_env, `shardsync run`)", kOwn},
    {"SHARDSYNC_TOKEN", T::kText, "", 0, 0, "", "store (launch contract), cli (store)",
     "The store's token; `shardsync store` serves with it, ranks connect with it", kOwn,
     /*secret=*/true},
    {"SHARDSYNC_TRACE", T::kChoice, "0", 0, 0, "0|1|buffered", "common (trace)",
     "Timestamped steps on stderr; buffered: kept in memory and written at exit", kOwn},
    {"SHARDSYNC_UCX_MODE", T::kChoice, "", 0, 0, "put|tag|auto", "transport (ucx)",
     "UCX transfer mode; unset: the session's option (auto: put with an RDMA device, else tag)",
     kOwn},
    {"SHARDSYNC_UCX_NET_DEVICES", T::kText, "", 0, 0, "", "transport (ucx)",
     "Devices UCX may use: loopback, all, or names like eth0,mlx5_0:1; unset: the session's "
     "option, else UCX_NET_DEVICES, else loopback",
     kOwn},
    {"SHARDSYNC_VERDICT_BOARD", T::kBool, "1", 0, 0, "", "sync (verdicts)",
     "Exchange sync verdicts through shared memory among a host's ranks; 0: through the store",
     kOwn},
    // Other programs' variables shardsync reads.
    {"NCCL_HOSTID", T::kText, "", 0, 0, "", "cuda (nccl)",
     "NCCL: its host identity; where SHARDSYNC_HOST_ID is set, nccl connects only if it is the "
     "same (NCCL would otherwise see one host, and two ranks on one GPU fail its init)",
     kOther},
    {"RANK", T::kInt, "", 0, kIntMax, "", "store (launch contract)",
     "Launcher (torchrun, `shardsync run`): this process's sync rank", kOther},
    {"RAY_JOB_ID", T::kText, "", 0, 0, "", "store (launch id)",
     "Ray: the job id, this launch's id when SHARDSYNC_JOB_ID and the others are unset", kOther},
    {"SGLANG_PP_LAYER_PARTITION", T::kText, "", 0, 0, "", "python (hooks layout check)",
     "SGLang: a custom pipeline layer partition, which the layout check refuses", kOther},
    {"SLURM_JOB_ID", T::kText, "", 0, 0, "", "store (launch id)",
     "Slurm: the job id (with SLURM_STEP_ID) as this launch's id", kOther},
    {"SLURM_NTASKS", T::kInt, "", 1, kIntMax, "", "store (launch contract)",
     "Slurm: the world size when WORLD_SIZE is unset", kOther},
    {"SLURM_PROCID", T::kInt, "", 0, kIntMax, "", "store (launch contract)",
     "Slurm: the rank when RANK is unset", kOther},
    {"SLURM_STEP_ID", T::kText, "", 0, 0, "", "store (launch id)",
     "Slurm: the step id; one srun step is one launch", kOther},
    {"TMPDIR", T::kText, "/tmp", 0, 0, "", "cli (temporary directories)",
     "POSIX: where the CLI makes its temporary directories (engine dumps, rank logs)", kOther},
    {"TORCHELASTIC_RUN_ID", T::kText, "", 0, 0, "", "store (launch id)",
     "torchrun: the rendezvous id, this launch's id unless it is torchrun's default \"none\"",
     kOther},
    {"UCX_KEEPALIVE_INTERVAL", T::kText, "", 0, 0, "", "transport (ucx)",
     "UCX: its keepalive interval; unset: shardsync sets 1s so a dead peer surfaces within a "
     "sync timeout",
     kOther},
    {"UCX_NET_DEVICES", T::kText, "", 0, 0, "", "transport (ucx)",
     "UCX: its devices, used when SHARDSYNC_UCX_NET_DEVICES and the session name none", kOther},
    {"VLLM_PP_LAYER_PARTITION", T::kText, "", 0, 0, "", "python (hooks layout check)",
     "vLLM: a custom pipeline layer partition, which the layout check refuses", kOther},
    {"WORLD_SIZE", T::kInt, "", 1, kIntMax, "", "store (launch contract)",
     "Launcher: the number of sync ranks", kOther},
};

std::string Quoted(const Knob& k, std::string_view v) {
  return std::string(k.name) + "='" + std::string(v) + "'";
}

Result<int64_t> ParseInt(const Knob& k, std::string_view v) {
  int64_t out = 0;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec == std::errc::result_out_of_range ||
      (ec == std::errc() && ptr == v.data() + v.size() && (out < k.min || out > k.max))) {
    return InvalidArgumentError(Quoted(k, v) + ": out of range, want " + KnobRange(k));
  }
  if (ec != std::errc() || ptr != v.data() + v.size()) {
    return InvalidArgumentError(Quoted(k, v) + ": not an integer, want " + KnobRange(k));
  }
  return out;
}

Result<bool> ParseBool(const Knob& k, std::string_view v) {
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  return InvalidArgumentError(Quoted(k, v) + ": want 0 or 1");
}

Status ParseChoice(const Knob& k, std::string_view v) {
  std::string_view rest = k.choices;
  while (!rest.empty()) {
    const size_t bar = rest.find('|');
    if (rest.substr(0, bar) == v) return OkStatus();
    rest = bar == std::string_view::npos ? std::string_view() : rest.substr(bar + 1);
  }
  return InvalidArgumentError(Quoted(k, v) + ": want " + KnobRange(k));
}

Result<const Knob*> Lookup(std::string_view name) {
  const Knob* k = FindKnob(name);
  if (k == nullptr) {
    return NotFoundError("environment variable " + std::string(name) +
                         " is not in the settings registry (src/common/settings.cc)");
  }
  return k;
}

Result<const Knob*> TypedLookup(std::string_view name, KnobType type) {
  SS_ASSIGN_OR_RETURN(const Knob* k, Lookup(name));
  if (k->type != type) {
    return InternalError(std::string(name) + " is a " + std::string(KnobTypeName(k->type)) +
                         " knob, read as a " + std::string(KnobTypeName(type)));
  }
  return k;
}

}  // namespace

const EnvLookup& ProcessEnvironment() {
  static const EnvLookup env = [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
  return env;
}

std::span<const Knob> Knobs() { return kKnobs; }

const Knob* FindKnob(std::string_view name) {
  for (const Knob& k : kKnobs) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

std::string_view KnobTypeName(KnobType type) {
  switch (type) {
    case KnobType::kBool:
      return "bool";
    case KnobType::kInt:
      return "int";
    case KnobType::kChoice:
      return "choice";
    case KnobType::kText:
      return "text";
  }
  return "?";
}

std::string KnobRange(const Knob& k) {
  switch (k.type) {
    case KnobType::kBool:
      return "0 or 1";
    case KnobType::kInt:
      return std::to_string(k.min) + ".." + std::to_string(k.max);
    case KnobType::kChoice: {
      std::string out;
      for (char c : std::string_view(k.choices))
        out += c == '|' ? std::string(" | ") : std::string(1, c);
      return out;
    }
    case KnobType::kText:
      return "text";
  }
  return "?";
}

Status CheckKnobValue(const Knob& k, std::string_view v) {
  switch (k.type) {
    case KnobType::kBool:
      return ParseBool(k, v).status();
    case KnobType::kInt:
      return ParseInt(k, v).status();
    case KnobType::kChoice:
      return ParseChoice(k, v);
    case KnobType::kText:
      return OkStatus();
  }
  return OkStatus();
}

Result<std::optional<std::string>> ReadKnob(std::string_view name, const EnvLookup& env) {
  SS_ASSIGN_OR_RETURN(const Knob* k, Lookup(name));
  std::optional<std::string> v = env(k->name);
  // Empty is unset: `VAR= cmd` is how a shell clears a variable for one command.
  if (!v || v->empty()) return std::optional<std::string>();
  SS_RETURN_IF_ERROR(CheckKnobValue(*k, *v));
  return v;
}

Result<std::optional<int64_t>> ReadIntKnob(std::string_view name, const EnvLookup& env) {
  SS_ASSIGN_OR_RETURN(const Knob* k, TypedLookup(name, KnobType::kInt));
  SS_ASSIGN_OR_RETURN(std::optional<std::string> v, ReadKnob(name, env));
  if (!v) return std::optional<int64_t>();
  SS_ASSIGN_OR_RETURN(int64_t out, ParseInt(*k, *v));
  return std::optional<int64_t>(out);
}

Result<int64_t> IntKnob(std::string_view name, const EnvLookup& env) {
  SS_ASSIGN_OR_RETURN(const Knob* k, TypedLookup(name, KnobType::kInt));
  SS_ASSIGN_OR_RETURN(std::optional<int64_t> v, ReadIntKnob(name, env));
  if (v) return *v;
  if (*k->default_value == '\0') {
    return InternalError(std::string(name) + " has no default: read it with ReadIntKnob");
  }
  return ParseInt(*k, k->default_value);
}

Result<bool> BoolKnob(std::string_view name, const EnvLookup& env) {
  SS_ASSIGN_OR_RETURN(const Knob* k, TypedLookup(name, KnobType::kBool));
  SS_ASSIGN_OR_RETURN(std::optional<std::string> v, ReadKnob(name, env));
  return ParseBool(*k, v ? *v : std::string(k->default_value));
}

Result<std::string> TextKnob(std::string_view name, const EnvLookup& env) {
  SS_ASSIGN_OR_RETURN(const Knob* k, Lookup(name));
  if (k->type != KnobType::kChoice && k->type != KnobType::kText) {
    return InternalError(std::string(name) + " is a " + std::string(KnobTypeName(k->type)) +
                         " knob, read as text");
  }
  SS_ASSIGN_OR_RETURN(std::optional<std::string> v, ReadKnob(name, env));
  return v ? *v : std::string(k->default_value);
}

Status CheckKnobs(const EnvLookup& env) {
  for (const Knob& k : kKnobs) {
    if (k.origin != KnobOrigin::kShardsync) continue;
    SS_RETURN_IF_ERROR(ReadKnob(k.name, env).status());
  }
  return OkStatus();
}

void ReportKnobError(const Status& status) {
  static std::mutex mu;
  static std::set<std::string> told;
  std::lock_guard<std::mutex> lock(mu);
  if (!told.insert(status.message()).second) return;
  std::fprintf(stderr, "shardsync: %s (using the default)\n", status.ToString().c_str());
}

Result<std::vector<KnobSetting>> EffectiveKnobs(const EnvLookup& env) {
  std::vector<KnobSetting> out;
  for (const Knob& k : kKnobs) {
    SS_ASSIGN_OR_RETURN(std::optional<std::string> v, ReadKnob(k.name, env));
    KnobSetting s{&k, v ? *v : std::string(k.default_value), v.has_value()};
    if (k.secret && v) s.value = "(set, " + std::to_string(v->size()) + " chars)";
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace shardsync
