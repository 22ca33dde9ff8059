// Internal: the device delta codec's kernels (delta_encode.cu, delta_decode.cu) and what they
// share with the host side of delta_gpu.h (src/cuda/device/delta_gpu.cc): the scratch's control
// block, the result the last kernel leaves in pinned host memory, and the header check (one
// __host__ __device__ function, so the refusal the device decides and the message the host
// writes come from the same code). Free of CUDA headers.
#pragma once

#include <cstdint>

#include "shardsync/checksum.h"  // SHARDSYNC_HD
#include "shardsync/delta.h"
#include "shardsync/delta_rule.h"

namespace shardsync::gpu::delta {

inline constexpr uint32_t kMagic = 0x4C445353;  // "SSDL" little-endian, as delta.cc
inline constexpr uint8_t kFormat = 3;

// Launch shape. Every pass over the bucket works in tiles of kThreads x kTileVecs 16-byte vectors
// of the bucket (and, for encode, of next too), 16 KiB. The decode's check and apply passes take
// one tile per block: 4 vectors keep a thread's loads in flight at once within 64 registers, so
// 4 blocks fit an SM (8 vectors: 100-122 registers, 2 blocks, measured slower). The encoder's
// tile pass takes a range of tiles per block (delta_encode.cu).
inline constexpr int kThreads = 256;
inline constexpr int kTileVecs = 4;
inline constexpr int kMinBlocks = 4;  // __launch_bounds__ of the tile kernels
inline constexpr uint64_t kTileBytes = uint64_t{kThreads} * kTileVecs * 16;

// Refusals, in the order DecodeDeltaInPlace checks them.
enum Code : uint32_t {
  kOk = 0,
  kShort,  // encoded_bytes < header
  kBadMagic,
  kBadFormat,
  kBadKind,
  kBadElementSize,  // not 1/2/4 in the header
  kBadReserved,
  kBadElements,        // over kDeltaMaxElements
  kBadCount,           // count over elements
  kBadPacked,          // packed form: element size 4, or count over the form's limit
  kBadLength,          // payload length for the kind and count
  kExpectElementSize,  // the receiver's element size differs
  kExpectBucket,       // the receiver's bucket size differs
  kVersion,            // base version differs
  kBaseChecksum,       // the receiver's bytes are not the base
  kBadRecord,          // the index / packed form's tiles, records, padding (detail: *Fault)
  kBitmapTail,         // bitmap bits past the last element
  kPopcount,           // bitmap popcount != count (detail: popcount)
  kResultChecksum,     // the predicted result's checksum is not the sender's
};

// The index form's faults in DecodeDeltaInPlace's order, as one key (the smallest is the one
// reported): a tile whose running count falls (the tile), the last tile's count not the header's,
// a record out of its tile or not above the one before (record, then tile), a padding byte.
SHARDSYNC_HD unsigned long long IndexFaultTile(uint64_t t) { return t; }
SHARDSYNC_HD unsigned long long IndexFaultLast() { return 1ull << 62; }
SHARDSYNC_HD unsigned long long IndexFaultRecord(uint64_t k, uint64_t t) {
  return 2ull << 62 | k << 20 | t;
}
SHARDSYNC_HD unsigned long long IndexFaultPadding(uint64_t i) { return 3ull << 62 | i; }
// The packed form's faults in DecodeDeltaInPlace's order (delta.cc), as one key: a running count
// falling (the tile), the last one not the count, an escape running count falling, the last one
// not the length's, then tile by tile: a subtile count over its elements (the subtile within the
// tile), the tile's subtile counts not its changes, a record out of its subtile or not above the
// one before (record within the tile, then its subtile within the tile), the tile's escaped value
// bytes not its escapes; then the padding byte.
enum PackedInTile : unsigned { kPackedSub = 0, kPackedSum = 1, kPackedRecord = 2, kPackedEsc = 3 };
SHARDSYNC_HD unsigned long long PackedFaultTile(uint64_t t) { return t; }
SHARDSYNC_HD unsigned long long PackedFaultLast() { return 1ull << 60; }
SHARDSYNC_HD unsigned long long PackedFaultEscTile(uint64_t t) { return 2ull << 60 | t; }
SHARDSYNC_HD unsigned long long PackedFaultEscLast() { return 3ull << 60; }
SHARDSYNC_HD unsigned long long PackedFaultIn(uint64_t t, unsigned what, uint64_t detail) {
  return 4ull << 60 | t << 34 | uint64_t{what} << 32 | detail;
}
SHARDSYNC_HD unsigned long long PackedFaultPadding(uint64_t i) { return 5ull << 60 | i; }
static_assert(kTileBytes == kDeltaTileBytes, "the index form's tiles are the device's");

// Device control block at the start of the scratch. Between calls every field holds its rest
// value (kernels reset it at their end): sums 0, bad_record ~0, ticket and tail 0.
struct Ctl {
  unsigned long long sum_a;       // checksum sum of the base (encode and decode)
  unsigned long long sum_b;       // encode: of next; decode: new minus old terms of changed words
  unsigned long long bad_record;  // decode: the index form's first fault (IndexFault)
  unsigned int ticket;            // decode: blocks of the counting pass done (the last one scans)
  unsigned int tail_bad;          // decode: bitmap bits past the end
  // Decode, written by every call before they are read (no rest value needed): the decision
  // (Code | kind << 32 | applied << 40: whether the changes were written before the decision),
  // the change count, and the bitmap's popcount from the counting pass.
  unsigned long long go;
  unsigned long long changed;
  unsigned long long popcount;
};

// Written by the last kernel of a call into pinned, mapped host memory.
struct HostResult {
  unsigned long long code;  // Code (decode), 0 for encode
  unsigned long long kind, changed, bytes, elements, base_checksum, new_checksum;  // encode
  unsigned long long escapes;                                                      // encode
  unsigned long long have;                  // decode: base checksum / predicted result checksum
  unsigned long long detail;                // decode: bad record / popcount
  unsigned char header[kDeltaHeaderBytes];  // decode: the encoding's header
};

inline constexpr uint32_t kNoSlot = 0xFFFFFFFFu;  // a tile whose changes found no staging room

struct ScratchPtrs {
  Ctl* ctl = nullptr;
  // Per tile of the bucket. Encode: its change count. Decode (bitmap form): its first value,
  // from the count pass's scans, entry `tiles` the total.
  uint32_t* tile = nullptr;
  uint32_t* voff = nullptr;  // encode: the tile's first staged value (kNoSlot: none)
  uint32_t* ioff = nullptr;  // encode: the tile's first staged index (kNoSlot: none)
  // Per range of tiles (at most one per tile). Encode: each range's change count. Decode (bitmap
  // form): the count pass's ranges, their counts then their first values.
  uint32_t* rtot = nullptr;
  // Encode, element size 2: each tile's escaped changes (packed form) and each range's.
  uint32_t* etile = nullptr;
  uint32_t* etot = nullptr;
  // Encode: each tile's subtile counts (kSubtilesPerTile bytes a tile, for every tile), and for
  // element size 2 the staged changes' packed value bytes (beside their staged values).
  unsigned char* subc = nullptr;
  unsigned char* pv = nullptr;
  unsigned char* vals = nullptr;  // encode: staged values, in tile order within a tile
  uint16_t* idx = nullptr;        // encode: staged indices (element within the tile)
  // Bytes from `vals` to the scratch's end (vals and idx together). Decode: the changed
  // elements' old values, saved as they are overwritten (change k at k x E), for the restore.
  uint64_t stage_bytes = 0;
  HostResult* result = nullptr;  // device view of the pinned result
};

// The scratch layout for buckets up to max_bytes, for every element size. The encoder's tile
// pass runs as ranges of consecutive tiles, one per block; each range stages its changes in its
// own part of the staging areas, proportional to its tiles: values up to a quarter of the
// tiles' bytes (a denser range re-reads the tiles that found no room), indices (2 bytes each) up
// to 1/16 of their elements (the index form's limit; a range over it re-reads its tiles too).
inline constexpr uint64_t kStageDivisor = 4;
inline constexpr uint64_t kIndexDivisor = 16;
inline constexpr uint64_t kScanBatch = 8192;  // tile array entries: a multiple of this
inline constexpr uint64_t kStagePad = 64;     // copies read up to 32 bytes past staged values
struct ScratchLayout {
  uint64_t tile = 0, voff = 0, ioff = 0, rtot = 0, etile = 0, etot = 0, subc = 0, pv = 0, vals = 0,
           idx = 0, total = 0;
};
// The most subtiles a tile holds (element size 1).
inline constexpr uint64_t kSubtilesPerTile = 16384 / 128;
inline uint64_t Tiles(uint64_t bytes) {
  return bytes == 0 ? 1 : (bytes + kTileBytes - 1) / kTileBytes;
}
inline ScratchLayout LayoutScratch(uint64_t max_bytes) {
  auto up = [](uint64_t v) { return (v + 255) / 256 * 256; };
  const uint64_t tiles = Tiles(max_bytes);
  const uint64_t entries = (tiles + 1 + kScanBatch - 1) / kScanBatch * kScanBatch;
  ScratchLayout l;
  l.tile = up(sizeof(Ctl));
  l.voff = l.tile + up(4 * entries);
  l.ioff = l.voff + up(4 * tiles);
  l.rtot = l.ioff + up(4 * tiles);
  l.etile = l.rtot + up(4 * tiles);
  l.etot = l.etile + up(4 * tiles);
  l.subc = l.etot + up(4 * tiles);
  l.pv = l.subc + up(tiles * kSubtilesPerTile);
  // One byte per staged value of 2-byte elements: a quarter of the tile's bytes, halved.
  l.vals = l.pv + up(tiles * kTileBytes / kStageDivisor / 2 + kStagePad);
  l.idx = l.vals + up(tiles * kTileBytes / kStageDivisor + kStagePad);
  l.total = l.idx + up(2 * tiles * kTileBytes / kIndexDivisor + kStagePad);
  return l;
}

SHARDSYNC_HD uint64_t LoadLE(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Plain (no initializers) so a kernel can hold one in shared memory.
struct HeaderView {
  uint32_t code;
  uint32_t magic;
  int format, kind, element_size, reserved;
  uint64_t elements, base_version, base_checksum, new_checksum, changed;
  uint64_t payload;  // bytes the header's kind and count need
  uint64_t escapes;  // packed form, element size 2: from the length
};

// InspectDelta's checks, then the receiver's (element size, bucket size, base version), in
// DecodeDeltaInPlace's order. `h` holds at least kDeltaHeaderBytes bytes.
SHARDSYNC_HD HeaderView ParseHeader(const unsigned char* h, uint64_t encoded_bytes, int expect_e,
                                    uint64_t bucket_bytes, uint64_t expect_version) {
  HeaderView v{};
  if (encoded_bytes < kDeltaHeaderBytes) {
    v.code = kShort;
    return v;
  }
  v.magic = static_cast<uint32_t>(LoadLE(h, 4));
  v.format = h[4];
  v.kind = h[5];
  v.element_size = h[6];
  v.reserved = h[7];
  v.elements = LoadLE(h + 8, 8);
  v.base_version = LoadLE(h + 16, 8);
  v.base_checksum = LoadLE(h + 24, 8);
  v.new_checksum = LoadLE(h + 32, 8);
  v.changed = LoadLE(h + 40, 8);
  const uint64_t e = static_cast<uint64_t>(v.element_size);
  if (v.magic != kMagic) {
    v.code = kBadMagic;
  } else if (v.format != kFormat) {
    v.code = kBadFormat;
  } else if (v.kind != static_cast<int>(DeltaKind::kIndex) &&
             v.kind != static_cast<int>(DeltaKind::kBitmap) &&
             v.kind != static_cast<int>(DeltaKind::kPacked)) {
    v.code = kBadKind;
  } else if (e != 1 && e != 2 && e != 4) {
    v.code = kBadElementSize;
  } else if (v.reserved != 0) {
    v.code = kBadReserved;
  } else if (v.elements > kDeltaMaxElements) {
    v.code = kBadElements;
  } else if (v.changed > v.elements) {
    v.code = kBadCount;
  } else if (v.kind == static_cast<int>(DeltaKind::kPacked) &&
             !DeltaPackedAllowed(v.elements, e, v.changed)) {
    v.code = kBadPacked;
  } else {
    const uint64_t have = encoded_bytes - kDeltaHeaderBytes;
    if (v.kind == static_cast<int>(DeltaKind::kPacked)) {
      // The escapes are what the length leaves after the payload without them (element size 2).
      const uint64_t l0 = DeltaPackedPayload(v.elements, e, v.changed, 0).bytes;
      const bool ok =
          e == 1 ? have == l0 : have >= l0 && (have - l0) % 2 == 0 && (have - l0) / 2 <= v.changed;
      v.escapes = ok && e == 2 ? (have - l0) / 2 : 0;
      v.payload = ok ? have : l0;
    } else {
      v.payload = v.kind == static_cast<int>(DeltaKind::kIndex)
                      ? DeltaIndexPayload(v.elements, e, v.changed).bytes
                      : DeltaBitmapBytes(v.elements) + v.changed * e;
    }
    if (encoded_bytes - kDeltaHeaderBytes != v.payload) {
      v.code = kBadLength;
    } else if (v.element_size != expect_e) {
      v.code = kExpectElementSize;
    } else if (bucket_bytes % e != 0 || bucket_bytes / e != v.elements) {
      v.code = kExpectBucket;
    } else if (v.base_version != expect_version) {
      v.code = kVersion;
    }
  }
  return v;
}

// Queue the kernels of one call on `stream` (a cudaStream_t). Return a cudaError_t (0: queued).
// Arguments are checked by the caller (delta_gpu.cc): sizes, alignment, capacity. `blocks`: the
// encoder's tile pass blocks that fit the GPU at once (EncodeBlocksPerSm x SMs).
// `advance`: null, or base (writable), which then ends holding next's bytes.
int LaunchEncode(const void* base, const void* next, uint64_t bytes, int element_size,
                 uint64_t base_version, void* out, const ScratchPtrs& s, int blocks, void* stream,
                 void* advance = nullptr);
// Blocks per SM the encoder's tile pass runs with (its occupancy), for the launch; 0 on error.
int EncodeBlocksPerSm(int element_size);
int LaunchDecode(const void* encoded, uint64_t encoded_bytes, void* bucket, uint64_t bytes,
                 int element_size, uint64_t base_version, const ScratchPtrs& s, int sm_count,
                 void* stream);

}  // namespace shardsync::gpu::delta
