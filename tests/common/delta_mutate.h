// Test helper shared by the host and device delta codec tests: changes that look like an
// optimizer's step.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace shardsync::testing_delta {

// `base` with `changed` distinct elements moved by small steps: 2-byte bit patterns by a
// difference in [-140, 140] (never 0; about one in 13 escaped in the packed form), bytes and
// 4-byte elements to another top byte.
inline std::vector<std::byte> MutateSmall(const std::vector<std::byte>& base, int e,
                                          uint64_t changed, uint32_t seed) {
  std::vector<std::byte> next = base;
  const uint64_t elements = base.size() / e;
  std::vector<uint64_t> order(elements);
  for (uint64_t i = 0; i < elements; ++i) order[i] = i;
  std::mt19937 rng(seed);
  for (uint64_t k = 0; k < changed; ++k) {  // partial Fisher-Yates: the first `changed`
    std::swap(order[k], order[k + rng() % (elements - k)]);
    std::byte* p = next.data() + order[k] * e;
    if (e == 2) {
      int d = static_cast<int>(rng() % 280) - 140;
      if (d >= 0) ++d;
      uint16_t v;
      std::memcpy(&v, p, 2);
      v = static_cast<uint16_t>(v + d);
      std::memcpy(p, &v, 2);
    } else {
      p[e - 1] ^= static_cast<std::byte>(1 + rng() % 255);
    }
  }
  return next;
}

}  // namespace shardsync::testing_delta
