// The rank program: trainer ranks fill their shards with synthetic weights and send; engine ranks
// allocate their parameters, receive, and check every element against the HF values it was cut
// from. Bench mode adds the broadcast-all baseline and raw transport puts (bench.cc).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "common/trace.h"
#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/gpu.h"
#include "shardsync/refengine.h"
#include "shardsync/safetensors.h"
#include "shardsync/shard_map.h"
#include "shardsync/synthetic.h"
#include "shardsync/transport.h"

namespace shardsync {

using Clock = std::chrono::steady_clock;

int64_t job_internal::PeakRssBytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
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
  if (!job.verify) a.push_back("--no-verify");
  if (!job.dump_dir.empty()) {
    a.push_back("--dump-dir");
    a.push_back(job.dump_dir);
  }
  return a;
}

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
      {"bench",
       {{"sharded", r.bench.sharded},
        {"broadcast", r.bench.broadcast},
        {"raw", r.bench.raw},
        {"raw_nccl", r.bench.raw_nccl},
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
    r.device = j.at("device");
    r.routes = j.at("routes");
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
  job.verify = !f.no_verify;
  if (f.prefix.empty()) return InvalidArgumentError("--prefix: must not be empty");
  job.prefix = f.prefix;
  job.dump_dir = f.dump_dir;
  // The plan must exist: fail here, naming the field, rather than in every rank.
  SS_RETURN_IF_ERROR(SummarizePlan(in).status());
  return job;
}

int RankSteps(const JobSpec& job) {
  // allocated, connected, one per sync (bench: one per variant), verified.
  return 3 + (job.mode == JobMode::kBench ? 3 : job.syncs);
}

namespace job_internal {

std::vector<BcastBucket> BroadcastBuckets(const std::vector<HfTensor>& inv, int ws, int64_t cap,
                                          std::vector<int64_t>* tensor_offsets) {
  std::vector<BcastBucket> out;
  int64_t at = 0;
  tensor_offsets->assign(inv.size(), 0);
  for (size_t t = 0; t < inv.size(); ++t) {
    const int64_t b = inv[t].numel() * ws;
    (*tensor_offsets)[t] = at;
    if (out.empty() || out.back().bytes + b > cap) out.push_back({t, t, at, 0});
    out.back().t_end = t + 1;
    out.back().bytes += b;
    at += b;
  }
  return out;
}

// Stores float values in `dtype` (f32 / bf16 / f16).
void StoreFloats(const float* in, int64_t n, DType dtype, void* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, in, n * 4);
      return;
    case DType::kBF16: {
      auto* o = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = F32ToBF16(in[i]);
      return;
    }
    default: {
      auto* o = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = F32ToF16(in[i]);
      return;
    }
  }
}

float LoadFloat(const void* p, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return BF16ToF32(static_cast<const uint16_t*>(p)[i]);
    default:
      return F16ToF32(static_cast<const uint16_t*>(p)[i]);
  }
}

Status CheckFloatDType(DType t, std::string_view field) {
  if (t == DType::kF32 || t == DType::kBF16 || t == DType::kF16) return OkStatus();
  return InvalidArgumentError(std::string(field) + ": " + std::string(DTypeName(t)) +
                              " is not supported for synthetic weights (use F32, BF16 or F16)");
}

Result<TrainerShards> FillTrainerShards(const JobSpec& job, int trainer_rank) {
  const PlanInputs& in = job.inputs;
  SS_RETURN_IF_ERROR(CheckFloatDType(in.trainer_dtype, "--trainer-dtype"));
  TrainerShards t;
  std::vector<float> tmp;
  for (const HfTensor& h : HfTensorInventory(in.model)) {
    const Region held = TrainerHeldRegion(in.trainer, trainer_rank, h.shape);
    if (held.empty()) continue;
    const int64_t n = held.numel();
    auto buf = std::make_unique<unsigned char[]>(n * DTypeSize(in.trainer_dtype));
    if (in.trainer_dtype == DType::kF32) {
      FillSyntheticRegion(job.seed, h.name, h.shape, held, reinterpret_cast<float*>(buf.get()));
    } else {
      tmp.resize(n);
      FillSyntheticRegion(job.seed, h.name, h.shape, held, tmp.data());
      StoreFloats(tmp.data(), n, in.trainer_dtype, buf.get());
    }
    t.bindings.push_back({h.name, buf.get(), in.trainer_dtype, held, MemKind::kHost, -1});
    t.buffers.push_back(std::move(buf));
  }
  return t;
}

Result<EngineParams> AllocateEngineParams(const std::vector<EngineParam>& expected, DType dtype) {
  EngineParams e;
  for (const EngineParam& p : expected) {
    const int64_t bytes = p.numel() * DTypeSize(dtype);
    // Garbage, not zeros: a byte the sync forgets must show up in the element check.
    auto buf = std::make_unique<unsigned char[]>(bytes);
    std::memset(buf.get(), 0xA5, bytes);
    e.bindings.push_back({p.name, buf.get(), dtype, p.shape, MemKind::kHost, -1});
    e.buffers.push_back(std::move(buf));
  }
  return e;
}

// Expected element = the synthetic fp32 value, stored in the trainer dtype, cast to the wire
// dtype: the exact path the bytes took. Streams over the runs (no buffer the size of a tensor).
void VerifyEngineParams(const JobSpec& job, const std::vector<EngineParam>& params,
                        const std::vector<DestBinding>& bound, RankResult& out) {
  std::map<std::string, Shape> shapes;
  for (const HfTensor& h : HfTensorInventory(job.inputs.model)) shapes[h.name] = h.shape;
  const DType td = job.inputs.trainer_dtype;
  const DType wd = job.inputs.options.wire_dtype;
  const int ws = DTypeSize(wd);
  auto mismatch = [&](const std::string& name, int64_t element) {
    if (out.element_mismatches++ == 0) {
      out.first_mismatch = name + " element " + std::to_string(element);
    }
  };
  // The bytes a synthetic value has on the wire.
  auto wire_bytes = [&](float v, unsigned char* o) {
    unsigned char t[4];
    StoreFloats(&v, 1, td, t);
    const float back = LoadFloat(t, 0, td);
    StoreFloats(&back, 1, wd, o);
  };
  constexpr int64_t kChunk = 4096;
  std::vector<unsigned char> expect(kChunk * ws);
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = params[i];
    const auto* base = static_cast<const unsigned char*>(bound[i].data);
    for (const Piece& pc : p.pieces) {
      const Shape& src_shape = shapes.at(pc.source);
      const SyntheticTensor t = SyntheticFor(pc.source, src_shape);
      std::vector<std::pair<int64_t, int64_t>> src_runs;
      ForEachRun(pc.src, src_shape,
                 [&](int64_t off, int64_t len) { src_runs.emplace_back(off, len); });
      size_t sr = 0;
      int64_t sr_pos = 0;  // position inside src_runs[sr]
      ForEachRun(pc.dst, p.shape, [&](int64_t off, int64_t len) {
        for (int64_t done = 0; done < len;) {
          const int64_t n = std::min({kChunk, len - done, src_runs[sr].second - sr_pos});
          for (int64_t e = 0; e < n; ++e) {
            wire_bytes(SyntheticValue(job.seed, t, src_runs[sr].first + sr_pos + e),
                       expect.data() + e * ws);
          }
          const unsigned char* got = base + (off + done) * ws;
          if (std::memcmp(got, expect.data(), n * ws) != 0) {
            for (int64_t e = 0; e < n; ++e) {
              if (std::memcmp(got + e * ws, expect.data() + e * ws, ws) != 0) {
                mismatch(p.name, off + done + e);
              }
            }
          }
          done += n;
          sr_pos += n;
          if (sr_pos == src_runs[sr].second) {
            ++sr;
            sr_pos = 0;
          }
        }
      });
      out.elements_checked += pc.src.numel();
    }
    for (const ZeroFill& z : p.zero_fills) {
      ForEachRun(z.dst, p.shape, [&](int64_t off, int64_t len) {
        for (int64_t e = 0; e < len; ++e) {
          for (int b = 0; b < ws; ++b) {
            if (base[(off + e) * ws + b] != 0) {
              mismatch(p.name, off + e);
              break;
            }
          }
        }
      });
      out.elements_checked += z.dst.numel();
    }
  }
}

}  // namespace job_internal

using namespace job_internal;

namespace {

// Engine ranks with --dump-dir: the received parameters as <dump_dir>/rank-<rank>.safetensors.
Status WriteDump(const JobSpec& job, int rank, const SyncRank& who,
                 const std::vector<EngineParam>& expected, const std::vector<DestBinding>& bound) {
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < expected.size(); ++i) {
    const DestBinding& b = bound[i];
    tensors.push_back({expected[i].name,
                       b.dtype,
                       expected[i].shape,
                       {static_cast<const uint8_t*>(b.data),
                        static_cast<size_t>(expected[i].numel() * DTypeSize(b.dtype))}});
  }
  return WriteEngineDump(job.dump_dir + "/rank-" + std::to_string(rank) + ".safetensors", tensors,
                         {who.replica, who.tp_rank, who.pp_rank});
}

}  // namespace

Result<RankResult> RunRank(const JobSpec& job, int rank, StoreClient& store, Transport& transport,
                           const ProgressFn& progress) {
  auto step = [&] {
    if (progress) progress();
  };
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(job.inputs, rank));
  RankResult res;
  res.rank = rank;
  res.is_trainer = who.is_trainer;
  res.replica = who.replica;
  res.tp_rank = who.tp_rank;
  res.pp_rank = who.pp_rank;
  res.trainer_rank = who.trainer_rank;
  if (job.device == "cuda" || job.mode == JobMode::kBench) {
    Status s = job.device == "cuda" ? RunDeviceRank(job, rank, who, store, transport, res, progress)
                                    : RunBenchRank(job, rank, who, store, transport, res, progress);
    res.ok = s.ok();
    if (!s.ok()) res.error = s.ToString();
    res.peak_rss_bytes = PeakRssBytes();
    return res;
  }
  SessionOptions opt;
  opt.prefix = job.prefix;
  opt.connect_timeout = job.timeout;
  opt.sync_timeout = job.timeout;
  SS_ASSIGN_OR_RETURN(auto session, SyncSession::Create(job.inputs, rank, store, transport, opt));
  const auto t0 = Clock::now();
  TrainerShards shards;
  EngineParams params;
  if (who.is_trainer) {
    SS_ASSIGN_OR_RETURN(shards, FillTrainerShards(job, who.trainer_rank));
    for (const SourceBinding& b : shards.bindings) SS_RETURN_IF_ERROR(session->BindSource(b));
  } else {
    SS_ASSIGN_OR_RETURN(
        params, AllocateEngineParams(session->ExpectedParams(), job.inputs.options.wire_dtype));
    for (const DestBinding& b : params.bindings) SS_RETURN_IF_ERROR(session->BindDest(b));
  }
  res.setup_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  step();
  auto finish = [&](const Status& s) {
    res.ok = s.ok();
    res.poisoned = session->IsPoisoned();
    if (!s.ok()) res.error = s.ToString();
    res.peak_rss_bytes = PeakRssBytes();
    return res;
  };
  Status cs = session->Connect();
  if (!cs.ok()) return finish(cs);
  step();
  for (int v = 1; v <= job.syncs; ++v) {
    auto rep = session->Sync(static_cast<uint64_t>(v));
    if (!rep.ok()) return finish(rep.status());
    res.report = *rep;
    step();
  }
  if (!who.is_trainer && job.verify) {
    if (session->IsPoisoned()) {
      return finish(FailedPreconditionError("sync rank " + std::to_string(rank) +
                                            " is poisoned after the last sync"));
    }
    VerifyEngineParams(job, session->ExpectedParams(), params.bindings, res);
    if (res.element_mismatches > 0) {
      return finish(DataLossError(
          "sync rank " + std::to_string(rank) + ": " + std::to_string(res.element_mismatches) +
          " of " + std::to_string(res.elements_checked) +
          " elements differ from the HF values, first: " + res.first_mismatch));
    }
  }
  if (!who.is_trainer && !job.dump_dir.empty()) {
    // The dump is a demo/test artifact: report the sync's memory peak, not the serializer's.
    const int64_t sync_peak = PeakRssBytes();
    Status ds = WriteDump(job, rank, who, session->ExpectedParams(), params.bindings);
    if (!ds.ok()) return finish(ds.Annotate("--dump-dir"));
    step();
    finish(OkStatus());
    res.peak_rss_bytes = sync_peak;
    return res;
  }
  step();
  return finish(OkStatus());
}

Result<RankResult> RunRankProcess(const JobSpec& job, const LaunchEnv& env) {
  const int world = SyncWorldSize(job.inputs);
  if (env.world_size != world) {
    return InvalidArgumentError("WORLD_SIZE: " + std::to_string(env.world_size) +
                                ", but the job's sync world (trainer + engine ranks) is " +
                                std::to_string(world));
  }
  if (env.rank < 0 || env.rank >= world) {
    return InvalidArgumentError("RANK: " + std::to_string(env.rank) + " outside [0, " +
                                std::to_string(world) + ")");
  }
  if (job.transport == "loopback") {
    return InvalidArgumentError(
        "--transport loopback: works within one process only; use --transport ucx for "
        "separate processes (or `shardsync demo --transport loopback`, which runs threads)");
  }
  SS_ASSIGN_OR_RETURN(auto store, StoreClient::Connect(env.store_address, env.token, job.timeout));
  TransportOptions topt;
  std::unique_ptr<Transport> transport;
  if (job.device == "cuda") {
    SS_ASSIGN_OR_RETURN(int device, DeviceOfRank(job, env.rank));
    SS_RETURN_IF_ERROR(gpu::RegisterGpuTransports());
    RouteOptions ro;
    SS_ASSIGN_OR_RETURN(ro.self, gpu::DevicePeerInfo(env.rank, device));
    ro.hint = job.transport == "auto" ? "" : job.transport;
    ro.options.params["device"] = std::to_string(device);
    SS_ASSIGN_OR_RETURN(transport, NewRoutedTransport(std::move(ro)));
  } else {
    SS_ASSIGN_OR_RETURN(transport, CreateTransport(job.transport, topt));
  }
  auto progress = [&store, &job] { store->Add(job.prefix + "progress", 1).status().IgnoreError(); };
  SS_ASSIGN_OR_RETURN(RankResult r, RunRank(job, env.rank, *store, *transport, progress));
  SS_RETURN_IF_ERROR(
      store->Set(job.prefix + "result/" + std::to_string(env.rank), RankResultToJson(r)));
  if (job.device == "cuda" && !r.ok) {
    // Device work may still wait on a dead peer; freeing memory would wait with it (cudaFree
    // synchronizes the device). The result is posted: leave without tearing down.
    std::fprintf(stderr, "shardsync: sync rank %d: %s\n", r.rank, r.error.c_str());
    trace::Flush();
    std::fflush(nullptr);
    _exit(1);
  }
  return r;
}

}  // namespace shardsync
