// Block FP8's plan codec (codec.h): the walk's units cut on the 128 x 128 grid (fp8_planner.cc,
// fp8_megatron.cc), its summary (fp8_summary.cc), validation (fp8_validate.cc) and hash fields.
#include <fmt/format.h>

#include "plan/codec.h"
#include "plan/fp8_planner.h"

namespace shardsync::plan_internal {
namespace {

// One 128 x 128 block with its scale must fit a bucket.
constexpr int64_t kMinFp8Bucket = int64_t{64} << 10;

class BlockFp8Codec final : public PlanCodec {
 public:
  std::string_view name() const override { return "block-FP8"; }
  Status CheckOptions(const PlanInputs& in) const override {
    if (in.options.bucket_bytes < kMinFp8Bucket) {
      return InvalidArgumentError(fmt::format(
          "--bucket-mb: block-FP8 plans need a bucket of at least 64 KiB (one 128 x 128 block "
          "with its scale), got {} bytes",
          in.options.bucket_bytes));
    }
    if (in.options.encoding != WireEncoding::kFull && in.options.straddle == Encoding::kStage) {
      // A delta's base is the image the engine rebuilds from its landed bytes (sync/codec.h
      // RebuildImage); staged rows are trainer values the engine quantizes itself: no image.
      return InvalidArgumentError(fmt::format(
          "--encoding {}: block-FP8 plans with --fp8-split stage are not delta-encoded (staged "
          "rows have no landed image); use --fp8-split amax or --encoding full",
          WireEncodingName(in.options.encoding)));
    }
    return OkStatus();
  }
  // The shard map (its 128 grid checks), and the Megatron trainer's grid: milliseconds.
  Status CheckInputs(const PlanInputs& in) const override { return Fp8Context::Build(in).status(); }
  // A weight's weight_scale_inv has no units: the quantize / amax ops of its weight fill it.
  bool Walks(const EngineParam& p) const override { return !IsFp8ScaleParam(p); }
  // Units keep the shard map's pieces (their bands start where the pieces do).
  bool Coalesces() const override { return false; }
  Status Prepare(PlanContext*) const override { return OkStatus(); }
  void HashFields(const PlanInputs& in, std::string* text) const override {
    const QuantConfig& q = *in.model.quant;
    *text += fmt::format("quant={};{}\n", QuantConfigToString(q), kFp8PlannerVersion);
    // Only for the amax exchange, so staged FP8 plans keep the hashes they had.
    if (in.options.straddle == Fp8Split::kAmax) *text += "fp8_split=amax\n";
  }
  Result<RankPlan> PlanForRank(const PlanContext& c, int sync_rank) const override {
    SS_ASSIGN_OR_RETURN(Fp8Context f, Fp8Context::Build(c));
    return f.PlanForRank(sync_rank);
  }
  Result<PlanSummary> Summarize(const PlanContext& c) const override { return SummarizeFp8(c); }
  Status Validate(const PlanContext& c) const override { return ValidateFp8(c); }
};

}  // namespace

const PlanCodec& BlockQuantCodec() {
  static const BlockFp8Codec codec;
  return codec;
}

}  // namespace shardsync::plan_internal
