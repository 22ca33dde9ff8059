// The receiving side of a cuda_ipc delta pair (delta_ipc.cc has the protocol).
#include "cuda/cuda_ipc/delta_ipc_internal.h"

namespace shardsync::gpu::ipc::delta_internal {
namespace {

class DeltaRecvPair final : public PreparedPair {
 public:
  DeltaRecvPair(CudaIpcTransport& t, const PairSpec& spec)
      : t_(t), spec_(spec), who_("cuda_ipc: delta pair from rank " + std::to_string(spec.peer)) {}

  Status Init(StoreClient& store) {
    const size_t n = spec_.buckets.size();
    uint64_t max = 0;
    for (const PairBucket& b : spec_.buckets) max = std::max<uint64_t>(max, b.bytes);
    SS_ASSIGN_OR_RETURN(stream_, Stream::Create(t_.device()));
    enc_off_ = DeltaAlign(max);
    SS_ASSIGN_OR_RETURN(window_, DeviceBuffer::Allocate(enc_off_ + max, t_.device()));
    slot_ = window_->data();
    enc_ = static_cast<unsigned char*>(window_->data()) + enc_off_;
    SS_ASSIGN_OR_RETURN(scratch_,
                        DeltaGpuScratch::Allocate(max, spec_.delta.element_size, t_.device()));
    BatchSpec verify;
    verify.mode = BatchMode::kVerify;
    verify.in_dtype = verify.out_dtype = spec_.wire;
    for (size_t b = 0; b < n; ++b) {
      const PairBucket& pb = spec_.buckets[b];
      if (!pb.local.empty() && pb.local[0].dtype != spec_.wire) {
        return InvalidArgumentError(who_ + ": bucket " + std::to_string(b) + " lands in " +
                                    std::string(DTypeName(pb.local[0].dtype)) + ", the wire is " +
                                    std::string(DTypeName(spec_.wire)));
      }
      SS_ASSIGN_OR_RETURN(
          auto g, CopyBatch::Prepare(
                      DeltaBucketBatch(pb.local, pb.bytes, spec_.wire, slot_, BatchMode::kPack),
                      t_.device()));
      SS_ASSIGN_OR_RETURN(
          auto l, CopyBatch::Prepare(
                      DeltaBucketBatch(pb.local, pb.bytes, spec_.wire, slot_, BatchMode::kUnpack),
                      t_.device()));
      gather_.push_back(std::move(g));
      land_.push_back(std::move(l));
      BatchSpec one = DeltaBucketBatch(pb.local, pb.bytes, spec_.wire, slot_, BatchMode::kPack);
      for (CopyRun& r : one.runs) r.bucket = static_cast<int32_t>(b);
      verify.runs.insert(verify.runs.end(), one.runs.begin(), one.runs.end());
      verify.bucket_bytes.push_back(pb.bytes);
    }
    SS_ASSIGN_OR_RETURN(verify_, CopyBatch::Prepare(verify, t_.device()));
    verified_.assign(n, 0);
    advertised_.assign(n, 0);
    packed_.assign(n, 0);
    // The window, exported for the sender (whole 2 MiB pages: DeviceBuffer::Allocate).
    DeltaWindowRecord w;
    w.pid = getpid();
    w.base = reinterpret_cast<uint64_t>(window_->data());
    w.bytes = enc_off_ + max;
    w.slot = 0;
    w.enc = enc_off_;
    SS_CUDA(cudaIpcGetMemHandle(&w.handle, window_->data()), who_ + ": export of its window");
    return store.Set(spec_.key + "dwindow",
                     std::string(reinterpret_cast<const char*>(&w), sizeof(w)));
  }

  Status Post(uint64_t version) override {
    if (state_ != kIdle) return FailedPreconditionError(who_ + ": posted twice");
    SS_CUDA(cudaSetDevice(t_.device()), who_ + ": cudaSetDevice");
    const auto t0 = std::chrono::steady_clock::now();
    version_ = version;
    report_ = PairDeltaReport{};
    // The bases: every bucket's checksum of the live bytes, recomputed each sync (a corrupted
    // or restored byte shows whatever the version says), with the version it was verified at.
    SS_RETURN_IF_ERROR(verify_->Launch(stream_->handle()));
    SS_RETURN_IF_ERROR(WaitLocal(*stream_, who_ + ": checksums of its bases"));
    SS_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, verify_->Checksums());
    bases_ = {version, spec_.buckets.size()};
    for (size_t b = 0; b < sums.size(); ++b) {
      advertised_[b] = verified_[b];
      bases_.push_back(verified_[b]);
      bases_.push_back(sums[b]);
    }
    SS_ASSIGN_OR_RETURN(XferId id, t_.PostSendHost(spec_.peer, DeltaTag(kBasesTagBase, version),
                                                   bases_.data(), bases_.size() * 8));
    sends_.push_back(id);
    next_ = 0;
    SS_RETURN_IF_ERROR(PostCtl());
    state_ = kRecv;
    report_.seconds += SecondsSince(t0);
    return OkStatus();
  }

  Result<XferState> Poll() override {
    if (state_ == kIdle) return XferState::kDone;
    SS_CUDA(cudaSetDevice(t_.device()), who_ + ": cudaSetDevice");
    SS_RETURN_IF_ERROR(PollSends(t_, sends_));
    while (next_ < spec_.buckets.size()) {
      SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(ctl_id_));
      if (st == XferState::kInProgress) {
        SS_RETURN_IF_ERROR(t_.CheckPeer(spec_.peer));
        return st;
      }
      SS_RETURN_IF_ERROR(Apply(next_));
      const uint64_t ack[2] = {version_, next_};
      SS_ASSIGN_OR_RETURN(XferId id, t_.PostSendHost(spec_.peer, DeltaTag(kAckTagBase, version_),
                                                     ack, sizeof(ack)));
      sends_.push_back(id);
      if (++next_ < spec_.buckets.size()) SS_RETURN_IF_ERROR(PostCtl());
    }
    SS_RETURN_IF_ERROR(PollSends(t_, sends_));
    if (!sends_.empty()) return XferState::kInProgress;
    // Every bucket landed: every landed word read back, for the session's comparison.
    const auto t0 = std::chrono::steady_clock::now();
    SS_RETURN_IF_ERROR(verify_->Launch(stream_->handle()));
    SS_RETURN_IF_ERROR(WaitLocal(*stream_, who_ + ": landed readback"));
    SS_ASSIGN_OR_RETURN(landed_, verify_->Checksums());
    for (size_t b = 0; b < landed_.size(); ++b) {
      if (landed_[b] == packed_[b]) verified_[b] = version_;
    }
    report_.seconds += SecondsSince(t0);
    state_ = kIdle;
    return XferState::kDone;
  }

  Result<PairSums> Sums() override {
    PairSums s;
    s.packed = packed_;
    s.landed = landed_;
    return s;
  }
  const PairDeltaReport* Delta() const override { return &report_; }
  bool DeliversSums() const override { return true; }
  // Posted receives of a cancelled sync are never polled again (their tags name its version).
  void Cancel() override {
    state_ = kIdle;
    sends_.clear();
  }
  std::string Describe() const override {
    return who_ + ", bucket " + std::to_string(next_) + " of " +
           std::to_string(spec_.buckets.size());
  }

 private:
  Status PostCtl() {
    SS_ASSIGN_OR_RETURN(
        ctl_id_, t_.PostRecvHost(spec_.peer, DeltaTag(kCtlTagBase, version_), ctl_, sizeof(ctl_)));
    return OkStatus();
  }

  // Bucket b's control message arrived: its delta decoded over the base, or the whole bucket,
  // lands in the parameters.
  Status Apply(size_t b) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t bytes = spec_.buckets[b].bytes;
    const std::string where =
        "message from sync rank " + std::to_string(spec_.peer) + ", bucket " + std::to_string(b);
    const auto form = static_cast<DeltaKind>(ctl_[2]);
    const auto reason = static_cast<DeltaReason>(ctl_[3]);
    const uint64_t payload = ctl_[4];
    if (ctl_[0] != version_ || ctl_[1] != b || ctl_[2] > uint64_t(DeltaKind::kBitmap) ||
        ctl_[3] > uint64_t(DeltaReason::kCost) ||
        (form == DeltaKind::kFull) == (reason == DeltaReason::kDelta) ||
        (form == DeltaKind::kFull ? payload != uint64_t(bytes)
                                  : payload < kDeltaHeaderBytes || payload >= uint64_t(bytes))) {
      return DataLossError(who_ + ": malformed control message for " + where + " (version " +
                           std::to_string(ctl_[0]) + ", bucket " + std::to_string(ctl_[1]) +
                           ", form " + std::to_string(ctl_[2]) + ", reason " +
                           std::to_string(ctl_[3]) + ", " + std::to_string(payload) + " bytes)");
    }
    void* s = stream_->handle();
    if (form != DeltaKind::kFull) {
      // The base: the bytes this rank holds, in wire order.
      SS_RETURN_IF_ERROR(gather_[b]->Launch(s));
      DeltaGpuDecodeArgs a;
      a.encoded = enc_;
      a.encoded_bytes = payload;
      a.bucket = slot_;
      a.bucket_bytes = static_cast<size_t>(bytes);
      a.expect.bucket = where;
      a.expect.element_size = spec_.delta.element_size;
      a.expect.base_version = advertised_[b];
      SS_RETURN_IF_ERROR(EnqueueDeltaDecode(a, scratch_.get(), s));
      Status decoded = FinishDeltaDecode(scratch_.get(), kDeltaLocalWait);
      if (!decoded.ok()) {
        return decoded.Annotate(who_ + ": the delta of version " + std::to_string(version_) +
                                " was refused, nothing of it landed");
      }
    }
    // From here the bucket's bytes are of no verified version until the readback says so.
    verified_[b] = 0;
    SS_RETURN_IF_ERROR(land_[b]->Launch(s));
    SS_RETURN_IF_ERROR(WaitLocal(*stream_, who_ + ": landing " + where));
    packed_[b] = ctl_[5];
    PairDeltaBucket o;
    o.reason = reason;
    o.wire_bytes = payload;
    o.full_bytes = static_cast<uint64_t>(bytes);
    if (form != DeltaKind::kFull) {
      o.changed = ctl_[6];
      o.elements = static_cast<uint64_t>(bytes / spec_.delta.element_size);
    }
    report_.buckets.push_back(o);
    report_.seconds += SecondsSince(t0);
    return OkStatus();
  }

  CudaIpcTransport& t_;
  PairSpec spec_;
  std::string who_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<DeviceBuffer> window_;
  void* slot_ = nullptr;
  unsigned char* enc_ = nullptr;
  size_t enc_off_ = 0;
  std::unique_ptr<DeltaGpuScratch> scratch_;
  std::vector<std::unique_ptr<CopyBatch>> gather_, land_;
  std::unique_ptr<CopyBatch> verify_;
  std::vector<uint64_t> verified_;  // per bucket: the version its bytes were verified at (0: none)
  std::vector<uint64_t> advertised_;  // this sync's advertisement
  std::vector<uint64_t> packed_, landed_;
  std::vector<uint64_t> bases_;  // the ready message
  uint64_t ctl_[kDeltaCtlWords] = {};
  XferId ctl_id_ = 0;
  std::vector<XferId> sends_;
  uint64_t version_ = 0;
  size_t next_ = 0;
  enum { kIdle, kRecv } state_ = kIdle;
  PairDeltaReport report_;
};

}  // namespace

Result<std::unique_ptr<PreparedPair>> MakeDeltaRecvPair(CudaIpcTransport& t, StoreClient& store,
                                                        const PairSpec& spec) {
  auto p = std::make_unique<DeltaRecvPair>(t, spec);
  SS_RETURN_IF_ERROR(p->Init(store));
  return std::unique_ptr<PreparedPair>(std::move(p));
}

}  // namespace shardsync::gpu::ipc::delta_internal
