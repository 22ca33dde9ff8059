// Shared-memory transport (transport.h, "Shared memory"): one single-producer / single-consumer
// ring per (sender, receiver) pair in the receiver's POSIX shm segment. Post* queue work and
// Poll drives it: senders copy their queued messages into free slots, receivers copy published
// slots into posted buffers. Written by hand: UCX's shm transports do the same copies but give
// no hook to fuse the checksum into them, and the fused copies are what make verification cheap.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardsync/checksum.h"
#include "shardsync/transport.h"
#include "store/log.h"
#include "transport/process.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x3147'4e49'5253'5353ull;  // "SSSRING1"
// 16 x 64 KiB per pair: measured on the 2-core VM (4 pairs, fused checksums both ends), 64 KiB
// slots beat 128 KiB - 1 MiB ones by 7-18 %: the ring stays in L2 while both ends work on it.
constexpr uint64_t kSlotBytes = uint64_t{64} << 10;
constexpr uint64_t kSlots = 16;
// Largest message a receiver buffers before its receive is posted (a corrupt length must not
// become an allocation of any size).
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 40;

struct SlotHeader {
  uint64_t tag;
  uint64_t msg_bytes;
  uint64_t frag_offset;
  uint64_t frag_bytes;
};

// head: slots the sender published; tail: slots the receiver released. The closed flags are set
// by each side's transport when it is destroyed or aborted.
struct alignas(64) RingCtl {
  std::atomic<uint64_t> head;
  char pad0[56];
  std::atomic<uint64_t> tail;
  char pad1[56];
  std::atomic<uint32_t> sender_closed;
  std::atomic<uint32_t> receiver_closed;
  char pad2[56];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
constexpr uint64_t kSlotStride = 64 + kSlotBytes;  // header padded to a cache line
constexpr uint64_t kRingBytes = sizeof(RingCtl) + kSlots * kSlotStride;

struct SegHeader {
  uint64_t magic;
  uint64_t rings;
  uint64_t ring_bytes;
  int64_t owner_rank;
  char pad[32];
};
static_assert(sizeof(SegHeader) == 64);

uint64_t TableBytes(uint64_t rings) { return (rings * 8 + 63) / 64 * 64; }
uint64_t SegmentBytes(uint64_t rings) {
  return sizeof(SegHeader) + TableBytes(rings) + rings * kRingBytes;
}
RingCtl* RingAt(char* seg, uint64_t rings, uint64_t i) {
  return reinterpret_cast<RingCtl*>(seg + sizeof(SegHeader) + TableBytes(rings) + i * kRingBytes);
}
char* SlotAt(RingCtl* ring, uint64_t seq) {
  return reinterpret_cast<char*>(ring) + sizeof(RingCtl) + (seq % kSlots) * kSlotStride;
}

// Copies message bytes [a, b) (dst and src point at offset a), adding the whole words of the
// message (SummedHead/SummedTail of `sum->key`) that lie inside [a, b) into `sum` from the
// copy's own loads; a word that starts here and ends in a later fragment goes to `straddles`.
void CopyFragment(char* dst, const char* src, uint64_t a, uint64_t b, uint64_t msg_bytes,
                  CopySum* sum, std::vector<uint64_t>& straddles) {
  if (sum == nullptr) {
    std::memcpy(dst, src, b - a);
    return;
  }
  const uint64_t h = SummedHead(sum->key, msg_bytes), t = SummedTail(sum->key, msg_bytes);
  const uint64_t s = std::max(a, h) <= h ? h : h + (std::max(a, h) - h + 7) / 8 * 8;
  const uint64_t lim = std::min(b, t);
  const uint64_t e = lim <= s ? s : h + (lim - h) / 8 * 8;
  if (e > s) {
    std::memcpy(dst, src, s - a);
    sum->sum += CopyWithChecksumPartial(dst + (s - a), src + (s - a), e - s, sum->key + s);
    std::memcpy(dst + (e - a), src + (e - a), b - e);
  } else {
    std::memcpy(dst, src, b - a);
  }
  if (e < b && e + 8 <= t) straddles.push_back(e);
}

// The straddling words, read from the message's whole image once every byte is in place.
void FinishSum(const char* image, CopySum* sum, std::vector<uint64_t>& straddles) {
  if (sum == nullptr) return;
  for (uint64_t w : straddles) sum->sum += ChecksumPartial(image + w, 8, sum->key + w);
  straddles.clear();
}

struct Op {
  int peer = 0;
  uint64_t tag = 0;
  const char* src = nullptr;  // send
  char* dst = nullptr;        // recv
  uint64_t bytes = 0;
  uint64_t done_bytes = 0;  // send: bytes copied into the ring
  bool started = false;     // send: its first fragment is in the ring
  CopySum* sum = nullptr;
  Transport::SendFill fill;  // filled send: the caller writes each fragment
  std::vector<uint64_t> straddles;
  uint64_t flush_seq = 0;  // flush: sends posted to the peer before it
  bool complete = false;
  Status error;
};

struct Unexpected {
  uint64_t tag = 0;
  std::vector<char> data;
  uint64_t received = 0;
  bool complete = false;
};

struct Peer {
  int rank = 0;
  pid_t pid = 0;
  char* map = nullptr;  // the peer's segment (null for this rank itself)
  size_t map_bytes = 0;
  RingCtl* out = nullptr;  // this rank -> peer, in the peer's segment
  RingCtl* in = nullptr;   // peer -> this rank, in this rank's segment
  uint64_t out_head = 0;   // local copy of out->head (only this side writes it)
  uint64_t in_tail = 0;    // local copy of in->tail
  std::deque<XferId> sendq;
  uint64_t sends_posted = 0, sends_done = 0;
  std::list<XferId> recvs;     // posted, unmatched, FIFO
  std::deque<XferId> flushes;  // in posting order
  std::deque<Unexpected> unexpected;
  // The message being received: into `target` (a recv op), the back of `unexpected`, or dropped.
  bool in_msg = false;
  XferId target = 0;
  bool discard = false;
  uint64_t msg_bytes = 0, msg_received = 0, msg_tag = 0;
  bool gone = false;     // dead, closed, or its ring is corrupt: no further sends
  bool corrupt = false;  // nothing more is read from its ring
  Status why;
  Clock::time_point next_check{};
};

class ShmTransport final : public Transport {
 public:
  ~ShmTransport() override {
    Close();
    for (auto& [r, p] : peers_) {
      if (p.map != nullptr) munmap(p.map, p.map_bytes);
    }
    if (seg_ != nullptr) munmap(seg_, seg_bytes_);
    Unlink();
  }

  std::string_view name() const override { return "shm"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.host_memory = true;
    c.two_sided = true;
    c.same_node_only = true;
    c.summed_copy = true;
    c.filled_send = true;
    c.tag_matching = true;  // receives match (peer, tag), FIFO per pair
    return c;
  }
  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return self.hostname == peer.hostname && self.mem == MemKind::kHost &&
           peer.mem == MemKind::kHost;
  }

  Result<uint32_t> RegisterMemory(const MemRegion& region) override {
    if (connected_) return FailedPreconditionError("shm: RegisterMemory after Connect");
    if (region.kind != MemKind::kHost) {
      return InvalidArgumentError("shm: only host memory can be registered");
    }
    return regions_++;  // no puts: ids are accepted for interface compatibility only
  }

  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override {
    if (aborted_) return AbortedError("shm: transport was aborted");
    if (connected_) return FailedPreconditionError("shm: Connect called twice");
    const auto deadline = Clock::now() + timeout;
    rank_ = rank;
    std::vector<int> list;
    for (int p : peers) {
      if (std::find(list.begin(), list.end(), p) == list.end()) list.push_back(p);
    }
    SS_RETURN_IF_ERROR(CreateSegment(list));
    std::ostringstream rec;
    rec << name_ << ' ' << getpid() << ' ' << list.size();
    for (int p : list) rec << ' ' << p;
    SS_RETURN_IF_ERROR(store.Set(prefix + "/shm/" + std::to_string(rank), rec.str()));
    for (size_t i = 0; i < list.size(); ++i) {
      Peer& p = peers_[list[i]];
      p.rank = list[i];
      p.in = RingAt(seg_, list.size(), i);
      if (list[i] == rank) {
        p.pid = getpid();
        p.out = p.in;
        continue;
      }
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      auto v = store.Get(prefix + "/shm/" + std::to_string(list[i]), std::max(left, Millis(1)));
      if (!v.ok()) {
        if (v.status().code() == StatusCode::kDeadlineExceeded) {
          return DeadlineExceededError("shm: rank " + std::to_string(rank) +
                                       " timed out waiting for peer rank " +
                                       std::to_string(list[i]) + " to connect");
        }
        return v.status();
      }
      SS_RETURN_IF_ERROR(MapPeer(p, *v));
    }
    // The segment's name can go once every peer has mapped it (no file left behind on a crash).
    SS_RETURN_IF_ERROR(store.Set(prefix + "/shm_mapped/" + std::to_string(rank), "1"));
    for (int p : list) {
      if (p == rank) continue;
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      auto v = store.Get(prefix + "/shm_mapped/" + std::to_string(p), std::max(left, Millis(1)));
      if (!v.ok()) {
        return DeadlineExceededError("shm: rank " + std::to_string(rank) +
                                     " timed out waiting for peer rank " + std::to_string(p) +
                                     " to map its rings");
      }
    }
    Unlink();
    connected_ = true;
    return OkStatus();
  }

  Result<XferId> PostPut(int, const void*, size_t, uint32_t, uint64_t) override {
    return FailedPreconditionError(
        "shm: no one-sided put (caps().one_sided_put is false); "
        "use PostSend / PostRecv");
  }

  Result<XferId> PostFlush(int peer) override {
    SS_ASSIGN_OR_RETURN(Peer * p, Usable(peer, true));
    Op op;
    op.peer = peer;
    op.flush_seq = p->sends_posted;
    const XferId id = Add(std::move(op));
    p->flushes.push_back(id);
    return id;
  }

  Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) override {
    return Send(peer, tag, buf, bytes, nullptr);
  }
  Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) override {
    return Recv(peer, tag, buf, bytes, nullptr);
  }
  Result<XferId> PostSendSummed(int peer, uint64_t tag, const void* buf, size_t bytes,
                                CopySum* sum) override {
    if (sum == nullptr) return InvalidArgumentError("shm: PostSendSummed without a CopySum");
    return Send(peer, tag, buf, bytes, sum);
  }
  Result<XferId> PostRecvSummed(int peer, uint64_t tag, void* buf, size_t bytes,
                                CopySum* sum) override {
    if (sum == nullptr) return InvalidArgumentError("shm: PostRecvSummed without a CopySum");
    return Recv(peer, tag, buf, bytes, sum);
  }

  Result<XferId> PostSendFilled(int peer, uint64_t tag, size_t bytes, SendFill fill) override {
    if (!fill) return InvalidArgumentError("shm: PostSendFilled without a fill function");
    return Send(peer, tag, nullptr, bytes, nullptr, std::move(fill));
  }

  Result<XferState> Poll(XferId id) override {
    if (aborted_) return AbortedError("shm: transport was aborted");
    auto it = ops_.find(id);
    if (it == ops_.end()) return NotFoundError("shm: unknown transfer id " + std::to_string(id));
    if (!it->second.complete && it->second.error.ok()) Progress();
    Op& op = it->second;
    if (!op.error.ok()) {
      Status e = op.error;
      ops_.erase(it);
      return e;
    }
    if (op.complete) {
      ops_.erase(it);
      return XferState::kDone;
    }
    return XferState::kInProgress;
  }

  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    Close();
    ops_.clear();
  }

 private:
  Status CreateSegment(const std::vector<int>& list) {
    std::random_device rd;
    char nonce[17];
    std::snprintf(nonce, sizeof(nonce), "%08x%08x", rd(), rd());
    name_ = "/shardsync-" + std::to_string(getuid()) + "-" + std::to_string(getpid()) + "-" +
            std::to_string(rank_) + "-" + nonce;
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      return UnavailableError("shm: shm_open(" + name_ + ") failed: " + std::strerror(errno));
    }
    linked_ = true;
    seg_bytes_ = SegmentBytes(list.size());
    // Reserve the pages now: on a full /dev/shm a lazily backed mapping dies of SIGBUS later.
    const int rc = posix_fallocate(fd, 0, static_cast<off_t>(seg_bytes_));
    if (rc != 0) {
      close(fd);
      return UnavailableError("shm: cannot reserve " + std::to_string(seg_bytes_) +
                              " bytes in /dev/shm for rank " + std::to_string(rank_) +
                              "'s rings: " + std::strerror(rc));
    }
    void* m = mmap(nullptr, seg_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
      return UnavailableError(std::string("shm: mmap of this rank's rings failed: ") +
                              std::strerror(errno));
    }
    seg_ = static_cast<char*>(m);
    auto* h = reinterpret_cast<SegHeader*>(seg_);
    h->rings = list.size();
    h->ring_bytes = kRingBytes;
    h->owner_rank = rank_;
    auto* table = reinterpret_cast<int64_t*>(seg_ + sizeof(SegHeader));
    for (size_t i = 0; i < list.size(); ++i) {
      table[i] = list[i];
      new (RingAt(seg_, list.size(), i)) RingCtl{};
    }
    std::atomic_thread_fence(std::memory_order_release);
    h->magic = kMagic;
    return OkStatus();
  }

  // Parses a peer's record ("name pid rings rank...") and maps its segment; every field is
  // checked, since the record comes from another process.
  Status MapPeer(Peer& p, const std::string& record) {
    const std::string who = "shm: peer rank " + std::to_string(p.rank);
    std::istringstream in(record);
    std::string name;
    long long pid = 0;
    unsigned long long rings = 0;
    if (!(in >> name >> pid >> rings) || name.size() < 2 || name[0] != '/' ||
        name.find('/', 1) != std::string::npos || pid <= 0 || rings == 0 || rings > 65536) {
      return DataLossError(who + " published a malformed connection record");
    }
    long long index = -1;
    for (unsigned long long i = 0; i < rings; ++i) {
      long long r = 0;
      if (!(in >> r)) return DataLossError(who + " published a malformed connection record");
      if (r == rank_) index = static_cast<long long>(i);
    }
    if (index < 0) {
      return FailedPreconditionError(who + " did not list rank " + std::to_string(rank_) +
                                     " among its peers");
    }
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      return UnavailableError(who + ": shm_open(" + name + ") failed: " + std::strerror(errno));
    }
    struct stat st {};
    const uint64_t need = SegmentBytes(rings);
    if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < need) {
      close(fd);
      return DataLossError(who + "'s segment is smaller than its record says");
    }
    void* m = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
      return UnavailableError(who + ": mmap failed: " + std::strerror(errno));
    }
    p.map = static_cast<char*>(m);
    p.map_bytes = need;
    const auto* h = reinterpret_cast<const SegHeader*>(p.map);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (h->magic != kMagic || h->rings != rings || h->ring_bytes != kRingBytes ||
        h->owner_rank != p.rank) {
      return DataLossError(who + "'s segment header does not match its record");
    }
    p.out = RingAt(p.map, rings, static_cast<uint64_t>(index));
    p.out_head = p.out->head.load(std::memory_order_relaxed);
    p.pid = static_cast<pid_t>(pid);
    return OkStatus();
  }

  void Unlink() {
    if (linked_) shm_unlink(name_.c_str());
    linked_ = false;
  }

  // Tells every peer this side is gone (their operations with this rank then fail).
  void Close() {
    for (auto& [r, p] : peers_) {
      if (p.out != nullptr) p.out->sender_closed.store(1, std::memory_order_release);
      if (p.in != nullptr) p.in->receiver_closed.store(1, std::memory_order_release);
    }
  }

  Result<Peer*> Usable(int peer, bool sending) {
    if (aborted_) return AbortedError("shm: transport was aborted");
    auto it = peers_.find(peer);
    if (!connected_ || it == peers_.end()) {
      return FailedPreconditionError("shm: rank " + std::to_string(peer) +
                                     " is not a connected peer");
    }
    Peer& p = it->second;
    Watch(p);
    if (sending && p.gone) return p.why;
    return &p;
  }

  XferId Add(Op op) {
    const XferId id = next_id_++;
    ops_.emplace(id, std::move(op));
    return id;
  }

  Result<XferId> Send(int peer, uint64_t tag, const void* buf, size_t bytes, CopySum* sum,
                      SendFill fill = nullptr) {
    SS_ASSIGN_OR_RETURN(Peer * p, Usable(peer, true));
    Op op;
    op.peer = peer;
    op.tag = tag;
    op.src = static_cast<const char*>(buf);
    op.bytes = bytes;
    op.sum = sum;
    op.fill = std::move(fill);
    const XferId id = Add(std::move(op));
    p->sendq.push_back(id);
    ++p->sends_posted;
    PumpSends(*p);
    return id;
  }

  Result<XferId> Recv(int peer, uint64_t tag, void* buf, size_t bytes, CopySum* sum) {
    SS_ASSIGN_OR_RETURN(Peer * p, Usable(peer, false));
    Op op;
    op.peer = peer;
    op.tag = tag;
    op.dst = static_cast<char*>(buf);
    op.bytes = bytes;
    op.sum = sum;
    const XferId id = Add(std::move(op));
    Op& o = ops_.at(id);
    // FIFO per (peer, tag): the oldest message with this tag that arrived before this receive.
    for (auto u = p->unexpected.begin(); u != p->unexpected.end(); ++u) {
      if (u->tag != tag) continue;
      const bool current = !u->complete;  // still arriving: it is the back of the queue
      if (u->data.size() > bytes) {
        o.error = TooSmall(*p, u->data.size(), bytes);
        if (current) p->discard = true;
      } else {
        CopyFragment(o.dst, u->data.data(), 0, u->received, u->data.size(), o.sum, o.straddles);
        if (u->complete) {
          FinishSum(o.dst, o.sum, o.straddles);
          o.complete = true;
        } else {
          p->target = id;  // the rest lands in place
        }
      }
      p->unexpected.erase(u);
      return id;
    }
    p->recvs.push_back(id);
    PumpRecvs(*p);
    return id;
  }

  Status TooSmall(const Peer& p, uint64_t msg, uint64_t buf) const {
    return OutOfRangeError("shm: a " + std::to_string(msg) + "-byte message from rank " +
                           std::to_string(p.rank) + " does not fit the " + std::to_string(buf) +
                           "-byte receive buffer");
  }

  // Notices a dead, closed or corrupt peer (the process check at most every 50 ms).
  void Watch(Peer& p) {
    if (p.gone) return;
    if (p.out != nullptr && p.out->receiver_closed.load(std::memory_order_acquire)) {
      return Gone(p, "closed its transport");
    }
    if (p.in != nullptr && p.in->sender_closed.load(std::memory_order_acquire)) {
      return Gone(p, "closed its transport");
    }
    if (p.pid == getpid() || p.pid == 0) return;
    const auto now = Clock::now();
    if (now < p.next_check) return;
    p.next_check = now + Millis(50);
    if (!internal::ProcessAlive(p.pid)) {
      TransportLog().warn("shm: peer rank {} (pid {}) exited", p.rank, p.pid);
      Gone(p, "(pid " + std::to_string(p.pid) + ") exited");
    }
  }
  void Gone(Peer& p, const std::string& what) {
    p.gone = true;
    p.why = UnavailableError("shm: peer rank " + std::to_string(p.rank) + " " + what);
  }

  void Fail(XferId id, const Status& s) {
    auto it = ops_.find(id);
    if (it != ops_.end() && it->second.error.ok() && !it->second.complete) it->second.error = s;
  }

  void Progress() {
    for (auto& [r, p] : peers_) {
      Watch(p);
      PumpSends(p);
      PumpRecvs(p);
      // Flushes complete once every send posted before them left for the ring.
      while (!p.flushes.empty()) {
        auto it = ops_.find(p.flushes.front());
        if (it != ops_.end() && p.sends_done < it->second.flush_seq) break;
        if (it != ops_.end()) it->second.complete = true;
        p.flushes.pop_front();
      }
      if (p.gone) FailPending(p);
    }
  }

  // After draining what the peer published: its unfinished operations cannot complete.
  void FailPending(Peer& p) {
    for (XferId id : p.sendq) Fail(id, p.why);
    p.sendq.clear();
    for (XferId id : p.recvs) Fail(id, p.why);
    p.recvs.clear();
    for (XferId id : p.flushes) Fail(id, p.why);
    p.flushes.clear();
    if (p.in_msg && p.target != 0) Fail(p.target, p.why);
    p.target = 0;
  }

  void PumpSends(Peer& p) {
    if (p.gone) return;
    while (!p.sendq.empty()) {
      Op& op = ops_.at(p.sendq.front());
      while (!op.started || op.done_bytes < op.bytes) {
        const uint64_t tail = p.out->tail.load(std::memory_order_acquire);
        if (p.out_head - tail >= kSlots) return;  // ring full: the receiver has to catch up
        char* slot = SlotAt(p.out, p.out_head);
        const uint64_t n = std::min(kSlotBytes, op.bytes - op.done_bytes);
        SlotHeader h{op.tag, op.bytes, op.done_bytes, n};
        std::memcpy(slot, &h, sizeof(h));
        if (op.fill) {
          op.fill(slot + 64, op.done_bytes, n);
        } else {
          CopyFragment(slot + 64, op.src + op.done_bytes, op.done_bytes, op.done_bytes + n,
                       op.bytes, op.sum, op.straddles);
        }
        op.done_bytes += n;
        op.started = true;
        p.out->head.store(++p.out_head, std::memory_order_release);
      }
      FinishSum(op.src, op.sum, op.straddles);
      op.fill = nullptr;  // release what it holds now
      op.complete = true;
      ++p.sends_done;
      p.sendq.pop_front();
    }
  }

  void PumpRecvs(Peer& p) {
    while (!p.corrupt) {
      const uint64_t head = p.in->head.load(std::memory_order_acquire);
      if (p.in_tail == head) return;
      if (head - p.in_tail > kSlots) return CorruptRing(p, "published more slots than it has");
      const char* slot = SlotAt(p.in, p.in_tail);
      SlotHeader h;
      std::memcpy(&h, slot, sizeof(h));
      if (!p.in_msg) {
        if (h.frag_offset != 0 || h.msg_bytes > kMaxMessageBytes) {
          return CorruptRing(p, "sent a malformed message header");
        }
        StartMessage(p, h);
      }
      if (h.tag != p.msg_tag || h.msg_bytes != p.msg_bytes || h.frag_offset != p.msg_received ||
          h.frag_bytes > kSlotBytes || h.frag_bytes > h.msg_bytes - h.frag_offset ||
          (h.frag_bytes == 0 && h.msg_bytes != 0)) {
        return CorruptRing(p, "sent a fragment out of sequence");
      }
      const uint64_t a = h.frag_offset, b = a + h.frag_bytes;
      if (!p.discard) {
        if (p.target != 0) {
          Op& op = ops_.at(p.target);
          CopyFragment(op.dst + a, slot + 64, a, b, h.msg_bytes, op.sum, op.straddles);
        } else {
          Unexpected& u = p.unexpected.back();
          std::memcpy(u.data.data() + a, slot + 64, b - a);
          u.received = b;
        }
      }
      p.in->tail.store(++p.in_tail, std::memory_order_release);
      p.msg_received = b;
      if (b == h.msg_bytes) EndMessage(p);
    }
  }

  void StartMessage(Peer& p, const SlotHeader& h) {
    p.in_msg = true;
    p.msg_tag = h.tag;
    p.msg_bytes = h.msg_bytes;
    p.msg_received = 0;
    p.discard = false;
    p.target = 0;
    for (auto it = p.recvs.begin(); it != p.recvs.end(); ++it) {
      Op& op = ops_.at(*it);
      if (op.tag != h.tag) continue;
      if (op.bytes < h.msg_bytes) {
        op.error = TooSmall(p, h.msg_bytes, op.bytes);
        p.discard = true;
      } else {
        p.target = *it;
      }
      p.recvs.erase(it);
      return;
    }
    Unexpected u;
    u.tag = h.tag;
    try {
      u.data.resize(h.msg_bytes);
    } catch (const std::bad_alloc&) {
      p.discard = true;
      TransportLog().error("shm: cannot buffer a {}-byte message from rank {}", h.msg_bytes,
                           p.rank);
      return;
    }
    p.unexpected.push_back(std::move(u));
  }

  void EndMessage(Peer& p) {
    if (!p.discard) {
      if (p.target != 0) {
        Op& op = ops_.at(p.target);
        FinishSum(op.dst, op.sum, op.straddles);
        op.complete = true;
      } else {
        p.unexpected.back().complete = true;
      }
    }
    p.in_msg = false;
    p.target = 0;
    p.discard = false;
  }

  void CorruptRing(Peer& p, const std::string& what) {
    TransportLog().error("shm: peer rank {} {}", p.rank, what);
    p.why = DataLossError("shm: peer rank " + std::to_string(p.rank) + " " + what);
    p.gone = true;
    p.corrupt = true;
    if (p.target != 0) Fail(p.target, p.why);
    p.in_msg = false;
    p.target = 0;
    FailPending(p);
  }

  int rank_ = -1;
  bool connected_ = false;
  bool aborted_ = false;
  uint32_t regions_ = 0;
  std::string name_;
  bool linked_ = false;
  char* seg_ = nullptr;
  size_t seg_bytes_ = 0;
  std::map<int, Peer> peers_;
  std::unordered_map<XferId, Op> ops_;
  XferId next_id_ = 1;
};

}  // namespace

Result<std::unique_ptr<Transport>> NewShmTransport() {
  return std::unique_ptr<Transport>(new ShmTransport());
}

}  // namespace shardsync
