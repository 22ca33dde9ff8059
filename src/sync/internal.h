// Internals of the sync layer shared by its files, its tests and the job harness (src/job): tags,
// verdict encoding, how buckets are cut into transfers, the CPU casts, and the session's harness
// hooks.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/session.h"

namespace shardsync {
namespace sync_internal {

// Transfer tags, 48 bits (UCX keeps 16 for the source rank):
// [control 1][version mod 2^11][sequence 36]. Sessions use versions from 1; the benchmark's
// baseline variants use reserved versions (job/internal.h kBenchVersion*).
inline constexpr uint64_t kSeqBits = 36;
inline uint64_t MakeTag(bool control, uint64_t version, uint64_t seq) {
  return (uint64_t{control} << 47) | ((version & 0x7FF) << kSeqBits) |
         (seq & ((uint64_t{1} << kSeqBits) - 1));
}
// A rank's verdict of one sync as its store value: one short line, written and read on every
// sync's critical path (JSON cost 10-20 us a side on the H200 machine). Decode fails with
// DataLoss naming `rank` on anything malformed or naming another rank.
std::string EncodeVerdict(const RankSyncStats& s);
Result<RankSyncStats> DecodeVerdict(std::string_view text, int rank);

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

// Element cast between F32 / BF16 / F16 (plain copy for equal dtypes), as the packer does it.
void CastInto(const void* in, DType a, void* out, DType b, int64_t n);
// fp32 -> bf16 cast (as CastInto) of the first k elements of in[0, n), with k a multiple of 16
// chosen by the kernel (0 where no vector unit does it), adding the checksum.h partial sum of
// the k * 2 bytes written to *sum, out[0] being the start of message word `word`. Returns k.
int64_t CastF32ToBF16WithSum(const void* in, void* out, int64_t n, uint64_t word, uint64_t* sum);

// Harness hooks of a session (benchmarks; not in the public SessionOptions): transport peers
// beyond the plan's (the broadcast-all baseline's), and a hook run after the session registered
// its memory and before the transport connects (the baseline's staging).
struct HarnessHooks {
  std::vector<int> extra_peers;
  std::function<Status(Transport&)> before_transport_connect;
};
Result<std::unique_ptr<SyncSession>> CreateHarnessSession(const PlanInputs& inputs, int rank,
                                                          StoreClient& store, Transport& transport,
                                                          SessionOptions options,
                                                          HarnessHooks hooks);
}  // namespace sync_internal

}  // namespace shardsync
