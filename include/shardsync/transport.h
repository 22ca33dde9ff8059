// Transport interface: moves bytes between ranks. Implementations: ucx (host memory: shm, cma,
// tcp, RDMA verbs), loopback (in-process, tests), fault (fault-injecting decorator, tests),
// cuda_ipc (same-node GPUs) and nccl (GPUs, any node).
//
// Life cycle: RegisterMemory (once per buffer, before Connect) -> Connect (exchanges addresses and
// memory keys with peers through the store; collective over the listed peers) -> repeated
// Post* / Poll per sync -> destruction. Post* never blocks; Poll drives progress and never blocks
// longer than a progress step (Progress: a step with nothing to poll). Completion of a Put at the
// target is only guaranteed after a later Flush to that peer completes. Threading: one thread
// drives a transport at a time. Failure: a transport whose peer died returns Unavailable from Poll;
// Abort cancels every outstanding transfer and makes further calls fail fast.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/delta.h"
#include "shardsync/pack.h"
#include "shardsync/status.h"
#include "shardsync/store.h"

namespace shardsync {

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
  bool summed_copy = false;   // PostSendSummed / PostRecvSummed (the transport copies the bytes)
  bool filled_send = false;   // PostSendFilled (the caller writes into the transport's staging)
  bool tag_matching = false;  // two-sided messages matched by (source, tag); else by order per pair
  bool prepared = false;      // Prepare: a pair's whole slice of the plan compiled once (below)
};

// A checksum riding on the copy a transport makes anyway (caps().summed_copy; the shm transport
// copies every byte into and out of a shared ring). Byte i of the message has checksum position
// `key + i` (checksum.h). The transport adds ChecksumPartial of the message's whole words, i.e.
// of bytes [SummedHead, SummedTail), into `sum` before it reports the transfer done; the bytes
// outside that span (under 8 at each end) are the caller's to add.
struct CopySum {
  uint64_t key = 0;
  uint64_t sum = 0;
};
inline uint64_t SummedHead(uint64_t key, uint64_t bytes) {
  const uint64_t h = (8 - key % 8) % 8;
  return h < bytes ? h : bytes;
}
inline uint64_t SummedTail(uint64_t key, uint64_t bytes) {
  const uint64_t h = SummedHead(key, bytes);
  return h + (bytes - h) / 8 * 8;
}

// Identity a rank advertises so peers can pick a transport (canConnect).
struct PeerInfo {
  int rank = 0;
  std::string hostname;  // the host identity (HostIdentity: SHARDSYNC_HOST_ID, else gethostname)
  MemKind mem = MemKind::kHost;
  int device = -1;  // CUDA index in the rank's own process (CUDA_VISIBLE_DEVICES may differ)
  // The physical GPU (PCI bus id) for kCuda; when both sides have one, "same GPU" compares it
  // instead of `device`, whose numbering depends on each process's CUDA_VISIBLE_DEVICES.
  std::string gpu_id;
};
enum class XferState { kInProgress, kDone };
using XferId = uint64_t;

// Whether two ranks' memory sits on the same physical GPU of the same host (host identity: two
// emulated nodes on one GPU are not the same GPU, as NCCL sees them with NCCL_HOSTID).
bool SameGpu(const PeerInfo& a, const PeerInfo& b);

// ---------------------------------------------------------------------------------------------
// Prepared pairs (caps().prepared; NIXL's prepare / post / check): one (sender, receiver) pair's
// whole slice of the plan, every bucket, compiled once at Connect into the transport's own form
// (cuda_ipc: one launch that packs, casts and checksums straight into the peer's parameters and
// reads every landed word back through the receiver's own map; nccl: pipelined pack / send / recv
// / unpack rounds) and replayed every sync. Both sides prepare the pair with the same buckets.
//
// Where a sender's bucket lands at the peer: region `dst` of a tensor of `shape` held in the
// peer's registered memory region `region`, at byte `offset` of it (one-sided transports).
struct RemoteRegion {
  uint32_t region = 0;
  uint64_t offset = 0;
  Shape shape;
  Region dst;
};
// An op of a pair's bucket that is not a plain copy, with its plan.h Encoding (`encoding`, its
// integer value: the transport layer sits below the plan's): a transport hands it to that
// encoding's codec (its kernels: gpu.h EncodedTask) or refuses it. The fields are the codec's:
//  - block FP8 kQuantize: the sender quantizes `src` (trainer values; src.wire_offset is the op's
//    offset in the bucket's wire image) into `dst` (e4m3 rows) and `aux` (fp32 block scales) at
//    the peer. Receivers give their own tensors as `landed` / `landed_aux` and leave the rest
//    empty. kAmax (rows of a block row shared with other trainer ranks) is the same with its
//    block row's scales given: `given` (sender: device memory of this rank holding the agreed
//    scale of each of the op's column blocks, written before every launch; the op's own amax is
//    not taken), and `with_aux` false for the holders that send e4m3 rows only (no scale section
//    on the wire, `aux` / `landed_aux` unused).
//  - block FP8 kStage: raw trainer values copied, with no cast, into the receiver's staging, which
//    it quantizes once the sync's data is verified. `src`: the sender's source (trainer dtype) or
//    the receiver's staging (the same dtype), its wire_offset in a compact image of the bucket's
//    stage ops alone; `dst` (senders): where it lands at the peer.
struct EncodedRegion {
  uint8_t encoding = 0;
  PackRegion src;
  RemoteRegion dst, aux;
  PackRegion landed, landed_aux;
  const float* given = nullptr;
  bool with_aux = true;
};
struct PairBucket {
  int64_t bytes = 0;  // wire bytes
  // Sender: the source regions (tensor dtype), tiling [0, bytes) of the wire image. Receiver:
  // where the wire image lands, in its own tensors (wire dtype).
  std::vector<PackRegion> local;
  // Sender: for each of `local`, where it lands at the peer (the receiver's landed region of the
  // same wire bytes). Empty on receivers and for two-sided transports.
  std::vector<RemoteRegion> remote;
  // Image pairs (PairSpec::image): the bucket's ops that are not copies.
  std::vector<EncodedRegion> encoded{};
  // Image pairs: each of `local`'s byte offset in the bucket's whole wire image (its wire_offset
  // is in the compact image of the copies), for transports that send the image itself (nccl).
  std::vector<int64_t> wire_offsets{};
};
// The delta encoding on a prepared pair (issue 35, docs/delta.md "Device pairs"): the sender keeps
// a device copy of every bucket's wire image it last sent and sends a bucket as its delta against
// that image (delta_gpu.h kernels) when the receiver's advertised base is that image, else whole,
// with the reason (delta.h DeltaReason). The receiver rebuilds the base from its live bytes and
// decodes on the device; a delta is never applied to another base. Transports without it refuse
// a spec with `on`.
struct PairDelta {
  bool on = false;
  int element_size = 2;  // the wire element the codec diffs by (delta.h)
  // Sender, encoding auto: whether a delta of `changed` of `elements` elements pays (null: it
  // always does, encoding delta).
  std::function<bool(uint64_t elements, uint64_t changed)> pays;
  // Receiver under a staged commit (docs/staged-commit.md): its buckets land in staging, while a
  // delta's base is the committed bytes the engine serves. `live` maps each landing tensor's
  // address (a PackRegion base of the buckets) to its live parameter's; `committed` is the
  // committed version, the base version of every bucket. Null: in place (the landing tensors
  // are the base, each bucket at the version its last readback verified).
  std::function<const void*(const void* landing)> live;
  std::function<uint64_t()> committed;
};
// What one replay of a delta pair did, per bucket in order: the sender's decision, or the bucket
// as the receiver landed it.
struct PairDeltaBucket {
  DeltaReason reason = DeltaReason::kNoImage;
  uint64_t wire_bytes = 0;  // on the wire: the delta's, or the bucket's when whole
  uint64_t full_bytes = 0;  // the bucket's
  uint64_t changed = 0;     // elements that changed (buckets compared against a base)
  uint64_t elements = 0;    // elements compared
};
struct PairDeltaReport {
  std::vector<PairDeltaBucket> buckets;
  // Sender: packing the image aside, encoding, the copies; receiver: its base's checksums, the
  // base gathered, the decode, the landing and its readback.
  double seconds = 0;
  std::string first_fallback;  // sender: its first fallback in words ("" for none)
};

struct PairSpec {
  int peer = -1;
  bool send = true;
  DType wire = DType::kBF16;
  std::vector<PairBucket> buckets;
  // Store key prefix of this pair, the same on both sides (prepare-time exchanges: cuda_ipc's
  // landed map). Unique per pair and job.
  std::string key;
  // The pair of an image codec's plan (block FP8): each bucket's `local` / `remote` are its copy
  // ops at wire offsets of a compact image of the copies alone (no pads, no encoded ops;
  // `wire_offsets` their offsets in the whole image), `encoded` its other ops, and `bytes` the
  // whole wire image. Transports refuse an encoding they have no codec kernels for.
  bool image = false;
  PairDelta delta;  // the delta encoding (see PairDelta)
};
// Per bucket, the finished checksum (checksum.h) of the wire image as packed, and as landed
// where this side knows it: the sender of cuda_ipc reads every landed word back through the
// receiver's map; an nccl receiver sums while unpacking. Empty `landed` where the other side has
// it. A receiver's `packed` is non-empty when the sender's packed sums arrived with the data
// (DeliversSums); otherwise the session carries them.
struct PairSums {
  std::vector<uint64_t> packed;
  std::vector<uint64_t> landed;
};
class PreparedPair {
 public:
  virtual ~PreparedPair() = default;
  // Starts one replay of every bucket for sync `version` (enqueues device work; never blocks).
  // The caller made sure the receiver is ready for new bytes (sync protocol); at most one replay
  // in flight. Both sides post the same versions.
  virtual Status Post(uint64_t version) = 0;
  // Drives progress; kDone once this side's part of the replay finished (sender: every byte
  // sent and visible at the receiver; receiver: every byte landed where it computes the sums).
  // Unavailable when the peer died, Aborted after Abort.
  virtual Result<XferState> Poll() = 0;
  // After kDone.
  virtual Result<PairSums> Sums() = 0;
  // Sender: true when the packed sums reach the receiving pair's Sums() with the data (cuda_ipc:
  // in its completion message), so the session need not send them.
  virtual bool DeliversSums() const { return false; }
  // Sender: true when the pair itself holds its writes until the receiving pair was posted for
  // the same version (the receiver is inside Sync), so the session need not wait for the
  // receiver's ready key (cuda_ipc: a mailbox message from the receiving pair's Post).
  virtual bool SignalsReady() const { return false; }
  // Gives up a replay that was posted and not seen done (the sync failed: peer dead, timeout,
  // abort): device work still waiting on the peer is torn down (nccl: the pair's communicator is
  // aborted) and later Posts fail with Aborted, so the job re-connects. No-op when idle.
  virtual void Cancel() = 0;
  // Short description for reports ("cuda_ipc: 3 buckets into rank 2 (1 launch)").
  virtual std::string Describe() const = 0;
  // A pair prepared with PairSpec::delta: what its last replay did, after kDone; null otherwise.
  virtual const PairDeltaReport* Delta() const { return nullptr; }
};

// Options of prepared pairs, as TransportOptions.params keys: "nccl_depth" (plan buckets in flight
// per nccl pair, default 2). An nccl round is one plan bucket, so the bucket cap sets its size
// (docs/benchmarks.md has the measured sizes).

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
  // Matched by (source rank, tag), FIFO per pair; tags must fit in 48 bits and ranks in 16
  // (UCX packs both into its 64-bit tag). A receive buffer may be larger than the message; a
  // smaller one fails the receive with OutOfRange. Send buffers must stay valid until done.
  virtual Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) = 0;
  virtual Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) = 0;
  // As PostSend / PostRecv, with `sum` (alive until done) filled from the transport's own copy
  // of the bytes. Unimplemented unless caps().summed_copy.
  virtual Result<XferId> PostSendSummed(int peer, uint64_t tag, const void* buf, size_t bytes,
                                        CopySum* sum);
  virtual Result<XferId> PostRecvSummed(int peer, uint64_t tag, void* buf, size_t bytes,
                                        CopySum* sum);
  // A send whose bytes the caller writes straight into the transport's staging (shm: the ring
  // slots), e.g. casting into it with the checksum fused: `fill(dst, offset, len)` must write
  // message bytes [offset, offset + len) to dst. Called in order, on the driving thread from
  // Post* / Poll as staging frees up; the send is done after the last call. What `fill` uses
  // must stay valid until then. Unimplemented unless caps().filled_send.
  using SendFill = std::function<void(void* dst, uint64_t offset, uint64_t len)>;
  virtual Result<XferId> PostSendFilled(int peer, uint64_t tag, size_t bytes, SendFill fill);
  // kDone once complete (the id is then released); Unavailable / Internal on failure.
  virtual Result<XferState> Poll(XferId id) = 0;
  // One progress step with no transfer of this side's to wait for, for a rank that waits on
  // something else (the store) while peers may still need this side: UCX off shared memory (TCP)
  // completes a peer's flush only while this side progresses its worker. Never blocks; failures
  // surface in later Polls. Default: nothing progresses outside Poll.
  virtual void Progress() {}
  // Cancels everything outstanding; later calls fail with Aborted.
  virtual void Abort() = 0;

  // Compiles a pair's slice of the plan (after Connect; collective with the peer, which prepares
  // the mirror spec). Unimplemented unless caps().prepared (for this peer: PeerCaps).
  virtual Result<std::unique_ptr<PreparedPair>> Prepare(StoreClient& store, const PairSpec& spec,
                                                        Millis timeout);
  // Per-peer view for transports that route peers to other transports (NewRoutedTransport);
  // valid after Connect. Defaults: this transport's own.
  virtual TransportCaps PeerCaps(int peer) const;
  virtual std::string PeerTransport(int peer) const;
};

// Waits for `id` with a deadline (DeadlineExceeded naming `what`).
Status WaitXfer(Transport& t, XferId id, Millis timeout, std::string_view what);
// Waits for every id (one shared deadline); the first failure is returned, naming `what`.
Status WaitAllXfers(Transport& t, const std::vector<XferId>& ids, Millis timeout,
                    std::string_view what);

// This process's host identity, the `hostname` of its PeerInfo: SHARDSYNC_HOST_ID when set, else
// gethostname(). Every same-host decision compares it (cuda_ipc, shm, UCX's shared memory, SameGpu,
// the verdict board, cuda_ipc's shared launches), so ranks with different ids are different nodes
// even on one machine: `--emulate-nodes` (bench, demo) gives each rank process its own, with
// NCCL_HOSTID the same, and their GPU pairs go through NCCL's network transport (sockets). Ranks
// with one id must share a machine. Liveness watches (a peer's pid) keep the real hostname.
std::string HostIdentity();

// This host's identity for transport selection (gpu_id empty: see gpu::DevicePeerInfo).
PeerInfo LocalPeerInfo(int rank, MemKind mem = MemKind::kHost, int device = -1);

// ---------------------------------------------------------------------------------------------
// Loopback: in-process transport for tests. Every rank is a Transport object sharing one hub;
// each object may be driven from its own thread. Put and Send copy at post time (memcpy into the
// peer's registered memory / into the matching posted receive or a buffered message), so they
// complete immediately; Recv completes when a message with the same (src, tag) arrives, FIFO.
// A rank that is destroyed or aborted leaves the hub: its peers' pending receives from it and
// later posts to it fail with Unavailable.
class LoopbackHub;
std::shared_ptr<LoopbackHub> NewLoopbackHub();
std::unique_ptr<Transport> NewLoopbackTransport(std::shared_ptr<LoopbackHub> hub);
// Connects without a store: waits (up to timeout) until every peer joined the same hub.
// `t` must come from NewLoopbackTransport.
Status ConnectLoopbackDirect(Transport& t, int rank, const std::vector<int>& peers, Millis timeout);

// ---------------------------------------------------------------------------------------------
// UCX (UCP API): one ucp_context + ucp_worker per transport object (one per process in real
// jobs). Memory registered with ucp_mem_map, rkeys and the worker address published through the
// store under `prefix`. UCX_TLS / UCX_NET_DEVICES etc. are left to the user (UCX picks shm /
// cma / tcp / verbs).
//   put: PostPut = ucp_put_nbx into the peer's memory (true one-sided on RDMA verbs; UCX
//        emulates it through active messages elsewhere, which needs the target to progress).
//   tag: caps().one_sided_put is false and PostPut fails with FailedPrecondition; move data
//        with PostSend / PostRecv (zero-copy rendezvous over cma / verbs). The fast path on a
//        single host: measured 0.2-0.5 GB/s for emulated puts vs 1.2-1.4 GB/s for tagged
//        sends of 64 MiB on the 2-core dev VM.
//   auto (default): put when this host has RDMA devices (/sys/class/infiniband), else tag.
// SHARDSYNC_UCX_MODE=put|tag|auto overrides. All ranks of a job must resolve to the same mode
// (Connect fails naming SHARDSYNC_UCX_MODE otherwise).
// Listening: UCX's TCP transport opens a listener on every network device it may use (one per
// UCX_NET_DEVICES entry, bound to that device's address: uct_tcp_iface_listener_init in UCX's
// src/uct/tcp/tcp_iface.c), and the store token does not cover those ports. So UCX uses only the
// loopback interface unless a device is named (net_devices, SHARDSYNC_UCX_NET_DEVICES or UCX's
// UCX_NET_DEVICES; "all" for every device): nothing listens on a routable address by default;
// shared memory (posix, sysv, cma) is unaffected. Jobs across hosts name their interconnect.
// Same-host peers: UCX 1.13's shm transports have no peer-failure support, so their death is
// detected by watching the peer's process; remote peers use UCX keepalive (1 s unless
// UCX_KEEPALIVE_INTERVAL is set). Destruction closes endpoints without waiting for the peer:
// PostFlush before destroying. Launchers must fork + exec: a bare-forked child of a multi-threaded
// parent was seen to deadlock inside UCX's memory hooks (ucm) during ucp_init.
enum class UcxMode { kPut, kTag, kAuto };
struct UcxOptions {
  UcxMode mode = UcxMode::kAuto;
  bool mode_from_env = true;  // SHARDSYNC_UCX_MODE=put|tag|auto overrides `mode` when set
  // false: treat every peer as remote (UCX peer-failure mode, so no shared memory; TCP on one
  // host). Exercises the multi-node failure path on a single machine (tests).
  bool same_host_shm = true;
  // Network devices UCX may use, in UCX_NET_DEVICES syntax ("eth0,mlx5_0:1"), "loopback" for
  // this host's loopback interface only, or "all" for UCX's choice (every device). "": the
  // user's UCX_NET_DEVICES when set, else loopback. When set it wins over UCX_NET_DEVICES.
  std::string net_devices;
  bool net_devices_from_env = true;  // SHARDSYNC_UCX_NET_DEVICES overrides `net_devices` when set
};
// Unimplemented when shardsync was built without UCX.
Result<std::unique_ptr<Transport>> NewUcxTransport(const UcxOptions& options = {});

// ---------------------------------------------------------------------------------------------
// Shared memory (same host, host memory, two-sided): every rank creates one POSIX shm segment
// holding a ring per peer that sends to it (16 slots x 64 KiB); peers map it (names exchanged
// through the store under `prefix`; the segment is unlinked once every peer mapped it; a rank
// killed before that has its segment removed by a peer that sees its process gone, or by the next
// connect on the host). A send
// is copied into the ring slot by slot, the receiver copies each slot out into the posted
// buffer (or into a buffer for messages that arrive before their receive). Two copies through a
// ring that stays in cache instead of one kernel copy (UCX's cma), which lets the checksum ride
// on both copies (PostSendSummed / PostRecvSummed), and packing / casting write straight into
// the slots (PostSendFilled): a verified sync then costs about what the raw copies do
// (docs/benchmarks.md, "Host data path"). No one-sided put (PostPut fails with
// FailedPrecondition). A peer's death is seen through its process id (at most every 50 ms) or
// its transport's close flag in the ring.
Result<std::unique_ptr<Transport>> NewShmTransport();

// ---------------------------------------------------------------------------------------------
// Fault injection (tests): wraps any transport. Counters are 1-based over this wrapper's posts;
// 0 disables a fault. A default FaultConfig is a pure pass-through.
struct FaultConfig {
  int fail_post = 0;  // the Nth Post* call fails with `fail_code`
  StatusCode fail_code = StatusCode::kUnavailable;
  int drop_completion = 0;     // the Nth Post* never completes (Poll stays kInProgress)
  Millis completion_delay{0};  // every completion reported this long after the inner one
  int corrupt_data_post = 0;   // the Nth PostPut/PostSend with bytes > 0 sends a copy with one
  size_t corrupt_byte = 0;     // byte (index clamped to the message) XOR-ed with 0xFF
  int die_after_posts = 0;  // after N posts every later Post*/Poll fails Unavailable (peer death)
  // Before the Nth Post* is passed on, `before_post` runs on the posting thread: a test's step
  // at a known point of a sync (e.g. after a receiver advertised, before anything landed).
  int call_before_post = 0;
  std::function<void()> before_post = nullptr;
};
struct FaultCounters {
  int posts = 0;
  int data_posts = 0;
  int failed = 0;
  int dropped = 0;
  int corrupted = 0;
};
class FaultTransport : public Transport {
 public:
  virtual FaultCounters counters() const = 0;
  virtual void set_config(const FaultConfig& config) = 0;  // applies to later posts
};
std::unique_ptr<FaultTransport> NewFaultTransport(std::unique_ptr<Transport> inner,
                                                  FaultConfig config = {});

// ---------------------------------------------------------------------------------------------
// Registry and selection: transports by name with a priority (lower first) and a static
// CanConnect predicate, so a rank picks per peer pair the first transport both sides can use
// (cuda_ipc -> nccl -> shm -> ucx). Built in: "shm" (priority 250, same host), "ucx" (priority
// 300, when built with UCX) and
// "loopback" (priority 1000, never auto-selected: it only works in one process). Other layers
// register their transports by calling RegisterTransport (e.g. from an init function).
struct TransportOptions {
  std::shared_ptr<LoopbackHub> loopback_hub;  // loopback only
  UcxOptions ucx;
  std::map<std::string, std::string> params;  // free-form options for other transports
};
using TransportFactory =
    std::function<Result<std::unique_ptr<Transport>>(const TransportOptions& options)>;
using CanConnectFn = std::function<bool(const PeerInfo& self, const PeerInfo& peer)>;
struct TransportEntry {
  std::string name;
  int priority = 500;
  bool auto_select = true;  // considered by SelectTransport without an explicit hint
  CanConnectFn can_connect;
  TransportFactory factory;
};
// InvalidArgument if the name is empty or already registered.
Status RegisterTransport(TransportEntry entry);
// Registered names in priority order.
std::vector<std::string> RegisteredTransports();
Result<std::unique_ptr<Transport>> CreateTransport(const std::string& name,
                                                   const TransportOptions& options = {});
// First transport by priority that can connect self -> peer. `hint` (a name, or "" for
// automatic) restricts the choice; NotFound names the ranks when nothing fits.
Result<std::string> SelectTransport(const PeerInfo& self, const PeerInfo& peer,
                                    std::string_view hint = "");

// ---------------------------------------------------------------------------------------------
// Routing: one Transport whose peers are served by whichever registered transport fits each pair
// best, the way NCCL picks P2P / SHM / NET per peer. At Connect every rank publishes its PeerInfo
// under `prefix`; each pair then takes the first transport by priority whose CanConnect holds
// for both (same GPU or node: cuda_ipc; other GPUs or nodes: nccl; host memory: shm on one host,
// ucx across hosts). `hint` ("" or "auto": none) is tried first for every pair and may be refused
// by a pair it cannot connect (NCCL cannot put two ranks on one GPU), which then falls back to
// the automatic choice; both sides compute the same choice. Registered memory goes to every
// transport in the same order (the region ids agree). Post* / Poll / Prepare dispatch by peer;
// caps() is what every chosen transport offers (AND), PeerCaps the chosen one's.
struct RouteOptions {
  PeerInfo self;
  std::string hint;
  TransportOptions options;  // handed to every factory
};
Result<std::unique_ptr<Transport>> NewRoutedTransport(RouteOptions options);

}  // namespace shardsync
