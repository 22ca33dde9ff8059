// Layout of the shm transport's segments (shm.cc): a header, a table of the ranks that send
// here, and one single-producer / single-consumer ring per sender; and the copies into and out of
// ring slots with the checksum fused into them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "shardsync/checksum.h"
#include "shardsync/transport.h"

namespace shardsync::shm {

inline constexpr uint64_t kMagic = 0x3147'4e49'5253'5353ull;  // "SSSRING1"
// 16 x 64 KiB per pair: measured on the 2-core VM (4 pairs, fused checksums both ends), 64 KiB
// slots beat 128 KiB - 1 MiB ones by 7-18 %: the ring stays in L2 while both ends work on it.
inline constexpr uint64_t kSlotBytes = uint64_t{64} << 10;
inline constexpr uint64_t kSlots = 16;
// Largest message a receiver buffers before its receive is posted (a corrupt length must not
// become an allocation of any size).
inline constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 40;

struct SlotHeader {
  uint64_t tag;
  uint64_t msg_bytes;
  uint64_t frag_offset;
  uint64_t frag_bytes;
};

// head: slots the sender published; tail: slots the receiver released. The closed flags are set
// by each side's transport when it is destroyed or aborted.
struct alignas(64) RingCtl {
  std::atomic<uint64_t> head;
  char pad0[56];
  std::atomic<uint64_t> tail;
  char pad1[56];
  std::atomic<uint32_t> sender_closed;
  std::atomic<uint32_t> receiver_closed;
  char pad2[56];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
inline constexpr uint64_t kSlotStride = 64 + kSlotBytes;  // header padded to a cache line
inline constexpr uint64_t kRingBytes = sizeof(RingCtl) + kSlots * kSlotStride;

struct SegHeader {
  uint64_t magic;
  uint64_t rings;
  uint64_t ring_bytes;
  int64_t owner_rank;
  char pad[32];
};
static_assert(sizeof(SegHeader) == 64);

inline uint64_t TableBytes(uint64_t rings) { return (rings * 8 + 63) / 64 * 64; }
inline uint64_t SegmentBytes(uint64_t rings) {
  return sizeof(SegHeader) + TableBytes(rings) + rings * kRingBytes;
}
inline RingCtl* RingAt(char* seg, uint64_t rings, uint64_t i) {
  return reinterpret_cast<RingCtl*>(seg + sizeof(SegHeader) + TableBytes(rings) + i * kRingBytes);
}
inline char* SlotAt(RingCtl* ring, uint64_t seq) {
  return reinterpret_cast<char*>(ring) + sizeof(RingCtl) + (seq % kSlots) * kSlotStride;
}

// Copies message bytes [a, b) (dst and src point at offset a), adding the whole words of the
// message (SummedHead/SummedTail of `sum->key`) that lie inside [a, b) into `sum` from the
// copy's own loads; a word that starts here and ends in a later fragment goes to `straddles`.
inline void CopyFragment(char* dst, const char* src, uint64_t a, uint64_t b, uint64_t msg_bytes,
                         CopySum* sum, std::vector<uint64_t>& straddles) {
  if (sum == nullptr) {
    std::memcpy(dst, src, b - a);
    return;
  }
  const uint64_t h = SummedHead(sum->key, msg_bytes), t = SummedTail(sum->key, msg_bytes);
  const uint64_t s = std::max(a, h) <= h ? h : h + (std::max(a, h) - h + 7) / 8 * 8;
  const uint64_t lim = std::min(b, t);
  const uint64_t e = lim <= s ? s : h + (lim - h) / 8 * 8;
  if (e > s) {
    std::memcpy(dst, src, s - a);
    sum->sum += CopyWithChecksumPartial(dst + (s - a), src + (s - a), e - s, sum->key + s);
    std::memcpy(dst + (e - a), src + (e - a), b - e);
  } else {
    std::memcpy(dst, src, b - a);
  }
  if (e < b && e + 8 <= t) straddles.push_back(e);
}

// The straddling words, read from the message's whole image once every byte is in place.
inline void FinishSum(const char* image, CopySum* sum, std::vector<uint64_t>& straddles) {
  if (sum == nullptr) return;
  for (uint64_t w : straddles) sum->sum += ChecksumPartial(image + w, 8, sum->key + w);
  straddles.clear();
}

}  // namespace shardsync::shm
