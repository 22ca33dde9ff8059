// The host kernels on the sync path (the vectorized checksum in src/common/checksum.cc and the
// packer's fp32 -> bf16 cast) against their scalar definitions in checksum.h and dtype.h, bit for
// bit, on random sizes, offsets and bit patterns (NaN, Inf and denormals included).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "common/cast.h"
#include "shardsync/checksum.h"
#include "shardsync/dtype.h"

namespace shardsync {
namespace {

// checksum.h's definition, one word at a time.
uint64_t ReferencePartial(const unsigned char* p, size_t n, uint64_t byte_offset) {
  uint64_t sum = 0;
  for (size_t at = 0; at < n; at += 8) {
    uint64_t w = 0;
    std::memcpy(&w, p + at, std::min<size_t>(8, n - at));
    sum += ChecksumMixWord(w, byte_offset / 8 + at / 8);
  }
  return sum;
}

TEST(HostKernels, ChecksumMatchesTheDefinitionOnRandomSizesAndOffsets) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> buf(3 << 20);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const size_t sizes[] = {0,
                          1,
                          7,
                          8,
                          9,
                          63,
                          64,
                          127,
                          128,
                          129,
                          1000,
                          1024,
                          1031,
                          4096 + 5,
                          65536,
                          (1 << 20) + 3,
                          (3 << 20) - 64};
  for (size_t n : sizes) {
    for (int k = 0; k < 4; ++k) {
      const size_t start = n >= buf.size() ? 0 : rng() % (buf.size() - n + 1);
      const uint64_t off = 8 * (rng() % (1u << 30));  // word index keys far from zero too
      EXPECT_EQ(ChecksumPartial(buf.data() + start, n, off),
                ReferencePartial(buf.data() + start, n, off))
          << "n=" << n << " start=" << start << " offset=" << off;
    }
  }
  // Whole-buffer form and the stream over random splits agree with it.
  const uint64_t whole = ChecksumFinish(ReferencePartial(buf.data(), buf.size(), 0), buf.size());
  EXPECT_EQ(Checksum(buf.data(), buf.size()), whole);
  ChecksumStream cs;
  for (size_t at = 0; at < buf.size();) {
    const size_t n = std::min<size_t>(buf.size() - at, 1 + rng() % 300000);
    cs.Update(buf.data() + at, n);
    at += n;
  }
  EXPECT_EQ(cs.Finish(), whole);
}

TEST(HostKernels, CopyWithChecksumCopiesAndMatchesTheDefinition) {
  std::mt19937_64 rng(11);
  std::vector<unsigned char> src(1 << 20), dst(1 << 20);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  for (size_t n : {size_t{0}, size_t{5}, size_t{64}, size_t{127}, size_t{128}, size_t{129},
                   size_t{1000}, size_t{4096 + 13}, size_t{(1 << 20) - 96}}) {
    for (int k = 0; k < 4; ++k) {
      const size_t from = rng() % (src.size() - n + 1), to = rng() % (dst.size() - n + 1);
      const uint64_t off = 8 * (rng() % (1u << 30));
      std::fill(dst.begin(), dst.end(), 0xEE);
      const uint64_t got = CopyWithChecksumPartial(dst.data() + to, src.data() + from, n, off);
      EXPECT_EQ(got, ReferencePartial(src.data() + from, n, off)) << "n=" << n;
      EXPECT_EQ(std::memcmp(dst.data() + to, src.data() + from, n), 0) << "n=" << n;
      // Nothing outside [to, to + n) is written.
      const auto untouched = std::count(dst.begin(), dst.begin() + to, 0xEE) +
                             std::count(dst.begin() + to + n, dst.end(), 0xEE);
      EXPECT_EQ(untouched, static_cast<long>(dst.size() - n)) << "n=" << n;
    }
  }
}

TEST(HostKernels, Fp32ToBf16CastMatchesF32ToBF16BitForBit) {
  std::mt19937 rng(11);
  const size_t n = (1 << 18) + 13;
  std::vector<uint32_t> in(n + 1);
  for (auto& x : in) x = rng();
  // Specials: +-0, +-Inf, quiet and signalling NaNs, denormals, rounding ties.
  const uint32_t special[] = {0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000,
                              0x7f800001, 0xffbfffff, 0x00000001, 0x807fffff, 0x3f808000,
                              0x3f818000, 0x7f7fffff, 0x477f8000};
  for (size_t i = 0; i < std::size(special); ++i) in[i * 37] = special[i];
  for (size_t start : {size_t{0}, size_t{1}}) {  // aligned and unaligned source
    for (size_t len : {n, size_t{15}, size_t{16}, size_t{17}, size_t{1000}}) {
      std::vector<uint16_t> out(len, 0xDEAD);
      CastInto(in.data() + start, DType::kF32, out.data(), DType::kBF16, static_cast<int64_t>(len));
      for (size_t i = 0; i < len; ++i) {
        float f;
        std::memcpy(&f, &in[start + i], 4);
        ASSERT_EQ(out[i], F32ToBF16(f)) << "element " << i << " bits " << std::hex << in[start + i];
      }
    }
  }
}

TEST(HostKernels, FusedCastAndChecksumMatchTheDefinitions) {
  std::mt19937 rng(13);
  std::vector<uint32_t> in(100003);
  for (auto& x : in) x = rng();
  in[5] = 0x7fc00001;   // NaN
  in[77] = 0xff800000;  // -Inf
  for (size_t n : {size_t{0}, size_t{15}, size_t{16}, size_t{33}, size_t{4096}, in.size()}) {
    for (uint64_t word : {uint64_t{0}, uint64_t{12345}, uint64_t{1} << 40}) {
      std::vector<uint16_t> out(n, 0xDEAD);
      uint64_t sum = 7;  // added to, not overwritten
      const int64_t k =
          CastF32ToBF16WithSum(in.data(), out.data(), static_cast<int64_t>(n), word, &sum);
      ASSERT_GE(k, 0);
      ASSERT_LE(k, static_cast<int64_t>(n));
      EXPECT_EQ(k % 16, 0);
      for (int64_t i = 0; i < k; ++i) {
        float f;
        std::memcpy(&f, &in[i], 4);
        ASSERT_EQ(out[i], F32ToBF16(f)) << "element " << i;
      }
      for (size_t i = k; i < n; ++i) EXPECT_EQ(out[i], 0xDEAD) << "wrote past k at " << i;
      EXPECT_EQ(sum - 7, ReferencePartial(reinterpret_cast<const unsigned char*>(out.data()),
                                          static_cast<size_t>(k) * 2, word * 8))
          << "n=" << n << " word=" << word;
#if defined(__x86_64__)
      if (__builtin_cpu_supports("avx2")) {
        EXPECT_EQ(k, static_cast<int64_t>(n & ~size_t{15}));
      }
#endif
    }
  }
}

}  // namespace
}  // namespace shardsync
