// A session's prepared pairs: the messages whose transport compiles the pair's slice once at
// Connect and replays it each sync (device memory: cuda_ipc, nccl; transport.h PreparedPair).
// The host path (host_send.h, host_recv.h) carries every other message.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "sync/bindings.h"
#include "sync/codec.h"
#include "sync/context.h"
#include "sync/delta_path.h"
#include "sync/guard.h"
#include "sync/staging.h"

namespace shardsync::sync_internal {

class PreparedPairs {
 public:
  PreparedPairs(const SessionContext& ctx, SyncGuard& guard, Codec& codec,
                const StagedCommit& staged)
      : ctx_(ctx), guard_(guard), codec_(codec), staged_(staged) {}

  // Every pair whose transport prepares transfers over the memory this rank's bindings live in
  // gets its slice compiled now. Receivers first: they publish what their senders read
  // (cuda_ipc: the landed map) and never wait. `regbase`: each receiver's first region id.
  Status Prepare(const Bindings& bindings, PeerShapes& shapes,
                 const std::map<int, uint32_t>& regbase, Clock::time_point deadline);

  // Receivers, before Connect registers their parameters: device memory the codec's pairs write
  // into besides them (Codec::AllocPairStaging), returned for RegisterParams; null for none.
  Result<const MemRegion*> AllocStaging(const Bindings& bindings) {
    return codec_.AllocPairStaging(bindings);
  }
  // Receiver, after FinishRecvs verified every checksum: the codec's last step over device memory
  // (Codec::AfterPairsVerified; block FP8: the staged bands quantized, a bounded wait).
  Status AfterVerified() { return codec_.AfterPairsVerified(); }

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
  // A delta pair's replay (transport.h PairDeltaReport) counted into this rank's figures.
  static void AddDelta(const PairDeltaReport& d, bool sender, DeltaSyncStats& st);
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
  Codec& codec_;
  const StagedCommit&
      staged_;  // engine ranks of a staged session: a delta's base is the live bytes
  // By send / recv message index (null: the message goes the host path).
  Pairs send_, recv_;
  // Peers whose pairs encoding auto prepared as full (no delta can pay over their link).
  std::set<int> auto_full_;
};

}  // namespace shardsync::sync_internal
