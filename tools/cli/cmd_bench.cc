// `shardsync bench`: on the demo workload, in one run on one transport: the sharded plan through
// the product's SyncSession, the broadcast-all baseline and the raw ceiling of the same bytes
// (host: raw transport transfers; --device cuda: cudaMemcpy device-to-device, and NCCL send /
// recv of every nccl pair's bytes with the session's communicators). GB/s count bytes landed in
// engine parameters per second; per repetition the slowest rank counts, then the median.
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "command.h"
#include "delta_json.h"
#include "job/launcher.h"
#include "shardsync/gpu.h"
#include "shardsync/plan.h"
#include "shardsync/refengine.h"
#include "shardsync/shard_map.h"

namespace shardsync::cli {

void AddJobFlags(CLI::App* sub, JobFlags* f);
std::string HumanBytes(double b);
std::function<void(int, int)> JobProgress(const std::string& label, bool json, int world,
                                          std::vector<std::string> phases);
void PhaseLine(const std::string& label, const std::string& what);
LocalJobOptions::Mode ParseLaunch(const std::string& s);

using json = nlohmann::json;

// Per replica: greedy tokens of the reference engine on the engine ranks' dumps (TP x PP math on
// the received parameters) against the unsharded model on the synthetic HF weights (block FP8:
// quantized from the trainer's values in its dtype, as the sync does).
Result<json> Generation(const JobSpec& job, const std::string& dir, int n, bool* all) {
  SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(job.inputs.model, job.inputs.rollout.shard));
  json out = json::array();
  *all = true;
  for (int d = 0; d < job.inputs.rollout.dp; ++d) {
    SS_ASSIGN_OR_RETURN(GenerationCheck g,
                        CheckGenerationOfDump(map, dir, d, job.seed, job.inputs.options.wire_dtype,
                                              n, job.inputs.trainer_dtype));
    *all = *all && g.match;
    out.push_back({{"replica", d},
                   {"match", g.match},
                   {"tokens", g.engine_tokens},
                   {"reference_tokens", g.reference_tokens},
                   {"max_logit_diff", g.max_logit_diff},
                   {"tolerance", g.tolerance}});
  }
  return out;
}

struct BenchFlags {
  JobFlags job;
  bool json = false;
  std::string launch = "auto";
  int job_timeout_s = 900;
  int gen_tokens = 0;
  int kill_rank = -1;
  bool emulate_nodes = false;
};

// `bench` on a block-FP8 job (cmd_bench_fp8.cc).
int RunFp8Bench(const JobSpec& job, bool as_json, const std::string& launch, bool emulate_nodes,
                int job_timeout_s, int gen_tokens);

namespace {

// Bytes the plan moves between ranks that `differ` (on different GPUs, or nodes).
Result<int64_t> CrossBytes(const JobSpec& job, const LocalJobResult& res,
                           bool (*differ)(const RankResult&, const RankResult&)) {
  int64_t cross = 0;
  for (int t = 0; t < job.inputs.trainer.world(); ++t) {
    SS_ASSIGN_OR_RETURN(RankPlan plan, PlanForRank(job.inputs, t));
    for (const Message& m : plan.sends) {
      if (differ(res.ranks.at(t), res.ranks.at(m.dst))) cross += m.bytes;
    }
  }
  return cross;
}

}  // namespace

Status AddNodeFigures(const JobSpec& job, const LocalJobResult& res, bool emulate_nodes,
                      json* extra) {
  // Distinct host identities the ranks reported (processes): --emulate-nodes gives one per rank.
  std::set<std::string> hosts;
  for (const RankResult& r : res.ranks) {
    if (!r.host_id.empty()) hosts.insert(r.host_id);
  }
  if (!hosts.empty()) {
    (*extra)["nodes"] = hosts.size();
    // Bytes between nodes (host identities): with --emulate-nodes, what crosses NCCL's sockets
    // (device memory) or UCX's TCP (host memory).
    SS_ASSIGN_OR_RETURN((*extra)["cross_node_bytes"],
                        CrossBytes(job, res, [](const RankResult& a, const RankResult& b) {
                          return a.host_id != b.host_id;
                        }));
  }
  (*extra)["emulate_nodes"] = emulate_nodes;
  return OkStatus();
}

void PrintNodeLine(const json& extra) {
  if (!extra.value("emulate_nodes", false)) return;
  std::printf(
      "  emulated nodes: %d, one per rank process (SHARDSYNC_HOST_ID, NCCL_HOSTID); %s of the "
      "plan between nodes\n",
      extra.value("nodes", 0), HumanBytes(extra.value("cross_node_bytes", int64_t{0})).c_str());
}

namespace {

// --kill-rank: sync rank R is SIGKILLed while the job syncs back to back; every other rank must
// report an error within the timeout. Then the same job, re-connected (fresh processes and
// store prefix), must sync verified.
int RunFault(const BenchFlags& f, const JobSpec& job) {
  const int world = SyncWorldSize(job.inputs);
  if (f.kill_rank >= world) {
    return ReportError(InvalidArgumentError("--kill-rank: " + std::to_string(f.kill_rank) +
                                            " outside the sync world [0, " + std::to_string(world) +
                                            ")"));
  }
  LocalJobOptions lo;
  lo.job = job;
  lo.job.mode = JobMode::kSync;
  lo.job.syncs = 1000;  // back to back: the kill lands inside a sync
  lo.job.verify = false;
  lo.mode = LocalJobOptions::Mode::kProcesses;
  lo.emulate_nodes = f.emulate_nodes;
  lo.job_timeout = Millis(int64_t{f.job_timeout_s} * 1000);
  lo.kill_rank = f.kill_rank;
  lo.kill_at_progress = world * (2 + 3);  // every rank allocated, connected and 3 syncs done
  const auto t0 = std::chrono::steady_clock::now();
  auto res = RunLocalJob(lo);
  if (!res.ok()) return ReportError(res.status());
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bool all_failed = true;
  // --commit staged: every surviving engine rank's live parameters hash as they did after its
  // last commit (nothing of the failed version reached them).
  bool live_intact = true;
  json survivors = json::array();
  for (const RankResult& r : res->ranks) {
    if (r.rank == f.kill_rank) continue;
    all_failed = all_failed && !r.ok;
    json sv = {{"rank", r.rank}, {"ok", r.ok}, {"error", r.error}};
    if (job.staged() && !r.is_trainer) {
      live_intact = live_intact && r.live_intact && !r.live_hash.empty();
      sv["failed_in"] = r.failed_in;
      sv["committed_version"] = r.committed_version;
      sv["live_hash_committed"] = r.live_hash;
      sv["live_hash_after"] = r.live_hash_after;
      sv["live_intact"] = r.live_intact;
    }
    survivors.push_back(sv);
  }
  // The next sync after re-connect.
  LocalJobOptions again = lo;
  again.kill_rank = -1;
  again.job.syncs = 1;
  again.job.verify = true;
  again.job.prefix = job.prefix + "reconnect/";
  auto res2 = RunLocalJob(again);
  bool reconnect_ok = res2.ok() && res2->ok();
  if (reconnect_ok && job.staged()) {
    // The re-connected job's sync committed on every engine rank.
    for (const RankResult& r : res2->ranks) {
      reconnect_ok = reconnect_ok && (r.is_trainer || r.committed_version == 1);
    }
  }
  const bool ok = all_failed && reconnect_ok && live_intact;
  json j = {{"kill_rank", f.kill_rank},
            {"timeout_ms", job.timeout.count()},
            {"fault_job_seconds", wall},
            {"every_survivor_failed", all_failed},
            {"survivors", survivors},
            {"reconnect_ok", reconnect_ok},
            {"commit", job.staged() ? "staged" : "inplace"},
            {"live_intact", live_intact},
            {"reconnect_error", res2.ok() ? res2->FirstError() : res2.status().ToString()},
            {"ok", ok}};
  std::printf("%s\n", f.json ? j.dump().c_str() : j.dump(2).c_str());
  return ok ? kExitOk : kExitFailure;
}

void PrintText(const JobSpec& job, const BenchSummary& b, const json& extra, bool verified,
               bool wire_eq_owned) {
  const auto& in = job.inputs;
  std::printf(
      "shardsync bench: %s, trainer %s -> %s dp=%d tp=%d pp=%d, %s, transport %s, "
      "%d warm-up + %d reps (median; slowest rank per rep)\n",
      in.model.name.c_str(), in.trainer.ToString().c_str(),
      std::string(EngineKindName(in.rollout.shard.engine)).c_str(), in.rollout.dp,
      in.rollout.shard.tp, in.rollout.shard.pp, job.device.c_str(), job.transport.c_str(),
      job.bench_warmup, job.bench_reps);
  std::printf("  bytes landed in engine parameters per sync: %s\n", HumanBytes(b.bytes).c_str());
  std::printf("  sharded (plan + checksums)  %8.4f s  %7.2f GB/s\n", b.sharded_seconds,
              b.sharded_gbps);
  std::printf("  broadcast-all baseline      %8.4f s  %7.2f GB/s\n", b.broadcast_seconds,
              b.broadcast_gbps);
  std::printf("  %-27s %8.4f s  %7.2f GB/s\n",
              job.device == "cuda" ? "cudaMemcpy D2D (ceiling)" : "raw transport (ceiling)",
              b.raw_seconds, b.raw_transport_gbps);
  if (b.raw_nccl_seconds > 0) {
    std::printf("  raw NCCL send/recv (nccl pairs) %8.4f s: sharded runs them at %.2fx of raw\n",
                b.raw_nccl_seconds, b.ratio_to_raw_nccl);
  }
  if (extra.contains("routes")) std::printf("  pairs: %s\n", extra["routes"].dump().c_str());
  PrintNodeLine(extra);
  if (extra.contains("generation")) {
    for (const auto& g : extra["generation"]) {
      std::printf("  generation replica %d: %s %s vs %s\n", g["replica"].get<int>(),
                  g["match"].get<bool>() ? "MATCH" : "MISMATCH", g["tokens"].dump().c_str(),
                  g["reference_tokens"].dump().c_str());
    }
  }
  if (job.staged()) {
    std::printf(
        "  staged commit: stall %.4f s (slowest engine rank's commit) vs %s of every "
        "engine rank's bytes at once %.4f s = %.2fx; transfer %.4f s while serving\n",
        b.stall_seconds, job.device == "cuda" ? "cudaMemcpy" : "memcpy", b.commit_raw_seconds,
        b.commit_raw_seconds > 0 ? b.stall_seconds / b.commit_raw_seconds : 0.0, b.sharded_seconds);
  }
  std::printf("  sharded / raw = %.2f, speedup vs broadcast = %.2fx, wire bytes == owned: %s, %s\n",
              b.ratio_to_raw, b.speedup_vs_broadcast, wire_eq_owned ? "yes" : "NO",
              verified ? "verified" : "NOT VERIFIED");
}

int Run(const BenchFlags& f) {
  auto job = JobSpecFromFlags(f.job, /*all_local=*/true);
  if (!job.ok()) return ReportError(job.status());
  if (f.job_timeout_s < 1) {
    return ReportError(InvalidArgumentError("--job-timeout-s: must be positive"));
  }
  if (f.gen_tokens < 0 || f.gen_tokens > 256) {
    return ReportError(InvalidArgumentError("--gen-tokens: must be in [0, 256]"));
  }
  const LocalJobOptions::Mode mode = job->device == "cuda" || f.kill_rank >= 0
                                         ? LocalJobOptions::Mode::kProcesses
                                         : ParseLaunch(f.launch);
  if (f.emulate_nodes) {
    if (Status s = CheckEmulateNodes(*job, mode); !s.ok()) return ReportError(s);
  }
  if (f.kill_rank >= 0) return RunFault(f, *job);
  if (job->inputs.model.quant) {
    return RunFp8Bench(*job, f.json, f.launch, f.emulate_nodes, f.job_timeout_s, f.gen_tokens);
  }
  auto summary = SummarizePlan(job->inputs);
  if (!summary.ok()) return ReportError(summary.status());
  LocalJobOptions lo;
  lo.job = *job;
  lo.job.mode = JobMode::kBench;
  lo.mode = mode;
  lo.emulate_nodes = f.emulate_nodes;
  lo.job_timeout = Millis(int64_t{f.job_timeout_s} * 1000);
  const int world = SyncWorldSize(job->inputs);
  PhaseLine("shardsync bench",
            job->inputs.model.name + ": " + std::to_string(summary->ops) + " ops planned; " +
                std::to_string(world) + " sync ranks time the sharded sync, broadcast-all and " +
                "the raw transport (" + std::to_string(job->bench_warmup) + " warm-up + " +
                std::to_string(job->bench_reps) + " reps each), transport " + job->transport);
  lo.on_progress = JobProgress("shardsync bench", f.json, world, {});
  // --gen-tokens reads the engine dumps: from --dump-dir when given, else a temporary directory.
  TempDir dumps;
  if (f.gen_tokens > 0 && lo.job.dump_dir.empty()) {
    if (Status s = dumps.Create("bench"); !s.ok()) return ReportError(s);
    lo.job.dump_dir = dumps.path;
  }
  auto res = RunLocalJob(lo);
  if (!res.ok()) return ReportError(res.status());
  PhaseLine("shardsync bench", "every rank finished");
  auto b = SummarizeBench(*res);
  if (!b.ok()) return ReportError(b.status());
  // Wire bytes per engine rank against owned bytes, from the ranks' own accounting.
  bool wire_eq_owned = true;
  for (size_t i = 0; i < summary->engine_ranks.size(); ++i) {
    const RankResult& r = res->ranks.at(job->inputs.trainer.world() + i);
    wire_eq_owned = wire_eq_owned && r.bench.bytes == summary->engine_ranks[i].owned_bytes;
  }
  json extra = json::object();
  bool generation_ok = true;
  if (f.gen_tokens > 0) {
    auto g = Generation(*job, lo.job.dump_dir, f.gen_tokens, &generation_ok);
    if (!g.ok()) return ReportError(g.status());
    extra["generation"] = *g;
  }
  const RankResult& r0 = res->ranks.at(0);
  if (Status st = AddNodeFigures(*job, *res, f.emulate_nodes, &extra); !st.ok()) {
    return ReportError(st);
  }
  if (job->device == "cuda") {
    json routes = json::object();
    for (const RankResult& r : res->ranks) {
      if (!r.routes.empty()) routes[std::to_string(r.rank)] = r.routes;
    }
    extra["routes"] = routes;
    auto cross = CrossBytes(
        *job, *res, [](const RankResult& a, const RankResult& b) { return a.device != b.device; });
    if (!cross.ok()) return ReportError(cross.status());
    extra["cross_gpu_bytes"] = *cross;
    if (auto info = gpu::QueryDevice(0); info.ok()) extra["device_name"] = info->name;
    if (auto n = gpu::DeviceCount(); n.ok()) extra["gpus_visible"] = *n;
  }
  // Device runs also carry the last sharded sync's job report (every bucket's checksum).
  const bool sums_ok =
      job->device != "cuda" ||
      (r0.report.checksums_total > 0 && r0.report.checksums_ok == r0.report.checksums_total);
  const bool verified = b->verified && wire_eq_owned && generation_ok && sums_ok;
  if (f.json) {
    json j = {{"device", job->device},
              {"sharded_gbps", b->sharded_gbps},
              {"broadcast_gbps", b->broadcast_gbps},
              {"raw_transport_gbps", b->raw_transport_gbps},
              {"ratio_to_raw", b->ratio_to_raw},
              {"speedup_vs_broadcast", b->speedup_vs_broadcast},
              {"raw_nccl_seconds", b->raw_nccl_seconds},
              {"ratio_to_raw_nccl", b->ratio_to_raw_nccl},
              {"verified", verified},
              {"bytes", b->bytes},
              {"sharded_seconds", b->sharded_seconds},
              {"broadcast_seconds", b->broadcast_seconds},
              {"raw_seconds", b->raw_seconds},
              {"wire_bytes_equal_owned", wire_eq_owned},
              {"transport", job->transport},
              {"reps", job->bench_reps},
              {"warmup", job->bench_warmup}};
    j.update(extra);
    j["commit"] = job->staged() ? "staged" : "inplace";
    j["encoding"] = std::string(WireEncodingName(job->inputs.options.encoding));
    if (job->inputs.options.encoding != WireEncoding::kFull) {
      // The last sharded sync's delta figures, job-wide (the senders' sums: session.h
      // DeltaSyncStats), as `demo --json` gives them.
      j["delta"] = DeltaReportJson(r0.report.delta);
    }
    // The engine's stall per sync: in place, the whole transfer (it must be idle while bytes land
    // in its parameters); staged, the commit alone. Per engine rank beside the job's figures.
    j["transfer_seconds"] = b->sharded_seconds;
    j["stall_seconds"] = job->staged() ? b->stall_seconds : b->sharded_seconds;
    if (job->staged()) {
      j["commit_raw_seconds"] = b->commit_raw_seconds;
      j["commit_copy_seconds"] = b->commit_copy_seconds;
      j["stall_over_commit_raw"] =
          b->commit_raw_seconds > 0 ? b->stall_seconds / b->commit_raw_seconds : 0.0;
      json per = json::array();
      for (const RankResult& r : res->ranks) {
        if (r.is_trainer) continue;
        per.push_back({{"rank", r.rank},
                       {"transfer_seconds", r.transfer_seconds},
                       {"stall_seconds", r.stall_seconds},
                       {"staging_bytes", r.staging_bytes},
                       {"keep_previous", r.keep_previous},
                       {"decode_idle_ms", r.bench.decode_idle_ms},
                       {"decode_transfer_ms", r.bench.decode_transfer_ms},
                       {"decode_commit_ms", r.bench.decode_commit_ms}});
      }
      j["engine_ranks"] = per;
    }
    if (job->device == "cuda") {
      j["checksums_ok"] = r0.report.checksums_ok;
      j["checksums_total"] = r0.report.checksums_total;
    }
    int64_t checked = 0, mismatches = 0;
    for (const RankResult& r : res->ranks) {
      checked += r.elements_checked;
      mismatches += r.element_mismatches;
    }
    j["elements_checked"] = checked;
    j["element_mismatches"] = mismatches;
    std::printf("%s\n", j.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  } else {
    PrintText(*job, *b, extra, verified, wire_eq_owned);
  }
  return verified ? kExitOk : kExitFailure;
}

Registration reg({"bench", [](CLI::App& app) {
                    auto f = std::make_shared<BenchFlags>();
                    // 7: a median that holds still on a shared 2-core VM (3 moved by up to 50%).
                    f->job.reps = 7;
                    auto* sub = app.add_subcommand(
                        "bench",
                        "Sharded sync vs broadcast-all vs the raw ceiling on the demo workload");
                    AddJobFlags(sub, &f->job);
                    sub->add_flag("--json", f->json, "Print one JSON object");
                    sub->add_option("--launch", f->launch, "auto | threads | processes")
                        ->check(CLI::IsMember({"auto", "threads", "processes"}))
                        ->capture_default_str();
                    sub->add_option("--job-timeout-s", f->job_timeout_s,
                                    "Kill every rank past this many seconds")
                        ->capture_default_str();
                    sub->add_option("--gen-tokens", f->gen_tokens,
                                    "After the sharded syncs, greedy-decode N tokens per replica "
                                    "with the reference engine on the engine ranks' parameters "
                                    "and compare with the unsharded model");
                    sub->add_flag("--emulate-nodes", f->emulate_nodes, kEmulateNodesHelp);
                    sub->add_option("--kill-rank", f->kill_rank,
                                    "Fault run: SIGKILL this sync rank mid-sync; every other rank "
                                    "must fail within --timeout-ms, then a re-connected job must "
                                    "sync");
                    return [f] { return Run(*f); };
                  }});

}  // namespace
}  // namespace shardsync::cli
