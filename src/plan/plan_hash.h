// PlanHash's canonical text (plan_hash.cc), for the sessions' plan agreement: ranks publish it
// beside the hash so that a mismatch names the field that differs.
#pragma once

#include <string>
#include <string_view>

#include "shardsync/plan.h"

namespace shardsync {

// The "field=value" lines PlanHash hashes (the model's fields, layouts, dtypes, plan options,
// planner versions).
std::string PlanHashText(const PlanInputs& in);
// The first field whose value differs between two PlanHashText texts, as "tp is 2 here and 4 on
// <who>"; "" when they are equal.
std::string FirstPlanDifference(std::string_view mine, std::string_view theirs,
                                std::string_view who);

}  // namespace shardsync
