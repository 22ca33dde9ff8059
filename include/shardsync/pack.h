// What packing works on: a strided region of a tensor and where its elements sit in a wire image,
// and the Packer interface that moves them. Shared by the session (session.h: it packs through a
// Packer), the transports' prepared pairs (transport.h) and the device packer (gpu.h
// MakeCudaPacker): an interface of the common layer, so the cuda layer implements it without
// seeing the sync layer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/region.h"
#include "shardsync/status.h"

namespace shardsync {

// Where a region's memory lives (transport.h MemRegion, a Packer's Supports).
enum class MemKind { kHost, kCuda };

// A strided region of a row-major tensor at `base`, whose elements occupy wire bytes
// [wire_offset, wire_offset + region.numel() * wire size) of one bucket, in row-major order.
struct PackRegion {
  const void* base = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Region region;
  int64_t wire_offset = 0;
};

// One band of block-FP8 weights an engine rank quantizes itself (plan.h StagedBand):
// `rows` (<= 128) x `cols` raw trainer values of `dtype` (f32 / bf16 / f16) at `src`, row-major
// and contiguous, quantized per 128 x 128 block (fp8.h) into e4m3 rows at `weight` (row stride
// `weight_stride` bytes) and fp32 scales at `scales` (row stride `scale_stride` floats).
struct Fp8BandTask {
  const void* src = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0;
  void* weight = nullptr;
  int64_t weight_stride = 0;
  float* scales = nullptr;
  int64_t scale_stride = 0;
};

// A trainer rank's rows of one band of block-FP8 weights shared with other trainer ranks (the
// amax exchange, plan.h AmaxBand) in device memory: `rows` (<= 128) x `cols` values of
// `dtype` (f32 / bf16 / f16) at `src`, `src_stride` elements apart, whose partial amax per
// 128-column block goes to entry `slot + column block` of the rank's partials.
struct Fp8AmaxTask {
  const void* src = nullptr;
  DType dtype = DType::kF32;
  int64_t src_stride = 0;
  int64_t rows = 0, cols = 0;
  int64_t slot = 0;
};

// Copies strided regions to and from contiguous wire images with the dtype cast and the checksum
// (checksum.h) fused into the pass. The CPU implementation handles host memory; a device
// implementation (src/cuda) can be passed in SessionOptions for device buffers.
class Packer {
 public:
  virtual ~Packer() = default;
  virtual std::string_view name() const = 0;
  // Whether this packer can read and write memory of `kind`. The CPU packer: host only; the
  // default trusts a packer passed in to handle the memory it was made for.
  virtual bool Supports(MemKind kind) const {
    (void)kind;
    return true;
  }
  // Packs `regions` (which tile [0, bytes) of the wire image) into `out`, cast to `wire`, and
  // returns the finished checksum of the wire image.
  virtual Result<uint64_t> Pack(const std::vector<PackRegion>& regions, DType wire, void* out,
                                int64_t bytes) = 0;
  // Finished checksum of landed regions (already in the wire dtype) read in wire order: equal to
  // the sender's Pack checksum iff every byte arrived.
  virtual Result<uint64_t> ChecksumLanded(const std::vector<PackRegion>& regions,
                                          int64_t bytes) = 0;
  // Unpacks a wire image into regions (cast from `wire` to each region's dtype); `regions[i].base`
  // is written. Used by receivers that land into staging (broadcast baseline, cast on receive).
  virtual Status Unpack(const void* in, DType wire, int64_t bytes,
                        const std::vector<PackRegion>& regions) = 0;
  // Zero-fills `region` of a tensor at `base`.
  virtual Status ZeroFill(void* base, DType dtype, const Shape& shape, const Region& region) = 0;
  // Waits (bounded) until work the caller queued on the bound memory has finished, so the session
  // never races the framework's own writes (an optimizer step, an engine's parameter init on
  // torch's default CUDA stream). Called at connect and at the start of every sync. No-op on host.
  virtual Status Quiesce() { return OkStatus(); }
  // A sender's staging buffer (one bucket's wire image), in memory this packer writes: host
  // memory for the CPU packer, device memory for a device packer. Freed by the deleter.
  virtual Result<std::shared_ptr<unsigned char>> AllocStaging(size_t bytes) {
    return std::shared_ptr<unsigned char>(new unsigned char[bytes > 0 ? bytes : 1](),
                                          std::default_delete<unsigned char[]>());
  }
  // Quantizes every band (in memory this packer reads and writes; a non-finite value makes its
  // block's scale NaN and bytes 0x7f) and returns, per band, the non-finite values met. Waits at
  // most the packer's timeout. A receiver passes the same bands every sync: a device packer
  // prepares them once. The CPU packer and the CUDA one are bit-exact with fp8.h.
  virtual Result<std::vector<int64_t>> QuantizeBands(const std::vector<Fp8BandTask>& bands) {
    (void)bands;
    return UnimplementedError("packer " + std::string(name()) +
                              " does not quantize block-FP8 bands");
  }
  // The amax exchange of a trainer whose shards live in this packer's memory: each task's
  // partial amax per 128-column block, as magnitude bits (fp8.h Fp8PartialAmax's, bit for bit on
  // finite values; a non-finite value ranks above every finite one), into
  // out[task.slot + block]; entries of `out` (out_len of them) no task covers are zero. Waits at
  // most the packer's timeout. A trainer passes the same tasks every sync: a device packer
  // prepares them once.
  virtual Status PartialAmax(const std::vector<Fp8AmaxTask>& tasks, uint32_t* out,
                             int64_t out_len) {
    (void)tasks;
    (void)out;
    (void)out_len;
    return UnimplementedError("packer " + std::string(name()) +
                              " does not take partial amaxes of device memory");
  }
  // Copies `bytes` of host memory to `dst`, memory this packer allocated (AllocStaging): the
  // agreed block scales a prepared pair reads. Done when it returns (a wait of at most the
  // packer's timeout).
  virtual Status Upload(void* dst, const void* src, size_t bytes) {
    (void)dst;
    (void)src;
    (void)bytes;
    return UnimplementedError("packer " + std::string(name()) + " does not upload to its memory");
  }
  // Staged commit (SessionOptions::commit): bytes of memory this packer's AllocStaging could
  // still take (host: available memory; device: cudaMemGetInfo's free bytes).
  virtual Result<int64_t> FreeBytes() {
    return UnimplementedError("packer " + std::string(name()) + " does not report free memory");
  }
  // Copies (or, `swap`, exchanges) every task's `bytes` between `dst` and `src`, memory this
  // packer reads and writes; done when it returns (a wait of at most the packer's timeout). The
  // staged commit's only data movement: staging -> live parameters, and back on a rollback.
  struct AreaCopy {
    void* dst = nullptr;
    void* src = nullptr;
    int64_t bytes = 0;
  };
  virtual Status CopyAreas(const std::vector<AreaCopy>& copies, bool swap) {
    (void)copies;
    (void)swap;
    return UnimplementedError("packer " + std::string(name()) + " does not copy areas");
  }
};

}  // namespace shardsync
