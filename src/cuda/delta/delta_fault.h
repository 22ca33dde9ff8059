// The device delta pairs' test hook (delta_send.cc). No CUDA types: tests include it.
#pragma once

#include <cstdint>

namespace shardsync::gpu {

// Tests: the next delta a sender of this process ships for bucket `bucket` of its pair has byte
// `byte` (clamped to the delta) flipped before it leaves, once (the kept image is untouched): the
// receiver's device decode must refuse it (DataLoss) and land nothing of it. Every transport's
// delta pairs (cuda_ipc, nccl).
void FailNextDeltaForTesting(int64_t bucket, int64_t byte);

}  // namespace shardsync::gpu
