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
inline constexpr uint8_t kFormat = 1;

// Launch shape. Every pass over the bucket (encode, the decode's check and bitmap apply): a tile
// is kThreads x kTileVecs 16-byte vectors of the bucket (and, for encode, of next too), one tile
// per block. 4 vectors (16 KiB tiles) keep a thread's loads in flight at once within 64
// registers, so 4 blocks fit an SM (8 vectors: 100-122 registers, 2 blocks, measured slower).
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
  kBadLength,          // payload length for the kind and count
  kExpectElementSize,  // the receiver's element size differs
  kExpectBucket,       // the receiver's bucket size differs
  kVersion,            // base version differs
  kBaseChecksum,       // the receiver's bytes are not the base
  kBadRecord,          // an index record out of range or not increasing (detail: record)
  kBitmapTail,         // bitmap bits past the last element
  kPopcount,           // bitmap popcount != count (detail: popcount)
  kResultChecksum,     // the predicted result's checksum is not the sender's
};

// Device control block at the start of the scratch. Between calls every field holds its rest
// value (kernels reset it at their end): sums 0, bad_record ~0, counters 0, epoch >= 1.
struct Ctl {
  unsigned long long epoch;       // tag of this call's tile states (30 bits used)
  unsigned long long sum_a;       // checksum sum of the base (encode and decode)
  unsigned long long sum_b;       // encode: of next; decode: new minus old terms of changed words
  unsigned long long bad_record;  // decode: first bad index record
  unsigned long long popcount;    // decode: bitmap bits set
  unsigned int tile_counter;      // dynamic tile ids
  unsigned int ticket;            // unused (0)
  unsigned int tail_bad;          // decode: bitmap bits past the end
  unsigned int pad;
  // Decode: the decision (Code | kind << 32) and the change count, written by the decide kernel
  // of every call before the apply pass reads them (no rest value needed).
  unsigned long long go;
  unsigned long long changed;
};

// Written by the last kernel of a call into pinned, mapped host memory.
struct HostResult {
  unsigned long long code;  // Code (decode), 0 for encode
  unsigned long long kind, changed, bytes, elements, base_checksum, new_checksum;  // encode
  unsigned long long have;                  // decode: base checksum / predicted result checksum
  unsigned long long detail;                // decode: bad record / popcount
  unsigned char header[kDeltaHeaderBytes];  // decode: the encoding's header
};

struct ScratchPtrs {
  Ctl* ctl = nullptr;
  unsigned long long* states = nullptr;  // tile states: epoch | flag | value
  uint32_t* tile_prefix = nullptr;       // decode: changes before each tile (tiles + 1 entries)
  uint32_t* idx = nullptr;               // encode: staged index-form indices
  unsigned char* vals = nullptr;         // encode: staged index-form values
  HostResult* result = nullptr;          // device view of the pinned result
};

// The scratch layout for buckets up to max_bytes with elements of at least min_e bytes.
struct ScratchLayout {
  uint64_t states = 0, tile_prefix = 0, idx = 0, vals = 0, total = 0;
};
inline ScratchLayout LayoutScratch(uint64_t max_bytes, int min_e) {
  auto up = [](uint64_t v) { return (v + 255) / 256 * 256; };
  const uint64_t bitmap = DeltaBitmapBytes(max_bytes / static_cast<uint64_t>(min_e));
  const uint64_t tiles = (max_bytes + kTileBytes - 1) / kTileBytes;
  const uint64_t positions = bitmap / kDeltaIndexBytes;  // most the index form can hold
  ScratchLayout l;
  l.states = up(sizeof(Ctl));
  l.tile_prefix = l.states + up(8 * tiles + 8);
  l.idx = l.tile_prefix + up(4 * tiles + 8);
  l.vals = l.idx + up(4 * positions + 4);
  // positions(e) * e <= max_bytes / 32 for every e >= min_e.
  l.total = l.vals + up(max_bytes / 32 + 8);
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
             v.kind != static_cast<int>(DeltaKind::kBitmap)) {
    v.code = kBadKind;
  } else if (e != 1 && e != 2 && e != 4) {
    v.code = kBadElementSize;
  } else if (v.reserved != 0) {
    v.code = kBadReserved;
  } else if (v.elements > kDeltaMaxElements) {
    v.code = kBadElements;
  } else if (v.changed > v.elements) {
    v.code = kBadCount;
  } else {
    v.payload = v.kind == static_cast<int>(DeltaKind::kIndex)
                    ? v.changed * (kDeltaIndexBytes + e)
                    : DeltaBitmapBytes(v.elements) + v.changed * e;
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
// Arguments are checked by the caller (delta_gpu.cc): sizes, alignment, capacity.
int LaunchEncode(const void* base, const void* next, uint64_t bytes, int element_size,
                 uint64_t base_version, void* out, const ScratchPtrs& s, int sm_count,
                 void* stream);
int LaunchDecode(const void* encoded, uint64_t encoded_bytes, void* bucket, uint64_t bytes,
                 int element_size, uint64_t base_version, const ScratchPtrs& s, int sm_count,
                 void* stream);

}  // namespace shardsync::gpu::delta
