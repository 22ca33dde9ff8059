// The receiving side of a device delta pair (delta_pair.h has the protocol).
//
// Post: one verify launch over its live parameters gives every bucket's checksum (the base it
// holds), sent with the version each bucket was verified at as the bases message. Per bucket, on
// the sender's control message (checked) and its payload: a delta is applied over the base
// gathered from the live parameters into the slot (the inverse of landing: the same runs
// reversed) by the device decode, which checks the base version and checksum the delta names and
// the result's checksum and otherwise leaves the slot as it was (the sync fails: "refused,
// nothing of it landed": the parameters are written only from an accepted slot); a whole bucket
// arrives in the slot as it is. The slot then lands in the parameters and the channel is told (the
// window is free). Once every bucket landed, one verify launch reads every landed word back: the
// session compares those sums with the sender's packed ones (delivered in the control messages) as
// for every pair.
//
// Staged commit (PairDelta::live): the base is gathered from and advertised for the live
// (committed) parameters at the committed version, the bucket lands in staging and the readback
// reads staging. Block FP8 (image pairs): the landing is the FP8 round's (every byte of the
// image into codes, scales and copies), the base its runs reversed, pads read as zeros.
//
// Memory: a window of two largest buckets (slot + encoded) and the codec's scratch. A bucket it
// began landing is of no verified version until its readback verified it, so after a failed sync
// the next one sends such buckets whole (the base version differs).
#include "cuda/cuda_util.h"
#include "cuda/delta/delta_pair.h"
#include "cuda/nccl/fp8_rounds.h"

namespace shardsync::gpu::delta_pair {
namespace {

class DeltaRecvPair final : public PreparedPair {
 public:
  DeltaRecvPair(const PairSpec& spec, int device, std::string who)
      : spec_(spec), device_(device), who_(std::move(who)) {}

  Status Init(const OpenRecvChannel& open) {
    const size_t n = spec_.buckets.size();
    const uint64_t max = MaxBucketBytes(spec_);
    SS_ASSIGN_OR_RETURN(stream_, Stream::Create(device_));
    SS_ASSIGN_OR_RETURN(window_, DeviceBuffer::Allocate(WindowBytes(max), device_));
    slot_ = window_->data();
    enc_ = static_cast<unsigned char*>(window_->data()) + WindowEncOffset(max);
    SS_ASSIGN_OR_RETURN(scratch_,
                        DeltaGpuScratch::Allocate(max, spec_.delta.element_size, device_));
    if (spec_.image) {  // the pads: zeros a rebuilt image reads, a sink the landing writes
      SS_ASSIGN_OR_RETURN(pads_, DeviceBuffer::Allocate(2 * kImageRoundScratchBytes, device_));
      SS_CUDA(cudaMemset(pads_->data(), 0, 2 * kImageRoundScratchBytes), who_ + ": pads");
    }
    const bool staged = static_cast<bool>(spec_.delta.live);
    BatchSpec base_verify, landed_verify;
    for (size_t b = 0; b < n; ++b) {
      const PairBucket& pb = spec_.buckets[b];
      SS_ASSIGN_OR_RETURN(BatchSpec land, LandingSpec(pb, b));
      // The base: the same runs reversed, from the live bytes (staged: the committed ones).
      PairBucket live = pb;
      if (staged) SS_RETURN_IF_ERROR(ToLive(&live, b));
      SS_ASSIGN_OR_RETURN(BatchSpec from_live, LandingSpec(live, b));
      const BatchSpec gather = Reversed(from_live);
      SS_ASSIGN_OR_RETURN(auto g, CopyBatch::Prepare(gather, device_));
      SS_ASSIGN_OR_RETURN(auto l, CopyBatch::Prepare(land, device_));
      gather_.push_back(std::move(g));
      land_.push_back(std::move(l));
      AppendVerify(gather, b, &base_verify);
      if (staged) AppendVerify(Reversed(land), b, &landed_verify);
    }
    // The advertisement reads the base; the readback what landed (in place: the same bytes).
    SS_ASSIGN_OR_RETURN(verify_, CopyBatch::Prepare(base_verify, device_));
    if (staged) {
      SS_ASSIGN_OR_RETURN(landed_verify_, CopyBatch::Prepare(landed_verify, device_));
    }
    verified_.assign(n, 0);
    advertised_.assign(n, 0);
    packed_.assign(n, 0);
    DeltaWindow w;
    w.base = window_->data();
    w.bytes = WindowBytes(max);
    w.slot = static_cast<unsigned char*>(slot_);
    w.enc = enc_;
    SS_ASSIGN_OR_RETURN(ch_, open(w));
    return OkStatus();
  }

  Status Post(uint64_t version) override {
    if (state_ != kIdle) return FailedPreconditionError(who_ + ": posted twice");
    SS_CUDA(cudaSetDevice(device_), who_ + ": cudaSetDevice");
    const auto t0 = std::chrono::steady_clock::now();
    version_ = version;
    report_ = PairDeltaReport{};
    // The bases: every bucket's checksum of the live bytes, recomputed each sync (a corrupted
    // or restored byte shows whatever the version says), with the version it was verified at.
    SS_RETURN_IF_ERROR(verify_->Launch(stream_->handle()));
    SS_RETURN_IF_ERROR(stream_->Synchronize(kDeltaLocalWait, who_ + ": checksums of its bases"));
    SS_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, verify_->Checksums());
    bases_ = {version, spec_.buckets.size()};
    for (size_t b = 0; b < sums.size(); ++b) {
      advertised_[b] = spec_.delta.committed ? spec_.delta.committed() : verified_[b];
      bases_.push_back(advertised_[b]);
      bases_.push_back(sums[b]);
    }
    SS_RETURN_IF_ERROR(ch_->SendBases(version, bases_));
    next_ = 0;
    payload_ = false;
    SS_RETURN_IF_ERROR(ch_->PostCtl(version_, &ctl_));
    state_ = kRecv;
    report_.seconds += SecondsSince(t0);
    return OkStatus();
  }

  Result<XferState> Poll() override {
    if (state_ == kIdle) return XferState::kDone;
    SS_CUDA(cudaSetDevice(device_), who_ + ": cudaSetDevice");
    while (next_ < spec_.buckets.size()) {
      if (!payload_) {
        SS_ASSIGN_OR_RETURN(bool in, ch_->CtlIn());
        if (!in) {
          SS_RETURN_IF_ERROR(ch_->CheckPeer());
          return XferState::kInProgress;
        }
        SS_RETURN_IF_ERROR(CheckCtl(next_));
        const bool full = static_cast<DeltaKind>(ctl_[2]) == DeltaKind::kFull;
        SS_RETURN_IF_ERROR(ch_->PostPayload(full ? slot_ : enc_, ctl_[4]));
        payload_ = true;
      }
      SS_ASSIGN_OR_RETURN(bool in, ch_->PayloadIn());
      if (!in) {
        SS_RETURN_IF_ERROR(ch_->CheckPeer());
        return XferState::kInProgress;
      }
      payload_ = false;
      SS_RETURN_IF_ERROR(Apply(next_));
      SS_RETURN_IF_ERROR(ch_->Landed(version_, next_));
      if (++next_ < spec_.buckets.size()) SS_RETURN_IF_ERROR(ch_->PostCtl(version_, &ctl_));
    }
    SS_ASSIGN_OR_RETURN(bool drained, ch_->Drained());
    if (!drained) {
      SS_RETURN_IF_ERROR(ch_->CheckPeer());
      return XferState::kInProgress;
    }
    // Every bucket landed: every landed word read back, for the session's comparison.
    const auto t0 = std::chrono::steady_clock::now();
    CopyBatch* readback = landed_verify_ ? landed_verify_.get() : verify_.get();
    SS_RETURN_IF_ERROR(readback->Launch(stream_->handle()));
    SS_RETURN_IF_ERROR(stream_->Synchronize(kDeltaLocalWait, who_ + ": landed readback"));
    SS_ASSIGN_OR_RETURN(landed_, readback->Checksums());
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
  void Cancel() override {
    if (state_ != kIdle) ch_->Cancel();
    state_ = kIdle;
  }
  std::string Describe() const override {
    return who_ + ", bucket " + std::to_string(next_) + " of " +
           std::to_string(spec_.buckets.size()) + (payload_ ? " (its payload)" : "");
  }

 private:
  // Bucket b's landing from the slot: its wire elements into their tensors (copy codec), or every
  // byte of the image into the e4m3 rows, scales and copies, pads into the sink (block FP8:
  // nccl/fp8_rounds.h).
  Result<BatchSpec> LandingSpec(const PairBucket& pb, size_t b) const {
    if (spec_.image) {
      return ImageRecvRoundSpec(pb, spec_.wire, slot_, sink(),
                                who_ + ", bucket " + std::to_string(b));
    }
    if (!pb.local.empty() && pb.local[0].dtype != spec_.wire) {
      return InvalidArgumentError(who_ + ": bucket " + std::to_string(b) + " lands in " +
                                  std::string(DTypeName(pb.local[0].dtype)) + ", the wire is " +
                                  std::string(DTypeName(spec_.wire)));
    }
    return DeltaBucketBatch(pb.local, pb.bytes, spec_.wire, slot_, BatchMode::kUnpack);
  }
  // A landing reversed: the bytes the tensors hold into the slot, in wire order (the inverse of
  // landing; block FP8's pads read as zeros, as the sender writes them).
  BatchSpec Reversed(const BatchSpec& land) const {
    BatchSpec bs = land;
    bs.mode = BatchMode::kPack;
    for (CopyRun& r : bs.runs) {
      const bool pad = spec_.image && r.out == sink();
      FlipRun(r);
      if (pad) r.in = pads_->data();
    }
    return bs;
  }
  static void AppendVerify(const BatchSpec& gather, size_t b, BatchSpec* verify) {
    verify->mode = BatchMode::kVerify;
    verify->in_dtype = verify->out_dtype = gather.in_dtype;
    for (CopyRun r : gather.runs) {
      r.bucket = static_cast<int32_t>(b);
      verify->runs.push_back(r);
    }
    verify->bucket_bytes.push_back(gather.bucket_bytes.at(0));
  }
  // Staged: every region of bucket b moved from its landing tensor (staging) to the live one.
  Status ToLive(PairBucket* pb, size_t b) const {
    auto move = [&](PackRegion& r) -> Status {
      if (r.base == nullptr) return OkStatus();
      const void* live = spec_.delta.live(r.base);
      if (live == nullptr) {
        return InternalError(who_ + ": bucket " + std::to_string(b) +
                             " lands in a tensor with no live parameter (staged commit)");
      }
      r.base = live;
      return OkStatus();
    };
    for (PackRegion& r : pb->local) SS_RETURN_IF_ERROR(move(r));
    for (EncodedRegion& e : pb->encoded) {
      SS_RETURN_IF_ERROR(move(e.landed));
      SS_RETURN_IF_ERROR(move(e.landed_aux));
    }
    return OkStatus();
  }
  void* sink() const {
    return pads_ ? static_cast<unsigned char*>(pads_->data()) + kImageRoundScratchBytes : nullptr;
  }

  // Bucket b's control message, before its payload is taken anywhere.
  Status CheckCtl(size_t b) const {
    const int64_t bytes = spec_.buckets[b].bytes;
    const auto form = static_cast<DeltaKind>(ctl_[2]);
    const auto reason = static_cast<DeltaReason>(ctl_[3]);
    const uint64_t payload = ctl_[4];
    if (ctl_[0] != version_ || ctl_[1] != b || ctl_[2] > uint64_t(DeltaKind::kPacked) ||
        ctl_[3] > uint64_t(DeltaReason::kCost) ||
        (form == DeltaKind::kFull) == (reason == DeltaReason::kDelta) ||
        (form == DeltaKind::kFull ? payload != uint64_t(bytes)
                                  : payload < kDeltaHeaderBytes || payload >= uint64_t(bytes))) {
      return DataLossError(
          who_ + ": malformed control message from sync rank " + std::to_string(spec_.peer) +
          " for bucket " + std::to_string(b) + " (version " + std::to_string(ctl_[0]) +
          ", bucket " + std::to_string(ctl_[1]) + ", form " + std::to_string(ctl_[2]) +
          ", reason " + std::to_string(ctl_[3]) + ", " + std::to_string(payload) + " bytes)");
    }
    return OkStatus();
  }

  // Bucket b's payload arrived: its delta decoded over the base, or the whole bucket, lands in
  // the parameters.
  Status Apply(size_t b) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t bytes = spec_.buckets[b].bytes;
    const std::string where =
        "message from sync rank " + std::to_string(spec_.peer) + ", bucket " + std::to_string(b);
    const auto form = static_cast<DeltaKind>(ctl_[2]);
    const uint64_t payload = ctl_[4];
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
    SS_RETURN_IF_ERROR(stream_->Synchronize(kDeltaLocalWait, who_ + ": landing " + where));
    packed_[b] = ctl_[5];
    PairDeltaBucket o;
    o.reason = static_cast<DeltaReason>(ctl_[3]);
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

  PairSpec spec_;
  int device_;
  std::string who_;
  std::unique_ptr<DeltaRecvChannel> ch_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<DeviceBuffer> window_;
  void* slot_ = nullptr;
  unsigned char* enc_ = nullptr;
  std::unique_ptr<DeltaGpuScratch> scratch_;
  std::vector<std::unique_ptr<CopyBatch>> gather_, land_;
  std::unique_ptr<DeviceBuffer> pads_;  // block FP8: zeros, then the landing's sink
  // The base's checksums (the advertisement), and under a staged commit what landed (staging)
  // for the readback; in place verify_ reads both.
  std::unique_ptr<CopyBatch> verify_, landed_verify_;
  std::vector<uint64_t> verified_;  // per bucket: the version its bytes were verified at (0: none)
  std::vector<uint64_t> advertised_;  // this sync's advertisement
  std::vector<uint64_t> packed_, landed_;
  std::vector<uint64_t> bases_;  // the bases message
  DeltaCtl ctl_{};
  bool payload_ = false;  // bucket next_'s control message was checked, its payload is posted
  uint64_t version_ = 0;
  size_t next_ = 0;
  enum { kIdle, kRecv } state_ = kIdle;
  PairDeltaReport report_;
};

}  // namespace

Result<std::unique_ptr<PreparedPair>> MakeDeltaRecvPair(const PairSpec& spec, int device,
                                                        std::string who,
                                                        const OpenRecvChannel& open) {
  auto p = std::make_unique<DeltaRecvPair>(spec, device, std::move(who));
  SS_RETURN_IF_ERROR(p->Init(open));
  return std::unique_ptr<PreparedPair>(std::move(p));
}

}  // namespace shardsync::gpu::delta_pair
