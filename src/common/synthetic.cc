#include "shardsync/synthetic.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace shardsync {

namespace {
uint64_t NameKey(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a: tiny, stable across machines
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}
bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}
}  // namespace

SyntheticTensor SyntheticFor(std::string_view name, const Shape& shape) {
  SyntheticTensor t;
  t.key = NameKey(name);
  if (EndsWith(name, "norm.weight")) {
    t.center = 1.0f;
    t.scale = 0.1f;
  } else if (EndsWith(name, ".bias")) {
    t.scale = 0.02f;
  } else {
    // Embeddings and matrices alike, 3 / sqrt(fan_in) (0.1 at hidden 896). Measured on
    // qwen2.5-0.5b, qwen3-0.6b and tiny test models: unit embeddings over sqrt(3 / fan_in) matrices
    // made greedy decoding repeat one token forever (a weak token comparison); this gives varied
    // tokens.
    const double fan_in = shape.empty() ? 1.0 : static_cast<double>(shape.back());
    t.scale = static_cast<float>(std::min(1.0, 3.0 / std::sqrt(fan_in)));
  }
  return t;
}

void FillSyntheticRegion(uint64_t seed, std::string_view name, const Shape& shape, const Region& r,
                         float* out) {
  const SyntheticTensor t = SyntheticFor(name, shape);
  int64_t k = 0;
  ForEachRun(r, shape, [&](int64_t off, int64_t len) {
    for (int64_t i = 0; i < len; ++i) out[k++] = SyntheticValue(seed, t, off + i);
  });
}

}  // namespace shardsync
