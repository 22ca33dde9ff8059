// The cuda_ipc delta pairs' test hook (delta_ipc.cc). No CUDA types: tests include it.
#pragma once

#include <cstdint>

namespace shardsync::gpu::ipc {

// Tests: the next delta a sender of this process copies for bucket `bucket` of its pair has byte
// `byte` (clamped to the delta) flipped in the receiver's window after the copy, once: the
// receiver's device decode must refuse it (DataLoss) and land nothing of it.
void FailNextDeltaForTesting(int64_t bucket, int64_t byte);

}  // namespace shardsync::gpu::ipc
