#include "common/human.h"

#include <fmt/format.h>

namespace shardsync {

std::string HumanBytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

}  // namespace shardsync
