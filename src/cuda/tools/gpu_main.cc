// shardsync_gpu: the GPU data-path harness (scripts/device_gpu_tests.sh,
// scripts/multigpu_harness.sh).
//   shardsync_gpu bench [--model M --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 --transport
//   cuda_ipc|nccl
//                        --trainer-dtype f32|bf16 --gpus N --iters K --broadcast --kill-rank R ...]
//   shardsync_gpu info
// Prints one JSON object on stdout (the report) and a summary line on stderr; exit 0 iff the run
// met its check (every element equal and every checksum good; or, with --kill-rank, every other
// rank errored within the timeout).
#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "shardsync/gpu.h"
#include "shardsync/gpu_bench.h"
#include "shardsync/model.h"
#include "shardsync/plan.h"
#include "shardsync/refengine.h"
#include "shardsync/shard_map.h"

using namespace shardsync;
using json = nlohmann::json;

namespace {

// The proof that the bytes landed where the engine's math expects them: per replica, greedy
// decoding with the TP x PP reference engine on the parameters the engine ranks held after the
// run (their dumps) against the unsharded model on the synthetic HF weights (bf16, as the wire).
Result<json> GenerationCheckAll(const gpu::GpuBenchOptions& o, const std::string& dir, int n,
                                bool* all_match) {
  SS_ASSIGN_OR_RETURN(ModelSpec model, LoadModelSpec(o.model));
  SS_ASSIGN_OR_RETURN(EngineKind ek, ParseEngineKind(o.engine, "--engine"));
  SS_ASSIGN_OR_RETURN(RolloutSpec rollout, ParseRolloutSpec(o.rollout, ek));
  SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(model, rollout.shard));
  json out = json::array();
  *all_match = true;
  for (int d = 0; d < rollout.dp; ++d) {
    SS_ASSIGN_OR_RETURN(GenerationCheck g,
                        CheckGenerationOfDump(map, dir, d, o.seed, DType::kBF16, n));
    *all_match = *all_match && g.match;
    out.push_back({{"replica", d},
                   {"match", g.match},
                   {"tokens", g.engine_tokens},
                   {"reference_tokens", g.reference_tokens},
                   {"max_logit_diff", g.max_logit_diff},
                   {"logit_tolerance", g.tolerance}});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("shardsync GPU data-path harness");
  app.require_subcommand(1);
  gpu::GpuBenchOptions o;
  std::string dtype = "bf16";
  int64_t timeout_ms = 60000;
  bool no_memcpy = false, no_kernels = false, no_verify = false;
  int gen_tokens = 0;
  std::string dump_dir;
  auto* bench = app.add_subcommand("bench", "run a GPU sync job and its baselines");
  bench->add_option("--model", o.model, "model name or config path");
  bench->add_option("--trainer", o.trainer, "trainer layout (fsdp=N)");
  bench->add_option("--rollout", o.rollout, "rollout layout (dp=,tp=,pp=)");
  bench->add_option("--engine", o.engine, "sglang|vllm");
  bench->add_option("--transport", o.transport, "cuda_ipc|nccl");
  bench->add_option("--trainer-dtype", dtype, "f32|bf16 (what trainers hold)");
  bench->add_option("--landed-check", o.landed_check,
                    "fused (pack kernel reads back through the receiver's map) | pass (receiver "
                    "re-reads every landed byte)");
  bench->add_option("--bucket-bytes", o.bucket_bytes, "bucket cap");
  bench->add_option("--gpus", o.gpus, "GPUs to place ranks on (0: all)");
  bench->add_option("--iters", o.iters, "timed syncs");
  bench->add_option("--warmup", o.warmup, "untimed syncs");
  bench->add_option("--seed", o.seed, "synthetic weights seed");
  bench->add_option("--kill-rank", o.kill_rank, "sync rank that dies mid-sync (fault test)");
  bench->add_option("--timeout-ms", timeout_ms, "per-wait timeout");
  bench->add_option("--log-prefix", o.log_prefix, "per-process stderr logs (PREFIXrankN.log)");
  bench->add_flag("--broadcast", o.broadcast_baseline, "also run the broadcast-all baseline");
  bool no_turns = false;
  bench->add_flag("--no-turns", no_turns,
                  "let trainers sharing a GPU pack concurrently (time-sliced) instead of in turn");
  bench->add_flag("--no-memcpy", no_memcpy, "skip the cudaMemcpy baseline");
  bench->add_flag("--no-kernel-bench", no_kernels, "skip the kernel microbenchmarks");
  bench->add_flag("--no-verify", no_verify, "skip the element-by-element check");
  bench
      ->add_option("--gen-tokens", gen_tokens,
                   "after the run, greedy-decode N tokens per replica with the reference engine "
                   "on the engine ranks' parameters and compare with the unsharded model")
      ->check(CLI::Range(0, 256));
  bench->add_option("--dump-dir", dump_dir,
                    "keep the engine ranks' parameter dumps here (default with --gen-tokens: a "
                    "temporary directory, removed)");
  auto* info = app.add_subcommand("info", "device and NCCL information");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {  // bad flags: exit 2 with the message, like shardsync
    std::cerr << "shardsync_gpu: " << e.what() << std::endl;
    return 2;
  }
  spdlog::set_level(spdlog::level::warn);  // stdout carries the JSON report only

  if (info->parsed()) {
    std::string why;
    json j;
    j["available"] = gpu::Available(&why);
    j["reason"] = why;
    if (auto n = gpu::DeviceCount(); n.ok()) {
      for (int d = 0; d < *n; ++d) {
        if (auto i = gpu::QueryDevice(d); i.ok()) {
          j["devices"].push_back({{"index", d},
                                  {"name", i->name},
                                  {"sms", i->sm_count},
                                  {"bytes", i->total_bytes},
                                  {"hbm_peak_gbps", i->hbm_peak_gbps},
                                  {"pci", i->pci_bus_id}});
        }
      }
    }
    auto v = gpu::NcclVersion();
    j["nccl"] = v.ok() ? json(*v) : json(v.status().ToString());
    std::cout << j.dump(2) << std::endl;
    return 0;
  }
  auto dt = ParseDType(dtype, "--trainer-dtype");
  if (!dt.ok()) {
    std::cerr << dt.status().ToString() << std::endl;
    return 2;
  }
  o.trainer_dtype = *dt;
  o.timeout = Millis(timeout_ms);
  o.memcpy_baseline = !no_memcpy;
  o.kernel_bench = !no_kernels;
  o.colocated_turns = !no_turns;
  o.verify_elements = !no_verify;
  std::string dumps = dump_dir;
  bool remove_dumps = false;
  if (gen_tokens > 0 || !dump_dir.empty()) {
    std::error_code ec;
    if (dumps.empty()) {
      std::string tmpl =
          (std::filesystem::temp_directory_path(ec) / "shardsync-gpu-XXXXXX").string();
      if (mkdtemp(tmpl.data()) == nullptr) {
        std::cerr << "--gen-tokens: cannot create a temporary directory for the dumps" << std::endl;
        return 1;
      }
      dumps = tmpl;
      remove_dumps = true;
    } else if (!std::filesystem::create_directories(dumps, ec) && ec) {
      std::cerr << "--dump-dir: cannot create '" << dumps << "': " << ec.message() << std::endl;
      return 2;
    }
    o.engine_dump = [dumps](int replica, int tp, int pp, const std::vector<TensorToWrite>& t) {
      const std::string path = dumps + "/replica-" + std::to_string(replica) + "-pp" +
                               std::to_string(pp) + "-tp" + std::to_string(tp) + ".safetensors";
      return WriteEngineDump(path, t, EngineDumpInfo{replica, tp, pp});
    };
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{remove_dumps ? dumps : std::string()};
  auto r = gpu::RunGpuBench(o);
  if (!r.ok()) {
    std::cerr << r.status().ToString() << std::endl;
    return r.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  const gpu::GpuBenchReport& p = *r;
  json ranks = json::array();
  for (const auto& x : p.ranks) {
    ranks.push_back({{"rank", x.rank},
                     {"trainer", x.is_trainer},
                     {"device", x.device},
                     {"error", x.error},
                     {"seconds_to_error", x.seconds_to_error},
                     {"bytes", x.bytes},
                     {"checksums_ok", x.checksums_ok},
                     {"checksums_total", x.checksums_total},
                     {"element_mismatches", x.element_mismatches},
                     {"elements_checked", x.elements_checked},
                     {"seconds", x.seconds},
                     {"kernel_seconds", x.kernel_seconds},
                     {"phases", x.phases}});
  }
  json j = {{"device", p.device_name},
            {"gpus", p.gpus},
            {"model", p.model},
            {"trainer", p.trainer},
            {"rollout", p.rollout},
            {"engine", p.engine},
            {"transport", p.transport},
            {"trainer_dtype", p.trainer_dtype},
            {"landed_check", p.landed_check},
            {"engine_placement", p.engine_placement},
            {"nccl_version", p.nccl_version},
            {"wire_bytes", p.wire_bytes},
            {"cross_gpu_bytes", p.cross_gpu_bytes},
            {"broadcast_bytes", p.broadcast_bytes},
            {"sync_seconds", p.sync_seconds},
            {"sync_gbps", p.sync_gbps},
            {"sync_seconds_all", p.sync_seconds_all},
            {"memcpy_seconds", p.memcpy_seconds},
            {"memcpy_gbps", p.memcpy_gbps},
            {"sync_vs_memcpy", p.sync_vs_memcpy},
            {"broadcast_mode", p.broadcast_mode},
            {"broadcast_seconds", p.broadcast_seconds},
            {"speedup_vs_broadcast", p.speedup_vs_broadcast},
            {"link_gbps", p.link_gbps},
            {"bound_seconds", p.bound_seconds},
            {"sync_vs_bound", p.sync_vs_bound},
            {"hbm_peak_gbps", p.hbm_peak_gbps},
            {"pack_f32_bf16_gbps", p.pack_f32_bf16_gbps},
            {"pack_bf16_gbps", p.pack_bf16_gbps},
            {"pack_strided_gbps", p.pack_strided_gbps},
            {"unpack_gbps", p.unpack_gbps},
            {"verify_gbps", p.verify_gbps},
            {"pack_landed_bf16_gbps", p.pack_landed_bf16_gbps},
            {"pack_landed_f32_bf16_gbps", p.pack_landed_f32_bf16_gbps},
            {"memcpy_kernel_ref_gbps", p.memcpy_kernel_ref_gbps},
            {"element_mismatches", p.element_mismatches},
            {"elements_checked", p.elements_checked},
            {"checksums_ok", p.checksums_ok},
            {"checksums_total", p.checksums_total},
            {"ok", p.ok},
            {"summary", p.summary},
            {"ranks", ranks}};
  bool gen_ok = true;
  if (gen_tokens > 0 && p.ok) {
    auto g = GenerationCheckAll(o, dumps, gen_tokens, &gen_ok);
    if (g.ok()) {
      j["generation"] = *g;
    } else {
      gen_ok = false;
      j["generation_error"] = g.status().ToString();
    }
  }
  j["generation_match"] = gen_tokens > 0 ? json(gen_ok && p.ok) : json(nullptr);
  std::cout << j.dump(2) << std::endl;
  std::cerr << p.summary << std::endl;
  if (gen_tokens > 0) {
    if (j.contains("generation")) {
      for (const json& g : j["generation"]) {
        std::cerr << "generation replica " << g["replica"] << ": tokens " << g["tokens"].dump()
                  << " reference " << g["reference_tokens"].dump() << " max |dlogit| "
                  << g["max_logit_diff"] << (g["match"].get<bool>() ? " MATCH" : " MISMATCH")
                  << std::endl;
      }
    } else if (j.contains("generation_error")) {
      std::cerr << "generation: " << j["generation_error"].get<std::string>() << std::endl;
    }
  }
  return p.ok && gen_ok ? 0 : 1;
}
