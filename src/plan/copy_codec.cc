// The copy codec (codec.h): every unit of the walk a plain copy, cut into contiguous runs under
// the bucket cap, a trainer source's bytes spread over its holders by byte-balanced cuts
// (planner.cc for FSDP-like layouts, megatron_plan.cc for Megatron), the summary computed
// analytically (summary.cc) and the element-by-element oracle (validate.cc).
#include <fmt/format.h>

#include "plan/codec.h"
#include "plan/planner.h"

namespace shardsync::plan_internal {
namespace {

class Copy final : public PlanCodec {
 public:
  std::string_view name() const override { return "copy"; }
  Status CheckOptions(const PlanInputs& in) const override {
    if (in.options.bucket_bytes < 4096) {
      return InvalidArgumentError(
          fmt::format("--bucket-mb: bucket cap {} bytes is below 4 KiB", in.options.bucket_bytes));
    }
    return OkStatus();
  }
  Status CheckInputs(const PlanInputs& in) const override {
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
  bool Walks(const EngineParam&) const override { return true; }
  bool Coalesces() const override { return true; }
  Status Prepare(PlanContext* c) const override { return c->PrepareCopy(); }
  void HashFields(const PlanInputs&, std::string*) const override {}
  Result<RankPlan> PlanForRank(const PlanContext& c, int sync_rank) const override {
    return c.PlanForRank(sync_rank);
  }
  Result<PlanSummary> Summarize(const PlanContext& c) const override {
    SS_ASSIGN_OR_RETURN(DetailedSummary ds, c.Summarize(SummaryOptions{}));
    return std::move(ds.summary);
  }
  Status Validate(const PlanContext& c) const override { return ValidateContext(c); }
};

}  // namespace

const PlanCodec& CopyCodec() {
  static const Copy codec;
  return codec;
}

}  // namespace shardsync::plan_internal
