// Internal: block FP8's element checks, behind the harness's EncodedParamCheck (internal.h).
#pragma once

#include <vector>

#include "job/internal.h"

namespace shardsync::job_internal {

// The e4m3 weight params[i] and its weight_scale_inv (found by name) against fp8.h's quantizer
// applied to the synthetic values as the trainer holds them (trainer dtype), piece by piece:
// every byte and every scale, bit for bit (fp8_verify.cc).
void VerifyFp8Param(const JobSpec& job, const std::vector<EngineParam>& params, size_t i,
                    const std::vector<DestBinding>& bound, RankResult& out);
// Device mode: every block-FP8 weight and scale of an engine rank's parameters (`dests`, device
// memory) against the GPU quantizer on the trainer's values (fp8_device_verify.cc); adds to out.
Status VerifyFp8Device(const JobSpec& job, const std::vector<EngineParam>& params,
                       const std::vector<DestBinding>& dests, int device, void* stream,
                       RankResult& out);

}  // namespace shardsync::job_internal
