#include "cuda/gpu_turnstile.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "cuda/shm_common.h"

namespace shardsync::gpu::internal {

struct GpuTurnstile::Segment {
  alignas(64) uint64_t turn;           // 0: free; else the holder's token
  alignas(64) uint64_t users[kUsers];  // tokens of the instances that opened it (0: free)
};

namespace {

constexpr size_t kTurnstileBytes = 4096;

using Ref = std::atomic_ref<uint64_t>;
static_assert(Ref::is_always_lock_free, "shared-memory words must be lock-free");

std::string TurnstileErrno(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

std::string GpuTurnstile::Name(const std::string& prefix, const std::string& gpu_id) {
  return GpuShmName("ssgpu", prefix, gpu_id);
}

GpuTurnstile::GpuTurnstile(std::string name, Segment* seg, std::chrono::milliseconds max_wait)
    : name_(std::move(name)), seg_(seg), max_wait_(max_wait), token_(NewShmToken()) {
  for (int i = 0; i < kUsers && user_slot_ < 0; ++i) {
    uint64_t v = Ref(seg_->users[i]).load(std::memory_order_acquire);
    if ((v == 0 || !PidAlive(TokenPid(v))) &&
        Ref(seg_->users[i]).compare_exchange_strong(v, token_, std::memory_order_acq_rel)) {
      user_slot_ = i;
    }
  }
}

Result<std::unique_ptr<GpuTurnstile>> GpuTurnstile::Open(const std::string& name,
                                                         std::chrono::milliseconds max_wait) {
  static_assert(sizeof(Segment) <= kTurnstileBytes);
  SS_ASSIGN_OR_RETURN(const int fd, OpenOwnShm(name, kTurnstileBytes, "gpu turnstile"));
  void* p =
      mmap(nullptr, kTurnstileBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return UnavailableError(TurnstileErrno("gpu turnstile mmap " + name));
  return std::unique_ptr<GpuTurnstile>(new GpuTurnstile(name, static_cast<Segment*>(p), max_wait));
}

GpuTurnstile::~GpuTurnstile() {
  Give();
  if (user_slot_ >= 0) Ref(seg_->users[user_slot_]).store(0, std::memory_order_release);
  bool live = false;
  for (int i = 0; i < kUsers && !live; ++i) {
    const uint64_t v = Ref(seg_->users[i]).load(std::memory_order_acquire);
    live = v != 0 && PidAlive(TokenPid(v));
  }
  // A process opening the name right now keeps a segment no one else will find: its launches
  // are then unordered for that job, which costs speed only.
  if (!live) shm_unlink(name_.c_str());
  munmap(seg_, kTurnstileBytes);
}

GpuTurnstile::Turn GpuTurnstile::TryTake() {
  if (held_) return Turn::kMine;
  Ref turn(seg_->turn);
  uint64_t cur = 0;
  // Our own token left by an earlier process with this pid and instance number: ours now.
  if (turn.compare_exchange_strong(cur, token_, std::memory_order_acq_rel) || cur == token_) {
    held_ = true;
    seen_ = 0;
    return Turn::kMine;
  }
  const auto now = std::chrono::steady_clock::now();
  if (cur != seen_) {
    seen_ = cur;
    seen_since_ = now;
    next_pid_check_ = now;
  }
  if (now >= next_pid_check_) {  // a syscall: at most every millisecond
    next_pid_check_ = now + std::chrono::milliseconds(1);
    if (!PidAlive(TokenPid(cur)) && turn.compare_exchange_strong(cur, token_)) {
      held_ = true;
      seen_ = 0;
      return Turn::kMine;
    }
  }
  return now - seen_since_ >= max_wait_ ? Turn::kBypassed : Turn::kBusy;
}

void GpuTurnstile::Give() {
  if (!held_) return;
  held_ = false;
  uint64_t mine = token_;
  Ref(seg_->turn).compare_exchange_strong(mine, 0, std::memory_order_acq_rel);
}

int GpuTurnstile::HolderPid() const {
  return TokenPid(Ref(seg_->turn).load(std::memory_order_acquire));
}

}  // namespace shardsync::gpu::internal
