// The shardsync checksum: one 64-bit value per message, identical on CPU and GPU.
//
// Definition (byte-exact; the GPU kernels implement the same inline functions):
//   word_j  = little-endian uint64 of message bytes [8j, 8j+8), the last word zero-padded;
//   term_j  = MixWord(word_j, j)   (a bijection of word_j keyed by its position j);
//   sum     = sum of term_j mod 2^64;
//   value   = ChecksumFinish(sum, total_bytes).
// A flipped bit changes one term (MixWord is a bijection); a moved block changes the keys; a
// truncated message changes the length. Because the sum is order independent, any split of the
// message (threads, GPU blocks, packing chunks) gives the same value.
// Hand-written on purpose: xxhash/CRC are sequential over the stream, so a GPU cannot reproduce
// them with a parallel reduction bit for bit; this construction can.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define SHARDSYNC_HD __host__ __device__ __forceinline__
#else
#define SHARDSYNC_HD inline
#endif

namespace shardsync {

inline constexpr uint64_t kChecksumStep = 0x9E3779B97F4A7C15ull;  // golden ratio, odd
inline constexpr uint64_t kChecksumSeed = 0xD6E8FEB86659FD93ull;
inline constexpr uint64_t kChecksumMul = 0xFF51AFD7ED558CCDull;  // murmur3 fmix constant, odd

SHARDSYNC_HD uint64_t ChecksumMixWord(uint64_t word, uint64_t index) {
  uint64_t t = (word ^ (index * kChecksumStep + kChecksumSeed)) * kChecksumMul;
  return t ^ (t >> 32);
}

SHARDSYNC_HD uint64_t ChecksumFinish(uint64_t sum, uint64_t total_bytes) {
  uint64_t t = (sum ^ (total_bytes * kChecksumStep)) * kChecksumMul;
  t ^= t >> 29;
  t *= 0xC4CEB9FE1A85EC53ull;
  return t ^ (t >> 32);
}

// Partial sum over bytes [byte_offset, byte_offset + nbytes) of a message. byte_offset must be a
// multiple of 8; if nbytes is not, the last word is zero-padded (so only the final chunk of a
// message may have a ragged end). Partial sums of disjoint chunks add up (mod 2^64).
uint64_t ChecksumPartial(const void* data, size_t nbytes, uint64_t byte_offset);

// Copies nbytes from src to dst (not overlapping) and returns ChecksumPartial of those bytes,
// reading them once: the checksum terms come from the registers the copy loaded. Same
// byte_offset rule as ChecksumPartial.
uint64_t CopyWithChecksumPartial(void* dst, const void* src, size_t nbytes, uint64_t byte_offset);

// Checksum of one whole buffer.
inline uint64_t Checksum(const void* data, size_t nbytes) {
  return ChecksumFinish(ChecksumPartial(data, nbytes, 0), nbytes);
}

// Streaming form for chunks of any size and alignment, fed in message order.
class ChecksumStream {
 public:
  void Update(const void* data, size_t nbytes);
  // Sum so far including a zero-padded pending word; does not change the stream.
  uint64_t Finish() const;
  uint64_t bytes() const { return bytes_; }

 private:
  uint64_t sum_ = 0;
  uint64_t bytes_ = 0;
  uint64_t pending_ = 0;  // bytes of the current partial word, little-endian
  int pending_len_ = 0;
};

}  // namespace shardsync
