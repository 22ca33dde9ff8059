// GPU sync benchmark: a whole sync job (trainer ranks -> engine ranks, one process per sync rank,
// placed on the node's GPUs) run over cuda_ipc and/or nccl with the GPU pack / verify kernels,
// checked element for element against the synthetic HF tensors, and measured in the same run
// against cudaMemcpy device-to-device of the same bytes, a broadcast-all baseline and the link
// bound. `shardsync bench --device cuda` and tools `shardsync_gpu` call RunGpuBench.
//
// Process model: the calling process forks one child per sync rank BEFORE it touches CUDA (a
// CUDA context does not survive fork) and serves the store; it never initializes CUDA itself.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/safetensors.h"
#include "shardsync/status.h"
#include "shardsync/store.h"

namespace shardsync::gpu {

struct GpuBenchOptions {
  std::string model = "qwen3-8b";          // embedded name or config path (LoadModelSpec)
  std::string trainer = "fsdp=2";          // ParseTrainerSpec
  std::string rollout = "dp=1,tp=2,pp=2";  // ParseRolloutSpec
  std::string engine = "sglang";           // sglang | vllm
  // cuda_ipc: every pair over CUDA IPC (kernels write straight into engine parameters).
  // nccl: pairs on different GPUs over NCCL (pack -> send -> recv -> unpack, double-buffered
  // staging bounded by the bucket cap), same-GPU pairs over cuda_ipc (NCCL cannot).
  std::string transport = "cuda_ipc";
  DType trainer_dtype = DType::kBF16;  // what trainers hold: kF32 (cast while packing) or kBF16
  // How engines check what landed over cuda_ipc. "fused": the engine publishes its own map of
  // every bucket (param offsets in ITS plan) and a checksum accumulator in its memory; the
  // trainer's pack kernel reads every word back through that map right after writing it (L2)
  // and adds it there; the engine compares the accumulator with the sender's checksum.
  // "pass": the engine re-reads every landed byte with its own verify launch after the sync.
  std::string landed_check = "fused";
  // Trainers sharing a GPU pack one after another (a GPU-side wait on the previous trainer's
  // interprocess event) instead of being time-sliced by the GPU.
  bool colocated_turns = true;
  int64_t bucket_bytes = int64_t{512} << 20;
  // GPUs to place ranks on (0: all visible). Trainer t on GPU t % gpus; engine ranks where the
  // engine's own layout rule puts them (SGLang / vLLM: replica d, pp, tp on GPU d*tp*pp + pp*tp +
  // tp, PP-major), colocated with the trainers; with more engine ranks than GPUs, engine rank
  // % gpus (one-GPU dry runs).
  int gpus = 0;
  int iters = 5;   // timed syncs (the median is reported)
  int warmup = 1;  // untimed syncs first (IPC mappings, NCCL channels)
  uint64_t seed = 1;
  bool verify_elements = true;  // compare every engine element with the synthetic HF value
  bool memcpy_baseline = true;  // cudaMemcpy D2D of the same wire bytes on GPU 0, same run
  // Trainer 0 sends every full HF tensor to every engine rank (report: broadcast_mode).
  bool broadcast_baseline = false;
  bool kernel_bench = true;  // pack / unpack / verify GB/s on GPU 0 vs HBM peak
  // Fault: this sync rank SIGKILLs itself mid-sync in the first timed iteration (after its
  // kernels were launched, before its control messages): every other rank must error within
  // `timeout`. -1: no fault.
  int kill_rank = -1;
  Millis timeout{60000};
  std::string log_prefix;  // where child processes write rank logs (empty: stderr)
  // Each engine rank copies its parameters to the host after the timed syncs (and the broadcast
  // baseline) and hands them to this, in its own process: tools write refengine dumps with it
  // for the generation check. Empty: no copy.
  std::function<Status(int replica, int tp_rank, int pp_rank, const std::vector<TensorToWrite>&)>
      engine_dump;
};

struct GpuBenchRank {
  int rank = 0;
  bool is_trainer = false;
  int device = 0;
  std::string error;            // empty when every iteration succeeded
  double seconds_to_error = 0;  // fault runs: from the sync start to this rank's error
  int64_t bytes = 0;            // wire bytes sent (trainer) or received (engine) per sync
  int64_t checksums_ok = 0, checksums_total = 0;
  int64_t element_mismatches = -1;  // engines with verify_elements; -1: not checked
  int64_t elements_checked = 0;
  std::vector<double> seconds;  // per timed iteration
  // GPU time of this rank's one IPC launch (trainer: pack into the engines; engine: verify) per
  // timed iteration, from CUDA events.
  std::vector<double> kernel_seconds;
  // Host clock (seconds) at the steps of the last timed sync: t0, start, turn, launched,
  // flushed (trainer), checksums (engine), t1.
  std::vector<std::pair<std::string, double>> phases;
};

struct GpuBenchReport {
  std::string device_name;
  int gpus = 0;
  std::string model, trainer, rollout, engine, transport;
  std::string trainer_dtype;
  std::string landed_check;
  std::string engine_placement;  // "sglang layout" | "vllm layout" | "engine rank % GPUs ..."
  int nccl_version = 0;
  int64_t wire_bytes = 0;       // bytes the plan moves per sync (job-wide)
  int64_t cross_gpu_bytes = 0;  // of which between different GPUs
  int64_t broadcast_bytes = 0;  // bytes broadcast-all moves per sync
  // Job time per sync = last rank's end - first rank's start (same host clock), median.
  double sync_seconds = 0;
  double sync_gbps = 0;  // wire_bytes / sync_seconds
  std::vector<double> sync_seconds_all;
  double memcpy_seconds = 0;  // cudaMemcpy D2D of wire_bytes on GPU 0 (median)
  double memcpy_gbps = 0;
  double sync_vs_memcpy = 0;  // memcpy_seconds / sync_seconds (goal >= 0.8 colocated)
  // "nccl ring": trainer 0 copies each round into the engine rank on its GPU, which
  // ncclBroadcasts it to the other engine ranks (each on its own GPU); "point-to-point": trainer
  // 0 sends every round to every engine rank (IPC puts on its GPU, ncclSend across GPUs).
  std::string broadcast_mode;
  double broadcast_seconds = 0;
  double speedup_vs_broadcast = 0;
  double link_gbps = 0;      // measured GPU0 -> GPU1 copy bandwidth (2+ GPUs)
  double bound_seconds = 0;  // per-GPU bytes / measured bandwidths, max over GPUs
  double sync_vs_bound = 0;  // sync_seconds / bound_seconds
  // Kernel microbenchmarks on GPU 0 (GB/s of bytes read + written).
  double hbm_peak_gbps = 0;
  double pack_f32_bf16_gbps = 0, pack_bf16_gbps = 0, pack_strided_gbps = 0, unpack_gbps = 0,
         verify_gbps = 0, memcpy_kernel_ref_gbps = 0;
  // Pack with the landed readback (BatchSpec::landed_runs), same sizes as the packs above.
  double pack_landed_bf16_gbps = 0, pack_landed_f32_bf16_gbps = 0;
  int64_t element_mismatches = 0;  // summed over engine ranks
  int64_t elements_checked = 0;
  int64_t checksums_ok = 0, checksums_total = 0;
  bool ok = false;      // every rank succeeded (no fault) / every survivor errored (fault)
  std::string summary;  // one line
  std::vector<GpuBenchRank> ranks;
};

Result<GpuBenchReport> RunGpuBench(const GpuBenchOptions& options);

}  // namespace shardsync::gpu
