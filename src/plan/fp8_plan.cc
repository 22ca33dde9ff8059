// The public functions of fp8_plan.h: the --fp8-split names, and what a block-FP8 plan's engine
// parameters are bound in.
#include <fmt/format.h>

#include <string>
#include <string_view>

#include "shardsync/fp8_plan.h"

namespace shardsync {

std::string_view Fp8SplitName(Fp8Split s) { return s == Fp8Split::kAmax ? "amax" : "stage"; }

Result<Fp8Split> ParseFp8Split(std::string_view s, std::string_view flag) {
  if (s == "amax") return Fp8Split::kAmax;
  if (s == "stage") return Fp8Split::kStage;
  return InvalidArgumentError(fmt::format("{}: '{}', expected amax or stage", flag, s));
}

bool IsFp8ScaleParam(const EngineParam& p) {
  // The shard map gives each e4m3 weight a "<weight>_scale_inv" companion in fp32
  // (sharding/fp8_shard_map.cc).
  constexpr std::string_view kScale = "weight_scale_inv";
  return p.dtype == DType::kF32 && p.name.size() >= kScale.size() &&
         p.name.compare(p.name.size() - kScale.size(), kScale.size(), kScale) == 0;
}

DType Fp8DestDType(const EngineParam& p, DType wire) {
  // e4m3 weights and their scales as they are; unquantized parameters carry the model dtype in
  // the map but land wire bytes.
  if (p.dtype == DType::kF8E4M3 || IsFp8ScaleParam(p)) return p.dtype;
  return wire;
}

}  // namespace shardsync
