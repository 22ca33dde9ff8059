#include "transport/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <sstream>

#include "store/log.h"
#include "transport/process.h"
#include "transport/shm_ring.h"

namespace shardsync::shm {
namespace {

// The pid namespace's inode (/proc/self/ns/pid -> "pid:[4026531836]"); 0 when unknown, and
// then no segment is ever swept (a pid means nothing across namespaces).
uint64_t PidNamespace() {
  char buf[64] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  if (n <= 0) return 0;
  const char* open = std::strchr(buf, '[');
  uint64_t ns = 0;
  if (open == nullptr || std::from_chars(open + 1, buf + n, ns).ec != std::errc()) return 0;
  return ns;
}

// "shardsync-<uid>-<pidns>-": the names of this user's segments in this pid namespace.
std::string Prefix() {
  return "shardsync-" + std::to_string(getuid()) + "-" + std::to_string(PidNamespace()) + "-";
}

}  // namespace

std::string OwnSegmentPrefix() {
  std::string name = "/";
  name.append(Prefix()).append(std::to_string(getpid())).append("-");
  return name;
}

Result<OwnSegment> CreateSegment(int rank, const std::vector<int>& senders) {
  std::random_device rd;
  char nonce[17];
  std::snprintf(nonce, sizeof(nonce), "%08x%08x", rd(), rd());
  OwnSegment s;
  // Built by appends: `"/" + std::string` trips GCC 12's bogus -Wrestrict.
  s.name = OwnSegmentPrefix();
  s.name.append(std::to_string(rank)).append("-").append(nonce);
  const int fd = shm_open(s.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return UnavailableError("shm: shm_open(" + s.name + ") failed: " + std::strerror(errno));
  }
  s.bytes = SegmentBytes(senders.size());
  // Reserve the pages now: on a full /dev/shm a lazily backed mapping dies of SIGBUS later.
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(s.bytes));
  void* m =
      rc == 0 ? mmap(nullptr, s.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int err = rc != 0 ? rc : errno;
  close(fd);
  if (m == MAP_FAILED) {
    shm_unlink(s.name.c_str());
    return UnavailableError("shm: cannot reserve " + std::to_string(s.bytes) +
                            " bytes in /dev/shm for rank " + std::to_string(rank) +
                            "'s rings: " + std::strerror(err));
  }
  s.map = static_cast<char*>(m);
  auto* h = reinterpret_cast<SegHeader*>(s.map);
  h->rings = senders.size();
  h->ring_bytes = kRingBytes;
  h->owner_rank = rank;
  auto* table = reinterpret_cast<int64_t*>(s.map + sizeof(SegHeader));
  for (size_t i = 0; i < senders.size(); ++i) {
    table[i] = senders[i];
    new (RingAt(s.map, senders.size(), i)) RingCtl{};
  }
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return s;
}

std::string FormatRecord(const std::string& name, pid_t pid, const std::vector<int>& senders) {
  std::ostringstream rec;
  rec << name << ' ' << pid << ' ' << senders.size();
  for (int p : senders) rec << ' ' << p;
  return rec.str();
}

Result<PeerRecord> ParsePeerRecord(const std::string& record, int peer, int self) {
  const std::string who = "shm: peer rank " + std::to_string(peer);
  std::istringstream in(record);
  PeerRecord r;
  long long pid = 0;
  unsigned long long rings = 0;
  if (!(in >> r.name >> pid >> rings) || r.name.size() < 2 || r.name[0] != '/' ||
      r.name.find('/', 1) != std::string::npos || pid <= 0 || rings == 0 || rings > 65536) {
    return DataLossError(who + " published a malformed connection record");
  }
  long long index = -1;
  for (unsigned long long i = 0; i < rings; ++i) {
    long long x = 0;
    if (!(in >> x)) return DataLossError(who + " published a malformed connection record");
    if (x == self) index = static_cast<long long>(i);
  }
  if (index < 0) {
    return FailedPreconditionError(who + " did not list rank " + std::to_string(self) +
                                   " among its peers");
  }
  r.pid = static_cast<pid_t>(pid);
  r.rings = rings;
  r.index = static_cast<uint64_t>(index);
  return r;
}

Result<char*> MapPeerSegment(const PeerRecord& rec, int peer, size_t* bytes) {
  const std::string who = "shm: peer rank " + std::to_string(peer);
  const int fd = shm_open(rec.name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return UnavailableError(who + ": shm_open(" + rec.name + ") failed: " + std::strerror(errno));
  }
  struct stat st {};
  const uint64_t need = SegmentBytes(rec.rings);
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < need) {
    close(fd);
    return DataLossError(who + "'s segment is smaller than its record says");
  }
  void* m = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return UnavailableError(who + ": mmap failed: " + std::strerror(errno));
  auto* map = static_cast<char*>(m);
  const auto* h = reinterpret_cast<const SegHeader*>(map);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (h->magic != kMagic || h->rings != rec.rings || h->ring_bytes != kRingBytes ||
      h->owner_rank != peer) {
    munmap(map, need);
    return DataLossError(who + "'s segment header does not match its record");
  }
  *bytes = need;
  return map;
}

std::optional<pid_t> SegmentCreator(std::string_view name) {
  if (!name.empty() && name[0] == '/') name.remove_prefix(1);
  const std::string prefix = Prefix();
  if (PidNamespace() == 0 || !name.starts_with(prefix)) return std::nullopt;
  name.remove_prefix(prefix.size());
  long long pid = 0;
  auto [ptr, ec] = std::from_chars(name.data(), name.data() + name.size(), pid);
  if (ec != std::errc() || ptr == name.data() + name.size() || *ptr != '-' || pid <= 0) {
    return std::nullopt;
  }
  return static_cast<pid_t>(pid);
}

bool UnlinkOrphan(const std::string& name) {
  const std::optional<pid_t> pid = SegmentCreator(name);
  if (!pid || *pid == getpid() || internal::ProcessAlive(*pid)) return false;
  const std::string bare = name[0] == '/' ? name.substr(1) : name;
  std::string path = "/dev/shm/";
  path.append(bare);
  struct stat st {};
  // Only a regular file this user owns (sticky /dev/shm would refuse others' anyway).
  if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid()) {
    return false;
  }
  std::string shm_name = "/";
  shm_name.append(bare);
  if (shm_unlink(shm_name.c_str()) != 0) return false;
  TransportLog().info("shm: removed {} left by pid {}, which exited before unlinking it", name,
                      *pid);
  return true;
}

int SweepOrphanSegments() {
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  std::vector<std::string> names;
  const std::string prefix = Prefix();
  while (dirent* e = readdir(d)) {
    if (std::string_view(e->d_name).starts_with(prefix)) names.emplace_back(e->d_name);
  }
  closedir(d);
  int n = 0;
  for (const std::string& name : names) n += UnlinkOrphan(name) ? 1 : 0;
  return n;
}

}  // namespace shardsync::shm
