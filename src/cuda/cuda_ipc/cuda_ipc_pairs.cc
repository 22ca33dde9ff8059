// cuda_ipc prepared pairs (cuda_ipc.h).
//
// Sender: ONE pack launch per replay casts every bucket of the pair straight into the receiver's
// parameters (through the IPC mappings) with the checksum fused, and reads every landed word back
// through the receiver's OWN map (published by the receiver at Prepare; the readback must not
// share the sender's addressing) from L2 right after writing it; the landed sums then reach the
// receiver through the mailbox once the launch completed, with the packed sums: the session then
// needs no store round trip to compare them. Receiver: waits for that message.
#include <cstring>
#include <functional>

#include "cuda/cuda_ipc/cuda_ipc.h"

namespace shardsync::gpu::ipc {
namespace {

constexpr uint64_t kLandedMagic = 0x53534c4d;  // "SSLM"
constexpr uint64_t kStageMagic = 0x53535354;   // "SSST": a block-FP8 receiver's staging map
constexpr uint64_t kPairTagBase = uint64_t{0x5350} << 48;

constexpr uint64_t kReadyTagBase = uint64_t{0x5352} << 48;

uint64_t PairTag(uint64_t version) { return kPairTagBase | (version & ((uint64_t{1} << 48) - 1)); }
// The receiver's pair was posted for `version` (it is inside Sync): the sender may write.
uint64_t ReadyTag(uint64_t version) {
  return kReadyTagBase | (version & ((uint64_t{1} << 48) - 1));
}

// One contiguous run of the receiver's map: wire bytes [wire, wire + bytes) of `bucket` land at
// byte `offset` of its registered region `region`.
struct LandedEntry {
  int64_t bucket, wire, region, offset, bytes;
};

Status CheckBuckets(const PairSpec& spec) {
  const size_t max = (internal::kMailboxSlotBytes - 16) / 16;  // a landed and a packed sum each
  if (spec.buckets.empty() || spec.buckets.size() > max) {
    return InvalidArgumentError("cuda_ipc: pair with rank " + std::to_string(spec.peer) + " has " +
                                std::to_string(spec.buckets.size()) + " buckets (1.." +
                                std::to_string(max) + " supported)");
  }
  return OkStatus();
}

class IpcRecvPair final : public PreparedPair {
 public:
  IpcRecvPair(CudaIpcTransport& t, int peer, size_t buckets)
      : t_(t), peer_(peer), buckets_(buckets), msg_(2 + 2 * buckets) {}

  Status Post(uint64_t version) override {
    if (cancelled_)
      return AbortedError("cuda_ipc: pair with rank " + std::to_string(peer_) + " was cancelled");
    version_ = version;
    SS_ASSIGN_OR_RETURN(id_,
                        t_.PostRecvHost(peer_, PairTag(version), msg_.data(), msg_.size() * 8));
    // Tell the sender through the mailbox (microseconds; the store's ready key takes a round
    // trip through the store server).
    SS_ASSIGN_OR_RETURN(ready_id_, t_.PostSendHost(peer_, ReadyTag(version), &version_, 8));
    SS_ASSIGN_OR_RETURN(XferState rs, t_.Poll(ready_id_));
    ready_sent_ = rs == XferState::kDone;
    posted_ = true;
    return OkStatus();
  }
  Result<XferState> Poll() override {
    if (!posted_) return XferState::kDone;
    if (!ready_sent_) {
      SS_ASSIGN_OR_RETURN(XferState rs, t_.Poll(ready_id_));
      ready_sent_ = rs == XferState::kDone;
      if (!ready_sent_) return XferState::kInProgress;
    }
    SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(id_));
    if (st == XferState::kInProgress) return st;
    posted_ = false;
    if (msg_[0] != version_ || msg_[1] != buckets_) {
      return DataLossError("cuda_ipc: landed checksums from rank " + std::to_string(peer_) +
                           " are for version " + std::to_string(msg_[0]) + " with " +
                           std::to_string(msg_[1]) + " buckets");
    }
    return XferState::kDone;
  }
  Result<PairSums> Sums() override {
    PairSums s;
    s.landed.assign(msg_.begin() + 2, msg_.begin() + 2 + buckets_);
    s.packed.assign(msg_.begin() + 2 + buckets_, msg_.end());
    return s;
  }
  void Cancel() override {
    if (posted_) cancelled_ = true;
  }
  std::string Describe() const override {
    return "cuda_ipc: landed sums read back by rank " + std::to_string(peer_) + ", " +
           std::to_string(buckets_) + " buckets";
  }

 private:
  CudaIpcTransport& t_;
  int peer_;
  size_t buckets_;
  std::vector<uint64_t> msg_;  // [version, buckets, landed sum per bucket, packed sum per bucket]
  uint64_t version_ = 0;
  XferId id_ = 0;
  XferId ready_id_ = 0;
  bool ready_sent_ = false;
  bool posted_ = false, cancelled_ = false;
};

}  // namespace

// Sender (cuda_ipc.h). Post only marks the pair and waits (mailbox) for the receiver's pair to be
// posted for the same version; the launch comes once every posted send pair's receiver is ready, at
// the last Post or a later Poll: so a trainer's pairs run as ONE kernel over all their buckets
// instead of one launch per pair, which spares the GPU each launch's ramp-up and tail (measured on
// an H200, docs/benchmarks.md), and the session needs no ready keys for them (SignalsReady).

IpcSendPair::~IpcSendPair() {
  t_.RemoveSend(this);
  cudaSetDevice(t_.device());
  if (done_) cudaEventDestroy(done_);
}

Status IpcSendPair::Init(BatchSpec spec) {
  const size_t nb = bytes_.size();
  SS_ASSIGN_OR_RETURN(lsum_, DeviceBuffer::Allocate(nb * 8, t_.device()));
  SS_CUDA(cudaMemset(lsum_->data(), 0, nb * 8), "cuda_ipc: zero landed sums");
  SS_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cuda_ipc: pair event");
  for (size_t b = 0; b < nb; ++b) {
    spec.landed_sums.push_back(static_cast<unsigned char*>(lsum_->data()) + 8 * b);
  }
  SS_ASSIGN_OR_RETURN(batch_, CopyBatch::Prepare(spec, t_.device()));
  spec_ = std::move(spec);
  return OkStatus();
}

Status IpcSendPair::Post(uint64_t version) {
  if (cancelled_)
    return AbortedError("cuda_ipc: pair with rank " + std::to_string(peer_) + " was cancelled");
  SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
  version_ = version;
  SS_ASSIGN_OR_RETURN(ready_id_, t_.PostRecvHost(peer_, ReadyTag(version), &ready_msg_, 8));
  ready_ = false;
  state_ = kPosted;
  return t_.SendPosted();
}

Result<bool> IpcSendPair::Ready() {
  if (!ready_) {
    SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(ready_id_));
    if (st == XferState::kInProgress) return false;
    if (ready_msg_ != version_) {
      return DataLossError("cuda_ipc: rank " + std::to_string(peer_) + " is ready for version " +
                           std::to_string(ready_msg_) + ", this pair posted " +
                           std::to_string(version_));
    }
    ready_ = true;
  }
  return true;
}

Status IpcSendPair::LaunchAlone(cudaStream_t s) {
  SS_RETURN_IF_ERROR(batch_->LaunchSignaled(s, ++seq_));
  t_.LaunchStarted();
  SS_CUDA(cudaEventRecord(done_, s), "cuda_ipc: pair event");
  TraceLaunch("launched", bytes_.size());
  LaunchedIn(nullptr, 0);
  return OkStatus();
}

Result<XferState> IpcSendPair::Poll() {
  if (state_ == kIdle) return XferState::kDone;
  if (state_ == kPosted) {
    SS_RETURN_IF_ERROR(t_.LaunchPostedSends());
    if (state_ == kPosted) {  // a receiver is not in this sync yet
      SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
      return XferState::kInProgress;
    }
  }
  if (state_ == kLaunched && group_ == t_.remote_marker()) {  // another sender's launch
    SS_ASSIGN_OR_RETURN(bool done, t_.PollRemote(this));
    if (!done) {
      SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
      return XferState::kInProgress;
    }
    if (state_ == kIdle) return XferState::kDone;
  } else if (state_ == kLaunched) {
    // The kernel's own signal comes first; the event (after it on the stream) tells a fault.
    const CopyBatch& b = group_ ? *group_->batch : *batch_;
    const uint64_t seq = group_ ? group_->seq : seq_;
    if (b.Signaled() != seq) {
      if (!t_.StreamCheckDue()) return XferState::kInProgress;
      const cudaError_t e = cudaEventQuery(group_ ? group_->done : done_);
      if (e == cudaErrorNotReady) {
        SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
        return XferState::kInProgress;
      }
      if (e != cudaSuccess) t_.FailShared(group_);
      SS_CUDA(e, "cuda_ipc: pack into rank " + std::to_string(peer_));
      if (b.Signaled() != seq) {
        t_.FailShared(group_);
        return InternalError("cuda_ipc: pack into rank " + std::to_string(peer_) +
                             " completed without its signal (launch " + std::to_string(seq) +
                             ", signaled " + std::to_string(b.Signaled()) + ")");
      }
    }
    TraceLaunch("launch complete", bytes_.size());
    t_.LaunchCompleted();  // the GPU's turn goes to the next launch before the messages
    // Every pair of the launch tells its receiver now, not one per Poll of the caller's loop.
    if (group_) {
      SS_RETURN_IF_ERROR(t_.FinishLaunch(group_, this));
    } else {
      SS_ASSIGN_OR_RETURN(std::vector<uint64_t> packed, batch_->Checksums());
      SS_ASSIGN_OR_RETURN(std::vector<uint64_t> landed, batch_->LandedSums());
      SS_RETURN_IF_ERROR(Finished(packed, landed, batch_->NonFinite()));
    }
    if (state_ == kIdle) return XferState::kDone;
  }
  SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(id_));
  if (st == XferState::kDone) state_ = kIdle;
  return st;
}

Status IpcSendPair::Finished(const std::vector<uint64_t>& packed,
                             const std::vector<uint64_t>& landed,
                             const std::vector<int64_t>& nonfinite) {
  const size_t first = group_ ? first_ : 0;
  if (first + bytes_.size() > packed.size() || first + bytes_.size() > landed.size()) {
    return InternalError("cuda_ipc: launch sums for " + std::to_string(packed.size()) +
                         " buckets, pair to rank " + std::to_string(peer_) + " needs [" +
                         std::to_string(first) + ", " + std::to_string(first + bytes_.size()) +
                         ")");
  }
  int64_t bad = 0;
  for (size_t b = first; b < first + bytes_.size() && b < nonfinite.size(); ++b)
    bad += nonfinite[b];
  if (bad > 0) {
    state_ = kIdle;  // the receiver hears of it through the session's abort
    return DataLossError("cuda_ipc: " + std::to_string(bad) +
                         " non-finite trainer values (NaN or Inf) in block-FP8 weights for rank " +
                         std::to_string(peer_) +
                         ": block FP8 cannot represent them; nothing of this sync is reported "
                         "good and the engine ranks stay poisoned");
  }
  sums_.packed.assign(packed.begin() + first, packed.begin() + first + bytes_.size());
  msg_ = {version_, bytes_.size()};
  sums_.landed.clear();
  for (size_t b = 0; b < bytes_.size(); ++b) {
    sums_.landed.push_back(ChecksumFinish(landed[first + b], static_cast<uint64_t>(bytes_[b])));
    msg_.push_back(sums_.landed.back());
  }
  msg_.insert(msg_.end(), sums_.packed.begin(), sums_.packed.end());
  // Every byte is in the receiver's memory before it hears of it.
  SS_ASSIGN_OR_RETURN(id_, t_.PostSendHost(peer_, PairTag(version_), msg_.data(), msg_.size() * 8));
  state_ = kSending;
  SS_ASSIGN_OR_RETURN(XferState st, t_.Poll(id_));  // into the mailbox now, usually
  if (st == XferState::kDone) state_ = kIdle;
  return OkStatus();
}

void IpcSendPair::Cancel() {
  if (state_ == kIdle) return;
  cancelled_ = true;
  t_.DropTurn();
  if (state_ == kPosted) state_ = kIdle;  // never launched: nothing in flight
}

std::string IpcSendPair::Describe() const {
  const char* how = group_ == t_.remote_marker() ? " (launched by another sender on this GPU)"
                    : group_                     ? " (one launch with the other pairs)"
                                                 : " (1 launch)";
  return "cuda_ipc: " + std::to_string(bytes_.size()) + " buckets into rank " +
         std::to_string(peer_) + how + (state_ == kPosted ? t_.TurnNote() : "");
}

namespace {

// The receiver's own map of the regions `of(bucket)` gives (elements of `dtype`), merged into
// runs contiguous in wire and memory, as a store value headed by `magic`.
Result<std::string> LandedMap(const CudaIpcTransport& t, const PairSpec& spec, DType dtype,
                              uint64_t magic,
                              const std::function<std::vector<PackRegion>(size_t)>& of) {
  const int ws = DTypeSize(dtype);
  std::vector<LandedEntry> map;
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    for (const PackRegion& r : of(b)) {
      if (r.dtype != dtype) {
        return InvalidArgumentError(
            "cuda_ipc: landed region of pair with rank " + std::to_string(spec.peer) + " is " +
            std::string(DTypeName(r.dtype)) + ", expected " + std::string(DTypeName(dtype)));
      }
      SS_ASSIGN_OR_RETURN(auto where, t.FindLocal(r.base, NumElements(r.shape) * ws));
      int64_t wire = r.wire_offset;
      ForEachRun(r.region, r.shape, [&](int64_t off, int64_t len) {
        const int64_t at = static_cast<int64_t>(where.second) + off * ws, n = len * ws;
        LandedEntry* last = map.empty() ? nullptr : &map.back();
        if (last && last->bucket == static_cast<int64_t>(b) && last->region == where.first &&
            last->offset + last->bytes == at && last->wire + last->bytes == wire) {
          last->bytes += n;
        } else {
          map.push_back({static_cast<int64_t>(b), wire, where.first, at, n});
        }
        wire += n;
      });
    }
  }
  std::string blob(16 + map.size() * sizeof(LandedEntry), '\0');
  const uint64_t head[2] = {magic, map.size()};
  std::memcpy(blob.data(), head, 16);
  if (!map.empty()) std::memcpy(blob.data() + 16, map.data(), map.size() * sizeof(LandedEntry));
  return blob;
}

// The receiver's map `blob` (LandedMap) as landed runs of the sender's batch, each mapped
// through the receiver's regions.
Status LandedRuns(CudaIpcTransport& t, const PairSpec& spec, const std::string& blob,
                  uint64_t magic, int ws, const std::string& what, std::vector<CopyRun>* out) {
  const std::string who = "cuda_ipc: pair with rank " + std::to_string(spec.peer);
  uint64_t head[2] = {0, 0};
  if (blob.size() >= 16) std::memcpy(head, blob.data(), 16);
  if (blob.size() < 16 || head[0] != magic || (blob.size() - 16) / sizeof(LandedEntry) != head[1] ||
      (blob.size() - 16) % sizeof(LandedEntry) != 0) {
    return DataLossError(who + ": the receiver's " + what + " is malformed (" +
                         std::to_string(blob.size()) + " bytes)");
  }
  std::vector<LandedEntry> map(head[1]);
  if (!map.empty()) std::memcpy(map.data(), blob.data() + 16, map.size() * sizeof(LandedEntry));
  for (size_t k = 0; k < map.size(); ++k) {
    const LandedEntry& e = map[k];
    if (e.bucket < 0 || e.bucket >= static_cast<int64_t>(spec.buckets.size()) || e.wire < 0 ||
        e.region < 0 || e.region > UINT32_MAX || e.offset < 0 || e.bytes <= 0 || e.wire % ws != 0 ||
        e.bytes % ws != 0) {
      return DataLossError(who + ": " + what + " entry " + std::to_string(k) + " is malformed");
    }
    SS_ASSIGN_OR_RETURN(
        void* p, t.RemotePointer(spec.peer, static_cast<uint32_t>(e.region),
                                 static_cast<uint64_t>(e.offset), static_cast<uint64_t>(e.bytes)));
    CopyRun lr;
    lr.in = p;
    lr.row_elems = e.bytes / ws;
    lr.bucket = static_cast<int32_t>(e.bucket);
    lr.wire_offset = e.wire;
    out->push_back(lr);
  }
  return OkStatus();
}

// Stage ops (kStage encoded regions: raw values, no cast, into the receiver's staging) travel as
// plain copies of a compact image of their own, whatever codec staged them.
bool IsStage(const EncodedRegion& r) {
  return static_cast<Encoding>(r.encoding) == Encoding::kStage;
}

bool HasStage(const PairSpec& spec) {
  for (const PairBucket& b : spec.buckets) {
    for (const EncodedRegion& r : b.encoded) {
      if (IsStage(r)) return true;
    }
  }
  return false;
}

std::vector<PackRegion> StageLocals(const PairSpec& spec, size_t b) {
  std::vector<PackRegion> v;
  for (const EncodedRegion& r : spec.buckets[b].encoded) {
    if (IsStage(r)) v.push_back(r.src);
  }
  return v;
}

// Sender: the bucket's stage ops as raw copies (no cast) into the receiver's staging, at offsets
// of a compact image of them, read back through the receiver's staging map.
Status AddStageRuns(CudaIpcTransport& t, StoreClient& store, const PairSpec& spec, Millis timeout,
                    BatchSpec* bs) {
  const std::string who = "cuda_ipc: image pair with rank " + std::to_string(spec.peer);
  bool first = true;
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    int64_t bytes = 0;
    size_t i = 0;
    for (const EncodedRegion& sr : spec.buckets[b].encoded) {
      if (!IsStage(sr)) continue;
      const PackRegion& l = sr.src;
      const RemoteRegion& r = sr.dst;
      if (first) bs->stage_dtype = l.dtype;
      first = false;
      const int es = DTypeSize(l.dtype);
      if (l.dtype != bs->stage_dtype || l.wire_offset != bytes ||
          l.region.numel() != r.dst.numel() || !RegionInside(l.region, l.shape) ||
          !RegionInside(r.dst, r.shape)) {
        return InvalidArgumentError(who + ": bucket " + std::to_string(b) + " stage op " +
                                    std::to_string(i) + " " + l.region.ToString() + " -> " +
                                    r.dst.ToString() +
                                    " does not fit (dtype, compact offset, size or bounds)");
      }
      SS_ASSIGN_OR_RETURN(
          void* base, t.RemotePointer(spec.peer, r.region, r.offset, NumElements(r.shape) * es));
      AppendCoRuns(l.region, l.shape, l.base, es, r.dst, r.shape, base, es, es,
                   static_cast<int32_t>(b), l.wire_offset, &bs->stage_runs);
      bytes += l.region.numel() * es;
      ++i;
    }
    bs->stage_bytes.push_back(bytes);
  }
  SS_ASSIGN_OR_RETURN(std::string blob, store.Get(spec.key + "stagemap", timeout));
  return LandedRuns(t, spec, blob, kStageMagic, DTypeSize(bs->stage_dtype), "staging map",
                    &bs->stage_landed_runs);
}

}  // namespace

Result<std::unique_ptr<PreparedPair>> CudaIpcTransport::Prepare(StoreClient& store,
                                                                const PairSpec& spec,
                                                                Millis timeout) {
  SS_RETURN_IF_ERROR(Usable());
  SS_RETURN_IF_ERROR(CheckBuckets(spec));
  if (spec.delta.on) return PrepareDeltaPair(*this, store, spec, timeout);
  const std::string who = "cuda_ipc: pair with rank " + std::to_string(spec.peer);
  if (!spec.send) {
    SS_ASSIGN_OR_RETURN(std::string blob,
                        LandedMap(*this, spec, spec.wire, kLandedMagic,
                                  [&](size_t b) { return spec.buckets[b].local; }));
    SS_RETURN_IF_ERROR(store.Set(spec.key + "landed", blob));
    if (spec.image) {
      SS_ASSIGN_OR_RETURN(std::string enc, EncodedLandedMap(*this, spec));
      SS_RETURN_IF_ERROR(store.Set(spec.key + "encmap", enc));
    }
    if (spec.image && HasStage(spec)) {  // only pairs with stage ops publish (and read) it
      DType stage_dtype = DType::kF32;
      for (size_t b = 0; b < spec.buckets.size(); ++b) {
        const std::vector<PackRegion> locals = StageLocals(spec, b);
        if (!locals.empty()) {
          stage_dtype = locals[0].dtype;
          break;
        }
      }
      SS_ASSIGN_OR_RETURN(std::string st,
                          LandedMap(*this, spec, stage_dtype, kStageMagic,
                                    [&](size_t b) { return StageLocals(spec, b); }));
      SS_RETURN_IF_ERROR(store.Set(spec.key + "stagemap", st));
    }
    return std::unique_ptr<PreparedPair>(new IpcRecvPair(*this, spec.peer, spec.buckets.size()));
  }
  OpenTurnstile();
  BatchSpec bs;
  bs.mode = BatchMode::kPack;
  bs.out_dtype = spec.wire;
  bool first = true;
  const int ws = DTypeSize(spec.wire);
  std::vector<int64_t> bytes;
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    const PairBucket& pb = spec.buckets[b];
    bytes.push_back(pb.bytes);
    bs.bucket_bytes.push_back(pb.bytes);
    if (pb.remote.size() != pb.local.size()) {
      return InvalidArgumentError(who + ": bucket " + std::to_string(b) + " has " +
                                  std::to_string(pb.local.size()) + " regions, " +
                                  std::to_string(pb.remote.size()) + " destinations");
    }
    for (size_t i = 0; i < pb.local.size(); ++i) {
      const PackRegion& l = pb.local[i];
      const RemoteRegion& r = pb.remote[i];
      if (first) bs.in_dtype = l.dtype;
      first = false;
      if (l.dtype != bs.in_dtype || l.region.numel() != r.dst.numel() ||
          !RegionInside(l.region, l.shape) || !RegionInside(r.dst, r.shape)) {
        return InvalidArgumentError(who + ": bucket " + std::to_string(b) + " region " +
                                    std::to_string(i) + " " + l.region.ToString() + " -> " +
                                    r.dst.ToString() + " does not fit (dtype, size or bounds)");
      }
      SS_ASSIGN_OR_RETURN(void* base,
                          RemotePointer(spec.peer, r.region, r.offset, NumElements(r.shape) * ws));
      AppendCoRuns(l.region, l.shape, l.base, DTypeSize(l.dtype), r.dst, r.shape, base, ws, ws,
                   static_cast<int32_t>(b), l.wire_offset, &bs.runs);
    }
  }
  if (spec.image) {  // the codec's encoded ops, and each bucket's compact copy image
    SS_ASSIGN_OR_RETURN(std::string enc, store.Get(spec.key + "encmap", timeout));
    SS_RETURN_IF_ERROR(AddEncodedTasks(*this, spec, enc, &bs));
    if (HasStage(spec)) SS_RETURN_IF_ERROR(AddStageRuns(*this, store, spec, timeout, &bs));
  } else {
    for (const PairBucket& pb : spec.buckets) {
      if (!pb.encoded.empty())
        return InvalidArgumentError(who + ": encoded ops outside an image pair");
    }
  }
  // The receiver's map, read back through its regions.
  SS_ASSIGN_OR_RETURN(std::string blob, store.Get(spec.key + "landed", timeout));
  SS_RETURN_IF_ERROR(
      LandedRuns(*this, spec, blob, kLandedMagic, ws, "landed map", &bs.landed_runs));
  auto pair = std::make_unique<IpcSendPair>(*this, spec.peer, std::move(bytes));
  SS_RETURN_IF_ERROR(pair->Init(std::move(bs)).Annotate(who));
  return std::unique_ptr<PreparedPair>(std::move(pair));
}

}  // namespace shardsync::gpu::ipc
