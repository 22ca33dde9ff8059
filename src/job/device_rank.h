// Device mode of the rank program (device_rank.cc) and the bench's device baselines
// (device_baselines.cc): the rank's state, shared by both files.
#pragma once

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

namespace shardsync::job_internal {

using Clock = std::chrono::steady_clock;

inline int64_t Align(int64_t v) { return (v + 255) / 256 * 256; }

// --commit staged, engine ranks of the bench: a decode-like loop on a stream of its own, each
// step one read of every live parameter (what a decode step reads), timed per step, so the bench
// can say how much the transfer and the commit slow the engine down. Pause / Resume bracket a
// commit as an engine's in-place pause does: the step in flight ends first, the next one waits
// (its time, from when it was due, is what a token sees across the commit).
class DecodeLoop {
 public:
  DecodeLoop(const void* p, size_t bytes, int device, Millis timeout, Clock::time_point epoch)
      : p_(p), bytes_(bytes), device_(device), timeout_(timeout), epoch_(epoch) {}
  ~DecodeLoop() { Stop().IgnoreError(); }  // a caller that cares called Stop() first
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
  // bench --update-fraction: sync i of `total` (the first: as filled) scales every
  // 1/fraction-th element of the trainer's weights by BenchUpdateFactor(i), the last restores
  // them; a no-op without the flag or on engine ranks.
  Status UpdateTrainer(int i, int total);
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
  std::unique_ptr<gpu::DeviceBuffer> buf_;           // trainer: held shards; engine: parameters
  std::unique_ptr<gpu::DeviceBuffer> update_saved_;  // UpdateTrainer: the elements it changes
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

}  // namespace shardsync::job_internal
