// AVX2 form of the shardsync checksum's per-word term (checksum.h ChecksumMixWord), four words
// per vector, for the checksum and the fused cast + checksum. Internal to the library.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include "shardsync/checksum.h"

namespace shardsync::internal {

// MixWord terms of four words given their keys (index * step + seed): (w ^ key) * kChecksumMul,
// then t ^ (t >> 32). AVX2 has no 64-bit multiply: three 32x32->64 multiplies give the same low
// 64 bits (a*b mod 2^64 = lo*lo + ((lo*hi + hi*lo) << 32)).
__attribute__((target("avx2"))) inline __m256i ChecksumTermsAvx2(__m256i words, __m256i keys) {
  const __m256i a = _mm256_xor_si256(words, keys);
  const __m256i lo_m = _mm256_set1_epi64x(kChecksumMul & 0xffffffffull);
  const __m256i hi_m = _mm256_set1_epi64x(kChecksumMul >> 32);
  const __m256i ll = _mm256_mul_epu32(a, lo_m);
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(a, hi_m), _mm256_mul_epu32(_mm256_srli_epi64(a, 32), lo_m));
  const __m256i t = _mm256_add_epi64(ll, _mm256_slli_epi64(cross, 32));
  return _mm256_xor_si256(t, _mm256_srli_epi64(t, 32));
}

// Keys of words j .. j+3 in lanes 0..3.
__attribute__((target("avx2"))) inline __m256i ChecksumKeysAvx2(uint64_t j) {
  return _mm256_set_epi64x(static_cast<long long>((j + 3) * kChecksumStep + kChecksumSeed),
                           static_cast<long long>((j + 2) * kChecksumStep + kChecksumSeed),
                           static_cast<long long>((j + 1) * kChecksumStep + kChecksumSeed),
                           static_cast<long long>(j * kChecksumStep + kChecksumSeed));
}

// Sum of the four lanes.
__attribute__((target("avx2"))) inline uint64_t HorizontalSumAvx2(__m256i v) {
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

}  // namespace shardsync::internal
#endif
