// The bench's variants (bench.cc): the broadcast-all baseline, and what it shares with the raw
// variant. On one transport and one set of processes: (a) the sharded plan through a
// SyncSession, (b) broadcast-all: trainer rank 0 sends every full HF tensor to every engine rank,
// which slices its shards locally, as the engines' update_weights_from_distributed does, (c) raw
// transport transfers of the plan's bytes with no plan logic (the transport's ceiling).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "job/internal.h"
#include "shardsync/transport.h"

namespace shardsync::job_internal {

// A completion message of a one-sided variant (the bytes landed; its contents are not read).
struct BenchControl {
  uint64_t word[4] = {};
};

// Waits (bounded) for `ids`, then clears them.
Status WaitXfers(Transport& tx, std::vector<XferId>& ids, Millis timeout, const std::string& what);
// Send completion can precede the protocol tail on this side (UCX rendezvous): flushes every peer
// before the transport is left alone at the next store barrier.
Status FlushPeers(Transport& tx, const std::vector<int>& peers, Millis timeout);

// Broadcast-all, variant (b): whole HF tensors in buckets under the plan's cap (BroadcastBuckets),
// two buckets in flight. With one-sided puts each bucket is put, flushed, then announced.
class BroadcastBaseline {
 public:
  BroadcastBaseline(const JobSpec& job, Transport& tx);

  // Trainer rank 0 holds the whole model in the trainer dtype, as a gathered full_tensor() would
  // be (the gather itself is not timed, which favours the baseline), and two buckets of staging.
  void SetupSender();
  // Engine ranks: two buckets of staging to land in, and which pieces of `params` each HF
  // tensor feeds.
  void SetupReceiver(const std::vector<EngineParam>& params);
  // Engine ranks' staging, registered with the transport; trainer rank 0 learns each one's id.
  MemRegion staging() { return {stage_.data(), stage_.size(), MemKind::kHost, -1}; }
  void SetRemoteStaging(int dst, uint32_t region) { stage_region_[dst] = region; }

  // One repetition. Trainer rank 0: cast each bucket and send it to every engine rank.
  Status Send();
  // Engine ranks: receive every bucket and copy the pieces of `params` out of it into `bound`.
  Status Receive(const std::vector<EngineParam>& params, const std::vector<DestBinding>& bound);

 private:
  bool put() const { return tx_.caps().one_sided_put; }
  Status Wait(std::vector<XferId>& ids, const std::string& what) {
    return WaitXfers(tx_, ids, job_.timeout, what);
  }

  const JobSpec& job_;
  const PlanInputs& in_;
  Transport& tx_;
  int S_, world_, ws_;
  std::vector<HfTensor> inv_;
  std::vector<BcastBucket> buckets_;
  std::vector<int64_t> tensor_offsets_;
  int64_t max_bucket_ = 0;
  std::vector<unsigned char> full_;   // trainer 0: the whole model, trainer dtype
  std::vector<unsigned char> stage_;  // two buckets (trainer 0: cast; engines: landed)
  std::vector<std::vector<std::pair<size_t, size_t>>> slices_;  // tensor -> (param, piece)
  std::map<int, uint32_t> stage_region_;                        // trainer 0: engines' staging
  BenchControl control_;
};

}  // namespace shardsync::job_internal
