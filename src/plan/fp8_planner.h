// Internal: block FP8's plan codec (codec.h) and its context (shared by planning, validation and
// the summary).
#pragma once

#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "plan/megatron.h"
#include "plan/planner.h"
#include "shardsync/fp8.h"
#include "shardsync/fp8_plan.h"

namespace shardsync::plan_internal {

// The block edge, short for the grid arithmetic of the FP8 planner's files.
inline constexpr int64_t B = kFp8Block;
// Staged bands and copies start on 8-byte boundaries of the wire image / staging.
inline int64_t AlignUp8(int64_t n) { return (n + 7) & ~int64_t{7}; }

// One op before bucket splitting: a walk unit's part on the grid, with its encoding.
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

// Block FP8's codec state over a PlanContext (codec.h): the units the walk gives cut on the 128
// grid (Walk), who serves each, and the amax exchange's layout.
class Fp8Context {
 public:
  // Builds the PlanContext too (its shard map and walk); FailedPrecondition without a
  // quantization config.
  static Result<Fp8Context> Build(const PlanInputs& in);
  // Over a context the caller keeps alive.
  static Result<Fp8Context> Build(const PlanContext& c);

  Result<RankPlan> PlanForRank(int sync_rank) const;
  // Calls fn for every unit of engine rank `e` of a replica, in the plan's order: the walk's
  // units (PlanContext::ForEachUnit) cut on the grid; fills `staged` (the bands the rank
  // quantizes itself, staging offsets assigned) when given.
  void Walk(int e, const std::function<void(const Fp8Unit&)>& fn,
            std::vector<StagedBand>* staged) const;
  // Trainer rank serving unit `u` of engine rank `e` in replica `d`.
  int SourceOf(const Fp8Unit& u, int e, int d) const { return SenderOf(u, e, d).first; }
  // The same, with the Megatron place (MegatronSources::places) it reads (-1 for FSDP-like).
  std::pair<int, int32_t> SenderOf(const Fp8Unit& u, int e, int d) const;
  bool megatron() const { return mg_ != nullptr; }

  const PlanContext& plan() const { return *c_; }
  const PlanInputs& inputs() const { return c_->inputs(); }
  const ShardMap& map() const { return c_->map(); }
  const std::vector<HfTensor>& inventory() const { return c_->inventory(); }
  const std::string& hash() const { return c_->hash(); }
  int trainer_world() const { return c_->trainer_world(); }
  int engine_per_replica() const { return c_->engine_per_replica(); }
  int replicas() const { return c_->replicas(); }
  int64_t chunk_rows(int32_t tensor) const { return c_->chunk_rows(tensor); }
  int64_t wire_size() const { return c_->wire_size(); }
  // kAmax plans of FSDP-like trainers: every straddling band (tensor, first HF row), sorted.
  const std::vector<std::pair<int32_t, int64_t>>& amax_bands() const { return amax_bands_; }
  // The exchange's layout (fp8_plan.h AmaxBand): the bands chunk `s` holds rows of, for a
  // rank of replica group `group` (mine); every chunk's value length in blocks (blocks); which
  // chunks read which (peers[k][j]: chunk k reads chunk j's value). Each output optional.
  void AmaxLayout(int s, std::vector<AmaxBand>* mine, std::vector<int64_t>* blocks,
                  std::vector<std::vector<char>>* peers, int group) const;
  int64_t stage_size() const { return stage_; }

 private:
  // What one engine rank's walk carries from unit to unit.
  struct WalkState {
    std::vector<int64_t> counter;  // units so far per chunk (FSDP-like) or source (Megatron)
    std::vector<StagedBand>* staged = nullptr;
    int32_t bands = 0;    // kStage: staged bands so far
    int64_t staging = 0;  // and the staging they take
    int32_t band = -1;    // the band the last stage unit fed, and its staging offset
    int64_t band_offset = 0;
  };
  static Result<Fp8Context> Build(std::shared_ptr<const PlanContext> c);
  // The unit of an FSDP-like walk (a piece's rows in one dim-0 chunk) cut into bands: quantized
  // where whole bands lie in the chunk, amax or stage parts where a band straddles chunks.
  void CutChunkUnit(int e, const PlanUnit& u, WalkState* st,
                    const std::function<void(const Fp8Unit&)>& fn) const;
  // The unit of a Megatron walk (a piece x one trainer source, on the grid) cut along dim 0 into
  // up to `holders` units (fp8_megatron.cc).
  void CutSourceUnit(int e, const PlanUnit& u, WalkState* st,
                     const std::function<void(const Fp8Unit&)>& fn) const;
  void Split(const Fp8Unit& u, std::vector<TransferOp>* out) const;
  // Megatron: InvalidArgument when a trainer source cuts a block of a quantized engine piece.
  Status CheckMegatronGrid() const;

  std::shared_ptr<const PlanContext> c_;
  int64_t stage_ = 4;
  // Per engine rank of a replica: param index -> its weight_scale_inv param index (-1: none).
  std::vector<std::vector<int32_t>> scale_of_;
  // Megatron trainers: the HF boxes each rank holds and where (the context's, megatron.h).
  const MegatronSources* mg_ = nullptr;
  std::vector<std::pair<int32_t, int64_t>> amax_bands_;
};

// The block-FP8 plan's summary (fp8_summary.cc) and its element-by-element validation
// (fp8_validate.cc): the codec's Summarize and Validate.
Result<PlanSummary> SummarizeFp8(const PlanContext& c);
Status ValidateFp8(const PlanContext& c);

}  // namespace shardsync::plan_internal
