// One GPU's turn for the cuda_ipc send launches of one job on one host: at most one of them in
// flight at a time. Without MPS, kernels of different processes do not run side by side: the
// GPU time-slices their contexts, preempting a running pack kernel (its blocks' state saved and
// restored) whenever another process's kernel waits. A Megatron tp2 pp2 trainer on one GPU is
// four such processes; taking turns lets each kernel run alone (measured on an H200,
// docs/benchmarks.md). Only speed is at stake: a turnstile that cannot be opened, or a holder
// that keeps its turn past kMaxWait, leaves launches unordered, as they were before.
//
// POSIX shared memory named after the job (its transport prefix), the user and the GPU's PCI bus
// id, created zero-filled by whoever comes first (zeros are the initial state, so no one
// initializes it). The turn is a 64-bit word: 0 free, else the holder's token (pid << 32 | a
// per-process instance number, so two transports of one process are different holders); a
// holder whose process is gone is replaced. Users are listed by token; the last one out (no live
// user left) removes the name. Host code only: no CUDA call.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "shardsync/status.h"

namespace shardsync::gpu::internal {

class GpuTurnstile {
 public:
  static constexpr int kUsers = 64;
  // A waiter stops waiting for a holder that kept the turn this long (a hung or stopped
  // process, or a kernel far longer than any sync's): it launches without the turn.
  static constexpr std::chrono::milliseconds kMaxWait{2000};

  // The segment name of the turnstile of (job `prefix`, GPU `gpu_id`).
  static std::string Name(const std::string& prefix, const std::string& gpu_id);
  // Opens (creating when absent) the segment `name`; Unavailable when it cannot.
  static Result<std::unique_ptr<GpuTurnstile>> Open(const std::string& name,
                                                    std::chrono::milliseconds max_wait = kMaxWait);
  ~GpuTurnstile();  // gives the turn back, leaves; the last live user unlinks the name
  GpuTurnstile(const GpuTurnstile&) = delete;
  GpuTurnstile& operator=(const GpuTurnstile&) = delete;

  enum class Turn {
    kMine,      // this instance holds the turn (taken now or before)
    kBusy,      // another holder has it: try again later
    kBypassed,  // the holder kept it past max_wait: go ahead without it
  };
  Turn TryTake();
  // Gives the turn back if this instance holds it (idempotent).
  void Give();
  bool held() const { return held_; }
  // The current holder's pid (0: none), for messages.
  int HolderPid() const;
  uint64_t token() const { return token_; }

 private:
  struct Segment;
  GpuTurnstile(std::string name, Segment* seg, std::chrono::milliseconds max_wait);

  std::string name_;
  Segment* seg_;
  std::chrono::milliseconds max_wait_;
  uint64_t token_;
  int user_slot_ = -1;  // -1: not listed (every slot taken by live users)
  bool held_ = false;
  // The holder a TryTake last saw, since when, and when its pid was last checked.
  uint64_t seen_ = 0;
  std::chrono::steady_clock::time_point seen_since_, next_pid_check_;
};

}  // namespace shardsync::gpu::internal
