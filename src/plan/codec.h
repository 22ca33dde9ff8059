// Internal: the plan's codecs. Planning is one walk per trainer layout (PlanContext::ForEachUnit:
// every engine piece x the trainer source boxes of its tensor, i.e. the piece's rows in each
// FSDP dim-0 chunk or its intersection with each Megatron source) and a codec that turns each
// unit into ops: the copy codec (planner.cc, megatron_plan.cc) cuts a unit into plain copies
// under the bucket cap and spreads a source's bytes over its holders; block FP8's
// (fp8_planner.cc, docs/fp8.md) cuts it on its 128 x 128 grid and adds quantize / stage / amax
// ops. The model's quantization picks the codec (CodecFor); the public entry points
// (plan_api.cc), the hash (plan_hash.cc) and the context dispatch through it.
#pragma once

#include <string>
#include <string_view>

#include "shardsync/plan.h"

namespace shardsync::plan_internal {

class PlanContext;

class PlanCodec {
 public:
  virtual ~PlanCodec() = default;
  // Its name in messages ("copy", "block-FP8").
  virtual std::string_view name() const = 0;
  // The option checks particular to the codec (the bucket cap its smallest op needs), run after
  // the inputs' own checks and before the shard map is built.
  virtual Status CheckOptions(const PlanInputs& in) const = 0;
  // Every check ValidatePlanInputs makes for the codec beyond CheckOptions (the engine's
  // divisibilities, the codec's grid), without planning.
  virtual Status CheckInputs(const PlanInputs& in) const = 0;
  // Whether the walk visits parameter `p` (false: a companion, such as a weight's scales, whose
  // bytes the ops of another parameter carry) and whether adjacent pieces of one parameter are
  // coalesced into one unit before it walks (copies do not care where the map's pieces end).
  virtual bool Walks(const EngineParam& p) const = 0;
  virtual bool Coalesces() const = 0;
  // Tables the codec precomputes once per context (the copy codec's byte-balanced cuts).
  virtual Status Prepare(PlanContext* c) const = 0;
  // Appends the codec's "key=value\n" lines to the plan hash text (PlanHashText) at their place:
  // its planner version and options. Nothing for the copy codec, so bf16 hashes stay as they were.
  virtual void HashFields(const PlanInputs& in, std::string* text) const = 0;
  virtual Result<RankPlan> PlanForRank(const PlanContext& c, int sync_rank) const = 0;
  virtual Result<PlanSummary> Summarize(const PlanContext& c) const = 0;
  // Enumerates every rank's plan and checks it element by element (small jobs only).
  virtual Status Validate(const PlanContext& c) const = 0;
};

// The codec of plain copies (every op Encoding::kCopy), for models without quantized weights.
const PlanCodec& CopyCodec();
// The codec of block-quantized engine weights (ModelSpec::quant: block FP8, fp8_planner.cc).
const PlanCodec& BlockQuantCodec();
// The codec the inputs' model needs.
inline const PlanCodec& CodecFor(const PlanInputs& in) {
  return in.model.quant ? BlockQuantCodec() : CopyCodec();
}

}  // namespace shardsync::plan_internal
