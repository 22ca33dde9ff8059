// nccl transport: two-sided GPU transfers through NCCL, loaded at run time.
//
// libnccl is dlopen-ed (SHARDSYNC_NCCL_LIB, else libnccl.so.2) so one build runs with whatever
// NCCL the user's PyTorch ships and builds without NCCL; nccl.h supplies the types only.
//
// Communicators: one 2-rank communicator per connected peer pair (unique id published by the
// lower rank through the store), not one over the sync world: NCCL refuses two ranks of one
// communicator on the same GPU ("Duplicate GPU"), and colocated layouts put trainer and engine
// ranks on the same GPUs, so CanConnect is false for a same-GPU pair (cuda_ipc serves those).
// Communicators are non-blocking (config.blocking = 0): init and every group are polled with
// ncclCommGetAsyncError, and Abort() calls ncclCommAbort, so a dead peer gives an error after the
// caller's timeout instead of a hang.
//
// Posting: PostSend / PostRecv queue operations; the next Poll or Flush issues everything queued
// as ONE ncclGroupStart/End (a bucket's sends and receives progress together). NCCL matches by
// order per pair, not by tag: both sides post a pair's messages in the same order (the plan's).
// Host buffers (control messages) bounce through device memory.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "common/trace.h"
#include "cuda/cuda_util.h"
#include "shardsync/gpu.h"
#include "transport/process.h"

namespace shardsync::gpu {

using internal::CudaStatus;

namespace {

struct NcclApi {
  void* lib = nullptr;
  std::string error;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;
};

const NcclApi& Nccl() {
  static NcclApi api = [] {
    NcclApi a;
    const char* env = std::getenv("SHARDSYNC_NCCL_LIB");
    const std::string path = env && *env ? env : "libnccl.so.2";
    a.lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!a.lib) {
      const char* e = dlerror();
      a.error = "cannot load NCCL '" + path + "' (set SHARDSYNC_NCCL_LIB): " + (e ? e : "?");
      return a;
    }
    bool ok = true;
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(a.lib, name));
      if (!fn) {
        ok = false;
        a.error += std::string(a.error.empty() ? "" : ", ") + "missing symbol " + name;
      }
    };
    load(a.GetVersion, "ncclGetVersion");
    load(a.GetUniqueId, "ncclGetUniqueId");
    load(a.CommInitRankConfig, "ncclCommInitRankConfig");
    load(a.CommGetAsyncError, "ncclCommGetAsyncError");
    load(a.CommAbort, "ncclCommAbort");
    load(a.Send, "ncclSend");
    load(a.Recv, "ncclRecv");
    load(a.GroupStart, "ncclGroupStart");
    load(a.GroupEnd, "ncclGroupEnd");
    load(a.GetErrorString, "ncclGetErrorString");
    load(a.GetLastError, "ncclGetLastError");
    if (!ok) {
      a.error = "NCCL '" + path + "': " + a.error;
      dlclose(a.lib);
      a.lib = nullptr;
    }
    return a;
  }();
  return api;
}

Status LoadNccl() {
  if (!Nccl().lib) return UnavailableError(Nccl().error);
  return OkStatus();
}

Status NcclStatus(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  if (r == ncclSuccess || r == ncclInProgress) return OkStatus();
  std::string msg = what + ": " + Nccl().GetErrorString(r);
  if (comm) {
    const char* last = Nccl().GetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  if (r == ncclRemoteError || r == ncclSystemError) return UnavailableError(msg);
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return InvalidArgumentError(msg);
  return InternalError(msg);
}

std::string Hex(const void* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<const unsigned char*>(p)[i];
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}
bool Unhex(const std::string& s, void* out, size_t n) {
  if (s.size() != 2 * n) return false;
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i < n; ++i) {
    static_cast<unsigned char*>(out)[i] =
        static_cast<unsigned char>(v(s[2 * i]) << 4 | v(s[2 * i + 1]));
  }
  return true;
}

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(const NcclOptions& o) : opt_(o) {}
  ~NcclTransport() override {
    cudaSetDevice(opt_.device);
    if (Nccl().lib) {
      for (auto& [p, c] : comms_) Nccl().CommAbort(c);  // quick teardown; work is complete
    }
    for (auto& g : groups_) {
      if (g.event) cudaEventDestroy(g.event);
      for (void* b : g.bounce) cudaFree(b);
    }
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "nccl"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.device_memory = true;
    c.host_memory = false;
    c.one_sided_put = false;
    c.two_sided = true;
    c.prepared = true;  // tag_matching stays false: NCCL matches by order per pair
    return c;
  }
  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return self.mem == MemKind::kCuda && peer.mem == MemKind::kCuda && !SameGpu(self, peer);
  }

  Result<uint32_t> RegisterMemory(const MemRegion& region) override {
    if (!comms_.empty()) return FailedPreconditionError("nccl: RegisterMemory after Connect");
    regions_.push_back(region);  // two-sided: nothing to exchange
    return static_cast<uint32_t>(regions_.size() - 1);
  }

  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override {
    SS_RETURN_IF_ERROR(LoadNccl());
    rank_ = rank;
    SS_CUDA(cudaSetDevice(opt_.device), "nccl: cudaSetDevice " + std::to_string(opt_.device));
    SS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "nccl: stream");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // Start every pair's init (non-blocking), then wait for all: a pair's init needs both sides.
    for (int p : peers) {
      if (p == rank) {  // a 1-rank communicator: send-to-self (exercises the path on one GPU)
        ncclUniqueId id{};
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().GetUniqueId(&id), nullptr, "nccl: ncclGetUniqueId"));
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 0;
        ncclComm_t c = nullptr;
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommInitRankConfig(&c, 1, id, 0, &cfg), c,
                                      "nccl: self communicator"));
        comms_[p] = c;
        peer_nccl_rank_[p] = 0;
        continue;
      }
      const int lo = std::min(rank, p), hi = std::max(rank, p);
      const std::string key = prefix + "nccl/id/" + std::to_string(lo) + "_" + std::to_string(hi);
      ncclUniqueId id{};
      if (rank == lo) {
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().GetUniqueId(&id), nullptr, "nccl: ncclGetUniqueId"));
        SS_RETURN_IF_ERROR(store.Set(key, Hex(&id, sizeof(id))));
      } else {
        const auto left =
            std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
        auto got = store.Get(key, std::max(Millis(1), left));
        if (!got.ok()) {
          return Status(got.status().code(), "nccl: rank " + std::to_string(rank) +
                                                 " waiting for the unique id of peer rank " +
                                                 std::to_string(p) + ": " + got.status().message());
        }
        if (!Unhex(*got, &id, sizeof(id))) {
          return DataLossError("nccl: malformed unique id from peer rank " + std::to_string(p));
        }
      }
      ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
      cfg.blocking = 0;
      ncclComm_t c = nullptr;
      SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommInitRankConfig(&c, 2, id, rank == lo ? 0 : 1, &cfg),
                                    c, "nccl: init with peer rank " + std::to_string(p)));
      comms_[p] = c;
      peer_nccl_rank_[p] = rank == lo ? 1 : 0;
    }
    SS_RETURN_IF_ERROR(ExchangePids(store, prefix, peers, deadline));
    for (auto& [p, c] : comms_) {
      while (true) {
        ncclResult_t st = ncclSuccess;
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommGetAsyncError(c, &st), c, "nccl: init state"));
        if (st == ncclSuccess) break;
        if (st != ncclInProgress) {
          return NcclStatus(st, c, "nccl: init with peer rank " + std::to_string(p));
        }
        if (std::chrono::steady_clock::now() > deadline) {
          Abort();
          return DeadlineExceededError("nccl: rank " + std::to_string(rank) +
                                       " communicator with peer rank " + std::to_string(p) +
                                       " not ready after " + std::to_string(timeout.count()) +
                                       " ms (peer dead or not connecting?)");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    return OkStatus();
  }

  Result<XferId> PostPut(int, const void*, size_t, uint32_t, uint64_t) override {
    return UnimplementedError(
        "nccl: no one-sided put (caps().one_sided_put is false); use Send/Recv");
  }

  Result<XferId> PostFlush(int peer) override {
    SS_RETURN_IF_ERROR(Usable(peer));
    return Queue({Op::kFlush, peer, nullptr, 0, nullptr});
  }
  Result<XferId> PostSend(int peer, uint64_t, const void* buf, size_t bytes) override {
    SS_RETURN_IF_ERROR(Usable(peer));
    return Queue({Op::kSend, peer, const_cast<void*>(buf), bytes, nullptr});
  }
  Result<XferId> PostRecv(int peer, uint64_t, void* buf, size_t bytes) override {
    SS_RETURN_IF_ERROR(Usable(peer));
    return Queue({Op::kRecv, peer, buf, bytes, nullptr});
  }

  Result<XferState> Poll(XferId id) override {
    if (aborted_) return AbortedError("nccl: transport aborted");
    if (!pending_.empty()) SS_RETURN_IF_ERROR(Issue());
    auto it = xfer_group_.find(id);
    if (it == xfer_group_.end()) {
      if (std::find(pending_ids_.begin(), pending_ids_.end(), id) != pending_ids_.end()) {
        return XferState::kInProgress;  // queued behind a group NCCL has not taken yet
      }
      return InvalidArgumentError("nccl: unknown xfer " + std::to_string(id));
    }
    Group& g = groups_[it->second - group_base_];
    if (!g.done) {
      SS_RETURN_IF_ERROR(Progress(g));
      if (!g.done) return XferState::kInProgress;
    }
    xfer_group_.erase(it);
    Reap();
    return XferState::kDone;
  }

  void SetStream(cudaStream_t s) { stream_override_ = s; }

  Result<std::unique_ptr<PreparedPair>> Prepare(StoreClient& store, const PairSpec& spec,
                                                Millis timeout) override;

  // For prepared pairs: the pair's communicator (one per peer) and the peer's rank in it.
  Result<std::pair<ncclComm_t, int>> PairComm(int peer) const {
    SS_RETURN_IF_ERROR(Usable(peer));
    return std::make_pair(comms_.at(peer), peer_nccl_rank_.at(peer));
  }
  int device() const { return opt_.device; }
  int depth() const { return opt_.depth; }
  // NCCL's P2P kernels wait for a dead peer forever and report nothing: peers on this host are
  // watched through their process instead, so survivors fail fast rather than at the timeout.
  Status CheckPeer(int peer) const {
    auto it = peer_pid_.find(peer);
    if (it == peer_pid_.end() || ::shardsync::internal::ProcessAlive(it->second)) return OkStatus();
    return UnavailableError("nccl: peer rank " + std::to_string(peer) + " (pid " +
                            std::to_string(it->second) + ") exited");
  }
  // A pair gave up on its peer: abort that communicator only (kernels waiting on the peer exit).
  void AbortPeer(int peer) {
    auto it = comms_.find(peer);
    if (it == comms_.end()) return;
    if (Nccl().lib) Nccl().CommAbort(it->second);
    comms_.erase(it);
  }

  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    if (Nccl().lib) {
      for (auto& [p, c] : comms_) Nccl().CommAbort(c);
    }
    comms_.clear();
  }

 private:
  struct Op {
    enum Kind { kSend, kRecv, kFlush } kind;
    int peer;
    void* buf;
    size_t bytes;
    void* host;  // host buffer of a bounced op
  };
  struct Group {
    std::vector<Op> ops;
    std::vector<ncclComm_t> comms;
    std::vector<void*> bounce;
    cudaEvent_t event = nullptr;
    bool enqueued = false;  // every comm left ncclInProgress and the event is recorded
    bool done = false;
    int live_ids = 0;
  };

  // Each rank publishes "hostname pid"; peers on this host are watched (CheckPeer).
  Status ExchangePids(StoreClient& store, const std::string& prefix, const std::vector<int>& peers,
                      std::chrono::steady_clock::time_point deadline) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const std::string me = std::string(host) + " " + std::to_string(getpid());
    SS_RETURN_IF_ERROR(store.Set(prefix + "nccl/pid/" + std::to_string(rank_), me));
    for (int p : peers) {
      if (p == rank_) continue;
      const auto left =
          std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
      auto got = store.Get(prefix + "nccl/pid/" + std::to_string(p), std::max(Millis(1), left));
      if (!got.ok()) continue;  // an old peer without the record: only the timeout watches it
      const size_t sp = got->rfind(' ');
      if (sp == std::string::npos || got->substr(0, sp) != host) continue;
      const long pid = std::strtol(got->c_str() + sp + 1, nullptr, 10);
      if (pid > 0) peer_pid_[p] = static_cast<pid_t>(pid);
    }
    return OkStatus();
  }

  Status Usable(int peer) const {
    if (aborted_) return AbortedError("nccl: transport aborted");
    if (!comms_.count(peer)) {
      return InvalidArgumentError("nccl: rank " + std::to_string(peer) +
                                  " is not a connected peer of rank " + std::to_string(rank_));
    }
    return OkStatus();
  }

  Result<XferId> Queue(Op op) {
    const XferId id = next_id_++;
    pending_.push_back(op);
    pending_ids_.push_back(id);
    return id;
  }

  static bool IsHost(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return true;
    }
    return a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged;
  }

  cudaStream_t S() const { return stream_override_ ? stream_override_ : stream_; }

  Status Issue() {
    // NCCL refuses any call on a non-blocking communicator whose previous call is still
    // ncclInProgress ("Attempt to use communicator before the previous operation returned
    // ncclSuccess", seen on 2 H200s with 512 MiB buckets): the queued operations wait until every
    // earlier group left that state (their ids report kInProgress meanwhile).
    for (Group& prev : groups_) {
      if (prev.enqueued) continue;
      SS_RETURN_IF_ERROR(Progress(prev));
      if (!prev.enqueued) return OkStatus();
    }
    SS_CUDA(cudaSetDevice(opt_.device), "nccl: cudaSetDevice");
    Group g;
    g.ops = std::move(pending_);
    pending_.clear();
    // Bounce host buffers through device memory.
    for (Op& op : g.ops) {
      if (op.kind == Op::kFlush || op.bytes == 0 || !IsHost(op.buf)) continue;
      void* d = nullptr;
      SS_CUDA(cudaMalloc(&d, op.bytes), "nccl: bounce buffer");
      g.bounce.push_back(d);
      if (op.kind == Op::kSend) {
        SS_CUDA(cudaMemcpyAsync(d, op.buf, op.bytes, cudaMemcpyHostToDevice, S()),
                "nccl: bounce copy");
      }
      op.host = op.buf;
      op.buf = d;
    }
    SS_RETURN_IF_ERROR(NcclStatus(Nccl().GroupStart(), nullptr, "nccl: group start"));
    for (const Op& op : g.ops) {
      if (op.kind == Op::kFlush || op.bytes == 0) continue;
      ncclComm_t c = comms_[op.peer];
      const std::string what = std::string(op.kind == Op::kSend ? "send to" : "recv from") +
                               " rank " + std::to_string(op.peer);
      const ncclResult_t r =
          op.kind == Op::kSend
              ? Nccl().Send(op.buf, op.bytes, ncclUint8, peer_nccl_rank_[op.peer], c, S())
              : Nccl().Recv(op.buf, op.bytes, ncclUint8, peer_nccl_rank_[op.peer], c, S());
      if (r != ncclSuccess && r != ncclInProgress) {
        Nccl().GroupEnd();
        return NcclStatus(r, c, "nccl: " + what);
      }
      if (std::find(g.comms.begin(), g.comms.end(), c) == g.comms.end()) g.comms.push_back(c);
    }
    SS_RETURN_IF_ERROR(NcclStatus(Nccl().GroupEnd(), nullptr, "nccl: group end"));
    const size_t index = group_base_ + groups_.size();
    for (XferId id : pending_ids_) xfer_group_[id] = index;
    g.live_ids = static_cast<int>(pending_ids_.size());
    pending_ids_.clear();
    groups_.push_back(std::move(g));
    return Progress(groups_.back());
  }

  Status Progress(Group& g) {
    if (!g.enqueued) {
      for (ncclComm_t c : g.comms) {
        ncclResult_t st = ncclSuccess;
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommGetAsyncError(c, &st), c, "nccl: state"));
        if (st == ncclInProgress) return OkStatus();
        SS_RETURN_IF_ERROR(NcclStatus(st, c, "nccl: group"));
      }
      for (const Op& op : g.ops) {
        if (op.host && op.kind == Op::kRecv) {
          SS_CUDA(cudaMemcpyAsync(op.host, op.buf, op.bytes, cudaMemcpyDeviceToHost, S()),
                  "nccl: bounce copy back");
        }
      }
      SS_CUDA(cudaEventCreateWithFlags(&g.event, cudaEventDisableTiming), "nccl: event");
      SS_CUDA(cudaEventRecord(g.event, S()), "nccl: event record");
      g.enqueued = true;
    }
    const cudaError_t e = cudaEventQuery(g.event);
    if (e == cudaErrorNotReady) {
      for (const Op& op : g.ops) SS_RETURN_IF_ERROR(CheckPeer(op.peer));
      // A failed peer surfaces as an async error on the communicator.
      for (ncclComm_t c : g.comms) {
        ncclResult_t st = ncclSuccess;
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommGetAsyncError(c, &st), c, "nccl: state"));
        SS_RETURN_IF_ERROR(NcclStatus(st, c, "nccl: transfer"));
      }
      return OkStatus();
    }
    SS_CUDA(e, "nccl: transfer");
    g.done = true;
    return OkStatus();
  }

  void Reap() {
    // Groups complete in stream order; free leading groups no id refers to.
    std::map<size_t, int> refs;
    for (auto& [id, gi] : xfer_group_) refs[gi]++;
    while (!groups_.empty() && groups_.front().done && !refs.count(group_base_)) {
      Group& g = groups_.front();
      if (g.event) cudaEventDestroy(g.event);
      for (void* b : g.bounce) cudaFree(b);
      groups_.erase(groups_.begin());
      ++group_base_;
    }
  }

  NcclOptions opt_;
  int rank_ = -1;
  bool aborted_ = false;
  cudaStream_t stream_ = nullptr;
  cudaStream_t stream_override_ = nullptr;
  std::vector<MemRegion> regions_;
  std::map<int, ncclComm_t> comms_;
  std::map<int, int> peer_nccl_rank_;
  std::map<int, pid_t> peer_pid_;
  std::vector<Op> pending_;
  std::vector<XferId> pending_ids_;
  std::vector<Group> groups_;
  size_t group_base_ = 0;
  std::map<XferId, size_t> xfer_group_;
  XferId next_id_ = 1;
};

// ---- prepared pairs ----
//
// Every round (a plan bucket) is enqueued on streams with device-side ordering only: the sender
// packs round b into slot b % depth on its pack stream once the send of round b - depth left that
// slot (event), and sends it on its comm stream once packed (event); the receiver receives round b
// into slot b % depth once the unpack of round b - depth drained it, and unpacks it (cast +
// checksum) into its parameters on its unpack stream. The host only enqueues (a non-blocking
// communicator takes one call at a time: each waits until the previous left ncclInProgress) and
// polls one event at the end. Checksums: the sender's pack and the receiver's unpack kernels sum
// the wire image of each round.

class NcclPair final : public PreparedPair {
 public:
  NcclPair(NcclTransport& t, const PairSpec& spec, ncclComm_t comm, int peer_rank)
      : t_(t), peer_(spec.peer), send_(spec.send), comm_(comm), peer_rank_(peer_rank) {
    for (const PairBucket& b : spec.buckets) bytes_.push_back(b.bytes);
  }
  ~NcclPair() override {
    cudaSetDevice(t_.device());
    for (auto* v : {&ev_a_, &ev_b_}) {
      for (cudaEvent_t e : *v) cudaEventDestroy(e);
    }
    if (done_) cudaEventDestroy(done_);
    for (cudaStream_t st : {work_, comm_stream_}) {
      if (st) cudaStreamDestroy(st);
    }
  }

  Status Init(const PairSpec& spec) {
    const int dev = t_.device();
    SS_CUDA(cudaSetDevice(dev), "nccl pair: cudaSetDevice");
    SS_CUDA(cudaStreamCreateWithFlags(&work_, cudaStreamNonBlocking), "nccl pair: stream");
    SS_CUDA(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking), "nccl pair: stream");
    SS_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "nccl pair: event");
    const size_t nb = bytes_.size();
    const int64_t cap = *std::max_element(bytes_.begin(), bytes_.end());
    const size_t slots = std::min<size_t>(nb, static_cast<size_t>(std::max(1, t_.depth())));
    for (size_t k = 0; k < slots; ++k) {
      SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(static_cast<size_t>(cap), dev));
      slots_.push_back(std::move(buf));
    }
    const int ws = DTypeSize(spec.wire);
    for (size_t b = 0; b < nb; ++b) {
      cudaEvent_t a = nullptr, c = nullptr;
      SS_CUDA(cudaEventCreateWithFlags(&a, cudaEventDisableTiming), "nccl pair: event");
      ev_a_.push_back(a);
      SS_CUDA(cudaEventCreateWithFlags(&c, cudaEventDisableTiming), "nccl pair: event");
      ev_b_.push_back(c);
      auto* slot = static_cast<unsigned char*>(slots_[b % slots]->data());
      BatchSpec bs;
      bs.mode = send_ ? BatchMode::kPack : BatchMode::kUnpack;
      bs.bucket_bytes = {bytes_[b]};
      const auto& local = spec.buckets[b].local;
      const DType td = local.empty() ? spec.wire : local[0].dtype;
      bs.in_dtype = send_ ? td : spec.wire;
      bs.out_dtype = send_ ? spec.wire : td;
      for (size_t i = 0; i < local.size(); ++i) {
        const PackRegion& r = local[i];
        if (r.dtype != td || !RegionInside(r.region, r.shape)) {
          return InvalidArgumentError("nccl pair with rank " + std::to_string(peer_) + ": bucket " +
                                      std::to_string(b) + " region " + std::to_string(i) +
                                      " mixes dtypes or leaves its tensor");
        }
        const size_t first = bs.runs.size();
        AppendRegionRuns(r.region, r.shape, r.base, DTypeSize(td), slot + r.wire_offset, ws, ws, 0,
                         r.wire_offset, &bs.runs);
        if (!send_) {  // unpack: the wire image is the input
          for (size_t k = first; k < bs.runs.size(); ++k) {
            CopyRun& c2 = bs.runs[k];
            const void* tensor = c2.in;
            c2.in = c2.out;
            c2.out = const_cast<void*>(tensor);
            std::swap(c2.in_stride, c2.out_stride);
          }
        }
      }
      SS_ASSIGN_OR_RETURN(auto batch, CopyBatch::Prepare(bs, dev));
      batches_.push_back(std::move(batch));
    }
    return OkStatus();
  }

  Status Post(uint64_t) override {
    if (cancelled_) {
      return AbortedError("nccl: pair with rank " + std::to_string(peer_) + " was cancelled");
    }
    SS_CUDA(cudaSetDevice(t_.device()), "nccl pair: cudaSetDevice");
    next_ = 0;
    call_pending_ = false;
    recorded_done_ = false;
    posted_ = true;
    return Pump();
  }

  Result<XferState> Poll() override {
    if (!posted_) return XferState::kDone;
    SS_RETURN_IF_ERROR(Pump());
    if (next_ < bytes_.size()) {  // the peer cannot have finished: its exit is a death
      SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
      return XferState::kInProgress;
    }
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) {
      SS_RETURN_IF_ERROR(CommState().status());  // a failed remote peer surfaces here
      SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
      return XferState::kInProgress;
    }
    SS_CUDA(e, "nccl: pair with rank " + std::to_string(peer_));
    posted_ = false;
    trace::Line("nccl pair %s rank %d: done", send_ ? "->" : "<-", peer_);
    return XferState::kDone;
  }

  Result<PairSums> Sums() override {
    PairSums s;
    for (auto& b : batches_) {
      SS_ASSIGN_OR_RETURN(auto c, b->Checksums());
      (send_ ? s.packed : s.landed).push_back(c[0]);
    }
    return s;
  }

  void Cancel() override {
    if (!posted_) return;
    cancelled_ = true;
    posted_ = false;
    t_.AbortPeer(peer_);
  }

  std::string Describe() const override {
    return std::string("nccl: ") + (send_ ? "send to" : "recv from") + " rank " +
           std::to_string(peer_) + ", " + std::to_string(bytes_.size()) + " rounds, " +
           std::to_string(slots_.size()) + " in flight";
  }

 private:
  // kInProgress while the communicator still takes the previous call.
  Result<ncclResult_t> CommState() const {
    ncclResult_t st = ncclSuccess;
    SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommGetAsyncError(comm_, &st), comm_, "nccl: state"));
    SS_RETURN_IF_ERROR(NcclStatus(st, comm_, "nccl: pair with rank " + std::to_string(peer_)));
    return st;
  }

  // Enqueues as many rounds as the communicator takes now.
  Status Pump() {
    const size_t nb = bytes_.size(), d = slots_.size();
    while (next_ < nb) {
      SS_ASSIGN_OR_RETURN(ncclResult_t st, CommState());
      if (st == ncclInProgress) return OkStatus();
      const size_t b = next_;
      void* slot = slots_[b % d]->data();
      if (call_pending_) {  // round b's NCCL call is enqueued: the rest of the round follows it
        call_pending_ = false;
        SS_CUDA(cudaEventRecord(ev_b_[b], comm_stream_), "nccl pair: event");
        if (!send_) {
          SS_CUDA(cudaStreamWaitEvent(work_, ev_b_[b], 0), "nccl pair: unpack waits recv");
          SS_RETURN_IF_ERROR(batches_[b]->Launch(work_));
          SS_CUDA(cudaEventRecord(ev_a_[b], work_), "nccl pair: event");
        }
        trace::Line("nccl pair %s rank %d: round %zu enqueued", send_ ? "->" : "<-", peer_, b);
        ++next_;
        continue;
      }
      if (send_) {
        // ev_a: packed, ev_b: sent (the slot is free again).
        if (b >= d) SS_CUDA(cudaStreamWaitEvent(work_, ev_b_[b - d], 0), "nccl pair: slot wait");
        SS_RETURN_IF_ERROR(batches_[b]->Launch(work_));
        SS_CUDA(cudaEventRecord(ev_a_[b], work_), "nccl pair: event");
        SS_CUDA(cudaStreamWaitEvent(comm_stream_, ev_a_[b], 0), "nccl pair: send waits pack");
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().Send(slot, static_cast<size_t>(bytes_[b]), ncclUint8,
                                                  peer_rank_, comm_, comm_stream_),
                                      comm_, "nccl: send to rank " + std::to_string(peer_)));
      } else {
        // ev_b: received, ev_a: unpacked (the slot is free again).
        if (b >= d) {
          SS_CUDA(cudaStreamWaitEvent(comm_stream_, ev_a_[b - d], 0), "nccl pair: slot wait");
        }
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().Recv(slot, static_cast<size_t>(bytes_[b]), ncclUint8,
                                                  peer_rank_, comm_, comm_stream_),
                                      comm_, "nccl: recv from rank " + std::to_string(peer_)));
      }
      call_pending_ = true;
    }
    if (next_ == nb && !call_pending_ && !recorded_done_) {
      SS_CUDA(cudaEventRecord(done_, send_ ? comm_stream_ : work_), "nccl pair: event");
      recorded_done_ = true;
    }
    return OkStatus();
  }

  NcclTransport& t_;
  int peer_;
  bool send_;
  ncclComm_t comm_;
  int peer_rank_;
  std::vector<int64_t> bytes_;
  std::vector<std::unique_ptr<DeviceBuffer>> slots_;
  std::vector<std::unique_ptr<CopyBatch>> batches_;
  std::vector<cudaEvent_t> ev_a_, ev_b_;
  cudaEvent_t done_ = nullptr;
  cudaStream_t work_ = nullptr, comm_stream_ = nullptr;
  size_t next_ = 0;
  bool call_pending_ = false, posted_ = false, cancelled_ = false, recorded_done_ = false;
};

Result<std::unique_ptr<PreparedPair>> NcclTransport::Prepare(StoreClient&, const PairSpec& spec,
                                                             Millis) {
  if (spec.buckets.empty()) {
    return InvalidArgumentError("nccl: pair with rank " + std::to_string(spec.peer) +
                                " has no buckets");
  }
  SS_ASSIGN_OR_RETURN(auto comm, PairComm(spec.peer));
  auto pair = std::make_unique<NcclPair>(*this, spec, comm.first, comm.second);
  SS_RETURN_IF_ERROR(pair->Init(spec));
  return std::unique_ptr<PreparedPair>(std::move(pair));
}

}  // namespace

Status NcclSetStream(Transport& t, void* stream, bool* matched) {
  auto* n = dynamic_cast<NcclTransport*>(&t);
  *matched = n != nullptr;
  if (n) n->SetStream(static_cast<cudaStream_t>(stream));
  return OkStatus();
}

std::unique_ptr<Transport> MakeNcclTransport(const NcclOptions& options) {
  return std::make_unique<NcclTransport>(options);
}

Result<int> NcclVersion() {
  SS_RETURN_IF_ERROR(LoadNccl());
  int v = 0;
  SS_RETURN_IF_ERROR(NcclStatus(Nccl().GetVersion(&v), nullptr, "ncclGetVersion"));
  return v;
}

}  // namespace shardsync::gpu
