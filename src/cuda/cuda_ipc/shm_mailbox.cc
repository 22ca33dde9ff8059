#include "cuda/cuda_ipc/shm_mailbox.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <new>

namespace shardsync::gpu::internal {

namespace {
constexpr size_t kLen = sizeof(MailboxHeader) + sizeof(MailboxSlot) * kMailboxSlots;
std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// Maps this process's page tables for the header and the first 8 KiB of every slot (where control
// messages land) up front. Each message goes to the next slot, so without this the first
// kMailboxSlots messages each took a page fault on both sides: 3-13 us in TrySend on an H200
// machine, on every sync's critical path (docs/benchmarks.md). The rest of a slot (only large
// messages reach it) stays lazy, so the segment's memory is not all allocated.
void Prefault(void* map) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  auto populate = [&](size_t off, size_t len) {
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(map) + off) / page * page;
    const uintptr_t hi = reinterpret_cast<uintptr_t>(map) + std::min(off + len, kLen);
    // A kernel without MADV_POPULATE_WRITE (before Linux 5.14) faults them in later, as before.
    madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);
  };
  populate(0, sizeof(MailboxHeader));
  for (uint32_t k = 0; k < kMailboxSlots; ++k) {
    populate(sizeof(MailboxHeader) + sizeof(MailboxSlot) * k, 8 << 10);
  }
}
}  // namespace

Mailbox::Mailbox(std::string name, void* map, size_t len, bool owner)
    : name_(std::move(name)), map_(map), len_(len), owner_(owner) {
  hdr_ = static_cast<MailboxHeader*>(map_);
  slots_ =
      reinterpret_cast<MailboxSlot*>(static_cast<unsigned char*>(map_) + sizeof(MailboxHeader));
}

Result<Mailbox*> Mailbox::Create(const std::string& name) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {  // stale segment of a crashed run with the same prefix
    shm_unlink(name.c_str());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0) return UnavailableError(Errno("mailbox shm_open " + name));
  if (ftruncate(fd, static_cast<off_t>(kLen)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return UnavailableError(Errno("mailbox ftruncate " + name));
  }
  void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return UnavailableError(Errno("mailbox mmap " + name));
  }
  Prefault(p);
  auto* hdr = new (p) MailboxHeader();  // zero-filled segment; placement-new for the atomics
  hdr->head.store(0);
  hdr->tail.store(0);
  hdr->sender_closed.store(0);
  hdr->receiver_closed.store(0);
  hdr->sender_pid.store(0);
  hdr->receiver_pid.store(getpid());
  return new Mailbox(name, p, kLen, true);
}

Result<Mailbox*> Mailbox::Open(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return UnavailableError(Errno("mailbox shm_open (peer's) " + name));
  void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return UnavailableError(Errno("mailbox mmap (peer's) " + name));
  Prefault(p);
  auto* m = new Mailbox(name, p, kLen, false);
  m->hdr_->sender_pid.store(getpid());
  return m;
}

Mailbox::~Mailbox() {
  if (owner_) {
    hdr_->receiver_closed.store(1);
    Unlink();
  } else {
    hdr_->sender_closed.store(1);
  }
  munmap(map_, len_);
}

void Mailbox::Unlink() {
  if (owner_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

bool Mailbox::TrySend(uint64_t tag, const void* data, uint64_t bytes) {
  const uint64_t head = hdr_->head.load(std::memory_order_relaxed);
  const uint64_t tail = hdr_->tail.load(std::memory_order_acquire);
  if (head - tail >= kMailboxSlots) return false;
  MailboxSlot& s = slots_[head % kMailboxSlots];
  s.tag = tag;
  s.bytes = bytes;
  if (bytes) std::memcpy(s.data, data, bytes);
  hdr_->head.store(head + 1, std::memory_order_release);
  return true;
}

bool Mailbox::Peek(uint64_t* tag, uint64_t* bytes) const {
  const uint64_t tail = hdr_->tail.load(std::memory_order_relaxed);
  const uint64_t head = hdr_->head.load(std::memory_order_acquire);
  if (tail == head) return false;
  const MailboxSlot& s = slots_[tail % kMailboxSlots];
  *tag = s.tag;
  *bytes = s.bytes;
  return true;
}

const unsigned char* Mailbox::PeekData() const {
  return slots_[hdr_->tail.load(std::memory_order_relaxed) % kMailboxSlots].data;
}

void Mailbox::Pop() {
  hdr_->tail.store(hdr_->tail.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

}  // namespace shardsync::gpu::internal
