// cuda_ipc transport: same-node GPU memory, one-sided.
//
// Export: at Connect every rank publishes, for each registered region, the IPC handle of the
// allocation holding it (cudaIpcGetMemHandle of the base cuMemGetAddressRange returns) plus the
// region's offset in it. Import: a sender opens a peer's allocation on first use
// (cudaIpcOpenMemHandle, peer access enabled lazily for other GPUs) and caches the mapping for the
// transport's life, so later syncs pay nothing. Puts are cudaMemcpyAsync on the transport's stream
// (or the caller's, see CudaIpcSetStream) and complete through CUDA events; a Flush is an event
// after every earlier put. Control messages (Send/Recv) go through a shared-memory mailbox per
// direction (shm_mailbox.h); a peer that exits or aborts is seen there (closed flag, pid gone).
#include <cuda_runtime.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/trace.h"
#include "cuda/cuda_util.h"
#include "cuda/impl/shm_mailbox.h"
#include "shardsync/gpu.h"

namespace shardsync::gpu {

using internal::CudaStatus;
using internal::Mailbox;

namespace internal {

Status AllocationRange(const void* ptr, void** base, size_t* size) {
  using Fn = int (*)(unsigned long long*, size_t*, unsigned long long);
  static Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<Fn>(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  if (!fn) return InternalError("cuMemGetAddressRange entry point not found in the driver");
  unsigned long long b = 0;
  const int rc = fn(&b, size, reinterpret_cast<unsigned long long>(ptr));
  if (rc != 0) {
    return InvalidArgumentError("cuMemGetAddressRange failed (CUresult " + std::to_string(rc) +
                                "): pointer is not device memory from cudaMalloc");
  }
  *base = reinterpret_cast<void*>(b);
  return OkStatus();
}

}  // namespace internal

namespace {

constexpr uint32_t kExportMagic = 0x53534950;  // "SSIP"

struct ExportRecord {
  uint32_t magic = kExportMagic;
  int32_t pid = 0;
  int32_t device = -1;
  int32_t ok = 0;  // 0: not exportable (error text below)
  cudaIpcMemHandle_t handle{};
  uint64_t alloc_base = 0;  // exporter's address of the allocation (same-process shortcut)
  uint64_t offset = 0;      // region start inside the allocation
  uint64_t bytes = 0;
  char error[160] = {};
};

uint64_t Fnv(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string Hex(uint64_t v) {
  char b[17];
  snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// SHARDSYNC_TRACE=1 (common/trace.h): launches and their completion on stderr.
void TraceLaunch(const char* what, size_t buckets) {
  trace::Line("cuda_ipc: %s (%zu buckets)", what, buckets);
}

bool PidAlive(int pid) { return pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH; }

class IpcSendPair;

// One launch over several send pairs' buckets: the batch, the landed sums of all of them in one
// device buffer (the kernel hands them over with its signal), and the event behind it.
struct MergedLaunch {
  int device = 0;
  std::unique_ptr<CopyBatch> batch;  // null: the pairs share no kernel (one launch each)
  std::unique_ptr<DeviceBuffer> lsum;
  // After the kernel: how a fault shows (a faulted kernel never signals).
  cudaEvent_t done = nullptr;
  uint64_t seq = 0;  // of the last signaled launch
  size_t buckets = 0;
  ~MergedLaunch() {
    cudaSetDevice(device);
    if (done) cudaEventDestroy(done);
  }
};

class CudaIpcTransport final : public Transport {
 public:
  explicit CudaIpcTransport(int device) : device_(device) {}
  ~CudaIpcTransport() override {
    cudaSetDevice(device_);
    merged_.clear();
    retired_.clear();
    xfers_.clear();  // returns shared events to the pool
    for (cudaEvent_t e : event_pool_) cudaEventDestroy(e);
    for (auto& [key, ptr] : opened_) cudaIpcCloseMemHandle(ptr);
    if (own_stream_) cudaStreamDestroy(own_stream_);
  }

  std::string_view name() const override { return "cuda_ipc"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.device_memory = true;
    c.one_sided_put = true;
    c.two_sided = true;  // control messages up to kMailboxSlotBytes through the mailbox
    c.same_node_only = true;
    c.tag_matching = true;
    c.prepared = true;
    return c;
  }
  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return self.hostname == peer.hostname && self.mem == MemKind::kCuda &&
           peer.mem == MemKind::kCuda;
  }

  Result<uint32_t> RegisterMemory(const MemRegion& region) override {
    if (connected_) return FailedPreconditionError("cuda_ipc: RegisterMemory after Connect");
    if (region.kind != MemKind::kCuda) {
      return InvalidArgumentError("cuda_ipc: region " + std::to_string(regions_.size()) +
                                  " is host memory; cuda_ipc moves device memory only");
    }
    regions_.push_back(region);
    return static_cast<uint32_t>(regions_.size() - 1);
  }

  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override {
    if (connected_) return FailedPreconditionError("cuda_ipc: Connect called twice");
    rank_ = rank;
    SS_CUDA(cudaSetDevice(device_), "cuda_ipc: cudaSetDevice " + std::to_string(device_));
    if (!stream_) {
      SS_CUDA(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking), "cuda_ipc: stream");
      stream_ = own_stream_;
    }
    const std::string base = prefix + "cuda_ipc/";
    // 1. Export every region.
    std::string blob;
    for (size_t i = 0; i < regions_.size(); ++i) {
      ExportRecord rec;
      rec.pid = getpid();
      rec.device = device_;
      rec.bytes = regions_[i].bytes;
      void* alloc = nullptr;
      size_t alloc_size = 0;
      Status s = internal::AllocationRange(regions_[i].base, &alloc, &alloc_size);
      if (s.ok()) {
        s = CudaStatus(cudaIpcGetMemHandle(&rec.handle, alloc),
                       "cudaIpcGetMemHandle of region " + std::to_string(i));
      }
      if (s.ok()) {
        rec.ok = 1;
        rec.alloc_base = reinterpret_cast<uint64_t>(alloc);
        rec.offset = static_cast<uint64_t>(static_cast<unsigned char*>(regions_[i].base) -
                                           static_cast<unsigned char*>(alloc));
      } else {
        cudaGetLastError();
        snprintf(rec.error, sizeof(rec.error), "%s", s.message().c_str());
      }
      blob.append(reinterpret_cast<const char*>(&rec), sizeof(rec));
    }
    SS_RETURN_IF_ERROR(store.Set(base + std::to_string(rank) + "/mem", blob));
    // 2. Inboxes (peer -> me), created by me.
    const std::string shm = "/ssipc_" + Hex(Fnv(prefix)) + "_";
    for (int p : peers) {
      SS_ASSIGN_OR_RETURN(Mailbox * m,
                          Mailbox::Create(shm + std::to_string(p) + "_" + std::to_string(rank)));
      inbox_[p].reset(m);
    }
    SS_RETURN_IF_ERROR(store.Set(base + std::to_string(rank) + "/ready", "1"));
    // 3. Peers' exports and outboxes (me -> peer).
    for (int p : peers) {
      auto got = store.Get(base + std::to_string(p) + "/mem", timeout);
      if (!got.ok()) {
        return Status(got.status().code(), "cuda_ipc: rank " + std::to_string(rank) +
                                               " waiting for peer rank " + std::to_string(p) +
                                               " exports: " + got.status().message());
      }
      const std::string& v = *got;
      if (v.size() % sizeof(ExportRecord) != 0) {
        return DataLossError("cuda_ipc: peer rank " + std::to_string(p) + " export is malformed");
      }
      auto& recs = exports_[p];
      recs.resize(v.size() / sizeof(ExportRecord));
      if (!recs.empty()) std::memcpy(recs.data(), v.data(), v.size());
      for (const auto& r : recs) {
        if (r.magic != kExportMagic) {
          return DataLossError("cuda_ipc: peer rank " + std::to_string(p) + " export bad magic");
        }
      }
      SS_RETURN_IF_ERROR(store.Get(base + std::to_string(p) + "/ready", timeout)
                             .status()
                             .Annotate("cuda_ipc: peer rank " + std::to_string(p) + " mailbox"));
      SS_ASSIGN_OR_RETURN(Mailbox * m,
                          Mailbox::Open(shm + std::to_string(rank) + "_" + std::to_string(p)));
      outbox_[p].reset(m);
      peer_pid_[p] = recs.empty() ? m->header()->receiver_pid.load() : recs[0].pid;
      if (peer_pid_[p] == 0) peer_pid_[p] = m->header()->receiver_pid.load();
    }
    // 4. Once every peer mapped my inboxes, their names can go (no leak if we crash later).
    SS_RETURN_IF_ERROR(store.Set(base + std::to_string(rank) + "/opened", "1"));
    for (int p : peers) {
      SS_RETURN_IF_ERROR(store.Get(base + std::to_string(p) + "/opened", timeout)
                             .status()
                             .Annotate("cuda_ipc: peer rank " + std::to_string(p) + " opening"));
    }
    for (auto& [p, m] : inbox_) m->Unlink();
    connected_ = true;
    return OkStatus();
  }

  Result<void*> RemotePointer(int peer, uint32_t region, uint64_t offset, uint64_t bytes) {
    SS_RETURN_IF_ERROR(Usable());
    auto it = exports_.find(peer);
    if (it == exports_.end()) {
      return InvalidArgumentError("cuda_ipc: rank " + std::to_string(peer) +
                                  " is not a connected peer of rank " + std::to_string(rank_));
    }
    if (region >= it->second.size()) {
      return OutOfRangeError("cuda_ipc: peer rank " + std::to_string(peer) + " has no region " +
                             std::to_string(region) + " (it registered " +
                             std::to_string(it->second.size()) + ")");
    }
    const ExportRecord& r = it->second[region];
    if (offset + bytes > r.bytes || offset + bytes < offset) {
      return OutOfRangeError("cuda_ipc: put [" + std::to_string(offset) + ", " +
                             std::to_string(offset + bytes) + ") outside peer rank " +
                             std::to_string(peer) + " region " + std::to_string(region) + " of " +
                             std::to_string(r.bytes) + " bytes");
    }
    if (!r.ok) {
      return FailedPreconditionError("cuda_ipc: peer rank " + std::to_string(peer) + " region " +
                                     std::to_string(region) + " is not exportable: " + r.error);
    }
    unsigned char* alloc = nullptr;
    if (r.pid == getpid()) {
      alloc = reinterpret_cast<unsigned char*>(r.alloc_base);  // same process: no IPC needed
    } else {
      const std::string key(reinterpret_cast<const char*>(&r.handle), sizeof(r.handle));
      auto o = opened_.find(key);
      if (o == opened_.end()) {
        SS_CUDA(cudaSetDevice(device_), "cuda_ipc: cudaSetDevice");
        void* p = nullptr;
        SS_CUDA(cudaIpcOpenMemHandle(&p, r.handle, cudaIpcMemLazyEnablePeerAccess),
                "cuda_ipc: cudaIpcOpenMemHandle of peer rank " + std::to_string(peer) + " region " +
                    std::to_string(region) + " (device " + std::to_string(r.device) + ")");
        o = opened_.emplace(key, p).first;
      }
      alloc = static_cast<unsigned char*>(o->second);
    }
    return static_cast<void*>(alloc + r.offset + offset);
  }

  Result<XferId> PostPut(int peer, const void* src, size_t bytes, uint32_t remote_region,
                         uint64_t remote_offset) override {
    SS_ASSIGN_OR_RETURN(void* dst, RemotePointer(peer, remote_region, remote_offset, bytes));
    if (bytes > 0) {
      SS_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
              "cuda_ipc: put to peer rank " + std::to_string(peer));
    }
    // No event per put (a session posts one put per parameter run): the first Poll or Flush
    // records one event that covers every put posted before it.
    Xfer x;
    x.kind = Xfer::kEvent;
    x.peer = peer;
    const XferId id = next_id_++;
    xfers_.emplace(id, std::move(x));
    unevented_.push_back(id);
    return id;
  }

  Result<XferId> PostFlush(int peer) override {
    SS_RETURN_IF_ERROR(Usable());
    return NewEventXfer(peer);
  }

  Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) override {
    return PostSendImpl(peer, tag, buf, bytes, IsDevice(buf));
  }
  Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) override {
    return PostRecvImpl(peer, tag, buf, bytes, IsDevice(buf));
  }
  // Prepared pairs' control messages live in host memory: no pointer query (a driver call of
  // microseconds each, on every sync's critical path).
  Result<XferId> PostSendHost(int peer, uint64_t tag, const void* buf, size_t bytes) {
    return PostSendImpl(peer, tag, buf, bytes, false);
  }
  Result<XferId> PostRecvHost(int peer, uint64_t tag, void* buf, size_t bytes) {
    return PostRecvImpl(peer, tag, buf, bytes, false);
  }

  Result<XferState> Poll(XferId id) override {
    if (aborted_) return AbortedError("cuda_ipc: transport aborted");
    auto it = xfers_.find(id);
    if (it == xfers_.end())
      return InvalidArgumentError("cuda_ipc: unknown xfer " + std::to_string(id));
    Xfer& x = it->second;
    switch (x.kind) {
      case Xfer::kEvent: {
        if (!x.event) SS_RETURN_IF_ERROR(RecordShared().status());
        const cudaError_t e = cudaEventQuery(x.event->e);
        if (e == cudaErrorNotReady) {
          SS_RETURN_IF_ERROR(PeerAliveSoon(x.peer));
          return XferState::kInProgress;
        }
        xfers_.erase(it);
        SS_CUDA(e, "cuda_ipc: put/flush to peer rank");
        return XferState::kDone;
      }
      case Xfer::kSend: {
        Mailbox& m = *outbox_[x.peer];
        if (m.header()->receiver_closed.load()) return PeerGone(x.peer, "closed its mailbox");
        // The ring would take a message for a dead peer too: a send to it must fail.
        SS_RETURN_IF_ERROR(PeerAlive(x.peer));
        if (!m.TrySend(x.tag, x.data.data(), x.data.size())) {
          SS_RETURN_IF_ERROR(PeerAliveSoon(x.peer));
          return XferState::kInProgress;
        }
        xfers_.erase(it);
        return XferState::kDone;
      }
      case Xfer::kRecv: {
        Drain(x.peer);
        auto& q = unexpected_[x.peer];
        for (auto m = q.begin(); m != q.end(); ++m) {
          if (m->first != x.tag) continue;
          if (m->second.size() > x.bytes) {  // a larger buffer is fine (transport.h)
            const std::string msg = "cuda_ipc: message tag " + std::to_string(x.tag) +
                                    " from rank " + std::to_string(x.peer) + " has " +
                                    std::to_string(m->second.size()) + " bytes, receive posted " +
                                    std::to_string(x.bytes);
            xfers_.erase(it);
            return OutOfRangeError(msg);
          }
          SS_RETURN_IF_ERROR(CopyOut(m->second.data(), m->second.size(), x.buf, x.device_buf));
          q.erase(m);
          xfers_.erase(it);
          return XferState::kDone;
        }
        if (inbox_[x.peer]->header()->sender_closed.load()) {
          return PeerGone(x.peer, "closed its mailbox");
        }
        SS_RETURN_IF_ERROR(PeerAliveSoon(x.peer));
        return XferState::kInProgress;
      }
    }
    return InternalError("cuda_ipc: bad xfer kind");
  }

  void Abort() override {
    aborted_ = true;
    for (auto& [p, m] : inbox_) m->header()->receiver_closed.store(1);
    for (auto& [p, m] : outbox_) m->header()->sender_closed.store(1);
  }

  void SetStream(cudaStream_t s) { stream_ = s ? s : own_stream_; }

  Result<std::unique_ptr<PreparedPair>> Prepare(StoreClient& store, const PairSpec& spec,
                                                Millis timeout) override;

  // For prepared pairs.
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  // For the polls of a pair in flight (PeerAliveSoon).
  Status CheckPeer(int peer) {
    SS_RETURN_IF_ERROR(Usable());
    return PeerAliveSoon(peer);
  }
  // Whether a pair in flight should ask the driver about its stream now: at most every
  // kWaitCheckEvery (a fault shows there; completion shows in the kernel's own signal first).
  bool StreamCheckDue() {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_stream_check_) return false;
    next_stream_check_ = now + kWaitCheckEvery;
    return true;
  }
  // Send pairs launch together (see IpcSendPair): every live send pair registers here.
  void AddSend(IpcSendPair* p) { sends_.push_back(p); }
  void RemoveSend(IpcSendPair* p) {
    sends_.erase(std::remove(sends_.begin(), sends_.end(), p), sends_.end());
    // Launches naming it are never replayed again; kept (other members may still point at one)
    // until the transport goes.
    for (auto it = merged_.begin(); it != merged_.end();) {
      if (std::find(it->first.begin(), it->first.end(), p) != it->first.end()) {
        retired_.push_back(std::move(it->second));
        it = merged_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // A send pair was posted: once every live send pair is, they launch as one.
  Status SendPosted();
  // Launches every posted send pair that has not launched yet, as one kernel, once each one's
  // receiver is ready (else later: the pairs' Polls call it again).
  Status LaunchPostedSends();
  // `group`'s launch completed: every pair still waiting on it tells its receiver. Returns
  // `self`'s error; another pair's resurfaces at its own Poll (so it names the right peer).
  Status FinishLaunch(const MergedLaunch* group, IpcSendPair* self);
  // The registered region holding [p, p + bytes) and p's offset in it.
  Result<std::pair<uint32_t, uint64_t>> FindLocal(const void* p, uint64_t bytes) const {
    const auto* q = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < regions_.size(); ++i) {
      const auto* b = static_cast<const unsigned char*>(regions_[i].base);
      if (q >= b && q + bytes <= b + regions_[i].bytes) {
        return std::make_pair(static_cast<uint32_t>(i), static_cast<uint64_t>(q - b));
      }
    }
    return InvalidArgumentError("cuda_ipc: " + std::to_string(bytes) +
                                " bytes of a prepared pair are in no registered region");
  }

 private:
  // An event shared by the puts it covers; back to the pool when the last one completes.
  struct SharedEvent {
    cudaEvent_t e = nullptr;
    std::vector<cudaEvent_t>* pool = nullptr;
    ~SharedEvent() {
      if (e) pool->push_back(e);
    }
  };
  // PostSend / PostRecv with the buffer's memory kind known.
  Result<XferId> PostSendImpl(int peer, uint64_t tag, const void* buf, size_t bytes,
                              bool device_buf) {
    SS_RETURN_IF_ERROR(Usable());
    if (!outbox_.count(peer)) {
      return InvalidArgumentError("cuda_ipc: send to rank " + std::to_string(peer) +
                                  ", not a connected peer");
    }
    if (bytes > internal::kMailboxSlotBytes) {
      return InvalidArgumentError("cuda_ipc: send of " + std::to_string(bytes) + " bytes to rank " +
                                  std::to_string(peer) + " exceeds the control-message limit " +
                                  std::to_string(internal::kMailboxSlotBytes) +
                                  " (move data with PostPut)");
    }
    Xfer x;
    x.kind = Xfer::kSend;
    x.peer = peer;
    x.tag = tag;
    x.data.resize(bytes);
    if (bytes) SS_RETURN_IF_ERROR(CopyIn(buf, bytes, x.data.data(), device_buf));
    const XferId id = next_id_++;
    xfers_.emplace(id, std::move(x));
    return id;
  }

  Result<XferId> PostRecvImpl(int peer, uint64_t tag, void* buf, size_t bytes, bool device_buf) {
    SS_RETURN_IF_ERROR(Usable());
    if (!inbox_.count(peer)) {
      return InvalidArgumentError("cuda_ipc: recv from rank " + std::to_string(peer) +
                                  ", not a connected peer");
    }
    Xfer x;
    x.kind = Xfer::kRecv;
    x.peer = peer;
    x.tag = tag;
    x.buf = buf;
    x.bytes = bytes;
    x.device_buf = device_buf;
    const XferId id = next_id_++;
    xfers_.emplace(id, std::move(x));
    return id;
  }

  struct Xfer {
    enum Kind { kEvent, kSend, kRecv } kind = kEvent;
    int peer = -1;
    std::shared_ptr<SharedEvent> event;
    uint64_t tag = 0;
    std::vector<unsigned char> data;
    void* buf = nullptr;
    size_t bytes = 0;
    bool device_buf = false;  // kRecv: buf is device memory
  };

  Status Usable() const {
    if (aborted_) return AbortedError("cuda_ipc: transport aborted");
    if (!connected_) return FailedPreconditionError("cuda_ipc: not connected");
    return OkStatus();
  }

  // Records one event on the stream and gives it to every put still without one.
  Result<std::shared_ptr<SharedEvent>> RecordShared() {
    cudaEvent_t e = nullptr;
    if (!event_pool_.empty()) {
      e = event_pool_.back();
      event_pool_.pop_back();
    } else {
      SS_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cuda_ipc: event");
    }
    auto ev = std::make_shared<SharedEvent>();
    ev->e = e;
    ev->pool = &event_pool_;
    SS_CUDA(cudaEventRecord(e, stream_), "cuda_ipc: event record");
    for (XferId id : unevented_) {
      auto it = xfers_.find(id);
      if (it != xfers_.end()) it->second.event = ev;
    }
    unevented_.clear();
    return ev;
  }

  Result<XferId> NewEventXfer(int peer) {
    SS_ASSIGN_OR_RETURN(auto ev, RecordShared());
    Xfer x;
    x.kind = Xfer::kEvent;
    x.peer = peer;
    x.event = std::move(ev);
    const XferId id = next_id_++;
    xfers_.emplace(id, std::move(x));
    return id;
  }

  // Control buffers may live in host or device memory.
  static bool IsDevice(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeDevice;
  }
  static Status CopyIn(const void* buf, size_t n, void* host, bool device_buf) {
    if (device_buf) {
      SS_CUDA(cudaMemcpy(host, buf, n, cudaMemcpyDeviceToHost), "cuda_ipc: control copy");
    } else {
      std::memcpy(host, buf, n);
    }
    return OkStatus();
  }
  static Status CopyOut(const void* host, size_t n, void* buf, bool device_buf) {
    if (n == 0) return OkStatus();
    if (device_buf) {
      SS_CUDA(cudaMemcpy(buf, host, n, cudaMemcpyHostToDevice), "cuda_ipc: control copy");
    } else {
      std::memcpy(buf, host, n);
    }
    return OkStatus();
  }

  void Drain(int peer) {
    Mailbox& m = *inbox_[peer];
    uint64_t tag = 0, bytes = 0;
    while (m.Peek(&tag, &bytes)) {
      const unsigned char* d = m.PeekData();
      unexpected_[peer].emplace_back(tag, std::vector<unsigned char>(d, d + bytes));
      m.Pop();
    }
  }

  Status PeerGone(int peer, const std::string& why) {
    return UnavailableError("cuda_ipc: peer rank " + std::to_string(peer) + " (pid " +
                            std::to_string(peer_pid_[peer]) + ") " + why);
  }
  Status PeerAlive(int peer) {
    auto it = peer_pid_.find(peer);
    if (it == peer_pid_.end()) return OkStatus();
    if (!PidAlive(it->second)) return PeerGone(peer, "exited");
    return OkStatus();
  }
  // PeerAlive for waits that poll in a tight loop: the syscall at most every kWaitCheckEvery per
  // peer (it took a visible share of each poll, and so of the time to notice a completion), so a
  // dead peer still fails the wait within a millisecond. A send checks exactly (PeerAlive).
  Status PeerAliveSoon(int peer) {
    const auto now = std::chrono::steady_clock::now();
    auto& next = next_alive_check_[peer];
    if (now < next) return OkStatus();
    next = now + kWaitCheckEvery;
    return PeerAlive(peer);
  }
  static constexpr std::chrono::milliseconds kWaitCheckEvery{1};

  int device_;
  int rank_ = -1;
  bool connected_ = false;
  bool aborted_ = false;
  cudaStream_t own_stream_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<MemRegion> regions_;
  std::map<int, std::vector<ExportRecord>> exports_;
  std::unordered_map<std::string, void*> opened_;  // IPC handle bytes -> mapping (cached)
  std::map<int, std::unique_ptr<Mailbox>> inbox_, outbox_;
  std::map<int, int> peer_pid_;
  std::map<int, std::chrono::steady_clock::time_point> next_alive_check_;
  std::chrono::steady_clock::time_point next_stream_check_;
  std::map<int, std::deque<std::pair<uint64_t, std::vector<unsigned char>>>> unexpected_;
  std::map<XferId, Xfer> xfers_;
  std::vector<cudaEvent_t> event_pool_;
  std::vector<XferId> unevented_;  // puts posted since the last recorded event
  XferId next_id_ = 1;
  std::vector<IpcSendPair*> sends_;  // live send pairs, in creation order
  // One batch over several send pairs' buckets, by its members (in sends_ order).
  std::map<std::vector<IpcSendPair*>, std::unique_ptr<MergedLaunch>> merged_;
  std::vector<std::unique_ptr<MergedLaunch>> retired_;
};

// ---- prepared pairs ----
//
// Sender: ONE pack launch per replay casts every bucket of the pair straight into the receiver's
// parameters (through the IPC mappings) with the checksum fused, and reads every landed word back
// through the receiver's OWN map (published by the receiver at Prepare; the readback must not
// share the sender's addressing) from L2 right after writing it; the landed sums then reach the
// receiver through the mailbox once the launch completed, with the packed sums: the session then
// needs no store round trip to compare them. Receiver: waits for that message.

constexpr uint64_t kLandedMagic = 0x53534c4d;  // "SSLM"
constexpr uint64_t kPairTagBase = uint64_t{0x5350} << 48;

constexpr uint64_t kReadyTagBase = uint64_t{0x5352} << 48;

uint64_t PairTag(uint64_t version) { return kPairTagBase | (version & ((uint64_t{1} << 48) - 1)); }
// The receiver's pair was posted for `version` (it is inside Sync): the sender may write.
uint64_t ReadyTag(uint64_t version) {
  return kReadyTagBase | (version & ((uint64_t{1} << 48) - 1));
}

// One contiguous run of the receiver's map: wire bytes [wire, wire + bytes) of `bucket` land at
// byte `offset` of its registered region `region`.
struct LandedEntry {
  int64_t bucket, wire, region, offset, bytes;
};

Status CheckBuckets(const PairSpec& spec) {
  const size_t max = (internal::kMailboxSlotBytes - 16) / 16;  // a landed and a packed sum each
  if (spec.buckets.empty() || spec.buckets.size() > max) {
    return InvalidArgumentError("cuda_ipc: pair with rank " + std::to_string(spec.peer) + " has " +
                                std::to_string(spec.buckets.size()) + " buckets (1.." +
                                std::to_string(max) + " supported)");
  }
  return OkStatus();
}

class IpcRecvPair final : public PreparedPair {
 public:
  IpcRecvPair(CudaIpcTransport& t, int peer, size_t buckets)
      : t_(t), peer_(peer), buckets_(buckets), msg_(2 + 2 * buckets) {}

  Status Post(uint64_t version) override {
    if (cancelled_)
      return AbortedError("cuda_ipc: pair with rank " + std::to_string(peer_) + " was cancelled");
    version_ = version;
    SS_ASSIGN_OR_RETURN(id_,
                        t_.PostRecvHost(peer_, PairTag(version), msg_.data(), msg_.size() * 8));
    // Tell the sender through the mailbox (microseconds; the store's ready key takes a round
    // trip through the store server).
    SS_ASSIGN_OR_RETURN(ready_id_, t_.PostSendHost(peer_, ReadyTag(version), &version_, 8));
    SS_ASSIGN_OR_RETURN(XferState rs, t_.Poll(ready_id_));
    ready_sent_ = rs == XferState::kDone;
    posted_ = true;
    return OkStatus();
  }
  Result<XferState> Poll() override {
    if (!posted_) return XferState::kDone;
    if (!ready_sent_) {
      SS_ASSIGN_OR_RETURN(XferState rs, t_.Poll(ready_id_));
      ready_sent_ = rs == XferState::kDone;
      if (!ready_sent_) return XferState::kInProgress;
    }
    SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(id_));
    if (st == XferState::kInProgress) return st;
    posted_ = false;
    if (msg_[0] != version_ || msg_[1] != buckets_) {
      return DataLossError("cuda_ipc: landed checksums from rank " + std::to_string(peer_) +
                           " are for version " + std::to_string(msg_[0]) + " with " +
                           std::to_string(msg_[1]) + " buckets");
    }
    return XferState::kDone;
  }
  Result<PairSums> Sums() override {
    PairSums s;
    s.landed.assign(msg_.begin() + 2, msg_.begin() + 2 + buckets_);
    s.packed.assign(msg_.begin() + 2 + buckets_, msg_.end());
    return s;
  }
  void Cancel() override {
    if (posted_) cancelled_ = true;
  }
  std::string Describe() const override {
    return "cuda_ipc: landed sums read back by rank " + std::to_string(peer_) + ", " +
           std::to_string(buckets_) + " buckets";
  }

 private:
  CudaIpcTransport& t_;
  int peer_;
  size_t buckets_;
  std::vector<uint64_t> msg_;  // [version, buckets, landed sum per bucket, packed sum per bucket]
  uint64_t version_ = 0;
  XferId id_ = 0;
  XferId ready_id_ = 0;
  bool ready_sent_ = false;
  bool posted_ = false, cancelled_ = false;
};

// Sender. Post only marks the pair and waits (mailbox) for the receiver's pair to be posted for
// the same version; the launch comes once every posted send pair's receiver is ready, at the last
// Post or a later Poll: so a trainer's pairs run as ONE kernel over all their buckets instead of
// one launch per pair, which spares the GPU each launch's ramp-up and tail (measured on an H200,
// docs/benchmarks.md), and the session needs no ready keys for them (SignalsReady).
class IpcSendPair final : public PreparedPair {
 public:
  IpcSendPair(CudaIpcTransport& t, int peer, std::vector<int64_t> bytes)
      : t_(t), peer_(peer), bytes_(std::move(bytes)) {
    t_.AddSend(this);
  }
  ~IpcSendPair() override {
    t_.RemoveSend(this);
    cudaSetDevice(t_.device());
    if (done_) cudaEventDestroy(done_);
  }

  Status Init(BatchSpec spec) {
    const size_t nb = bytes_.size();
    SS_ASSIGN_OR_RETURN(lsum_, DeviceBuffer::Allocate(nb * 8, t_.device()));
    SS_CUDA(cudaMemset(lsum_->data(), 0, nb * 8), "cuda_ipc: zero landed sums");
    SS_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cuda_ipc: pair event");
    for (size_t b = 0; b < nb; ++b) {
      spec.landed_sums.push_back(static_cast<unsigned char*>(lsum_->data()) + 8 * b);
    }
    SS_ASSIGN_OR_RETURN(batch_, CopyBatch::Prepare(spec, t_.device()));
    spec_ = std::move(spec);
    return OkStatus();
  }

  Status Post(uint64_t version) override {
    if (cancelled_)
      return AbortedError("cuda_ipc: pair with rank " + std::to_string(peer_) + " was cancelled");
    SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
    version_ = version;
    SS_ASSIGN_OR_RETURN(ready_id_, t_.PostRecvHost(peer_, ReadyTag(version), &ready_msg_, 8));
    ready_ = false;
    state_ = kPosted;
    return t_.SendPosted();
  }

  bool posted() const { return state_ == kPosted; }
  // Whether the receiver's pair was posted for this version (drives the mailbox).
  Result<bool> Ready() {
    if (!ready_) {
      SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(ready_id_));
      if (st == XferState::kInProgress) return false;
      if (ready_msg_ != version_) {
        return DataLossError("cuda_ipc: rank " + std::to_string(peer_) + " is ready for version " +
                             std::to_string(ready_msg_) + ", this pair posted " +
                             std::to_string(version_));
      }
      ready_ = true;
    }
    return true;
  }
  const BatchSpec& spec() const { return spec_; }
  // This pair's buckets went out in `group`'s launch, as its buckets [first, first + n).
  void LaunchedIn(const MergedLaunch* group, size_t first) {
    group_ = group;
    first_ = first;
    state_ = kLaunched;
  }
  // A signaled launch: the kernel hands over the sums and re-zeroes them itself.
  Status LaunchAlone(cudaStream_t s) {
    SS_RETURN_IF_ERROR(batch_->LaunchSignaled(s, ++seq_));
    SS_CUDA(cudaEventRecord(done_, s), "cuda_ipc: pair event");
    LaunchedIn(nullptr, 0);
    return OkStatus();
  }

  Result<XferState> Poll() override {
    if (state_ == kIdle) return XferState::kDone;
    if (state_ == kPosted) {
      SS_RETURN_IF_ERROR(t_.LaunchPostedSends());
      if (state_ == kPosted) {  // a receiver is not in this sync yet
        SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
        return XferState::kInProgress;
      }
    }
    if (state_ == kLaunched) {
      // The kernel's own signal comes first; the event (after it on the stream) tells a fault.
      const CopyBatch& b = group_ ? *group_->batch : *batch_;
      const uint64_t seq = group_ ? group_->seq : seq_;
      if (b.Signaled() != seq) {
        if (!t_.StreamCheckDue()) return XferState::kInProgress;
        const cudaError_t e = cudaEventQuery(group_ ? group_->done : done_);
        if (e == cudaErrorNotReady) {
          SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
          return XferState::kInProgress;
        }
        SS_CUDA(e, "cuda_ipc: pack into rank " + std::to_string(peer_));
        if (b.Signaled() != seq) {
          return InternalError("cuda_ipc: pack into rank " + std::to_string(peer_) +
                               " completed without its signal (launch " + std::to_string(seq) +
                               ", signaled " + std::to_string(b.Signaled()) + ")");
        }
      }
      TraceLaunch("launch complete", bytes_.size());
      // Every pair of the launch tells its receiver now, not one per Poll of the caller's loop.
      if (group_) {
        SS_RETURN_IF_ERROR(t_.FinishLaunch(group_, this));
      } else {
        SS_ASSIGN_OR_RETURN(std::vector<uint64_t> packed, batch_->Checksums());
        SS_ASSIGN_OR_RETURN(std::vector<uint64_t> landed, batch_->LandedSums());
        SS_RETURN_IF_ERROR(Finished(packed, landed));
      }
      if (state_ == kIdle) return XferState::kDone;
    }
    SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(id_));
    if (st == XferState::kDone) state_ = kIdle;
    return st;
  }

  const MergedLaunch* group() const { return state_ == kLaunched ? group_ : nullptr; }
  // The launch completed: the sums, and the message that tells the receiver. `packed` (finished)
  // and `landed` (raw) are the launch's, read once for all its pairs; this pair's buckets start
  // at its offset in them.
  Status Finished(const std::vector<uint64_t>& packed, const std::vector<uint64_t>& landed) {
    const size_t first = group_ ? first_ : 0;
    if (first + bytes_.size() > packed.size() || first + bytes_.size() > landed.size()) {
      return InternalError("cuda_ipc: launch sums for " + std::to_string(packed.size()) +
                           " buckets, pair to rank " + std::to_string(peer_) + " needs [" +
                           std::to_string(first) + ", " + std::to_string(first + bytes_.size()) +
                           ")");
    }
    sums_.packed.assign(packed.begin() + first, packed.begin() + first + bytes_.size());
    msg_ = {version_, bytes_.size()};
    sums_.landed.clear();
    for (size_t b = 0; b < bytes_.size(); ++b) {
      sums_.landed.push_back(ChecksumFinish(landed[first + b], static_cast<uint64_t>(bytes_[b])));
      msg_.push_back(sums_.landed.back());
    }
    msg_.insert(msg_.end(), sums_.packed.begin(), sums_.packed.end());
    // Every byte is in the receiver's memory before it hears of it.
    SS_ASSIGN_OR_RETURN(id_,
                        t_.PostSendHost(peer_, PairTag(version_), msg_.data(), msg_.size() * 8));
    state_ = kSending;
    SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(id_));  // into the mailbox now, usually
    if (st == XferState::kDone) state_ = kIdle;
    return OkStatus();
  }

  Result<PairSums> Sums() override { return sums_; }
  bool DeliversSums() const override { return true; }
  bool SignalsReady() const override { return true; }
  void Cancel() override {
    if (state_ == kIdle) return;
    cancelled_ = true;
    if (state_ == kPosted) state_ = kIdle;  // never launched: nothing in flight
  }
  std::string Describe() const override {
    return "cuda_ipc: " + std::to_string(bytes_.size()) + " buckets into rank " +
           std::to_string(peer_) + (group_ ? " (one launch with the other pairs)" : " (1 launch)");
  }

 private:
  CudaIpcTransport& t_;
  int peer_;
  std::vector<int64_t> bytes_;
  BatchSpec spec_;
  std::unique_ptr<CopyBatch> batch_;
  std::unique_ptr<DeviceBuffer> lsum_;
  cudaEvent_t done_ = nullptr;
  uint64_t seq_ = 0;  // of the last signaled launch of batch_
  enum { kIdle, kPosted, kLaunched, kSending } state_ = kIdle;
  uint64_t version_ = 0;
  const MergedLaunch* group_ = nullptr;
  size_t first_ = 0;
  XferId ready_id_ = 0;
  uint64_t ready_msg_ = 0;
  bool ready_ = false;
  std::vector<uint64_t> msg_;
  PairSums sums_;
  XferId id_ = 0;
  bool cancelled_ = false;
};

// The send pairs' batches as one: buckets renumbered after each other's, in member order, landed
// sums to `lsum` (8 bytes per bucket). Nullopt when they do not share one kernel (dtypes).
std::optional<BatchSpec> MergeSpecs(const std::vector<IpcSendPair*>& members, void* lsum) {
  const BatchSpec& first = members[0]->spec();
  BatchSpec m;
  m.mode = first.mode;
  m.in_dtype = first.in_dtype;
  m.out_dtype = first.out_dtype;
  for (const IpcSendPair* p : members) {
    const BatchSpec& s = p->spec();
    if (s.mode != m.mode || s.in_dtype != m.in_dtype || s.out_dtype != m.out_dtype) {
      return std::nullopt;
    }
    const auto base = static_cast<int32_t>(m.bucket_bytes.size());
    for (CopyRun r : s.runs) {
      r.bucket += base;
      m.runs.push_back(r);
    }
    for (CopyRun r : s.landed_runs) {
      r.bucket += base;
      m.landed_runs.push_back(r);
    }
    m.bucket_bytes.insert(m.bucket_bytes.end(), s.bucket_bytes.begin(), s.bucket_bytes.end());
  }
  for (size_t b = 0; b < m.bucket_bytes.size(); ++b) {
    m.landed_sums.push_back(static_cast<unsigned char*>(lsum) + 8 * b);
  }
  return m;
}

Status CudaIpcTransport::SendPosted() {
  for (const IpcSendPair* p : sends_) {
    if (!p->posted()) return OkStatus();  // the rest follow (or the first Poll launches)
  }
  return LaunchPostedSends();
}

Status CudaIpcTransport::FinishLaunch(const MergedLaunch* group, IpcSendPair* self) {
  SS_ASSIGN_OR_RETURN(std::vector<uint64_t> packed, group->batch->Checksums());
  SS_ASSIGN_OR_RETURN(std::vector<uint64_t> landed, group->batch->LandedSums());
  Status mine;
  for (IpcSendPair* p : sends_) {
    if (p->group() != group) continue;
    Status s = p->Finished(packed, landed);
    if (p == self) mine = s;
  }
  return mine;
}

Status CudaIpcTransport::LaunchPostedSends() {
  std::vector<IpcSendPair*> members;
  bool all_ready = true;
  for (IpcSendPair* p : sends_) {
    if (!p->posted()) continue;
    members.push_back(p);
    SS_ASSIGN_OR_RETURN(bool ready, p->Ready());
    all_ready = all_ready && ready;
  }
  if (members.empty() || !all_ready) return OkStatus();
  SS_CUDA(cudaSetDevice(device_), "cuda_ipc: cudaSetDevice");
  if (members.size() == 1) return members[0]->LaunchAlone(stream_);
  auto it = merged_.find(members);
  if (it == merged_.end()) {
    auto g = std::make_unique<MergedLaunch>();
    g->device = device_;
    for (const IpcSendPair* p : members) g->buckets += p->spec().bucket_bytes.size();
    SS_ASSIGN_OR_RETURN(g->lsum, DeviceBuffer::Allocate(g->buckets * 8, device_));
    SS_CUDA(cudaMemset(g->lsum->data(), 0, g->buckets * 8), "cuda_ipc: zero landed sums");
    SS_CUDA(cudaEventCreateWithFlags(&g->done, cudaEventDisableTiming), "cuda_ipc: launch event");
    if (std::optional<BatchSpec> spec = MergeSpecs(members, g->lsum->data())) {
      SS_ASSIGN_OR_RETURN(g->batch, CopyBatch::Prepare(*spec, device_));
    }
    it = merged_.emplace(members, std::move(g)).first;
  }
  MergedLaunch& g = *it->second;
  if (!g.batch) {  // no common kernel: one launch each
    for (IpcSendPair* p : members) SS_RETURN_IF_ERROR(p->LaunchAlone(stream_));
    return OkStatus();
  }
  SS_RETURN_IF_ERROR(g.batch->LaunchSignaled(stream_, ++g.seq));
  SS_CUDA(cudaEventRecord(g.done, stream_), "cuda_ipc: launch event");
  TraceLaunch("launched", g.buckets);
  size_t first = 0;
  for (IpcSendPair* p : members) {
    p->LaunchedIn(&g, first);
    first += p->spec().bucket_bytes.size();
  }
  return OkStatus();
}

// The receiver's own map of every bucket, merged into runs contiguous in wire and memory.
Result<std::string> LandedMap(const CudaIpcTransport& t, const PairSpec& spec) {
  const int ws = DTypeSize(spec.wire);
  std::vector<LandedEntry> map;
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    for (const PackRegion& r : spec.buckets[b].local) {
      if (r.dtype != spec.wire) {
        return InvalidArgumentError(
            "cuda_ipc: landed region of pair with rank " + std::to_string(spec.peer) + " is " +
            std::string(DTypeName(r.dtype)) + ", the wire " + std::string(DTypeName(spec.wire)));
      }
      SS_ASSIGN_OR_RETURN(auto where, t.FindLocal(r.base, NumElements(r.shape) * ws));
      int64_t wire = r.wire_offset;
      ForEachRun(r.region, r.shape, [&](int64_t off, int64_t len) {
        const int64_t at = static_cast<int64_t>(where.second) + off * ws, n = len * ws;
        LandedEntry* last = map.empty() ? nullptr : &map.back();
        if (last && last->bucket == static_cast<int64_t>(b) && last->region == where.first &&
            last->offset + last->bytes == at && last->wire + last->bytes == wire) {
          last->bytes += n;
        } else {
          map.push_back({static_cast<int64_t>(b), wire, where.first, at, n});
        }
        wire += n;
      });
    }
  }
  std::string blob(16 + map.size() * sizeof(LandedEntry), '\0');
  const uint64_t head[2] = {kLandedMagic, map.size()};
  std::memcpy(blob.data(), head, 16);
  if (!map.empty()) std::memcpy(blob.data() + 16, map.data(), map.size() * sizeof(LandedEntry));
  return blob;
}

Result<std::unique_ptr<PreparedPair>> CudaIpcTransport::Prepare(StoreClient& store,
                                                                const PairSpec& spec,
                                                                Millis timeout) {
  SS_RETURN_IF_ERROR(Usable());
  SS_RETURN_IF_ERROR(CheckBuckets(spec));
  const std::string who = "cuda_ipc: pair with rank " + std::to_string(spec.peer);
  if (!spec.send) {
    SS_ASSIGN_OR_RETURN(std::string blob, LandedMap(*this, spec));
    SS_RETURN_IF_ERROR(store.Set(spec.key + "landed", blob));
    return std::unique_ptr<PreparedPair>(new IpcRecvPair(*this, spec.peer, spec.buckets.size()));
  }
  BatchSpec bs;
  bs.mode = BatchMode::kPack;
  bs.out_dtype = spec.wire;
  bool first = true;
  const int ws = DTypeSize(spec.wire);
  std::vector<int64_t> bytes;
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    const PairBucket& pb = spec.buckets[b];
    bytes.push_back(pb.bytes);
    bs.bucket_bytes.push_back(pb.bytes);
    if (pb.remote.size() != pb.local.size()) {
      return InvalidArgumentError(who + ": bucket " + std::to_string(b) + " has " +
                                  std::to_string(pb.local.size()) + " regions, " +
                                  std::to_string(pb.remote.size()) + " destinations");
    }
    for (size_t i = 0; i < pb.local.size(); ++i) {
      const PackRegion& l = pb.local[i];
      const RemoteRegion& r = pb.remote[i];
      if (first) bs.in_dtype = l.dtype;
      first = false;
      if (l.dtype != bs.in_dtype || l.region.numel() != r.dst.numel() ||
          !RegionInside(l.region, l.shape) || !RegionInside(r.dst, r.shape)) {
        return InvalidArgumentError(who + ": bucket " + std::to_string(b) + " region " +
                                    std::to_string(i) + " " + l.region.ToString() + " -> " +
                                    r.dst.ToString() + " does not fit (dtype, size or bounds)");
      }
      SS_ASSIGN_OR_RETURN(void* base,
                          RemotePointer(spec.peer, r.region, r.offset, NumElements(r.shape) * ws));
      AppendCoRuns(l.region, l.shape, l.base, DTypeSize(l.dtype), r.dst, r.shape, base, ws, ws,
                   static_cast<int32_t>(b), l.wire_offset, &bs.runs);
    }
  }
  // The receiver's map, read back through its regions.
  SS_ASSIGN_OR_RETURN(std::string blob, store.Get(spec.key + "landed", timeout));
  uint64_t head[2] = {0, 0};
  if (blob.size() >= 16) std::memcpy(head, blob.data(), 16);
  if (blob.size() < 16 || head[0] != kLandedMagic ||
      (blob.size() - 16) / sizeof(LandedEntry) != head[1] ||
      (blob.size() - 16) % sizeof(LandedEntry) != 0) {
    return DataLossError(who + ": the receiver's landed map is malformed (" +
                         std::to_string(blob.size()) + " bytes)");
  }
  std::vector<LandedEntry> map(head[1]);
  if (!map.empty()) std::memcpy(map.data(), blob.data() + 16, map.size() * sizeof(LandedEntry));
  for (size_t k = 0; k < map.size(); ++k) {
    const LandedEntry& e = map[k];
    if (e.bucket < 0 || e.bucket >= static_cast<int64_t>(spec.buckets.size()) || e.wire < 0 ||
        e.region < 0 || e.region > UINT32_MAX || e.offset < 0 || e.bytes <= 0 || e.wire % ws != 0 ||
        e.bytes % ws != 0) {
      return DataLossError(who + ": landed map entry " + std::to_string(k) + " is malformed");
    }
    SS_ASSIGN_OR_RETURN(
        void* p, RemotePointer(spec.peer, static_cast<uint32_t>(e.region),
                               static_cast<uint64_t>(e.offset), static_cast<uint64_t>(e.bytes)));
    CopyRun lr;
    lr.in = p;
    lr.row_elems = e.bytes / ws;
    lr.bucket = static_cast<int32_t>(e.bucket);
    lr.wire_offset = e.wire;
    bs.landed_runs.push_back(lr);
  }
  auto pair = std::make_unique<IpcSendPair>(*this, spec.peer, std::move(bytes));
  SS_RETURN_IF_ERROR(pair->Init(std::move(bs)).Annotate(who));
  return std::unique_ptr<PreparedPair>(std::move(pair));
}

}  // namespace

std::unique_ptr<Transport> MakeCudaIpcTransport(int device) {
  return std::make_unique<CudaIpcTransport>(device);
}

Result<void*> CudaIpcRemotePointer(Transport& ipc, int peer, uint32_t region, uint64_t offset,
                                   uint64_t bytes) {
  auto* t = dynamic_cast<CudaIpcTransport*>(&ipc);
  if (!t) return InvalidArgumentError("CudaIpcRemotePointer: transport is not cuda_ipc");
  return t->RemotePointer(peer, region, offset, bytes);
}

Status NcclSetStream(Transport& t, void* stream, bool* matched);  // nccl_transport.cc

Status SetTransportStream(Transport& t, void* stream) {
  if (auto* ipc = dynamic_cast<CudaIpcTransport*>(&t)) {
    ipc->SetStream(static_cast<cudaStream_t>(stream));
    return OkStatus();
  }
  bool matched = false;
  SS_RETURN_IF_ERROR(NcclSetStream(t, stream, &matched));
  if (matched) return OkStatus();
  return InvalidArgumentError("SetTransportStream: transport '" + std::string(t.name()) +
                              "' is not a GPU transport");
}

Status RegisterGpuTransports() {
  static const Status once = [] {
    auto device_of = [](const TransportOptions& o) {
      auto it = o.params.find("device");
      return it == o.params.end() ? 0 : std::atoi(it->second.c_str());
    };
    TransportEntry ipc;
    ipc.name = "cuda_ipc";
    ipc.priority = 100;
    ipc.can_connect = [](const PeerInfo& a, const PeerInfo& b) {
      return a.hostname == b.hostname && a.mem == MemKind::kCuda && b.mem == MemKind::kCuda;
    };
    ipc.factory = [device_of](const TransportOptions& o) -> Result<std::unique_ptr<Transport>> {
      return MakeCudaIpcTransport(device_of(o));
    };
    SS_RETURN_IF_ERROR(RegisterTransport(std::move(ipc)));
    TransportEntry nccl;
    nccl.name = "nccl";
    nccl.priority = 200;
    nccl.can_connect = [](const PeerInfo& a, const PeerInfo& b) {
      return a.mem == MemKind::kCuda && b.mem == MemKind::kCuda && !SameGpu(a, b);
    };
    nccl.factory = [device_of](const TransportOptions& o) -> Result<std::unique_ptr<Transport>> {
      NcclOptions n;
      n.device = device_of(o);
      if (auto it = o.params.find("nccl_depth"); it != o.params.end()) {
        n.depth = std::atoi(it->second.c_str());
        if (n.depth < 1 || n.depth > 64) {
          return InvalidArgumentError("transport param nccl_depth: '" + it->second +
                                      "', expected 1..64");
        }
      }
      return MakeNcclTransport(n);
    };
    return RegisterTransport(std::move(nccl));
  }();
  return once;
}

}  // namespace shardsync::gpu
