// An independent reference of the block-FP8 quantizer (docs/fp8.md), for tests only. It shares
// no code with src/common/fp8.cc: arithmetic in double (exact products; divisions rounded once to
// double and once to float, which gives the correctly rounded float because 53 >= 2 * 24 + 2),
// and e4m3 rounding by searching the table of the 127 finite non-negative code values (decoded from
// the format's definition), ties to the even code. Slow and obvious on purpose.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace shardsync::fp8_reference {

// Value of an e4m3fn code, from the format's definition (bias 7, 3 mantissa bits, no infinity,
// S.1111.111 is NaN).
inline double CodeValue(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (code & 0x80) ? -mag : mag;
}

// The 127 finite non-negative codes' values, ascending (code c has value index c).
inline const std::vector<double>& PositiveCodeValues() {
  static const std::vector<double> v = [] {
    std::vector<double> t;
    for (int c = 0; c <= 0x7e; ++c) t.push_back(CodeValue(static_cast<uint8_t>(c)));
    return t;
  }();
  return v;
}

// Nearest code to v (v a float value), ties to the even code, saturating to +-448: the two
// codes around |v| by binary search over the table, compared by distance.
inline uint8_t Encode(double v) {
  if (std::isnan(v)) return std::signbit(v) ? 0xff : 0x7f;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(v);
  if (a >= 448.0) return sign | 0x7e;
  const auto& t = PositiveCodeValues();
  const size_t hi = std::lower_bound(t.begin(), t.end(), a) - t.begin();  // t[hi] >= a
  if (hi == 0) return sign;
  const size_t lo = hi - 1;
  const double dlo = a - t[lo], dhi = t[hi] - a;
  size_t best = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  return sign | static_cast<uint8_t>(best);
}

inline float ToFloat(double d) { return static_cast<float>(d); }

// Scale of a block of fp32 values: max(max|x|, 1e-4f) / 448 in fp32; NaN when any is non-finite.
inline float BlockScale(const std::vector<float>& block) {
  double amax = 0;
  for (float x : block) {
    if (!std::isfinite(x)) return std::numeric_limits<float>::quiet_NaN();
    amax = std::max(amax, std::fabs(static_cast<double>(x)));
  }
  amax = std::max(amax, static_cast<double>(1e-4f));
  return ToFloat(amax / 448.0);
}

struct Quantized {
  std::vector<uint8_t> q;     // rows * cols
  std::vector<float> scales;  // ceil(rows/128) * ceil(cols/128)
  int64_t nonfinite = 0;
};

// Quantizes a row-major [rows, cols] fp32 matrix with 128 x 128 blocks aligned at (0, 0).
inline Quantized QuantizeMatrix(const float* x, int64_t rows, int64_t cols) {
  Quantized out;
  const int64_t nbr = (rows + 127) / 128, nbc = (cols + 127) / 128;
  out.q.assign(static_cast<size_t>(rows * cols), 0);
  out.scales.assign(static_cast<size_t>(nbr * nbc), 0.f);
  for (int64_t br = 0; br < nbr; ++br) {
    for (int64_t bc = 0; bc < nbc; ++bc) {
      std::vector<float> block;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) {
          block.push_back(x[r * cols + c]);
        }
      }
      const float scale = BlockScale(block);
      out.scales[br * nbc + bc] = scale;
      const bool bad = std::isnan(scale);
      const float inv = bad ? 0.f : ToFloat(1.0 / static_cast<double>(scale));
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) {
          const float v = x[r * cols + c];
          if (!std::isfinite(v)) ++out.nonfinite;
          out.q[r * cols + c] =
              bad ? 0x7f : Encode(ToFloat(static_cast<double>(v) * static_cast<double>(inv)));
        }
      }
    }
  }
  return out;
}

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace shardsync::fp8_reference
