// How the host data path cuts a bucket into transfers (transfers.cc): sender and receiver call it
// with the same plan and get the same list.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "shardsync/plan.h"

namespace shardsync::sync_internal {

// One transfer of a bucket: wire bytes [wire_offset, wire_offset + len) of the bucket (offsets
// from the bucket start), landing contiguously at byte param_offset of destination parameter
// `param`. `direct`: the same bytes are one contiguous run of the sender's source shard of HF
// tensor `tensor` (Megatron senders: of its local parameter `tensor`, Message::local) at byte
// src_offset, already in the wire dtype, so the sender posts them from its own memory instead
// of packing them into staging.
struct WireRun {
  int32_t param = 0;
  uint64_t param_offset = 0;
  int64_t wire_offset = 0;
  size_t len = 0;
  bool direct = false;
  int32_t tensor = -1;
  uint64_t src_offset = 0;
};

// Transfers are at most this long: a packed or checksummed transfer is still in the sender's
// L2 when the receiver's CMA copy reads it, and a landed one is still in the receiver's cache
// when it is checksummed.
inline constexpr size_t kMaxTransferBytes = size_t{1} << 20;
// A run shared by source and destination shorter than this is packed with its neighbours: a
// transfer costs a rendezvous round trip, more than copying a few KiB.
inline constexpr size_t kMinDirectBytes = size_t{64} << 10;

// The transfers of bucket `b` of message `m`. Sender and receiver call it with the same plan
// and get the same list, so in two-sided mode each send has one receive posted straight into
// its parameter. Runs contiguous in the destination are coalesced; when the trainer dtype is the
// wire dtype they are cut where the source shard (TrainerHeldRegion of the message's trainer
// rank; Megatron messages: the Message::local region of the sender's local parameter) stops
// being contiguous, so long runs of both go direct; then split at kMaxTransferBytes.
// `dest_shape(param)`: shape of the destination rank's parameter; `local_shape(param)`: shape
// of the sender's local parameter (Megatron messages; null: no direct transfers).
std::vector<WireRun> BucketTransfers(const PlanInputs& in, const std::vector<HfTensor>& inventory,
                                     int src_trainer_rank, const Message& m, const Bucket& b,
                                     const std::function<const Shape&(int)>& dest_shape,
                                     const std::function<const Shape*(int)>& local_shape);

}  // namespace shardsync::sync_internal
