// What a codec's device steps (pack.h CodecKernels) borrow from the CUDA packer: its device, its
// stream and its bounded wait. Each codec's kernels live in files named for it (block FP8:
// fp8_packer_kernels.cc); the packer lists them (cuda_packer.cc).
#pragma once

#include <memory>

#include "shardsync/pack.h"
#include "shardsync/status.h"

namespace shardsync::gpu {

class PackerAccess {
 public:
  virtual ~PackerAccess() = default;
  virtual Status Ready() = 0;  // the packer's stream exists (lazily created)
  virtual int device() const = 0;
  virtual void* stream() = 0;  // a cudaStream_t
  virtual Status Wait() = 0;   // the stream drained, within the packer's timeout
};

std::unique_ptr<CodecKernels> MakeCudaBlockQuantizeKernels(PackerAccess& packer);

}  // namespace shardsync::gpu
