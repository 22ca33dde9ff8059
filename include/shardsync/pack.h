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

// A codec's steps that run over memory a packer reaches, besides packing (block FP8: a receiver's
// quantize pass over staged rows, the trainers' partial amaxes: fp8.h). Each codec
// declares its own interface deriving from this one; a packer offers the ones it implements
// (Packer::codec_kernels) and the codec finds its own with KernelsOf. Steps take whole task
// lists (per band, per op), never single elements.
class CodecKernels {
 public:
  virtual ~CodecKernels() = default;
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
  // The codec steps this packer runs over its memory (none by default): KernelsOf<T> finds a
  // codec's. Owned by the packer.
  virtual std::vector<CodecKernels*> codec_kernels() { return {}; }
  // Copies `bytes` of host memory to `dst`, memory this packer allocated (AllocStaging): e.g.
  // what a codec's prepared pairs read at their launch (block FP8: the agreed block scales). Done
  // when it returns (a wait of at most the packer's timeout).
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

// The codec kernels of type T that `packer` offers, or null.
template <typename T>
T* KernelsOf(Packer& packer) {
  for (CodecKernels* k : packer.codec_kernels()) {
    if (auto* t = dynamic_cast<T*>(k)) return t;
  }
  return nullptr;
}

}  // namespace shardsync
