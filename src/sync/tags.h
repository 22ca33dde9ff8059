// The transfer tag layout of the sync layer, exported to the job harness (src/job): the
// benchmark's baselines send on a session's transport with tags that must never collide with a
// session's (job/internal.h reserves their versions).
#pragma once

#include <cstdint>

namespace shardsync {

// Transfer tags, 48 bits (UCX keeps 16 for the source rank):
// [control 1][version mod 2^11][sequence 36]. Sessions use versions from 1; the benchmark's
// baseline variants use reserved versions (job/internal.h kBenchVersion*).
inline constexpr uint64_t kTagSeqBits = 36;
inline uint64_t MakeTag(bool control, uint64_t version, uint64_t seq) {
  return (uint64_t{control} << 47) | ((version & 0x7FF) << kTagSeqBits) |
         (seq & ((uint64_t{1} << kTagSeqBits) - 1));
}

}  // namespace shardsync
