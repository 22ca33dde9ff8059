#include "sync/verdict_board.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>

#include "shardsync/transport.h"

namespace shardsync::sync_internal {

namespace {

constexpr uint64_t kMagic = 0x5353564244524231ull;  // "SSVBDRB1"
constexpr uint64_t kBusy = ~uint64_t{0};            // an entry's version while it is written

struct Header {
  alignas(64) uint64_t magic;
  uint64_t world;
  uint64_t job;                 // the job's nonce (identity.h): a board of another job is refused
  std::atomic<uint64_t> nonce;  // published last: an opener that sees it sees the rest
};

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

struct VerdictBoard::Entry {
  alignas(64) std::atomic<uint64_t> version;  // 0: never written
  std::atomic<uint32_t> bytes;
  char text[kTextBytes];
};

namespace {
size_t BoardBytes(int world) {
  return sizeof(Header) +
         sizeof(VerdictBoard::Entry) * static_cast<size_t>(world) * VerdictBoard::kRing;
}
}  // namespace

std::string VerdictBoardName(uint64_t nonce) {
  uint32_t host = 2166136261u;  // FNV-1a of the host identity
  for (unsigned char c : HostIdentity()) host = (host ^ c) * 16777619u;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "/shardsync-vb-%016llx-%08x",
                static_cast<unsigned long long>(nonce), host);
  return buf;
}

VerdictBoard::VerdictBoard(std::string name, void* map, size_t len, bool owner, int world)
    : name_(std::move(name)),
      map_(map),
      len_(len),
      owner_(owner),
      world_(world),
      posts_(static_cast<size_t>(world), 0) {}

VerdictBoard::~VerdictBoard() {
  Unlink();
  munmap(map_, len_);
}

void VerdictBoard::Unlink() {
  if (owner_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

Result<std::unique_ptr<VerdictBoard>> VerdictBoard::Create(const std::string& name, int world,
                                                           uint64_t nonce, uint64_t job) {
  if (world < 1 || world > kMaxWorld) {
    return InvalidArgumentError("verdict board: world " + std::to_string(world) + " not in 1.." +
                                std::to_string(kMaxWorld));
  }
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {  // a crashed job's segment with the same nonce: replace it
    shm_unlink(name.c_str());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0) return UnavailableError(Errno("verdict board shm_open " + name));
  const size_t len = BoardBytes(world);
  if (ftruncate(fd, static_cast<off_t>(len)) != 0) {  // zero-filled: every entry unwritten
    close(fd);
    shm_unlink(name.c_str());
    return UnavailableError(Errno("verdict board ftruncate " + name));
  }
  // MAP_POPULATE: every entry is touched within kRing syncs; a page fault then would sit on a
  // sync's critical path.
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return UnavailableError(Errno("verdict board mmap " + name));
  }
  auto* h = new (p) Header();
  h->magic = kMagic;
  h->world = static_cast<uint64_t>(world);
  h->job = job;
  h->nonce.store(nonce, std::memory_order_release);
  return std::unique_ptr<VerdictBoard>(new VerdictBoard(name, p, len, true, world));
}

Result<std::unique_ptr<VerdictBoard>> VerdictBoard::Open(const std::string& name, int world,
                                                         uint64_t nonce, uint64_t job) {
  if (world < 1 || world > kMaxWorld) {
    return InvalidArgumentError("verdict board: world " + std::to_string(world) + " not in 1.." +
                                std::to_string(kMaxWorld));
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return UnavailableError(Errno("verdict board shm_open " + name));
  const size_t len = BoardBytes(world);
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != len) {
    close(fd);
    return UnavailableError("verdict board " + name + " is not a board of " +
                            std::to_string(world) + " ranks (size " + std::to_string(st.st_size) +
                            ")");
  }
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return UnavailableError(Errno("verdict board mmap " + name));
  auto* h = static_cast<Header*>(p);
  if (h->nonce.load(std::memory_order_acquire) != nonce || h->magic != kMagic ||
      h->world != static_cast<uint64_t>(world) || h->job != job) {
    munmap(p, len);
    return UnavailableError("verdict board " + name + " belongs to another job");
  }
  return std::unique_ptr<VerdictBoard>(new VerdictBoard(name, p, len, false, world));
}

VerdictBoard::Entry& VerdictBoard::At(int rank, int slot) const {
  auto* entries = reinterpret_cast<Entry*>(static_cast<unsigned char*>(map_) + sizeof(Header));
  return entries[static_cast<size_t>(rank) * kRing + static_cast<size_t>(slot)];
}

void VerdictBoard::Post(int rank, uint64_t version, std::string_view text) {
  // The oldest of the rank's entries (this process is the rank's only writer).
  Entry& e = At(rank, static_cast<int>(posts_[static_cast<size_t>(rank)]++ % kRing));
  const size_t n = std::min(text.size(), kTextBytes);
  e.version.store(kBusy, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // busy is seen before any new byte
  std::memcpy(e.text, text.data(), n);
  e.bytes.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
  e.version.store(version, std::memory_order_release);
}

VerdictBoard::Lookup VerdictBoard::Get(int rank, uint64_t version, std::string* text) const {
  int later = 0;  // entries holding a later version
  for (int slot = 0; slot < kRing; ++slot) {
    const Entry& e = At(rank, slot);
    const uint64_t v1 = e.version.load(std::memory_order_acquire);
    // A post in progress (kBusy) reads as missing: the caller polls again (and a writer that
    // died mid-post leaves the caller to its deadline, not spinning here).
    if (v1 != version) {
      later += v1 != kBusy && v1 > version;
      continue;
    }
    const uint32_t n = std::min<uint32_t>(e.bytes.load(std::memory_order_relaxed), kTextBytes);
    text->assign(e.text, n);
    std::atomic_thread_fence(std::memory_order_acquire);  // the copy before the re-check
    if (e.version.load(std::memory_order_relaxed) == v1) return Lookup::kFound;
    return Lookup::kMissing;  // rewritten while copied: it holds another version now
  }
  return later == kRing ? Lookup::kOverwritten : Lookup::kMissing;
}

}  // namespace shardsync::sync_internal
