// The checksum of a bucket assembled from pieces that complete in any order (host send and
// receive paths).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "shardsync/checksum.h"

namespace shardsync::sync_internal {

// The checksum of one bucket's wire image (checksum.h) accumulated from runs that complete
// in any order at any byte offset: whole words are summed at once; words split between runs
// (or the zero-padded last word) are collected as byte pieces and mixed once complete.
class LandedSum {
 public:
  void Add(const unsigned char* p, size_t len, uint64_t off) {
    bytes_ += len;
    const size_t lead = off % 8;
    if (lead != 0 && len > 0) {
      const size_t n = std::min(len, 8 - lead);
      uint64_t w = 0;
      std::memcpy(&w, p, n);
      pieces_.emplace_back(off / 8, w << (8 * lead));
      p += n;
      off += n;
      len -= n;
    }
    const size_t whole = len & ~size_t{7};
    if (whole) sum_ += ChecksumPartial(p, whole, off);
    p += whole;
    off += whole;
    len -= whole;
    if (len > 0) {
      uint64_t w = 0;
      std::memcpy(&w, p, len);  // little-endian host, as in checksum.cc
      pieces_.emplace_back(off / 8, w);
    }
  }
  // A partial sum (checksum.h) of `len` bytes of whole words, computed elsewhere.
  void AddWords(uint64_t partial, size_t len) {
    sum_ += partial;
    bytes_ += len;
  }
  uint64_t bytes() const { return bytes_; }
  // Pieces of one word cover disjoint bytes, so OR assembles the word (missing bytes: zero).
  uint64_t Finish() {
    std::sort(pieces_.begin(), pieces_.end());
    uint64_t sum = sum_;
    for (size_t i = 0; i < pieces_.size();) {
      uint64_t w = 0;
      size_t j = i;
      for (; j < pieces_.size() && pieces_[j].first == pieces_[i].first; ++j)
        w |= pieces_[j].second;
      sum += ChecksumMixWord(w, pieces_[i].first);
      i = j;
    }
    return ChecksumFinish(sum, bytes_);
  }

 private:
  uint64_t sum_ = 0;
  uint64_t bytes_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> pieces_;  // (word index, bytes in place)
};

}  // namespace shardsync::sync_internal
