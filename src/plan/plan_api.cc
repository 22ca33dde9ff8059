// Public planner API: builds the shard map and inventory, then plans over the context.
#include <chrono>

#include "plan/fp8_planner.h"
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
  if (in.model.quant) {  // block FP8: the codec's planner (fp8_planner.cc)
    SS_ASSIGN_OR_RETURN(auto fp8, plan_internal::Fp8Context::Build(in));
    return fp8.PlanForRank(sync_rank);
  }
  SS_ASSIGN_OR_RETURN(auto ctx, plan_internal::MakeContext(in));
  return ctx.PlanForRank(sync_rank);
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
  if (in.model.quant) {  // block FP8: the codec's summary (fp8_summary.cc)
    const auto t0 = std::chrono::steady_clock::now();
    SS_ASSIGN_OR_RETURN(PlanSummary s, plan_internal::SummarizeFp8(in));
    s.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  }
  SS_ASSIGN_OR_RETURN(DetailedSummary ds, SummarizePlanDetailed(in, SummaryOptions{}));
  return std::move(ds.summary);
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
  // Block FP8: the FP8 planner's checks, the 128 grid of every quantized piece included (builds
  // the shard map: milliseconds).
  if (in.model.quant) return plan_internal::Fp8Context::Build(in).status();
  SS_RETURN_IF_ERROR(plan_internal::CheckPlanOptions(in));
  // What BuildShardMap checks before it builds anything: every divisibility the engine asserts
  // and every stage's layer range, without materialising the map.
  const ShardSpec& sh = in.rollout.shard;
  SS_RETURN_IF_ERROR(ComputeShardDims(in.model, sh).status());
  for (int p = 0; p < sh.pp; ++p) {
    SS_RETURN_IF_ERROR(
        PpLayerRange(sh.engine, in.model.num_hidden_layers, p, sh.pp, sh.pp_partition).status());
  }
  return OkStatus();
}

Status ValidatePlan(const PlanInputs& in) {
  if (in.model.quant) return plan_internal::ValidateFp8(in);  // fp8_validate.cc
  SS_ASSIGN_OR_RETURN(auto ctx, plan_internal::MakeContext(in));
  return plan_internal::ValidateContext(ctx);
}

}  // namespace shardsync
