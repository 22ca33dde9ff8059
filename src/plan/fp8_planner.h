// Internal: the block-FP8 planner's context (shared by planning, validation and the summary).
#pragma once

#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "plan/megatron.h"
#include "shardsync/fp8.h"
#include "shardsync/fp8_plan.h"

namespace shardsync::plan_internal {

// The block edge, short for the grid arithmetic of the FP8 planner's files.
inline constexpr int64_t B = kFp8Block;

// One op before bucket splitting, as the walk over an engine rank's pieces produces it.
struct Fp8Unit {
  Encoding encoding = Encoding::kCopy;
  int32_t tensor = 0, param = 0, scale_param = -1;
  int32_t stage = -1;          // kStage: index into the erank's staged bands
  int64_t staging_offset = 0;  // kStage: that band's StagedBand::staging_offset
  Region src, dst, scale_dst;
  int64_t chunk = 0;    // trainer dim-0 chunk (FSDP shard position) holding src
  int32_t source = -1;  // Megatron: index into MegatronSources::sources holding src
  int64_t index = 0;    // position among the erank's units of that chunk / source (senders)
};

// Blocks of a region's last two dims (leading dims kept): where a weight region's scales are.
Region BlockRegion(const Region& r);

class Fp8Context {
 public:
  static Result<Fp8Context> Build(const PlanInputs& in);

  Result<RankPlan> PlanForRank(int sync_rank) const;
  // Calls fn for every unit of engine rank `e` of a replica, in the plan's order; fills `staged`
  // (the bands the rank quantizes itself, staging offsets assigned) when given.
  void Walk(int e, const std::function<void(const Fp8Unit&)>& fn,
            std::vector<StagedBand>* staged) const;
  // Trainer rank serving unit `u` of engine rank `e` in replica `d`.
  int SourceOf(const Fp8Unit& u, int e, int d) const { return SenderOf(u, e, d).first; }
  // The same, with the Megatron place (MegatronSources::places) it reads (-1 for FSDP-like).
  std::pair<int, int32_t> SenderOf(const Fp8Unit& u, int e, int d) const;
  // Megatron: where the sender reading from `place` holds op `op` of a unit of `source`.
  LocalSource LocalOf(const TransferOp& op, int32_t source, int32_t place) const;
  bool megatron() const { return mg_ != nullptr; }

  const PlanInputs& inputs() const { return in_; }
  const ShardMap& map() const { return map_; }
  const std::vector<HfTensor>& inventory() const { return inv_; }
  const std::string& hash() const { return hash_; }
  int trainer_world() const { return S_world_; }
  int engine_per_replica() const { return E_; }
  int replicas() const { return D_; }
  int64_t chunk_rows(int32_t tensor) const { return chunk_[tensor]; }
  int64_t wire_size() const { return wire_; }
  // kAmax plans of FSDP-like trainers: every straddling band (tensor, first HF row), sorted.
  const std::vector<std::pair<int32_t, int64_t>>& amax_bands() const { return amax_bands_; }
  // The exchange's layout (fp8_plan.h AmaxBand): the bands chunk `s` holds rows of, for a
  // rank of replica group `group` (mine); every chunk's value length in blocks (blocks); which
  // chunks read which (peers[k][j]: chunk k reads chunk j's value). Each output optional.
  void AmaxLayout(int s, std::vector<AmaxBand>* mine, std::vector<int64_t>* blocks,
                  std::vector<std::vector<char>>* peers, int group) const;
  int64_t stage_size() const { return stage_; }

 private:
  void Split(const Fp8Unit& u, std::vector<TransferOp>* out) const;
  void WalkMegatron(int e, const std::function<void(const Fp8Unit&)>& fn) const;
  // Megatron: InvalidArgument when a trainer source cuts a block of a quantized engine piece.
  Status CheckMegatronGrid() const;

  PlanInputs in_;
  ShardMap map_;
  std::vector<HfTensor> inv_;
  std::unordered_map<std::string, int32_t> by_name_;
  std::vector<int64_t> chunk_;  // per tensor: dim-0 rows per trainer shard (torch.chunk)
  std::string hash_;
  int S_world_ = 1, R_ = 1, S_ = 1, D_ = 1, E_ = 1;
  int64_t wire_ = 2, stage_ = 4;
  // Per engine rank of a replica: param index -> its weight_scale_inv param index (-1: none).
  std::vector<std::vector<int32_t>> scale_of_;
  // Megatron trainers: the HF boxes each rank holds and where (megatron.h).
  std::shared_ptr<const MegatronSources> mg_;
  std::vector<std::pair<int32_t, int64_t>> amax_bands_;
};

// The block-FP8 plan's summary (fp8_summary.cc) and its element-by-element validation
// (fp8_validate.cc), behind SummarizePlan and ValidatePlan.
Result<PlanSummary> SummarizeFp8(const PlanInputs& in);
Status ValidateFp8(const PlanInputs& in);

}  // namespace shardsync::plan_internal
