// cuda_ipc transport (cuda_ipc.h): same-node GPU memory, one-sided puts, control messages
// through the shared-memory mailboxes.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "cuda/cuda_ipc/cuda_ipc.h"
#include "transport/shm_segment.h"

namespace shardsync::gpu::ipc {

using internal::CudaStatus;

namespace {

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

bool PidAlive(int pid) { return pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH; }

}  // namespace

CudaIpcTransport::~CudaIpcTransport() {
  cudaSetDevice(device_);
  merged_.clear();
  shared_.clear();
  retired_.clear();
  xfers_.clear();  // returns shared events to the pool
  for (cudaEvent_t e : event_pool_) cudaEventDestroy(e);
  for (auto& [key, ptr] : opened_) cudaIpcCloseMemHandle(ptr);
  if (own_stream_) cudaStreamDestroy(own_stream_);
}

TransportCaps CudaIpcTransport::caps() const {
  TransportCaps c;
  c.device_memory = true;
  c.one_sided_put = true;
  c.two_sided = true;  // control messages up to kMailboxSlotBytes through the mailbox
  c.same_node_only = true;
  c.tag_matching = true;
  c.prepared = true;
  return c;
}

Result<uint32_t> CudaIpcTransport::RegisterMemory(const MemRegion& region) {
  if (connected_) return FailedPreconditionError("cuda_ipc: RegisterMemory after Connect");
  if (region.kind != MemKind::kCuda) {
    return InvalidArgumentError("cuda_ipc: region " + std::to_string(regions_.size()) +
                                " is host memory; cuda_ipc moves device memory only");
  }
  regions_.push_back(region);
  return static_cast<uint32_t>(regions_.size() - 1);
}

Status CudaIpcTransport::Connect(StoreClient& store, const std::string& prefix, int rank,
                                 const std::vector<int>& peers, Millis timeout) {
  if (connected_) return FailedPreconditionError("cuda_ipc: Connect called twice");
  rank_ = rank;
  prefix_ = prefix;
  SS_CUDA(cudaSetDevice(device_), "cuda_ipc: cudaSetDevice " + std::to_string(device_));
  if (!stream_) {
    SS_CUDA(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking), "cuda_ipc: stream");
    stream_ = own_stream_;
  }
  const std::string base = prefix + "cuda_ipc/";
  // 1. Export every region.
  SS_RETURN_IF_ERROR(store.Set(base + std::to_string(rank) + "/mem", ExportRegions()));
  // 2. Inboxes (peer -> me), created by me. Their names follow the shm transport's convention
  // (creator's uid, pid namespace and pid), so the mailboxes of a rank killed before it unlinked
  // them are reclaimed by the next connect on this host (shm::SweepOrphanSegments), as shm
  // rings are; the name is published in `ready` for the peers to open.
  shm::SweepOrphanSegments();
  const std::string shm = shm::OwnSegmentPrefix() + "ipc" + Hex(Fnv(prefix)) + "-";
  for (int p : peers) {
    SS_ASSIGN_OR_RETURN(Mailbox * m,
                        Mailbox::Create(shm + std::to_string(p) + "_" + std::to_string(rank)));
    inbox_[p].reset(m);
  }
  SS_RETURN_IF_ERROR(store.Set(base + std::to_string(rank) + "/ready", shm));
  // 3. Peers' exports and outboxes (me -> peer).
  for (int p : peers) SS_RETURN_IF_ERROR(OpenPeer(store, base, p, timeout));
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

std::string CudaIpcTransport::ExportRegions() const {
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
    if (s.ok() && alloc_size >= (size_t{1} << 20) && alloc_size % (size_t{2} << 20) != 0) {
      // Peers map it with small pages and run slower on it (cuda_util.h IpcAllocBytes).
      trace::Line(
          "cuda_ipc: region %zu lies in an allocation of %zu bytes, not whole 2 MiB "
          "pages: peers map it with small pages (slower kernels)",
          i, alloc_size);
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
  return blob;
}

Status CudaIpcTransport::OpenPeer(StoreClient& store, const std::string& base, int p,
                                  Millis timeout) {
  auto got = store.Get(base + std::to_string(p) + "/mem", timeout);
  if (!got.ok()) {
    return Status(got.status().code(), "cuda_ipc: rank " + std::to_string(rank_) +
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
  auto ready = store.Get(base + std::to_string(p) + "/ready", timeout);
  SS_RETURN_IF_ERROR(
      ready.status().Annotate("cuda_ipc: peer rank " + std::to_string(p) + " mailbox"));
  // The peer's mailbox prefix: one of this user's shardsync segments, nothing else.
  const std::string& peer_shm = *ready;
  if (!peer_shm.starts_with("/shardsync-") || peer_shm.size() > 200 ||
      peer_shm.find('/', 1) != std::string::npos) {
    return DataLossError("cuda_ipc: peer rank " + std::to_string(p) +
                         " published a malformed mailbox name");
  }
  SS_ASSIGN_OR_RETURN(Mailbox * m,
                      Mailbox::Open(peer_shm + std::to_string(rank_) + "_" + std::to_string(p)));
  outbox_[p].reset(m);
  peer_pid_[p] = recs.empty() ? m->header()->receiver_pid.load() : recs[0].pid;
  if (peer_pid_[p] == 0) peer_pid_[p] = m->header()->receiver_pid.load();
  return OkStatus();
}

Result<void*> CudaIpcTransport::RemotePointer(int peer, uint32_t region, uint64_t offset,
                                              uint64_t bytes) {
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
    allocs_.try_emplace(r.alloc_base, AllocInfo{r.handle, r.pid, r.alloc_base, 0});
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
      allocs_.try_emplace(reinterpret_cast<uint64_t>(p),
                          AllocInfo{r.handle, r.pid, r.alloc_base, 0});
    }
    alloc = static_cast<unsigned char*>(o->second);
  }
  return static_cast<void*>(alloc + r.offset + offset);
}

Result<XferId> CudaIpcTransport::PostPut(int peer, const void* src, size_t bytes,
                                         uint32_t remote_region, uint64_t remote_offset) {
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

Result<XferState> CudaIpcTransport::Poll(XferId id) {
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
          const std::string msg = "cuda_ipc: message tag " + std::to_string(x.tag) + " from rank " +
                                  std::to_string(x.peer) + " has " +
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

void CudaIpcTransport::Abort() {
  aborted_ = true;
  DropTurn();
  for (auto& [p, m] : inbox_) m->header()->receiver_closed.store(1);
  for (auto& [p, m] : outbox_) m->header()->sender_closed.store(1);
}

bool CudaIpcTransport::StreamCheckDue() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_stream_check_) return false;
  next_stream_check_ = now + kWaitCheckEvery;
  return true;
}

void CudaIpcTransport::RemoveSend(IpcSendPair* p) {
  sends_.erase(std::remove(sends_.begin(), sends_.end(), p), sends_.end());
  // Launches naming it are never replayed again; kept (other members may still point at one)
  // until the transport goes.
  for (auto& [key, g] : shared_) retired_.push_back(std::move(g));
  shared_.clear();
  published_.clear();
  share_ = Share::kUnknown;  // a changed set of pairs publishes again
  for (auto it = merged_.begin(); it != merged_.end();) {
    if (std::find(it->first.begin(), it->first.end(), p) != it->first.end()) {
      retired_.push_back(std::move(it->second));
      it = merged_.erase(it);
    } else {
      ++it;
    }
  }
}

Result<std::pair<uint32_t, uint64_t>> CudaIpcTransport::FindLocal(const void* p,
                                                                  uint64_t bytes) const {
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

Result<XferId> CudaIpcTransport::PostSendImpl(int peer, uint64_t tag, const void* buf, size_t bytes,
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

Result<XferId> CudaIpcTransport::PostRecvImpl(int peer, uint64_t tag, void* buf, size_t bytes,
                                              bool device_buf) {
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

Result<std::shared_ptr<CudaIpcTransport::SharedEvent>> CudaIpcTransport::RecordShared() {
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

Result<XferId> CudaIpcTransport::NewEventXfer(int peer) {
  SS_ASSIGN_OR_RETURN(auto ev, RecordShared());
  Xfer x;
  x.kind = Xfer::kEvent;
  x.peer = peer;
  x.event = std::move(ev);
  const XferId id = next_id_++;
  xfers_.emplace(id, std::move(x));
  return id;
}

bool CudaIpcTransport::IsDevice(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}

Status CudaIpcTransport::CopyIn(const void* buf, size_t n, void* host, bool device_buf) {
  if (device_buf) {
    SS_CUDA(cudaMemcpy(host, buf, n, cudaMemcpyDeviceToHost), "cuda_ipc: control copy");
  } else {
    std::memcpy(host, buf, n);
  }
  return OkStatus();
}

Status CudaIpcTransport::CopyOut(const void* host, size_t n, void* buf, bool device_buf) {
  if (n == 0) return OkStatus();
  if (device_buf) {
    SS_RETURN_IF_ERROR(internal::UploadBlocking(buf, host, n, "cuda_ipc: control copy"));
  } else {
    std::memcpy(buf, host, n);
  }
  return OkStatus();
}

void CudaIpcTransport::Drain(int peer) {
  Mailbox& m = *inbox_[peer];
  uint64_t tag = 0, bytes = 0;
  while (m.Peek(&tag, &bytes)) {
    const unsigned char* d = m.PeekData();
    unexpected_[peer].emplace_back(tag, std::vector<unsigned char>(d, d + bytes));
    m.Pop();
  }
}

Status CudaIpcTransport::PeerAlive(int peer) {
  auto it = peer_pid_.find(peer);
  if (it == peer_pid_.end()) return OkStatus();
  if (!PidAlive(it->second)) return PeerGone(peer, "exited");
  return OkStatus();
}

Status CudaIpcTransport::PeerAliveSoon(int peer) {
  const auto now = std::chrono::steady_clock::now();
  auto& next = next_alive_check_[peer];
  if (now < next) return OkStatus();
  next = now + kWaitCheckEvery;
  return PeerAlive(peer);
}

}  // namespace shardsync::gpu::ipc
