// Public planner API: builds the context (shard map, inventory, the walk) and dispatches through
// the codec the model picks (codec.h).
#include <chrono>

#include "plan/codec.h"
#include "plan/megatron.h"
#include "plan/planner.h"

namespace shardsync {
namespace plan_internal {

Result<PlanContext> MakeContext(const PlanInputs& in) {
  SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(in.model, in.rollout.shard));
  return PlanContext::Build(in, std::move(map), HfTensorInventory(in.model));
}

}  // namespace plan_internal

Result<RankPlan> PlanForRank(const PlanInputs& in, int sync_rank) {
  SS_RETURN_IF_ERROR(DescribeSyncRank(in, sync_rank));
  SS_ASSIGN_OR_RETURN(auto ctx, plan_internal::MakeContext(in));
  return ctx.codec().PlanForRank(ctx, sync_rank);
}

Result<DetailedSummary> SummarizePlanDetailed(const PlanInputs& in, const SummaryOptions& opts) {
  // Wall time is reported, never used: the plan itself does not depend on it.
  const auto t0 = std::chrono::steady_clock::now();
  SS_ASSIGN_OR_RETURN(auto ctx, plan_internal::MakeContext(in));
  SS_ASSIGN_OR_RETURN(DetailedSummary ds, ctx.Summarize(opts));
  ds.summary.plan_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ds;
}

Result<PlanSummary> SummarizePlan(const PlanInputs& in) {
  const auto t0 = std::chrono::steady_clock::now();
  SS_ASSIGN_OR_RETURN(auto ctx, plan_internal::MakeContext(in));
  SS_ASSIGN_OR_RETURN(PlanSummary s, ctx.codec().Summarize(ctx));
  s.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

Status ValidatePlanInputs(const PlanInputs& in) {
  // A Megatron trainer's layout on this model (its dims and every chunk's layers), so a Plan that
  // constructs can be planned (issue 36: megatron=tp=2,pp=8 on a 4-layer model constructed and
  // failed only at its first use).
  if (in.trainer.kind == TrainerSpec::Kind::kMegatron) {
    const MegatronLayout& m = in.trainer.megatron;
    SS_RETURN_IF_ERROR(plan_internal::ComputeMegatronDims(in.model, m).status());
    for (int p = 0; p < m.pp; ++p) {
      for (int c = 0; c < m.vpp; ++c) {
        SS_RETURN_IF_ERROR(MegatronChunkLayers(m, in.model.num_hidden_layers, p, c).status());
      }
    }
  }
  SS_RETURN_IF_ERROR(plan_internal::CheckPlanOptions(in));
  // The codec's checks (the engine's divisibilities; a quantized model's grid, which builds the
  // shard map: milliseconds).
  return plan_internal::CodecFor(in).CheckInputs(in);
}

Status ValidatePlan(const PlanInputs& in) {
  SS_ASSIGN_OR_RETURN(auto ctx, plan_internal::MakeContext(in));
  return ctx.codec().Validate(ctx);
}

}  // namespace shardsync
