// Deterministic pseudo-random model weights: a pure function of (seed, tensor name, element index),
// so every trainer rank can fill its own shard and every checker can recompute any element without
// holding the model. Used by `demo`, `bench`, `run --role trainer` without --weights, and tests.
#pragma once

#include <cstdint>
#include <string_view>

#include "shardsync/region.h"

namespace shardsync {

struct SyntheticTensor {
  uint64_t key = 0;   // from the tensor name
  float scale = 0.f;  // values are center + scale * u, u uniform in [-1, 1)
  float center = 0.f;
};

// Norm weights ("...norm.weight") center on 1 with scale 0.1; biases scale 0.02; embeddings and
// matrices scale min(1, 3 / sqrt(fan_in)), so greedy decoding with the reference engine gives
// varied tokens rather than one token repeated, and logits stay finite at every model size.
SyntheticTensor SyntheticFor(std::string_view hf_name, const Shape& shape);

// counter-based hash (splitmix64 of seed ^ key ^ element) -> float.
inline float SyntheticValue(uint64_t seed, const SyntheticTensor& t, int64_t element) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull ^ t.key ^
               (static_cast<uint64_t>(element) * 0xBF58476D1CE4E5B9ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u =
      static_cast<float>(static_cast<int64_t>(z >> 40) - (1 << 23)) * (1.0f / (1 << 23));
  return t.center + t.scale * u;
}

// Fills `out` (row-major, `r.numel()` floats) with the values of region `r` of the tensor.
void FillSyntheticRegion(uint64_t seed, std::string_view hf_name, const Shape& shape,
                         const Region& r, float* out);

}  // namespace shardsync
