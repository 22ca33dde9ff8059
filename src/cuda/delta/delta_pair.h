// Device pairs under the delta encoding (PairSpec::delta; docs/delta.md "Device pairs"): one
// protocol for every GPU transport (delta_send.cc: the sender, delta_recv.cc: the receiver); a
// transport supplies only how messages and bytes move between the two sides, as a channel
// (cuda_ipc/delta_ipc.cc: mailbox messages and copies into the receiver's window; nccl/
// delta_nccl.cc: everything over the pair's communicator).
//
// Per sync: the receiver advertises its bases (every bucket's checksum of its live bytes and the
// version they were verified at; staged: the committed bytes and version); per bucket the sender
// packs the new image (block FP8: the whole wire image), encodes it against the image it kept
// when the base is that image (else sends it whole, by reason), ships the payload and a control
// message; the receiver gathers its base from the live parameters, decodes on the device
// (refusing any other base, writing nothing then), lands (staged: into staging), and reads back.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardsync/delta_gpu.h"
#include "shardsync/gpu.h"
#include "shardsync/transport.h"

namespace shardsync::gpu::delta_pair {

// Local device work (packs, copies, codec kernels of one bucket) is waited for at most this long.
constexpr Millis kDeltaLocalWait{60000};
constexpr size_t kDeltaAlign = 256;
inline size_t DeltaAlign(size_t n) { return (n + kDeltaAlign - 1) / kDeltaAlign * kDeltaAlign; }
inline std::string DeltaHex(uint64_t v) {
  char b[17];
  snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}
inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A bucket's control message: [version, bucket, form, reason, payload bytes, packed checksum,
// changed elements].
constexpr size_t kDeltaCtlWords = 7;
using DeltaCtl = std::array<uint64_t, kDeltaCtlWords>;
// The bases message: [version, buckets, then per bucket: verified version, checksum].
inline size_t BasesWords(size_t buckets) { return 2 + 2 * buckets; }

// A copy run read the other way (its destination becomes its source): an unpack from a pack, a
// landing read back into wire order.
inline void FlipRun(CopyRun& r) {
  const void* in = r.in;
  r.in = r.out;
  r.out = const_cast<void*>(in);
  std::swap(r.in_stride, r.out_stride);
}

// The receiver's window: a whole bucket lands at `slot`, a delta at `enc` (device pointers into
// one allocation of `bytes` at `base`).
struct DeltaWindow {
  void* base = nullptr;
  size_t bytes = 0;
  unsigned char* slot = nullptr;
  unsigned char* enc = nullptr;
};

// How the sender's messages and bytes travel. Every call returns at once (progress in the polls).
class DeltaSendChannel {
 public:
  virtual ~DeltaSendChannel() = default;
  // Receives the receiver's bases message of sync `version` (`words.size()` words) into `words`
  // (kept by the caller until BasesIn said true).
  virtual Status PostBases(uint64_t version, std::vector<uint64_t>* words) = 0;
  virtual Result<bool> BasesIn() = 0;
  // Ships a bucket: `ctl[4]` bytes at device `src` (complete: the caller waited for the work
  // that wrote them), into the receiver's encoded window when `delta` else its slot, and its
  // control message `ctl`.
  virtual Status Ship(const DeltaCtl& ctl, const void* src, bool delta) = 0;
  // True once `src` may be written again and the control message is on its way.
  virtual Result<bool> Shipped() = 0;
  // True once the receiver can take the next bucket's payload (cuda_ipc: it acknowledged this
  // one; two-sided channels: at once, the receiver posts its receive when it is ready).
  virtual Result<bool> WindowFree() = 0;
  // True once every message of this replay completed.
  virtual Result<bool> Drained() = 0;
  // Unavailable when the peer died.
  virtual Status CheckPeer() = 0;
  // The sync failed with this replay in flight (nccl: the communicator is aborted; later calls
  // fail with Aborted, so the job re-connects).
  virtual void Cancel() = 0;
};

// How the receiver's messages and bytes travel.
class DeltaRecvChannel {
 public:
  virtual ~DeltaRecvChannel() = default;
  // Sends the bases message (`words`, kept by the caller until Drained).
  virtual Status SendBases(uint64_t version, const std::vector<uint64_t>& words) = 0;
  // Receives the next bucket's control message of sync `version` into `ctl` (kept until CtlIn).
  virtual Status PostCtl(uint64_t version, DeltaCtl* ctl) = 0;
  virtual Result<bool> CtlIn() = 0;
  // After a checked control message: its payload of `bytes` into `dst` (the window's slot or
  // encoded part). cuda_ipc: already there.
  virtual Status PostPayload(void* dst, size_t bytes) = 0;
  virtual Result<bool> PayloadIn() = 0;
  // The bucket landed: the window is free again (cuda_ipc: the acknowledgement).
  virtual Status Landed(uint64_t version, uint64_t bucket) = 0;
  virtual Result<bool> Drained() = 0;
  virtual Status CheckPeer() = 0;
  virtual void Cancel() = 0;
};

// The checks every delta pair makes of its spec: copies of one dtype; image (block FP8) pairs
// diffed by byte, with quantize ops only (stage ops and amax-exchanged rows are refused, naming
// the op). `who` names the pair in errors ("nccl: delta pair to rank 2").
Status CheckDeltaSpec(const PairSpec& spec, const std::string& who);

// The sender: `spec` checked; `channel` carries its messages. Current device set by the caller.
Result<std::unique_ptr<PreparedPair>> MakeDeltaSendPair(const PairSpec& spec, int device,
                                                        std::string who,
                                                        std::unique_ptr<DeltaSendChannel> channel);
// The receiver: allocates its window on `device` (whole 2 MiB pages, so another process may map
// it) and asks `open` for its channel over it.
using OpenRecvChannel =
    std::function<Result<std::unique_ptr<DeltaRecvChannel>>(const DeltaWindow& window)>;
Result<std::unique_ptr<PreparedPair>> MakeDeltaRecvPair(const PairSpec& spec, int device,
                                                        std::string who,
                                                        const OpenRecvChannel& open);

// The largest bucket of `spec`.
inline uint64_t MaxBucketBytes(const PairSpec& spec) {
  uint64_t max = 0;
  for (const PairBucket& b : spec.buckets) max = std::max<uint64_t>(max, b.bytes);
  return max;
}
// The window a receiver of buckets up to `max` bytes allocates: a slot, then the encoded part.
inline size_t WindowEncOffset(uint64_t max) { return DeltaAlign(max); }
inline size_t WindowBytes(uint64_t max) { return DeltaAlign(max) + max; }

// One bucket's runs between tensors (`regions`, elements of their own dtype) and a contiguous wire
// image at `image` (elements of `wire`), as bucket 0 of a batch: pack orientation (tensor ->
// image), or reversed (image -> tensor, kUnpack).
BatchSpec DeltaBucketBatch(const std::vector<PackRegion>& regions, int64_t bytes, DType wire,
                           void* image, BatchMode mode);

// Tests (delta_fault.h): consumes the planted fault for `bucket`, if any: the byte to flip.
bool TakeDeltaFault(int64_t bucket, int64_t* byte);

}  // namespace shardsync::gpu::delta_pair
