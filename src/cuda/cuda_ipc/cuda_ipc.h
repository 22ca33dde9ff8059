// cuda_ipc transport internals, shared by its files: the transport (cuda_ipc_transport.cc:
// exports, puts, control messages through the shared-memory mailboxes), its send pairs' merged
// launch (cuda_ipc_launch.cc) and its prepared pairs (cuda_ipc_pairs.cc).
//
// Export: at Connect every rank publishes, for each registered region, the IPC handle of the
// allocation holding it (cudaIpcGetMemHandle of the base cuMemGetAddressRange returns) plus the
// region's offset in it. Import: a sender opens a peer's allocation on first use
// (cudaIpcOpenMemHandle, peer access enabled lazily for other GPUs) and caches the mapping for the
// transport's life, so later syncs pay nothing. Puts are cudaMemcpyAsync on the transport's stream
// (or the caller's, see CudaIpcSetStream) and complete through CUDA events; a Flush is an event
// after every earlier put. Control messages (Send/Recv) go through a shared-memory mailbox per
// direction (shm_mailbox.h); a peer that exits or aborts is seen there (closed flag, pid gone).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/trace.h"
#include "cuda/cuda_ipc/shm_mailbox.h"
#include "cuda/cuda_util.h"
#include "cuda/gpu_launch_board.h"
#include "cuda/gpu_turnstile.h"
#include "shardsync/gpu.h"

namespace shardsync::gpu::ipc {

using internal::Mailbox;

inline constexpr uint32_t kExportMagic = 0x53534950;  // "SSIP"

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

// SHARDSYNC_TRACE=1 (common/trace.h): launches and their completion on stderr.
inline void TraceLaunch(const char* what, size_t buckets) {
  trace::Line("cuda_ipc: %s (%zu buckets)", what, buckets);
}

class IpcSendPair;
class CudaIpcTransport;

// A pair under the delta encoding (PairSpec::delta; delta_ipc.cc): either side.
Result<std::unique_ptr<PreparedPair>> PrepareDeltaPair(CudaIpcTransport& t, StoreClient& store,
                                                       const PairSpec& spec, Millis timeout);

// Image pairs' encoded ops, by the codec of their encoding (block FP8: fp8_ipc.cc). Receiver:
// its own map of every encoded op of `spec`, as a store value. Sender: those ops as EncodedTasks
// of `bs` (mapped through the
// receiver's map `blob`), and each bucket's compact copy image size (BatchSpec::copy_bytes).
Result<std::string> EncodedLandedMap(const CudaIpcTransport& t, const PairSpec& spec);
Status AddEncodedTasks(CudaIpcTransport& t, const PairSpec& spec, const std::string& blob,
                       BatchSpec* bs);

// The send pairs' batches as one: buckets renumbered after each other's, in member order, landed
// sums to `lsum` (8 bytes per bucket; none when null). Nullopt when they do not share one
// kernel (dtypes).
std::optional<BatchSpec> MergeSpecs(const std::vector<IpcSendPair*>& members, void* lsum);
// `from` with every run's bucket moved up by `base`, appended to `to` (batches merged into one).
void AppendRenumbered(const std::vector<CopyRun>& from, int32_t base, std::vector<CopyRun>* to);

// One launch over several send pairs' buckets: the batch, the landed sums of all of them in one
// device buffer (the kernel hands them over with its signal), and the event behind it. A shared
// launch (gpu_launch_board.h) also packs other senders' batches: their buckets follow this
// rank's, each claimed sender's from `first`; in one kernel (`batch`), or (split mode, an
// experiment) one kernel per sender back to back on this rank's stream, `before` then `batch`.
struct MergedLaunch {
  struct Remote {
    internal::GpuLaunchBoard::Peer peer;
    size_t first = 0;
  };
  int device = 0;
  std::vector<Remote> remote;
  uint64_t version = 0;              // of the shared launch in flight
  std::unique_ptr<CopyBatch> batch;  // null: the pairs share no kernel (one launch each)
  // Split mode: batches launched before `batch`, each with the buckets from its `first`.
  std::vector<std::pair<std::unique_ptr<CopyBatch>, size_t>> before;
  std::unique_ptr<DeviceBuffer> lsum;
  // After the kernel: how a fault shows (a faulted kernel never signals).
  cudaEvent_t done = nullptr;
  // SHARDSYNC_TRACE only: timing events around the launch (GPU time in the trace).
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  std::string what;  // for the trace: whose batches, how many chunks
  uint64_t seq = 0;  // of the last signaled launch
  size_t buckets = 0;
  ~MergedLaunch() {
    cudaSetDevice(device);
    for (cudaEvent_t e : {done, t0, t1}) {
      if (e) cudaEventDestroy(e);
    }
  }
  // The launch's finished and raw landed sums over all its buckets, and non-finite counts.
  Status Sums(std::vector<uint64_t>* packed, std::vector<uint64_t>* landed,
              std::vector<int64_t>* nonfinite) const;
};

class CudaIpcTransport final : public Transport {
 public:
  explicit CudaIpcTransport(int device) : device_(device) {}
  ~CudaIpcTransport() override;

  std::string_view name() const override { return "cuda_ipc"; }
  TransportCaps caps() const override;
  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return self.hostname == peer.hostname && self.mem == MemKind::kCuda &&
           peer.mem == MemKind::kCuda;
  }

  Result<uint32_t> RegisterMemory(const MemRegion& region) override;

  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override;

  Result<void*> RemotePointer(int peer, uint32_t region, uint64_t offset, uint64_t bytes);

  Result<XferId> PostPut(int peer, const void* src, size_t bytes, uint32_t remote_region,
                         uint64_t remote_offset) override;

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

  Result<XferState> Poll(XferId id) override;

  void Abort() override;

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
  bool StreamCheckDue();
  // Send pairs launch together (see IpcSendPair): every live send pair registers here.
  void AddSend(IpcSendPair* p) { sends_.push_back(p); }
  void RemoveSend(IpcSendPair* p);
  // A send pair was posted: once every live send pair is, they launch as one.
  Status SendPosted();
  // Launches every posted send pair that has not launched yet, as one kernel, once each one's
  // receiver is ready (else later: the pairs' Polls call it again).
  Status LaunchPostedSends();
  // `group`'s launch completed: every pair still waiting on it tells its receiver. Returns
  // `self`'s error; another pair's resurfaces at its own Poll (so it names the right peer).
  Status FinishLaunch(const MergedLaunch* group, IpcSendPair* self);
  // The GPU's turn (gpu_turnstile.h): opened with the first send pair; a launch completed (the
  // turn goes back with the last one in flight); a failed or cancelled sync gives it back.
  void OpenTurnstile();
  void LaunchStarted() { ++launches_; }
  // This rank's pairs launched by another sender (gpu_launch_board.h): whether their sums are
  // in; if so every such pair has been told (Finished), and `self`'s error is returned.
  Result<bool> PollRemote(IpcSendPair* self);
  const MergedLaunch* remote_marker() const { return &remote_marker_; }
  // The launch of `group` failed or was abandoned: the senders it packed for learn it.
  void FailShared(const MergedLaunch* group);
  void LaunchCompleted();
  void DropTurn();
  // For a pair's Describe: whose turn a launch is waiting for ("" when none).
  std::string TurnNote() const;
  // Maps an allocation another process exported (`handle`: its cudaIpcMemHandle_t; `pid`, `base`:
  // its owner and the owner's address), cached for the transport's life; `base` itself when the
  // owner is this process (in-process ranks).
  Result<void*> OpenShared(const void* handle, int pid, uint64_t base);
  // The registered region holding [p, p + bytes) and p's offset in it.
  Result<std::pair<uint32_t, uint64_t>> FindLocal(const void* p, uint64_t bytes) const;

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
                              bool device_buf);

  Result<XferId> PostRecvImpl(int peer, uint64_t tag, void* buf, size_t bytes, bool device_buf);
  // Connect's steps: this rank's export records (one per registered region) as a store value;
  // peer `p`'s exports and the outbox to it (`shm`: the mailbox name prefix of this job).
  std::string ExportRegions() const;
  Status OpenPeer(StoreClient& store, const std::string& base, int p, Millis timeout);

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
  Result<std::shared_ptr<SharedEvent>> RecordShared();

  Result<XferId> NewEventXfer(int peer);

  // Control buffers may live in host or device memory.
  static bool IsDevice(const void* p);
  static Status CopyIn(const void* buf, size_t n, void* host, bool device_buf);
  static Status CopyOut(const void* host, size_t n, void* buf, bool device_buf);

  void Drain(int peer);

  Status PeerGone(int peer, const std::string& why) {
    return UnavailableError("cuda_ipc: peer rank " + std::to_string(peer) + " (pid " +
                            std::to_string(peer_pid_[peer]) + ") " + why);
  }
  Status PeerAlive(int peer);
  // Whether the posted sends may launch now: this rank has the GPU's turn, or goes without one.
  bool MayLaunch();
  Status LaunchMembers(const std::vector<IpcSendPair*>& members,
                       const std::vector<internal::GpuLaunchBoard::Peer>& peers, uint64_t version);
  // Shared launches (cuda_ipc_share.cc): this rank's batch published on the board (once; false
  // when it cannot be shared), the launch of its pairs by another sender adopted, and the
  // peers' batches decoded into this process's pointers.
  bool Shareable(const std::vector<IpcSendPair*>& members);
  Status AdoptRemote(const std::vector<IpcSendPair*>& members, uint64_t version);
  Result<const BatchSpec*> PeerBatch(const internal::GpuLaunchBoard::Peer& p, const BatchSpec& own);
  Result<std::unique_ptr<BatchSpec>> DecodePeerBatch(const internal::GpuLaunchBoard::Peer& p,
                                                     const BatchSpec& own);
  Result<MergedLaunch*> SharedGroup(const std::vector<IpcSendPair*>& members,
                                    const std::vector<internal::GpuLaunchBoard::Peer>& peers);
  // PeerAlive for waits that poll in a tight loop: the syscall at most every kWaitCheckEvery per
  // peer (it took a visible share of each poll, and so of the time to notice a completion), so a
  // dead peer still fails the wait within a millisecond. A send checks exactly (PeerAlive).
  Status PeerAliveSoon(int peer);
  static constexpr std::chrono::milliseconds kWaitCheckEvery{1};
  // Shared launches: whether this rank launches now (the GPU's launcher, or a sender the
  // launcher did not claim in time); false while it waits to be claimed or was (adopted).
  Result<bool> ShareStep(const std::vector<IpcSendPair*>& members, uint64_t version);
  // Takes this rank's post for `version` off the board before it launches for itself: false when
  // a launcher claimed it first (then it waits for that launch).
  void StopSharing(const Status& why);
  bool WithdrawPost(uint64_t version);
  // Launch timing for the trace (SHARDSYNC_TRACE): events around a group's kernels.
  void TraceStart(MergedLaunch& g);
  void TraceEnd(const MergedLaunch& g);
  // How long the GPU's launcher waits for the other senders of its GPU to be ready, to pack for
  // them in its launch (they arrive within tens of microseconds of each other in a sync).
  static constexpr std::chrono::microseconds kGatherWait{2000};
  // How long a sender waits for the launcher to claim it before it launches for itself (the
  // launcher's receivers may enter the sync much later than this rank's).
  static constexpr std::chrono::milliseconds kClaimWait{20};

  int device_;
  int rank_ = -1;
  std::string prefix_;  // Connect's: names this job's shared-memory records
  std::unique_ptr<internal::GpuTurnstile> turn_;
  std::unique_ptr<internal::GpuLaunchBoard> board_;  // null: no shared launches
  enum class Share { kUnknown, kYes, kNo } share_ = Share::kUnknown;
  int share_mode_ = 0;  // SHARDSYNC_GPU_SHARED_LAUNCH: 0 off, 1 one kernel, 2 split (experiment)
  std::vector<IpcSendPair*> published_;  // the pairs whose batch is on the board, in order
  uint64_t posted_ready_ = 0;            // version posted on the board
  // The sync a ShareStep is in: when it started, the launcher's slot (re-checked every
  // kWaitCheckEvery), whether this rank's post was claimed while it tried to withdraw it.
  uint64_t share_version_ = 0;
  std::chrono::steady_clock::time_point share_start_, next_leader_check_;
  int leader_ = -1;
  bool claim_taken_ = false;
  uint64_t gather_version_ = 0;  // the launcher waits briefly for the other senders
  std::chrono::steady_clock::time_point gather_start_;
  MergedLaunch remote_marker_;  // the group of pairs another sender launched
  uint64_t remote_version_ = 0;
  int remote_rank_ = -1, remote_pid_ = 0;  // that sender
  const MergedLaunch* inflight_shared_ = nullptr;
  // This process's allocations and mappings by base: how a peer opens them (IPC handle, the
  // owner's pid and base) and their size.
  struct AllocInfo {
    cudaIpcMemHandle_t handle{};
    int pid = 0;
    uint64_t base = 0;
    uint64_t bytes = 0;
  };
  std::map<uint64_t, AllocInfo> allocs_;
  // Peers' batches decoded (null: unusable), by (slot, token, generation); shared groups by
  // their members.
  std::map<std::vector<uint64_t>, std::unique_ptr<BatchSpec>> peer_batches_;
  std::map<std::vector<uint64_t>, std::unique_ptr<MergedLaunch>> shared_;
  bool turn_opened_ = false;  // tried (turn_ stays null when off or unavailable)
  int launches_ = 0;          // this rank's launches in flight
  bool turn_waiting_ = false;
  std::chrono::steady_clock::time_point turn_wait_start_;
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
  ~IpcSendPair() override;

  Status Init(BatchSpec spec);

  Status Post(uint64_t version) override;

  bool posted() const { return state_ == kPosted; }
  uint64_t version() const { return version_; }
  size_t buckets() const { return bytes_.size(); }
  // Whether the receiver's pair was posted for this version (drives the mailbox).
  Result<bool> Ready();
  const BatchSpec& spec() const { return spec_; }
  // This pair's buckets went out in `group`'s launch, as its buckets [first, first + n).
  void LaunchedIn(const MergedLaunch* group, size_t first) {
    group_ = group;
    first_ = first;
    state_ = kLaunched;
  }
  // A signaled launch: the kernel hands over the sums and re-zeroes them itself.
  Status LaunchAlone(cudaStream_t s);

  Result<XferState> Poll() override;

  const MergedLaunch* group() const { return state_ == kLaunched ? group_ : nullptr; }
  // The launch completed: the sums, and the message that tells the receiver. `packed` (finished)
  // and `landed` (raw) are the launch's, read once for all its pairs; this pair's buckets start
  // at its offset in them.
  // `nonfinite` (block-FP8 launches; else empty): per bucket of the launch, the non-finite
  // trainer values met, which fail the pair (DataLoss) instead of telling the receiver.
  Status Finished(const std::vector<uint64_t>& packed, const std::vector<uint64_t>& landed,
                  const std::vector<int64_t>& nonfinite);

  Result<PairSums> Sums() override { return sums_; }
  bool DeliversSums() const override { return true; }
  bool SignalsReady() const override { return true; }
  void Cancel() override;
  std::string Describe() const override;

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

}  // namespace shardsync::gpu::ipc
