// Bench mode of the rank program: the sharded plan, the broadcast-all baseline (bench_broadcast.cc)
// and raw transfers (bench.h says what each is). Each repetition starts at a store barrier; a
// rank's time runs from the barrier to its own end.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>

#include "common/cast.h"
#include "job/bench.h"
#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/settings.h"
#include "shardsync/shard_map.h"
#include "shardsync/synthetic.h"
#include "shardsync/transport.h"
#include "sync/harness.h"
#include "sync/tags.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;
using job_internal::BenchControl;
using job_internal::FlushPeers;
using job_internal::kBenchVersionRaw;
using job_internal::WaitXfers;

class BenchRank {
 public:
  BenchRank(const JobSpec& job, int rank, const SyncRank& who, StoreClient& store, Transport& tx,
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
        ws_(DTypeSize(in_.options.wire_dtype)),
        inv_(HfTensorInventory(in_.model)),
        bcast_(job, tx) {}

  Status Run() {
    SS_RETURN_IF_ERROR(Setup());
    Step();
    const int total = job_.bench_warmup + job_.bench_reps;
    // (a) sharded.
    for (int i = 0; i < total; ++i) {
      UpdateTrainer(i, total);
      SS_RETURN_IF_ERROR(Barrier("sharded/" + std::to_string(i)));
      const auto t0 = Clock::now();
      SS_ASSIGN_OR_RETURN(res_.report, session_->Sync(++version_));
      Record(res_.bench.sharded, i, t0);
      if (job_.staged()) SS_RETURN_IF_ERROR(TimedCommit(i));
    }
    if (job_.staged()) SS_RETURN_IF_ERROR(CommitCeiling(total));
    bool verified = true;
    if (!who_.is_trainer) verified = VerifyParams("sharded");
    if (!who_.is_trainer && !job_.dump_dir.empty()) {  // the sharded sync's parameters
      Status ds = job_internal::WriteRankDump(job_, rank_, who_, session_->ExpectedParams(),
                                              params_.bindings);
      if (!ds.ok()) return ds.Annotate("--dump-dir");
    }
    Step();
    // (b) broadcast-all. Parameters are scrambled first so the baseline has to rewrite them.
    // Block-FP8 engines have no broadcast-all of their own (the engines' update_weights paths
    // load bf16 and requantize): `bench --quant` times the bf16 job beside (cmd_bench.cc).
    const int broadcast_reps = fp8() ? 0 : total;
    if (!who_.is_trainer && !fp8()) {
      for (auto& b : params_.bindings) {
        std::memset(b.data, 0xA5, NumElements(b.shape) * ws_);
      }
    }
    for (int i = 0; i < broadcast_reps; ++i) {
      // The first waits for the engines' element check and scramble: work, not a sync.
      SS_RETURN_IF_ERROR(Barrier("broadcast/" + std::to_string(i), i == 0));
      const auto t0 = Clock::now();
      if (rank_ == 0) {
        SS_RETURN_IF_ERROR(bcast_.Send());
      } else if (!who_.is_trainer) {
        SS_RETURN_IF_ERROR(bcast_.Receive(session_->ExpectedParams(), params_.bindings));
      }
      Record(res_.bench.broadcast, i, t0);
    }
    if (!who_.is_trainer && !fp8()) verified = VerifyParams("broadcast") && verified;
    Step();
    // (c) raw transfers of the plan's bytes per (sender, receiver) pair.
    for (int i = 0; i < total; ++i) {
      SS_RETURN_IF_ERROR(Barrier("raw/" + std::to_string(i), i == 0));
      const auto t0 = Clock::now();
      SS_RETURN_IF_ERROR(who_.is_trainer ? RawSend() : RawReceive());
      Record(res_.bench.raw, i, t0);
    }
    // No rank leaves (closing its endpoints) while a peer may still drive transfers with it: the
    // transport reports a departed peer as a failure of every transfer with it.
    SS_RETURN_IF_ERROR(Barrier("end"));
    ReportCpu();
    res_.bench.verified = verified;
    if (!verified) {
      return DataLossError("sync rank " + std::to_string(rank_) + ": " + res_.first_mismatch +
                           " differs from the HF value");
    }
    return OkStatus();
  }

 private:
  void Step() {
    if (progress_) progress_();
  }
  bool fp8() const { return in_.model.quant.has_value(); }
  void Record(std::vector<double>& v, int i, Clock::time_point t0) {
    if (i >= job_.bench_warmup)
      v.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    // Diagnostic (SHARDSYNC_BENCH_CPU=FILE): this rank's CPU seconds per variant, appended to
    // FILE: on a machine with few cores the sync is CPU-bound, so CPU is the figure to cut.
    const double cpu = CpuSeconds();
    if (i >= job_.bench_warmup) cpu_[&v] += cpu - cpu_mark_;
    cpu_mark_ = cpu;
  }
  static double CpuSeconds() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  }
  void ReportCpu() {
    auto file = TextKnob("SHARDSYNC_BENCH_CPU");  // text: no value is malformed
    if (!file.ok() || file->empty() || job_.bench_reps <= 0) return;
    if (FILE* f = std::fopen(file->c_str(), "a")) {
      std::fprintf(
          f, "rank %d %s cpu_s_per_rep sharded %.4f broadcast %.4f raw %.4f\n", rank_,
          who_.is_trainer ? "trainer" : "engine", cpu_[&res_.bench.sharded] / job_.bench_reps,
          cpu_[&res_.bench.broadcast] / job_.bench_reps, cpu_[&res_.bench.raw] / job_.bench_reps);
      std::fclose(f);
    }
  }
  // --update-fraction (DeviceRank::UpdateTrainer's host twin): before sync i of `total` (not the
  // first) every `stride`-th element of the trainer's shards, counted across its buffers, becomes
  // its filled value times BenchUpdateFactor(i) (in fp32, rounded to the shard's dtype); the last
  // sync restores them, so the element check holds.
  void UpdateTrainer(int i, int total) {
    if (job_.bench_update <= 0 || !who_.is_trainer || i == 0) return;
    const auto stride = static_cast<int64_t>(std::max(1.0, std::round(1.0 / job_.bench_update)));
    const bool restore = i == total - 1;
    const bool save = update_saved_.empty();
    const float factor = job_internal::BenchUpdateFactor(i);
    size_t at = 0;     // in update_saved_
    int64_t next = 0;  // the next element to change, counted across the buffers
    int64_t base = 0;  // this buffer's first element in that count
    for (const SourceBinding& b : shards_.bindings) {
      const int64_t es = DTypeSize(b.dtype);
      const int64_t n = b.region.numel();
      auto* data = static_cast<unsigned char*>(const_cast<void*>(b.data));
      for (; next < base + n; next += stride, at += es) {
        unsigned char* e = data + (next - base) * es;
        if (save) update_saved_.insert(update_saved_.end(), e, e + es);
        if (restore) {
          std::memcpy(e, update_saved_.data() + at, es);
        } else {
          float v = 0;
          CastInto(update_saved_.data() + at, b.dtype, &v, DType::kF32, 1);
          v *= factor;
          CastInto(&v, DType::kF32, e, b.dtype, 1);
        }
      }
      base += n;
    }
  }

  // Every rank arrives, then waits for the others while driving its transport: a peer may still
  // be finishing a flush to this rank, and off shared memory (UCX over TCP, e.g. between emulated
  // nodes) that completes only while this rank progresses (transport.h Progress). A store
  // barrier alone would leave that peer waiting until its timeout. `after_work`: the barrier
  // follows a phase of local work (the engines' element check of every parameter: a minute on a
  // loaded 2-core machine), bounded like setup, not by --timeout-ms.
  Status Barrier(const std::string& name, bool after_work = false) {
    const Millis timeout = after_work ? job_.setup_timeout : job_.timeout;
    const auto deadline = Clock::now() + timeout;
    const std::string base = Key("at/" + name);
    SS_ASSIGN_OR_RETURN(const int64_t n, store_.Add(base + "/arrived", 1));
    if (n == world_) SS_RETURN_IF_ERROR(store_.Set(base + "/done", "1"));
    const auto arrived = Clock::now();
    while (true) {
      // Short waits on the store, a transport step between: a peer's flush waits about one wait
      // here (they sleep in the store, not on this machine's cores). 1 ms while peers are likely
      // finishing their transfers, then 5 ms (a long wait is peers' local work).
      const auto now = Clock::now();
      const auto left = std::chrono::duration_cast<Millis>(deadline - now);
      const Millis step = now - arrived < Millis(100) ? Millis(1) : Millis(5);
      auto v = store_.Get(base + "/done", std::clamp(left, Millis(0), step));
      if (v.ok()) break;
      if (v.status().code() != StatusCode::kDeadlineExceeded) return v.status();
      if (left <= Millis(0)) {
        auto count = store_.Add(base + "/arrived", 0);
        return DeadlineExceededError(
            "bench barrier '" + name + "' at sync rank " + std::to_string(rank_) + ": " +
            (count.ok() ? std::to_string(*count) : std::string("?")) + " of " +
            std::to_string(world_) + " sync ranks arrived within " +
            std::to_string(timeout.count()) + " ms");
      }
      tx_.Progress();
    }
    cpu_mark_ = CpuSeconds();  // the barrier's own waiting is not the variant's work
    return OkStatus();
  }
  std::string Key(const std::string& k) const { return job_.prefix + "bench/" + k; }

  bool VerifyParams(const char* after) {
    RankResult r;
    job_internal::VerifyEngineParams(job_, session_->ExpectedParams(), params_.bindings, r);
    res_.elements_checked += r.elements_checked;
    res_.element_mismatches += r.element_mismatches;
    if (r.element_mismatches > 0 && res_.first_mismatch.empty()) {
      res_.first_mismatch = std::string("after ") + after + ": " + r.first_mismatch;
    }
    return r.element_mismatches == 0;
  }

  // --commit staged: every rank starts the commit together (as an engine's pause would), and
  // the stall is each engine rank's Commit call.
  Status TimedCommit(int i) {
    SS_RETURN_IF_ERROR(Barrier("commit/" + std::to_string(i)));
    SS_ASSIGN_OR_RETURN(CommitReport c, session_->Commit(version_));
    if (who_.is_trainer) return OkStatus();
    if (i >= job_.bench_warmup) {
      res_.bench.stall.push_back(c.stall_seconds);
      res_.bench.commit_copy.push_back(c.copy_seconds);
    }
    res_.stall_seconds = c.stall_seconds;
    res_.transfer_seconds = res_.report.local.seconds;
    res_.staging_bytes = session_->staging_bytes();
    res_.keep_previous = c.keep_previous;
    return OkStatus();
  }

  // The copy a commit cannot beat: memcpy of each engine rank's parameter bytes, every engine
  // rank at once.
  Status CommitCeiling(int total) {
    std::vector<unsigned char> scratch;
    int64_t bytes = 0;
    for (const DestBinding& b : params_.bindings)
      bytes += NumElements(b.shape) * DTypeSize(b.dtype);
    if (!who_.is_trainer) scratch.assign(static_cast<size_t>(std::max<int64_t>(bytes, 1)), 1);
    for (int i = 0; i < total; ++i) {
      SS_RETURN_IF_ERROR(Barrier("commitraw/" + std::to_string(i)));
      const auto t0 = Clock::now();
      int64_t at = 0;
      for (const DestBinding& b : params_.bindings) {
        const int64_t n = NumElements(b.shape) * DTypeSize(b.dtype);
        std::memcpy(scratch.data() + at, b.data, static_cast<size_t>(n));
        at += n;
      }
      if (!who_.is_trainer) Record(res_.bench.commit_raw, i, t0);
    }
    return OkStatus();
  }

  Status Setup() {
    SessionOptions opt;
    HarnessHooks hooks;
    opt.prefix = job_.prefix;
    if (job_.launch.any()) {
      opt.job_id = job_.launch.id;
      opt.job_secret = job_.launch.secret;
    }
    opt.connect_timeout = job_.timeout;
    opt.sync_timeout = job_.timeout;
    ApplyCommitOptions(job_, opt);
    // The broadcast baseline needs trainer 0 <-> every engine rank.
    if (fp8()) {
    } else if (rank_ == 0) {
      for (int r = S_; r < world_; ++r) hooks.extra_peers.push_back(r);
    } else if (!who_.is_trainer) {
      hooks.extra_peers.push_back(0);
    }
    hooks.before_transport_connect = [this](Transport& t) -> Status {
      if (who_.is_trainer) return OkStatus();
      uint32_t a = 0;
      if (!fp8()) {
        SS_ASSIGN_OR_RETURN(a, t.RegisterMemory(bcast_.staging()));
      }
      SS_ASSIGN_OR_RETURN(uint32_t b,
                          t.RegisterMemory({raw_.data(), raw_.size(), MemKind::kHost, -1}));
      return store_.Set(Key("regs/" + std::to_string(rank_)),
                        std::to_string(a) + " " + std::to_string(b));
    };
    SS_ASSIGN_OR_RETURN(session_,
                        CreateHarnessSession(in_, rank_, store_, tx_, opt, std::move(hooks)));
    // Rank 0 fills the whole model for the broadcast baseline: minutes on a loaded 2-core
    // machine. Connect's timeout starts once every rank is set up.
    job_internal::SetupBarrier setup(job_, rank_, store_);
    SS_RETURN_IF_ERROR(setup.Begin());
    if (Status s = Fill(); !s.ok()) return setup.Fail(s);
    SS_RETURN_IF_ERROR(setup.Wait());
    SS_RETURN_IF_ERROR(session_->Connect());
    return ReadPeerRegions();
  }

  // This rank's synthetic weights and bindings, the baselines' buffers and its raw offsets.
  Status Fill() {
    const RankPlan& plan = session_->plan();
    if (who_.is_trainer) {
      SS_ASSIGN_OR_RETURN(shards_, job_internal::FillTrainerShards(job_, who_.trainer_rank));
      for (const SourceBinding& b : shards_.bindings) SS_RETURN_IF_ERROR(session_->BindSource(b));
      int64_t max_msg = 0;
      for (const Message& m : plan.sends) max_msg = std::max(max_msg, m.bytes);
      raw_.assign(std::max<int64_t>(max_msg, 1), 0x5A);
      if (rank_ == 0 && !fp8()) bcast_.SetupSender();
    } else {
      SS_ASSIGN_OR_RETURN(params_, job_internal::AllocateEngineParams(session_->ExpectedParams(),
                                                                      in_.options.wire_dtype));
      for (const DestBinding& b : params_.bindings) SS_RETURN_IF_ERROR(session_->BindDest(b));
      if (!fp8()) bcast_.SetupReceiver(session_->ExpectedParams());
      int64_t total = 0;
      for (const Message& m : plan.recvs) {
        SS_RETURN_IF_ERROR(
            store_.Set(Key("rawoff/" + std::to_string(rank_) + "/" + std::to_string(m.src)),
                       std::to_string(total)));
        total += m.bytes;
      }
      raw_.assign(std::max<int64_t>(total, 1), 0);
      res_.bench.bytes = total;
    }
    return OkStatus();
  }

  // Remote region ids and raw offsets of the peers this rank sends to.
  Status ReadPeerRegions() {
    const RankPlan& plan = session_->plan();
    const auto deadline = Clock::now() + job_.timeout;
    auto get = [&](const std::string& k) -> Result<std::string> {
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      return store_.Get(Key(k), std::max(left, Millis(1)));
    };
    if (who_.is_trainer) {
      std::vector<int> dsts;
      if (rank_ == 0 && !fp8()) {
        for (int r = S_; r < world_; ++r) dsts.push_back(r);
      }
      for (const Message& m : plan.sends) dsts.push_back(m.dst);
      for (int d : dsts) {
        SS_ASSIGN_OR_RETURN(std::string regs, get("regs/" + std::to_string(d)));
        unsigned a = 0, b = 0;
        if (std::sscanf(regs.c_str(), "%u %u", &a, &b) != 2) {
          return DataLossError("bench: malformed region ids of sync rank " + std::to_string(d));
        }
        if (!fp8()) bcast_.SetRemoteStaging(d, a);
        raw_region_[d] = b;
      }
      for (const Message& m : plan.sends) {
        SS_ASSIGN_OR_RETURN(std::string off,
                            get("rawoff/" + std::to_string(m.dst) + "/" + std::to_string(rank_)));
        char* end = nullptr;
        raw_offset_[m.dst] = std::strtoull(off.c_str(), &end, 10);
        if (off.empty() || *end != '\0') {
          return DataLossError("bench: malformed raw offset of sync rank " + std::to_string(m.dst));
        }
      }
    }
    return OkStatus();
  }

  bool put() const { return tx_.caps().one_sided_put; }

  Status Wait(std::vector<XferId>& ids, const std::string& what) {
    return WaitXfers(tx_, ids, job_.timeout, what);
  }

  std::vector<int> PlanPeers() const {
    std::vector<int> v;
    for (const Message& m : session_->plan().sends) v.push_back(m.dst);
    for (const Message& m : session_->plan().recvs) v.push_back(m.src);
    return v;
  }

  // Raw transfers are cut at 4 MiB (the session's own are at most kMaxTransferBytes, 1 MiB,
  // sync/transfers.h), not at the bucket cap: on UCX over CMA, 4 MiB transfers move the same bytes
  // about twice as fast as 512 MiB ones here, and the ceiling should be the transport's best.
  static constexpr int64_t kRawTransferBytes = int64_t{4} << 20;

  Status RawSend() {
    std::vector<XferId> ids;
    const int64_t cap = std::min(in_.options.bucket_bytes, kRawTransferBytes);
    for (const Message& m : session_->plan().sends) {
      uint64_t seq = 0;
      for (int64_t off = 0; off < m.bytes; off += cap) {
        const int64_t n = std::min(cap, m.bytes - off);
        auto id = put() ? tx_.PostPut(m.dst, raw_.data() + off, n, raw_region_.at(m.dst),
                                      raw_offset_.at(m.dst) + off)
                        : tx_.PostSend(m.dst, MakeTag(false, kBenchVersionRaw, seq++),
                                       raw_.data() + off, n);
        SS_RETURN_IF_ERROR(id.status());
        ids.push_back(*id);
      }
      if (put()) {
        SS_ASSIGN_OR_RETURN(XferId fl, tx_.PostFlush(m.dst));
        ids.push_back(fl);
      }
    }
    SS_RETURN_IF_ERROR(Wait(ids, "raw transfers"));
    if (put()) {
      for (const Message& m : session_->plan().sends) {
        SS_ASSIGN_OR_RETURN(XferId c, tx_.PostSend(m.dst, MakeTag(true, kBenchVersionRaw, 0),
                                                   &control_, sizeof(BenchControl)));
        ids.push_back(c);
      }
      SS_RETURN_IF_ERROR(Wait(ids, "raw completion messages"));
    }
    return FlushPeers(tx_, PlanPeers(), job_.timeout);
  }

  Status RawReceive() {
    std::vector<XferId> ids;
    std::vector<BenchControl> ctrl(session_->plan().recvs.size());
    const int64_t cap = std::min(in_.options.bucket_bytes, kRawTransferBytes);
    int64_t base = 0;
    for (size_t i = 0; i < session_->plan().recvs.size(); ++i) {
      const Message& m = session_->plan().recvs[i];
      if (put()) {
        SS_ASSIGN_OR_RETURN(XferId id, tx_.PostRecv(m.src, MakeTag(true, kBenchVersionRaw, 0),
                                                    &ctrl[i], sizeof(BenchControl)));
        ids.push_back(id);
      } else {
        uint64_t seq = 0;
        for (int64_t off = 0; off < m.bytes; off += cap) {
          const int64_t n = std::min(cap, m.bytes - off);
          SS_ASSIGN_OR_RETURN(XferId id,
                              tx_.PostRecv(m.src, MakeTag(false, kBenchVersionRaw, seq++),
                                           raw_.data() + base + off, n));
          ids.push_back(id);
        }
      }
      base += m.bytes;
    }
    SS_RETURN_IF_ERROR(Wait(ids, "raw transfers"));
    return FlushPeers(tx_, PlanPeers(), job_.timeout);
  }

  const JobSpec& job_;
  const PlanInputs& in_;
  int rank_;
  SyncRank who_;
  StoreClient& store_;
  Transport& tx_;
  RankResult& res_;
  ProgressFn progress_;
  int S_, world_, ws_;
  std::vector<HfTensor> inv_;
  std::unique_ptr<SyncSession> session_;
  uint64_t version_ = 0;
  job_internal::TrainerShards shards_;
  job_internal::EngineParams params_;
  std::vector<unsigned char> raw_;  // engines: raw receive area; trainers: raw source
  std::map<int, uint32_t> raw_region_;
  std::map<int, uint64_t> raw_offset_;
  BenchControl control_;
  job_internal::BroadcastBaseline bcast_;
  std::vector<unsigned char> update_saved_;  // UpdateTrainer: the original bytes it changes
  std::map<const std::vector<double>*, double> cpu_;  // CPU seconds per variant (measured reps)
  double cpu_mark_ = 0;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

Status job_internal::RunBenchRank(const JobSpec& job, int rank, const SyncRank& who,
                                  StoreClient& store, Transport& transport, RankResult& res,
                                  const ProgressFn& progress) {
  BenchRank b(job, rank, who, store, transport, res, progress);
  return b.Run();
}

Result<BenchSummary> SummarizeBench(const LocalJobResult& job) {
  if (!job.ok()) return AbortedError("bench: " + job.FailureReport());
  BenchSummary s;
  s.verified = true;
  size_t reps = 0;
  for (const RankResult& r : job.ranks) {
    s.bytes += r.bench.bytes;
    if (!r.is_trainer) s.verified = s.verified && r.bench.verified;
    reps = std::max(reps, r.bench.sharded.size());
  }
  // Per repetition, the job takes as long as its slowest rank.
  auto job_median = [&](auto member) {
    std::vector<double> per_rep(reps, 0.0);
    for (const RankResult& r : job.ranks) {
      const std::vector<double>& v = r.bench.*member;
      for (size_t i = 0; i < v.size() && i < reps; ++i) per_rep[i] = std::max(per_rep[i], v[i]);
    }
    return Median(per_rep);
  };
  s.sharded_seconds = job_median(&BenchNumbers::sharded);
  s.broadcast_seconds = job_median(&BenchNumbers::broadcast);
  s.raw_seconds = job_median(&BenchNumbers::raw);
  // A block-FP8 job has no broadcast-all variant (bench.cc): its figures stay 0.
  if (reps == 0 || s.sharded_seconds <= 0 || s.raw_seconds <= 0) {
    return InternalError("bench: no measured repetitions");
  }
  s.sharded_gbps = s.bytes / s.sharded_seconds / 1e9;
  s.broadcast_gbps = s.broadcast_seconds > 0 ? s.bytes / s.broadcast_seconds / 1e9 : 0;
  s.raw_transport_gbps = s.bytes / s.raw_seconds / 1e9;
  s.ratio_to_raw = s.sharded_gbps / s.raw_transport_gbps;
  s.speedup_vs_broadcast = s.broadcast_seconds / s.sharded_seconds;  // 0 without broadcast
  s.raw_nccl_seconds = job_median(&BenchNumbers::raw_nccl);
  if (s.raw_nccl_seconds > 0) s.ratio_to_raw_nccl = s.raw_nccl_seconds / s.sharded_seconds;
  s.stall_seconds = job_median(&BenchNumbers::stall);
  s.commit_raw_seconds = job_median(&BenchNumbers::commit_raw);
  s.commit_copy_seconds = job_median(&BenchNumbers::commit_copy);
  return s;
}

}  // namespace shardsync
