// cuda_ipc pairs under the delta encoding (PairSpec::delta; docs/delta.md "Device pairs"), the
// host path's protocol (sync/delta_path.h) on device memory, bucket by bucket:
//
// Receiver. Post: one verify launch over its live parameters gives every bucket's checksum (the
// base it holds), sent with the version each bucket was verified at in its ready message (the
// mailbox; the sender waits for it, SignalsReady). Per bucket, on the sender's control message:
// a delta is applied over the base gathered from the live parameters into the slot (the inverse
// of landing: the same runs reversed) by the device decode, which checks the base version and
// checksum the delta names and the result's checksum and writes nothing otherwise (the sync fails:
// "refused, nothing of it landed"); a whole bucket arrives in the slot as it is. The slot then
// lands in the parameters and the receiver acknowledges the bucket (the slot is free). Once every
// bucket landed, one verify launch reads every landed word back: the session compares those sums
// with the sender's packed ones (delivered in the control messages) as for every pair.
//
// Sender. Per bucket: the new wire image packed into a local slot (cast, packed checksum); if
// the receiver's base is the image kept of what it last sent there (same version and checksum,
// sync/delta_path.h CheckBase), its delta against the kept image (EnqueueDeltaEncode); the delta
// or the whole image is copied into the receiver's window (CUDA IPC), the image into the kept
// copy, and the control message names the form, the reason, the length and the checksum. The
// next bucket is packed and encoded while the receiver lands this one; it is copied once that
// one was acknowledged.
//
// Memory: the sender keeps every bucket's wire image (the pair's wire bytes: 2 per bf16 element)
// plus a slot, an encode output of the largest bucket and the codec's scratch (delta_gpu.h); the
// receiver a window of two largest buckets (slot + encoded) and the scratch. A failed sync leaves
// the pairs usable: the sender forgets a bucket whose landing it did not hear of, the receiver
// marks a bucket it began landing as of no verified version until its readback verified it, so
// the next sync sends such buckets whole (no kept image, base version differs).
#include "cuda/cuda_ipc/delta_ipc.h"
#include "cuda/cuda_ipc/delta_ipc_internal.h"

namespace shardsync::gpu::ipc {
namespace delta_internal {
namespace {

std::atomic<int64_t> g_fault_bucket{-1};
std::atomic<int64_t> g_fault_byte{0};

// Every pair's checks of its spec: copies of one dtype, no encoded ops.
Status CheckDeltaSpec(const PairSpec& spec, const std::string& who) {
  if (spec.image) {
    return UnimplementedError(who +
                              ": the delta encoding over cuda_ipc pairs carries copy plans "
                              "only (bf16 / fp32 wire), not block FP8's image pairs");
  }
  const int es = spec.delta.element_size;
  if (es != 1 && es != 2 && es != 4) {
    return InvalidArgumentError(who + ": delta element size " + std::to_string(es));
  }
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    const PairBucket& pb = spec.buckets[b];
    if (pb.bytes <= 0 || pb.bytes % es != 0 || !pb.encoded.empty()) {
      return InvalidArgumentError(who + ": bucket " + std::to_string(b) + " of " +
                                  std::to_string(pb.bytes) +
                                  " bytes does not fit the delta encoding (size, encoded ops)");
    }
    for (const PackRegion& r : pb.local) {
      if (r.dtype != pb.local[0].dtype || !RegionInside(r.region, r.shape)) {
        return InvalidArgumentError(who + ": bucket " + std::to_string(b) +
                                    " has a region of another dtype or out of bounds");
      }
    }
  }
  return OkStatus();
}

class DeltaSendPair final : public PreparedPair {
 public:
  DeltaSendPair(CudaIpcTransport& t, const PairSpec& spec)
      : t_(t), spec_(spec), who_("cuda_ipc: delta pair to rank " + std::to_string(spec.peer)) {}
  ~DeltaSendPair() override {
    cudaSetDevice(t_.device());
    // Work still queued (a cancelled sync) reads the buffers freed below: a bounded wait.
    if (stream_) (void)stream_->Synchronize(kDeltaLocalWait, who_ + ": teardown");
    if (ev_) cudaEventDestroy(ev_);
  }

  Status Init(StoreClient& store, Millis timeout) {
    const size_t n = spec_.buckets.size();
    uint64_t max = 0, total = 0;
    for (const PairBucket& b : spec_.buckets) {
      max = std::max<uint64_t>(max, b.bytes);
      kept_off_.push_back(total);
      total += DeltaAlign(b.bytes);
    }
    SS_ASSIGN_OR_RETURN(stream_, Stream::Create(t_.device()));
    SS_CUDA(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), who_ + ": event");
    SS_ASSIGN_OR_RETURN(kept_, DeviceBuffer::Allocate(total, t_.device()));
    SS_ASSIGN_OR_RETURN(img_, DeviceBuffer::Allocate(max, t_.device()));
    SS_ASSIGN_OR_RETURN(out_, DeviceBuffer::Allocate(max, t_.device()));
    SS_ASSIGN_OR_RETURN(scratch_,
                        DeltaGpuScratch::Allocate(max, spec_.delta.element_size, t_.device()));
    for (size_t b = 0; b < n; ++b) {
      const PairBucket& pb = spec_.buckets[b];
      SS_ASSIGN_OR_RETURN(
          auto p, CopyBatch::Prepare(DeltaBucketBatch(pb.local, pb.bytes, spec_.wire, img_->data(),
                                                      BatchMode::kPack),
                                     t_.device()));
      pack_.push_back(std::move(p));
    }
    kept_ver_.assign(n, 0);
    kept_sum_.assign(n, 0);
    SS_ASSIGN_OR_RETURN(std::string blob, store.Get(spec_.key + "dwindow", timeout));
    DeltaWindowRecord w;
    if (blob.size() != sizeof(w)) {
      return DataLossError(who_ + ": the receiver's window record has " +
                           std::to_string(blob.size()) + " bytes");
    }
    std::memcpy(&w, blob.data(), sizeof(w));
    if (w.magic != kWindowMagic || w.enc < DeltaAlign(max) || w.bytes < w.enc + max) {
      return DataLossError(who_ + ": the receiver's window does not fit bucket of " +
                           std::to_string(max) + " bytes");
    }
    SS_ASSIGN_OR_RETURN(void* base, t_.OpenShared(&w.handle, w.pid, w.base));
    slot_ = static_cast<unsigned char*>(base) + w.slot;
    enc_ = static_cast<unsigned char*>(base) + w.enc;
    return OkStatus();
  }

  Status Post(uint64_t version) override {
    if (state_ != kIdle) return FailedPreconditionError(who_ + ": posted twice");
    SS_RETURN_IF_ERROR(t_.CheckPeer(spec_.peer));
    version_ = version;
    report_ = PairDeltaReport{};
    bases_.assign(2 + 2 * spec_.buckets.size(), 0);
    SS_ASSIGN_OR_RETURN(bases_id_, t_.PostRecvHost(spec_.peer, DeltaTag(kBasesTagBase, version),
                                                   bases_.data(), bases_.size() * 8));
    next_ = 0;
    step_ = kNone;
    awaiting_ = -1;
    state_ = kBases;
    return OkStatus();
  }

  Result<XferState> Poll() override {
    if (state_ == kIdle) return XferState::kDone;
    SS_CUDA(cudaSetDevice(t_.device()), who_ + ": cudaSetDevice");
    if (state_ == kBases) {
      SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(bases_id_));
      if (st == XferState::kInProgress) {
        SS_RETURN_IF_ERROR(t_.CheckPeer(spec_.peer));
        return st;
      }
      if (bases_[0] != version_ || bases_[1] != spec_.buckets.size()) {
        return DataLossError(who_ + ": its bases are for version " + std::to_string(bases_[0]) +
                             " with " + std::to_string(bases_[1]) + " buckets, this pair posted " +
                             std::to_string(version_) + " with " +
                             std::to_string(spec_.buckets.size()));
      }
      state_ = kBuckets;
    }
    // No host waits: each step's device work is enqueued and its event polled, so the sender's
    // pairs (one per engine rank) overlap on the GPU; packing and encoding the next bucket
    // overlaps the receiver's landing of the last one.
    const size_t n = spec_.buckets.size();
    while (true) {
      SS_RETURN_IF_ERROR(PollSends(t_, sends_));
      if (step_ == kShipping) {
        SS_ASSIGN_OR_RETURN(bool done, EventDone("bucket " + std::to_string(next_) + " copied"));
        if (!done) return XferState::kInProgress;
        SS_RETURN_IF_ERROR(Shipped(next_));
        ++next_;
        step_ = kNone;
      }
      bool ready = step_ == kReady;
      if (next_ < n && !ready) {
        SS_ASSIGN_OR_RETURN(ready, Advance(next_));
      }
      if (awaiting_ >= 0) {  // the window is the receiver's until it acknowledged that bucket
        SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(ack_id_));
        if (st == XferState::kInProgress) {
          SS_RETURN_IF_ERROR(t_.CheckPeer(spec_.peer));
          return st;
        }
        if (ack_[0] != version_ || ack_[1] != static_cast<uint64_t>(awaiting_)) {
          return DataLossError(who_ + ": acknowledgement of version " + std::to_string(ack_[0]) +
                               " bucket " + std::to_string(ack_[1]) + ", expected bucket " +
                               std::to_string(awaiting_));
        }
        awaiting_ = -1;
      }
      if (next_ == n) break;
      if (!ready) return XferState::kInProgress;
      SS_RETURN_IF_ERROR(Ship(next_));
    }
    if (!sends_.empty()) return XferState::kInProgress;
    state_ = kIdle;
    return XferState::kDone;
  }

  Result<PairSums> Sums() override {
    PairSums s;
    s.packed = packed_;
    return s;
  }
  const PairDeltaReport* Delta() const override { return &report_; }
  bool DeliversSums() const override { return true; }
  bool SignalsReady() const override { return true; }
  void Cancel() override {
    // A bucket copied (or being copied) but not acknowledged may or may not have landed, and its
    // kept image may be half the new one: it starts over whole.
    if (awaiting_ >= 0) kept_ver_[awaiting_] = 0;
    if (step_ == kShipping && next_ < kept_ver_.size()) kept_ver_[next_] = 0;
    // The codec allows one encode in flight per scratch: a cancelled one is finished here.
    if (step_ == kEncoding) (void)FinishDeltaEncode(scratch_.get(), kDeltaLocalWait);
    step_ = kNone;
    awaiting_ = -1;
    sends_.clear();
    state_ = kIdle;
  }
  std::string Describe() const override {
    return who_ + ", bucket " + std::to_string(next_) + " of " +
           std::to_string(spec_.buckets.size()) +
           (state_ == kBases ? " (waiting for its bases)" : "");
  }

 private:
  // Whether the event after the last enqueued step passed (a device fault: its error).
  Result<bool> EventDone(const std::string& what) {
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) return false;
    SS_CUDA(e, who_ + ": " + what);
    return true;
  }
  Status Record() {
    SS_CUDA(cudaEventRecord(ev_, static_cast<cudaStream_t>(stream_->handle())),
            who_ + ": event record");
    return OkStatus();
  }

  // Bucket b, one step per call: its new image packed into img_, the decision, its delta
  // encoded into out_. True once it is decided (step_ kReady).
  Result<bool> Advance(size_t b) {
    const int64_t bytes = spec_.buckets[b].bytes;
    void* s = stream_->handle();
    if (step_ == kNone) {
      step_t0_ = std::chrono::steady_clock::now();
      SS_RETURN_IF_ERROR(pack_[b]->Launch(s));
      SS_RETURN_IF_ERROR(Record());
      step_ = kPacking;
    }
    if (step_ == kPacking) {
      SS_ASSIGN_OR_RETURN(bool done, EventDone("packing bucket " + std::to_string(b)));
      if (!done) return false;
      SS_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, pack_[b]->Checksums());
      sum_ = sums.at(0);
      const uint64_t base_ver = bases_[2 + 2 * b], base_sum = bases_[3 + 2 * b];
      cur_ = PairDeltaBucket{};
      cur_.full_bytes = static_cast<uint64_t>(bytes);
      cur_.wire_bytes = static_cast<uint64_t>(bytes);
      cur_.reason = kept_ver_[b] == 0          ? DeltaReason::kNoImage
                    : base_ver != kept_ver_[b] ? DeltaReason::kVersion
                    : base_sum != kept_sum_[b] ? DeltaReason::kChecksum
                                               : DeltaReason::kDelta;
      form_ = DeltaKind::kFull;
      if (cur_.reason != DeltaReason::kDelta) {
        if (cur_.reason != DeltaReason::kNoImage && report_.first_fallback.empty()) {
          report_.first_fallback =
              "to sync rank " + std::to_string(spec_.peer) + ", bucket " + std::to_string(b) +
              ": " + std::string(DeltaReasonText(cur_.reason)) + " (it holds v" +
              std::to_string(base_ver) + " " + DeltaHex(base_sum) + ", kept v" +
              std::to_string(kept_ver_[b]) + " " + DeltaHex(kept_sum_[b]) + ")";
        }
        return Decided();
      }
      DeltaGpuEncodeArgs a;
      a.base = kept_at(b);
      a.next = img_->data();
      a.bytes = static_cast<size_t>(bytes);
      a.element_size = spec_.delta.element_size;
      a.base_version = kept_ver_[b];
      a.out = out_->data();
      a.bucket = "sync rank " + std::to_string(spec_.peer) + " bucket " + std::to_string(b);
      SS_RETURN_IF_ERROR(EnqueueDeltaEncode(a, scratch_.get(), s));
      SS_RETURN_IF_ERROR(Record());
      step_ = kEncoding;
    }
    if (step_ == kEncoding) {
      SS_ASSIGN_OR_RETURN(bool done, EventDone("encoding bucket " + std::to_string(b)));
      if (!done) return false;
      // The encode's own event is behind this one: Finish reads its result without waiting.
      SS_ASSIGN_OR_RETURN(const DeltaGpuEncoded r,
                          FinishDeltaEncode(scratch_.get(), kDeltaLocalWait));
      cur_.changed = r.result.changed;
      cur_.elements = r.result.elements;
      if (r.result.kind == DeltaKind::kFull) {
        cur_.reason = DeltaReason::kSize;
      } else if (spec_.delta.pays && !spec_.delta.pays(r.result.elements, r.result.changed)) {
        cur_.reason = DeltaReason::kCost;
      } else {
        form_ = r.result.kind;
        cur_.wire_bytes = r.bytes;
      }
      return Decided();
    }
    return step_ == kReady;
  }
  bool Decided() {
    step_ = kReady;
    report_.seconds += SecondsSince(step_t0_);
    return true;
  }

  // Bucket b into the receiver's window (its delta, or the image whole) and the image kept: the
  // copies enqueued (Shipped follows once they are done).
  Status Ship(size_t b) {
    step_t0_ = std::chrono::steady_clock::now();
    const int64_t bytes = spec_.buckets[b].bytes;
    auto s = static_cast<cudaStream_t>(stream_->handle());
    const bool delta = form_ != DeltaKind::kFull;
    SS_CUDA(cudaMemcpyAsync(delta ? enc_ : slot_, delta ? out_->data() : img_->data(),
                            cur_.wire_bytes, cudaMemcpyDeviceToDevice, s),
            who_ + ": bucket " + std::to_string(b) + " into the receiver's window");
    if (delta && g_fault_bucket.load() == static_cast<int64_t>(b)) {
      // Tests (delta_ipc.h): one byte of this delta flipped on its way, once.
      g_fault_bucket.store(-1);
      SS_RETURN_IF_ERROR(WaitLocal(*stream_, who_ + ": fault"));
      const int64_t at = std::min<int64_t>(g_fault_byte.load(), cur_.wire_bytes - 1);
      unsigned char c = 0;
      SS_CUDA(cudaMemcpy(&c, enc_ + at, 1, cudaMemcpyDeviceToHost), who_ + ": fault");
      c ^= 0xFF;
      SS_CUDA(cudaMemcpy(enc_ + at, &c, 1, cudaMemcpyHostToDevice), who_ + ": fault");
    }
    SS_CUDA(cudaMemcpyAsync(kept_at(b), img_->data(), static_cast<size_t>(bytes),
                            cudaMemcpyDeviceToDevice, s),
            who_ + ": bucket " + std::to_string(b) + " kept");
    SS_RETURN_IF_ERROR(Record());
    step_ = kShipping;
    return OkStatus();
  }

  // Bucket b's copies are done: the control message.
  Status Shipped(size_t b) {
    // The kept image is what the receiver holds once it landed this bucket (forgotten on Cancel
    // until the acknowledgement came).
    kept_ver_[b] = version_;
    kept_sum_[b] = sum_;
    if (packed_.size() != spec_.buckets.size()) packed_.assign(spec_.buckets.size(), 0);
    packed_[b] = sum_;
    report_.buckets.push_back(cur_);
    const uint64_t ctl[kDeltaCtlWords] = {version_,
                                          b,
                                          static_cast<uint64_t>(form_),
                                          static_cast<uint64_t>(cur_.reason),
                                          cur_.wire_bytes,
                                          sum_,
                                          cur_.changed};
    SS_ASSIGN_OR_RETURN(
        ack_id_, t_.PostRecvHost(spec_.peer, DeltaTag(kAckTagBase, version_), ack_, sizeof(ack_)));
    SS_ASSIGN_OR_RETURN(
        XferId id, t_.PostSendHost(spec_.peer, DeltaTag(kCtlTagBase, version_), ctl, sizeof(ctl)));
    sends_.push_back(id);
    awaiting_ = static_cast<int64_t>(b);
    report_.seconds += SecondsSince(step_t0_);
    return OkStatus();
  }

  void* kept_at(size_t b) const {
    return static_cast<unsigned char*>(kept_->data()) + kept_off_[b];
  }

  CudaIpcTransport& t_;
  PairSpec spec_;
  std::string who_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<DeviceBuffer> kept_, img_, out_;
  std::vector<uint64_t> kept_off_;
  std::vector<uint64_t> kept_ver_, kept_sum_;  // per bucket (version 0: nothing kept)
  std::unique_ptr<DeltaGpuScratch> scratch_;
  std::vector<std::unique_ptr<CopyBatch>> pack_;
  unsigned char *slot_ = nullptr, *enc_ = nullptr;  // the receiver's window, mapped here
  std::vector<uint64_t> bases_;                     // the receiver's ready message
  XferId bases_id_ = 0, ack_id_ = 0;
  uint64_t ack_[2] = {};
  std::vector<XferId> sends_;
  std::vector<uint64_t> packed_;
  uint64_t version_ = 0;
  size_t next_ = 0;
  // Bucket next_'s step: nothing yet, packing, encoding (device work behind ev_), decided,
  // being copied (behind ev_).
  enum { kNone, kPacking, kEncoding, kReady, kShipping } step_ = kNone;
  cudaEvent_t ev_ = nullptr;
  std::chrono::steady_clock::time_point step_t0_;
  int64_t awaiting_ = -1;  // the bucket whose acknowledgement is due (-1: none)
  PairDeltaBucket cur_;
  DeltaKind form_ = DeltaKind::kFull;
  uint64_t sum_ = 0;
  enum { kIdle, kBases, kBuckets } state_ = kIdle;
  PairDeltaReport report_;
};

}  // namespace

void SetDeltaFault(int64_t bucket, int64_t byte) {
  g_fault_byte.store(byte);
  g_fault_bucket.store(bucket);
}

}  // namespace delta_internal

void FailNextDeltaForTesting(int64_t bucket, int64_t byte) {
  delta_internal::SetDeltaFault(bucket, byte);
}

Result<std::unique_ptr<PreparedPair>> PrepareDeltaPair(CudaIpcTransport& t, StoreClient& store,
                                                       const PairSpec& spec, Millis timeout) {
  const std::string who = std::string("cuda_ipc: delta pair ") + (spec.send ? "to" : "from") +
                          " rank " + std::to_string(spec.peer);
  SS_RETURN_IF_ERROR(delta_internal::CheckDeltaSpec(spec, who));
  SS_CUDA(cudaSetDevice(t.device()), who + ": cudaSetDevice");
  if (!spec.send) return delta_internal::MakeDeltaRecvPair(t, store, spec);
  auto p = std::make_unique<delta_internal::DeltaSendPair>(t, spec);
  SS_RETURN_IF_ERROR(p->Init(store, timeout));
  return std::unique_ptr<PreparedPair>(std::move(p));
}

}  // namespace shardsync::gpu::ipc
