// Internal: the staged commit's device exchange (area_kernels.cu). Free of CUDA headers.
#pragma once

#include <cstdint>

namespace shardsync::gpu {

// Queues an exchange of `bytes` between device memory `a` and `b` on `stream` (a cudaStream_t):
// 16-byte words when both addresses and the size allow, else bytes. Returns the launch's
// cudaError_t (0: queued).
int LaunchSwap(void* a, void* b, int64_t bytes, void* stream, int sm_count);

}  // namespace shardsync::gpu
