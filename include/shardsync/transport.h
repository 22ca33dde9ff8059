// Transport interface: moves bytes between ranks. Implementations: ucx (host memory: shm, cma,
// tcp, RDMA verbs), loopback (in-process, tests), fault (fault-injecting decorator, tests),
// cuda_ipc (same-node GPUs) and nccl (GPUs, any node).
//
// Life cycle: RegisterMemory (once per buffer, before Connect) -> Connect (exchanges addresses and
// memory keys with peers through the store; collective over the listed peers) -> repeated
// Post* / Poll per sync -> destruction. Post* never blocks; Poll drives progress and never blocks
// longer than a progress step. Completion of a Put at the target is only guaranteed after a
// later Flush to that peer completes. Threading: one thread drives a transport at a time.
// Failure: a transport whose peer died returns Unavailable from Poll; Abort cancels every
// outstanding transfer and makes further calls fail fast.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/status.h"
#include "shardsync/store.h"

namespace shardsync {

enum class MemKind { kHost, kCuda };

struct MemRegion {
  void* base = nullptr;
  size_t bytes = 0;
  MemKind kind = MemKind::kHost;
  int device = -1;  // CUDA device index for kCuda
};

struct TransportCaps {
  bool host_memory = false;
  bool device_memory = false;
  bool one_sided_put = false;  // Put into remote registered memory
  bool two_sided = false;      // Send / Recv
  bool same_node_only = false;
};

// Identity a rank advertises so peers can pick a transport (canConnect).
struct PeerInfo {
  int rank = 0;
  std::string hostname;
  MemKind mem = MemKind::kHost;
  int device = -1;
};

enum class XferState { kInProgress, kDone };
using XferId = uint64_t;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string_view name() const = 0;
  virtual TransportCaps caps() const = 0;
  virtual bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const = 0;

  // Registers local memory peers may Put into. Returns a region id (dense, from 0) that peers
  // name in Put. Must precede Connect.
  virtual Result<uint32_t> RegisterMemory(const MemRegion& region) = 0;
  // Exchanges worker addresses and memory keys with `peers` through the store under `prefix`.
  virtual Status Connect(StoreClient& store, const std::string& prefix, int rank,
                         const std::vector<int>& peers, Millis timeout) = 0;

  // One-sided write of [src, src+bytes) into peer's region `remote_region` at `remote_offset`.
  virtual Result<XferId> PostPut(int peer, const void* src, size_t bytes, uint32_t remote_region,
                                 uint64_t remote_offset) = 0;
  // Completes when every Put issued so far to peer is visible in the peer's memory.
  virtual Result<XferId> PostFlush(int peer) = 0;
  // Two-sided messages (control messages, and data where puts are unavailable or slow).
  virtual Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) = 0;
  virtual Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) = 0;
  // kDone once complete (the id is then released); Unavailable / Internal on failure.
  virtual Result<XferState> Poll(XferId id) = 0;
  // Cancels everything outstanding; later calls fail with Aborted.
  virtual void Abort() = 0;
};

// Waits for `id` with a deadline (DeadlineExceeded naming `what`).
Status WaitXfer(Transport& t, XferId id, Millis timeout, std::string_view what);

}  // namespace shardsync
