// The sending side of a device delta pair (delta_pair.h has the protocol), and what both sides
// share: the spec checks, a bucket's batch, the test fault.
//
// Per bucket: the new wire image packed into a local slot (cast, packed checksum); if the
// receiver's base is the image kept of what it last sent there (same version and checksum,
// sync/delta_path.h CheckBase), its delta against the kept image (EnqueueDeltaEncode); the delta
// or the whole image is shipped through the channel, and the control message names the form, the
// reason, the length and the checksum. The kept image becomes the new one: the encoder writes the
// vectors that differ into it as it reads them (DeltaGpuEncodeArgs::advance); a bucket that was
// not encoded (or whose encode is not trusted) is copied there whole. The next bucket is
// packed and encoded while the receiver lands this one; it is shipped once the channel says the
// receiver's window is free.
//
// Block FP8 (image pairs): the pack is the FP8 round's (nccl/fp8_rounds.h: quantize ops, copies,
// zero pads into the slot) and a byte-sum of the slot; the delta diffs bytes (element size 1).
//
// Memory: every bucket's wire image kept (the pair's wire bytes: 2 per bf16 element; block FP8:
// 1 per quantized element plus 4 per block scale) plus a slot,
// an encode output of the largest bucket and the codec's scratch (delta_gpu.h). A failed sync:
// the sender forgets a bucket whose landing it did not hear of, so the next sync (on pairs that
// stay usable: cuda_ipc) sends it whole.
#include <atomic>
#include <cstring>

#include "cuda/cuda_util.h"
#include "cuda/delta/delta_fault.h"
#include "cuda/delta/delta_pair.h"
#include "cuda/nccl/fp8_rounds.h"
#include "shardsync/plan.h"

namespace shardsync::gpu {
namespace delta_pair {
namespace {

std::atomic<int64_t> g_fault_bucket{-1};
std::atomic<int64_t> g_fault_byte{0};
std::atomic<int64_t> g_kept_fault_bucket{-1};

class DeltaSendPair final : public PreparedPair {
 public:
  DeltaSendPair(const PairSpec& spec, int device, std::string who,
                std::unique_ptr<DeltaSendChannel> ch)
      : spec_(spec), device_(device), who_(std::move(who)), ch_(std::move(ch)) {}
  ~DeltaSendPair() override {
    cudaSetDevice(device_);
    // Work still queued (a cancelled sync) reads the buffers freed below: a bounded wait.
    if (stream_) (void)stream_->Synchronize(kDeltaLocalWait, who_ + ": teardown");
    if (ev_) cudaEventDestroy(ev_);
  }

  Status Init() {
    const size_t n = spec_.buckets.size();
    const uint64_t max = MaxBucketBytes(spec_);
    uint64_t total = 0;
    for (const PairBucket& b : spec_.buckets) {
      kept_off_.push_back(total);
      total += DeltaAlign(b.bytes);
    }
    SS_ASSIGN_OR_RETURN(stream_, Stream::Create(device_));
    SS_CUDA(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), who_ + ": event");
    SS_ASSIGN_OR_RETURN(kept_, DeviceBuffer::Allocate(total, device_));
    SS_ASSIGN_OR_RETURN(img_, DeviceBuffer::Allocate(max, device_));
    SS_ASSIGN_OR_RETURN(out_, DeviceBuffer::Allocate(max, device_));
    SS_ASSIGN_OR_RETURN(scratch_,
                        DeltaGpuScratch::Allocate(max, spec_.delta.element_size, device_));
    if (spec_.image) {  // the pads' zeros
      SS_ASSIGN_OR_RETURN(zeros_, DeviceBuffer::Allocate(kImageRoundScratchBytes, device_));
      SS_CUDA(cudaMemset(zeros_->data(), 0, kImageRoundScratchBytes), who_ + ": zeros");
    }
    for (size_t b = 0; b < n; ++b) {
      const PairBucket& pb = spec_.buckets[b];
      if (spec_.image) {
        // Block FP8: the bucket's whole wire image (e4m3 rows, scales, copies, zero pads), as
        // the nccl pairs build a round (nccl/fp8_rounds.h), and its bytes summed by position.
        SS_ASSIGN_OR_RETURN(ImageSendRound r,
                            PrepareImageSendRound(pb, spec_.wire, img_->data(), zeros_->data(),
                                                  device_, who_ + ", bucket " + std::to_string(b)));
        pack_.push_back(std::move(r.pack));
        sum_of_.push_back(std::move(r.verify));
        continue;
      }
      SS_ASSIGN_OR_RETURN(
          auto p, CopyBatch::Prepare(DeltaBucketBatch(pb.local, pb.bytes, spec_.wire, img_->data(),
                                                      BatchMode::kPack),
                                     device_));
      pack_.push_back(std::move(p));
    }
    kept_ver_.assign(n, 0);
    kept_sum_.assign(n, 0);
    return OkStatus();
  }

  Status Post(uint64_t version) override {
    if (state_ != kIdle) return FailedPreconditionError(who_ + ": posted twice");
    SS_RETURN_IF_ERROR(ch_->CheckPeer());
    version_ = version;
    report_ = PairDeltaReport{};
    bases_.assign(BasesWords(spec_.buckets.size()), 0);
    SS_RETURN_IF_ERROR(ch_->PostBases(version, &bases_));
    next_ = 0;
    step_ = kNone;
    awaiting_ = -1;
    state_ = kBases;
    return OkStatus();
  }

  Result<XferState> Poll() override {
    if (state_ == kIdle) return XferState::kDone;
    SS_CUDA(cudaSetDevice(device_), who_ + ": cudaSetDevice");
    if (state_ == kBases) {
      SS_ASSIGN_OR_RETURN(bool in, ch_->BasesIn());
      if (!in) {
        SS_RETURN_IF_ERROR(ch_->CheckPeer());
        return XferState::kInProgress;
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
      if (step_ == kShipping) {
        SS_ASSIGN_OR_RETURN(bool done, EventDone("bucket " + std::to_string(next_) + " shipped"));
        if (done) {
          SS_ASSIGN_OR_RETURN(done, ch_->Shipped());
        }
        if (!done) {
          SS_RETURN_IF_ERROR(ch_->CheckPeer());
          return XferState::kInProgress;
        }
        Shipped(next_);
        ++next_;
        step_ = kNone;
      }
      bool ready = step_ == kReady;
      if (next_ < n && !ready) {
        SS_ASSIGN_OR_RETURN(ready, Advance(next_));
      }
      if (awaiting_ >= 0) {  // the window is the receiver's until the channel frees it
        SS_ASSIGN_OR_RETURN(bool free, ch_->WindowFree());
        if (!free) {
          SS_RETURN_IF_ERROR(ch_->CheckPeer());
          return XferState::kInProgress;
        }
        awaiting_ = -1;
      }
      if (next_ == n) break;
      if (!ready) return XferState::kInProgress;
      SS_RETURN_IF_ERROR(Ship(next_));
    }
    SS_ASSIGN_OR_RETURN(bool drained, ch_->Drained());
    if (!drained) {
      SS_RETURN_IF_ERROR(ch_->CheckPeer());
      return XferState::kInProgress;
    }
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
    // A bucket shipped (or being shipped) whose window was not freed may or may not have landed,
    // and its kept image may be half the new one: it starts over whole.
    if (awaiting_ >= 0) kept_ver_[awaiting_] = 0;
    if (step_ == kShipping && next_ < kept_ver_.size()) kept_ver_[next_] = 0;
    // The codec allows one encode in flight per scratch: a cancelled one is finished here.
    if (step_ == kEncoding) (void)FinishDeltaEncode(scratch_.get(), kDeltaLocalWait);
    if (state_ != kIdle) ch_->Cancel();
    step_ = kNone;
    awaiting_ = -1;
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
      if (spec_.image) SS_RETURN_IF_ERROR(sum_of_[b]->Launch(s));
      SS_RETURN_IF_ERROR(Record());
      step_ = kPacking;
    }
    if (step_ == kPacking) {
      SS_ASSIGN_OR_RETURN(bool done, EventDone("packing bucket " + std::to_string(b)));
      if (!done) return false;
      SS_ASSIGN_OR_RETURN(std::vector<uint64_t> sums,
                          (spec_.image ? sum_of_[b] : pack_[b])->Checksums());
      sum_ = sums.at(0);
      int64_t bad = 0;
      for (int64_t k : pack_[b]->NonFinite()) bad += k;
      if (bad > 0) {  // as the full pairs: the receiver hears of it through the session's abort
        return DataLossError(who_ + ": " + std::to_string(bad) +
                             " non-finite trainer values (NaN or Inf) in block-FP8 weights of "
                             "bucket " +
                             std::to_string(b) +
                             ": block FP8 cannot represent them; nothing of this sync is "
                             "reported good and the engine ranks stay poisoned");
      }
      const uint64_t base_ver = bases_[2 + 2 * b], base_sum = bases_[3 + 2 * b];
      cur_ = PairDeltaBucket{};
      cur_.full_bytes = static_cast<uint64_t>(bytes);
      cur_.wire_bytes = static_cast<uint64_t>(bytes);
      cur_.reason = kept_ver_[b] == 0          ? DeltaReason::kNoImage
                    : base_ver != kept_ver_[b] ? DeltaReason::kVersion
                    : base_sum != kept_sum_[b] ? DeltaReason::kChecksum
                                               : DeltaReason::kDelta;
      form_ = DeltaKind::kFull;
      advanced_ = false;
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
      int64_t kb = static_cast<int64_t>(b);
      if (g_kept_fault_bucket.compare_exchange_strong(kb, -1)) {
        // Tests (delta_fault.h): one byte of the kept image flipped, so the encoder reads another
        // base than the one it kept (as an encoder glitch would).
        auto* p = static_cast<unsigned char*>(kept_at(b));
        unsigned char c = 0;
        SS_CUDA(cudaMemcpy(&c, p, 1, cudaMemcpyDeviceToHost), who_ + ": kept fault");
        c ^= 0xFF;
        SS_CUDA(cudaMemcpy(p, &c, 1, cudaMemcpyHostToDevice), who_ + ": kept fault");
      }
      DeltaGpuEncodeArgs a;
      a.base = kept_at(b);
      a.next = img_->data();
      a.bytes = static_cast<size_t>(bytes);
      a.element_size = spec_.delta.element_size;
      a.base_version = kept_ver_[b];
      a.out = out_->data();
      a.bucket = "sync rank " + std::to_string(spec_.peer) + " bucket " + std::to_string(b);
      // The encoder leaves the new image in the kept one (no copy at Ship): from here the kept
      // bytes are of no version until the bucket is out (a failed sync sends it whole next).
      a.advance = kept_at(b);
      SS_RETURN_IF_ERROR(EnqueueDeltaEncode(a, scratch_.get(), s));
      kept_ver_[b] = 0;
      advanced_ = true;
      SS_RETURN_IF_ERROR(Record());
      step_ = kEncoding;
    }
    if (step_ == kEncoding) {
      SS_ASSIGN_OR_RETURN(bool done, EventDone("encoding bucket " + std::to_string(b)));
      if (!done) return false;
      // The encode's own event is behind this one: Finish reads its result without waiting
      // (the encoded size comes back to the host here, for the control message and the
      // two-sided channels' counts).
      SS_ASSIGN_OR_RETURN(const DeltaGpuEncoded r,
                          FinishDeltaEncode(scratch_.get(), kDeltaLocalWait));
      cur_.changed = r.result.changed;
      cur_.elements = r.result.elements;
      if (r.result.kind != DeltaKind::kFull &&
          (r.result.base_checksum != kept_sum_[b] || r.result.new_checksum != sum_)) {
        // The encoder's own sums of the base and the new image must be the ones kept and packed
        // (the same checksum, computed twice): where they are not, the encoding describes other
        // bytes, which the receiver would refuse and fail the sync. The bucket goes whole now,
        // under the checksum reason. Seen on one H200 with block-FP8 images of 511 MiB whose
        // changes cluster, from the encoder's missing proxy fence (fixed: docs/delta.md "Device
        // pairs", block FP8); kept for any other encoder fault.
        cur_.reason = DeltaReason::kChecksum;
        cur_.changed = 0;
        cur_.elements = 0;
        advanced_ = false;  // what it left in the kept image is not trusted: Ship copies
        if (report_.first_fallback.empty()) {
          report_.first_fallback =
              "to sync rank " + std::to_string(spec_.peer) + ", bucket " + std::to_string(b) +
              ": the device encoder's sums (base " + DeltaHex(r.result.base_checksum) + ", new " +
              DeltaHex(r.result.new_checksum) + ") are not the kept " + DeltaHex(kept_sum_[b]) +
              " and packed " + DeltaHex(sum_) + " ones; sent whole";
        }
      } else if (r.result.kind == DeltaKind::kFull) {
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

  // Bucket b through the channel (its delta, or the image whole) and the image kept: enqueued
  // (Shipped follows once both are done).
  Status Ship(size_t b) {
    step_t0_ = std::chrono::steady_clock::now();
    const int64_t bytes = spec_.buckets[b].bytes;
    auto s = static_cast<cudaStream_t>(stream_->handle());
    const bool delta = form_ != DeltaKind::kFull;
    int64_t at = 0;
    if (delta && TakeDeltaFault(static_cast<int64_t>(b), &at)) {
      // Tests (delta_fault.h): one byte of this delta flipped before it leaves, once.
      at = std::min<int64_t>(at, static_cast<int64_t>(cur_.wire_bytes) - 1);
      auto* p = static_cast<unsigned char*>(out_->data()) + at;
      unsigned char c = 0;
      SS_CUDA(cudaMemcpy(&c, p, 1, cudaMemcpyDeviceToHost), who_ + ": fault");
      c ^= 0xFF;
      SS_CUDA(cudaMemcpy(p, &c, 1, cudaMemcpyHostToDevice), who_ + ": fault");
    }
    const DeltaCtl ctl = {version_,
                          b,
                          static_cast<uint64_t>(form_),
                          static_cast<uint64_t>(cur_.reason),
                          cur_.wire_bytes,
                          sum_,
                          cur_.changed};
    SS_RETURN_IF_ERROR(ch_->Ship(ctl, delta ? out_->data() : img_->data(), delta));
    if (!advanced_) {  // the encoder did not leave the new image there
      SS_CUDA(cudaMemcpyAsync(kept_at(b), img_->data(), static_cast<size_t>(bytes),
                              cudaMemcpyDeviceToDevice, s),
              who_ + ": bucket " + std::to_string(b) + " kept");
    }
    SS_RETURN_IF_ERROR(Record());
    step_ = kShipping;
    return OkStatus();
  }

  // Bucket b is out: the kept image is what the receiver holds once it landed it (forgotten on
  // Cancel until its window was freed).
  void Shipped(size_t b) {
    kept_ver_[b] = version_;
    kept_sum_[b] = sum_;
    if (packed_.size() != spec_.buckets.size()) packed_.assign(spec_.buckets.size(), 0);
    packed_[b] = sum_;
    report_.buckets.push_back(cur_);
    awaiting_ = static_cast<int64_t>(b);
    report_.seconds += SecondsSince(step_t0_);
  }

  void* kept_at(size_t b) const {
    return static_cast<unsigned char*>(kept_->data()) + kept_off_[b];
  }

  PairSpec spec_;
  int device_;
  std::string who_;
  std::unique_ptr<DeltaSendChannel> ch_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<DeviceBuffer> kept_, img_, out_;
  std::vector<uint64_t> kept_off_;
  std::vector<uint64_t> kept_ver_, kept_sum_;  // per bucket (version 0: nothing kept)
  std::unique_ptr<DeltaGpuScratch> scratch_;
  std::vector<std::unique_ptr<CopyBatch>> pack_;
  std::vector<std::unique_ptr<CopyBatch>> sum_of_;  // block FP8: the packed image's checksum
  std::unique_ptr<DeviceBuffer> zeros_;             // block FP8: the pads' zeros
  std::vector<uint64_t> bases_;                     // the receiver's bases message
  std::vector<uint64_t> packed_;
  uint64_t version_ = 0;
  size_t next_ = 0;
  // Bucket next_'s step: nothing yet, packing, encoding (device work behind ev_), decided,
  // being shipped (behind ev_ and the channel).
  enum { kNone, kPacking, kEncoding, kReady, kShipping } step_ = kNone;
  cudaEvent_t ev_ = nullptr;
  std::chrono::steady_clock::time_point step_t0_;
  int64_t awaiting_ = -1;  // the bucket whose window is not free yet (-1: none)
  PairDeltaBucket cur_;
  DeltaKind form_ = DeltaKind::kFull;
  bool advanced_ = false;  // the encoder left the current bucket's new image in the kept one
  uint64_t sum_ = 0;
  enum { kIdle, kBases, kBuckets } state_ = kIdle;
  PairDeltaReport report_;
};

}  // namespace

Status CheckDeltaSpec(const PairSpec& spec, const std::string& who) {
  const int es = spec.delta.element_size;
  if (es != 1 && es != 2 && es != 4) {
    return InvalidArgumentError(who + ": delta element size " + std::to_string(es));
  }
  if (spec.image && es != 1) {  // the image mixes e4m3 codes, scales, copies and pads
    return InvalidArgumentError(who + ": block FP8's image is diffed by byte, not by " +
                                std::to_string(es) + " bytes");
  }
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    const PairBucket& pb = spec.buckets[b];
    if (pb.bytes <= 0 || pb.bytes % es != 0 || (!spec.image && !pb.encoded.empty())) {
      return InvalidArgumentError(who + ": bucket " + std::to_string(b) + " of " +
                                  std::to_string(pb.bytes) +
                                  " bytes does not fit the delta encoding (size, encoded ops)");
    }
    for (const EncodedRegion& e : pb.encoded) {
      // The delta pairs build the bucket's whole wire image on the sender and land it from a
      // slot: quantize ops and copies. Stage ops (plans with --fp8-split stage) are refused when
      // planned; amax-exchanged rows would need the exchange's scales in the pack.
      if (static_cast<Encoding>(e.encoding) != Encoding::kQuantize || e.given || !e.with_aux) {
        return UnimplementedError(
            who + ": bucket " + std::to_string(b) + " carries a block-FP8 op of encoding '" +
            std::string(EncodingName(static_cast<Encoding>(e.encoding))) +
            "' (rows of 128-row blocks that straddle trainer ranks), which the delta encoding over "
            "device pairs does not carry; use encoding full, or an FSDP size whose chunks fall "
            "on the 128 grid (`shardsync plan` shows them)");
      }
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

BatchSpec DeltaBucketBatch(const std::vector<PackRegion>& regions, int64_t bytes, DType wire,
                           void* image, BatchMode mode) {
  BatchSpec bs;
  bs.mode = mode;
  bs.in_dtype = regions.empty() ? wire : regions[0].dtype;
  bs.out_dtype = wire;
  if (mode == BatchMode::kUnpack) bs.in_dtype = wire;
  bs.bucket_bytes = {bytes};
  const int ws = DTypeSize(wire);
  for (const PackRegion& r : regions) {
    const size_t first = bs.runs.size();
    // `out` is where this region's elements start (its wire offset into the image).
    AppendRegionRuns(r.region, r.shape, r.base, DTypeSize(r.dtype),
                     static_cast<unsigned char*>(image) + r.wire_offset, ws, ws, 0, r.wire_offset,
                     &bs.runs);
    if (mode != BatchMode::kUnpack) continue;
    for (size_t k = first; k < bs.runs.size(); ++k) FlipRun(bs.runs[k]);
  }
  return bs;
}

bool TakeDeltaFault(int64_t bucket, int64_t* byte) {
  int64_t want = bucket;
  if (!g_fault_bucket.compare_exchange_strong(want, -1)) return false;
  *byte = g_fault_byte.load();
  return true;
}

Result<std::unique_ptr<PreparedPair>> MakeDeltaSendPair(const PairSpec& spec, int device,
                                                        std::string who,
                                                        std::unique_ptr<DeltaSendChannel> channel) {
  auto p = std::make_unique<DeltaSendPair>(spec, device, std::move(who), std::move(channel));
  SS_RETURN_IF_ERROR(p->Init());
  return std::unique_ptr<PreparedPair>(std::move(p));
}

}  // namespace delta_pair

void CorruptNextKeptImageForTesting(int64_t bucket) {
  delta_pair::g_kept_fault_bucket.store(bucket);
}

void FailNextDeltaForTesting(int64_t bucket, int64_t byte) {
  delta_pair::g_fault_byte.store(byte);
  delta_pair::g_fault_bucket.store(bucket);
}

}  // namespace shardsync::gpu
