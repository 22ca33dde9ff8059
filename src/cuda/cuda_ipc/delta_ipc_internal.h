// The cuda_ipc delta pairs' shared internals (delta_ipc.cc: the protocol, the sender and the
// factory; delta_ipc_recv.cc: the receiver): message tags and layouts, the receiver's window
// record, one bucket's batch between tensors and a wire image.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_ipc/cuda_ipc.h"
#include "shardsync/delta_gpu.h"

namespace shardsync::gpu::ipc::delta_internal {

constexpr uint64_t kBasesTagBase = uint64_t{0x5344} << 48;  // the receiver's bases (it is ready)
constexpr uint64_t kCtlTagBase = uint64_t{0x5345} << 48;    // a bucket's control message
constexpr uint64_t kAckTagBase = uint64_t{0x5346} << 48;    // the receiver landed a bucket
constexpr uint64_t kWindowMagic = 0x53535744;               // "SSWD": the receiver's window

inline uint64_t DeltaTag(uint64_t base, uint64_t version) {
  return base | (version & ((uint64_t{1} << 48) - 1));
}

// Local device work (packs, copies, codec kernels of one bucket) is waited for at most this long.
constexpr Millis kDeltaLocalWait{60000};
constexpr size_t kDeltaAlign = 256;
inline size_t DeltaAlign(size_t n) { return (n + kDeltaAlign - 1) / kDeltaAlign * kDeltaAlign; }
inline std::string DeltaHex(uint64_t v) {
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

inline Status WaitLocal(const Stream& s, const std::string& what) {
  return s.Synchronize(kDeltaLocalWait, what);
}

// One bucket's runs between tensors (`regions`, elements of their own dtype) and a contiguous wire
// image at `image` (elements of `wire`), as bucket 0 of a batch: pack orientation (tensor ->
// image), or reversed (image -> tensor, kUnpack).
inline BatchSpec DeltaBucketBatch(const std::vector<PackRegion>& regions, int64_t bytes, DType wire,
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

inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Drops the completed transfers of `ids` (host-memory mailbox sends); a failed one's error.
inline Status PollSends(CudaIpcTransport& t, std::vector<XferId>& ids) {
  for (size_t i = 0; i < ids.size();) {
    SS_ASSIGN_OR_RETURN(XferState st, t.Poll(ids[i]));
    if (st == XferState::kDone) {
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  return OkStatus();
}

// The receiving pair for `spec` (checked by the caller).
Result<std::unique_ptr<PreparedPair>> MakeDeltaRecvPair(CudaIpcTransport& t, StoreClient& store,
                                                        const PairSpec& spec);
// delta_ipc.h's test hook.
void SetDeltaFault(int64_t bucket, int64_t byte);

}  // namespace shardsync::gpu::ipc::delta_internal
