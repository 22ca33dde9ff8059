// Shared launches of one GPU's cuda_ipc senders (one job, one host): one sender, the GPU's
// launcher, packs for the other senders of its GPU in the same launch, so the GPU runs one launch
// per sync instead of one per sender process. Separate launches cost each about 0.15 ms more than
// their share of one (a context switch between the processes, the launch, the kernel's ramp and
// tail; measured on an H200, docs/benchmarks.md).
//
// Each sender publishes, once, its send pairs' batch (cuda_ipc_share.cc writes it: pointers as
// CUDA IPC handles and offsets) in its slot of this board, and per sync posts the version it is
// ready for (every receiver of its pairs is in that sync). The launcher is stable: the live
// sender of lowest sync rank that has not said it cannot share (Leader), so it opens the others'
// allocations and builds the merged batch once per job. It claims the slots ready for its version
// (a compare-and-swap on the slot's ready word: a sender that takes its post back with Withdraw
// and a launcher that claims it cannot both win), launches, and when the launch completes hands
// each claimed slot its buckets' sums (done) or the failure (failed). A claimed sender then tells
// its receivers as if it had launched itself. A sender that is not claimed (the launcher went
// without it, is gone, or took too long) withdraws its post and launches for itself under the
// GPU's turn, as without the board.
//
// POSIX shared memory named after the job (transport prefix), the user and the GPU, created
// zero-filled by whoever comes first (zeros are the initial state). Slots are owned by tokens
// (pid << 32 | instance); a slot whose owner's process is gone is reused, reset under a
// sentinel token first so no one reads a stale version from it. The last user out unlinks the
// name. Host code only: no CUDA call.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/status.h"

namespace shardsync::gpu::internal {

class GpuLaunchBoard {
 public:
  static constexpr int kSlots = 16;
  static constexpr uint32_t kMaxBuckets = 1024;          // per sender (sums in the slot)
  static constexpr size_t kSpecBytes = size_t{1} << 20;  // a sender's published batch

  static std::string Name(const std::string& prefix, const std::string& gpu_id);
  // Opens (creating when absent) `name` and takes a slot for sync rank `rank`; Unavailable when
  // the segment cannot be opened or every slot is held by a live process.
  static Result<std::unique_ptr<GpuLaunchBoard>> Open(const std::string& name, int rank);
  ~GpuLaunchBoard();  // frees the slot; the last live user unlinks the name
  GpuLaunchBoard(const GpuLaunchBoard&) = delete;
  GpuLaunchBoard& operator=(const GpuLaunchBoard&) = delete;

  int slot() const { return slot_; }
  uint64_t token() const { return token_; }

  // --- A sender's own slot.
  // Its batch (bytes of gpu_share.h's format) and bucket count; InvalidArgument past the limits.
  Status Publish(std::string_view spec, uint32_t buckets);
  // This sender will never be launched by another (its batch cannot be shared): launchers stop
  // waiting for it.
  void MarkUnshareable();
  void PostReady(uint64_t version);
  // Takes back a posted `version`: true when no launcher can claim it any more (withdrawn now, or
  // never posted); false when a launcher claimed it first (ClaimedFor says so once the launcher
  // has written its name, microseconds later).
  bool Withdraw(uint64_t version);
  // Whether a launcher claimed this slot for `version`, and who (rank, pid).
  bool ClaimedFor(uint64_t version, int* launcher_rank = nullptr,
                  int* launcher_pid = nullptr) const;
  enum class Outcome { kPending, kDone, kFailed, kLauncherGone };
  // The claimed launch of `version`: its sums once done (packed finished, landed raw, per
  // bucket), or why there are none. The launcher's liveness is checked at most every ms.
  Outcome Collect(uint64_t version, std::vector<uint64_t>* packed, std::vector<uint64_t>* landed);

  // --- The launcher.
  struct Peer {
    int slot = -1;
    int rank = -1;
    uint64_t token = 0;
    uint64_t generation = 0;  // of its published batch
    uint32_t buckets = 0;
  };
  // Other live senders ready for `version` and not claimed for it (published batches); and how
  // many other live senders may still become ready for it (shareable, or not yet known).
  void Survey(uint64_t version, std::vector<Peer>* ready, int* pending) const;
  // The launcher of this GPU: the live slot of lowest sync rank not marked unshareable (ties: the
  // lower slot). Its slot and whether it is this one's; -1 when there is none.
  int Leader() const;
  bool IsLeader() const { return Leader() == slot_; }
  // Whether slot `slot`'s owner launched for `version` (it claimed its own slot for it).
  bool LaunchedFor(int slot, uint64_t version) const;
  // A peer's published batch; empty if it changed since Survey (the slot changed hands).
  std::string Spec(const Peer& p) const;
  // Claims `p` for `version`: false when its owner or batch changed or it is no longer ready
  // (never posted, withdrawn, or claimed by another).
  bool Claim(const Peer& p, uint64_t version);
  // The launcher's own slot, so no later launcher packs its batch again for `version`.
  void ClaimOwn(uint64_t version);
  void Complete(const Peer& p, uint64_t version, const uint64_t* packed, const uint64_t* landed);
  // Successful Claims by any board of this process (tests: that launches were shared at all).
  static uint64_t ClaimsMade();
  // Unlinks this user's boards whose every slot is free or owned by a dead process and whose
  // name is at least `min_age` old: boards of jobs that were killed (the last user out unlinks a
  // board, a killed job's last user never does), each holding the pages its senders published.
  // Open runs it with 60 s (a live job's board has a live slot; a board younger than that may be
  // being created). `only`: just that board (tests). Returns how many it removed.
  static int SweepStale(std::chrono::seconds min_age, const std::string& only = "");
  void Fail(const Peer& p, uint64_t version);

  struct Segment;

 private:
  GpuLaunchBoard(std::string name, Segment* seg, int slot, uint64_t token);

  std::string name_;
  Segment* seg_;
  int slot_;
  uint64_t token_;
  std::chrono::steady_clock::time_point next_pid_check_;
};

}  // namespace shardsync::gpu::internal
