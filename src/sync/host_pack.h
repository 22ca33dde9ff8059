// The host send path's view of a bucket (computed once at Connect) and its packing: the bucket's
// transfers (BucketTransfers) and, for packed ones, the contiguous source runs that feed them,
// cast to the wire dtype with the checksum taken while the bytes are still in cache.
#pragma once

#include <cstdint>
#include <vector>

#include "common/cast.h"
#include "sync/bindings.h"
#include "sync/landed_sum.h"
#include "sync/transfers.h"

namespace shardsync::sync_internal {

// A contiguous run of the sender's source memory (trainer dtype) feeding wire bytes
// [wire, wire + elems * wire size) of one bucket.
struct SrcPiece {
  int64_t wire = 0;
  const unsigned char* src = nullptr;
  int64_t elems = 0;
};

// A sender's precomputed view of one bucket: its transfers and, for packed ones, its sources.
struct SendBucket {
  std::vector<WireRun> xfers;
  std::vector<SrcPiece> pieces;  // in wire order, tiling the bucket
};

// Bucket `b` of send message `m` of this trainer rank over its bound sources.
SendBucket MakeSendBucket(const SessionContext& ctx, const Bindings& bindings, PeerShapes& shapes,
                          const Message& m, const Bucket& b);

// Packs wire bytes [from, from + len) of bucket `sb` into `out` (the bucket's staging at
// `from`), cast from the trainer dtype `td` to the wire dtype `wd`, adding the checksum of each
// chunk to `sum` right after it is written.
void PackRange(const SendBucket& sb, DType td, DType wd, int64_t from, int64_t len,
               unsigned char* out, LandedSum& sum);

}  // namespace shardsync::sync_internal
