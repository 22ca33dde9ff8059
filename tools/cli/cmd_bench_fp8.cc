// `shardsync bench` on a block-FP8 job (--quant fp8-block128, or a config's quantization_config):
// in one run, the FP8 sync (the product's session, quantizing at sync time) and its ceiling, then
// the bf16 sync of the same model and layouts, so the FP8 figure stands next to the one it
// replaces. The ceiling is the memory bound of the FP8 work with --device cuda (every trainer
// element read once, every engine byte written once, SummarizePlan; cudaMemcpy of half that
// many bytes moves exactly that much through HBM) and the raw transport on the host.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "command.h"
#include "delta_json.h"
#include "job/launcher.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/gpu.h"
#include "shardsync/plan.h"

namespace shardsync::cli {

using json = nlohmann::json;

// cmd_bench.cc: `nodes`, `cross_node_bytes` (the ranks' host identities) and `emulate_nodes`.
Status AddNodeFigures(const JobSpec& job, const LocalJobResult& res, bool emulate_nodes,
                      json* extra);
void PrintNodeLine(const json& extra);  // the text line of AddNodeFigures' figures

std::string HumanBytes(double b);
std::function<void(int, int)> JobProgress(const std::string& label, bool json, int world,
                                          std::vector<std::string> phases);
void PhaseLine(const std::string& label, const std::string& what);
LocalJobOptions::Mode ParseLaunch(const std::string& s);
Result<PlanSummary> JobPlanSummary(const PlanInputs& in, std::optional<PlanSummary>* fp8);
std::string Fp8SummaryText(const PlanInputs& in, const PlanSummary& s);
json Fp8SummaryJson(const PlanInputs& in, const PlanSummary& s);
Result<json> Generation(const JobSpec& job, const std::string& dir, int n, bool* all);

namespace {

struct Figures {
  BenchSummary fp8, bf16;
  double bound_bytes = 0;  // read + write of the FP8 work
  int64_t checked = 0, mismatches = 0;
  int64_t checksums_ok = 0, checksums_total = 0;
  DeltaSyncStats fp8_delta, bf16_delta;  // each run's last sync (encoding delta / auto)
};

Result<BenchSummary> RunOne(const JobSpec& job, bool as_json, const std::string& launch,
                            bool emulate_nodes, int timeout_s, const std::string& label,
                            LocalJobResult* out) {
  LocalJobOptions lo;
  lo.job = job;
  lo.job.mode = JobMode::kBench;
  lo.mode = job.device == "cuda" ? LocalJobOptions::Mode::kProcesses : ParseLaunch(launch);
  lo.emulate_nodes = emulate_nodes;
  lo.job_timeout = Millis(int64_t{timeout_s} * 1000);
  lo.on_progress = JobProgress(label, as_json, SyncWorldSize(job.inputs), {});
  SS_ASSIGN_OR_RETURN(*out, RunLocalJob(lo));
  return SummarizeBench(*out);
}

void PrintText(const JobSpec& job, const PlanSummary& s, const Figures& f, const json& extra,
               bool verified) {
  const auto& in = job.inputs;
  const bool cuda = job.device == "cuda";
  std::printf(
      "shardsync bench: %s, trainer %s (%s) -> %s dp=%d tp=%d pp=%d ep=%d, block FP8, %s, "
      "transport %s, %d warm-up + %d reps (median; slowest rank per rep)\n",
      in.model.name.c_str(), in.trainer.ToString().c_str(),
      std::string(DTypeName(in.trainer_dtype)).c_str(),
      std::string(EngineKindName(in.rollout.shard.engine)).c_str(), in.rollout.dp,
      in.rollout.shard.tp, in.rollout.shard.pp, in.rollout.shard.ep, job.device.c_str(),
      job.transport.c_str(), job.bench_warmup, job.bench_reps);
  std::printf("%s", Fp8SummaryText(in, s).c_str());
  std::printf("  memory-bound work: read %s + write %s\n",
              HumanBytes(static_cast<double>(s.bound_read_bytes)).c_str(),
              HumanBytes(static_cast<double>(s.bound_write_bytes)).c_str());
  PrintNodeLine(extra);
  std::printf("  FP8 sync (quantize + checksums)   %8.4f s\n", f.fp8.sharded_seconds);
  if (cuda) {
    std::printf("  memory bound (cudaMemcpy D2D)     %8.4f s  (%.0f GB/s of HBM traffic)\n",
                f.fp8.raw_seconds, f.bound_bytes / f.fp8.raw_seconds / 1e9);
  } else {
    std::printf("  raw transport of the FP8 bytes    %8.4f s\n", f.fp8.raw_seconds);
  }
  std::printf("  bf16 sync of the same model       %8.4f s\n", f.bf16.sharded_seconds);
  std::printf(
      "  FP8 at %.2fx of the %s, %.2fx faster than bf16; %lld elements checked, %lld "
      "mismatches, %s\n",
      f.fp8.raw_seconds / f.fp8.sharded_seconds, cuda ? "memory bound" : "raw transport",
      f.bf16.sharded_seconds / f.fp8.sharded_seconds, static_cast<long long>(f.checked),
      static_cast<long long>(f.mismatches), verified ? "verified" : "NOT VERIFIED");
  if (job.inputs.options.encoding != WireEncoding::kFull) {
    for (const auto& [what, d] :
         {std::pair{"FP8", &f.fp8_delta}, std::pair{"bf16", &f.bf16_delta}}) {
      std::printf(
          "  %s encoding %s, last sync: %s of %s on the wire, density %.4f, %lld buckets as "
          "deltas, %lld whole\n",
          what, std::string(WireEncodingName(job.inputs.options.encoding)).c_str(),
          HumanBytes(static_cast<double>(d->wire_bytes)).c_str(),
          HumanBytes(static_cast<double>(d->full_bytes)).c_str(),
          d->elements ? static_cast<double>(d->changed) / d->elements : 0.0,
          static_cast<long long>(d->buckets_delta), static_cast<long long>(d->buckets_full));
    }
  }
  if (extra.contains("generation")) {
    for (const auto& g : extra["generation"]) {
      std::printf("  generation replica %d: %s %s vs %s\n", g["replica"].get<int>(),
                  g["match"].get<bool>() ? "MATCH" : "MISMATCH", g["tokens"].dump().c_str(),
                  g["reference_tokens"].dump().c_str());
    }
  }
}

}  // namespace

int RunFp8Bench(const JobSpec& job, bool as_json, const std::string& launch, bool emulate_nodes,
                int job_timeout_s, int gen_tokens) {
  std::optional<PlanSummary> s;
  auto summary = JobPlanSummary(job.inputs, &s);
  if (!summary.ok()) return ReportError(summary.status());
  // --dump-dir DIR holds the FP8 run's engine parameters (e4m3 weights and their scales): the
  // run the bench is about. The bf16 comparison run below dumps nothing, or it would overwrite
  // them. --gen-tokens reads the FP8 dumps, from DIR or a temporary directory.
  JobSpec fp8_job = job;
  TempDir dumps;
  if (gen_tokens > 0 && fp8_job.dump_dir.empty()) {
    if (Status st = dumps.Create("bench"); !st.ok()) return ReportError(st);
    fp8_job.dump_dir = dumps.path;
  }
  PhaseLine("shardsync bench", job.inputs.model.name + ": the block-FP8 sync (" +
                                   std::to_string(summary->ops) + " ops) and its ceiling, then " +
                                   "the bf16 sync of the same model");
  Figures f;
  f.bound_bytes = static_cast<double>(s->bound_read_bytes + s->bound_write_bytes);
  LocalJobResult res;
  auto b =
      RunOne(fp8_job, as_json, launch, emulate_nodes, job_timeout_s, "shardsync bench (fp8)", &res);
  if (!b.ok()) return ReportError(b.status());
  f.fp8 = *b;
  for (const RankResult& r : res.ranks) {
    f.checked += r.elements_checked;
    f.mismatches += r.element_mismatches;
  }
  f.checksums_ok = res.ranks.at(0).report.checksums_ok;
  f.checksums_total = res.ranks.at(0).report.checksums_total;
  json extra = json::object();
  if (Status st = AddNodeFigures(fp8_job, res, emulate_nodes, &extra); !st.ok()) {
    return ReportError(st);
  }
  bool generation_ok = true;
  if (gen_tokens > 0) {
    auto g = Generation(fp8_job, fp8_job.dump_dir, gen_tokens, &generation_ok);
    if (!g.ok()) return ReportError(g.status());
    extra["generation"] = *g;
  }
  JobSpec bf16_job = job;
  bf16_job.inputs.model.quant.reset();
  bf16_job.prefix = job.prefix + "bf16/";
  bf16_job.dump_dir.clear();
  LocalJobResult res16;
  auto b16 = RunOne(bf16_job, as_json, launch, emulate_nodes, job_timeout_s,
                    "shardsync bench (bf16)", &res16);
  if (!b16.ok()) return ReportError(b16.status());
  f.bf16 = *b16;
  f.fp8_delta = res.ranks.at(0).report.delta;
  f.bf16_delta = res16.ranks.at(0).report.delta;
  const bool verified = f.fp8.verified && f.bf16.verified && generation_ok &&
                        f.checksums_total > 0 && f.checksums_ok == f.checksums_total;
  if (as_json) {
    nlohmann::json j = {{"device", job.device},
                        {"transport", job.transport},
                        {"quant", Fp8SummaryJson(job.inputs, *s)},
                        {"fp8_seconds", f.fp8.sharded_seconds},
                        {"bf16_seconds", f.bf16.sharded_seconds},
                        {"speedup_vs_bf16", f.bf16.sharded_seconds / f.fp8.sharded_seconds},
                        {"ceiling_seconds", f.fp8.raw_seconds},
                        {"ratio_to_ceiling", f.fp8.raw_seconds / f.fp8.sharded_seconds},
                        {"ceiling", job.device == "cuda" ? "memory_bound" : "raw_transport"},
                        {"bound_bytes", f.bound_bytes},
                        {"fp8_wire_bytes", f.fp8.bytes},
                        {"bf16_bytes", f.bf16.bytes},
                        {"elements_checked", f.checked},
                        {"element_mismatches", f.mismatches},
                        {"checksums_ok", f.checksums_ok},
                        {"checksums_total", f.checksums_total},
                        {"verified", verified},
                        {"reps", job.bench_reps},
                        {"warmup", job.bench_warmup}};
    if (job.device == "cuda") {
      j["hbm_gbps"] = f.bound_bytes / f.fp8.raw_seconds / 1e9;
      if (auto info = gpu::QueryDevice(0); info.ok()) j["device_name"] = info->name;
    }
    j.update(extra);
    j["encoding"] = std::string(WireEncodingName(job.inputs.options.encoding));
    if (job.inputs.options.encoding != WireEncoding::kFull) {
      // Each run's last sync, job-wide (the senders' sums), as `bench --json` gives them for bf16.
      j["delta"] = DeltaReportJson(f.fp8_delta);
      j["bf16_delta"] = DeltaReportJson(f.bf16_delta);
    }
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    PrintText(job, *s, f, extra, verified);
  }
  return verified ? kExitOk : kExitFailure;
}

}  // namespace shardsync::cli
