// The delta codec (delta.h) on device memory: encode and decode as CUDA kernels whose bytes,
// form choice, checksums and refusals are those of EncodeDelta / DecodeDeltaInPlace.
//
// Stream semantics: Enqueue* validates its arguments on the host, queues the kernels on `stream`
// (a cudaStream_t; nullptr: the legacy default stream) and an event after them, and returns
// without waiting. Finish* waits for that event, at most `timeout` (DeadlineExceeded past it),
// and reads the result the last kernel left in pinned host memory. Nothing is read back between
// the kernels: the form, the header and the decode's go / no-go are decided on the device. One
// call in flight per DeltaGpuScratch (Enqueue refuses a second before Finish), buffers untouched
// by the caller until Finish returned.
//
// Memory the caller provides (device memory of the scratch's device, 16-byte aligned):
//   encode: `base`, `next` (bucket bytes each, read only) and `out` (at least bucket bytes:
//     the encoded form is always smaller than the bucket when it is not kFull). `out` holds the
//     encoding in its first DeltaEncodeResult::bytes bytes after Finish; for kFull its contents
//     are undefined and the caller sends `next` whole, as with the host EncodeDelta.
//   decode: `encoded` (encoded_bytes, read only) and `bucket` (written in place). The decoder
//     writes the changes before it knows the base and result checksums and puts the old bytes
//     back when it refuses: once Finish returned, a refused delta has left `bucket` byte for
//     byte as it was (during the call it may hold part of the delta: no one else reads or writes
//     it until Finish, as for every buffer of the call).
// Scratch: DeltaGpuScratch::Bytes(max bucket bytes) of device memory, for every element size
// (the element-size argument is checked but no longer changes the size): about 0.51 x the
// bucket (values staged in up to a quarter of it, indices in 1/8, the packed form's value bytes
// in 1/8, its subtile counts in 1/128, 24 bytes per 16 KiB tile; decode keeps the changed
// elements' old values, and the packed form's records expanded, in the same room), plus one
// small pinned host block.
//
// Costs (docs/benchmarks.md "Delta codec on the device"). Encode, a reduce-then-scan in two
// kernels: the tile pass reads base and next once (the Hopper copy engine feeds each block's
// range of tiles, two tiles in flight), writes the bitmap form's bytes in place and stages each
// range's changes in scratch (no block waits on another); the write pass scans the ranges'
// counts and moves the staged changes to their place (bitmap form: one copy per range; index
// form: its tiles' running counts, then a copy each of offsets and values; packed form: its
// running counts and subtile counts, the offsets reduced to their subtile, a copy of the value
// bytes, the escapes compacted a warp per tile that has any), a programmatic
// dependent launch of the first. Traffic beyond the bound's:
// the changes written and read once more, the bitmap written even when the index form wins.
// Decode, apply then verify: the checks that need no bucket byte first (header, index form,
// bitmap tail and count), then one pass over the bucket reads each 16 KiB tile once (the base
// checksum), writes back each 16-byte vector holding a change and saves the old values in the
// scratch (the result's checksum predicted from the words in registers); a refusal costs one
// more pass that puts the old values back. Index form: a records pass (a warp per tile: running
// counts, offsets and padding checked, each tile's first record), then the tile pass (a range of
// tiles per block fed by the copy engine, the records patched into the tile in shared memory).
// Packed form: its records pass (a warp per tile: every check of the host's, in its order)
// expands the records into the scratch (element within the tile, value or difference), which
// the index form's tile pass applies.
// Bitmap form: a count pass over the bitmap (a range of tiles per block) gives each tile its first
// value, then the tile pass (grid-stride). A bitmap delta whose old values exceed the scratch (over
// about 31% density) is checked first and written after the decision. Measured on an H200
// (docs/benchmarks.md "Device delta decode, apply then verify"), 64 / 512 / 2048 MiB buckets at
// 1-10%: encode 0.52-0.78x of the HBM bound of its traffic (0.8-1.8 TB/s of bucket), short of the
// issue's 0.8x; decode: see that section.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "shardsync/delta.h"
#include "shardsync/status.h"

namespace shardsync::gpu {

class DeltaGpuScratch {
 public:
  // Device bytes for buckets of up to `max_bucket_bytes`. The same for every element size: a
  // scratch serves buckets of 1-, 2- and 4-byte elements alike (`min_element_size`, 1, 2 or 4, is
  // kept for callers and checked by Allocate; it no longer limits the scratch).
  static size_t Bytes(uint64_t max_bucket_bytes, int min_element_size);
  // Allocates and zeroes the scratch on `device` (made current).
  static Result<std::unique_ptr<DeltaGpuScratch>> Allocate(uint64_t max_bucket_bytes,
                                                           int min_element_size, int device);
  virtual ~DeltaGpuScratch() = default;
  virtual uint64_t max_bucket_bytes() const = 0;
  virtual int min_element_size() const = 0;
  virtual int device() const = 0;
};

struct DeltaGpuEncodeArgs {
  const void* base = nullptr;  // the wire image last sent
  const void* next = nullptr;  // the wire image to send now
  size_t bytes = 0;            // of each; a multiple of element_size
  int element_size = 2;        // 1, 2 or 4
  uint64_t base_version = 0;
  void* out = nullptr;      // >= bytes of device memory
  std::string_view bucket;  // named in errors (copied)
  // Null, or `base` itself (writable): the encoder then leaves next's bytes in it, writing each
  // 16-byte vector that differs while it has both in hand (a sender that keeps `base` as its
  // image of the bucket skips a whole-bucket copy; the host's EncodeDeltaAdvance does the same).
  // Whatever the form, kFull included; during the call base is part old, part new.
  void* advance = nullptr;
};

// InvalidArgument naming the bucket and the field: element size, sizes, alignment, a bucket over
// the scratch's capacity (in bytes, whatever its element size) or over kDeltaMaxElements;
// FailedPrecondition: a call already in flight.
Status EnqueueDeltaEncode(const DeltaGpuEncodeArgs& args, DeltaGpuScratch* scratch, void* stream);
// What EncodeDelta returns for the same bytes (kind, changed, elements, checksums; 0 checksums
// for kFull), plus the encoded size in `bytes` (0 for kFull).
struct DeltaGpuEncoded {
  DeltaEncodeResult result;
  uint64_t bytes = 0;
};
Result<DeltaGpuEncoded> FinishDeltaEncode(DeltaGpuScratch* scratch,
                                          std::chrono::milliseconds timeout);

struct DeltaGpuDecodeArgs {
  const void* encoded = nullptr;
  size_t encoded_bytes = 0;
  void* bucket = nullptr;  // the receiver's bytes of the bucket: the base, replaced in place
  size_t bucket_bytes = 0;
  DeltaExpect expect;  // bucket name (copied), element size, base version
};

// InvalidArgument for bad arguments (alignment, capacity); the encoding's own problems come from
// Finish, with DecodeDeltaInPlace's codes and the bucket and field named: FailedPrecondition
// (base version, base checksum), InvalidArgument (element size, bucket size), DataLoss
// (malformed, truncated, a bad record, a result checksum that is not the sender's).
Status EnqueueDeltaDecode(const DeltaGpuDecodeArgs& args, DeltaGpuScratch* scratch, void* stream);
Status FinishDeltaDecode(DeltaGpuScratch* scratch, std::chrono::milliseconds timeout);

// Enqueue + Finish.
Result<DeltaGpuEncoded> EncodeDeltaDevice(const DeltaGpuEncodeArgs& args, DeltaGpuScratch* scratch,
                                          void* stream, std::chrono::milliseconds timeout);
Status DecodeDeltaDevice(const DeltaGpuDecodeArgs& args, DeltaGpuScratch* scratch, void* stream,
                         std::chrono::milliseconds timeout);

}  // namespace shardsync::gpu
