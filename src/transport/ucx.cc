// UCX transport on the UCP API: one context + worker per object, worker addresses and packed
// rkeys exchanged through the store, one-sided ucp_put_nbx into peers' registered memory and
// tagged messages. Nothing blocks: Post* start requests, Poll progresses the worker and checks
// them; peer failures reach us through the endpoint error handler (keepalive / broken links).
#include "shardsync/transport.h"
#include "store/net.h"

#ifdef SHARDSYNC_HAVE_UCX

#include <signal.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include "shardsync/settings.h"
#include "store/log.h"
#include "transport/process.h"
#include "transport/ucx_support.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;
using ucx_support::HostName;
using ucx_support::Reader;
using ucx_support::Writer;

constexpr uint32_t kRecordMagic = 0x55435853;  // "SXCU": record format version 1
constexpr int kTagRankBits = 16;
constexpr int kTagUserBits = 64 - kTagRankBits;
constexpr uint64_t kTagUserMask = (uint64_t{1} << kTagUserBits) - 1;

std::string UcsError(const char* what, ucs_status_t s) {
  return std::string(what) + ": " + ucs_status_string(s);
}

struct LocalRegion {
  MemRegion region;
  ucp_mem_h memh = nullptr;
  void* rkey_buf = nullptr;
  size_t rkey_len = 0;
};

struct RemoteRegion {
  uint64_t base = 0;
  uint64_t bytes = 0;
  ucp_rkey_h rkey = nullptr;
};

class UcxTransport;

struct UcxPeer {
  UcxTransport* owner = nullptr;
  int rank = -1;
  ucp_ep_h ep = nullptr;
  std::vector<RemoteRegion> regions;
  bool failed = false;
  ucs_status_t failure = UCS_OK;
  // Same-host peers run without UCX peer-failure handling (see AddPeer); their death is
  // detected by watching the process instead.
  bool same_host = false;
  pid_t pid = 0;
  Clock::time_point next_check;
};

enum class Kind { kPut, kFlush, kSend, kRecv };
const char* KindName(Kind k) {
  switch (k) {
    case Kind::kPut:
      return "put";
    case Kind::kFlush:
      return "flush";
    case Kind::kSend:
      return "send";
    case Kind::kRecv:
      return "recv";
  }
  return "?";
}

struct Req {
  void* req = nullptr;  // UCX request; null when it completed at post
  Kind kind = Kind::kPut;
  int peer = -1;
  uint64_t tag = 0;
};

void OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* p = static_cast<UcxPeer*>(arg);
  if (!p->failed) {
    TransportLog().warn("ucx: connection to rank {} failed: {}", p->rank,
                        ucs_status_string(status));
  }
  p->failed = true;
  p->failure = status;
}

class UcxTransport final : public Transport {
 public:
  UcxTransport(UcxMode mode, bool same_host_shm, std::string net_devices)
      : mode_(mode), same_host_shm_(same_host_shm), net_devices_(std::move(net_devices)) {}
  ~UcxTransport() override {
    Teardown(/*force=*/aborted_);
    ReleaseLocal();
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
  }

  Status Init() {
    ucp_config_t* config = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
    if (s != UCS_OK) return InternalError(UcsError("ucx: ucp_config_read", s));
    // Peer death must surface within a sync timeout; UCX's default keepalive round is 20 s.
    // A user's UCX_KEEPALIVE_INTERVAL wins.
    SS_ASSIGN_OR_RETURN(const std::string keepalive, TextKnob("UCX_KEEPALIVE_INTERVAL"));
    if (keepalive.empty()) {
      ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
    }
    // The devices the job needs and no more: every TCP device UCX uses gets a listener on its
    // address (transport.h, "Listening").
    if (!net_devices_.empty()) {
      s = ucp_config_modify(config, "NET_DEVICES", net_devices_.c_str());
      if (s != UCS_OK) {
        ucp_config_release(config);
        return InvalidArgumentError(
            UcsError(("ucx: NET_DEVICES '" + net_devices_ + "'").c_str(), s));
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG;
    params.mt_workers_shared = 0;
    s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) {
      context_ = nullptr;
      return UnavailableError(UcsError("ucx: ucp_init", s));
    }
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // One thread at a time drives a transport, but not always the same thread.
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    s = ucp_worker_create(context_, &wp, &worker_);
    if (s != UCS_OK) {
      worker_ = nullptr;
      return UnavailableError(UcsError("ucx: ucp_worker_create", s));
    }
    return OkStatus();
  }

  std::string_view name() const override { return "ucx"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.host_memory = true;
    c.one_sided_put = mode_ == UcxMode::kPut;
    c.two_sided = true;
    c.tag_matching = true;  // the UCP tag packs (source rank, tag)
    return c;
  }
  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return self.mem == MemKind::kHost && peer.mem == MemKind::kHost;
  }

  Result<uint32_t> RegisterMemory(const MemRegion& region) override {
    SS_RETURN_IF_ERROR(CheckUsable());
    if (connected_) return FailedPreconditionError("ucx: RegisterMemory after Connect");
    if (region.kind != MemKind::kHost) {
      return InvalidArgumentError("ucx: only host memory can be registered (got a CUDA region)");
    }
    if (region.base == nullptr && region.bytes > 0) {
      return InvalidArgumentError("ucx: region base is null with " + std::to_string(region.bytes) +
                                  " bytes");
    }
    LocalRegion lr;
    lr.region = region;
    if (region.bytes > 0) {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = region.base;
      mp.length = region.bytes;
      ucs_status_t s = ucp_mem_map(context_, &mp, &lr.memh);
      if (s != UCS_OK) {
        return UnavailableError(UcsError(
            ("ucx: ucp_mem_map of " + std::to_string(region.bytes) + " bytes").c_str(), s));
      }
      s = ucp_rkey_pack(context_, lr.memh, &lr.rkey_buf, &lr.rkey_len);
      if (s != UCS_OK) {
        ucp_mem_unmap(context_, lr.memh);
        return InternalError(UcsError("ucx: ucp_rkey_pack", s));
      }
    }
    local_.push_back(lr);
    return static_cast<uint32_t>(local_.size() - 1);
  }

  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override {
    SS_RETURN_IF_ERROR(CheckUsable());
    if (connected_) return FailedPreconditionError("ucx: Connect called twice");
    if (rank < 0 || rank >= (1 << kTagRankBits)) {
      return InvalidArgumentError("ucx: rank " + std::to_string(rank) + " outside [0, 65536)");
    }
    auto deadline = Clock::now() + store_net::ClampWait(timeout);
    rank_ = rank;
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    ucs_status_t s = ucp_worker_get_address(worker_, &addr, &addr_len);
    if (s != UCS_OK) return InternalError(UcsError("ucx: ucp_worker_get_address", s));
    Writer w;
    w.U32(kRecordMagic);
    w.U32(static_cast<uint32_t>(mode_));
    const std::string host = HostName();
    w.Bytes(host.data(), host.size());
    w.U32(static_cast<uint32_t>(getpid()));
    w.Bytes(addr, addr_len);
    ucp_worker_release_address(worker_, addr);
    w.U32(static_cast<uint32_t>(local_.size()));
    for (const LocalRegion& lr : local_) {
      w.U64(reinterpret_cast<uint64_t>(lr.region.base));
      w.U64(lr.region.bytes);
      w.Bytes(lr.rkey_buf, lr.rkey_len);
    }
    auto key = [&](int r) { return prefix + "/ucx/" + std::to_string(r); };
    SS_RETURN_IF_ERROR(store.Set(key(rank), w.out));
    connected_ = true;  // endpoints created below are cleaned up on any failure path
    for (int p : peers) {
      if (p == rank || p < 0 || p >= (1 << kTagRankBits) || peers_.count(p)) {
        return InvalidArgumentError("ucx connect rank " + std::to_string(rank) +
                                    ": bad or duplicate peer rank " + std::to_string(p));
      }
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      auto rec = store.Get(key(p), std::max(left, Millis(0)));
      if (!rec.ok()) {
        Status st = rec.status();
        return st.Annotate("ucx connect rank " + std::to_string(rank) + " to peer rank " +
                           std::to_string(p));
      }
      SS_RETURN_IF_ERROR(AddPeer(p, *rec));
    }
    return OkStatus();
  }

  Result<XferId> PostPut(int peer, const void* src, size_t bytes, uint32_t remote_region,
                         uint64_t remote_offset) override {
    if (mode_ != UcxMode::kPut) {
      return FailedPreconditionError(
          "ucx transport in tag mode (SHARDSYNC_UCX_MODE=tag): one-sided put disabled; move "
          "data with PostSend/PostRecv");
    }
    SS_ASSIGN_OR_RETURN(UcxPeer * p, GetPeer(peer));
    if (remote_region >= p->regions.size()) {
      return OutOfRangeError("ucx put to rank " + std::to_string(peer) + ": region " +
                             std::to_string(remote_region) + " not registered (rank has " +
                             std::to_string(p->regions.size()) + ")");
    }
    const RemoteRegion& rr = p->regions[remote_region];
    if (remote_offset > rr.bytes || bytes > rr.bytes - remote_offset) {
      return OutOfRangeError("ucx put to rank " + std::to_string(peer) + " region " +
                             std::to_string(remote_region) + ": [" + std::to_string(remote_offset) +
                             ", +" + std::to_string(bytes) + ") outside its " +
                             std::to_string(rr.bytes) + " bytes");
    }
    if (bytes == 0) return Track(nullptr, Kind::kPut, peer, 0);
    ucp_request_param_t prm{};
    ucs_status_ptr_t r = ucp_put_nbx(p->ep, src, bytes, rr.base + remote_offset, rr.rkey, &prm);
    return Started(r, Kind::kPut, peer, 0);
  }

  Result<XferId> PostFlush(int peer) override {
    SS_ASSIGN_OR_RETURN(UcxPeer * p, GetPeer(peer));
    ucp_request_param_t prm{};
    return Started(ucp_ep_flush_nbx(p->ep, &prm), Kind::kFlush, peer, 0);
  }

  Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) override {
    SS_ASSIGN_OR_RETURN(UcxPeer * p, GetPeer(peer));
    SS_RETURN_IF_ERROR(CheckTag(tag));
    ucp_request_param_t prm{};
    ucs_status_ptr_t r = ucp_tag_send_nbx(p->ep, buf, bytes, WireTag(rank_, tag), &prm);
    return Started(r, Kind::kSend, peer, tag);
  }

  Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) override {
    SS_ASSIGN_OR_RETURN(UcxPeer * p, GetPeer(peer));
    (void)p;
    SS_RETURN_IF_ERROR(CheckTag(tag));
    ucp_request_param_t prm{};
    ucs_status_ptr_t r =
        ucp_tag_recv_nbx(worker_, buf, bytes, WireTag(peer, tag), ~uint64_t{0}, &prm);
    return Started(r, Kind::kRecv, peer, tag);
  }

  Result<XferState> Poll(XferId id) override {
    if (aborted_) return AbortedError("ucx transport aborted");
    auto it = reqs_.find(id);
    if (it == reqs_.end()) {
      return InvalidArgumentError("ucx: unknown transfer id " + std::to_string(id));
    }
    ucp_worker_progress(worker_);
    Req& rq = it->second;
    ucs_status_t s = rq.req ? ucp_request_check_status(rq.req) : UCS_OK;
    UcxPeer& peer = peers_.at(rq.peer);
    if (s == UCS_INPROGRESS) CheckAlive(peer);
    if (s == UCS_INPROGRESS) {
      if (!peer.failed) return XferState::kInProgress;
      // A receive is not bound to the endpoint, so UCX would wait forever for a dead sender.
      if (rq.kind == Kind::kRecv) ucp_request_cancel(worker_, rq.req);
      ucp_request_free(rq.req);
      Status err = Failure(rq, peer.failure);
      reqs_.erase(it);
      return err;
    }
    if (rq.req) ucp_request_free(rq.req);
    Req done = rq;
    reqs_.erase(it);
    if (s == UCS_OK) return XferState::kDone;
    return Failure(done, s);
  }

  // A few rounds, so that a peer's flush request and its reply's send both go through.
  void Progress() override {
    if (aborted_ || worker_ == nullptr) return;
    for (int i = 0; i < 8 && ucp_worker_progress(worker_) != 0; ++i) {
    }
  }

  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    Teardown(/*force=*/true);
  }

 private:
  static uint64_t WireTag(int rank, uint64_t tag) {
    return (static_cast<uint64_t>(rank) << kTagUserBits) | tag;
  }
  static Status CheckTag(uint64_t tag) {
    if (tag > kTagUserMask) {
      return InvalidArgumentError("ucx: tag " + std::to_string(tag) + " exceeds 48 bits");
    }
    return OkStatus();
  }

  Status CheckUsable() const {
    if (aborted_) return AbortedError("ucx transport aborted");
    if (worker_ == nullptr) return FailedPreconditionError("ucx transport not initialized");
    return OkStatus();
  }

  Result<UcxPeer*> GetPeer(int peer) {
    SS_RETURN_IF_ERROR(CheckUsable());
    if (!connected_) return FailedPreconditionError("ucx: not connected");
    auto it = peers_.find(peer);
    if (it == peers_.end()) {
      return InvalidArgumentError("ucx rank " + std::to_string(rank_) + ": rank " +
                                  std::to_string(peer) + " is not a connected peer");
    }
    CheckAlive(it->second);
    if (it->second.failed) {
      return UnavailableError("ucx: peer rank " + std::to_string(peer) + " failed (" +
                              ucs_status_string(it->second.failure) + ")");
    }
    return &it->second;
  }

  // Watches a same-host peer's process (at most every 50 ms).
  void CheckAlive(UcxPeer& p) {
    if (!p.same_host || p.failed || p.pid == getpid()) return;
    auto now = Clock::now();
    if (now < p.next_check) return;
    p.next_check = now + Millis(50);
    if (!internal::ProcessAlive(p.pid)) {
      TransportLog().warn("ucx: peer rank {} (pid {}) exited", p.rank, p.pid);
      p.failed = true;
      p.failure = UCS_ERR_CONNECTION_RESET;
    }
  }

  Status Failure(const Req& rq, ucs_status_t s) const {
    std::string what =
        std::string("ucx ") + KindName(rq.kind) + (rq.kind == Kind::kRecv ? " from" : " to") +
        " rank " + std::to_string(rq.peer) +
        (rq.kind == Kind::kSend || rq.kind == Kind::kRecv ? " tag " + std::to_string(rq.tag)
                                                          : std::string()) +
        ": " + ucs_status_string(s);
    switch (s) {
      case UCS_ERR_MESSAGE_TRUNCATED:
        return OutOfRangeError(what + " (message larger than the receive buffer)");
      case UCS_ERR_CANCELED:
        return AbortedError(what);
      case UCS_ERR_CONNECTION_RESET:
      case UCS_ERR_ENDPOINT_TIMEOUT:
      case UCS_ERR_UNREACHABLE:
      case UCS_ERR_TIMED_OUT:
      case UCS_ERR_IO_ERROR:
      case UCS_ERR_REJECTED:
        return UnavailableError(what + " (peer died or link failed)");
      default:
        if (peers_.count(rq.peer) && peers_.at(rq.peer).failed) {
          return UnavailableError(what + " (peer failed)");
        }
        return InternalError(what);
    }
  }

  Result<XferId> Started(ucs_status_ptr_t r, Kind kind, int peer, uint64_t tag) {
    if (UCS_PTR_IS_ERR(r)) {
      Req rq{nullptr, kind, peer, tag};
      return Failure(rq, UCS_PTR_STATUS(r));
    }
    return Track(UCS_PTR_IS_PTR(r) ? r : nullptr, kind, peer, tag);
  }

  XferId Track(void* req, Kind kind, int peer, uint64_t tag) {
    XferId id = next_id_++;
    reqs_.emplace(id, Req{req, kind, peer, tag});
    return id;
  }

  Status AddPeer(int rank, const std::string& record) {
    Reader rd{record};
    uint32_t magic = rd.Num<uint32_t>();
    uint32_t mode = rd.Num<uint32_t>();
    std::string_view host = rd.Bytes();
    uint32_t pid = rd.Num<uint32_t>();
    std::string_view addr = rd.Bytes();
    uint32_t nregions = rd.Num<uint32_t>();
    std::string who = "ucx connect to rank " + std::to_string(rank);
    if (!rd.ok || magic != kRecordMagic) {
      return DataLossError(who + ": malformed connection record in the store");
    }
    if (mode != static_cast<uint32_t>(mode_)) {
      return FailedPreconditionError(
          who + ": peer runs SHARDSYNC_UCX_MODE=" + (mode == 0 ? "put" : "tag") + ", this rank " +
          (mode_ == UcxMode::kPut ? "put" : "tag"));
    }
    UcxPeer& p = peers_[rank];
    p.owner = this;
    p.rank = rank;
    // Host identities (HostIdentity): emulated nodes are other hosts here, as to the router.
    p.same_host = same_host_shm_ && host == HostName();
    p.pid = static_cast<pid_t>(pid);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    // UCX 1.13's shared-memory transports (posix, sysv, cma) have no peer-failure handler, so
    // asking for UCP_ERR_HANDLING_MODE_PEER would silently push same-host traffic onto TCP
    // loopback (~10x slower). Same-host peers get mode NONE and a process watch instead.
    ep.err_mode = p.same_host ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = OnEpError;
    ep.err_handler.arg = &p;  // std::map nodes never move
    ucs_status_t s = ucp_ep_create(worker_, &ep, &p.ep);
    if (s != UCS_OK) {
      p.ep = nullptr;
      return UnavailableError(UcsError((who + ": ucp_ep_create").c_str(), s));
    }
    for (uint32_t i = 0; i < nregions && rd.ok; ++i) {
      RemoteRegion rr;
      rr.base = rd.Num<uint64_t>();
      rr.bytes = rd.Num<uint64_t>();
      std::string_view rkey = rd.Bytes();
      if (!rd.ok) break;
      if (rr.bytes > 0) {
        s = ucp_ep_rkey_unpack(p.ep, rkey.data(), &rr.rkey);
        if (s != UCS_OK) {
          return InternalError(
              UcsError((who + ": rkey of region " + std::to_string(i)).c_str(), s));
        }
      }
      p.regions.push_back(rr);
    }
    if (!rd.ok || !rd.in.empty()) {
      return DataLossError(who + ": malformed region list in the store record");
    }
    return OkStatus();
  }

  // Bounded progress until `done` or the deadline.
  template <typename F>
  void ProgressUntil(F&& done, Millis budget) {
    auto deadline = Clock::now() + budget;
    while (!done() && Clock::now() < deadline) {
      if (ucp_worker_progress(worker_) == 0) std::this_thread::yield();
    }
  }

  void Teardown(bool force) {
    if (torn_down_) return;
    torn_down_ = true;
    if (worker_ != nullptr) {
      for (auto& [id, rq] : reqs_) {
        if (rq.req && rq.kind == Kind::kRecv) ucp_request_cancel(worker_, rq.req);
      }
      // Let in-flight puts and sends finish (bounded) before their rkeys and endpoints go.
      if (!force) {
        ProgressUntil(
            [&] {
              for (auto& [id, rq] : reqs_) {
                if (rq.req && ucp_request_check_status(rq.req) == UCS_INPROGRESS &&
                    !peers_.at(rq.peer).failed) {
                  return false;
                }
              }
              return true;
            },
            Millis(2000));
      }
      for (auto& [rank, p] : peers_) {
        for (RemoteRegion& rr : p.regions) {
          if (rr.rkey) ucp_rkey_destroy(rr.rkey);
          rr.rkey = nullptr;
        }
      }
      std::vector<void*> closing;
      for (auto& [rank, p] : peers_) {
        if (!p.ep) continue;
        ucp_request_param_t prm{};
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        // Forced where UCX allows it (peer-failure mode, or the peer is gone): a flushing close
        // can wait on a peer that is itself tearing down. Same-host endpoints (mode NONE) must
        // flush-close; that completes locally on shared memory. Callers PostFlush first.
        prm.flags = (!p.same_host || p.failed) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
        ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &prm);
        if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
        p.ep = nullptr;
      }
      ProgressUntil(
          [&] {
            for (void* r : closing) {
              if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
            }
            return true;
          },
          Millis(500));
      for (void* r : closing) ucp_request_free(r);
      for (auto& [id, rq] : reqs_) {
        if (rq.req) ucp_request_free(rq.req);
      }
      reqs_.clear();
    }
  }

  void ReleaseLocal() {
    for (LocalRegion& lr : local_) {
      if (lr.rkey_buf) ucp_rkey_buffer_release(lr.rkey_buf);
      if (lr.memh && context_) ucp_mem_unmap(context_, lr.memh);
      lr.rkey_buf = nullptr;
      lr.memh = nullptr;
    }
  }

 private:
  UcxMode mode_;
  bool same_host_shm_;
  std::string net_devices_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int rank_ = -1;
  bool connected_ = false;
  bool aborted_ = false;
  bool torn_down_ = false;
  std::vector<LocalRegion> local_;
  std::map<int, UcxPeer> peers_;
  std::unordered_map<XferId, Req> reqs_;
  XferId next_id_ = 1;
};

}  // namespace

Result<std::unique_ptr<Transport>> NewUcxTransport(const UcxOptions& options) {
  SS_ASSIGN_OR_RETURN(ucx_support::ResolvedUcxOptions o, ucx_support::ResolveUcxOptions(options));
  auto t = std::make_unique<UcxTransport>(o.mode, options.same_host_shm, o.net_devices);
  SS_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace shardsync

#else  // !SHARDSYNC_HAVE_UCX

namespace shardsync {
Result<std::unique_ptr<Transport>> NewUcxTransport(const UcxOptions&) {
  return UnimplementedError("ucx transport: shardsync was built without UCX (libucx-dev)");
}
}  // namespace shardsync

#endif  // SHARDSYNC_HAVE_UCX
