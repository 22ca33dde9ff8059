// Internal: the fused pack + quantize kernel of block-FP8 syncs (fp8_kernels.cu). Free of CUDA
// headers so C++ tests can call it; compiled only with CUDA (SHARDSYNC_HAVE_CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/gpu.h"
#include "shardsync/status.h"

namespace shardsync::gpu {

// One kQuantize op (fp8_plan.h): a [rows, cols] region of a trainer tensor in device memory whose
// origin sits on the HF tensor's 128 grid, packed into the op's wire image at `out`
// (Fp8WireBytes(rows, cols): e4m3 row-major, zero pad to 8, fp32 block scales, zero pad to 8).
struct Fp8QuantizeTask {
  const void* src = nullptr;   // device address of element (0, 0) of the region
  DType dtype = DType::kF32;   // f32, bf16 or f16
  int64_t src_row_stride = 0;  // elements between rows of the source tensor
  int64_t rows = 0, cols = 0;
  void* out = nullptr;       // device address of the op's wire image (may be a peer's memory)
  uint64_t wire_offset = 0;  // of `out` inside its bucket, a multiple of 8 (checksum keys)
  int32_t sum_index = 0;     // which checksum accumulator (bucket) the op's terms go to
};

struct Fp8DeviceResult {
  std::vector<uint64_t> sums;  // ChecksumPartial of each accumulator's ops' wire bytes
  int64_t nonfinite = 0;       // non-finite inputs seen (their blocks are NaN on the wire)
};

// Quantizes and packs `tasks` on `stream` (a cudaStream_t; nullptr: the default stream) and
// waits: one CTA per 128 x 128 block reads its values once, reduces the block's amax, writes the
// e4m3 bytes and the scale, and adds the checksum terms of the words it wrote; a second small
// kernel writes the zero pads and adds the terms of the scale sections (and of the e4m3 bytes of
// ops whose column count is not a multiple of 8, whose words span blocks). Bit-identical with
// Fp8QuantizePack (fp8.h). Synchronous: for tests and the first device path; a prepared,
// asynchronous launch belongs to the device session.
// The block-FP8 codec's prepared pack (BatchSpec::encoded of kQuantize / kAmax ops, or
// copy_bytes; fp8_batch.cu), which CopyBatch::Prepare hands such specs to. Every launch must be
// signaled for the cuda_ipc pairs; a plain Launch also works (the sums are read after the stream
// passed it).
Result<std::unique_ptr<CopyBatch>> PrepareBlockQuantizeBatch(const BatchSpec& spec, int device);

// The amax exchange over device pairs (fp8_amax.cu): a trainer rank's rows of one shared band
// (pack.h Fp8AmaxTask): rows (<= 128) x cols values at `src`, `src_stride` elements apart,
// whose partial amax per 128-column block goes to entry slot + block.
struct Fp8AmaxPart {
  const void* src = nullptr;
  DType dtype = DType::kF32;  // f32, bf16 or f16
  int64_t src_stride = 0;
  int64_t rows = 0, cols = 0;
  int64_t slot = 0;
};
// The partial amaxes of a fixed set of parts, prepared once (descriptors uploaded) and replayed
// every sync: one CTA per (part, 128-column block) takes the max of its values' magnitude bits
// (fp8.h Fp8PartialAmax's: fp32 bits of |x|, so NaN and Inf rank above every finite value), and
// the out_len entries (zero where no part writes) are copied to pinned host memory.
class Fp8AmaxBatch {
 public:
  static Result<std::unique_ptr<Fp8AmaxBatch>> Prepare(const std::vector<Fp8AmaxPart>& parts,
                                                       int64_t out_len, int device);
  virtual ~Fp8AmaxBatch() = default;
  // Enqueues the kernel and the copy to host on `stream` (a cudaStream_t); once the stream
  // passed them, host() holds the entries. Never blocks.
  virtual Status Launch(void* stream) = 0;
  virtual const uint32_t* host() const = 0;
};

Result<Fp8DeviceResult> Fp8QuantizePackDevice(const std::vector<Fp8QuantizeTask>& tasks,
                                              int num_sums, void* stream);

}  // namespace shardsync::gpu
