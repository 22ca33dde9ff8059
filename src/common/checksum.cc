#include "shardsync/checksum.h"

#include <cstring>

namespace shardsync {

uint64_t ChecksumPartial(const void* data, size_t nbytes, uint64_t byte_offset) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t j = byte_offset / 8;
  const size_t full = nbytes / 8;
  // Four independent accumulators let the multiplies overlap.
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  size_t i = 0;
  for (; i + 4 <= full; i += 4, j += 4) {
    uint64_t w0, w1, w2, w3;
    std::memcpy(&w0, p + 8 * i, 8);
    std::memcpy(&w1, p + 8 * i + 8, 8);
    std::memcpy(&w2, p + 8 * i + 16, 8);
    std::memcpy(&w3, p + 8 * i + 24, 8);
    s0 += ChecksumMixWord(w0, j);
    s1 += ChecksumMixWord(w1, j + 1);
    s2 += ChecksumMixWord(w2, j + 2);
    s3 += ChecksumMixWord(w3, j + 3);
  }
  for (; i < full; ++i, ++j) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);
    s0 += ChecksumMixWord(w, j);
  }
  const size_t tail = nbytes % 8;
  if (tail) {
    uint64_t w = 0;
    std::memcpy(&w, p + 8 * full, tail);  // little-endian host assumed (x86-64, aarch64)
    s0 += ChecksumMixWord(w, j);
  }
  return s0 + s1 + s2 + s3;
}

void ChecksumStream::Update(const void* data, size_t nbytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (nbytes > 0 && pending_len_ > 0) {
    pending_ |= static_cast<uint64_t>(*p) << (8 * pending_len_);
    ++p;
    --nbytes;
    ++bytes_;
    if (++pending_len_ == 8) {
      sum_ += ChecksumMixWord(pending_, (bytes_ - 8) / 8);
      pending_ = 0;
      pending_len_ = 0;
    }
  }
  if (nbytes == 0) return;
  const size_t whole = nbytes & ~size_t{7};
  sum_ += ChecksumPartial(p, whole, bytes_);
  bytes_ += whole;
  p += whole;
  nbytes -= whole;
  for (size_t k = 0; k < nbytes; ++k) {
    pending_ |= static_cast<uint64_t>(p[k]) << (8 * pending_len_);
    ++pending_len_;
    ++bytes_;
  }
}

uint64_t ChecksumStream::Finish() const {
  uint64_t s = sum_;
  if (pending_len_ > 0) s += ChecksumMixWord(pending_, bytes_ / 8);
  return ChecksumFinish(s, bytes_);
}

}  // namespace shardsync
