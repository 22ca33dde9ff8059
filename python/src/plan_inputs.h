// PlanInputs from the Python-side spellings (shared by the plan and session bindings).
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "shardsync/plan.h"

namespace shardsync::py_bind {

PlanInputs MakePlanInputs(py::handle model, const std::string& trainer, const std::string& rollout,
                          const std::string& engine, const std::string& wire_dtype,
                          const std::string& trainer_dtype, int64_t bucket_bytes,
                          std::vector<int64_t> pp_partition,
                          const std::string& expert_naming = "fused_moe",
                          const std::string& quant = "", const std::string& fp8_split = "amax",
                          const std::string& encoding = "full");

}  // namespace shardsync::py_bind
