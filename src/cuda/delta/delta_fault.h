// The device delta pairs' test hook (delta_send.cc). No CUDA types: tests include it.
#pragma once

#include <cstdint>

namespace shardsync::gpu {

// Tests: the next delta a sender of this process ships for bucket `bucket` of its pair has byte
// `byte` (clamped to the delta) flipped before it leaves, once (the kept image is untouched): the
// receiver's device decode must refuse it (DataLoss) and land nothing of it. Every transport's
// delta pairs (cuda_ipc, nccl).
void FailNextDeltaForTesting(int64_t bucket, int64_t byte);

// Tests: before the next encode a sender of this process runs for bucket `bucket`, one byte of
// its kept image of that bucket is flipped, once: the encoder's base sum is then not the kept
// one, so the sender must send the bucket whole (reason: checksum) rather than a delta the
// receiver refuses. Every transport's delta pairs.
void CorruptNextKeptImageForTesting(int64_t bucket);

}  // namespace shardsync::gpu
