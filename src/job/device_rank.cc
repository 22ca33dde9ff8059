// Device mode of the rank program (`shardsync run|bench --device cuda`): the same SyncSession a
// user runs, with device bindings (trainer shards and engine parameters in GPU memory, the CUDA
// packer) over the routed transport (cuda_ipc on one GPU or node, nccl across). Bench mode adds,
// in the same processes and through the same transport, the broadcast-all baseline and the raw
// ceilings (device_baselines.cc).
#include "job/device_rank.h"

#include <algorithm>
#include <cmath>

namespace shardsync::job_internal {

Status DeviceRank::Setup(bool bench) {
  SS_ASSIGN_OR_RETURN(device_, job_internal::DeviceOfRank(job_, rank_));
  res_.device = device_;
  SS_RETURN_IF_ERROR(gpu::SetDevice(device_));
  SS_ASSIGN_OR_RETURN(stream_, gpu::Stream::Create(device_));
  packer_ = gpu::MakeCudaPacker(device_, job_.timeout);
  if (!packer_) return UnimplementedError("--device cuda: this build has no CUDA packer");
  SessionOptions opt;
  HarnessHooks hooks;
  opt.prefix = job_.prefix;
  if (job_.launch.any()) {
    opt.job_id = job_.launch.id;
    opt.job_secret = job_.launch.secret;
  }
  opt.connect_timeout = job_.timeout;
  opt.sync_timeout = job_.timeout;
  opt.packer = packer_.get();
  ApplyCommitOptions(job_, opt);
  const auto t0 = Clock::now();
  if (bench && !in_.model.quant) {  // block FP8: no broadcast-all (bench.cc says why)
    SS_RETURN_IF_ERROR(SetupBroadcast());
    if (rank_ == 0) {
      for (int r = S_; r < world_; ++r) hooks.extra_peers.push_back(r);
    } else if (!who_.is_trainer) {
      hooks.extra_peers.push_back(0);
    }
    hooks.before_transport_connect = [this](Transport& t) -> Status {
      if (who_.is_trainer) return OkStatus();
      SS_ASSIGN_OR_RETURN(uint32_t id, t.RegisterMemory(slots_->region()));
      return store_.Set(Key("slots/" + std::to_string(rank_)), std::to_string(id));
    };
  }
  SS_ASSIGN_OR_RETURN(session_,
                      CreateHarnessSession(in_, rank_, store_, tx_, opt, std::move(hooks)));
  job_internal::SetupBarrier setup(job_, rank_, store_);
  SS_RETURN_IF_ERROR(setup.Begin());
  Status filled = who_.is_trainer ? FillTrainer() : AllocEngine();
  if (filled.ok() && bench && !in_.model.quant) filled = SetupBroadcastSource();
  if (!filled.ok()) return setup.Fail(filled);
  res_.staging_bytes = session_->staging_bytes();
  if (Staged() && !bench) {
    auto hash = LiveHash();
    if (!hash.ok()) return setup.Fail(hash.status());
    res_.live_hash = *hash;
  }
  res_.setup_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  Step();
  SS_RETURN_IF_ERROR(setup.Wait());  // connect's timeout starts once every rank is set up
  SS_RETURN_IF_ERROR(session_->Connect());
  std::string routes;
  for (const Message& m : session_->plan().sends) {
    routes += (routes.empty() ? "" : " ") + std::to_string(m.dst) + ":" + tx_.PeerTransport(m.dst);
  }
  res_.routes = routes;
  if (bench && rank_ == 0 && in_.model.quant) {
    // The ceiling of a block-FP8 sync is its memory bound: cudaMemcpy of half the bytes it must
    // read and write moves exactly that many through HBM.
    SS_ASSIGN_OR_RETURN(PlanSummary sum, SummarizePlan(in_));
    total_bytes_ = (sum.bound_read_bytes + sum.bound_write_bytes) / 2;
  } else if (bench && rank_ == 0) {
    SS_ASSIGN_OR_RETURN(PlanSummary sum, SummarizePlan(in_));
    for (const auto& e : sum.engine_ranks) total_bytes_ += e.owned_bytes;
    for (int e = S_; e < world_; ++e) {
      SS_ASSIGN_OR_RETURN(std::string id,
                          store_.Get(Key("slots/" + std::to_string(e)), job_.timeout));
      slot_region_[e] = static_cast<uint32_t>(std::strtoul(id.c_str(), nullptr, 10));
    }
  }
  Step();
  return OkStatus();
}

// Every held shard in one allocation, filled on the GPU with the synthetic values.
Status DeviceRank::FillTrainer() {
  if (in_.trainer.kind == TrainerSpec::Kind::kMegatron) return FillMegatron();
  const DType td = in_.trainer_dtype;
  int64_t total = 0;
  std::vector<Region> held;
  for (const HfTensor& t : inv_) {
    held.push_back(TrainerHeldRegion(in_.trainer, who_.trainer_rank, t.shape));
    offsets_.push_back(total);
    total = Align(total + held.back().numel() * DTypeSize(td));
  }
  SS_ASSIGN_OR_RETURN(buf_, gpu::DeviceBuffer::Allocate(std::max<int64_t>(total, 1), device_));
  for (size_t i = 0; i < inv_.size(); ++i) {
    if (held[i].empty()) continue;
    void* at = static_cast<unsigned char*>(buf_->data()) + offsets_[i];
    SS_RETURN_IF_ERROR(gpu::FillSyntheticDevice(job_.seed,
                                                SyntheticFor(inv_[i].name, inv_[i].shape),
                                                inv_[i].shape, held[i], td, at, stream_->handle()));
    SS_RETURN_IF_ERROR(
        session_->BindSource({inv_[i].name, at, td, held[i], MemKind::kCuda, device_}));
  }
  return SyncStream("trainer fill");
}

// Megatron: every local parameter of the rank's trainer map in one allocation, garbage first
// (padded vocab rows keep it: the element check fails if the sync read them), then each piece's
// synthetic values filled into a scratch buffer on the GPU and copied to its local region.
Status DeviceRank::FillMegatron() {
  const DType td = in_.trainer_dtype;
  const int ts = DTypeSize(td);
  const std::vector<TrainerParam>& params = session_->ExpectedSources();
  std::map<std::string, Shape> hf;
  for (const HfTensor& h : inv_) hf[h.name] = h.shape;
  int64_t total = 0, scratch = 1;
  for (const TrainerParam& p : params) {
    offsets_.push_back(total);
    total = Align(total + p.numel() * ts);
    for (const TrainerPiece& pc : p.pieces) scratch = std::max(scratch, pc.src.numel() * ts);
  }
  SS_ASSIGN_OR_RETURN(buf_, gpu::DeviceBuffer::Allocate(std::max<int64_t>(total, 1), device_));
  SS_ASSIGN_OR_RETURN(auto tmp, gpu::DeviceBuffer::Allocate(scratch, device_));
  SS_RETURN_IF_ERROR(Scramble());
  // cudaMemset runs on the legacy stream, which stream_ does not wait for: a synchronous copy
  // on the legacy stream returns only after the memset finished.
  unsigned char probe = 0;
  SS_RETURN_IF_ERROR(gpu::CopyToHost(&probe, buf_->data(), 1));
  auto* base = static_cast<unsigned char*>(buf_->data());
  auto* scratch_at = static_cast<unsigned char*>(tmp->data());
  for (size_t i = 0; i < params.size(); ++i) {
    const TrainerParam& p = params[i];
    unsigned char* at = base + offsets_[i];
    for (const TrainerPiece& pc : p.pieces) {
      const Shape& shape = hf.at(pc.source);
      SS_RETURN_IF_ERROR(gpu::FillSyntheticDevice(job_.seed, SyntheticFor(pc.source, shape), shape,
                                                  pc.src, td, scratch_at, stream_->handle()));
      // src and local have the same extents: the scratch's row-major order is the local one.
      Status s;
      int64_t k = 0;
      ForEachRun(pc.local, p.shape, [&](int64_t off, int64_t len) {
        if (s.ok()) {
          s = gpu::CopyDeviceToDevice(at + off * ts, scratch_at + k * ts, len * ts,
                                      stream_->handle());
        }
        k += len;
      });
      SS_RETURN_IF_ERROR(s);
    }
    SourceBinding b;
    b.data = at;
    b.dtype = td;
    b.region = Region::Full(p.shape);
    b.mem = MemKind::kCuda;
    b.device = device_;
    b.local = p.name;
    b.chunk = p.chunk;
    SS_RETURN_IF_ERROR(session_->BindSource(b));
  }
  return SyncStream("megatron trainer fill");  // before the scratch buffer is freed
}

// Every parameter in one allocation (as an engine's caching allocator would), garbage first.
Status DeviceRank::AllocEngine() {
  const DType wd = in_.options.wire_dtype;
  int64_t total = 0;
  for (const EngineParam& p : session_->ExpectedParams()) {
    offsets_.push_back(total);
    total = Align(total + p.numel() * DTypeSize(job_internal::BoundDType(p, wd)));
  }
  SS_ASSIGN_OR_RETURN(buf_, gpu::DeviceBuffer::Allocate(std::max<int64_t>(total, 1), device_));
  SS_RETURN_IF_ERROR(Scramble());
  const auto& params = session_->ExpectedParams();
  for (size_t i = 0; i < params.size(); ++i) {
    DestBinding b{params[i].name,
                  static_cast<unsigned char*>(buf_->data()) + offsets_[i],
                  job_internal::BoundDType(params[i], wd),
                  params[i].shape,
                  MemKind::kCuda,
                  device_};
    dests_.push_back(b);
    SS_RETURN_IF_ERROR(session_->BindDest(b));
  }
  return OkStatus();
}

Status DeviceRank::Scramble() { return gpu::Memset(buf_->data(), 0xA5, buf_->bytes()); }

// Every element against the synthetic HF value it was cut from, on the GPU; padding rows must
// be zero (checked on the host: a few rows).
Status DeviceRank::Verify(const char* after) {
  std::map<std::string, Shape> shapes;
  for (const HfTensor& h : inv_) shapes[h.name] = h.shape;
  SS_ASSIGN_OR_RETURN(auto counter, gpu::DeviceBuffer::Allocate(8, device_));
  SS_RETURN_IF_ERROR(gpu::Memset(counter->data(), 0, 8));
  const auto& params = session_->ExpectedParams();
  int64_t checked = 0, zero_bad = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = params[i];
    if (job_internal::EncodedCheckOf(p) != nullptr) continue;  // its encoding's check, below
    for (const Piece& pc : p.pieces) {
      const Shape& ss = shapes.at(pc.source);
      SS_RETURN_IF_ERROR(gpu::CountSyntheticMismatches(
          job_.seed, SyntheticFor(pc.source, ss), ss, pc.src, p.shape, pc.dst, dests_[i].data,
          static_cast<unsigned long long*>(counter->data()), stream_->handle()));
      checked += pc.src.numel();
    }
    for (const ZeroFill& z : p.zero_fills) {
      std::vector<unsigned char> host;
      Status s;
      ForEachRun(z.dst, p.shape, [&](int64_t off, int64_t len) {
        host.assign(len * 2, 1);
        if (s.ok()) {
          s = gpu::CopyToHost(host.data(),
                              static_cast<const unsigned char*>(dests_[i].data) + off * 2, len * 2);
        }
        for (unsigned char c : host) zero_bad += c != 0;
      });
      SS_RETURN_IF_ERROR(s);
      checked += z.dst.numel();
    }
  }
  SS_RETURN_IF_ERROR(SyncStream("element check"));
  uint64_t bad = 0;
  SS_RETURN_IF_ERROR(gpu::CopyToHost(&bad, counter->data(), 8));
  std::string first_encoded;  // the first mismatch an encoding's check names
  for (const job_internal::EncodedParamCheck* c : job_internal::EncodedChecks()) {
    RankResult enc;
    SS_RETURN_IF_ERROR(c->VerifyDevice(job_, params, dests_, device_, stream_->handle(), enc));
    checked += enc.elements_checked;
    bad += static_cast<uint64_t>(enc.element_mismatches);
    if (first_encoded.empty()) first_encoded = enc.first_mismatch;
  }
  res_.elements_checked += checked;
  res_.element_mismatches += static_cast<int64_t>(bad) + zero_bad;
  if (bad + zero_bad > 0) {
    if (res_.first_mismatch.empty()) {
      res_.first_mismatch = std::string("after ") + after + ": " + first_encoded;
    }
    return DataLossError("sync rank " + std::to_string(rank_) + ": " +
                         std::to_string(bad + zero_bad) + " of " + std::to_string(checked) +
                         " elements differ from the HF values after " + after);
  }
  return OkStatus();
}

Status DeviceRank::Dump() {
  const auto& params = session_->ExpectedParams();
  std::vector<unsigned char> host(buf_->bytes());
  SS_RETURN_IF_ERROR(gpu::CopyToHost(host.data(), buf_->data(), host.size()));
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < params.size(); ++i) {
    tensors.push_back({params[i].name,
                       dests_[i].dtype,
                       params[i].shape,
                       {host.data() + offsets_[i],
                        static_cast<size_t>(params[i].numel() * DTypeSize(dests_[i].dtype))}});
  }
  return WriteEngineDump(job_.dump_dir + "/rank-" + std::to_string(rank_) + ".safetensors", tensors,
                         {who_.replica, who_.tp_rank, who_.pp_rank})
      .Annotate("--dump-dir");
}

Result<std::string> DeviceRank::LiveHash() {
  std::vector<unsigned char> host(buf_->bytes());
  SS_RETURN_IF_ERROR(gpu::CopyToHost(host.data(), buf_->data(), host.size()));
  std::vector<DestBinding> h = dests_;
  for (size_t i = 0; i < h.size(); ++i) h[i].data = host.data() + offsets_[i];
  return job_internal::LiveHash(h);
}

Status DeviceRank::StagedFailure(const char* where, Status s) {
  if (!Staged()) return s;
  res_.failed_in = where;
  res_.committed_version = session_->committed_version();
  res_.keep_previous = session_->keep_previous();
  auto h = LiveHash();
  res_.live_hash_after = h.ok() ? *h : h.status().ToString();
  res_.live_intact = res_.live_hash_after == res_.live_hash;
  return s;
}

Status DeviceRank::RunSyncs() {
  for (int v = 1; v <= job_.syncs; ++v) {
    auto rep = session_->Sync(static_cast<uint64_t>(v));
    if (!rep.ok()) return StagedFailure("sync", rep.status());
    res_.report = *rep;
    res_.transfer_seconds = rep->local.seconds;
    if (job_.staged()) {
      auto c = session_->Commit(static_cast<uint64_t>(v));
      if (!c.ok()) return StagedFailure("commit", c.status());
      res_.stall_seconds = c->stall_seconds;
      if (Staged()) {
        SS_ASSIGN_OR_RETURN(res_.live_hash, LiveHash());
      }
    }
    Step();
  }
  if (Staged()) {
    res_.committed_version = session_->committed_version();
    res_.keep_previous = session_->keep_previous();
    res_.live_hash_after = res_.live_hash;
  }
  if (who_.is_trainer) return OkStatus();
  if (job_.verify) SS_RETURN_IF_ERROR(Verify("the last sync"));
  if (!job_.dump_dir.empty()) SS_RETURN_IF_ERROR(Dump());
  return OkStatus();
}

Status DeviceRank::UpdateTrainer(int i, int total) {
  if (job_.bench_update <= 0 || !who_.is_trainer || i == 0) return OkStatus();
  // Whole trainer elements every `stride` of them over the one allocation (alignment gaps and
  // Megatron's padded rows included: they are not sent); one strided memset or copy each sync.
  const size_t es = static_cast<size_t>(DTypeSize(in_.trainer_dtype));
  const auto stride = static_cast<size_t>(std::max(1.0, std::round(1.0 / job_.bench_update)));
  const size_t rows = buf_->bytes() / (stride * es);
  if (rows == 0) return OkStatus();
  if (!update_saved_) {
    SS_ASSIGN_OR_RETURN(update_saved_, gpu::DeviceBuffer::Allocate(rows * es, device_));
    SS_RETURN_IF_ERROR(gpu::Copy2D(update_saved_->data(), es, buf_->data(), stride * es, es, rows));
  }
  if (i == total - 1) {
    return gpu::Copy2D(buf_->data(), stride * es, update_saved_->data(), es, es, rows);
  }
  return gpu::ScaleStrided(buf_->data(), stride * es, update_saved_->data(), rows,
                           in_.trainer_dtype, job_internal::BenchUpdateFactor(i));
}

Status DeviceRank::RunBench() {
  const int total = job_.bench_warmup + job_.bench_reps;
  double idle_end = 0;
  if (Staged()) {  // the engine serves throughout: alone first, then beside every sync
    decode_ = std::make_unique<DecodeLoop>(buf_->data(), buf_->bytes(), device_, job_.timeout,
                                           Clock::now());
    SS_RETURN_IF_ERROR(decode_->Start());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    idle_end = decode_->Now();
  }
  for (int i = 0; i < total; ++i) {  // (a) sharded: the product's session
    SS_RETURN_IF_ERROR(UpdateTrainer(i, total));
    SS_RETURN_IF_ERROR(Barrier("sharded/" + std::to_string(i)));
    const auto t0 = Clock::now();
    const double s0 = decode_ ? decode_->Now() : 0;
    SS_ASSIGN_OR_RETURN(res_.report, session_->Sync(++version_));
    Record(res_.bench.sharded, i, t0);
    if (decode_ && i >= job_.bench_warmup) transfer_spans_.emplace_back(s0, decode_->Now());
    if (job_.staged()) SS_RETURN_IF_ERROR(TimedCommit(i));
  }
  if (decode_) {
    SS_RETURN_IF_ERROR(decode_->Stop());
    res_.bench.decode_idle_ms = decode_->MedianMs({{0.0, idle_end}});
    res_.bench.decode_transfer_ms = decode_->MedianMs(transfer_spans_);
    res_.bench.decode_commit_ms = decode_->MedianMs(commit_spans_, /*across_end=*/true);
    decode_.reset();
  }
  if (!who_.is_trainer) {
    res_.bench.bytes = res_.report.local.recv_bytes;
    if (job_.verify) SS_RETURN_IF_ERROR(Verify("the sharded syncs"));
    if (!job_.dump_dir.empty()) SS_RETURN_IF_ERROR(Dump());
  }
  if (job_.staged()) SS_RETURN_IF_ERROR(CommitCeiling(total));  // overwrites the parameters
  if (!who_.is_trainer) SS_RETURN_IF_ERROR(Scramble());  // the baseline must rewrite every byte
  Step();
  for (int i = 0; i < (in_.model.quant ? 0 : total); ++i) {  // (b) broadcast-all
    SS_RETURN_IF_ERROR(Barrier("broadcast/" + std::to_string(i)));
    const auto t0 = Clock::now();
    if (rank_ == 0) SS_RETURN_IF_ERROR(BroadcastSend());
    if (!who_.is_trainer) SS_RETURN_IF_ERROR(BroadcastReceive());
    Record(res_.bench.broadcast, i, t0);
  }
  if (!who_.is_trainer && job_.verify && !in_.model.quant) {
    SS_RETURN_IF_ERROR(Verify("broadcast-all"));
  }
  full_.reset();  // the ceilings' buffers take their place (32B: 64 GiB on trainer 0's GPU)
  full_src_ = nullptr;
  slots_.reset();
  slices_.clear();
  Step();
  for (int i = 0; i < total; ++i) {  // (c) cudaMemcpy of the job's bytes on trainer 0's GPU
    SS_RETURN_IF_ERROR(Barrier("raw/" + std::to_string(i)));
    const auto t0 = Clock::now();
    if (rank_ == 0) SS_RETURN_IF_ERROR(RawMemcpy());
    Record(res_.bench.raw, i, t0);
  }
  const bool nccl = !NcclPeers().empty();
  SS_ASSIGN_OR_RETURN(int64_t any_nccl, store_.Add(Key("ncclranks"), nccl ? 1 : 0));
  SS_RETURN_IF_ERROR(Barrier("nccl-count"));
  SS_ASSIGN_OR_RETURN(any_nccl, store_.Add(Key("ncclranks"), 0));
  for (int i = 0; any_nccl > 0 && i < total; ++i) {  // (d) NCCL send / recv of each nccl pair
    SS_RETURN_IF_ERROR(Barrier("rawnccl/" + std::to_string(i)));
    const auto t0 = Clock::now();
    SS_RETURN_IF_ERROR(RawNccl());
    Record(res_.bench.raw_nccl, i, t0);
  }
  res_.bench.verified = who_.is_trainer || job_.verify;
  return Barrier("end");
}

Result<int> DeviceOfRank(const JobSpec& job, int rank) {
  int gpus = job.gpus;
  if (gpus <= 0) {
    SS_ASSIGN_OR_RETURN(gpus, gpu::DeviceCount());
  }
  if (gpus <= 0) return UnavailableError("--device cuda: no CUDA device");
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(job.inputs, rank));
  if (who.is_trainer) return who.trainer_rank % gpus;
  const ShardSpec& sh = job.inputs.rollout.shard;
  return (who.replica * sh.tp * sh.pp + who.pp_rank * sh.tp + who.tp_rank) % gpus;
}

Status RunDeviceRank(const JobSpec& job, int rank, const SyncRank& who, StoreClient& store,
                     Transport& transport, RankResult& res, const ProgressFn& progress) {
  // On failure the rank's device state is left in place, not destroyed: device work may still
  // wait on a dead peer, and freeing memory (cudaFree synchronizes the device) would wait with it
  // before the rank could report. The rank process exits right after reporting.
  auto d = std::make_unique<DeviceRank>(job, rank, who, store, transport, res, progress);
  const bool bench = job.mode == JobMode::kBench;
  Status s = d->Setup(bench);
  if (s.ok()) s = bench ? d->RunBench() : d->RunSyncs();
  if (!s.ok()) d.release();
  return s;
}

}  // namespace shardsync::job_internal
