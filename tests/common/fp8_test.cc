// The block-FP8 quantizer (fp8.h) against the independent reference (fp8_reference.h), bit for
// bit: codes, rounding ties, denormals, saturation, zero and non-finite blocks, partial blocks,
// bf16 / f16 / f32 inputs, and the fused quantize-pack with its checksum.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/fp8_lane.h"
#include "common/fp8_reference.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"

namespace shardsync {
namespace {

namespace ref = fp8_reference;

TEST(Fp8Codes, DecodeMatchesTheFormatAndRoundTrips) {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float v = E4M3ToF32(code);
    const double want = ref::CodeValue(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    ++finite;
    EXPECT_EQ(static_cast<double>(v), want) << "code " << c;
    EXPECT_EQ(F32ToE4M3(v), code) << "code " << c;  // -0 keeps its sign: 0x80
  }
  EXPECT_EQ(finite, 254);
  EXPECT_EQ(E4M3ToF32(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToF32(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8Codes, RoundingTiesDenormalsSaturationAndNan) {
  std::vector<float> probes;
  // Every midpoint between adjacent codes (a tie), and the floats just around it.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = E4M3ToF32(static_cast<uint8_t>(c)),
                hi = E4M3ToF32(static_cast<uint8_t>(c + 1));
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);
    for (float v : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f), lo, hi}) {
      probes.push_back(v);
      probes.push_back(-v);
    }
  }
  // Saturation: 448 to 480 and beyond, infinities.
  for (float v : {447.9f, 448.f, 448.0001f, 455.f, 464.f, 464.01f, 479.99f, 480.f, 1e6f, 3.4e38f,
                  std::numeric_limits<float>::infinity()}) {
    probes.push_back(v);
    probes.push_back(-v);
  }
  // fp32 denormals and the bottom of the e4m3 range.
  for (float v : {std::numeric_limits<float>::denorm_min(), 1e-40f, 1e-38f, std::ldexp(1.f, -10),
                  std::nextafter(std::ldexp(1.f, -10), 1.f), std::ldexp(1.f, -11), 0.f, -0.f}) {
    probes.push_back(v);
    probes.push_back(-v);
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isfinite(f) && std::fabs(f) < 1e3f) probes.push_back(f);
    probes.push_back(std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng),
                                std::uniform_int_distribution<int>(-14, 10)(rng)));
  }
  int64_t mismatches = 0;
  for (float v : probes) {
    if (F32ToE4M3(v) != ref::Encode(v)) {
      if (++mismatches < 5)
        ADD_FAILURE() << "value " << v << " -> " << int(F32ToE4M3(v)) << ", reference "
                      << int(ref::Encode(v));
    }
  }
  EXPECT_EQ(mismatches, 0) << "over " << probes.size() << " values";
  EXPECT_EQ(F32ToE4M3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(F32ToE4M3(-std::numeric_limits<float>::quiet_NaN()), 0xff);
  EXPECT_EQ(F32ToE4M3(1.0625f), 0x38);  // tie between 1.0 (0x38) and 1.125 (0x39): even
  EXPECT_EQ(F32ToE4M3(1.1875f), 0x3a);  // tie between 1.125 (0x39) and 1.25 (0x3a): even
}

// Fills a matrix with one of several value patterns per 128 x 128 block.
std::vector<float> MakeMatrix(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  const int64_t nbc = Fp8Blocks(cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t block = (r / kFp8Block) * nbc + c / kFp8Block;
      uint64_t h = (seed * 1000003 + block) * 0x9E3779B97F4A7C15ull;
      h ^= h >> 29;
      const int kind = static_cast<int>(h % 8);
      float v = 0;
      switch (kind) {
        case 0:  // weights as trained
          v = std::normal_distribution<float>(0.f, 0.02f)(rng);
          break;
        case 1:  // all zero: the 1e-4 floor
          v = 0.f;
          break;
        case 2:  // below the floor, into fp32 denormals
          v = std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng),
                         std::uniform_int_distribution<int>(-140, -14)(rng));
          break;
        case 3:  // amax 448: scale 1, so values land on e4m3 midpoints (ties)
          v = (r + c) % 17 == 0 ? 448.f
                                : E4M3ToF32(static_cast<uint8_t>(rng() % 0x7e)) * 0.5f +
                                      E4M3ToF32(static_cast<uint8_t>(rng() % 0x7e)) * 0.5f;
          break;
        case 4:  // wide dynamic range
          v = std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng),
                         std::uniform_int_distribution<int>(-30, 20)(rng));
          break;
        case 5:  // one dominant value per block
          v = (r % kFp8Block == 3 && c % kFp8Block == 5) ? -7.5f
                                                         : std::normal_distribution<float>()(rng);
          break;
        case 6:  // small integers: exact products
          v = static_cast<float>(static_cast<int>(rng() % 33) - 16);
          break;
        default: {  // next to e4m3 rounding boundaries for a scale that is not a power of two:
                    // x * (1/scale) and x / scale round differently here
          const float amax =
              std::ldexp(1.f + static_cast<float>(h % 1000) / 1000.f, static_cast<int>(h % 9) - 4);
          if (r % kFp8Block == 0 && c % kFp8Block == 0) {
            v = amax;
            break;
          }
          const float scale = amax / 448.f;
          const uint8_t code = static_cast<uint8_t>(rng() % 0x7d);
          const float mid = (E4M3ToF32(code) + E4M3ToF32(code + 1)) / 2;
          v = mid * scale;
          for (int k = static_cast<int>(rng() % 3); k > 0; --k) v = std::nextafter(v, 1e9f);
          if (rng() & 1) v = -v;
          break;
        }
      }
      x[r * cols + c] = v;
    }
  }
  return x;
}

void ExpectSameAsReference(const std::vector<float>& x, int64_t rows, int64_t cols,
                           int64_t* blocks_checked) {
  const ref::Quantized want = ref::QuantizeMatrix(x.data(), rows, cols);
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(want.scales.size());
  const int64_t bad = Fp8QuantizeMatrix(x.data(), rows, cols, q.data(), s.data());
  EXPECT_EQ(bad, want.nonfinite);
  int64_t byte_mismatches = 0, scale_mismatches = 0;
  for (size_t i = 0; i < q.size(); ++i) byte_mismatches += q[i] != want.q[i];
  for (size_t i = 0; i < s.size(); ++i)
    scale_mismatches += ref::Bits(s[i]) != ref::Bits(want.scales[i]);
  EXPECT_EQ(byte_mismatches, 0) << rows << "x" << cols;
  EXPECT_EQ(scale_mismatches, 0) << rows << "x" << cols;
  *blocks_checked += static_cast<int64_t>(s.size());
}

TEST(Fp8Quantize, MatchesTheReferenceOnManyBlocksAndShapes) {
  int64_t blocks = 0;
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},     {7, 300},   {128, 128}, {129, 127},
                                                {256, 384}, {300, 100}, {640, 512}, {1000, 260}};
  uint64_t seed = 1;
  for (auto [rows, cols] : shapes) {
    for (int rep = 0; rep < 2; ++rep) {
      ExpectSameAsReference(MakeMatrix(rows, cols, seed++), rows, cols, &blocks);
    }
  }
  EXPECT_GT(blocks, 100);
}

TEST(Fp8Quantize, ZeroBlockUsesTheFloorAndNonFiniteBlocksAreNan) {
  std::vector<float> x(128 * 256, 0.f);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[300] = std::numeric_limits<float>::infinity();  // same block (row 2)
  std::vector<uint8_t> q(x.size());
  float s[2];
  // Block 1 (columns 128..255) is all zero: scale 1e-4 / 448, every byte 0.
  EXPECT_EQ(Fp8QuantizeMatrix(x.data(), 128, 256, q.data(), s), 2);
  EXPECT_TRUE(std::isnan(s[0]));
  EXPECT_EQ(ref::Bits(s[1]), ref::Bits(1e-4f / 448.f));
  for (int64_t r = 0; r < 128; ++r) {
    EXPECT_EQ(q[r * 256], 0x7f);
    EXPECT_EQ(q[r * 256 + 200], 0x00);
  }
  int64_t blocks = 0;
  ExpectSameAsReference(x, 128, 256, &blocks);
}

TEST(Fp8Quantize, HalfPrecisionInputsConvertExactly) {
  const int64_t rows = 200, cols = 150;
  const auto x = MakeMatrix(rows, cols, 99);
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> h(x.size());
    std::vector<float> widened(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      h[i] = t == DType::kBF16 ? F32ToBF16(x[i]) : F32ToF16(x[i]);
      widened[i] = t == DType::kBF16 ? BF16ToF32(h[i]) : F16ToF32(h[i]);
    }
    const ref::Quantized want = ref::QuantizeMatrix(widened.data(), rows, cols);
    std::vector<uint8_t> q(x.size());
    int64_t bad = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += 128) {
      for (int64_t c0 = 0; c0 < cols; c0 += 128) {
        const float s = Fp8QuantizeBlock(
            h.data() + r0 * cols + c0, t, cols, std::min<int64_t>(128, rows - r0),
            std::min<int64_t>(128, cols - c0), q.data() + r0 * cols + c0, cols, &bad);
        EXPECT_EQ(ref::Bits(s), ref::Bits(want.scales[(r0 / 128) * 2 + c0 / 128]));
      }
    }
    EXPECT_EQ(q, want.q) << DTypeName(t);
  }
}

TEST(Fp8QuantizePack, WireLayoutAndChecksumOfAStridedRegion) {
  // A trainer shard [300, 400] f32; the op quantizes rows [128, 300) x cols [256, 400) (a block
  // aligned origin, partial last blocks) at wire offset 4096.
  const int64_t R = 300, C = 400;
  const auto x = MakeMatrix(R, C, 7);
  PackRegion pr;
  pr.base = x.data();
  pr.dtype = DType::kF32;
  pr.shape = {R, C};
  pr.region = Region::Make({128, 256}, {172, 144});
  pr.wire_offset = 4096;
  std::vector<float> sub(172 * 144);
  for (int64_t r = 0; r < 172; ++r) {
    for (int64_t c = 0; c < 144; ++c) sub[r * 144 + c] = x[(128 + r) * C + 256 + c];
  }
  const ref::Quantized want = ref::QuantizeMatrix(sub.data(), 172, 144);
  const int64_t bytes = Fp8WireBytes(172, 144);
  ASSERT_EQ(bytes, 172 * 144 + 2 * 2 * 4);  // 24768 is a multiple of 8; 4 scales = 16 bytes
  std::vector<uint8_t> wire(bytes, 0xcc);
  auto res = Fp8QuantizePack(pr, wire.data());
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->nonfinite, 0);
  EXPECT_TRUE(std::equal(want.q.begin(), want.q.end(), wire.begin()));
  for (size_t i = 0; i < want.scales.size(); ++i) {
    float s;
    std::memcpy(&s, wire.data() + 172 * 144 + 4 * i, 4);
    EXPECT_EQ(ref::Bits(s), ref::Bits(want.scales[i]));
  }
  EXPECT_EQ(res->sum, ChecksumPartial(wire.data(), wire.size(), 4096));

  // A ragged op (odd element count) pads both sections with zeros.
  pr.region = Region::Make({256, 128}, {44, 5});
  std::vector<uint8_t> wire2(Fp8WireBytes(44, 5), 0xcc);
  ASSERT_EQ(wire2.size(), 224u + 8u);
  res = Fp8QuantizePack(pr, wire2.data());
  ASSERT_TRUE(res.ok());
  EXPECT_EQ(wire2[220], 0);
  EXPECT_EQ(wire2[228], 0);
  EXPECT_EQ(res->sum, ChecksumPartial(wire2.data(), wire2.size(), 4096));
}

TEST(Fp8QuantizePack, ThreeDimensionalSliceAndBf16) {
  // An expert stack [3, 256, 128] bf16; quantize expert 2, rows [128, 256).
  std::vector<uint16_t> h(3 * 256 * 128);
  std::mt19937 rng(3);
  for (auto& v : h) v = F32ToBF16(std::normal_distribution<float>(0, 1)(rng));
  PackRegion pr;
  pr.base = h.data();
  pr.dtype = DType::kBF16;
  pr.shape = {3, 256, 128};
  pr.region = Region::Make({2, 128, 0}, {1, 128, 128});
  std::vector<float> sub(128 * 128);
  for (int64_t i = 0; i < 128 * 128; ++i) sub[i] = BF16ToF32(h[2 * 256 * 128 + 128 * 128 + i]);
  const ref::Quantized want = ref::QuantizeMatrix(sub.data(), 128, 128);
  std::vector<uint8_t> wire(Fp8WireBytes(128, 128));
  auto res = Fp8QuantizePack(pr, wire.data());
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_TRUE(std::equal(want.q.begin(), want.q.end(), wire.begin()));
  EXPECT_EQ(res->sum, ChecksumPartial(wire.data(), wire.size(), 0));
}

TEST(Fp8QuantizePack, RefusesBadInput) {
  std::vector<float> x(64);
  PackRegion pr;
  pr.base = x.data();
  pr.dtype = DType::kI32;
  pr.shape = {8, 8};
  pr.region = Region::Full(pr.shape);
  std::vector<uint8_t> out(Fp8WireBytes(8, 8));
  EXPECT_EQ(Fp8QuantizePack(pr, out.data()).status().code(), StatusCode::kInvalidArgument);
  pr.dtype = DType::kF32;
  pr.wire_offset = 4;
  EXPECT_EQ(Fp8QuantizePack(pr, out.data()).status().code(), StatusCode::kInvalidArgument);
  pr.wire_offset = 0;
  pr.region = Region::Make({0, 0}, {9, 8});
  EXPECT_EQ(Fp8QuantizePack(pr, out.data()).status().code(), StatusCode::kInvalidArgument);
}

TEST(Fp8Dequantize, MultipliesEachBlockByItsScale) {
  const auto x = MakeMatrix(130, 140, 11);
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(4), back(x.size());
  Fp8QuantizeMatrix(x.data(), 130, 140, q.data(), s.data());
  Fp8DequantizeMatrix(q.data(), s.data(), 130, 140, back.data());
  for (int64_t r = 0; r < 130; ++r) {
    for (int64_t c = 0; c < 140; ++c) {
      const float scale = s[(r / 128) * 2 + c / 128];
      EXPECT_EQ(back[r * 140 + c], E4M3ToF32(q[r * 140 + c]) * scale);
      // Within half an e4m3 step (relative 1/16) of the input, or of the block's floor.
      EXPECT_LE(std::fabs(back[r * 140 + c] - x[r * 140 + c]),
                std::fabs(x[r * 140 + c]) / 16 + scale * std::ldexp(1.f, -9))
          << r << "," << c;
    }
  }
}

}  // namespace
}  // namespace shardsync

namespace shardsync {
namespace {

// The CPU quantizer's branch-free conversion (common/fp8_lane.h) equals the definition on every
// bf16 value (every sign, exponent and the top 7 mantissa bits), on every fp32 whose low 16 bits
// are a few rounding-sensitive patterns, and on a million random fp32 bit patterns.
TEST(Fp8Codes, BranchFreeLaneEqualsTheDefinition) {
  auto check = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    ASSERT_EQ(E4M3Lane(f), F32ToE4M3(f)) << std::hex << "bits 0x" << u;
  };
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      check(hi << 16 | lo);
    }
  }
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 1000000; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    check(static_cast<uint32_t>(x));
  }
}

}  // namespace
}  // namespace shardsync
