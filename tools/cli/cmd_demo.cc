// `shardsync demo`: the main job. One trainer (synthetic weights) and one rollout engine layout
// on this host; every engine parameter synced point to point, checksum-verified, and compared
// element by element with the HF values it was cut from.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "command.h"
#include "delta_json.h"
#include "job/launcher.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/layout.h"
#include "shardsync/plan.h"
#include "shardsync/refengine.h"
#include "shardsync/shard_map.h"

namespace shardsync::cli {

void AddJobFlags(CLI::App* sub, JobFlags* f);

// Shared by demo and bench: "1.23 GB" style sizes and the progress bar.
std::string HumanBytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) {
    b /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

std::function<void(int, int)> ProgressBar(const std::string& label, bool enabled) {
  if (!enabled) return nullptr;
  return [label](int done, int total) {
    const int width = 30;
    const int fill = total > 0 ? std::min(width, done * width / total) : 0;
    std::fprintf(stderr, "\r%s [%s%s] %d/%d steps", label.c_str(), std::string(fill, '#').c_str(),
                 std::string(width - fill, ' ').c_str(), done, total);
    if (done >= total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  };
}

bool OnTerminal() { return isatty(STDOUT_FILENO) && isatty(STDERR_FILENO); }

void PhaseLine(const std::string& label, const std::string& what) {
  if (OnTerminal()) return;  // the bar speaks for itself there
  std::fprintf(stderr, "%s: %s\n", label.c_str(), what.c_str());
  std::fflush(stderr);
}

// Progress of a local job on stderr. On a terminal: the redrawn bar (not with --json). Elsewhere
// (CI logs, pipes, nohup): one line per milestone every rank has passed, named by `phases` when
// given, so a long run is never silent and a log holds no carriage returns.
std::function<void(int, int)> JobProgress(const std::string& label, bool json, int world,
                                          std::vector<std::string> phases) {
  if (OnTerminal()) return ProgressBar(label, !json);
  auto shown = std::make_shared<int>(0);
  return [label, world, phases = std::move(phases), shown](int done, int total) {
    const int steps = world > 0 ? total / world : 0;
    // The launcher reports job-wide counts; milestone k is passed once k * world of them are.
    const int reached = world > 0 ? std::min(done / world, steps) : 0;
    for (int k = *shown + 1; k <= reached; ++k) {
      if (k <= static_cast<int>(phases.size())) {
        std::fprintf(stderr, "%s: [%d/%d] %s (every rank)\n", label.c_str(), k, steps,
                     phases[k - 1].c_str());
      } else {
        std::fprintf(stderr, "%s: every rank passed milestone %d\n", label.c_str(), k);
      }
    }
    if (reached > *shown) {
      *shown = reached;
      std::fflush(stderr);
    }
  };
}

// The plan summary demo and bench print; block FP8: also in *fp8, whose codec figures (quantized
// elements, wire bytes by encoding) they print beside it.
Result<PlanSummary> JobPlanSummary(const PlanInputs& in, std::optional<PlanSummary>* fp8) {
  SS_ASSIGN_OR_RETURN(PlanSummary s, SummarizePlan(in));
  if (in.model.quant) *fp8 = s;
  return s;
}

std::string Fp8SummaryText(const PlanInputs& in, const PlanSummary& s) {
  std::string o = "quant      block FP8 (" + QuantConfigToString(*in.model.quant) + ", from " +
                  in.model.quant->origin +
                  "): " + std::to_string(s.sender_quantized_elements + s.amax_elements) +
                  " elements quantized by the trainer ranks (" + std::to_string(s.amax_elements) +
                  " in " + std::to_string(s.amax_blocks) + " blocks they share, amax exchanged), " +
                  std::to_string(s.receiver_quantized_elements) + " by the engine ranks (" +
                  std::to_string(s.staged_bands) + " bands straddling trainer ranks, staged)\n";
  o += "           wire: " + HumanBytes(static_cast<double>(s.quantize_bytes + s.amax_bytes)) +
       " e4m3 + scales, " + HumanBytes(static_cast<double>(s.stage_bytes)) + " staged raw, " +
       HumanBytes(static_cast<double>(s.copy_bytes)) + " unquantized copies\n";
  return o;
}

nlohmann::json Fp8SummaryJson(const PlanInputs& in, const PlanSummary& s) {
  return {{"method", "fp8"},
          {"weight_block_size", {in.model.quant->block_n, in.model.quant->block_k}},
          {"origin", in.model.quant->origin},
          {"sender_quantized_elements", s.sender_quantized_elements},
          {"receiver_quantized_elements", s.receiver_quantized_elements},
          {"staged_bands", s.staged_bands},
          {"quantize_bytes", s.quantize_bytes},
          {"stage_bytes", s.stage_bytes},
          {"copy_bytes", s.copy_bytes},
          {"bound_read_bytes", s.bound_read_bytes},
          {"bound_write_bytes", s.bound_write_bytes}};
}

LocalJobOptions::Mode ParseLaunch(const std::string& s) {
  if (s == "threads") return LocalJobOptions::Mode::kThreads;
  if (s == "processes") return LocalJobOptions::Mode::kProcesses;
  return LocalJobOptions::Mode::kAuto;
}

namespace {

struct DemoFlags {
  JobFlags job;
  bool json = false;
  std::string launch = "auto";
  int job_timeout_s = 600;
  int gen_tokens = 8;  // 0: no generation step
  bool emulate_nodes = false;
};

std::string TokenList(const std::vector<int64_t>& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.size(); ++i) s += (i ? ", " : "") + std::to_string(t[i]);
  return s + "]";
}

// Where the engine ranks land: GPU by the engine's own placement rule on one node.
std::string GpuOf(const Layout* layout, int replica, int tp, int pp) {
  if (layout == nullptr) return "-";
  for (const EngineRankPlacement& e : layout->replicas[replica].engine_ranks) {
    if (e.tp == tp && e.pp == pp) return "GPU " + std::to_string(e.gpu);
  }
  return "-";
}

int64_t SatMul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}
int64_t SatAdd(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}

// Host memory the whole demo takes on this host, checked before a rank starts: an absurd but
// valid config is bad input (exit 2), not ranks aborting on std::bad_alloc. Trainer shards in
// the trainer dtype, every engine rank's parameters, and for the generation check the
// unsharded fp32 reference beside the dumps and their fp32 copy.
Status CheckDemoFitsHost(const PlanInputs& in, const PlanSummary& summary, bool generation) {
  const std::vector<HfTensor> inv = HfTensorInventory(in.model);
  int64_t trainer = 0, elements = 0, engine = 0;
  for (const HfTensor& t : inv) {
    elements = SatAdd(elements, t.numel());
    for (int r = 0; r < in.trainer.world() && trainer < INT64_MAX; ++r) {
      trainer = SatAdd(trainer, TrainerHeldRegion(in.trainer, r, t.shape).numel());
    }
  }
  if (in.trainer.kind == TrainerSpec::Kind::kMegatron) {
    // Megatron ranks hold local parameters (padded vocab rows included), not HF slabs.
    for (int r = 0; r < in.trainer.world() && trainer < INT64_MAX; ++r) {
      SS_ASSIGN_OR_RETURN(TrainerRankParams tp,
                          BuildTrainerParams(in.model, in.trainer, r, in.trainer_dtype));
      for (const TrainerParam& p : tp.params) trainer = SatAdd(trainer, p.numel());
    }
  }
  trainer = SatMul(trainer, DTypeSize(in.trainer_dtype));
  for (const EngineRankSummary& e : summary.engine_ranks) engine = SatAdd(engine, e.owned_bytes);
  int64_t total = SatAdd(trainer, engine);
  if (generation) {
    const int64_t fp32_engine = SatMul(engine / DTypeSize(in.options.wire_dtype), 4);
    total = SatAdd(total, SatAdd(SatMul(elements, 4), SatAdd(engine, fp32_engine)));
  }
  return CheckHostMemory(total, "--model " + in.model.name,
                         "the demo (trainer shards, engine parameters" +
                             std::string(generation ? ", generation check" : "") + ")",
                         /*this_process=*/false);
}

int Run(const DemoFlags& f) {
  auto job = JobSpecFromFlags(f.job, /*all_local=*/true);
  if (!job.ok()) return ReportError(job.status());
  if (f.job_timeout_s < 1) {
    return ReportError(InvalidArgumentError("--job-timeout-s: must be positive"));
  }
  if (f.job.mode != "sync") {
    return ReportError(InvalidArgumentError("--mode: demo always syncs (got '" + f.job.mode +
                                            "'); `shardsync bench` runs the bench mode"));
  }
  if (f.gen_tokens < 0 || f.gen_tokens > 256) {
    return ReportError(InvalidArgumentError("--gen-tokens: must be in [0, 256], got " +
                                            std::to_string(f.gen_tokens)));
  }
  if (f.emulate_nodes) {
    if (Status s = CheckEmulateNodes(*job, ParseLaunch(f.launch)); !s.ok()) return ReportError(s);
  }
  const PlanInputs& in = job->inputs;
  std::optional<PlanSummary> fp8;
  auto summary = JobPlanSummary(in, &fp8);
  if (!summary.ok()) return ReportError(summary.status());
  if (Status s = CheckDemoFitsHost(in, *summary, f.gen_tokens > 0); !s.ok()) {
    return ReportError(s);
  }
  auto map = BuildShardMap(in.model, in.rollout.shard);
  if (!map.ok()) return ReportError(map.status());
  RolloutLayoutSpec ls;
  ls.dp = in.rollout.dp;
  ls.tp = in.rollout.shard.tp;
  ls.pp = in.rollout.shard.pp;
  ls.engine = in.rollout.shard.engine == EngineKind::kVllm ? EngineConvention::kVllm
                                                           : EngineConvention::kSglang;
  auto layout = ComputeLayout(Cluster::Uniform(1, in.rollout.world()), ls);
  const int world = SyncWorldSize(in);
  PhaseLine("shardsync demo", in.model.name + ": " + std::to_string(summary->ops) + " ops in " +
                                  std::to_string(summary->messages) +
                                  " messages planned; launching " + std::to_string(world) +
                                  " sync ranks, transport " + job->transport);

  LocalJobOptions lo;
  lo.job = *job;
  // Engine dumps and the ranks' logs live in one temporary directory, removed however the demo
  // ends (SIGINT / SIGTERM included).
  TempDir dumps;
  if (Status s = dumps.Create("demo"); !s.ok()) return ReportError(s);
  if (f.gen_tokens > 0) lo.job.dump_dir = dumps.path;
  lo.log_dir = dumps.path;
  lo.job.mode = JobMode::kSync;
  lo.mode = ParseLaunch(f.launch);
  lo.emulate_nodes = f.emulate_nodes;
  lo.job_timeout = Millis(int64_t{f.job_timeout_s} * 1000);
  // RankSteps: allocated, connected, each sync, verified (launcher.h).
  std::vector<std::string> phases = {"parameters allocated and bound", "connected"};
  for (int v = 1; v <= lo.job.syncs; ++v) phases.push_back("sync " + std::to_string(v));
  phases.push_back(lo.job.verify ? "elements verified" : "done");
  lo.on_progress = JobProgress("shardsync demo", f.json, world, std::move(phases));
  auto res = RunLocalJob(lo);
  if (!res.ok()) return ReportError(res.status());

  const int S = in.trainer.world();
  const RankResult* any = nullptr;
  int64_t checked = 0, mismatches = 0;
  for (const RankResult& r : res->ranks) {
    if (r.ok && !any) any = &r;
    checked += r.elements_checked;
    mismatches += r.element_mismatches;
  }
  const bool verified = res->ok() && any != nullptr && mismatches == 0 &&
                        any->report.checksums_ok == any->report.checksums_total &&
                        any->report.checksums_total > 0;
  const SyncReport rep = any ? any->report : SyncReport{};

  std::optional<GenerationCheck> gen;
  std::string gen_error;
  if (verified && f.gen_tokens > 0) {
    if (!f.json || !OnTerminal()) {
      std::fprintf(stderr, "shardsync demo: generating %d tokens on both sides\n", f.gen_tokens);
    }
    // Greedy-decode from a fixed prompt with the sharded TP x PP engine on the parameters the
    // engine ranks received (their dumps) and with the unsharded model on the trainer's weights.
    auto g = CheckGenerationOfDump(*map, dumps.path, 0, job->seed, in.options.wire_dtype,
                                   f.gen_tokens, in.trainer_dtype);
    if (g.ok()) {
      gen = *g;
    } else {
      gen_error = g.status().ToString();
    }
  }
  const bool generation_ok = f.gen_tokens == 0 || (gen.has_value() && gen->match);

  if (f.json) {
    // Distinct host identities the rank processes reported: one per rank with --emulate-nodes.
    std::set<std::string> hosts;
    for (const RankResult& r : res->ranks) {
      if (!r.host_id.empty()) hosts.insert(r.host_id);
    }
    nlohmann::json recv = nlohmann::json::array(), owned = nlohmann::json::array(),
                   rss = nlohmann::json::array(), rank_seconds = nlohmann::json::array();
    for (const RankResult& r : res->ranks) {
      rss.push_back(r.peak_rss_bytes);
      rank_seconds.push_back(r.report.local.seconds);
      if (!r.is_trainer) recv.push_back(r.report.local.recv_bytes);
    }
    for (const EngineRankSummary& e : summary->engine_ranks) owned.push_back(e.owned_bytes);
    nlohmann::json j = {{"verified", verified},
                        {"version", rep.version},
                        {"bytes", rep.bytes},
                        {"seconds", rep.seconds},
                        {"gbps", rep.gbps},
                        {"checksums_ok", rep.checksums_ok},
                        {"checksums_total", rep.checksums_total},
                        {"recv_bytes_per_engine_rank", recv},
                        {"owned_bytes_per_engine_rank", owned},
                        {"peak_rss_bytes", rss},
                        {"rank_seconds", rank_seconds},
                        {"elements_checked", checked},
                        {"element_mismatches", mismatches},
                        {"transport", job->transport},
                        {"emulate_nodes", f.emulate_nodes},
                        {"nodes", hosts.size()},
                        {"plan_hash", summary->plan_hash}};
    j["commit"] = job->staged() ? "staged" : "inplace";
    j["encoding"] = std::string(WireEncodingName(job->inputs.options.encoding));
    if (job->inputs.options.encoding != WireEncoding::kFull) {
      // The last sync's delta figures, job-wide (the senders' sums: session.h DeltaSyncStats).
      j["delta"] = DeltaReportJson(rep.delta);
    }
    if (job->staged()) {
      // Per engine rank: the last sync's transfer, the last commit's stall, the staging area.
      nlohmann::json transfer = nlohmann::json::array(), stall = nlohmann::json::array(),
                     staging = nlohmann::json::array();
      double max_stall = 0;
      for (const RankResult& r : res->ranks) {
        if (r.is_trainer) continue;
        transfer.push_back(r.transfer_seconds);
        stall.push_back(r.stall_seconds);
        staging.push_back(r.staging_bytes);
        max_stall = std::max(max_stall, r.stall_seconds);
        j["keep_previous"] = r.keep_previous;
        j["committed_version"] = r.committed_version;
      }
      j["transfer_seconds"] = transfer;
      j["stall_seconds"] = stall;
      j["staging_bytes"] = staging;
      j["max_stall_seconds"] = max_stall;
    }
    if (fp8) j["quant"] = Fp8SummaryJson(in, *fp8);
    if (gen) {
      j["generation_match"] = gen->match;
      j["tokens"] = gen->engine_tokens;
      j["reference_tokens"] = gen->reference_tokens;
      j["prompt"] = gen->prompt;
      j["max_logit_diff"] = gen->max_logit_diff;
      j["logit_tolerance"] = gen->tolerance;
    } else if (f.gen_tokens > 0) {
      j["generation_match"] = false;
      if (!gen_error.empty()) j["generation_error"] = gen_error;
    }
    if (!verified) {
      j["error"] = res->FirstError();
      nlohmann::json errs = nlohmann::json::object();
      for (const RankResult& r : res->ranks) {
        if (!r.ok) errs[std::to_string(r.rank)] = r.error;
      }
      j["rank_errors"] = errs;
    }
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    const auto& m = in.model;
    int64_t params = 0;
    for (const HfTensor& t : HfTensorInventory(m)) params += t.numel();
    std::printf("shardsync demo: %s (%.1fM params, %lld layers), synthetic weights seed %llu\n",
                m.name.c_str(), params / 1e6, static_cast<long long>(m.num_hidden_layers),
                static_cast<unsigned long long>(job->seed));
    std::printf(
        "layout     trainer %s (%s shards) = sync ranks 0-%d; rollout %s dp=%d tp=%d pp=%d\n",
        in.trainer.ToString().c_str(), std::string(DTypeName(in.trainer_dtype)).c_str(), S - 1,
        std::string(EngineKindName(in.rollout.shard.engine)).c_str(), in.rollout.dp,
        in.rollout.shard.tp, in.rollout.shard.pp);
    std::printf("           transport %s, one %s per sync rank on this host%s\n",
                job->transport.c_str(), job->transport == "loopback" ? "thread" : "process",
                f.emulate_nodes ? ", each its own emulated node" : "");
    std::printf(
        "plan       %s, %lld ops in %lld messages; bytes per engine rank vs broadcast-all "
        "(%s each):\n",
        summary->plan_hash.substr(0, 12).c_str(), static_cast<long long>(summary->ops),
        static_cast<long long>(summary->messages),
        HumanBytes(summary->broadcast_recv_bytes_per_rank).c_str());
    for (size_t i = 0; i < summary->engine_ranks.size(); ++i) {
      const EngineRankSummary& e = summary->engine_ranks[i];
      const int sync_rank = S + static_cast<int>(i);
      int64_t measured = -1, rss = 0;
      for (const RankResult& r : res->ranks) {
        if (r.rank == sync_rank) {
          measured = r.report.local.recv_bytes;
          rss = r.peak_rss_bytes;
        }
      }
      const auto& er = map->rank(e.tp_rank, e.pp_rank);
      std::printf(
          "  sync rank %-3d replica %d tp %d pp %d  %-6s layers %lld-%lld  received %s "
          "(owned %s, %.1fx less than broadcast)  peak RSS %s\n",
          sync_rank, e.replica, e.tp_rank, e.pp_rank,
          GpuOf(layout.ok() ? &*layout : nullptr, e.replica, e.tp_rank, e.pp_rank).c_str(),
          static_cast<long long>(er.layer_start), static_cast<long long>(er.layer_end - 1),
          measured >= 0 ? HumanBytes(measured).c_str() : "?", HumanBytes(e.owned_bytes).c_str(),
          e.owned_bytes > 0 ? double(summary->broadcast_recv_bytes_per_rank) / e.owned_bytes : 0.0,
          HumanBytes(rss).c_str());
    }
    std::string trss;
    for (const RankResult& r : res->ranks) {
      if (r.is_trainer) trss += (trss.empty() ? "" : ", ") + HumanBytes(r.peak_rss_bytes);
    }
    std::printf("  trainer peak RSS: %s\n", trss.c_str());
    if (rep.version > 0) {
      std::printf("sync       version %llu: %s in %.3f s = %.2f GB/s (slowest: sync rank %d)\n",
                  static_cast<unsigned long long>(rep.version), HumanBytes(rep.bytes).c_str(),
                  rep.seconds, rep.gbps, rep.slowest_rank);
      std::printf("checksums  %lld/%lld buckets verified\n",
                  static_cast<long long>(rep.checksums_ok),
                  static_cast<long long>(rep.checksums_total));
      if (job->inputs.options.encoding != WireEncoding::kFull) {
        const DeltaSyncStats& d = rep.delta;
        std::printf(
            "delta      %s on the wire of %s whole (%.2f%%), %.4f%% of elements changed; %lld "
            "buckets as deltas, %lld whole (fallbacks: %lld no kept image, %lld base version, "
            "%lld base checksum; %lld by size, %lld by cost, %lld as auto ran full)\n",
            HumanBytes(static_cast<double>(d.wire_bytes)).c_str(),
            HumanBytes(static_cast<double>(d.full_bytes)).c_str(),
            d.full_bytes ? 100.0 * d.wire_bytes / d.full_bytes : 0.0,
            d.elements ? 100.0 * d.changed / d.elements : 0.0,
            static_cast<long long>(d.buckets_delta), static_cast<long long>(d.buckets_full),
            static_cast<long long>(d.fallback_no_image), static_cast<long long>(d.fallback_version),
            static_cast<long long>(d.fallback_checksum), static_cast<long long>(d.full_by_size),
            static_cast<long long>(d.full_by_cost), static_cast<long long>(d.full_by_auto));
      }
    }
    if (job->staged()) {
      double max_stall = 0, max_transfer = 0;
      int64_t staging = 0;
      std::string keep;
      for (const RankResult& r : res->ranks) {
        if (r.is_trainer) continue;
        max_stall = std::max(max_stall, r.stall_seconds);
        max_transfer = std::max(max_transfer, r.transfer_seconds);
        staging = std::max(staging, r.staging_bytes);
        keep = r.keep_previous;
      }
      std::printf(
          "commit     staged: transfer %.3f s while serving, stall %.4f s (commit, slowest "
          "engine rank); staging up to %s per engine rank, rollback kept by %s\n",
          max_transfer, max_stall, HumanBytes(staging).c_str(), keep.c_str());
    }
    if (fp8) std::printf("%s", Fp8SummaryText(in, *fp8).c_str());
    std::printf("elements   %lld checked against the HF values%s, %lld mismatches\n",
                static_cast<long long>(checked),
                fp8 ? " (e4m3 bytes and scales against the quantizer)" : "",
                static_cast<long long>(mismatches));
    if (gen) {
      std::printf("generate   prompt %s, %d greedy tokens:\n", TokenList(gen->prompt).c_str(),
                  static_cast<int>(gen->engine_tokens.size()));
      std::printf("  engine  (sharded tp=%d pp=%d, received params): %s\n", in.rollout.shard.tp,
                  in.rollout.shard.pp, TokenList(gen->engine_tokens).c_str());
      std::printf("  trainer (unsharded, trainer weights):           %s\n",
                  TokenList(gen->reference_tokens).c_str());
      std::printf("  %s: max |logit diff| %.2e (tolerance %.2e)\n",
                  gen->match ? "MATCH" : "MISMATCH", gen->max_logit_diff, gen->tolerance);
    } else if (!gen_error.empty()) {
      std::printf("generate   failed: %s\n", gen_error.c_str());
    }
    std::printf("%s\n", verified && generation_ok
                            ? "VERIFIED: every engine parameter matches the trainer's weights"
                            : "NOT VERIFIED");
  }
  if (!verified) {
    std::fprintf(stderr, "shardsync demo: %s\n",
                 res->ok() ? "verification failed" : res->FailureReport().c_str());
    return kExitFailure;
  }
  if (!generation_ok) {
    std::fprintf(stderr, "shardsync demo: generation check failed: %s\n",
                 gen_error.empty() ? "the engine's tokens or logits differ from the trainer's"
                                   : gen_error.c_str());
    return kExitFailure;
  }
  return kExitOk;
}

Registration reg({"demo", [](CLI::App& app) {
                    auto f = std::make_shared<DemoFlags>();
                    auto* sub = app.add_subcommand(
                        "demo",
                        "The main job: sync a trainer's (synthetic) weights into a rollout "
                        "engine layout on this host, verify every checksum and element");
                    AddJobFlags(sub, &f->job);
                    sub->add_flag("--json", f->json, "Print one JSON object");
                    sub->add_option("--launch", f->launch, "auto | threads | processes")
                        ->check(CLI::IsMember({"auto", "threads", "processes"}))
                        ->capture_default_str();
                    sub->add_option("--gen-tokens", f->gen_tokens,
                                    "Greedy tokens generated on both sides after the sync "
                                    "(0: skip the generation step)")
                        ->capture_default_str();
                    sub->add_option("--job-timeout-s", f->job_timeout_s,
                                    "Kill every rank past this many seconds")
                        ->capture_default_str();
                    sub->add_flag("--emulate-nodes", f->emulate_nodes, kEmulateNodesHelp);
                    return [f] { return Run(*f); };
                  }});

}  // namespace
}  // namespace shardsync::cli
