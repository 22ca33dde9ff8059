// The delta encoding's bookkeeping on the host path (PlanOptions::encoding delta / auto; the codec
// is delta.h, docs/delta.md the protocol): what a receiver says it holds, what a sender kept, the
// per-bucket decision with its reason, and the control message of a bucket that may travel as a
// delta. Pure: no transport, no store.
//
// The protocol, per sync: each receiver recomputes the checksum of what it holds in every host
// bucket (its live bytes: a corrupted byte or a restored older image shows) and advertises it with
// the version those bytes were verified at in its `ready/<rank>` store value (EncodeBases). Each
// sender compares, per bucket, that base with the image it kept of what it last sent there
// (CheckBase): equal, it sends the delta against it (EncodeDelta; whole when the delta is not
// smaller, or under `auto` when it does not pay); not equal, the whole bucket, counted under the
// reason. Either travels as one message into one of the receiver's bucket slots (the host loops'
// image path); the bucket's control message names the form, the reason and the length. The
// receiver applies a delta with DecodeDeltaInPlace, which refuses a base whose version or
// checksum is not the one the delta names: a delta is never applied to another base.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsync/delta.h"
#include "shardsync/session.h"
#include "shardsync/status.h"
#include "sync/context.h"

namespace shardsync::sync_internal {

// What a receiver holds in one host bucket: the version its bytes were verified at (0: unknown,
// e.g. never landed or overwritten by a failed sync) and the checksum of the bytes now.
struct BucketBase {
  uint64_t version = 0;
  uint64_t checksum = 0;
  bool operator==(const BucketBase&) const = default;
};

// A receiver's ready value under the delta encoding: "D1" then, per host-path message, " <src>:"
// and its buckets' "<version>.<checksum hex>" separated by ','.
std::string EncodeBases(const std::vector<std::pair<int, std::vector<BucketBase>>>& by_src);
// The bases `receiver`'s value gives for the `buckets` buckets from sync rank `src`. DataLoss
// naming the receiver when the value is malformed, lacks `src` or has another bucket count.
Result<std::vector<BucketBase>> ParseBases(std::string_view value, int src, size_t buckets,
                                           int receiver);

// Why a bucket travels whole: DeltaReason and DeltaReasonText (delta.h), shared with the device
// pairs (transport.h PairDelta).

// The image a sender last sent in one bucket.
struct KeptImage {
  std::vector<std::byte> bytes;  // empty until the bucket was sent once
  uint64_t version = 0;
  uint64_t checksum = 0;  // Checksum() of bytes
  bool valid() const { return version != 0; }
};

// kDelta when the receiver's base is the kept image, else the fallback's reason.
DeltaReason CheckBase(const KeptImage& kept, const BucketBase& base);
// The reason in words with both sides' values, for the report and traces:
// "to sync rank 3, bucket 0: base checksum differs (holds v4 0123..., kept v4 4567...)".
std::string DescribeFallback(DeltaReason r, int dst, int bucket, const KeptImage& kept,
                             const BucketBase& base);

// Counts one bucket into `st`: `wire` bytes sent for a `full`-byte bucket, by `reason`.
void CountBucket(DeltaSyncStats& st, DeltaReason r, int64_t wire, int64_t full);

// The element the delta codec diffs by: the wire dtype's size, or 1 for block FP8, whose bucket
// images mix e4m3 bytes, fp32 scales, copies and pads (the codec is lossless on any byte image;
// a changed e4m3 code is one changed byte).
inline int DeltaElementSize(const PlanInputs& in) {
  return in.model.quant ? 1 : DTypeSize(in.options.wire_dtype);
}

// How encoding auto prices a delta: the link and the host codec's speeds (settings.h knobs
// SHARDSYNC_DELTA_LINK_MBPS, SHARDSYNC_DELTA_ENCODE_MBPS, SHARDSYNC_DELTA_DECODE_MBPS).
struct DeltaLink {
  double link_gbps = 25;
  double encode_gbps = 3.5;
  double decode_gbps = 5;
};
Result<DeltaLink> DeltaLinkFromKnobs();
// Whether a delta of `changed` of `elements` elements of `element_size` bytes pays over `link`
// (EstimateDeltaCost, serial: encode + wire + decode against the whole bucket on the wire).
Result<bool> DeltaPays(const DeltaLink& link, uint64_t elements, int element_size,
                       uint64_t changed);

// Checks a bucket's control message (context.h Control) under the delta encoding beyond
// CheckControl: a known form and reason, a payload that fits the bucket (a delta's is below
// `bucket_bytes`, a whole bucket's equals it).
Status CheckDeltaControl(const Control& d, const std::string& where, int64_t bucket_bytes);

}  // namespace shardsync::sync_internal
