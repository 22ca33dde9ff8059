// cuda_ipc pairs under the delta encoding: the device delta pair's protocol (cuda/delta/
// delta_pair.h) over this transport's two means: control messages through the shared-memory
// mailbox (bases, a bucket's control message, the acknowledgement that it landed) and the
// payload copied by the sender (CUDA IPC) into the receiver's window, which the receiver exports
// through the store at Prepare. The sender copies the next bucket once the last was acknowledged
// (the window is the receiver's until then); it sends a bucket's control message once its copy
// completed, so the payload is in the window when the receiver reads it.
#include <unistd.h>

#include <cstring>

#include "cuda/cuda_ipc/cuda_ipc.h"
#include "cuda/delta/delta_pair.h"

namespace shardsync::gpu::ipc {
namespace {

using delta_pair::DeltaCtl;
using delta_pair::DeltaWindow;

constexpr uint64_t kBasesTagBase = uint64_t{0x5344} << 48;  // the receiver's bases (it is ready)
constexpr uint64_t kCtlTagBase = uint64_t{0x5345} << 48;    // a bucket's control message
constexpr uint64_t kAckTagBase = uint64_t{0x5346} << 48;    // the receiver landed a bucket
constexpr uint64_t kWindowMagic = 0x53535744;               // "SSWD": the receiver's window

uint64_t DeltaTag(uint64_t base, uint64_t version) {
  return base | (version & ((uint64_t{1} << 48) - 1));
}

// The receiver's window, published at Prepare: the sender writes a whole bucket at `slot`, a
// delta at `enc` (byte offsets in the exported allocation).
struct DeltaWindowRecord {
  uint64_t magic = kWindowMagic;
  int32_t pid = 0;
  int32_t pad = 0;
  cudaIpcMemHandle_t handle{};
  uint64_t base = 0, bytes = 0, slot = 0, enc = 0;
};

// Drops the completed transfers of `ids` (host-memory mailbox sends); a failed one's error.
Status PollSends(CudaIpcTransport& t, std::vector<XferId>& ids) {
  for (size_t i = 0; i < ids.size();) {
    SS_ASSIGN_OR_RETURN(XferState st, t.Poll(ids[i]));
    if (st == XferState::kDone) {
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  return OkStatus();
}

Result<bool> Arrived(CudaIpcTransport& t, XferId id) {
  SS_ASSIGN_OR_RETURN(XferState st, t.Poll(id));
  return st == XferState::kDone;
}

class IpcDeltaSend final : public delta_pair::DeltaSendChannel {
 public:
  IpcDeltaSend(CudaIpcTransport& t, int peer, std::string who)
      : t_(t), peer_(peer), who_(std::move(who)) {}
  ~IpcDeltaSend() override {
    if (ev_) cudaEventDestroy(ev_);
  }

  Status Init(StoreClient& store, const std::string& key, uint64_t max, Millis timeout) {
    SS_CUDA(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), who_ + ": event");
    SS_ASSIGN_OR_RETURN(stream_, Stream::Create(t_.device()));
    SS_ASSIGN_OR_RETURN(std::string blob, store.Get(key + "dwindow", timeout));
    DeltaWindowRecord w;
    if (blob.size() != sizeof(w)) {
      return DataLossError(who_ + ": the receiver's window record has " +
                           std::to_string(blob.size()) + " bytes");
    }
    std::memcpy(&w, blob.data(), sizeof(w));
    if (w.magic != kWindowMagic || w.enc < delta_pair::DeltaAlign(max) || w.bytes < w.enc + max) {
      return DataLossError(who_ + ": the receiver's window does not fit bucket of " +
                           std::to_string(max) + " bytes");
    }
    SS_ASSIGN_OR_RETURN(void* base, t_.OpenShared(&w.handle, w.pid, w.base));
    slot_ = static_cast<unsigned char*>(base) + w.slot;
    enc_ = static_cast<unsigned char*>(base) + w.enc;
    return OkStatus();
  }

  Status PostBases(uint64_t version, std::vector<uint64_t>* words) override {
    version_ = version;
    sends_.clear();
    shipped_ = awaiting_ = false;
    SS_ASSIGN_OR_RETURN(bases_id_, t_.PostRecvHost(peer_, DeltaTag(kBasesTagBase, version),
                                                   words->data(), words->size() * 8));
    return OkStatus();
  }
  Result<bool> BasesIn() override { return Arrived(t_, bases_id_); }

  Status Ship(const DeltaCtl& ctl, const void* src, bool delta) override {
    ctl_ = ctl;
    shipped_ = false;
    auto s = static_cast<cudaStream_t>(stream_->handle());
    SS_CUDA(cudaMemcpyAsync(delta ? enc_ : slot_, src, ctl[4], cudaMemcpyDeviceToDevice, s),
            who_ + ": bucket " + std::to_string(ctl[1]) + " into the receiver's window");
    SS_CUDA(cudaEventRecord(ev_, s), who_ + ": event record");
    return OkStatus();
  }
  Result<bool> Shipped() override {
    if (shipped_) return true;
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) return false;
    SS_CUDA(e, who_ + ": bucket " + std::to_string(ctl_[1]) + " copied");
    // In the window: the control message, and the acknowledgement awaited.
    SS_ASSIGN_OR_RETURN(
        ack_id_, t_.PostRecvHost(peer_, DeltaTag(kAckTagBase, version_), ack_, sizeof(ack_)));
    SS_ASSIGN_OR_RETURN(XferId id, t_.PostSendHost(peer_, DeltaTag(kCtlTagBase, version_),
                                                   ctl_.data(), sizeof(ctl_)));
    sends_.push_back(id);
    shipped_ = awaiting_ = true;
    return true;
  }
  Result<bool> WindowFree() override {
    SS_RETURN_IF_ERROR(PollSends(t_, sends_));
    if (!awaiting_) return true;
    SS_ASSIGN_OR_RETURN(bool in, Arrived(t_, ack_id_));
    if (!in) return false;
    if (ack_[0] != version_ || ack_[1] != ctl_[1]) {
      return DataLossError(who_ + ": acknowledgement of version " + std::to_string(ack_[0]) +
                           " bucket " + std::to_string(ack_[1]) + ", expected bucket " +
                           std::to_string(ctl_[1]));
    }
    awaiting_ = false;
    return true;
  }
  Result<bool> Drained() override {
    SS_RETURN_IF_ERROR(PollSends(t_, sends_));
    return sends_.empty();
  }
  Status CheckPeer() override { return t_.CheckPeer(peer_); }
  // Posted receives of a cancelled sync are never polled again (their tags name its version).
  void Cancel() override {
    sends_.clear();
    awaiting_ = false;
  }

 private:
  CudaIpcTransport& t_;
  int peer_;
  std::string who_;
  std::unique_ptr<Stream> stream_;  // the copies into the window
  cudaEvent_t ev_ = nullptr;
  unsigned char *slot_ = nullptr, *enc_ = nullptr;  // the receiver's window, mapped here
  uint64_t version_ = 0;
  XferId bases_id_ = 0, ack_id_ = 0;
  uint64_t ack_[2] = {};
  DeltaCtl ctl_{};
  bool shipped_ = false, awaiting_ = false;
  std::vector<XferId> sends_;
};

class IpcDeltaRecv final : public delta_pair::DeltaRecvChannel {
 public:
  IpcDeltaRecv(CudaIpcTransport& t, int peer) : t_(t), peer_(peer) {}

  Status SendBases(uint64_t version, const std::vector<uint64_t>& words) override {
    sends_.clear();
    SS_ASSIGN_OR_RETURN(XferId id, t_.PostSendHost(peer_, DeltaTag(kBasesTagBase, version),
                                                   words.data(), words.size() * 8));
    sends_.push_back(id);
    return OkStatus();
  }
  Status PostCtl(uint64_t version, DeltaCtl* ctl) override {
    SS_ASSIGN_OR_RETURN(
        ctl_id_, t_.PostRecvHost(peer_, DeltaTag(kCtlTagBase, version), ctl->data(), sizeof(*ctl)));
    return OkStatus();
  }
  Result<bool> CtlIn() override {
    SS_RETURN_IF_ERROR(PollSends(t_, sends_));
    return Arrived(t_, ctl_id_);
  }
  // The sender copied the payload before it sent the control message.
  Status PostPayload(void*, size_t) override { return OkStatus(); }
  Result<bool> PayloadIn() override { return true; }
  Status Landed(uint64_t version, uint64_t bucket) override {
    const uint64_t ack[2] = {version, bucket};
    SS_ASSIGN_OR_RETURN(XferId id,
                        t_.PostSendHost(peer_, DeltaTag(kAckTagBase, version), ack, sizeof(ack)));
    sends_.push_back(id);
    return OkStatus();
  }
  Result<bool> Drained() override {
    SS_RETURN_IF_ERROR(PollSends(t_, sends_));
    return sends_.empty();
  }
  Status CheckPeer() override { return t_.CheckPeer(peer_); }
  void Cancel() override { sends_.clear(); }

 private:
  CudaIpcTransport& t_;
  int peer_;
  XferId ctl_id_ = 0;
  std::vector<XferId> sends_;
};

}  // namespace

Result<std::unique_ptr<PreparedPair>> PrepareDeltaPair(CudaIpcTransport& t, StoreClient& store,
                                                       const PairSpec& spec, Millis timeout) {
  const std::string who = std::string("cuda_ipc: delta pair ") + (spec.send ? "to" : "from") +
                          " rank " + std::to_string(spec.peer);
  SS_RETURN_IF_ERROR(delta_pair::CheckDeltaSpec(spec, who));
  SS_CUDA(cudaSetDevice(t.device()), who + ": cudaSetDevice");
  if (spec.send) {
    auto ch = std::make_unique<IpcDeltaSend>(t, spec.peer, who);
    SS_RETURN_IF_ERROR(ch->Init(store, spec.key, delta_pair::MaxBucketBytes(spec), timeout));
    return delta_pair::MakeDeltaSendPair(spec, t.device(), who, std::move(ch));
  }
  return delta_pair::MakeDeltaRecvPair(
      spec, t.device(), who,
      [&](const DeltaWindow& win) -> Result<std::unique_ptr<delta_pair::DeltaRecvChannel>> {
        // The window, exported for the sender (whole 2 MiB pages: DeviceBuffer::Allocate).
        DeltaWindowRecord w;
        w.pid = getpid();
        w.base = reinterpret_cast<uint64_t>(win.base);
        w.bytes = win.bytes;
        w.slot = static_cast<uint64_t>(win.slot - static_cast<unsigned char*>(win.base));
        w.enc = static_cast<uint64_t>(win.enc - static_cast<unsigned char*>(win.base));
        SS_CUDA(cudaIpcGetMemHandle(&w.handle, win.base), who + ": export of its window");
        SS_RETURN_IF_ERROR(store.Set(spec.key + "dwindow",
                                     std::string(reinterpret_cast<const char*>(&w), sizeof(w))));
        return std::unique_ptr<delta_pair::DeltaRecvChannel>(
            std::make_unique<IpcDeltaRecv>(t, spec.peer));
      });
}

}  // namespace shardsync::gpu::ipc
