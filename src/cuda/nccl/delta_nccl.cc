// nccl pairs under the delta encoding: the device delta pair's protocol (cuda/delta/delta_pair.h)
// over the pair's own 2-rank communicator, two-sided. NCCL matches a pair's messages by order, so
// both sides issue the same sequence, per sync:
//   receiver -> sender: the bases message (2 + 2 x buckets words);
//   per bucket, sender -> receiver: its control message (7 words), then its payload of exactly
//   the control message's length (the delta, or the bucket whole).
// ncclSend / ncclRecv take their counts on the host, and a delta's size is known on the device
// only after its encode: the sender reads it back (FinishDeltaEncode, one small read per bucket)
// before it sends the control message and the payload in one group; the receiver receives the
// control message into device memory, copies it to pinned host memory, checks it, then posts the
// payload's receive of that many bytes into its window (slot or encoded part). The receiver posts
// a bucket's receives only after it landed the last one, so the window needs no acknowledgement.
//
// A non-blocking communicator takes one call at a time (the next waits until the previous left
// ncclInProgress): calls are queued and issued in order from the polls, each followed by an event
// on the channel's stream. Every wait on the peer is the session's (its deadline; a dead peer on
// this host is seen through its pid, a failed remote one through the communicator's async error).
// A cancelled replay aborts the communicator (as for full nccl pairs): its messages could match the
// next sync's otherwise; later Posts fail with Aborted, and the job re-connects.
#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>

#include "cuda/cuda_util.h"
#include "cuda/delta/delta_pair.h"
#include "cuda/nccl/nccl_transport.h"

namespace shardsync::gpu::nccl {
namespace {

using delta_pair::DeltaCtl;
using delta_pair::kDeltaCtlWords;

// The pair's ordered calls on its communicator, and the small buffers its messages pass through.
class NcclDeltaLink {
 public:
  NcclDeltaLink(NcclTransport& t, int peer, std::string who)
      : t_(t), peer_(peer), who_(std::move(who)) {}
  ~NcclDeltaLink() {
    cudaSetDevice(t_.device());
    // Calls still waiting on the peer would hold the buffers freed below (a pair torn down
    // without Cancel): their communicator goes first.
    Cancel();
    for (Call& c : calls_) {
      if (c.ev) cudaEventDestroy(c.ev);
    }
    if (host_) cudaFreeHost(host_);
    if (dev_) cudaFree(dev_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  // `words` of room for messages: [0, kDeltaCtlWords) the control message, the bases after.
  Status Init(size_t words) {
    SS_ASSIGN_OR_RETURN(auto comm, t_.PairComm(peer_));
    comm_ = comm.first;
    peer_rank_ = comm.second;
    SS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), who_ + ": stream");
    SS_CUDA(cudaMallocHost(&host_, words * 8), who_ + ": pinned message buffer");
    SS_CUDA(cudaMalloc(&dev_, words * 8), who_ + ": device message buffer");
    return OkStatus();
  }
  uint64_t* host(size_t word) { return static_cast<uint64_t*>(host_) + word; }
  // A message's copy between the pinned and the device words, on the link's stream (enqueued
  // by a call's `before` / `after`).
  Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    SS_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, stream_), who_ + ": message copy");
    return OkStatus();
  }
  uint64_t* dev(size_t word) { return static_cast<uint64_t*>(dev_) + word; }

  struct Op {
    bool send;
    void* buf;
    size_t bytes;
  };
  // Queues one group of `ops` (device buffers): `before` and `after` enqueue work on the stream
  // around it (the host <-> device copies of a message). Returns its ticket.
  Result<uint64_t> Queue(std::vector<Op> ops, std::function<Status()> before,
                         std::function<Status()> after) {
    if (aborted_) return AbortedError(who_ + ": the communicator was aborted (a failed sync)");
    Call c;
    c.ticket = ++last_ticket_;
    c.ops = std::move(ops);
    c.before = std::move(before);
    c.after = std::move(after);
    calls_.push_back(std::move(c));
    active_ = true;
    SS_RETURN_IF_ERROR(Pump());
    return last_ticket_;
  }
  // Whether call `ticket` (and every call before it) completed.
  Result<bool> Done(uint64_t ticket) {
    if (aborted_) return AbortedError(who_ + ": the communicator was aborted (a failed sync)");
    SS_RETURN_IF_ERROR(Pump());
    while (!calls_.empty() && calls_.front().enqueued) {
      Call& c = calls_.front();
      const cudaError_t e = cudaEventQuery(c.ev);
      if (e == cudaErrorNotReady) break;
      SS_CUDA(e, who_ + ": transfer");
      cudaEventDestroy(c.ev);
      done_ = c.ticket;
      calls_.pop_front();
    }
    if (done_ >= ticket) return true;
    SS_RETURN_IF_ERROR(CommState().status());  // a failed remote peer surfaces here
    return false;
  }
  Result<bool> Drained() {
    SS_ASSIGN_OR_RETURN(bool d, Done(last_ticket_));
    if (d) active_ = false;
    return d;
  }
  Status CheckPeer() const { return t_.CheckPeer(peer_); }
  // Calls in flight of a failed sync would match the next sync's: the communicator goes.
  void Cancel() {
    if (!active_ || aborted_) return;
    aborted_ = true;
    t_.AbortPeer(peer_);
  }

 private:
  struct Call {
    uint64_t ticket = 0;
    std::vector<Op> ops;
    std::function<Status()> before, after;
    cudaEvent_t ev = nullptr;
    bool issued = false, enqueued = false;  // NCCL took it / it left ncclInProgress
  };

  Result<ncclResult_t> CommState() const {
    ncclResult_t st = ncclSuccess;
    SS_RETURN_IF_ERROR(NcclStatus(Nccl().CommGetAsyncError(comm_, &st), comm_, who_ + ": state"));
    SS_RETURN_IF_ERROR(NcclStatus(st, comm_, who_));
    return st;
  }

  // Issues the queued calls in order while the communicator takes them.
  Status Pump() {
    SS_CUDA(cudaSetDevice(t_.device()), who_ + ": cudaSetDevice");
    for (Call& c : calls_) {
      if (c.enqueued) continue;
      if (!c.issued) {
        if (c.before) SS_RETURN_IF_ERROR(c.before());
        SS_RETURN_IF_ERROR(NcclStatus(Nccl().GroupStart(), comm_, who_ + ": group start"));
        for (const Op& op : c.ops) {
          const ncclResult_t r =
              op.send ? Nccl().Send(op.buf, op.bytes, ncclUint8, peer_rank_, comm_, stream_)
                      : Nccl().Recv(op.buf, op.bytes, ncclUint8, peer_rank_, comm_, stream_);
          if (r != ncclSuccess && r != ncclInProgress) {
            Nccl().GroupEnd();
            return NcclStatus(r, comm_, who_ + (op.send ? ": send" : ": recv"));
          }
        }
        const ncclResult_t r = Nccl().GroupEnd();
        if (r != ncclSuccess && r != ncclInProgress) {
          return NcclStatus(r, comm_, who_ + ": group end");
        }
        c.issued = true;
      }
      SS_ASSIGN_OR_RETURN(ncclResult_t st, CommState());
      if (st == ncclInProgress) return OkStatus();
      if (c.after) SS_RETURN_IF_ERROR(c.after());
      SS_CUDA(cudaEventCreateWithFlags(&c.ev, cudaEventDisableTiming), who_ + ": event");
      SS_CUDA(cudaEventRecord(c.ev, stream_), who_ + ": event record");
      c.enqueued = true;
    }
    return OkStatus();
  }

  NcclTransport& t_;
  int peer_;
  std::string who_;
  ncclComm_t comm_ = nullptr;
  int peer_rank_ = 0;
  cudaStream_t stream_ = nullptr;
  void *host_ = nullptr, *dev_ = nullptr;
  std::deque<Call> calls_;
  uint64_t last_ticket_ = 0, done_ = 0;
  bool active_ = false, aborted_ = false;
};

class NcclDeltaSend final : public delta_pair::DeltaSendChannel {
 public:
  NcclDeltaSend(NcclTransport& t, int peer, std::string who) : link_(t, peer, std::move(who)) {}
  Status Init(size_t buckets) {
    bases_words_ = delta_pair::BasesWords(buckets);
    return link_.Init(kDeltaCtlWords + bases_words_);
  }

  Status PostBases(uint64_t, std::vector<uint64_t>* words) override {
    words_ = words;
    bases_in_ = false;
    const size_t bytes = bases_words_ * 8;
    uint64_t* h = link_.host(kDeltaCtlWords);
    uint64_t* d = link_.dev(kDeltaCtlWords);
    SS_ASSIGN_OR_RETURN(bases_, link_.Queue({{false, d, bytes}}, nullptr, [this, h, d, bytes] {
      return link_.Copy(h, d, bytes, cudaMemcpyDeviceToHost);
    }));
    return OkStatus();
  }
  Result<bool> BasesIn() override {
    if (bases_in_) return true;
    SS_ASSIGN_OR_RETURN(bool in, link_.Done(bases_));
    if (!in) return false;
    std::memcpy(words_->data(), link_.host(kDeltaCtlWords),
                std::min(words_->size(), bases_words_) * 8);
    bases_in_ = true;
    return true;
  }
  // The control message, then the payload: two calls, so each of the receiver's two receives
  // (the second posted only once it read the first) meets a call of its own.
  Status Ship(const DeltaCtl& ctl, const void* src, bool) override {
    // The pinned words are free: the last bucket's calls completed (Shipped) before this one.
    std::memcpy(link_.host(0), ctl.data(), sizeof(ctl));
    uint64_t* h = link_.host(0);
    uint64_t* d = link_.dev(0);
    SS_RETURN_IF_ERROR(
        link_
            .Queue(
                {{true, d, sizeof(ctl)}},
                [this, h, d] { return link_.Copy(d, h, sizeof(DeltaCtl), cudaMemcpyHostToDevice); },
                nullptr)
            .status());
    SS_ASSIGN_OR_RETURN(ship_,
                        link_.Queue({{true, const_cast<void*>(src), ctl[4]}}, nullptr, nullptr));
    return OkStatus();
  }
  Result<bool> Shipped() override { return link_.Done(ship_); }
  Result<bool> WindowFree() override { return true; }
  Result<bool> Drained() override { return link_.Drained(); }
  Status CheckPeer() override { return link_.CheckPeer(); }
  void Cancel() override { link_.Cancel(); }

 private:
  NcclDeltaLink link_;
  size_t bases_words_ = 0;
  std::vector<uint64_t>* words_ = nullptr;
  uint64_t bases_ = 0, ship_ = 0;
  bool bases_in_ = false;
};

class NcclDeltaRecv final : public delta_pair::DeltaRecvChannel {
 public:
  NcclDeltaRecv(NcclTransport& t, int peer, std::string who) : link_(t, peer, std::move(who)) {}
  Status Init(size_t buckets) {
    bases_words_ = delta_pair::BasesWords(buckets);
    return link_.Init(kDeltaCtlWords + bases_words_);
  }

  Status SendBases(uint64_t, const std::vector<uint64_t>& words) override {
    if (words.size() != bases_words_) {
      return InternalError("nccl: delta bases of " + std::to_string(words.size()) + " words, " +
                           std::to_string(bases_words_) + " expected");
    }
    // The pinned words are free: the last sync's calls completed (Drained).
    std::memcpy(link_.host(kDeltaCtlWords), words.data(), words.size() * 8);
    uint64_t* h = link_.host(kDeltaCtlWords);
    uint64_t* d = link_.dev(kDeltaCtlWords);
    const size_t bytes = words.size() * 8;
    SS_ASSIGN_OR_RETURN(uint64_t t, link_.Queue(
                                        {{true, d, bytes}},
                                        [this, h, d, bytes] {
                                          return link_.Copy(d, h, bytes, cudaMemcpyHostToDevice);
                                        },
                                        nullptr));
    (void)t;
    return OkStatus();
  }
  Status PostCtl(uint64_t, DeltaCtl* ctl) override {
    ctl_ = ctl;
    uint64_t* h = link_.host(0);
    uint64_t* d = link_.dev(0);
    SS_ASSIGN_OR_RETURN(ctl_ticket_,
                        link_.Queue({{false, d, sizeof(DeltaCtl)}}, nullptr, [this, h, d] {
                          return link_.Copy(h, d, sizeof(DeltaCtl), cudaMemcpyDeviceToHost);
                        }));
    return OkStatus();
  }
  Result<bool> CtlIn() override {
    SS_ASSIGN_OR_RETURN(bool in, link_.Done(ctl_ticket_));
    if (in) std::memcpy(ctl_->data(), link_.host(0), sizeof(DeltaCtl));
    return in;
  }
  Status PostPayload(void* dst, size_t bytes) override {
    SS_ASSIGN_OR_RETURN(payload_, link_.Queue({{false, dst, bytes}}, nullptr, nullptr));
    return OkStatus();
  }
  Result<bool> PayloadIn() override { return link_.Done(payload_); }
  // The next bucket's receives are posted after this one landed: nothing to tell the sender.
  Status Landed(uint64_t, uint64_t) override { return OkStatus(); }
  Result<bool> Drained() override { return link_.Drained(); }
  Status CheckPeer() override { return link_.CheckPeer(); }
  void Cancel() override { link_.Cancel(); }

 private:
  NcclDeltaLink link_;
  size_t bases_words_ = 0;
  DeltaCtl* ctl_ = nullptr;
  uint64_t ctl_ticket_ = 0, payload_ = 0;
};

}  // namespace

Result<std::unique_ptr<PreparedPair>> PrepareDeltaPair(NcclTransport& t, const PairSpec& spec) {
  const std::string who = std::string("nccl: delta pair ") + (spec.send ? "to" : "from") +
                          " rank " + std::to_string(spec.peer);
  SS_RETURN_IF_ERROR(delta_pair::CheckDeltaSpec(spec, who));
  SS_CUDA(cudaSetDevice(t.device()), who + ": cudaSetDevice");
  const size_t n = spec.buckets.size();
  if (spec.send) {
    auto ch = std::make_unique<NcclDeltaSend>(t, spec.peer, who);
    SS_RETURN_IF_ERROR(ch->Init(n));
    return delta_pair::MakeDeltaSendPair(spec, t.device(), who, std::move(ch));
  }
  return delta_pair::MakeDeltaRecvPair(
      spec, t.device(), who,
      [&](const delta_pair::DeltaWindow&) -> Result<std::unique_ptr<delta_pair::DeltaRecvChannel>> {
        auto ch = std::make_unique<NcclDeltaRecv>(t, spec.peer, who);
        SS_RETURN_IF_ERROR(ch->Init(n));
        return std::unique_ptr<delta_pair::DeltaRecvChannel>(std::move(ch));
      });
}

}  // namespace shardsync::gpu::nccl
