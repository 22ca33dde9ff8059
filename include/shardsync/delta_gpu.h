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
//   decode: `encoded` (encoded_bytes, read only) and `bucket` (written in place, and only when
//     every check passed: a refused delta leaves it as it was).
// Scratch: DeltaGpuScratch::Bytes(max bucket bytes, smallest element size) of device memory,
// about 0.16 x the bucket for 1-byte elements, 0.1 x for 2-byte (index scratch of the encoder:
// 4 bytes per position the index form can hold, the values beside them, per-tile states), plus
// one small pinned host block.
//
// Costs: encode reads base and next once and writes the bitmap form's bytes in the same pass
// (single-pass scan with a decoupled look-back for the output offsets); when the index form wins,
// a second kernel rewrites the records it staged in scratch. Decode reads the bucket once (the
// base checksum, and the result's checksum predicted from the changed words' old and new terms),
// then a later kernel writes the changed elements only if every check passed (bitmap form: each
// 16-byte vector holding a change read and written whole). Measured on an H200
// (docs/benchmarks.md "Delta codec on the device"), 64 / 512 MiB buckets at 1-10%: encode
// 0.40-0.51x and decode 0.15-0.26x of the HBM bound of their traffic (690-990 and 410-1120 GB/s
// of bucket; decode 0.30-0.39x of a bound counting the touched 32-byte sectors), short of the
// issue's 0.8x.
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
  // Device bytes for buckets of up to `max_bucket_bytes` with elements of at least
  // `min_element_size` bytes (1, 2 or 4).
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
};

// InvalidArgument naming the bucket and the field: element size, sizes, alignment, a bucket over
// the scratch's capacity or over kDeltaMaxElements; FailedPrecondition: a call already in flight.
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
