// Internals shared by the rank program, the benchmark variants and the launcher.
#pragma once

#include <memory>
#include <vector>

#include "shardsync/launcher.h"
#include "shardsync/session.h"

namespace shardsync {

int64_t PeakRssBytes();

namespace sync_internal {

// Transfer tags, 48 bits (UCX keeps 16 for the source rank):
// [control 1][version mod 2^11][sequence 36]. Sessions use versions from 1; the benchmark's
// baseline variants use the reserved versions kBenchVersion*.
inline constexpr uint64_t kSeqBits = 36;
inline uint64_t MakeTag(bool control, uint64_t version, uint64_t seq) {
  return (uint64_t{control} << 47) | ((version & 0x7FF) << kSeqBits) |
         (seq & ((uint64_t{1} << kSeqBits) - 1));
}
inline constexpr uint64_t kBenchVersionBroadcast = 0x7FF;
inline constexpr uint64_t kBenchVersionRaw = 0x7FE;

struct TrainerShards {
  std::vector<SourceBinding> bindings;
  std::vector<std::unique_ptr<unsigned char[]>> buffers;
};
struct EngineParams {
  std::vector<DestBinding> bindings;
  std::vector<std::unique_ptr<unsigned char[]>> buffers;
};

// Element cast between F32 / BF16 / F16 (plain copy for equal dtypes), as the packer does it.
void CastInto(const void* in, DType a, void* out, DType b, int64_t n);
void StoreFloats(const float* in, int64_t n, DType dtype, void* out);
float LoadFloat(const void* p, int64_t i, DType dtype);
Status CheckFloatDType(DType t, std::string_view field);
// Synthetic weights of every HF tensor region the trainer rank holds, in the trainer dtype.
Result<TrainerShards> FillTrainerShards(const JobSpec& job, int trainer_rank);
// Parameters in `dtype`, filled with a garbage pattern (0xA5).
Result<EngineParams> AllocateEngineParams(const std::vector<EngineParam>& expected, DType dtype);
// Element-by-element comparison with the synthetic HF values; adds to out's counters.
void VerifyEngineParams(const JobSpec& job, const std::vector<EngineParam>& params,
                        const std::vector<DestBinding>& bound, RankResult& out);

}  // namespace sync_internal

// Bench mode of RunRank (bench.cc): sharded, broadcast-all and raw variants.
Status RunBenchRank(const JobSpec& job, int rank, const SyncRank& who, StoreClient& store,
                    Transport& transport, RankResult& res, const ProgressFn& progress);

}  // namespace shardsync
