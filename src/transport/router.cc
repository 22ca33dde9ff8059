// Routed transport (transport.h, NewRoutedTransport): each peer served by the transport that fits
// the pair best, chosen at Connect from both ranks' PeerInfo, the way NCCL picks its transport per
// peer. Post* / Poll / Prepare dispatch by peer; ids are the router's own.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardsync/transport.h"

namespace shardsync {
namespace {

// PeerInfo on the wire: tab-separated, host identities (checked at Connect) and PCI ids hold no
// tabs.
std::string EncodePeer(const PeerInfo& p) {
  return std::to_string(p.rank) + "\t" + p.hostname + "\t" +
         (p.mem == MemKind::kCuda ? "cuda" : "host") + "\t" + std::to_string(p.device) + "\t" +
         p.gpu_id;
}

Result<PeerInfo> DecodePeer(const std::string& text, int rank) {
  std::vector<std::string> f;
  size_t at = 0;
  while (true) {
    const size_t t = text.find('\t', at);
    f.push_back(text.substr(at, t == std::string::npos ? std::string::npos : t - at));
    if (t == std::string::npos) break;
    at = t + 1;
  }
  const std::string bad = "routing: peer record of rank " + std::to_string(rank) + " is malformed";
  if (f.size() != 5 || (f[2] != "cuda" && f[2] != "host")) return DataLossError(bad + ": " + text);
  PeerInfo p;
  char* end = nullptr;
  p.rank = static_cast<int>(std::strtol(f[0].c_str(), &end, 10));
  if (f[0].empty() || *end != '\0' || p.rank != rank) {
    return DataLossError(bad + " (names rank '" + f[0] + "')");
  }
  p.hostname = f[1];
  p.mem = f[2] == "cuda" ? MemKind::kCuda : MemKind::kHost;
  p.device = static_cast<int>(std::strtol(f[3].c_str(), &end, 10));
  if (f[3].empty() || *end != '\0') return DataLossError(bad + " (device '" + f[3] + "')");
  p.gpu_id = f[4];
  return p;
}

class RoutedTransport final : public Transport {
 public:
  explicit RoutedTransport(RouteOptions o) : opt_(std::move(o)) {
    if (opt_.hint == "auto") opt_.hint.clear();
  }
  ~RoutedTransport() override {
    // Sub-transports may reference each other's streams through the caller; destroy in reverse.
    while (!subs_.empty()) subs_.pop_back();
  }

  std::string_view name() const override { return "routed"; }

  TransportCaps caps() const override {
    if (subs_.empty()) {
      TransportCaps c;
      c.host_memory = opt_.self.mem == MemKind::kHost;
      c.device_memory = opt_.self.mem == MemKind::kCuda;
      c.two_sided = true;
      return c;
    }
    TransportCaps c = subs_[0].t->caps();
    for (const Sub& s : subs_) {
      const TransportCaps d = s.t->caps();
      c.host_memory &= d.host_memory;
      c.device_memory &= d.device_memory;
      c.one_sided_put &= d.one_sided_put;
      c.two_sided &= d.two_sided;
      c.same_node_only |= d.same_node_only;
      c.summed_copy &= d.summed_copy;
      c.filled_send &= d.filled_send;
      c.tag_matching &= d.tag_matching;
      c.prepared &= d.prepared;
    }
    return c;
  }

  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return SelectTransport(self, peer, "").ok() ||
           (!opt_.hint.empty() && SelectTransport(self, peer, opt_.hint).ok());
  }

  Result<uint32_t> RegisterMemory(const MemRegion& region) override {
    if (connected_) return FailedPreconditionError("routing: RegisterMemory after Connect");
    regions_.push_back(region);
    return static_cast<uint32_t>(regions_.size() - 1);
  }

  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override {
    if (connected_) return FailedPreconditionError("routing: Connect called twice");
    if (!opt_.hint.empty()) {
      const auto known = RegisteredTransports();
      if (std::find(known.begin(), known.end(), opt_.hint) == known.end()) {
        std::string list;
        for (const auto& n : known) list += (list.empty() ? "" : ", ") + n;
        return InvalidArgumentError("transport hint '" + opt_.hint +
                                    "' is not registered (known: " + list + ")");
      }
    }
    if (opt_.self.hostname.empty() ||
        opt_.self.hostname.find_first_of("\t\n") != std::string::npos) {
      return InvalidArgumentError("routing: host identity '" + opt_.self.hostname +
                                  "' (SHARDSYNC_HOST_ID, else the hostname) is empty or holds a "
                                  "tab or newline, which the peer record cannot carry");
    }
    opt_.self.rank = rank;
    SS_RETURN_IF_ERROR(store.Set(prefix + "route/" + std::to_string(rank), EncodePeer(opt_.self)));
    // Choose per peer; group peers by transport, in registry (priority) order on every rank, so
    // the sub-transports connect in one global order and no two ranks wait on each other.
    std::map<std::string, std::vector<int>> by_name;
    for (int p : peers) {
      auto text = store.Get(prefix + "route/" + std::to_string(p), timeout);
      if (!text.ok()) {
        return Status(text.status().code(), "routing: rank " + std::to_string(rank) +
                                                " got no peer record from rank " +
                                                std::to_string(p) + ": " + text.status().message());
      }
      SS_ASSIGN_OR_RETURN(PeerInfo info, DecodePeer(*text, p));
      SS_ASSIGN_OR_RETURN(std::string name, Choose(info));
      by_name[name].push_back(p);
    }
    for (const std::string& name : RegisteredTransports()) {
      auto it = by_name.find(name);
      if (it == by_name.end()) continue;
      SS_ASSIGN_OR_RETURN(auto t, CreateTransport(name, opt_.options));
      for (size_t i = 0; i < regions_.size(); ++i) {
        SS_ASSIGN_OR_RETURN(uint32_t id, t->RegisterMemory(regions_[i]));
        if (id != i) {
          return InternalError("routing: transport " + name + " numbered region " +
                               std::to_string(i) + " as " + std::to_string(id));
        }
      }
      SS_RETURN_IF_ERROR(t->Connect(store, prefix + name + "/", rank, it->second, timeout)
                             .Annotate("routing: connecting " + name));
      for (int p : it->second) peer_sub_[p] = subs_.size();
      subs_.push_back({name, std::move(t)});
    }
    connected_ = true;
    return OkStatus();
  }

  Result<XferId> PostPut(int peer, const void* src, size_t bytes, uint32_t remote_region,
                         uint64_t remote_offset) override {
    SS_ASSIGN_OR_RETURN(size_t s, SubOf(peer));
    return Track(s, subs_[s].t->PostPut(peer, src, bytes, remote_region, remote_offset));
  }
  Result<XferId> PostFlush(int peer) override {
    SS_ASSIGN_OR_RETURN(size_t s, SubOf(peer));
    return Track(s, subs_[s].t->PostFlush(peer));
  }
  Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) override {
    SS_ASSIGN_OR_RETURN(size_t s, SubOf(peer));
    return Track(s, subs_[s].t->PostSend(peer, tag, buf, bytes));
  }
  Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) override {
    SS_ASSIGN_OR_RETURN(size_t s, SubOf(peer));
    return Track(s, subs_[s].t->PostRecv(peer, tag, buf, bytes));
  }
  Result<XferId> PostSendSummed(int peer, uint64_t tag, const void* buf, size_t bytes,
                                CopySum* sum) override {
    SS_ASSIGN_OR_RETURN(size_t s, SubOf(peer));
    return Track(s, subs_[s].t->PostSendSummed(peer, tag, buf, bytes, sum));
  }
  Result<XferId> PostRecvSummed(int peer, uint64_t tag, void* buf, size_t bytes,
                                CopySum* sum) override {
    SS_ASSIGN_OR_RETURN(size_t s, SubOf(peer));
    return Track(s, subs_[s].t->PostRecvSummed(peer, tag, buf, bytes, sum));
  }
  Result<XferId> PostSendFilled(int peer, uint64_t tag, size_t bytes, SendFill fill) override {
    SS_ASSIGN_OR_RETURN(size_t s, SubOf(peer));
    return Track(s, subs_[s].t->PostSendFilled(peer, tag, bytes, std::move(fill)));
  }

  Result<XferState> Poll(XferId id) override {
    auto it = ids_.find(id);
    if (it == ids_.end())
      return InvalidArgumentError("routing: unknown xfer " + std::to_string(id));
    auto st = subs_[it->second.first].t->Poll(it->second.second);
    if (!st.ok() || *st == XferState::kDone) ids_.erase(it);
    return st;
  }

  void Progress() override {
    for (Sub& s : subs_) s.t->Progress();
  }
  void Abort() override {
    for (Sub& s : subs_) s.t->Abort();
  }

  Result<std::unique_ptr<PreparedPair>> Prepare(StoreClient& store, const PairSpec& spec,
                                                Millis timeout) override {
    SS_ASSIGN_OR_RETURN(size_t s, SubOf(spec.peer));
    return subs_[s].t->Prepare(store, spec, timeout);
  }
  TransportCaps PeerCaps(int peer) const override {
    auto it = peer_sub_.find(peer);
    return it == peer_sub_.end() ? caps() : subs_[it->second].t->caps();
  }
  std::string PeerTransport(int peer) const override {
    auto it = peer_sub_.find(peer);
    return it == peer_sub_.end() ? std::string("none") : subs_[it->second].name;
  }

 private:
  struct Sub {
    std::string name;
    std::unique_ptr<Transport> t;
  };

  // The hint where it can connect the pair, else the automatic choice.
  Result<std::string> Choose(const PeerInfo& peer) const {
    if (!opt_.hint.empty()) {
      auto h = SelectTransport(opt_.self, peer, opt_.hint);
      if (h.ok()) return h;
    }
    auto any = SelectTransport(opt_.self, peer, "");
    if (any.ok() || opt_.self.mem == peer.mem) return any;
    auto where = [](const PeerInfo& p) {
      return (p.mem == MemKind::kCuda ? "device memory (cuda:" + std::to_string(p.device) + ")"
                                      : std::string("host memory")) +
             " on " + p.hostname;
    };
    return NotFoundError("routing: rank " + std::to_string(opt_.self.rank) + " binds " +
                         where(opt_.self) + ", its peer rank " + std::to_string(peer.rank) + " " +
                         where(peer) +
                         ": no transport moves bytes between the two; bind both sides in the same "
                         "kind of memory (a Python host session, device=None, stages CUDA "
                         "tensors through host memory)");
  }

  Result<size_t> SubOf(int peer) const {
    auto it = peer_sub_.find(peer);
    if (it == peer_sub_.end()) {
      return InvalidArgumentError("routing: rank " + std::to_string(peer) +
                                  " is not a connected peer");
    }
    return it->second;
  }

  Result<XferId> Track(size_t sub, Result<XferId> inner) {
    SS_RETURN_IF_ERROR(inner.status());
    const XferId id = next_id_++;
    ids_.emplace(id, std::make_pair(sub, *inner));
    return id;
  }

  RouteOptions opt_;
  bool connected_ = false;
  std::vector<MemRegion> regions_;
  std::vector<Sub> subs_;
  std::map<int, size_t> peer_sub_;
  std::map<XferId, std::pair<size_t, XferId>> ids_;
  XferId next_id_ = 1;
};

}  // namespace

Result<std::unique_ptr<Transport>> NewRoutedTransport(RouteOptions options) {
  return std::unique_ptr<Transport>(new RoutedTransport(std::move(options)));
}

}  // namespace shardsync
