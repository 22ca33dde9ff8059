// nccl prepared pairs (nccl_transport.h).
//
// Every round (a plan bucket) is enqueued on streams with device-side ordering only: the sender
// packs round b into slot b % depth on its pack stream once the send of round b - depth left that
// slot (event), and sends it on its comm stream once packed (event); the receiver receives round b
// into slot b % depth once the unpack of round b - depth drained it, and unpacks it (cast +
// checksum) into its parameters on its unpack stream. The host only enqueues (a non-blocking
// communicator takes one call at a time: each waits until the previous left ncclInProgress) and
// polls one event at the end. Checksums: the sender's pack and the receiver's unpack kernels sum
// the wire image of each round.
//
// Image pairs (PairSpec::image: block FP8's) send each round as the plan's wire image (the codec's
// rounds: fp8_rounds.h): the sender's prepared batch quantizes into the slot at the ops' wire
// offsets, casts the copies there and zeroes the pads, then a verify batch sums the slot's bytes
// (the packed checksum); the receiver's byte-copy batch scatters e4m3 rows, scale rows and copies
// into its parameters and sums the same bytes (the landed checksum).
#include <algorithm>
#include <cstring>

#include "common/trace.h"
#include "cuda/cuda_util.h"
#include "cuda/nccl/fp8_rounds.h"
#include "cuda/nccl/nccl_transport.h"

namespace shardsync::gpu::nccl {

using internal::CudaStatus;

namespace {

class NcclPair final : public PreparedPair {
 public:
  NcclPair(NcclTransport& t, const PairSpec& spec, ncclComm_t comm, int peer_rank)
      : t_(t), peer_(spec.peer), send_(spec.send), comm_(comm), peer_rank_(peer_rank) {
    for (const PairBucket& b : spec.buckets) bytes_.push_back(b.bytes);
  }
  ~NcclPair() override {
    cudaSetDevice(t_.device());
    for (auto* v : {&ev_a_, &ev_b_}) {
      for (cudaEvent_t e : *v) cudaEventDestroy(e);
    }
    if (done_) cudaEventDestroy(done_);
    for (cudaStream_t st : {work_, comm_stream_}) {
      if (st) cudaStreamDestroy(st);
    }
  }

  Status Init(const PairSpec& spec) {
    const int dev = t_.device();
    SS_CUDA(cudaSetDevice(dev), "nccl pair: cudaSetDevice");
    SS_CUDA(cudaStreamCreateWithFlags(&work_, cudaStreamNonBlocking), "nccl pair: stream");
    SS_CUDA(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking), "nccl pair: stream");
    SS_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "nccl pair: event");
    const size_t nb = bytes_.size();
    const int64_t cap = *std::max_element(bytes_.begin(), bytes_.end());
    const size_t slots = std::min<size_t>(nb, static_cast<size_t>(std::max(1, t_.depth())));
    for (size_t k = 0; k < slots; ++k) {
      SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(static_cast<size_t>(cap), dev));
      slots_.push_back(std::move(buf));
    }
    const int ws = DTypeSize(spec.wire);
    if (spec.image) {  // the pads' zeros (sender) or their sink (receiver)
      SS_ASSIGN_OR_RETURN(scratch_, DeviceBuffer::Allocate(kImageRoundScratchBytes, dev));
      SS_CUDA(cudaMemset(scratch_->data(), 0, kImageRoundScratchBytes), "nccl pair: zeros");
    }
    for (size_t b = 0; b < nb; ++b) {
      cudaEvent_t a = nullptr, c = nullptr;
      SS_CUDA(cudaEventCreateWithFlags(&a, cudaEventDisableTiming), "nccl pair: event");
      ev_a_.push_back(a);
      SS_CUDA(cudaEventCreateWithFlags(&c, cudaEventDisableTiming), "nccl pair: event");
      ev_b_.push_back(c);
      auto* slot = static_cast<unsigned char*>(slots_[b % slots]->data());
      if (spec.image) {
        SS_RETURN_IF_ERROR(InitImageRound(spec, b, slot));
        continue;
      }
      BatchSpec bs;
      bs.mode = send_ ? BatchMode::kPack : BatchMode::kUnpack;
      bs.bucket_bytes = {bytes_[b]};
      const auto& local = spec.buckets[b].local;
      const DType td = local.empty() ? spec.wire : local[0].dtype;
      bs.in_dtype = send_ ? td : spec.wire;
      bs.out_dtype = send_ ? spec.wire : td;
      for (size_t i = 0; i < local.size(); ++i) {
        const PackRegion& r = local[i];
        if (r.dtype != td || !RegionInside(r.region, r.shape)) {
          return InvalidArgumentError("nccl pair with rank " + std::to_string(peer_) + ": bucket " +
                                      std::to_string(b) + " region " + std::to_string(i) +
                                      " mixes dtypes or leaves its tensor");
        }
        const size_t first = bs.runs.size();
        AppendRegionRuns(r.region, r.shape, r.base, DTypeSize(td), slot + r.wire_offset, ws, ws, 0,
                         r.wire_offset, &bs.runs);
        if (!send_) {  // unpack: the wire image is the input
          for (size_t k = first; k < bs.runs.size(); ++k) {
            CopyRun& c2 = bs.runs[k];
            const void* tensor = c2.in;
            c2.in = c2.out;
            c2.out = const_cast<void*>(tensor);
            std::swap(c2.in_stride, c2.out_stride);
          }
        }
      }
      SS_ASSIGN_OR_RETURN(auto batch, CopyBatch::Prepare(bs, dev));
      batches_.push_back(std::move(batch));
    }
    return OkStatus();
  }

  // Round b of an image pair (fp8_rounds.h): the sender's batch into the slot and the
  // verify batch over it, or the receiver's scatter.
  Status InitImageRound(const PairSpec& spec, size_t b, unsigned char* slot) {
    const std::string who =
        "nccl: image pair with rank " + std::to_string(peer_) + ", round " + std::to_string(b);
    if (send_) {
      SS_ASSIGN_OR_RETURN(ImageSendRound r,
                          PrepareImageSendRound(spec.buckets[b], spec.wire, slot, scratch_->data(),
                                                t_.device(), who));
      batches_.push_back(std::move(r.pack));
      verify_.push_back(std::move(r.verify));
      return OkStatus();
    }
    SS_ASSIGN_OR_RETURN(auto batch, PrepareImageRecvRound(spec.buckets[b], spec.wire, slot,
                                                          scratch_->data(), t_.device(), who));
    batches_.push_back(std::move(batch));
    return OkStatus();
  }

  Status Post(uint64_t) override {
    if (cancelled_) {
      return AbortedError("nccl: pair with rank " + std::to_string(peer_) + " was cancelled");
    }
    SS_CUDA(cudaSetDevice(t_.device()), "nccl pair: cudaSetDevice");
    next_ = 0;
    call_pending_ = false;
    recorded_done_ = false;
    posted_ = true;
    return Pump();
  }

  Result<XferState> Poll() override {
    if (!posted_) return XferState::kDone;
    SS_RETURN_IF_ERROR(Pump());
    if (next_ < bytes_.size()) {  // the peer cannot have finished: its exit is a death
      SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
      return XferState::kInProgress;
    }
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) {
      SS_RETURN_IF_ERROR(CommState().status());  // a failed remote peer surfaces here
      SS_RETURN_IF_ERROR(t_.CheckPeer(peer_));
      return XferState::kInProgress;
    }
    SS_CUDA(e, "nccl: pair with rank " + std::to_string(peer_));
    posted_ = false;
    trace::Line("nccl pair %s rank %d: done", send_ ? "->" : "<-", peer_);
    return XferState::kDone;
  }

  Result<PairSums> Sums() override {
    PairSums s;
    int64_t bad = 0;
    for (size_t b = 0; b < batches_.size(); ++b) {
      // FP8 senders: the verify batch summed the slot's bytes as sent.
      SS_ASSIGN_OR_RETURN(auto c, (verify_.empty() ? batches_[b] : verify_[b])->Checksums());
      (send_ ? s.packed : s.landed).push_back(c[0]);
      for (int64_t n : batches_[b]->NonFinite()) bad += n;
    }
    if (bad > 0) {  // the receiver hears of it through the session's abort
      return DataLossError("nccl: " + std::to_string(bad) +
                           " non-finite trainer values (NaN or Inf) in block-FP8 weights for "
                           "rank " +
                           std::to_string(peer_) +
                           ": block FP8 cannot represent them; nothing of this sync is reported "
                           "good and the engine ranks stay poisoned");
    }
    return s;
  }

  void Cancel() override {
    if (!posted_) return;
    cancelled_ = true;
    posted_ = false;
    t_.AbortPeer(peer_);
  }

  std::string Describe() const override {
    return std::string("nccl: ") + (send_ ? "send to" : "recv from") + " rank " +
           std::to_string(peer_) + ", " + std::to_string(bytes_.size()) + " rounds, " +
           std::to_string(slots_.size()) + " in flight";
  }

 private:
  // kInProgress while the communicator still takes the previous call.
  Result<ncclResult_t> CommState() const {
    ncclResult_t st = ncclSuccess;
    SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommGetAsyncError(comm_, &st), comm_, "nccl: state"));
    SS_RETURN_IF_ERROR(NcclStatus(st, comm_, "nccl: pair with rank " + std::to_string(peer_)));
    return st;
  }

  // Enqueues as many rounds as the communicator takes now.
  Status Pump() {
    const size_t nb = bytes_.size(), d = slots_.size();
    while (next_ < nb) {
      SS_ASSIGN_OR_RETURN(ncclResult_t st, CommState());
      if (st == ncclInProgress) return OkStatus();
      const size_t b = next_;
      void* slot = slots_[b % d]->data();
      if (call_pending_) {  // round b's NCCL call is enqueued: the rest of the round follows it
        call_pending_ = false;
        SS_CUDA(cudaEventRecord(ev_b_[b], comm_stream_), "nccl pair: event");
        if (!send_) {
          SS_CUDA(cudaStreamWaitEvent(work_, ev_b_[b], 0), "nccl pair: unpack waits recv");
          SS_RETURN_IF_ERROR(batches_[b]->Launch(work_));
          SS_CUDA(cudaEventRecord(ev_a_[b], work_), "nccl pair: event");
        }
        trace::Line("nccl pair %s rank %d: round %zu enqueued", send_ ? "->" : "<-", peer_, b);
        ++next_;
        continue;
      }
      if (send_) {
        // ev_a: packed, ev_b: sent (the slot is free again).
        if (b >= d) SS_CUDA(cudaStreamWaitEvent(work_, ev_b_[b - d], 0), "nccl pair: slot wait");
        SS_RETURN_IF_ERROR(batches_[b]->Launch(work_));
        if (!verify_.empty()) SS_RETURN_IF_ERROR(verify_[b]->Launch(work_));
        SS_CUDA(cudaEventRecord(ev_a_[b], work_), "nccl pair: event");
        SS_CUDA(cudaStreamWaitEvent(comm_stream_, ev_a_[b], 0), "nccl pair: send waits pack");
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().Send(slot, static_cast<size_t>(bytes_[b]), ncclUint8,
                                                  peer_rank_, comm_, comm_stream_),
                                      comm_, "nccl: send to rank " + std::to_string(peer_)));
      } else {
        // ev_b: received, ev_a: unpacked (the slot is free again).
        if (b >= d) {
          SS_CUDA(cudaStreamWaitEvent(comm_stream_, ev_a_[b - d], 0), "nccl pair: slot wait");
        }
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().Recv(slot, static_cast<size_t>(bytes_[b]), ncclUint8,
                                                  peer_rank_, comm_, comm_stream_),
                                      comm_, "nccl: recv from rank " + std::to_string(peer_)));
      }
      call_pending_ = true;
    }
    if (next_ == nb && !call_pending_ && !recorded_done_) {
      SS_CUDA(cudaEventRecord(done_, send_ ? comm_stream_ : work_), "nccl pair: event");
      recorded_done_ = true;
    }
    return OkStatus();
  }

  NcclTransport& t_;
  int peer_;
  bool send_;
  ncclComm_t comm_;
  int peer_rank_;
  std::vector<int64_t> bytes_;
  std::vector<std::unique_ptr<DeviceBuffer>> slots_;
  std::vector<std::unique_ptr<CopyBatch>> batches_;
  std::vector<std::unique_ptr<CopyBatch>> verify_;  // FP8 senders: the slot's packed sums
  std::unique_ptr<DeviceBuffer> scratch_;           // FP8: the pads' zeros / sink
  std::vector<cudaEvent_t> ev_a_, ev_b_;
  cudaEvent_t done_ = nullptr;
  cudaStream_t work_ = nullptr, comm_stream_ = nullptr;
  size_t next_ = 0;
  bool call_pending_ = false, posted_ = false, cancelled_ = false, recorded_done_ = false;
};

}  // namespace

Result<std::unique_ptr<PreparedPair>> NcclTransport::Prepare(StoreClient&, const PairSpec& spec,
                                                             Millis) {
  if (spec.buckets.empty()) {
    return InvalidArgumentError("nccl: pair with rank " + std::to_string(spec.peer) +
                                " has no buckets");
  }
  if (spec.delta.on) return PrepareDeltaPair(*this, spec);
  for (size_t b = 0; spec.image && b < spec.buckets.size(); ++b) {
    // The session refuses these naming the tensor (sync/fp8_pairs.cc); a guard for other callers.
    bool staged = false;
    for (const EncodedRegion& r : spec.buckets[b].encoded) {
      staged = staged || static_cast<Encoding>(r.encoding) == Encoding::kStage;
    }
    if (staged) {
      return UnimplementedError("nccl: block-FP8 pair with rank " + std::to_string(spec.peer) +
                                ": bucket " + std::to_string(b) +
                                " stages rows into the receiver's staging, which only one-sided "
                                "pairs (cuda_ipc) write");
    }
  }
  SS_ASSIGN_OR_RETURN(auto comm, PairComm(spec.peer));
  auto pair = std::make_unique<NcclPair>(*this, spec, comm.first, comm.second);
  SS_RETURN_IF_ERROR(pair->Init(spec));
  return std::unique_ptr<PreparedPair>(std::move(pair));
}

}  // namespace shardsync::gpu::nccl
