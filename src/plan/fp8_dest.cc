// Fp8DestDType (fp8_plan.h): what a block-FP8 plan's engine parameters are bound in.
#include <string>
#include <string_view>

#include "shardsync/fp8_plan.h"

namespace shardsync {

DType Fp8DestDType(const EngineParam& p, DType wire) {
  if (p.dtype == DType::kF8E4M3) return p.dtype;
  // The shard map gives each e4m3 weight a "<weight>_scale_inv" companion in fp32
  // (sharding/fp8_shard_map.cc); unquantized parameters carry the model dtype there but land wire
  // bytes.
  constexpr std::string_view kScale = "weight_scale_inv";
  if (p.dtype == DType::kF32 && p.name.size() >= kScale.size() &&
      p.name.compare(p.name.size() - kScale.size(), kScale.size(), kScale) == 0) {
    return p.dtype;
  }
  return wire;
}

}  // namespace shardsync
