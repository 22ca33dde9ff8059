#include "shardsync/checksum.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace shardsync {
namespace {

std::vector<unsigned char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(Checksum, StreamingMatchesOneShotForAnySplit) {
  for (size_t n : {0ul, 1ul, 7ul, 8ul, 9ul, 63ul, 1000ul, 4099ul}) {
    auto data = RandomBytes(n, static_cast<uint32_t>(n));
    const uint64_t want = Checksum(data.data(), n);
    for (size_t chunk : {1ul, 3ul, 8ul, 13ul, 4096ul}) {
      ChecksumStream s;
      for (size_t off = 0; off < n; off += chunk)
        s.Update(data.data() + off, std::min(chunk, n - off));
      EXPECT_EQ(s.Finish(), want) << "n=" << n << " chunk=" << chunk;
    }
  }
}

TEST(Checksum, PartialSumsOfAlignedChunksAdd) {
  auto data = RandomBytes(1003, 1);
  uint64_t sum =
      ChecksumPartial(data.data(), 512, 0) + ChecksumPartial(data.data() + 512, 491, 512);
  EXPECT_EQ(ChecksumFinish(sum, 1003), Checksum(data.data(), 1003));
}

TEST(Checksum, DetectsBitFlipsSwapsAndTruncation) {
  auto data = RandomBytes(256, 2);
  const uint64_t base = Checksum(data.data(), data.size());
  for (size_t byte = 0; byte < data.size(); byte += 17) {
    for (int bit = 0; bit < 8; bit += 3) {
      auto d = data;
      d[byte] ^= static_cast<unsigned char>(1u << bit);
      EXPECT_NE(Checksum(d.data(), d.size()), base);
    }
  }
  auto swapped = data;
  std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 64);
  EXPECT_NE(Checksum(swapped.data(), swapped.size()), base);
  EXPECT_NE(Checksum(data.data(), data.size() - 1), base);
  std::vector<unsigned char> zeros(16, 0);
  EXPECT_NE(Checksum(zeros.data(), 8), Checksum(zeros.data(), 16));
}

}  // namespace
}  // namespace shardsync
