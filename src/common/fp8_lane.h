// The CPU quantizer's per-element e4m3 conversion (fp8.cc), here so tests can hold it to the
// definition (fp8.h F32ToE4M3) value by value.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "shardsync/fp8.h"

namespace shardsync {

// F32ToE4M3 (fp8.h, the definition) without branches, so the tile loop below vectorizes: the
// normal range rounds the mantissa to 3 bits to nearest even by adding a bias and rebiases the
// exponent (a carry moves into the exponent, which is the right encoding); the subnormal range
// is round-to-nearest-even of |y| * 2^9 (exact) by the fp32 addition of 2^23; saturation and NaN
// last. tests/common/fp8_test.cc holds it to F32ToE4M3 on every bf16 value and millions of fp32s.
inline uint8_t E4M3Lane(float y) {
  uint32_t u;
  std::memcpy(&u, &y, 4);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  uint32_t qn = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  qn = std::min(qn, 0x7eu);  // only read for a >= 2^-6, where it does not wrap
  float ya;
  std::memcpy(&ya, &a, 4);
  const float f = ya * 512.0f + 8388608.0f;
  uint32_t qs;
  std::memcpy(&qs, &f, 4);
  qs -= 0x4b000000u;
  // Selects as masks (no branches: the loop over a tile vectorizes).
  const uint32_t sub = 0u - static_cast<uint32_t>(a < 0x3c800000u);   // below 2^-6: subnormal
  const uint32_t sat = 0u - static_cast<uint32_t>(a >= 0x43e00000u);  // >= 448 and +-Inf
  const uint32_t nan = 0u - static_cast<uint32_t>(a > 0x7f800000u);
  uint32_t q = (qs & sub) | (qn & ~sub);
  q = (0x7eu & sat) | (q & ~sat);
  q = (static_cast<uint32_t>(kFp8E4M3Nan) & nan) | (q & ~nan);
  return static_cast<uint8_t>(sign | q);
}

}  // namespace shardsync
