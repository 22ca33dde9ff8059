#include "cuda/gpu_launch_board.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "cuda/shm_common.h"

namespace shardsync::gpu::internal {

namespace {

std::atomic<uint64_t> claims_made{0};

constexpr uint64_t kResetting = 1;  // a slot's token while a new owner resets it (pid 0)
constexpr uint32_t kShareUnknown = 0, kShareable = 1, kUnshareable = 2;

using Ref = std::atomic_ref<uint64_t>;
using Ref32 = std::atomic_ref<uint32_t>;
static_assert(Ref::is_always_lock_free && Ref32::is_always_lock_free,
              "shared-memory words must be lock-free");

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

struct SlotHeader {
  alignas(64) uint64_t token;  // owner; 0 free; kResetting while reset
  uint64_t generation;         // batches published (0: none)
  uint64_t spec_bytes;
  uint32_t buckets;
  uint32_t share;  // kShareUnknown / kShareable / kUnshareable
  uint32_t rank;
  alignas(64) uint64_t ready;  // version posted
  alignas(64) uint64_t claimed;
  uint64_t launcher;  // the claiming launcher's token
  uint32_t launcher_rank;
  uint64_t claiming;  // the version a launcher took off `ready` (then writes `claimed`)
  alignas(64) uint64_t done;
  uint64_t failed;
  uint64_t packed[GpuLaunchBoard::kMaxBuckets];
  uint64_t landed[GpuLaunchBoard::kMaxBuckets];
};

struct GpuLaunchBoard::Segment {
  SlotHeader slots[kSlots];
  unsigned char spec[kSlots][kSpecBytes];  // touched only by publishers (pages stay lazy)
};

namespace {
constexpr size_t kLen = sizeof(GpuLaunchBoard::Segment);
}  // namespace

std::string GpuLaunchBoard::Name(const std::string& prefix, const std::string& gpu_id) {
  return GpuShmName("ssgpb", prefix, gpu_id);
}

GpuLaunchBoard::GpuLaunchBoard(std::string name, Segment* seg, int slot, uint64_t token)
    : name_(std::move(name)), seg_(seg), slot_(slot), token_(token) {}

int GpuLaunchBoard::SweepStale(std::chrono::seconds min_age, const std::string& only) {
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  const std::string prefix = "ssgpb_" + std::to_string(getuid()) + "_";
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    if (std::string_view(e->d_name).starts_with(prefix)) names.emplace_back(e->d_name);
  }
  closedir(d);
  const auto now = std::chrono::system_clock::now();
  int removed = 0;
  for (const std::string& n : names) {
    if (!only.empty() && "/" + n != only) continue;
    const std::string path = "/dev/shm/" + n;
    struct stat st {};
    if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid() ||
        st.st_size != static_cast<off_t>(kLen) ||
        now - std::chrono::system_clock::from_time_t(st.st_ctime) < min_age) {
      continue;
    }
    const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW);
    if (fd < 0) continue;
    void* p = mmap(nullptr, sizeof(Segment::slots), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) continue;
    const auto* slots = static_cast<const SlotHeader*>(p);
    bool live = false;
    for (int i = 0; i < kSlots && !live; ++i) {
      const uint64_t v = __atomic_load_n(&slots[i].token, __ATOMIC_ACQUIRE);
      live = v != 0 && PidAlive(TokenPid(v));  // kResetting (pid 0) counts as live
    }
    munmap(p, sizeof(Segment::slots));
    if (!live && shm_unlink(("/" + n).c_str()) == 0) ++removed;
  }
  return removed;
}

Result<std::unique_ptr<GpuLaunchBoard>> GpuLaunchBoard::Open(const std::string& name, int rank) {
  SweepStale(std::chrono::seconds(60));
  SS_ASSIGN_OR_RETURN(const int fd, OpenOwnShm(name, kLen, "gpu launch board"));
  void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return UnavailableError(Errno("gpu launch board mmap " + name));
  auto* seg = static_cast<Segment*>(p);
  // The slot headers are polled on every sync's path: their pages up front (no fault there).
  madvise(p, sizeof(seg->slots), MADV_POPULATE_WRITE);
  const uint64_t token = NewShmToken();
  for (int i = 0; i < kSlots; ++i) {
    SlotHeader& h = seg->slots[i];
    uint64_t v = Ref(h.token).load(std::memory_order_acquire);
    const bool free = v == 0 || (v != kResetting && !PidAlive(TokenPid(v)));
    if (!free || !Ref(h.token).compare_exchange_strong(v, kResetting)) continue;
    for (uint64_t* w :
         {&h.generation, &h.ready, &h.claimed, &h.launcher, &h.claiming, &h.done, &h.failed}) {
      Ref(*w).store(0, std::memory_order_relaxed);
    }
    Ref32(h.share).store(kShareUnknown, std::memory_order_relaxed);
    Ref32(h.rank).store(static_cast<uint32_t>(rank), std::memory_order_relaxed);
    Ref(h.token).store(token, std::memory_order_release);
    return std::unique_ptr<GpuLaunchBoard>(new GpuLaunchBoard(name, seg, i, token));
  }
  munmap(p, kLen);
  return UnavailableError("gpu launch board " + name + ": all " + std::to_string(kSlots) +
                          " slots are held by live processes");
}

GpuLaunchBoard::~GpuLaunchBoard() {
  Ref(seg_->slots[slot_].token).store(0, std::memory_order_release);
  bool live = false;
  for (int i = 0; i < kSlots && !live; ++i) {
    const uint64_t v = Ref(seg_->slots[i].token).load(std::memory_order_acquire);
    live = v != 0 && PidAlive(TokenPid(v));
  }
  if (!live) shm_unlink(name_.c_str());  // one opening now keeps an unlisted board: speed only
  munmap(seg_, kLen);
}

Status GpuLaunchBoard::Publish(std::string_view spec, uint32_t buckets) {
  if (spec.size() > kSpecBytes || buckets == 0 || buckets > kMaxBuckets) {
    return InvalidArgumentError("gpu launch board: a batch of " + std::to_string(spec.size()) +
                                " bytes and " + std::to_string(buckets) + " buckets (limits " +
                                std::to_string(kSpecBytes) + " bytes, 1.." +
                                std::to_string(kMaxBuckets) + " buckets)");
  }
  SlotHeader& h = seg_->slots[slot_];
  std::memcpy(seg_->spec[slot_], spec.data(), spec.size());
  h.spec_bytes = spec.size();
  h.buckets = buckets;
  Ref(h.generation).fetch_add(1, std::memory_order_acq_rel);
  Ref32(h.share).store(kShareable, std::memory_order_release);
  return OkStatus();
}

void GpuLaunchBoard::MarkUnshareable() {
  Ref32(seg_->slots[slot_].share).store(kUnshareable, std::memory_order_release);
}

void GpuLaunchBoard::PostReady(uint64_t version) {
  Ref(seg_->slots[slot_].ready).store(version, std::memory_order_release);
}

bool GpuLaunchBoard::Withdraw(uint64_t version) {
  uint64_t v = version;
  if (Ref(seg_->slots[slot_].ready).compare_exchange_strong(v, 0, std::memory_order_acq_rel)) {
    return true;
  }
  // Not posted (any more): a claim took it unless this version was never posted at all.
  SlotHeader& h = seg_->slots[slot_];
  return Ref(h.claiming).load(std::memory_order_acquire) != version;
}

bool GpuLaunchBoard::ClaimedFor(uint64_t version, int* launcher_rank, int* launcher_pid) const {
  SlotHeader& h = seg_->slots[slot_];
  if (Ref(h.claimed).load(std::memory_order_acquire) != version) return false;
  if (launcher_rank) *launcher_rank = static_cast<int>(h.launcher_rank);
  if (launcher_pid) *launcher_pid = TokenPid(h.launcher);
  return true;
}

GpuLaunchBoard::Outcome GpuLaunchBoard::Collect(uint64_t version, std::vector<uint64_t>* packed,
                                                std::vector<uint64_t>* landed) {
  SlotHeader& h = seg_->slots[slot_];
  if (Ref(h.done).load(std::memory_order_acquire) == version) {
    packed->assign(h.packed, h.packed + h.buckets);
    landed->assign(h.landed, h.landed + h.buckets);
    return Outcome::kDone;
  }
  if (Ref(h.failed).load(std::memory_order_acquire) == version) return Outcome::kFailed;
  const auto now = std::chrono::steady_clock::now();
  if (now >= next_pid_check_) {  // a syscall: at most every millisecond
    next_pid_check_ = now + std::chrono::milliseconds(1);
    if (!PidAlive(TokenPid(h.launcher))) {
      // It may have finished just before it went.
      if (Ref(h.done).load(std::memory_order_acquire) == version)
        return Collect(version, packed, landed);
      return Outcome::kLauncherGone;
    }
  }
  return Outcome::kPending;
}

void GpuLaunchBoard::Survey(uint64_t version, std::vector<Peer>* ready, int* pending) const {
  ready->clear();
  *pending = 0;
  for (int i = 0; i < kSlots; ++i) {
    if (i == slot_) continue;
    SlotHeader& h = seg_->slots[i];
    const uint64_t tok = Ref(h.token).load(std::memory_order_acquire);
    if (tok == 0 || tok == kResetting || !PidAlive(TokenPid(tok))) continue;
    const uint32_t share = Ref32(h.share).load(std::memory_order_acquire);
    if (share == kUnshareable) continue;
    if (Ref(h.claimed).load(std::memory_order_acquire) == version) continue;  // launched
    if (share == kShareable && Ref(h.ready).load(std::memory_order_acquire) == version) {
      ready->push_back({i, static_cast<int>(h.rank), tok,
                        Ref(h.generation).load(std::memory_order_acquire), h.buckets});
    } else {
      ++*pending;
    }
  }
}

std::string GpuLaunchBoard::Spec(const Peer& p) const {
  SlotHeader& h = seg_->slots[p.slot];
  auto same = [&] {
    return Ref(h.token).load(std::memory_order_acquire) == p.token &&
           Ref(h.generation).load(std::memory_order_acquire) == p.generation;
  };
  if (!same() || h.spec_bytes > kSpecBytes) return "";
  std::string s(reinterpret_cast<const char*>(seg_->spec[p.slot]), h.spec_bytes);
  return same() ? s : "";
}

bool GpuLaunchBoard::Claim(const Peer& p, uint64_t version) {
  SlotHeader& h = seg_->slots[p.slot];
  if (Ref(h.token).load(std::memory_order_acquire) != p.token ||
      Ref(h.generation).load(std::memory_order_acquire) != p.generation) {
    return false;
  }
  // The post is taken off `ready` in one step: the owner's Withdraw and this claim cannot both
  // succeed. `claiming` tells a failed Withdraw that a claim (not a cancel) took it.
  Ref(h.claiming).store(version, std::memory_order_release);
  uint64_t v = version;
  if (!Ref(h.ready).compare_exchange_strong(v, 0, std::memory_order_acq_rel)) return false;
  Ref(h.launcher).store(token_, std::memory_order_relaxed);
  Ref32(h.launcher_rank).store(seg_->slots[slot_].rank, std::memory_order_relaxed);
  Ref(h.claimed).store(version, std::memory_order_release);
  claims_made.fetch_add(1, std::memory_order_relaxed);
  return true;
}

uint64_t GpuLaunchBoard::ClaimsMade() { return claims_made.load(std::memory_order_relaxed); }

int GpuLaunchBoard::Leader() const {
  int best = -1;
  uint32_t best_rank = 0;
  for (int i = 0; i < kSlots; ++i) {
    SlotHeader& h = seg_->slots[i];
    const uint64_t tok = Ref(h.token).load(std::memory_order_acquire);
    if (tok == 0 || tok == kResetting) continue;
    if (i != slot_ && !PidAlive(TokenPid(tok))) continue;
    if (Ref32(h.share).load(std::memory_order_acquire) == kUnshareable) continue;
    const uint32_t r = Ref32(h.rank).load(std::memory_order_relaxed);
    if (best < 0 || r < best_rank) {
      best = i;
      best_rank = r;
    }
  }
  return best;
}

bool GpuLaunchBoard::LaunchedFor(int slot, uint64_t version) const {
  if (slot < 0 || slot >= kSlots) return false;
  return Ref(seg_->slots[slot].claimed).load(std::memory_order_acquire) == version;
}

void GpuLaunchBoard::ClaimOwn(uint64_t version) {
  SlotHeader& h = seg_->slots[slot_];
  Ref(h.launcher).store(token_, std::memory_order_relaxed);
  Ref32(h.launcher_rank).store(h.rank, std::memory_order_relaxed);
  Ref(h.claimed).store(version, std::memory_order_release);
}

void GpuLaunchBoard::Complete(const Peer& p, uint64_t version, const uint64_t* packed,
                              const uint64_t* landed) {
  SlotHeader& h = seg_->slots[p.slot];
  if (Ref(h.token).load(std::memory_order_acquire) != p.token) return;
  const uint32_t n = std::min(p.buckets, kMaxBuckets);
  std::memcpy(h.packed, packed, n * sizeof(uint64_t));
  std::memcpy(h.landed, landed, n * sizeof(uint64_t));
  Ref(h.done).store(version, std::memory_order_release);
}

void GpuLaunchBoard::Fail(const Peer& p, uint64_t version) {
  SlotHeader& h = seg_->slots[p.slot];
  if (Ref(h.token).load(std::memory_order_acquire) != p.token) return;
  Ref(h.failed).store(version, std::memory_order_release);
}

}  // namespace shardsync::gpu::internal
