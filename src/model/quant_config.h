// Internal: config.json's `quantization_config`, honoured or refused field by field.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "shardsync/model.h"

namespace shardsync::internal {

// `q` is the value of "quantization_config" (nullptr: absent or null). Errors read
// "<source>: field 'quantization_config.<key>': <what>", like every other config field.
Result<std::optional<QuantConfig>> ParseQuantizationConfig(const nlohmann::json* q,
                                                           std::string_view source);

// The checks on a spec's QuantConfig that need the model (ValidateModelSpec calls it): block size,
// and ignored_modules against the model's modules (fused projections must agree, experts are not
// supported). InvalidArgument naming the field.
Status ValidateQuantConfig(const ModelSpec& spec);

}  // namespace shardsync::internal
