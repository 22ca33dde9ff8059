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
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "cuda/cuda_ipc/cuda_ipc.h"
#include "cuda/cuda_ipc/delta_ipc.h"
#include "shardsync/delta_gpu.h"

namespace shardsync::gpu::ipc {
namespace {

constexpr uint64_t kBasesTagBase = uint64_t{0x5344} << 48;  // the receiver's bases (it is ready)
constexpr uint64_t kCtlTagBase = uint64_t{0x5345} << 48;    // a bucket's control message
constexpr uint64_t kAckTagBase = uint64_t{0x5346} << 48;    // the receiver landed a bucket
constexpr uint64_t kWindowMagic = 0x53535744;               // "SSWD": the receiver's window

uint64_t DeltaTag(uint64_t base, uint64_t version) {
  return base | (version & ((uint64_t{1} << 48) - 1));
}

// Local device work (packs, copies, codec kernels of one bucket) is waited for at most this long.
constexpr Millis kDeltaLocalWait{60000};
constexpr size_t kDeltaAlign = 256;
size_t DeltaAlign(size_t n) { return (n + kDeltaAlign - 1) / kDeltaAlign * kDeltaAlign; }
std::string DeltaHex(uint64_t v) {
  char b[17];
  snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
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

// A bucket's control message: [version, bucket, form, reason, payload bytes, packed checksum,
// changed elements].
constexpr size_t kDeltaCtlWords = 7;

std::atomic<int64_t> g_fault_bucket{-1};
std::atomic<int64_t> g_fault_byte{0};

Status WaitLocal(const Stream& s, const std::string& what) {
  return s.Synchronize(kDeltaLocalWait, what);
}

// One bucket's runs between tensors (`regions`, elements of their own dtype) and a contiguous wire
// image at `image` (elements of `wire`), as bucket 0 of a batch: pack orientation (tensor ->
// image), or reversed (image -> tensor, kUnpack).
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
    for (size_t k = first; k < bs.runs.size(); ++k) {
      CopyRun& c = bs.runs[k];
      const void* tensor = c.in;
      c.in = c.out;
      c.out = const_cast<void*>(tensor);
      std::swap(c.in_stride, c.out_stride);
    }
  }
  return bs;
}

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
    report_.seconds += Since(t0);
    return OkStatus();
  }

  Result<XferState> Poll() override {
    if (state_ == kIdle) return XferState::kDone;
    SS_CUDA(cudaSetDevice(t_.device()), who_ + ": cudaSetDevice");
    SS_RETURN_IF_ERROR(PollSends());
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
    SS_RETURN_IF_ERROR(PollSends());
    if (!sends_.empty()) return XferState::kInProgress;
    // Every bucket landed: every landed word read back, for the session's comparison.
    const auto t0 = std::chrono::steady_clock::now();
    SS_RETURN_IF_ERROR(verify_->Launch(stream_->handle()));
    SS_RETURN_IF_ERROR(WaitLocal(*stream_, who_ + ": landed readback"));
    SS_ASSIGN_OR_RETURN(landed_, verify_->Checksums());
    for (size_t b = 0; b < landed_.size(); ++b) {
      if (landed_[b] == packed_[b]) verified_[b] = version_;
    }
    report_.seconds += Since(t0);
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
  static double Since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  Status PostCtl() {
    SS_ASSIGN_OR_RETURN(
        ctl_id_, t_.PostRecvHost(spec_.peer, DeltaTag(kCtlTagBase, version_), ctl_, sizeof(ctl_)));
    return OkStatus();
  }
  Status PollSends() {
    for (size_t i = 0; i < sends_.size();) {
      SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(sends_[i]));
      if (st == XferState::kDone) {
        sends_.erase(sends_.begin() + i);
      } else {
        ++i;
      }
    }
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
    report_.seconds += Since(t0);
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

class DeltaSendPair final : public PreparedPair {
 public:
  DeltaSendPair(CudaIpcTransport& t, const PairSpec& spec)
      : t_(t), spec_(spec), who_("cuda_ipc: delta pair to rank " + std::to_string(spec.peer)) {}

  Status Init(StoreClient& store, Millis timeout) {
    const size_t n = spec_.buckets.size();
    uint64_t max = 0, total = 0;
    for (const PairBucket& b : spec_.buckets) {
      max = std::max<uint64_t>(max, b.bytes);
      kept_off_.push_back(total);
      total += DeltaAlign(b.bytes);
    }
    SS_ASSIGN_OR_RETURN(stream_, Stream::Create(t_.device()));
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
    encoded_ = false;
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
    while (true) {
      SS_RETURN_IF_ERROR(PollSends());
      // Packing and encoding the next bucket overlaps the receiver's landing of the last one.
      if (next_ < spec_.buckets.size() && !encoded_) SS_RETURN_IF_ERROR(Encode(next_));
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
      if (next_ == spec_.buckets.size()) break;
      SS_RETURN_IF_ERROR(Ship(next_));
      ++next_;
      encoded_ = false;
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
    // A bucket copied but not acknowledged may or may not have landed: it starts over whole.
    if (awaiting_ >= 0) kept_ver_[awaiting_] = 0;
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
  static double Since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  Status PollSends() {
    for (size_t i = 0; i < sends_.size();) {
      SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(sends_[i]));
      if (st == XferState::kDone) {
        sends_.erase(sends_.begin() + i);
      } else {
        ++i;
      }
    }
    return OkStatus();
  }

  // Bucket b: its new image packed into img_, the decision, and its delta into out_.
  Status Encode(size_t b) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t bytes = spec_.buckets[b].bytes;
    const int es = spec_.delta.element_size;
    void* s = stream_->handle();
    SS_RETURN_IF_ERROR(pack_[b]->Launch(s));
    SS_RETURN_IF_ERROR(WaitLocal(*stream_, who_ + ": packing bucket " + std::to_string(b)));
    SS_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, pack_[b]->Checksums());
    sum_ = sums.at(0);
    const uint64_t base_ver = bases_[2 + 2 * b], base_sum = bases_[3 + 2 * b];
    cur_ = PairDeltaBucket{};
    cur_.full_bytes = static_cast<uint64_t>(bytes);
    cur_.reason = kept_ver_[b] == 0          ? DeltaReason::kNoImage
                  : base_ver != kept_ver_[b] ? DeltaReason::kVersion
                  : base_sum != kept_sum_[b] ? DeltaReason::kChecksum
                                             : DeltaReason::kDelta;
    form_ = DeltaKind::kFull;
    cur_.wire_bytes = static_cast<uint64_t>(bytes);
    if (cur_.reason == DeltaReason::kDelta) {
      DeltaGpuEncodeArgs a;
      a.base = kept_at(b);
      a.next = img_->data();
      a.bytes = static_cast<size_t>(bytes);
      a.element_size = es;
      a.base_version = kept_ver_[b];
      a.out = out_->data();
      a.bucket = "sync rank " + std::to_string(spec_.peer) + " bucket " + std::to_string(b);
      SS_RETURN_IF_ERROR(EnqueueDeltaEncode(a, scratch_.get(), s));
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
    } else if (cur_.reason != DeltaReason::kNoImage && report_.first_fallback.empty()) {
      report_.first_fallback = "to sync rank " + std::to_string(spec_.peer) + ", bucket " +
                               std::to_string(b) + ": " +
                               std::string(DeltaReasonText(cur_.reason)) + " (it holds v" +
                               std::to_string(base_ver) + " " + DeltaHex(base_sum) + ", kept v" +
                               std::to_string(kept_ver_[b]) + " " + DeltaHex(kept_sum_[b]) + ")";
    }
    encoded_ = true;
    report_.seconds += Since(t0);
    return OkStatus();
  }

  // Bucket b into the receiver's window (its delta, or the image whole), the image kept, and the
  // control message.
  Status Ship(size_t b) {
    const auto t0 = std::chrono::steady_clock::now();
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
    SS_RETURN_IF_ERROR(WaitLocal(*stream_, who_ + ": bucket " + std::to_string(b) + " copied"));
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
    report_.seconds += Since(t0);
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
  bool encoded_ = false;   // bucket next_ is packed and decided
  int64_t awaiting_ = -1;  // the bucket whose acknowledgement is due (-1: none)
  PairDeltaBucket cur_;
  DeltaKind form_ = DeltaKind::kFull;
  uint64_t sum_ = 0;
  enum { kIdle, kBases, kBuckets } state_ = kIdle;
  PairDeltaReport report_;
};

}  // namespace

void FailNextDeltaForTesting(int64_t bucket, int64_t byte) {
  g_fault_byte.store(byte);
  g_fault_bucket.store(bucket);
}

Result<std::unique_ptr<PreparedPair>> PrepareDeltaPair(CudaIpcTransport& t, StoreClient& store,
                                                       const PairSpec& spec, Millis timeout) {
  const std::string who = std::string("cuda_ipc: delta pair ") + (spec.send ? "to" : "from") +
                          " rank " + std::to_string(spec.peer);
  SS_RETURN_IF_ERROR(CheckDeltaSpec(spec, who));
  SS_CUDA(cudaSetDevice(t.device()), who + ": cudaSetDevice");
  if (!spec.send) {
    auto p = std::make_unique<DeltaRecvPair>(t, spec);
    SS_RETURN_IF_ERROR(p->Init(store));
    return std::unique_ptr<PreparedPair>(std::move(p));
  }
  auto p = std::make_unique<DeltaSendPair>(t, spec);
  SS_RETURN_IF_ERROR(p->Init(store, timeout));
  return std::unique_ptr<PreparedPair>(std::move(p));
}

}  // namespace shardsync::gpu::ipc
