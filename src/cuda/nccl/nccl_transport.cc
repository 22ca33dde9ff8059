#include "cuda/nccl/nccl_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "cuda/cuda_util.h"
#include "shardsync/settings.h"
#include "transport/process.h"

namespace shardsync::gpu {
namespace nccl {

using internal::CudaStatus;

namespace {

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

}  // namespace

NcclTransport::~NcclTransport() {
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

TransportCaps NcclTransport::caps() const {
  TransportCaps c;
  c.device_memory = true;
  c.host_memory = false;
  c.one_sided_put = false;
  c.two_sided = true;
  c.prepared = true;  // tag_matching stays false: NCCL matches by order per pair
  return c;
}

Result<uint32_t> NcclTransport::RegisterMemory(const MemRegion& region) {
  if (!comms_.empty()) return FailedPreconditionError("nccl: RegisterMemory after Connect");
  regions_.push_back(region);  // two-sided: nothing to exchange
  return static_cast<uint32_t>(regions_.size() - 1);
}

Status NcclTransport::Connect(StoreClient& store, const std::string& prefix, int rank,
                              const std::vector<int>& peers, Millis timeout) {
  SS_RETURN_IF_ERROR(LoadNccl());
  SS_RETURN_IF_ERROR(CheckHostIds());
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
      SS_RETURN_IF_ERROR(
          NcclStatus(Nccl().CommInitRankConfig(&c, 1, id, 0, &cfg), c, "nccl: self communicator"));
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
    SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommInitRankConfig(&c, 2, id, rank == lo ? 0 : 1, &cfg), c,
                                  "nccl: init with peer rank " + std::to_string(p)));
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

Result<XferState> NcclTransport::Poll(XferId id) {
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

Status NcclTransport::CheckPeer(int peer) const {
  auto it = peer_pid_.find(peer);
  if (it == peer_pid_.end() || ::shardsync::internal::ProcessAlive(it->second)) return OkStatus();
  return UnavailableError("nccl: peer rank " + std::to_string(peer) + " (pid " +
                          std::to_string(it->second) + ") exited");
}

void NcclTransport::AbortPeer(int peer) {
  auto it = comms_.find(peer);
  if (it == comms_.end()) return;
  if (Nccl().lib) Nccl().CommAbort(it->second);
  comms_.erase(it);
}

void NcclTransport::Abort() {
  if (aborted_) return;
  aborted_ = true;
  if (Nccl().lib) {
    for (auto& [p, c] : comms_) Nccl().CommAbort(c);
  }
  comms_.clear();
}

Status NcclTransport::CheckHostIds() {
  // The router placed this rank's pairs by SHARDSYNC_HOST_ID (transport.h HostIdentity); NCCL
  // places its peers by its own host hash, which NCCL_HOSTID replaces (NVIDIA/nccl
  // src/misc/utils.cc getHostHashOnce: the variable, else hostname + boot id; read once per
  // process). Two ranks on one GPU that NCCL sees on one host fail its init ("Duplicate GPU
  // detected"), so an emulated node must be NCCL's node too.
  SS_ASSIGN_OR_RETURN(const std::string ours, TextKnob("SHARDSYNC_HOST_ID"));
  if (ours.empty()) return OkStatus();
  SS_ASSIGN_OR_RETURN(const std::string theirs, TextKnob("NCCL_HOSTID"));
  if (theirs == ours) return OkStatus();
  return FailedPreconditionError(
      "nccl: SHARDSYNC_HOST_ID='" + ours +
      "' but NCCL_HOSTID=" + (theirs.empty() ? std::string("unset") : "'" + theirs + "'") +
      ": NCCL would not see the node shardsync routes by; set NCCL_HOSTID to the same value "
      "(`--emulate-nodes` sets both)");
}

Status NcclTransport::ExchangePids(StoreClient& store, const std::string& prefix,
                                   const std::vector<int>& peers,
                                   std::chrono::steady_clock::time_point deadline) {
  // The machine's hostname, not the host identity: a pid can be watched wherever it runs on this
  // machine, emulated nodes (SHARDSYNC_HOST_ID) included.
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

bool NcclTransport::IsHost(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged;
}

Status NcclTransport::Issue() {
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

Status NcclTransport::Progress(Group& g) {
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

void NcclTransport::Reap() {
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

}  // namespace nccl

Status NcclSetStream(Transport& t, void* stream, bool* matched) {
  auto* n = dynamic_cast<nccl::NcclTransport*>(&t);
  *matched = n != nullptr;
  if (n) n->SetStream(static_cast<cudaStream_t>(stream));
  return OkStatus();
}

std::unique_ptr<Transport> MakeNcclTransport(const NcclOptions& options) {
  return std::make_unique<nccl::NcclTransport>(options);
}

}  // namespace shardsync::gpu
