// Lossless delta codec for wire images (issue 35 groundwork): the bytes of one bucket as the
// sender sent them last time (the base) against the bytes it would send now; only the elements
// that changed travel, and the receiver applies them in place over its own copy of the base.
//
// Pure and deterministic: the same (base, new, element size, version) always gives the same
// bytes. Hand-written because no Debian library does this: generic compressors (zstd, lz4) find
// repeats inside one buffer, not element-wise differences against a second buffer the receiver
// already holds, and none names or checks the base.
//
// Encoded form, little-endian, `kDeltaHeaderBytes` of header then the payload:
//   0  u32 magic "SSDL"       4  u8 format (3)    5  u8 kind (1 index, 2 bitmap, 3 packed)
//   6  u8 element size        7  u8 zero
//   8  u64 elements in the bucket          16 u64 base version
//   24 u64 checksum of the base bytes      32 u64 checksum of the new bytes
//   40 u64 changed elements (count)
//   index:  the bucket in tiles of T = 16384 / element size elements (kDeltaTileBytes, the last
//           one ragged; ceil(elements / T) of them): a u32 per tile, the changes in the tiles up
//           to and including it (non-decreasing, the last one = count); then a u16 per change,
//           its element within its tile (tile t's changes are those numbered from the previous
//           tile's u32 on; strictly increasing within a tile, below the tile's element count);
//           zero bytes up to a multiple of 4 of the payload; then the count values in order
//           (delta_rule.h DeltaIndexPayload has the offsets);
//   bitmap: ceil(elements / 8) bytes (bit i of byte i/8, LSB first, = element i changed; bits past
//           the last element zero; popcount = count), then the count changed elements in order.
//   packed (element size 1 or 2 only, and only while the index form is not larger than the
//           bitmap form: under about 1/16 of the elements changed): the tiles as above, a u32
//           running count per tile (as the index form's); for element size 2 a second u32 per
//           tile, the escapes up to and including it (non-decreasing, the last one = the
//           escapes, which the length gives); then a u8 per subtile of 128 elements (the last
//           one ragged; ceil(elements / 128) of them), its change count (at most its elements;
//           a tile's subtiles sum to its changes); then a u8 per change, its element within its
//           subtile (strictly increasing within a subtile); then a u8 per change, its value byte:
//           element size 1: the new byte; element size 2: the difference new - old of the bit
//           patterns (mod 2^16) when it lies in [-127, 127], else 0x80 (escaped: the new value is
//           the next escape; a tile's 0x80 bytes are its escapes); element size 2 only: a zero
//           byte when the payload so far is odd, then a u16 per escape, the new value, in order
//           (delta_rule.h DeltaPackedPayload has the offsets). 2 bytes a change, where the index
//           form takes 2 + e.
// Nothing else: trailing bytes are malformed. Checksums are shardsync's (checksum.h). Format 1
// (before 2026-12-03) named each index-form change by a u32 element index: 4 + e bytes a change
// against 2 + e now; format 2 had no packed form. Both ends of a pair run one build, so older
// formats are refused, not read.
//
// The size rule (DeltaEncodedBytes, delta_rule.h): index costs 2 + e bytes per change plus 4
// bytes per 16 KiB tile (0.024% of the bucket's bytes), bitmap elements/8 + e per change, packed
// 2 bytes per change plus a byte per 128 elements (0.39% of a bf16 bucket, 0.78% of a byte image)
// and 4 (8 for e = 2) bytes per tile, plus 2 per escape; the smallest wins (ties: index, then
// packed); packed beats index above about 0.4% (bf16) or 0.8% (FP8) of the elements changed;
// "full" when the smallest form is not smaller than the bucket (the whole bucket travels
// instead). Buckets are limited to
// 2^32 - 1 elements (u32 counts).
//
// Memory: a sender that encodes deltas keeps the wire image it last sent for every pair it
// serves, i.e. one extra copy of its wire bytes (bf16: 2 bytes per parameter it sends; block
// FP8: 1 byte per element + 4 bytes per 128x128 block of scales), in whatever memory the wire
// image lives in (host, or HBM on device paths). qwen3-8b sent whole from one trainer rank in
// bf16: 16.4 GB kept. The receiver keeps nothing extra: its landed weights are the base.
//
// Costs: encode reads base and new once (plus a second pass over both when the bitmap form is
// picked); decode reads the receiver's bucket once to check its checksum, then touches only the
// changed elements. Decode writes nothing unless the base checksum matches, the encoding is
// well formed and the checksum of the result (computed from the base's by replacing the terms of
// the changed words) equals the one the sender named: a refused delta leaves the bucket as it was.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "shardsync/status.h"

namespace shardsync {

inline constexpr size_t kDeltaHeaderBytes = 48;
inline constexpr uint64_t kDeltaMaxElements = 0xFFFFFFFFull;

enum class DeltaKind : uint8_t {
  kFull = 0,    // the delta would not be smaller than the bucket: send the bucket
  kIndex = 1,   // per-tile running counts, element offsets, values
  kBitmap = 2,  // bitmap + values
  kPacked = 3,  // per-subtile counts, byte offsets, byte values (differences), escapes
};

// "full", "index", "bitmap", "packed".
std::string_view DeltaKindName(DeltaKind kind);

// Why a bucket of a session under the delta encoding travels whole, or kDelta (the reports count
// each; docs/delta.md): the host path (sync/delta_path.h) and the device pairs (transport.h
// PairDelta) decide alike.
enum class DeltaReason : uint8_t {
  kDelta,     // sent as a delta
  kNoImage,   // fallback: the sender kept no image of the bucket
  kVersion,   // fallback: the receiver's base is of another version than the image
  kChecksum,  // fallback: same version, other bytes
  kSize,      // the delta was not smaller than the bucket (the size rule below)
  kCost,      // encoding auto: the delta does not pay at the link speed (EstimateDeltaCost)
};
// "delta", "no kept image", "base version differs", "base checksum differs", "delta not
// smaller", "does not pay at the link speed".
std::string_view DeltaReasonText(DeltaReason r);

// Bytes of the encoded form (header included) of a bucket of `elements` elements of
// `element_size` bytes with `changed` of them changed, `escapes` of those (element size 2)
// escaped in the packed form (delta_rule.h DeltaEscaped), and the form the encoder picks. For
// kFull, bytes is the bucket's size (0 for an element size other than 1, 2 or 4, which the codec
// refuses). The encoder and the cost model share this rule.
struct DeltaSize {
  DeltaKind kind = DeltaKind::kFull;
  uint64_t bytes = 0;
};
DeltaSize DeltaEncodedBytes(uint64_t elements, int element_size, uint64_t changed,
                            uint64_t escapes = 0);

struct DeltaEncodeResult {
  DeltaKind kind = DeltaKind::kFull;
  uint64_t changed = 0;        // elements that differ; counted in full even for kFull
  uint64_t escapes = 0;        // element size 2: changes escaped in the packed form (all forms)
  uint64_t elements = 0;       // elements in the bucket
  uint64_t base_checksum = 0;  // Checksum() of the base bytes (0 when kFull)
  uint64_t new_checksum = 0;   // Checksum() of the new bytes (0 when kFull)
};

// Encodes `next` against `base` (same size, a multiple of element_size; element_size 1, 2 or 4)
// into *out (replaced). For kFull *out is left empty and the caller sends `next` whole. `bucket`
// names the bucket in errors (bad sizes).
Result<DeltaEncodeResult> EncodeDelta(std::span<const std::byte> base,
                                      std::span<const std::byte> next, int element_size,
                                      uint64_t base_version, std::string_view bucket,
                                      std::vector<std::byte>* out);

// The header of an encoded delta, checked for self-consistency (magic, format, kind, element
// size, count against elements, total length for the kind); not checked against any bucket.
struct DeltaInfo {
  DeltaKind kind = DeltaKind::kIndex;
  int element_size = 0;
  uint64_t elements = 0;
  uint64_t base_version = 0;
  uint64_t base_checksum = 0;
  uint64_t new_checksum = 0;
  uint64_t changed = 0;
  uint64_t escapes = 0;  // packed form, element size 2: from the length
};
Result<DeltaInfo> InspectDelta(std::span<const std::byte> encoded, std::string_view bucket);

// What the receiver expects the delta to have been computed against.
struct DeltaExpect {
  std::string_view bucket;  // named in every error
  int element_size = 0;
  uint64_t base_version = 0;  // the version its bytes hold
};

// Applies `encoded` over `bucket` (the receiver's bytes of that bucket, the base) in place.
// Errors, with the bucket and the field at fault, and `bucket` untouched:
//   FailedPrecondition: base version or base checksum differ from the receiver's (the caller
//     falls back to a full send);
//   InvalidArgument: element size or bucket size differ from the encoding's;
//   DataLoss: a malformed or truncated encoding (bad magic / format / kind, count over elements,
//     a tile's running count decreasing or not ending at the count, an element out of its tile or
//     not increasing, nonzero index padding, a bitmap bit past the end, a popcount that differs
//     from the count, wrong length) or a result whose checksum is not the sender's.
Status DecodeDeltaInPlace(std::span<const std::byte> encoded, std::span<std::byte> bucket,
                          const DeltaExpect& expect);

// --- The host path's forms (the session's delta steps, src/sync/delta_send.h, delta_recv.h) ---

// EncodeDelta for a sender that already knows both checksums (the one it kept with its image,
// and the one its pack step computed) and keeps `base` as its image of the bucket: skips both
// checksum passes, and leaves `base` holding `next`'s bytes, written in the same pass over the
// data (only the changed elements, or the whole bucket when the result is kFull). The checksums
// are taken as given, not recomputed: the receiver checks the result it builds against
// `new_checksum` and the base it holds against `base_checksum`, so a wrong one is refused there,
// never landed. Same errors as EncodeDelta (then `base` is untouched).
Result<DeltaEncodeResult> EncodeDeltaAdvance(std::span<std::byte> base,
                                             std::span<const std::byte> next, int element_size,
                                             uint64_t base_version, uint64_t base_checksum,
                                             uint64_t new_checksum, std::string_view bucket,
                                             std::vector<std::byte>* out);

// EncodeDeltaAdvance over a new image that comes in pieces: the host path's sender packs it
// chunk by chunk (or straight into its kept image) instead of into a bucket-sized buffer. Begin
// with the writable base; Feed every piece in order (each starting where the last ended, all but
// the last a multiple of 64 bytes); Finish with both checksums as known. The same result and
// bytes as EncodeDeltaAdvance over the whole image; the base is advanced piece by piece, so it
// holds the new bytes fed so far (a Begin error leaves it untouched).
class DeltaAdvanceEncoder {
 public:
  DeltaAdvanceEncoder();
  ~DeltaAdvanceEncoder();
  Status Begin(std::span<std::byte> base, int element_size, std::string_view bucket,
               std::vector<std::byte>* out);
  Status Feed(uint64_t at, std::span<const std::byte> piece);
  Result<DeltaEncodeResult> Finish(uint64_t base_version, uint64_t base_checksum,
                                   uint64_t new_checksum);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A bucket whose bytes are not one buffer: the receiver's landed runs (the elements of one bucket
// live in several parameters). Pieces tile [0, bucket bytes) in increasing `offset` order, each
// starting and ending on an element boundary.
struct DeltaPiece {
  uint64_t offset = 0;              // where the piece starts in the bucket
  uint64_t len = 0;                 // bytes
  const std::byte* base = nullptr;  // the base's bytes of the piece
  std::byte* out = nullptr;         // where the result goes: `base` itself, or elsewhere (staging)
};

// DecodeDeltaInPlace over pieces: reads every piece once (the base checksum; with `out` elsewhere,
// fused with copying the base there), then reads and writes only the changed elements' words.
// The same checks in the same order, and the same guarantee for `out == base`: a refused delta
// leaves the pieces untouched. With `out != base`, a refusal may leave the base's bytes in `out`
// (never a changed element). InvalidArgument naming the bucket when the pieces do not tile
// `bucket_bytes` as above.
Status DecodeDeltaPieces(std::span<const std::byte> encoded, std::span<const DeltaPiece> pieces,
                         uint64_t bucket_bytes, const DeltaExpect& expect);

// The checksum (checksum.h) of a bucket given as pieces (`base` bytes; same tiling rule, any
// element size), read once; with `copy`, each piece whose `out` is elsewhere also gets its bytes
// in the same pass (a whole bucket landing from a receive slot). InvalidArgument when they do not
// tile `bucket_bytes`.
Result<uint64_t> DeltaPiecesChecksum(std::span<const DeltaPiece> pieces, uint64_t bucket_bytes,
                                     bool copy = false);

// --- Cost model: does a delta pay for one bucket? Pure. ---
struct DeltaCostInput {
  uint64_t bucket_bytes = 0;
  double density = 0;      // fraction of elements changed, in [0, 1]
  int element_size = 2;    // 1 (e4m3), 2 (bf16), 4 (fp32 scales)
  double link_gbps = 25;   // link GB/s (1e9 bytes/s) the bucket crosses
  double encode_gbps = 0;  // encoder throughput over the bucket's bytes (GB/s of bucket)
  double decode_gbps = 0;  // decoder throughput over the bucket's bytes
  bool overlap = false;    // encode/decode pipelined with the transfer (max, not sum)
};
struct DeltaCost {
  DeltaKind kind = DeltaKind::kFull;  // what the encoder would send
  uint64_t full_bytes = 0;
  uint64_t wire_bytes = 0;          // delta form's bytes (= full_bytes when kind is kFull)
  double full_seconds = 0;          // full_bytes / link
  double delta_seconds = 0;         // encode + wire / link + decode (or their max)
  bool pays = false;                // delta_seconds < full_seconds
  double break_even_link_gbps = 0;  // the link speed above which full is faster (0: never pays)
};
// InvalidArgument naming the field: a density outside [0, 1] or not finite, an element size not
// 1/2/4, a bucket not a multiple of it, a non-positive link / encode / decode speed.
Result<DeltaCost> EstimateDeltaCost(const DeltaCostInput& in);

}  // namespace shardsync
