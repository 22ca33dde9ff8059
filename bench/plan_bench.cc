// Planner start-up cost: job-wide summary and the busiest rank's own op list, on one core.
// Counters: peak_rss_mb (getrusage; the process peak, so run one case per process with
// --benchmark_filter for a clean figure), ranks, tensors, pieces, ops, messages.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <sys/resource.h>

#include "plan/planner.h"

namespace shardsync {
namespace {

double PeakRssMb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // ru_maxrss is KiB on Linux
}

PlanInputs Make(const char* model, const char* trainer, const char* rollout) {
  PlanInputs in;
  in.model = LoadModelSpec(model).value();
  in.trainer = ParseTrainerSpec(trainer).value();
  in.rollout = ParseRolloutSpec(rollout, EngineKind::kSglang).value();
  return in;
}

struct Case {
  const char* model;
  const char* trainer;
  const char* rollout;
  bool busiest = true;  // also time the busiest rank (off where its op list alone is GBs)
};
const Case kCases[] = {
    {"qwen3-235b-a22b", "fsdp=1024", "dp=32,tp=8,pp=4"},
    {"qwen3-235b-a22b", "hsdp=128x8", "dp=32,tp=8,pp=4"},
    {"qwen3-8b", "fsdp=8", "dp=2,tp=4,pp=1"},
    {"qwen3-8b", "hsdp=2x4", "dp=2,tp=2,pp=2"},
    // R does not divide D, many chunks: byte-balanced cuts located per chunk.
    {"qwen3-235b-a22b", "hsdp=3x256", "dp=32,tp=8,pp=4"},
    {"qwen3-8b", "replicate=8", "dp=2,tp=4,pp=1"},
    // Growth with ranks (same model) and with tensors (same layout).
    {"qwen3-235b-a22b", "fsdp=256", "dp=8,tp=8,pp=4"},
    {"qwen3-235b-a22b", "fsdp=4096", "dp=128,tp=8,pp=4", false},
    {"qwen3-30b-a3b", "fsdp=1024", "dp=32,tp=8,pp=4"},
    {"qwen3-8b", "fsdp=1024", "dp=32,tp=8,pp=4"},
    // Megatron-Core trainers: box intersections of local parameters with engine pieces.
    {"qwen3-8b", "megatron=tp=2,pp=2", "dp=1,tp=2,pp=2"},
    {"qwen3-235b-a22b", "megatron=tp=4,pp=8,ep=8,etp=1,dp=4,first=10,last=12", "dp=32,tp=8,pp=4"},
};

void SetCounters(benchmark::State& st, const PlanInputs& in, const PlanSummary& s) {
  st.counters["peak_rss_mb"] = PeakRssMb();
  st.counters["ranks"] = SyncWorldSize(in);
  st.counters["tensors"] = static_cast<double>(HfTensorInventory(in.model).size());
  st.counters["ops"] = static_cast<double>(s.ops);
  st.counters["messages"] = static_cast<double>(s.messages);
}

void BM_Summary(benchmark::State& st, Case c) {
  const PlanInputs in = Make(c.model, c.trainer, c.rollout);
  PlanSummary last;
  for (auto _ : st) {
    auto s = SummarizePlan(in);
    if (!s.ok()) {
      st.SkipWithError(s.status().ToString().c_str());
      return;
    }
    last = std::move(*s);
    benchmark::DoNotOptimize(last.ops);
  }
  SetCounters(st, in, last);
}

// The busiest rank (most ops, from the summary) computes its own plan from scratch: shard map,
// context and op list, as at job start.
void BM_BusiestRank(benchmark::State& st, Case c) {
  const PlanInputs in = Make(c.model, c.trainer, c.rollout);
  auto ds = SummarizePlanDetailed(in, SummaryOptions{});
  if (!ds.ok()) {
    st.SkipWithError(ds.status().ToString().c_str());
    return;
  }
  int busiest = 0;
  int64_t most = -1;
  const int S = in.trainer.world();
  for (int t = 0; t < S; ++t) {
    if (ds->trainer_traffic[t].ops > most) most = ds->trainer_traffic[t].ops, busiest = t;
  }
  for (size_t j = 0; j < ds->engine_traffic.size(); ++j) {
    if (ds->engine_traffic[j].ops > most)
      most = ds->engine_traffic[j].ops, busiest = S + static_cast<int>(j);
  }
  int64_t ops = 0;
  for (auto _ : st) {
    auto rp = PlanForRank(in, busiest);
    if (!rp.ok()) {
      st.SkipWithError(rp.status().ToString().c_str());
      return;
    }
    ops = 0;
    for (const auto* v : {&rp->sends, &rp->recvs}) {
      for (const auto& m : *v) ops += static_cast<int64_t>(m.ops.size());
    }
    benchmark::DoNotOptimize(ops);
  }
  SetCounters(st, in, ds->summary);
  st.counters["rank"] = busiest;
  st.counters["rank_ops"] = static_cast<double>(ops);
}

const bool kRegistered = [] {
  for (const Case& c : kCases) {
    const std::string tag = fmt::format("{}/{}/{}", c.model, c.trainer, c.rollout);
    benchmark::RegisterBenchmark(("BM_Summary/" + tag).c_str(), BM_Summary, c)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(1);
    if (!c.busiest) continue;
    benchmark::RegisterBenchmark(("BM_BusiestRank/" + tag).c_str(), BM_BusiestRank, c)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(1);
  }
  return true;
}();

}  // namespace
}  // namespace shardsync

BENCHMARK_MAIN();
