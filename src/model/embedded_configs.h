// Embedded Hugging Face config.json texts (internal to the model layer).
#pragma once

#include <string_view>
#include <vector>

namespace shardsync::internal {

struct EmbeddedConfig {
  std::string_view name;     // "qwen3-8b"
  std::string_view hf_repo;  // "Qwen/Qwen3-8B"
  std::string_view json;     // config.json text
};

const std::vector<EmbeddedConfig>& EmbeddedConfigs();

}  // namespace shardsync::internal
