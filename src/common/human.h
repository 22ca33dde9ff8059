// Byte counts as people read them in the text renderings (shard maps, trainer maps): binary
// units, two decimals ("1.50 GiB"), exact below a KiB ("512 B").
#pragma once

#include <cstdint>
#include <string>

namespace shardsync {

std::string HumanBytes(int64_t bytes);

}  // namespace shardsync
