// The rank program: trainer ranks fill their shards with synthetic weights and send; engine ranks
// allocate their parameters, receive, and check every element against the HF values it was cut
// from. Bench mode adds the broadcast-all baseline and raw transport puts (bench.cc).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>

#include "common/trace.h"
#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/checksum.h"
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

namespace {

// Megatron trainers: every local parameter of the rank's trainer map, first filled with garbage
// (0xA5 bytes: the padded vocab rows keep it, so a sync that read them would fail the element
// check), then each piece's synthetic HF values written at its local region.
Result<TrainerShards> FillMegatronParams(const JobSpec& job, int trainer_rank) {
  const PlanInputs& in = job.inputs;
  SS_ASSIGN_OR_RETURN(TrainerRankParams tp,
                      BuildTrainerParams(in.model, in.trainer, trainer_rank, in.trainer_dtype));
  std::map<std::string, Shape> hf;
  for (const HfTensor& h : HfTensorInventory(in.model)) hf[h.name] = h.shape;
  const int ts = DTypeSize(in.trainer_dtype);
  TrainerShards t;
  std::vector<float> tmp;
  for (const TrainerParam& p : tp.params) {
    const int64_t bytes = p.numel() * ts;
    auto buf = std::make_unique<unsigned char[]>(std::max<int64_t>(bytes, 1));
    std::memset(buf.get(), 0xA5, bytes);
    for (const TrainerPiece& pc : p.pieces) {
      tmp.resize(pc.src.numel());
      FillSyntheticRegion(job.seed, pc.source, hf.at(pc.source), pc.src, tmp.data());
      int64_t k = 0;  // src and local have the same extents: row-major order matches
      ForEachRun(pc.local, p.shape, [&](int64_t off, int64_t len) {
        StoreFloats(tmp.data() + k, len, in.trainer_dtype, buf.get() + off * ts);
        k += len;
      });
    }
    SourceBinding b;
    b.data = buf.get();
    b.dtype = in.trainer_dtype;
    b.region = Region::Full(p.shape);
    b.local = p.name;
    b.chunk = p.chunk;
    t.bindings.push_back(std::move(b));
    t.buffers.push_back(std::move(buf));
  }
  return t;
}

}  // namespace

Result<TrainerShards> FillTrainerShards(const JobSpec& job, int trainer_rank) {
  const PlanInputs& in = job.inputs;
  SS_RETURN_IF_ERROR(CheckFloatDType(in.trainer_dtype, "--trainer-dtype"));
  if (in.trainer.kind == TrainerSpec::Kind::kMegatron) return FillMegatronParams(job, trainer_rank);
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

const std::vector<const EncodedParamCheck*>& EncodedChecks() {
  static const std::vector<const EncodedParamCheck*> all = {&BlockQuantCheck()};
  return all;
}

const EncodedParamCheck* EncodedCheckOf(const EngineParam& p) {
  for (const EncodedParamCheck* c : EncodedChecks()) {
    if (c->Owns(p)) return c;
  }
  return nullptr;
}

DType BoundDType(const EngineParam& p, DType wire) {
  const EncodedParamCheck* c = EncodedCheckOf(p);
  return c != nullptr ? c->BoundDType(p, wire) : wire;
}

Result<EngineParams> AllocateEngineParams(const std::vector<EngineParam>& expected, DType dtype) {
  EngineParams e;
  for (const EngineParam& p : expected) {
    // Encoded parameters (block-FP8 weights and scales) in their own dtypes; everything else
    // lands wire bytes.
    const DType t = BoundDType(p, dtype);
    const int64_t bytes = p.numel() * DTypeSize(t);
    // Garbage, not zeros: a byte the sync forgets must show up in the element check.
    auto buf = std::make_unique<unsigned char[]>(bytes);
    std::memset(buf.get(), 0xA5, bytes);
    e.bindings.push_back({p.name, buf.get(), t, p.shape, MemKind::kHost, -1});
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
    if (const EncodedParamCheck* c = EncodedCheckOf(p)) {
      c->VerifyHost(job, params, i, bound, out);
      continue;
    }
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

std::string LiveHash(const std::vector<DestBinding>& bound) {
  uint64_t h = 0;
  for (const DestBinding& d : bound) {
    int64_t n = DTypeSize(d.dtype);
    for (int64_t e : d.shape) n *= e;
    h = (h ^ Checksum(d.data, static_cast<size_t>(n))) * 0x100000001b3ull;
  }
  char buf[20];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace job_internal

using namespace job_internal;

// Engine ranks with --dump-dir: the received parameters as <dump_dir>/rank-<rank>.safetensors.
Status job_internal::WriteRankDump(const JobSpec& job, int rank, const SyncRank& who,
                                   const std::vector<EngineParam>& expected,
                                   const std::vector<DestBinding>& bound) {
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

namespace {

// A rank's last error as the launchers print it: a deadline names the flag that raises it
// (issue 36: users saw "exit code 1" and never learned of --timeout-ms).
std::string RankError(const JobSpec& job, const Status& s) {
  std::string e = s.ToString();
  if (s.code() == StatusCode::kDeadlineExceeded && e.find(" --") == std::string::npos) {
    e += " (--timeout-ms " + std::to_string(job.timeout.count()) +
         " bounds connect and each sync; raise it on a loaded machine)";
  }
  return e;
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
    if (!s.ok()) res.error = RankError(job, s);
    res.peak_rss_bytes = PeakRssBytes();
    return res;
  }
  SessionOptions opt;
  opt.prefix = job.prefix;
  if (job.launch.any()) {
    opt.job_id = job.launch.id;
    opt.job_secret = job.launch.secret;
  }
  opt.connect_timeout = job.timeout;
  opt.sync_timeout = job.timeout;
  ApplyCommitOptions(job, opt);
  SS_ASSIGN_OR_RETURN(auto session, SyncSession::Create(job.inputs, rank, store, transport, opt));
  SetupBarrier setup(job, rank, store);
  SS_RETURN_IF_ERROR(setup.Begin());
  const bool staged = job.staged() && !who.is_trainer;
  const auto t0 = Clock::now();
  TrainerShards shards;
  EngineParams params;
  auto fill = [&]() -> Status {
    if (who.is_trainer) {
      SS_ASSIGN_OR_RETURN(shards, FillTrainerShards(job, who.trainer_rank));
      for (const SourceBinding& b : shards.bindings) SS_RETURN_IF_ERROR(session->BindSource(b));
    } else {
      SS_ASSIGN_OR_RETURN(
          params, AllocateEngineParams(session->ExpectedParams(), job.inputs.options.wire_dtype));
      for (const DestBinding& b : params.bindings) SS_RETURN_IF_ERROR(session->BindDest(b));
      res.staging_bytes = session->staging_bytes();
      // Staged: what the live parameters hold until a commit (the fault runs compare it).
      if (staged) res.live_hash = LiveHash(params.bindings);
    }
    return OkStatus();
  };
  if (Status s = fill(); !s.ok()) return setup.Fail(s);
  res.setup_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  step();
  auto finish = [&](const Status& s) {
    res.ok = s.ok();
    res.poisoned = session->IsPoisoned();
    if (staged) {
      res.committed_version = session->committed_version();
      res.keep_previous = session->keep_previous();
      res.live_hash_after = LiveHash(params.bindings);
      res.live_intact = res.live_hash_after == res.live_hash;
    }
    if (!s.ok()) res.error = RankError(job, s);
    res.peak_rss_bytes = PeakRssBytes();
    return res;
  };
  // Connect's timeout starts once every rank is set up.
  if (Status s = setup.Wait(); !s.ok()) return finish(s);
  Status cs = session->Connect();
  if (!cs.ok()) return finish(cs);
  step();
  for (int v = 1; v <= job.syncs; ++v) {
    auto rep = session->Sync(static_cast<uint64_t>(v));
    if (!rep.ok()) {
      if (staged) res.failed_in = "sync";
      return finish(rep.status());
    }
    res.report = *rep;
    res.transfer_seconds = rep->local.seconds;
    if (job.staged()) {
      // Every rank verified v (the report is job-wide): the engine ranks commit it together.
      auto c = session->Commit(static_cast<uint64_t>(v));
      if (!c.ok()) {
        if (staged) res.failed_in = "commit";
        return finish(c.status());
      }
      res.stall_seconds = c->stall_seconds;
      if (staged) res.live_hash = LiveHash(params.bindings);
    }
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
    Status ds = WriteRankDump(job, rank, who, session->ExpectedParams(), params.bindings);
    if (!ds.ok()) return finish(ds.Annotate("--dump-dir"));
    step();
    finish(OkStatus());
    res.peak_rss_bytes = sync_peak;
    return res;
  }
  step();
  return finish(OkStatus());
}

Status job_internal::CheckRankFitsHost(const JobSpec& job, int rank) {
  if (job.device == "cuda") return OkStatus();  // the rank's buffers are in GPU memory
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(job.inputs, rank));
  const PlanInputs& in = job.inputs;
  // Saturating: an absurd config's sizes overflow int64 (CheckHostMemory reads INT64_MAX so).
  auto add = [](int64_t a, int64_t b) {
    int64_t r = 0;
    return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
  };
  auto mul = [](int64_t a, int64_t b) {
    int64_t r = 0;
    return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
  };
  int64_t bytes = 0;
  std::string what;
  if (who.is_trainer) {
    for (const HfTensor& h : HfTensorInventory(in.model)) {
      bytes = add(bytes, TrainerHeldRegion(in.trainer, who.trainer_rank, h.shape).numel());
    }
    bytes = mul(bytes, DTypeSize(in.trainer_dtype));
    what = "trainer rank " + std::to_string(who.trainer_rank) + "'s shards";
  } else {
    SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(in.model, in.rollout.shard));
    for (const EngineParam& p : map.rank(who.tp_rank, who.pp_rank).params) {
      bytes = add(bytes, p.numel());
    }
    bytes = mul(bytes, DTypeSize(in.options.wire_dtype));
    what = "engine rank tp=" + std::to_string(who.tp_rank) + " pp=" + std::to_string(who.pp_rank) +
           "'s parameters";
  }
  return CheckHostMemory(bytes, "--model " + in.model.name,
                         "sync rank " + std::to_string(rank) + " (" + what + ")");
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
  // Issue 26: an absurd but valid config is bad input (exit 2), not a rank aborting on bad_alloc.
  SS_RETURN_IF_ERROR(CheckRankFitsHost(job, env.rank));
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
  r.host_id = HostIdentity();
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
