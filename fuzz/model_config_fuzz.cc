// libFuzzer entry for the config.json parser: any byte string must yield a ModelSpec or an error,
// never a crash, hang or uncaught exception. A spec that parses must also inventory and shard.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shardsync/model.h"
#include "shardsync/shard_map.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto spec = shardsync::ParseModelConfig(text, "fuzz.json");
  if (!spec.ok()) return 0;
  // Keep each input cheap: inventory and shard only modest models.
  if (spec->num_hidden_layers * (spec->num_experts + 1) > 4096 || spec->vocab_size > (1 << 20)) {
    return 0;
  }
  (void)shardsync::HfTensorInventory(*spec);
  shardsync::ShardSpec s;
  s.tp = 2;
  s.pp = spec->num_hidden_layers >= 2 ? 2 : 1;
  auto map = shardsync::BuildShardMap(*spec, s);
  if (map.ok() && !shardsync::ValidateShardMap(*map).ok()) __builtin_trap();
  return 0;
}
