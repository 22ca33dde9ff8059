// A session's prepared pairs: the messages whose transport compiles the pair's slice once at
// Connect and replays it each sync (device memory: cuda_ipc, nccl; transport.h PreparedPair).
// The host path (host_send.h, host_recv.h) carries every other message.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sync/bindings.h"
#include "sync/context.h"
#include "sync/guard.h"

namespace shardsync::sync_internal {

class PreparedPairs {
 public:
  PreparedPairs(const SessionContext& ctx, SyncGuard& guard) : ctx_(ctx), guard_(guard) {}

  // Every pair whose transport prepares transfers over the memory this rank's bindings live in
  // gets its slice compiled now. Receivers first: they publish what their senders read
  // (cuda_ipc: the landed map) and never wait. `regbase`: each receiver's first region id.
  Status Prepare(const Bindings& bindings, PeerShapes& shapes,
                 const std::map<int, uint32_t>& regbase, Clock::time_point deadline);

  // Block-FP8 engine ranks whose parameters live in device memory and whose plan stages bands:
  // allocates the plan's staging_bytes with the packer (device memory beside the parameters) for
  // the senders to write raw rows into, and returns it for RegisterParams; null for every other
  // rank (host receivers stage on the host path, fp8_codec.h). Before Connect.
  Result<const MemRegion*> AllocStaging(const Bindings& bindings);
  // Receiver, after FinishRecvs verified every checksum: quantizes every staged band from the
  // staging into its e4m3 rows and scales (the packer's kernel; a bounded wait); DataLoss naming
  // the parameter of a band with non-finite values. No-op without staging.
  Status QuantizeStaged();
  // Block-FP8 trainers whose prepared pairs carry amax ops (blocks shared with other trainer
  // ranks): whether they do, and the agreed scales (fp8_codec.h Exchange, plan slot order)
  // copied into the device memory those pairs' launches read. Must precede PostSends.
  bool has_amax_sends() const { return amax_scales_ != nullptr; }
  Status UploadAmaxScales(const std::vector<float>& scales);

  // Whether send / recv message `mi` of the plan runs as a prepared pair.
  bool sends(size_t mi) const { return send_[mi] != nullptr; }
  bool recvs(size_t mi) const { return recv_[mi] != nullptr; }
  // Whether send message `mi` is a pair that holds its writes until its receiver is in this sync
  // (cuda_ipc), so the sender needs no ready key from that receiver.
  bool SignalsReady(size_t mi) const { return send_[mi] && send_[mi]->SignalsReady(); }

  // Posts the send pairs with which(mi) / every receive pair for this version.
  Status PostSends(const std::function<bool(size_t)>& which);
  Status PostRecvs() { return Post(recv_, nullptr); }
  // Sender: every send pair done, then its packed checksums go to the store for the receiver.
  // `while_waiting` runs once while the pairs run (see Wait).
  Status FinishSends(RankSyncStats& st, const std::function<Status()>& while_waiting);
  // Receiver: every receive pair landed; each bucket's landed checksum against what its sender
  // packed (with the data where the transport delivers it, else from the store).
  Status FinishRecvs(RankSyncStats& st, const Bindings& bindings);
  // After a failure: no pair keeps waiting for this sync.
  void CancelAll();

 private:
  using Pairs = std::vector<std::unique_ptr<PreparedPair>>;
  // Prepare for block-FP8 plans (fp8_pairs.cc): quantize ops as PairBucket::quantize.
  Status PrepareFp8(const Bindings& bindings, PeerShapes& shapes,
                    const std::map<int, uint32_t>& regbase, Clock::time_point deadline);
  // FP8 ops prepared pairs do not run (amax-exchanged blocks; staged bands without device
  // staging), refused naming the tensor before any pair is prepared.
  Status RefuseUnbuiltFp8(const Bindings& bindings) const;
  // Trainers with amax ops over prepared pairs: device memory (the packer's) for the agreed
  // scales of every shared block, and each band's slot in it.
  Status AllocAmaxScales(const Bindings& bindings);
  // One bucket of an FP8 message as the receiver's / the sender's PairBucket.
  PairBucket Fp8RecvBucket(const Bindings& bindings, const Message& m, const Bucket& b) const;
  PairBucket Fp8SendBucket(const Bindings& bindings, PeerShapes& shapes, const Message& m,
                           const Bucket& b, uint32_t base) const;
  // Whether the pair with `peer` runs as a prepared pair (see Prepare).
  bool Prepared(int peer, int mem) const;
  std::string PairKey(int src, int dst) const;
  // Posts pairs[i] for every i with `which(i)` (null entries skipped).
  Status Post(Pairs& pairs, const std::function<bool(size_t)>& which);
  // Polls `pairs` (null entries skipped) until every one is done, the deadline passes or the job
  // aborts; `who` names the peer of entry i for errors. `while_waiting` (optional) runs once,
  // 1 ms into the wait.
  Status Wait(Pairs& pairs, const std::function<std::string(size_t)>& who,
              const std::function<Status()>& while_waiting = nullptr);
  // The packed checksums of receive message `m` from the store, after those delivered with the
  // data (`sent`).
  Status StoreSums(const Message& m, std::vector<uint64_t>& sent);

  const SessionContext& ctx_;
  SyncGuard& guard_;
  // By send / recv message index (null: the message goes the host path).
  Pairs send_, recv_;
  // Block-FP8 receivers with staged bands in device memory (AllocStaging): the staging, its
  // registration and the bands' quantize tasks over it.
  std::shared_ptr<unsigned char> staging_;
  MemRegion staging_region_;
  std::vector<Fp8BandTask> bands_;
  const Bindings* bindings_ = nullptr;
  // Trainers with amax ops over prepared pairs (AllocAmaxScales): the agreed scales' device
  // memory, and per band (tensor, first row) its first block's index there.
  std::shared_ptr<unsigned char> amax_buf_;
  float* amax_scales_ = nullptr;
  std::map<std::pair<int32_t, int64_t>, int64_t> amax_slot_;
};

}  // namespace shardsync::sync_internal
