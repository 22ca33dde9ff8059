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
#include <memory>
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

// How encoding auto prices a delta: the link, and what the host path's delta steps cost per
// bucket byte on top of a whole bucket (settings.h knobs SHARDSYNC_DELTA_LINK_MBPS,
// SHARDSYNC_DELTA_ENCODE_MBPS, SHARDSYNC_DELTA_DECODE_MBPS): the sender's encode pass (kept and
// new image compared, the kept one moved), the receiver's two reads of its landed bucket (the
// advertisement's checksum, then the decode's base checksum with the changed words). Defaults:
// measured at 1% density on one core of the 2-core VM (docs/delta.md "Memory and cost").
struct DeltaLink {
  double link_gbps = 25;
  double encode_gbps = 7;
  double decode_gbps = 4.5;
};
Result<DeltaLink> DeltaLinkFromKnobs();
// The same for a prepared device pair over `transport` (cuda_ipc, nccl): the device steps' speeds
// (SHARDSYNC_DELTA_DEVICE_ENCODE_MBPS / _DECODE_MBPS, whole syncs measured on one H200: pack,
// encode and kept copy; advertisement, base gather, decode, landing and readback), and the link:
// SHARDSYNC_DELTA_IPC_LINK_MBPS for cuda_ipc (one node: NVLink, where at the defaults no delta
// pays), SHARDSYNC_DELTA_LINK_MBPS for the rest (across nodes). Both ends of a pair name the
// same transport, so they agree.
Result<DeltaLink> DevicePairDeltaLink(std::string_view transport);
// Whether a delta of `changed` of `elements` elements of `element_size` bytes pays over `link`
// (EstimateDeltaCost, serial: encode + wire + decode against the whole bucket on the wire).
Result<bool> DeltaPays(const DeltaLink& link, uint64_t elements, int element_size,
                       uint64_t changed);
// Whether a delta can pay at all over `link`: the delta of a large unchanged bucket. When it
// cannot, encoding auto runs the host path as encoding full (no advertisement, no kept image, no
// image path), on every rank alike (each reads the same knobs; the ready value says which ran,
// and a sender refuses a receiver that ran otherwise: DeltaAgreement).
Result<bool> DeltaCanPay(const DeltaLink& link);
// Connect, on every rank of an encoding auto session: drops the host loop's delta step `step`
// (DeltaSender / DeltaReceiver) when no delta can pay at the knobs' speeds (DeltaCanPay).
template <typename Step>
Status ResolveAuto(const SessionContext& ctx, std::unique_ptr<Step>& step) {
  if (!step || ctx.in.options.encoding != WireEncoding::kAuto) return OkStatus();
  SS_ASSIGN_OR_RETURN(const DeltaLink link, DeltaLinkFromKnobs());
  SS_ASSIGN_OR_RETURN(const bool can, DeltaCanPay(link));
  if (!can) step.reset();
  return OkStatus();
}
// A sender that ran `delta` (the delta steps) against receiver `dst`'s ready value `value`:
// FailedPrecondition naming both and the knobs when one ran the delta steps and the other not.
Status DeltaAgreement(bool delta, std::string_view value, int self, int dst);
// Counts one `bytes`-byte bucket that encoding auto sent whole without the delta steps.
inline void CountAutoFull(DeltaSyncStats& st, int64_t bytes) {
  ++st.buckets_full;
  ++st.full_by_auto;
  st.wire_bytes += bytes;
  st.full_bytes += bytes;
}

// Checks a bucket's control message (context.h Control) under the delta encoding beyond
// CheckControl: a known form and reason, a payload that fits the bucket (a delta's is below
// `bucket_bytes`, a whole bucket's equals it).
Status CheckDeltaControl(const Control& d, const std::string& where, int64_t bucket_bytes);

}  // namespace shardsync::sync_internal
