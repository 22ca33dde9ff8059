// Internal: an engine dump's quantized parameter back to the fp32 values the engine computes with
// (block FP8: fp8_weights.cc).
#pragma once

#include <string>

#include "shardsync/refengine.h"

namespace shardsync {

// The quantized parameter `p` (block FP8: e4m3 [.., rows, cols]) of an engine rank's `buffers`
// times its scales, into `out` (p.numel() floats); InvalidArgument naming `who` and the scale
// parameter when it is missing or misshapen.
Status DequantizeEngineParam(const EngineBuffers& buffers, const EngineParam& p,
                             const std::string& who, float* out);

}  // namespace shardsync
