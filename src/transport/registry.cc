// Transport registry. Built-ins are added on first use from this file (not by static
// registrars in their own files, which a static library link would silently drop).
#include <algorithm>
#include <mutex>

#include "shardsync/transport.h"

namespace shardsync {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<TransportEntry> entries;  // sorted by (priority, name)
};

void Insert(Registry& r, TransportEntry e) {
  r.entries.push_back(std::move(e));
  std::stable_sort(r.entries.begin(), r.entries.end(), [](const auto& a, const auto& b) {
    return a.priority != b.priority ? a.priority < b.priority : a.name < b.name;
  });
}

Registry& GetRegistry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    TransportEntry lb;
    lb.name = "loopback";
    lb.priority = 1000;
    lb.auto_select = false;
    lb.can_connect = [](const PeerInfo& a, const PeerInfo& b) {
      return a.hostname == b.hostname && a.mem == MemKind::kHost && b.mem == MemKind::kHost;
    };
    lb.factory = [](const TransportOptions& o) -> Result<std::unique_ptr<Transport>> {
      if (!o.loopback_hub) {
        return InvalidArgumentError("transport 'loopback' needs TransportOptions.loopback_hub");
      }
      return NewLoopbackTransport(o.loopback_hub);
    };
    Insert(*reg, std::move(lb));
    TransportEntry shm;
    shm.name = "shm";
    shm.priority = 250;
    shm.can_connect = [](const PeerInfo& a, const PeerInfo& b) {
      return a.hostname == b.hostname && a.mem == MemKind::kHost && b.mem == MemKind::kHost;
    };
    shm.factory = [](const TransportOptions&) { return NewShmTransport(); };
    Insert(*reg, std::move(shm));
#ifdef SHARDSYNC_HAVE_UCX
    TransportEntry ucx;
    ucx.name = "ucx";
    ucx.priority = 300;
    // Host memory between any two hosts; GPU memory goes through cuda_ipc / nccl.
    ucx.can_connect = [](const PeerInfo& a, const PeerInfo& b) {
      return a.mem == MemKind::kHost && b.mem == MemKind::kHost;
    };
    ucx.factory = [](const TransportOptions& o) { return NewUcxTransport(o.ucx); };
    Insert(*reg, std::move(ucx));
#endif
    return reg;
  }();
  return *r;
}

}  // namespace

Status RegisterTransport(TransportEntry entry) {
  if (entry.name.empty()) return InvalidArgumentError("RegisterTransport: empty name");
  if (!entry.factory || !entry.can_connect) {
    return InvalidArgumentError("RegisterTransport '" + entry.name +
                                "': factory and can_connect are required");
  }
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (const auto& e : r.entries) {
    if (e.name == entry.name) {
      return InvalidArgumentError("RegisterTransport: '" + entry.name + "' already registered");
    }
  }
  Insert(r, std::move(entry));
  return OkStatus();
}

std::vector<std::string> RegisteredTransports() {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::string> out;
  for (const auto& e : r.entries) out.push_back(e.name);
  return out;
}

Result<std::unique_ptr<Transport>> CreateTransport(const std::string& name,
                                                   const TransportOptions& options) {
  TransportFactory factory;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lk(r.mu);
    for (const auto& e : r.entries) {
      if (e.name == name) factory = e.factory;
    }
  }
  if (!factory) {
    std::string known;
    for (const auto& n : RegisteredTransports()) known += (known.empty() ? "" : ", ") + n;
    return NotFoundError("transport '" + name + "' is not registered (known: " + known + ")");
  }
  return factory(options);
}

Result<std::string> SelectTransport(const PeerInfo& self, const PeerInfo& peer,
                                    std::string_view hint) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lk(r.mu);
  bool hint_known = hint.empty();
  for (const auto& e : r.entries) {
    if (!hint.empty() && e.name != hint) continue;
    if (hint.empty() && !e.auto_select) continue;
    hint_known = true;
    if (e.can_connect(self, peer)) return e.name;
  }
  if (!hint_known) {
    return NotFoundError("transport '" + std::string(hint) + "' is not registered");
  }
  return NotFoundError("no transport" + (hint.empty() ? "" : " '" + std::string(hint) + "'") +
                       " can connect rank " + std::to_string(self.rank) + " (" + self.hostname +
                       ") to rank " + std::to_string(peer.rank) + " (" + peer.hostname + ")");
}

}  // namespace shardsync
