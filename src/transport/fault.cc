// Fault-injecting decorator (tests): failed posts, lost or late completions, corrupted bytes,
// and a simulated peer death, all counted over this wrapper's posts.
#include <cstring>
#include <unordered_map>

#include "shardsync/transport.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;

class FaultTransportImpl final : public FaultTransport {
 public:
  FaultTransportImpl(std::unique_ptr<Transport> inner, FaultConfig config)
      : inner_(std::move(inner)), config_(config) {}

  FaultCounters counters() const override { return counters_; }
  void set_config(const FaultConfig& config) override { config_ = config; }

  std::string_view name() const override { return inner_->name(); }
  TransportCaps caps() const override {
    TransportCaps c = inner_->caps();
    // Summed copies would checksum the corrupted copy this wrapper sends: callers take the
    // plain path (and sum the bytes themselves), so injected corruption stays detectable.
    c.summed_copy = false;
    c.filled_send = false;
    c.prepared = false;  // prepared pairs would bypass the injected faults
    return c;
  }
  bool CanConnect(const PeerInfo& self, const PeerInfo& peer) const override {
    return inner_->CanConnect(self, peer);
  }
  Result<uint32_t> RegisterMemory(const MemRegion& region) override {
    return inner_->RegisterMemory(region);
  }
  Status Connect(StoreClient& store, const std::string& prefix, int rank,
                 const std::vector<int>& peers, Millis timeout) override {
    return inner_->Connect(store, prefix, rank, peers, timeout);
  }

  Result<XferId> PostPut(int peer, const void* src, size_t bytes, uint32_t remote_region,
                         uint64_t remote_offset) override {
    return Post(bytes > 0, src, bytes, [&](const void* data) {
      return inner_->PostPut(peer, data, bytes, remote_region, remote_offset);
    });
  }
  Result<XferId> PostFlush(int peer) override {
    return Post(false, nullptr, 0, [&](const void*) { return inner_->PostFlush(peer); });
  }
  Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) override {
    return Post(bytes > 0, buf, bytes,
                [&](const void* data) { return inner_->PostSend(peer, tag, data, bytes); });
  }
  Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) override {
    return Post(false, nullptr, 0,
                [&](const void*) { return inner_->PostRecv(peer, tag, buf, bytes); });
  }

  Result<XferState> Poll(XferId id) override {
    if (Dead()) return DeathStatus();
    auto it = xfers_.find(id);
    if (it == xfers_.end()) {
      return InvalidArgumentError("fault: unknown transfer id " + std::to_string(id));
    }
    Xfer& x = it->second;
    if (!x.inner_done) {
      auto st = inner_->Poll(x.inner);
      if (!st.ok()) {
        xfers_.erase(it);
        return st.status();
      }
      if (*st == XferState::kInProgress) return XferState::kInProgress;
      x.inner_done = true;
      x.done_at = Clock::now();
    }
    if (x.dropped) return XferState::kInProgress;  // a lost completion: the caller must time out
    if (Clock::now() < x.done_at + config_.completion_delay) return XferState::kInProgress;
    xfers_.erase(it);
    return XferState::kDone;
  }

  // A simulated dead peer drives nothing.
  void Progress() override {
    if (!Dead()) inner_->Progress();
  }
  void Abort() override { inner_->Abort(); }

 private:
  struct Xfer {
    XferId inner = 0;
    bool inner_done = false;
    bool dropped = false;
    Clock::time_point done_at;
    std::vector<char> corrupt_copy;  // must outlive the inner transfer
  };

  bool Dead() const {
    return config_.die_after_posts > 0 && counters_.posts > config_.die_after_posts;
  }
  Status DeathStatus() const {
    return UnavailableError("fault: injected peer death after " +
                            std::to_string(config_.die_after_posts) + " posts");
  }

  template <typename F>
  Result<XferId> Post(bool data, const void* src, size_t bytes, F&& post) {
    int n = ++counters_.posts;
    if (n == config_.call_before_post && config_.before_post) config_.before_post();
    if (Dead()) return DeathStatus();
    if (n == config_.fail_post) {
      ++counters_.failed;
      return Status(config_.fail_code, "fault: injected failure of post #" + std::to_string(n));
    }
    Xfer x;
    const void* payload = src;
    if (data && ++counters_.data_posts == config_.corrupt_data_post) {
      const char* p = static_cast<const char*>(src);
      x.corrupt_copy.assign(p, p + bytes);
      x.corrupt_copy[std::min(config_.corrupt_byte, bytes - 1)] ^= static_cast<char>(0xFF);
      payload = x.corrupt_copy.data();
      ++counters_.corrupted;
    }
    SS_ASSIGN_OR_RETURN(x.inner, post(payload));
    if (n == config_.drop_completion) {
      x.dropped = true;
      ++counters_.dropped;
    }
    XferId id = next_id_++;
    xfers_.emplace(id, std::move(x));
    return id;
  }

  std::unique_ptr<Transport> inner_;
  FaultConfig config_;
  FaultCounters counters_;
  XferId next_id_ = 1;
  std::unordered_map<XferId, Xfer> xfers_;
};

}  // namespace

std::unique_ptr<FaultTransport> NewFaultTransport(std::unique_ptr<Transport> inner,
                                                  FaultConfig config) {
  return std::make_unique<FaultTransportImpl>(std::move(inner), config);
}

}  // namespace shardsync
