// In-process loopback transport: ranks are Transport objects sharing a hub (tests, sessions'
// unit tests). Data moves by memcpy under the hub lock, which keeps it simple and race-free.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "shardsync/transport.h"
#include "store/net.h"

namespace shardsync {

struct LoopbackRecv {
  int src = 0;
  uint64_t tag = 0;
  void* buf = nullptr;
  size_t bytes = 0;
  bool done = false;
  Status error;  // set when the receive failed
};

class LoopbackHub {
 public:
  struct Region {
    char* base = nullptr;
    size_t bytes = 0;
  };
  struct Message {
    int src = 0;
    uint64_t tag = 0;
    std::vector<char> data;
  };
  struct Rank {
    bool gone = false;
    std::vector<Region> regions;
    std::deque<Message> unexpected;
    std::list<std::shared_ptr<LoopbackRecv>> posted;
  };

  LoopbackHub() {
    static std::atomic<uint64_t> next{1};
    id_ = std::to_string(getpid()) + "/" + std::to_string(next++);
  }

  std::mutex mu;
  std::condition_variable cv;
  std::map<int, Rank> ranks;
  const std::string& id() const { return id_; }

 private:
  std::string id_;
};

std::shared_ptr<LoopbackHub> NewLoopbackHub() { return std::make_shared<LoopbackHub>(); }

namespace {

class LoopbackTransport final : public Transport {
 public:
  explicit LoopbackTransport(std::shared_ptr<LoopbackHub> hub) : hub_(std::move(hub)) {}
  ~LoopbackTransport() override { Leave(); }

  std::string_view name() const override { return "loopback"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.host_memory = true;
    c.one_sided_put = true;
    c.two_sided = true;
    c.same_node_only = true;
    c.tag_matching = true;  // receives match (src, tag), FIFO per pair
    return c;
  }
  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return self.hostname == peer.hostname && self.mem == MemKind::kHost &&
           peer.mem == MemKind::kHost;
  }

  Result<uint32_t> RegisterMemory(const MemRegion& region) override {
    SS_RETURN_IF_ERROR(CheckUsable());
    if (rank_ >= 0) return FailedPreconditionError("loopback: RegisterMemory after Connect");
    if (region.kind != MemKind::kHost) {
      return InvalidArgumentError("loopback: only host memory can be registered");
    }
    if (region.base == nullptr && region.bytes > 0) {
      return InvalidArgumentError("loopback: region base is null with " +
                                  std::to_string(region.bytes) + " bytes");
    }
    regions_.push_back({static_cast<char*>(region.base), region.bytes});
    return static_cast<uint32_t>(regions_.size() - 1);
  }

  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override {
    SS_RETURN_IF_ERROR(Join(rank, peers));
    SS_RETURN_IF_ERROR(store.Set(prefix + "/loopback/" + std::to_string(rank), hub_->id()));
    for (int p : peers) {
      auto v = store.Get(prefix + "/loopback/" + std::to_string(p), timeout);
      if (!v.ok()) {
        Status s = v.status();
        return s.Annotate("loopback connect rank " + std::to_string(rank) + " to peer rank " +
                          std::to_string(p));
      }
      if (*v != hub_->id()) {
        return FailedPreconditionError("loopback: peer rank " + std::to_string(p) +
                                       " joined a different hub (" + *v + " vs " + hub_->id() +
                                       "); loopback works within one process only");
      }
    }
    return WaitPeers(timeout);
  }

  Status ConnectDirect(int rank, const std::vector<int>& peers, Millis timeout) {
    SS_RETURN_IF_ERROR(Join(rank, peers));
    return WaitPeers(timeout);
  }

  Result<XferId> PostPut(int peer, const void* src, size_t bytes, uint32_t remote_region,
                         uint64_t remote_offset) override {
    SS_RETURN_IF_ERROR(CheckConnected(peer));
    std::lock_guard<std::mutex> lk(hub_->mu);
    auto& r = hub_->ranks[peer];
    if (r.gone) return PeerGone(peer);
    if (remote_region >= r.regions.size()) {
      return OutOfRangeError("loopback put to rank " + std::to_string(peer) + ": region " +
                             std::to_string(remote_region) + " not registered (rank has " +
                             std::to_string(r.regions.size()) + ")");
    }
    const auto& reg = r.regions[remote_region];
    if (remote_offset > reg.bytes || bytes > reg.bytes - remote_offset) {
      return OutOfRangeError("loopback put to rank " + std::to_string(peer) + " region " +
                             std::to_string(remote_region) + ": [" + std::to_string(remote_offset) +
                             ", +" + std::to_string(bytes) + ") outside its " +
                             std::to_string(reg.bytes) + " bytes");
    }
    if (bytes > 0) std::memcpy(reg.base + remote_offset, src, bytes);
    return NewDone();
  }

  Result<XferId> PostFlush(int peer) override {
    SS_RETURN_IF_ERROR(CheckConnected(peer));
    std::lock_guard<std::mutex> lk(hub_->mu);
    if (hub_->ranks[peer].gone) return PeerGone(peer);
    return NewDone();
  }

  Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) override {
    SS_RETURN_IF_ERROR(CheckConnected(peer));
    std::lock_guard<std::mutex> lk(hub_->mu);
    auto& r = hub_->ranks[peer];
    if (r.gone) return PeerGone(peer);
    for (auto it = r.posted.begin(); it != r.posted.end(); ++it) {
      LoopbackRecv& rv = **it;
      if (rv.src != rank_ || rv.tag != tag) continue;
      Deliver(rv, static_cast<const char*>(buf), bytes);
      r.posted.erase(it);
      return NewDone();
    }
    const char* p = static_cast<const char*>(buf);
    r.unexpected.push_back({rank_, tag, std::vector<char>(p, p + bytes)});
    return NewDone();
  }

  Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) override {
    SS_RETURN_IF_ERROR(CheckConnected(peer));
    auto rv = std::make_shared<LoopbackRecv>();
    rv->src = peer;
    rv->tag = tag;
    rv->buf = buf;
    rv->bytes = bytes;
    std::lock_guard<std::mutex> lk(hub_->mu);
    auto& me = hub_->ranks[rank_];
    auto it = std::find_if(me.unexpected.begin(), me.unexpected.end(),
                           [&](const auto& m) { return m.src == peer && m.tag == tag; });
    if (it != me.unexpected.end()) {
      Deliver(*rv, it->data.data(), it->data.size());
      me.unexpected.erase(it);
    } else {
      me.posted.push_back(rv);
    }
    XferId id = next_id_++;
    xfers_[id] = std::move(rv);
    return id;
  }

  Result<XferState> Poll(XferId id) override {
    if (aborted_) return AbortedError("loopback transport aborted");
    auto it = xfers_.find(id);
    if (it == xfers_.end()) {
      return InvalidArgumentError("loopback: unknown transfer id " + std::to_string(id));
    }
    if (!it->second) {  // put / send / flush: complete at post
      xfers_.erase(it);
      return XferState::kDone;
    }
    std::lock_guard<std::mutex> lk(hub_->mu);
    LoopbackRecv& rv = *it->second;
    if (rv.done) {
      Status err = rv.error;
      xfers_.erase(it);
      if (!err.ok()) return err;
      return XferState::kDone;
    }
    if (hub_->ranks[rv.src].gone) {
      return UnavailableError("loopback: peer rank " + std::to_string(rv.src) +
                              " left (died or aborted) before sending tag " +
                              std::to_string(rv.tag));
    }
    return XferState::kInProgress;
  }

  void Abort() override {
    aborted_ = true;
    Leave();
  }

 private:
  Status CheckUsable() const {
    if (aborted_) return AbortedError("loopback transport aborted");
    return OkStatus();
  }
  Status CheckConnected(int peer) const {
    SS_RETURN_IF_ERROR(CheckUsable());
    if (!connected_) return FailedPreconditionError("loopback: not connected");
    if (!peers_.count(peer)) {
      return InvalidArgumentError("loopback rank " + std::to_string(rank_) + ": rank " +
                                  std::to_string(peer) + " is not a connected peer");
    }
    return OkStatus();
  }
  Status PeerGone(int peer) const {
    return UnavailableError("loopback: peer rank " + std::to_string(peer) +
                            " left (died or aborted)");
  }

  // Copies a message into a posted receive (a larger message than the buffer is an error).
  static void Deliver(LoopbackRecv& rv, const char* data, size_t bytes) {
    rv.done = true;
    if (bytes > rv.bytes) {
      rv.error = OutOfRangeError("loopback recv from rank " + std::to_string(rv.src) + " tag " +
                                 std::to_string(rv.tag) + ": message of " + std::to_string(bytes) +
                                 " bytes exceeds the " + std::to_string(rv.bytes) + "-byte buffer");
      return;
    }
    if (bytes > 0) std::memcpy(rv.buf, data, bytes);
  }

  XferId NewDone() {
    XferId id = next_id_++;
    xfers_[id] = nullptr;
    return id;
  }

  Status Join(int rank, const std::vector<int>& peers) {
    SS_RETURN_IF_ERROR(CheckUsable());
    if (rank_ >= 0) return FailedPreconditionError("loopback: Connect called twice");
    if (rank < 0) return InvalidArgumentError("loopback: negative rank " + std::to_string(rank));
    std::lock_guard<std::mutex> lk(hub_->mu);
    auto it = hub_->ranks.find(rank);
    if (it != hub_->ranks.end() && !it->second.gone) {
      return InvalidArgumentError("loopback: rank " + std::to_string(rank) +
                                  " already joined this hub");
    }
    auto& r = hub_->ranks[rank];
    r = LoopbackHub::Rank{};
    r.regions = regions_;
    rank_ = rank;
    peers_ = std::set<int>(peers.begin(), peers.end());
    hub_->cv.notify_all();
    return OkStatus();
  }

  Status WaitPeers(Millis timeout) {
    std::unique_lock<std::mutex> lk(hub_->mu);
    auto deadline = std::chrono::steady_clock::now() + store_net::ClampWait(timeout);
    for (int p : peers_) {
      if (!hub_->cv.wait_until(lk, deadline, [&] { return hub_->ranks.count(p) > 0; })) {
        return DeadlineExceededError("loopback connect rank " + std::to_string(rank_) +
                                     ": peer rank " + std::to_string(p) + " did not join within " +
                                     std::to_string(timeout.count()) + " ms");
      }
      if (hub_->ranks[p].gone) return PeerGone(p);
    }
    connected_ = true;
    return OkStatus();
  }

  void Leave() {
    if (rank_ < 0 || left_) return;
    left_ = true;
    std::lock_guard<std::mutex> lk(hub_->mu);
    auto& r = hub_->ranks[rank_];
    r.gone = true;
    r.regions.clear();  // nobody may write into memory that is going away
    r.unexpected.clear();
    for (auto& rv : r.posted) {
      rv->done = true;
      rv->error = AbortedError("loopback transport aborted");
    }
    r.posted.clear();
    hub_->cv.notify_all();
  }

  std::shared_ptr<LoopbackHub> hub_;
  std::vector<LoopbackHub::Region> regions_;
  int rank_ = -1;
  std::set<int> peers_;
  bool connected_ = false;  // after every peer joined
  bool aborted_ = false;
  bool left_ = false;
  XferId next_id_ = 1;
  std::unordered_map<XferId, std::shared_ptr<LoopbackRecv>> xfers_;
};

}  // namespace

std::unique_ptr<Transport> NewLoopbackTransport(std::shared_ptr<LoopbackHub> hub) {
  return std::make_unique<LoopbackTransport>(std::move(hub));
}

Status ConnectLoopbackDirect(Transport& t, int rank, const std::vector<int>& peers,
                             Millis timeout) {
  auto* lt = dynamic_cast<LoopbackTransport*>(&t);
  if (lt == nullptr) {
    return InvalidArgumentError("ConnectLoopbackDirect: transport '" + std::string(t.name()) +
                                "' is not a loopback transport");
  }
  return lt->ConnectDirect(rank, peers, timeout);
}

}  // namespace shardsync
