// nccl transport: two-sided GPU transfers through NCCL, loaded at run time.
//
// The loader: nccl_api.h. Prepared pairs: nccl_pairs.cc.
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
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/nccl/nccl_api.h"
#include "shardsync/gpu.h"

namespace shardsync::gpu::nccl {

class NcclTransport;
// A pair under the delta encoding (PairSpec::delta; delta_nccl.cc): either side.
Result<std::unique_ptr<PreparedPair>> PrepareDeltaPair(NcclTransport& t, const PairSpec& spec);

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(const NcclOptions& o) : opt_(o) {}
  ~NcclTransport() override;

  std::string_view name() const override { return "nccl"; }
  TransportCaps caps() const override;
  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return self.mem == MemKind::kCuda && peer.mem == MemKind::kCuda && !SameGpu(self, peer);
  }

  Result<uint32_t> RegisterMemory(const MemRegion& region) override;

  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override;

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

  Result<XferState> Poll(XferId id) override;

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
  Status CheckPeer(int peer) const;
  // A pair gave up on its peer: abort that communicator only (kernels waiting on the peer exit).
  void AbortPeer(int peer);

  void Abort() override;

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

  // FailedPrecondition when SHARDSYNC_HOST_ID is set and NCCL_HOSTID differs from it.
  static Status CheckHostIds();
  // Each rank publishes "hostname pid"; peers on this machine are watched (CheckPeer).
  Status ExchangePids(StoreClient& store, const std::string& prefix, const std::vector<int>& peers,
                      std::chrono::steady_clock::time_point deadline);

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

  static bool IsHost(const void* p);

  cudaStream_t S() const { return stream_override_ ? stream_override_ : stream_; }

  Status Issue();

  Status Progress(Group& g);

  void Reap();

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

}  // namespace shardsync::gpu::nccl
