// Device mode of the rank program (`shardsync run|bench --device cuda`): the same SyncSession a
// user runs, with device bindings (trainer shards and engine parameters in GPU memory, the CUDA
// packer) over the routed transport (cuda_ipc on one GPU or node, nccl across). Bench mode adds,
// in the same processes and through the same transport, the broadcast-all baseline and the raw
// ceilings: cudaMemcpy device-to-device of the same bytes, and NCCL send / recv of each nccl
// pair's bytes.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/gpu.h"
#include "shardsync/refengine.h"
#include "shardsync/safetensors.h"
#include "shardsync/shard_map.h"
#include "shardsync/synthetic.h"
#include "shardsync/transport.h"
#include "sync/harness.h"
#include "sync/tags.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;
using job_internal::kBenchVersionBroadcast;
using job_internal::kBenchVersionRaw;

int64_t Align(int64_t v) { return (v + 255) / 256 * 256; }

// --commit staged, engine ranks of the bench: a decode-like loop on a stream of its own, each
// step one read of every live parameter (what a decode step reads), timed per step, so the bench
// can say how much the transfer and the commit slow the engine down. Pause / Resume bracket a
// commit as an engine's in-place pause does: the step in flight ends first, the next one waits
// (its time, from when it was due, is what a token sees across the commit).
class DecodeLoop {
 public:
  DecodeLoop(const void* p, size_t bytes, int device, Millis timeout, Clock::time_point epoch)
      : p_(p), bytes_(bytes), device_(device), timeout_(timeout), epoch_(epoch) {}
  ~DecodeLoop() { Stop(); }
  Status Start() {
    SS_ASSIGN_OR_RETURN(stream_, gpu::Stream::Create(device_));
    thread_ = std::thread([this] {
      status_ = gpu::SetDevice(device_);
      while (status_.ok()) {
        const double t0 = Now();
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return !paused_ || stop_; });
          if (stop_) break;
          in_step_ = true;
        }
        status_ = gpu::LaunchReadPass(p_, bytes_, stream_->handle());
        if (status_.ok()) status_ = stream_->Synchronize(timeout_, "decode-like loop");
        {
          std::lock_guard<std::mutex> lock(mu_);
          in_step_ = false;
          steps_.emplace_back(t0, Now());
        }
        cv_.notify_all();
      }
    });
    return OkStatus();
  }
  void Pause() {
    std::unique_lock<std::mutex> lock(mu_);
    paused_ = true;
    cv_.wait(lock, [&] { return !in_step_; });
  }
  void Resume() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      paused_ = false;
    }
    cv_.notify_all();
  }
  Status Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    return status_;
  }
  double Now() const { return std::chrono::duration<double>(Clock::now() - epoch_).count(); }
  // Median step (ms) of the steps whose midpoint falls in one of `spans` (seconds since the
  // epoch); `across_end`: of the steps running when a span ended (the step a pause held).
  double MedianMs(const std::vector<std::pair<double, double>>& spans,
                  bool across_end = false) const {
    std::vector<double> in;
    for (const auto& [a, b] : steps_) {
      const double mid = (a + b) / 2;
      for (const auto& [s, e] : spans) {
        if (across_end ? (a <= e && b >= e) : (mid >= s && mid <= e)) {
          in.push_back((b - a) * 1e3);
          break;
        }
      }
    }
    if (in.empty()) return 0;
    std::sort(in.begin(), in.end());
    return in[in.size() / 2];
  }

 private:
  const void* p_;
  size_t bytes_;
  int device_;
  Millis timeout_;
  Clock::time_point epoch_;
  std::unique_ptr<gpu::Stream> stream_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, paused_ = false, in_step_ = false;
  Status status_;
  std::vector<std::pair<double, double>> steps_;
};

class DeviceRank {
 public:
  DeviceRank(const JobSpec& job, int rank, const SyncRank& who, StoreClient& store, Transport& tx,
             RankResult& res, const ProgressFn& progress)
      : job_(job),
        in_(job.inputs),
        rank_(rank),
        who_(who),
        store_(store),
        tx_(tx),
        res_(res),
        progress_(progress),
        S_(in_.trainer.world()),
        world_(SyncWorldSize(in_)),
        inv_(HfTensorInventory(in_.model)) {}
  ~DeviceRank() {
    session_.reset();  // before the memory it bound
  }

  Status Setup(bool bench);
  Status RunSyncs();
  Status RunBench();

 private:
  void Step() {
    if (progress_) progress_();
  }
  std::string Key(const std::string& k) const { return job_.prefix + "bench/" + k; }
  Status Barrier(const std::string& name) {
    return store_.Barrier(job_.prefix + "bench/" + name, world_, job_.timeout);
  }
  void Record(std::vector<double>& v, int i, Clock::time_point t0) const {
    if (i >= job_.bench_warmup)
      v.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  Status SyncStream(const char* what) { return stream_->Synchronize(job_.timeout, what); }
  Status FillTrainer();
  Status FillMegatron();
  Status AllocEngine();
  Status Scramble();
  Status Verify(const char* after);
  Status Dump();
  Status SetupBroadcast();
  Status SetupBroadcastSource();
  Status BroadcastSend();
  Status BroadcastReceive();
  Status RawMemcpy();
  Status RawNccl();
  bool Staged() const { return job_.staged() && !who_.is_trainer; }
  // The live parameters' hash (job_internal::LiveHash) through a host copy: a device-wide
  // synchronize could wait on a dead peer's pair.
  Result<std::string> LiveHash();
  // A staged engine rank's failure in `where`: what its live parameters hold now.
  Status StagedFailure(const char* where, Status s);
  Status TimedCommit(int i);
  Status CommitCeiling(int total);
  std::vector<int> NcclPeers() const;

  const JobSpec& job_;
  const PlanInputs& in_;
  int rank_;
  SyncRank who_;
  StoreClient& store_;
  Transport& tx_;
  RankResult& res_;
  ProgressFn progress_;
  int S_, world_;
  std::vector<HfTensor> inv_;
  int device_ = 0;
  std::unique_ptr<gpu::Stream> stream_;
  std::unique_ptr<Packer> packer_;
  std::unique_ptr<SyncSession> session_;
  uint64_t version_ = 0;
  std::unique_ptr<gpu::DeviceBuffer> buf_;  // trainer: held shards; engine: parameters
  std::vector<int64_t> offsets_;  // trainer: per HF tensor (Megatron: local parameter); engine:
                                  // per parameter
  std::vector<DestBinding> dests_;
  // Broadcast-all: whole tensors in rounds under the bucket cap; trainer 0 holds the full model
  // in the wire dtype; each engine receives round r into slot r % 2 and slices its pieces out.
  std::vector<job_internal::BcastBucket> rounds_;
  std::vector<int64_t> full_offsets_;
  std::unique_ptr<gpu::DeviceBuffer> full_;   // trainer 0, unless its shards are that image
  const unsigned char* full_src_ = nullptr;   // trainer 0: full_, or its shards' buffer
  std::unique_ptr<gpu::DeviceBuffer> slots_;  // engines: 2 x the largest round
  int64_t slot_bytes_ = 0;
  std::vector<std::unique_ptr<gpu::CopyBatch>> slices_;  // engines: per round (null: nothing)
  std::map<int, uint32_t> slot_region_;                  // trainer 0: engine -> its slots' region
  // Raw ceilings: trainer 0's memcpy buffers, every rank's NCCL buffer.
  std::unique_ptr<gpu::DeviceBuffer> raw_;
  int64_t total_bytes_ = 0;  // trainer 0: bytes the plan lands job-wide
  // --commit staged, engine ranks: the decode-like loop and when each transfer / commit ran.
  std::unique_ptr<DecodeLoop> decode_;
  std::vector<std::pair<double, double>> transfer_spans_, commit_spans_;
  int broadcast_rep_ = 0;  // names the acks of each repetition
};

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
    total = Align(total + p.numel() * DTypeSize(Fp8DestDType(p, wd)));
  }
  SS_ASSIGN_OR_RETURN(buf_, gpu::DeviceBuffer::Allocate(std::max<int64_t>(total, 1), device_));
  SS_RETURN_IF_ERROR(Scramble());
  const auto& params = session_->ExpectedParams();
  for (size_t i = 0; i < params.size(); ++i) {
    DestBinding b{params[i].name,
                  static_cast<unsigned char*>(buf_->data()) + offsets_[i],
                  Fp8DestDType(params[i], wd),
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
    if (p.dtype == DType::kF8E4M3 || job_internal::IsFp8Scale(p)) continue;  // below
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
  RankResult fp8;
  SS_RETURN_IF_ERROR(
      job_internal::VerifyFp8Device(job_, params, dests_, device_, stream_->handle(), fp8));
  checked += fp8.elements_checked;
  bad += static_cast<uint64_t>(fp8.element_mismatches);
  res_.elements_checked += checked;
  res_.element_mismatches += static_cast<int64_t>(bad) + zero_bad;
  if (bad + zero_bad > 0) {
    if (res_.first_mismatch.empty()) {
      res_.first_mismatch = std::string("after ") + after + ": " + fp8.first_mismatch;
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

Status DeviceRank::SetupBroadcast() {
  rounds_ = job_internal::BroadcastBuckets(inv_, DTypeSize(in_.options.wire_dtype),
                                           in_.options.bucket_bytes, &full_offsets_);
  for (const auto& r : rounds_) slot_bytes_ = std::max(slot_bytes_, Align(r.bytes));
  if (who_.is_trainer) return OkStatus();
  SS_ASSIGN_OR_RETURN(slots_, gpu::DeviceBuffer::Allocate(2 * slot_bytes_, device_));
  return OkStatus();
}

// Trainer 0's source of the broadcast-all rounds: the whole model in the wire dtype, as a gathered
// full_tensor() would be. When its own shards already are that image (this rank holds every
// tensor whole, in the wire dtype, at the offsets the rounds use), they are the source, read
// only: no third copy of the model on the GPU. Issue 36: qwen3-30b-a3b fsdp=1 on one H200 ran out
// of memory allocating this copy (61 GB) beside the trainer's and the engines' 122 GB.
Status DeviceRank::SetupBroadcastSource() {
  if (rank_ != 0) return OkStatus();
  bool own = in_.trainer_dtype == in_.options.wire_dtype &&
             in_.trainer.kind != TrainerSpec::Kind::kMegatron && offsets_.size() == inv_.size();
  for (size_t t = 0; own && t < inv_.size(); ++t) {
    own = offsets_[t] == full_offsets_[t] &&
          TrainerHeldRegion(in_.trainer, who_.trainer_rank, inv_[t].shape) ==
              Region::Full(inv_[t].shape);
  }
  if (own) {
    full_src_ = static_cast<const unsigned char*>(buf_->data());
    return OkStatus();
  }
  int64_t total = 0;
  for (const auto& r : rounds_) total += r.bytes;
  SS_ASSIGN_OR_RETURN(full_, gpu::DeviceBuffer::Allocate(std::max<int64_t>(total, 1), device_));
  for (size_t t = 0; t < inv_.size(); ++t) {  // the trainer's weights cast to the wire dtype
    SS_RETURN_IF_ERROR(gpu::FillSyntheticDevice(
        job_.seed, SyntheticFor(inv_[t].name, inv_[t].shape), inv_[t].shape,
        Region::Full(inv_[t].shape), in_.options.wire_dtype,
        static_cast<unsigned char*>(full_->data()) + full_offsets_[t], stream_->handle()));
  }
  full_src_ = static_cast<const unsigned char*>(full_->data());
  return SyncStream("broadcast fill");
}

// Engine: round r's pieces out of slot r % 2 (prepared once, after the parameters are bound).
Status PrepareSlices(const std::vector<HfTensor>& inv, const std::vector<EngineParam>& params,
                     const std::vector<DestBinding>& dests,
                     const std::vector<job_internal::BcastBucket>& rounds,
                     const std::vector<int64_t>& full_offsets, unsigned char* slots,
                     int64_t slot_bytes, DType wire, int device,
                     std::vector<std::unique_ptr<gpu::CopyBatch>>* out) {
  std::map<std::string, size_t> index;
  for (size_t t = 0; t < inv.size(); ++t) index[inv[t].name] = t;
  const int ws = DTypeSize(wire);
  for (size_t r = 0; r < rounds.size(); ++r) {
    gpu::BatchSpec spec;
    spec.in_dtype = spec.out_dtype = wire;
    int64_t wire_at = 0;
    unsigned char* slot = slots + (r % 2) * slot_bytes;
    for (size_t p = 0; p < params.size(); ++p) {
      for (const Piece& pc : params[p].pieces) {
        const size_t t = index.at(pc.source);
        if (t < rounds[r].t_begin || t >= rounds[r].t_end) continue;
        gpu::AppendCoRuns(pc.src, inv[t].shape, slot + (full_offsets[t] - rounds[r].offset), ws,
                          pc.dst, params[p].shape, dests[p].data, ws, ws, 0, wire_at, &spec.runs);
        wire_at += pc.src.numel() * ws;
      }
    }
    if (wire_at == 0) {
      out->push_back(nullptr);
      continue;
    }
    spec.bucket_bytes = {wire_at};
    SS_ASSIGN_OR_RETURN(auto batch, gpu::CopyBatch::Prepare(spec, device));
    out->push_back(std::move(batch));
  }
  return OkStatus();
}

// Trainer 0 sends every round to every engine rank: a put into its slot plus a control message
// where the pair's transport is one-sided (cuda_ipc), a send matched by order otherwise (nccl).
// The engine acks each round through the store once sliced, and slot r % 2 is refilled after
// the ack of round r - 2. (Acks over NCCL would open the engine -> trainer direction inside a
// group that also carries the next round: NCCL connects every peer of a group before it starts
// any of it, so neither side would move.)
Status DeviceRank::BroadcastSend() {
  const std::string rep = std::to_string(broadcast_rep_++);
  std::vector<uint64_t> ctrl(rounds_.size());
  auto ack = [&](int e, size_t r) -> Status {
    return store_
        .Get(Key("ack/" + rep + "/" + std::to_string(e) + "/" + std::to_string(r)), job_.timeout)
        .status()
        .Annotate("broadcast ack of sync rank " + std::to_string(e));
  };
  for (size_t r = 0; r < rounds_.size(); ++r) {
    ctrl[r] = r;
    const auto* src = full_src_ + rounds_[r].offset;
    std::vector<XferId> ids;
    for (int e = S_; e < world_; ++e) {
      if (r >= 2) SS_RETURN_IF_ERROR(ack(e, r - 2));
      if (tx_.PeerCaps(e).one_sided_put) {
        SS_ASSIGN_OR_RETURN(XferId put, tx_.PostPut(e, src, rounds_[r].bytes, slot_region_.at(e),
                                                    (r % 2) * slot_bytes_));
        SS_ASSIGN_OR_RETURN(XferId fl, tx_.PostFlush(e));
        SS_RETURN_IF_ERROR(WaitAllXfers(tx_, {put, fl}, job_.timeout, "broadcast put"));
        SS_ASSIGN_OR_RETURN(XferId c,
                            tx_.PostSend(e, MakeTag(true, kBenchVersionBroadcast, r), &ctrl[r], 8));
        ids.push_back(c);
      } else {
        SS_ASSIGN_OR_RETURN(XferId s, tx_.PostSend(e, MakeTag(false, kBenchVersionBroadcast, r),
                                                   src, rounds_[r].bytes));
        ids.push_back(s);
      }
    }
    SS_RETURN_IF_ERROR(WaitAllXfers(tx_, ids, job_.timeout, "broadcast sends"));
  }
  for (int e = S_; e < world_; ++e) {
    for (size_t r = rounds_.size() >= 2 ? rounds_.size() - 2 : 0; r < rounds_.size(); ++r) {
      SS_RETURN_IF_ERROR(ack(e, r));
    }
  }
  return OkStatus();
}

Status DeviceRank::BroadcastReceive() {
  if (slices_.empty()) {
    SS_RETURN_IF_ERROR(PrepareSlices(inv_, session_->ExpectedParams(), dests_, rounds_,
                                     full_offsets_, static_cast<unsigned char*>(slots_->data()),
                                     slot_bytes_, in_.options.wire_dtype, device_, &slices_));
  }
  const std::string rep = std::to_string(broadcast_rep_++);
  const bool put = tx_.PeerCaps(0).one_sided_put;
  std::vector<uint64_t> ctrl(rounds_.size());
  for (size_t r = 0; r < rounds_.size(); ++r) {
    void* slot = static_cast<unsigned char*>(slots_->data()) + (r % 2) * slot_bytes_;
    SS_ASSIGN_OR_RETURN(
        XferId id,
        put ? tx_.PostRecv(0, MakeTag(true, kBenchVersionBroadcast, r), &ctrl[r], 8)
            : tx_.PostRecv(0, MakeTag(false, kBenchVersionBroadcast, r), slot, rounds_[r].bytes));
    SS_RETURN_IF_ERROR(WaitXfer(tx_, id, job_.timeout, "broadcast round " + std::to_string(r)));
    if (slices_[r]) {
      SS_RETURN_IF_ERROR(slices_[r]->Launch(stream_->handle()));
      SS_RETURN_IF_ERROR(SyncStream("broadcast slice"));
    }
    SS_RETURN_IF_ERROR(
        store_.Set(Key("ack/" + rep + "/" + std::to_string(rank_) + "/" + std::to_string(r)), "1"));
  }
  return OkStatus();
}

// --commit staged: every rank starts the commit together (as an engine's pause would).
Status DeviceRank::TimedCommit(int i) {
  // The engines pause in place first (the step in flight ends), then commit together: the stall
  // is the commit alone, every engine rank starting it at once.
  const double c0 = decode_ ? decode_->Now() : 0;
  if (decode_) decode_->Pause();
  SS_RETURN_IF_ERROR(Barrier("commit/" + std::to_string(i)));
  auto committed = session_->Commit(version_);
  if (decode_) decode_->Resume();
  SS_ASSIGN_OR_RETURN(CommitReport c, std::move(committed));
  if (decode_ && i >= job_.bench_warmup) commit_spans_.emplace_back(c0, decode_->Now());
  if (who_.is_trainer) return OkStatus();
  if (i >= job_.bench_warmup) {
    res_.bench.stall.push_back(c.stall_seconds);
    res_.bench.commit_copy.push_back(c.copy_seconds);
  }
  res_.stall_seconds = c.stall_seconds;
  res_.transfer_seconds = res_.report.local.seconds;
  res_.keep_previous = c.keep_previous;
  res_.committed_version = c.version;
  return OkStatus();
}

// The copy a commit cannot beat: cudaMemcpy of each engine rank's parameter bytes, every engine
// rank at once.
Status DeviceRank::CommitCeiling(int total) {
  // The parameters' allocation copied onto itself, half by half: the same bytes as one
  // cudaMemcpy of it, no second buffer (the parameters are verified before and scrambled after).
  const size_t half = buf_ ? buf_->bytes() / 2 : 0;
  auto* p = buf_ ? static_cast<unsigned char*>(buf_->data()) : nullptr;
  for (int i = 0; i < total; ++i) {
    SS_RETURN_IF_ERROR(Barrier("commitraw/" + std::to_string(i)));
    const auto t0 = Clock::now();
    if (who_.is_trainer) continue;
    SS_RETURN_IF_ERROR(gpu::CopyDeviceToDevice(p + half, p, half, stream_->handle()));
    SS_RETURN_IF_ERROR(gpu::CopyDeviceToDevice(p, p + half, half, stream_->handle()));
    SS_RETURN_IF_ERROR(SyncStream("commit ceiling cudaMemcpy"));
    Record(res_.bench.commit_raw, i, t0);
  }
  return OkStatus();
}

// cudaMemcpy device-to-device of the bytes the plan lands job-wide, through one pair of buffers
// of at most 1 GiB (the rate does not depend on the size past a few MiB). The pair is the first
// 2 GiB of trainer 0's own shards when it holds that much: the last phase that reads them (the
// broadcast) is over, and nothing is allocated beside the job's memory.
Status DeviceRank::RawMemcpy() {
  const int64_t want = std::max<int64_t>(std::min<int64_t>(total_bytes_, int64_t{1} << 30), 1);
  unsigned char* a = nullptr;
  int64_t chunk = want;
  if (buf_ && static_cast<int64_t>(buf_->bytes()) >= 2 * want) {
    a = static_cast<unsigned char*>(buf_->data());
  } else {
    if (!raw_) {
      SS_ASSIGN_OR_RETURN(raw_, gpu::DeviceBuffer::Allocate(2 * want, device_));
    }
    chunk = static_cast<int64_t>(raw_->bytes() / 2);
    a = static_cast<unsigned char*>(raw_->data());
  }
  for (int64_t done = 0; done < total_bytes_; done += chunk) {
    const int64_t n = std::min(chunk, total_bytes_ - done);
    SS_RETURN_IF_ERROR(gpu::CopyDeviceToDevice(a + chunk, a, n, stream_->handle()));
  }
  return SyncStream("cudaMemcpy");
}

std::vector<int> DeviceRank::NcclPeers() const {
  std::vector<int> v;
  for (const Message& m : session_->plan().sends) {
    if (tx_.PeerTransport(m.dst) == "nccl") v.push_back(m.dst);
  }
  for (const Message& m : session_->plan().recvs) {
    if (tx_.PeerTransport(m.src) == "nccl") v.push_back(m.src);
  }
  return v;
}

// Every nccl pair's message bytes, all pairs at once, with the session's communicators.
Status DeviceRank::RawNccl() {
  const RankPlan& plan = session_->plan();
  int64_t max = 0;
  for (const auto* list : {&plan.sends, &plan.recvs}) {
    for (const Message& m : *list) max = std::max(max, m.bytes);
  }
  if (!raw_ || static_cast<int64_t>(raw_->bytes()) < max) {
    raw_.reset();
    SS_ASSIGN_OR_RETURN(raw_, gpu::DeviceBuffer::Allocate(std::max<int64_t>(max, 1), device_));
  }
  std::vector<XferId> ids;
  const uint64_t tag = MakeTag(false, kBenchVersionRaw, 0);
  for (const Message& m : plan.sends) {
    if (tx_.PeerTransport(m.dst) != "nccl") continue;
    SS_ASSIGN_OR_RETURN(XferId id, tx_.PostSend(m.dst, tag, raw_->data(), m.bytes));
    ids.push_back(id);
  }
  for (const Message& m : plan.recvs) {
    if (tx_.PeerTransport(m.src) != "nccl") continue;
    SS_ASSIGN_OR_RETURN(XferId id, tx_.PostRecv(m.src, tag, raw_->data(), m.bytes));
    ids.push_back(id);
  }
  return WaitAllXfers(tx_, ids, job_.timeout, "raw nccl");
}

}  // namespace

namespace job_internal {

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

}  // namespace job_internal
}  // namespace shardsync
