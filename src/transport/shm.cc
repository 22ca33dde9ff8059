// Shared-memory transport (transport.h, "Shared memory"): one single-producer / single-consumer
// ring per (sender, receiver) pair in the receiver's POSIX shm segment (layout: shm_ring.h;
// segments and their cleanup: shm_segment.h). Post* queue work and Poll drives it: senders copy
// their queued messages into free slots, receivers copy published slots into posted buffers.
// Written by hand: UCX's shm transports do the same copies but give no hook to fuse the checksum
// into them, and the fused copies are what make verification cheap.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardsync/checksum.h"
#include "shardsync/transport.h"
#include "store/log.h"
#include "transport/process.h"
#include "transport/shm_ring.h"
#include "transport/shm_segment.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;
using shm::CopyFragment;
using shm::FinishSum;
using shm::kMaxMessageBytes;
using shm::kSlotBytes;
using shm::kSlots;
using shm::RingCtl;
using shm::SlotAt;
using shm::SlotHeader;

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

struct ShmPeer {
  int rank = 0;
  pid_t pid = 0;
  std::string segment;  // the name its record gave
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
    // Segments that ranks killed during an earlier connect on this host left behind.
    shm::SweepOrphanSegments();
    SS_ASSIGN_OR_RETURN(shm::OwnSegment own, shm::CreateSegment(rank, list));
    name_ = own.name;
    seg_ = own.map;
    seg_bytes_ = own.bytes;
    linked_ = true;
    SS_RETURN_IF_ERROR(store.Set(prefix + "/shm/" + std::to_string(rank),
                                 shm::FormatRecord(name_, getpid(), list)));
    for (size_t i = 0; i < list.size(); ++i) {
      ShmPeer& p = peers_[list[i]];
      p.rank = list[i];
      p.in = shm::RingAt(seg_, list.size(), i);
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
    for (int r : list) {
      if (r == rank) continue;
      // In short slices, so a peer that dies before mapping is seen within ~100 ms, not at the
      // timeout; its segment (it never unlinked it) goes with it.
      const std::string key = prefix + "/shm_mapped/" + std::to_string(r);
      while (true) {
        const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        auto v = store.Get(key, std::clamp(left, Millis(1), Millis(100)));
        if (v.ok()) break;
        if (v.status().code() != StatusCode::kDeadlineExceeded) return v.status();
        const ShmPeer& p = peers_[r];
        if (!internal::ProcessAlive(p.pid)) {
          shm::UnlinkOrphan(p.segment);
          return UnavailableError("shm: peer rank " + std::to_string(r) + " (pid " +
                                  std::to_string(p.pid) +
                                  ") exited during connect; its segment was removed");
        }
        if (Clock::now() >= deadline) {
          return DeadlineExceededError("shm: rank " + std::to_string(rank) +
                                       " timed out waiting for peer rank " + std::to_string(r) +
                                       " to map its rings");
        }
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
    SS_ASSIGN_OR_RETURN(ShmPeer * p, Usable(peer, true));
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
    if (!it->second.complete && it->second.error.ok()) Step();
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

  // Pumps every peer's rings: early messages are buffered, a dead peer is noticed.
  void Progress() override {
    if (!aborted_) Step();
  }

  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    Close();
    ops_.clear();
  }

 private:
  // Maps the segment a peer's record names; a record from a process that already exited has its
  // segment removed instead (the peer died during connect, before unlinking it).
  Status MapPeer(ShmPeer& p, const std::string& record) {
    SS_ASSIGN_OR_RETURN(shm::PeerRecord rec, shm::ParsePeerRecord(record, p.rank, rank_));
    p.pid = rec.pid;
    p.segment = rec.name;
    if (rec.pid != getpid() && !internal::ProcessAlive(rec.pid)) {
      shm::UnlinkOrphan(rec.name);
      return UnavailableError("shm: peer rank " + std::to_string(p.rank) + " (pid " +
                              std::to_string(rec.pid) +
                              ") exited during connect; its segment was removed");
    }
    SS_ASSIGN_OR_RETURN(p.map, shm::MapPeerSegment(rec, p.rank, &p.map_bytes));
    p.out = shm::RingAt(p.map, rec.rings, rec.index);
    p.out_head = p.out->head.load(std::memory_order_relaxed);
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

  Result<ShmPeer*> Usable(int peer, bool sending) {
    if (aborted_) return AbortedError("shm: transport was aborted");
    auto it = peers_.find(peer);
    if (!connected_ || it == peers_.end()) {
      return FailedPreconditionError("shm: rank " + std::to_string(peer) +
                                     " is not a connected peer");
    }
    ShmPeer& p = it->second;
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
    SS_ASSIGN_OR_RETURN(ShmPeer * p, Usable(peer, true));
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
    SS_ASSIGN_OR_RETURN(ShmPeer * p, Usable(peer, false));
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

  Status TooSmall(const ShmPeer& p, uint64_t msg, uint64_t buf) const {
    return OutOfRangeError("shm: a " + std::to_string(msg) + "-byte message from rank " +
                           std::to_string(p.rank) + " does not fit the " + std::to_string(buf) +
                           "-byte receive buffer");
  }

  // Notices a dead, closed or corrupt peer (the process check at most every 50 ms).
  void Watch(ShmPeer& p) {
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
  void Gone(ShmPeer& p, const std::string& what) {
    p.gone = true;
    p.why = UnavailableError("shm: peer rank " + std::to_string(p.rank) + " " + what);
  }

  void Fail(XferId id, const Status& s) {
    auto it = ops_.find(id);
    if (it != ops_.end() && it->second.error.ok() && !it->second.complete) it->second.error = s;
  }

  void Step() {
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
  void FailPending(ShmPeer& p) {
    for (XferId id : p.sendq) Fail(id, p.why);
    p.sendq.clear();
    for (XferId id : p.recvs) Fail(id, p.why);
    p.recvs.clear();
    for (XferId id : p.flushes) Fail(id, p.why);
    p.flushes.clear();
    if (p.in_msg && p.target != 0) Fail(p.target, p.why);
    p.target = 0;
  }

  void PumpSends(ShmPeer& p) {
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

  void PumpRecvs(ShmPeer& p) {
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

  void StartMessage(ShmPeer& p, const SlotHeader& h) {
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

  void EndMessage(ShmPeer& p) {
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

  void CorruptRing(ShmPeer& p, const std::string& what) {
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
  std::map<int, ShmPeer> peers_;
  std::unordered_map<XferId, Op> ops_;
  XferId next_id_ = 1;
};

}  // namespace

Result<std::unique_ptr<Transport>> NewShmTransport() {
  return std::unique_ptr<Transport>(new ShmTransport());
}

}  // namespace shardsync
