// Internals shared by the rank program, the benchmark variants and the launcher.
#pragma once

#include <memory>
#include <vector>

#include "shardsync/launcher.h"
#include "shardsync/session.h"

namespace shardsync {

int64_t PeakRssBytes();

namespace sync_internal {

struct TrainerShards {
  std::vector<SourceBinding> bindings;
  std::vector<std::unique_ptr<unsigned char[]>> buffers;
};
struct EngineParams {
  std::vector<DestBinding> bindings;
  std::vector<std::unique_ptr<unsigned char[]>> buffers;
};

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
