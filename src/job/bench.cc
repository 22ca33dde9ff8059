// Bench mode of the rank program: on one transport and one set of processes, (a) the sharded
// plan through a SyncSession, (b) the broadcast-all baseline (trainer rank 0 sends every full HF
// tensor to every engine rank, which slices its shards locally, as the engines'
// update_weights_from_distributed does), (c) raw transport transfers of the same bytes per
// receiver with no plan logic (the transport's ceiling). Each repetition starts at a store
// barrier; a rank's time runs from the barrier to its own end.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>

#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/shard_map.h"
#include "shardsync/synthetic.h"
#include "shardsync/transport.h"
#include "sync/internal.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;
using job_internal::BcastBucket;
using job_internal::BroadcastBuckets;
using job_internal::kBenchVersionBroadcast;
using job_internal::kBenchVersionRaw;
using sync_internal::MakeTag;

// Copies region `sr` of a row-major tensor (shape ss) into region `dr` of another (shape ds),
// element i of one to element i of the other, row-major.
void CopyRegion(const unsigned char* src, const Shape& ss, const Region& sr, unsigned char* dst,
                const Shape& ds, const Region& dr, int es) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  ForEachRun(sr, ss, [&](int64_t off, int64_t len) { runs.emplace_back(off, len); });
  size_t k = 0;
  int64_t pos = 0;
  ForEachRun(dr, ds, [&](int64_t off, int64_t len) {
    for (int64_t done = 0; done < len;) {
      const int64_t n = std::min(len - done, runs[k].second - pos);
      std::memcpy(dst + (off + done) * es, src + (runs[k].first + pos) * es, n * es);
      done += n;
      pos += n;
      if (pos == runs[k].second) {
        ++k;
        pos = 0;
      }
    }
  });
}

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
        inv_(HfTensorInventory(in_.model)) {
    buckets_ = BroadcastBuckets(inv_, ws_, in_.options.bucket_bytes, &tensor_offsets_);
    for (const BcastBucket& b : buckets_) max_bucket_ = std::max(max_bucket_, b.bytes);
  }

  Status Run() {
    SS_RETURN_IF_ERROR(Setup());
    Step();
    const int total = job_.bench_warmup + job_.bench_reps;
    // (a) sharded.
    for (int i = 0; i < total; ++i) {
      SS_RETURN_IF_ERROR(Barrier("sharded/" + std::to_string(i)));
      const auto t0 = Clock::now();
      SS_RETURN_IF_ERROR(session_->Sync(++version_).status());
      Record(res_.bench.sharded, i, t0);
    }
    bool verified = true;
    if (!who_.is_trainer) verified = VerifyParams("sharded");
    Step();
    // (b) broadcast-all. Parameters are scrambled first so the baseline has to rewrite them.
    if (!who_.is_trainer) {
      for (auto& b : params_.bindings) {
        std::memset(b.data, 0xA5, NumElements(b.shape) * ws_);
      }
    }
    for (int i = 0; i < total; ++i) {
      SS_RETURN_IF_ERROR(Barrier("broadcast/" + std::to_string(i)));
      const auto t0 = Clock::now();
      if (rank_ == 0) {
        SS_RETURN_IF_ERROR(BroadcastSend());
      } else if (!who_.is_trainer) {
        SS_RETURN_IF_ERROR(BroadcastReceive());
      }
      Record(res_.bench.broadcast, i, t0);
    }
    if (!who_.is_trainer) verified = VerifyParams("broadcast") && verified;
    Step();
    // (c) raw transfers of the plan's bytes per (sender, receiver) pair.
    for (int i = 0; i < total; ++i) {
      SS_RETURN_IF_ERROR(Barrier("raw/" + std::to_string(i)));
      const auto t0 = Clock::now();
      SS_RETURN_IF_ERROR(who_.is_trainer ? RawSend() : RawReceive());
      Record(res_.bench.raw, i, t0);
    }
    SS_RETURN_IF_ERROR(EndBarrier());
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
    const char* file = std::getenv("SHARDSYNC_BENCH_CPU");
    if (file == nullptr || *file == '\0' || job_.bench_reps <= 0) return;
    if (FILE* f = std::fopen(file, "a")) {
      std::fprintf(
          f, "rank %d %s cpu_s_per_rep sharded %.4f broadcast %.4f raw %.4f\n", rank_,
          who_.is_trainer ? "trainer" : "engine", cpu_[&res_.bench.sharded] / job_.bench_reps,
          cpu_[&res_.bench.broadcast] / job_.bench_reps, cpu_[&res_.bench.raw] / job_.bench_reps);
      std::fclose(f);
    }
  }
  Status Barrier(const std::string& name) {
    Status s = store_.Barrier(job_.prefix + "bench/" + name, world_, job_.timeout);
    cpu_mark_ = CpuSeconds();  // the barrier's own waiting is not the variant's work
    return s;
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

  Status Setup() {
    SessionOptions opt;
    sync_internal::HarnessHooks hooks;
    opt.prefix = job_.prefix;
    opt.connect_timeout = job_.timeout;
    opt.sync_timeout = job_.timeout;
    // The broadcast baseline needs trainer 0 <-> every engine rank.
    if (rank_ == 0) {
      for (int r = S_; r < world_; ++r) hooks.extra_peers.push_back(r);
    } else if (!who_.is_trainer) {
      hooks.extra_peers.push_back(0);
    }
    hooks.before_transport_connect = [this](Transport& t) -> Status {
      if (who_.is_trainer) return OkStatus();
      SS_ASSIGN_OR_RETURN(uint32_t a,
                          t.RegisterMemory({stage_.data(), stage_.size(), MemKind::kHost, -1}));
      SS_ASSIGN_OR_RETURN(uint32_t b,
                          t.RegisterMemory({raw_.data(), raw_.size(), MemKind::kHost, -1}));
      return store_.Set(Key("regs/" + std::to_string(rank_)),
                        std::to_string(a) + " " + std::to_string(b));
    };
    SS_ASSIGN_OR_RETURN(session_, sync_internal::CreateHarnessSession(in_, rank_, store_, tx_, opt,
                                                                      std::move(hooks)));
    const RankPlan& plan = session_->plan();
    if (who_.is_trainer) {
      SS_ASSIGN_OR_RETURN(shards_, job_internal::FillTrainerShards(job_, who_.trainer_rank));
      for (const SourceBinding& b : shards_.bindings) SS_RETURN_IF_ERROR(session_->BindSource(b));
      int64_t max_msg = 0;
      for (const Message& m : plan.sends) max_msg = std::max(max_msg, m.bytes);
      raw_.assign(std::max<int64_t>(max_msg, 1), 0x5A);
      if (rank_ == 0) SS_RETURN_IF_ERROR(FillFullModel());
    } else {
      SS_ASSIGN_OR_RETURN(params_, job_internal::AllocateEngineParams(session_->ExpectedParams(),
                                                                      in_.options.wire_dtype));
      for (const DestBinding& b : params_.bindings) SS_RETURN_IF_ERROR(session_->BindDest(b));
      stage_.assign(std::max<int64_t>(2 * max_bucket_, 1), 0);
      int64_t total = 0;
      for (const Message& m : plan.recvs) {
        SS_RETURN_IF_ERROR(
            store_.Set(Key("rawoff/" + std::to_string(rank_) + "/" + std::to_string(m.src)),
                       std::to_string(total)));
        total += m.bytes;
      }
      raw_.assign(std::max<int64_t>(total, 1), 0);
      res_.bench.bytes = total;
      // Which parameter pieces each HF tensor feeds (broadcast receivers slice locally).
      std::map<std::string, size_t> index;
      for (size_t t = 0; t < inv_.size(); ++t) index[inv_[t].name] = t;
      slices_.resize(inv_.size());
      const auto& params = session_->ExpectedParams();
      for (size_t p = 0; p < params.size(); ++p) {
        for (size_t k = 0; k < params[p].pieces.size(); ++k) {
          slices_[index.at(params[p].pieces[k].source)].emplace_back(p, k);
        }
      }
    }
    SS_RETURN_IF_ERROR(session_->Connect());
    // Remote region ids and raw offsets of the peers this rank sends to.
    const auto deadline = Clock::now() + job_.timeout;
    auto get = [&](const std::string& k) -> Result<std::string> {
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      return store_.Get(Key(k), std::max(left, Millis(1)));
    };
    if (who_.is_trainer) {
      std::vector<int> dsts;
      if (rank_ == 0) {
        for (int r = S_; r < world_; ++r) dsts.push_back(r);
      }
      for (const Message& m : plan.sends) dsts.push_back(m.dst);
      for (int d : dsts) {
        SS_ASSIGN_OR_RETURN(std::string regs, get("regs/" + std::to_string(d)));
        unsigned a = 0, b = 0;
        if (std::sscanf(regs.c_str(), "%u %u", &a, &b) != 2) {
          return DataLossError("bench: malformed region ids of sync rank " + std::to_string(d));
        }
        stage_region_[d] = a;
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

  // Trainer rank 0 holds the whole model in the trainer dtype, as a gathered full_tensor()
  // would be (the gather itself is not timed, which favours the baseline).
  Status FillFullModel() {
    const DType td = in_.trainer_dtype;
    const int ts = DTypeSize(td);
    int64_t total = 0;
    for (const HfTensor& t : inv_) total += t.numel() * ts;
    full_.resize(total);
    std::vector<float> tmp;
    int64_t at = 0;
    for (size_t t = 0; t < inv_.size(); ++t) {
      const int64_t n = inv_[t].numel();
      tmp.resize(n);
      FillSyntheticRegion(job_.seed, inv_[t].name, inv_[t].shape, Region::Full(inv_[t].shape),
                          tmp.data());
      job_internal::StoreFloats(tmp.data(), n, td, full_.data() + at);
      at += n * ts;
    }
    stage_.assign(std::max<int64_t>(2 * max_bucket_, 1), 0);
    return OkStatus();
  }

  bool put() const { return tx_.caps().one_sided_put; }

  Status Wait(std::vector<XferId>& ids, const std::string& what) {
    Status s = WaitAllXfers(tx_, ids, job_.timeout, what);
    ids.clear();
    return s;
  }

  // Send completion can precede the protocol tail on this side (UCX rendezvous): flush every
  // peer before leaving the transport alone at the next store barrier.
  Status FlushPeers(const std::vector<int>& peers) {
    std::vector<XferId> ids;
    for (int p : peers) {
      SS_ASSIGN_OR_RETURN(XferId id, tx_.PostFlush(p));
      ids.push_back(id);
    }
    return Wait(ids, "flushing peers");
  }
  std::vector<int> EnginePeers() const {
    std::vector<int> v;
    for (int r = S_; r < world_; ++r) v.push_back(r);
    return v;
  }
  std::vector<int> PlanPeers() const {
    std::vector<int> v;
    for (const Message& m : session_->plan().sends) v.push_back(m.dst);
    for (const Message& m : session_->plan().recvs) v.push_back(m.src);
    return v;
  }

  // No rank leaves (closing its endpoints) while a peer may still drive transfers with it: the
  // transport reports a departed peer as a failure of every transfer with it. Waits for every
  // rank's end key, driving this rank's transport progress meanwhile (a peer's rendezvous tail
  // may need it).
  Status EndBarrier() {
    SS_RETURN_IF_ERROR(store_.Set(Key("end/" + std::to_string(rank_)), "1"));
    const auto deadline = Clock::now() + job_.timeout;
    std::vector<int> peers = PlanPeers();
    if (rank_ == 0) {
      for (int r : EnginePeers()) peers.push_back(r);
    } else if (!who_.is_trainer) {
      peers.push_back(0);
    }
    XferId progress = 0;
    size_t next = 0;
    for (int r = 0; r < world_; ++r) {
      while (true) {
        const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        if (left <= Millis(0)) {
          return DeadlineExceededError("bench: sync rank " + std::to_string(rank_) +
                                       " timed out waiting for sync rank " + std::to_string(r) +
                                       " to finish");
        }
        auto v = store_.Get(Key("end/" + std::to_string(r)), std::min(left, Millis(5)));
        if (v.ok()) break;
        if (v.status().code() != StatusCode::kDeadlineExceeded) return v.status();
        if (peers.empty()) continue;
        if (progress == 0) {
          auto id = tx_.PostFlush(peers[next++ % peers.size()]);
          if (id.ok()) progress = *id;
        } else {
          auto st = tx_.Poll(progress);
          if (!st.ok() || *st == XferState::kDone) progress = 0;
        }
      }
    }
    if (progress != 0) {
      // Every rank finished its transfers: this flush only drains; its outcome is moot.
      std::vector<XferId> one{progress};
      WaitAllXfers(tx_, one, Millis(1000), "draining").IgnoreError();
    }
    return OkStatus();
  }

  Status BroadcastSend() {
    const int E = world_ - S_;
    const DType td = in_.trainer_dtype;
    const int ts = DTypeSize(td);
    std::vector<std::vector<XferId>> sends(buckets_.size());
    std::vector<std::vector<XferId>> acks(buckets_.size());
    std::vector<char> ack_bufs(buckets_.size() * E);
    std::vector<Control> controls(buckets_.size());
    for (size_t k = 0; k < buckets_.size(); ++k) {
      if (k >= 2) {
        // Slot k % 2 is free once bucket k-2 left it and every receiver sliced it.
        SS_RETURN_IF_ERROR(Wait(sends[k - 2], "broadcast bucket " + std::to_string(k - 2)));
        SS_RETURN_IF_ERROR(Wait(acks[k - 2], "broadcast acks of bucket " + std::to_string(k - 2)));
      }
      const BcastBucket& b = buckets_[k];
      // Cast the bucket's full tensors to the wire dtype, as the trainer does before broadcasting.
      unsigned char* slot = stage_.data() + (k % 2) * max_bucket_;
      const int64_t elems = b.bytes / ws_;
      sync_internal::CastInto(full_.data() + (b.offset / ws_) * ts, td, slot,
                              in_.options.wire_dtype, elems);
      const uint64_t remote = (k % 2) * max_bucket_;
      for (int e = 0; e < E; ++e) {
        const int dst = S_ + e;
        SS_ASSIGN_OR_RETURN(XferId a, tx_.PostRecv(dst, MakeTag(true, kBenchVersionBroadcast, k),
                                                   &ack_bufs[k * E + e], 1));
        acks[k].push_back(a);
        if (put()) {
          // Put, flush, then announce (the receiver slices only bytes that landed).
          std::vector<XferId> landed;
          SS_ASSIGN_OR_RETURN(XferId id,
                              tx_.PostPut(dst, slot, b.bytes, stage_region_.at(dst), remote));
          landed.push_back(id);
          SS_ASSIGN_OR_RETURN(XferId fl, tx_.PostFlush(dst));
          landed.push_back(fl);
          SS_RETURN_IF_ERROR(Wait(landed, "broadcast to sync rank " + std::to_string(dst)));
          SS_ASSIGN_OR_RETURN(XferId c, tx_.PostSend(dst, MakeTag(true, kBenchVersionBroadcast, k),
                                                     &controls[k], sizeof(Control)));
          sends[k].push_back(c);
        } else {
          SS_ASSIGN_OR_RETURN(
              XferId id,
              tx_.PostSend(dst, MakeTag(false, kBenchVersionBroadcast, k), slot, b.bytes));
          sends[k].push_back(id);
        }
      }
    }
    for (size_t k = 0; k < buckets_.size(); ++k) {
      SS_RETURN_IF_ERROR(Wait(sends[k], "broadcast sends"));
      SS_RETURN_IF_ERROR(Wait(acks[k], "broadcast acks"));
    }
    return FlushPeers(EnginePeers());
  }

  Status BroadcastReceive() {
    const auto& params = session_->ExpectedParams();
    auto post = [&](size_t k) -> Result<XferId> {
      unsigned char* slot = stage_.data() + (k % 2) * max_bucket_;
      if (put()) {
        return tx_.PostRecv(0, MakeTag(true, kBenchVersionBroadcast, k), &control_,
                            sizeof(Control));
      }
      return tx_.PostRecv(0, MakeTag(false, kBenchVersionBroadcast, k), slot, buckets_[k].bytes);
    };
    std::vector<XferId> acks;
    // Put mode: one control buffer, so one bucket announced at a time (the sender's acks keep
    // at most two buckets in flight anyway).
    const size_t ahead = put() ? 1 : 2;
    std::vector<XferId> posted;
    for (size_t k = 0; k < std::min(ahead, buckets_.size()); ++k) {
      SS_ASSIGN_OR_RETURN(XferId id, post(k));
      posted.push_back(id);
    }
    char ack = 1;
    for (size_t k = 0; k < buckets_.size(); ++k) {
      std::vector<XferId> one{posted[k]};
      SS_RETURN_IF_ERROR(Wait(one, "broadcast bucket " + std::to_string(k) + " from sync rank 0"));
      const BcastBucket& b = buckets_[k];
      const unsigned char* slot = stage_.data() + (k % 2) * max_bucket_;
      for (size_t t = b.t_begin; t < b.t_end; ++t) {
        const unsigned char* tensor = slot + (tensor_offsets_[t] - b.offset);
        for (auto [p, pc] : slices_[t]) {
          const Piece& piece = params[p].pieces[pc];
          CopyRegion(tensor, inv_[t].shape, piece.src,
                     static_cast<unsigned char*>(params_.bindings[p].data), params[p].shape,
                     piece.dst, ws_);
        }
      }
      if (k + ahead < buckets_.size()) {
        SS_ASSIGN_OR_RETURN(XferId id, post(k + ahead));
        posted.push_back(id);
      }
      SS_ASSIGN_OR_RETURN(XferId a,
                          tx_.PostSend(0, MakeTag(true, kBenchVersionBroadcast, k), &ack, 1));
      acks.push_back(a);
    }
    // Padding rows, as the engine's loader would zero them.
    for (size_t p = 0; p < params.size(); ++p) {
      for (const ZeroFill& z : params[p].zero_fills) {
        ForEachRun(z.dst, params[p].shape, [&](int64_t off, int64_t len) {
          std::memset(static_cast<unsigned char*>(params_.bindings[p].data) + off * ws_, 0,
                      len * ws_);
        });
      }
    }
    SS_RETURN_IF_ERROR(Wait(acks, "broadcast acks"));
    return FlushPeers({0});
  }

  // Raw transfers use the sync session's transfer size (at most 4 MiB, session.cc), not the
  // bucket cap: on UCX over CMA, 4 MiB transfers move the same bytes about twice as fast as
  // 512 MiB ones here, and the ceiling should be the transport's best, not a handicapped one.
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
                                                   &control_, sizeof(Control)));
        ids.push_back(c);
      }
      SS_RETURN_IF_ERROR(Wait(ids, "raw completion messages"));
    }
    return FlushPeers(PlanPeers());
  }

  Status RawReceive() {
    std::vector<XferId> ids;
    std::vector<Control> ctrl(session_->plan().recvs.size());
    const int64_t cap = std::min(in_.options.bucket_bytes, kRawTransferBytes);
    int64_t base = 0;
    for (size_t i = 0; i < session_->plan().recvs.size(); ++i) {
      const Message& m = session_->plan().recvs[i];
      if (put()) {
        SS_ASSIGN_OR_RETURN(XferId id, tx_.PostRecv(m.src, MakeTag(true, kBenchVersionRaw, 0),
                                                    &ctrl[i], sizeof(Control)));
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
    return FlushPeers(PlanPeers());
  }

  struct Control {
    uint64_t word[4] = {};
  };

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
  std::vector<BcastBucket> buckets_;
  std::vector<int64_t> tensor_offsets_;
  int64_t max_bucket_ = 0;
  std::unique_ptr<SyncSession> session_;
  uint64_t version_ = 0;
  job_internal::TrainerShards shards_;
  job_internal::EngineParams params_;
  std::vector<unsigned char> full_;   // trainer 0: the whole model, trainer dtype
  std::vector<unsigned char> stage_;  // two broadcast buckets (trainer 0: cast; engines: landed)
  std::vector<unsigned char> raw_;    // engines: raw receive area; trainers: raw source
  std::vector<std::vector<std::pair<size_t, size_t>>> slices_;  // tensor -> (param, piece)
  std::map<int, uint32_t> stage_region_, raw_region_;
  std::map<int, uint64_t> raw_offset_;
  Control control_;
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
  if (!job.ok()) return AbortedError("bench: " + job.FirstError());
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
  if (reps == 0 || s.sharded_seconds <= 0 || s.broadcast_seconds <= 0 || s.raw_seconds <= 0) {
    return InternalError("bench: no measured repetitions");
  }
  s.sharded_gbps = s.bytes / s.sharded_seconds / 1e9;
  s.broadcast_gbps = s.bytes / s.broadcast_seconds / 1e9;
  s.raw_transport_gbps = s.bytes / s.raw_seconds / 1e9;
  s.ratio_to_raw = s.sharded_gbps / s.raw_transport_gbps;
  s.speedup_vs_broadcast = s.broadcast_seconds / s.sharded_seconds;
  s.raw_nccl_seconds = job_median(&BenchNumbers::raw_nccl);
  if (s.raw_nccl_seconds > 0) s.ratio_to_raw_nccl = s.raw_nccl_seconds / s.sharded_seconds;
  return s;
}

}  // namespace shardsync
