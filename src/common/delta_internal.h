// The delta codec's shared pieces (delta.h: the format; delta.cc decodes, delta_encode.cc
// encodes): constants of the format, element access, and the per-word change masks. Internal to
// the library.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "shardsync/delta.h"
#include "shardsync/status.h"

namespace shardsync::delta_internal {

inline constexpr uint32_t kMagic = 0x4C445353;  // "SSDL" little-endian
inline constexpr uint8_t kFormat = 3;
inline constexpr size_t kChunk = size_t{64} << 10;  // checksum + diff chunk: both stay in L2

inline bool ValidElementSize(int e) { return e == 1 || e == 2 || e == 4; }

inline uint64_t BitmapBytes(uint64_t elements) { return (elements + 7) / 8; }

// SWAR popcount: the build targets baseline x86-64 (no POPCNT), where std::popcount is a call
// into libgcc (4% of a decode's samples in perf).
inline uint64_t Popcount64(uint64_t x) {
  x -= (x >> 1) & 0x5555555555555555ull;
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
  return (x * 0x0101010101010101ull) >> 56;
}

template <typename T>
inline void Put(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
inline T Get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The element as an unsigned integer: every hot loop is instantiated per element size so the
// compares and copies are single loads / stores, not calls to memcpy.
template <int E>
using Elem = std::conditional_t<E == 1, uint8_t, std::conditional_t<E == 2, uint16_t, uint32_t>>;

// Bit k set when element k of the 8-byte word d = base ^ new is nonzero (changed); branch free
// (SWAR: a lane's top bit after adding 0x7f.. to its low bits is set iff the lane is nonzero).
template <int E>
inline unsigned ChangedMask(uint64_t d) {
  if constexpr (E == 1) {
    const uint64_t t =
        (((d & 0x7F7F7F7F7F7F7F7Full) + 0x7F7F7F7F7F7F7F7Full) | d) & 0x8080808080808080ull;
    return static_cast<unsigned>(((t >> 7) * 0x0102040810204080ull) >> 56);  // gather bit 8k -> k
  } else if constexpr (E == 2) {
    const uint64_t t =
        (((d & 0x7FFF7FFF7FFF7FFFull) + 0x7FFF7FFF7FFF7FFFull) | d) & 0x8000800080008000ull;
    return static_cast<unsigned>((t >> 15 & 1) | (t >> 30 & 2) | (t >> 45 & 4) | (t >> 60 & 8));
  } else {
    return unsigned{static_cast<uint32_t>(d) != 0} | unsigned{(d >> 32) != 0} << 1;
  }
}

// Calls f(element index) for every element of [begin, end) (byte offsets, element aligned) that
// differs, comparing 8 bytes at a time first: at RL densities most words are equal.
template <int E, typename F>
inline void ForEachChanged(const std::byte* base, const std::byte* next, size_t begin, size_t end,
                           F&& f) {
  size_t o = begin;
  for (; o + 8 <= end; o += 8) {
    const uint64_t d = Get<uint64_t>(base + o) ^ Get<uint64_t>(next + o);
    if (d == 0) continue;
    for (unsigned m = ChangedMask<E>(d); m != 0; m &= m - 1) f(o / E + std::countr_zero(m));
  }
  for (; o < end; o += E)
    if (Get<Elem<E>>(base + o) != Get<Elem<E>>(next + o)) f(o / E);
}

// The packed form's positions checked in the decoder's order (delta_positions.cc): OK, or
// DataLoss naming `bucket` and the first fault. `offs` (info.changed u16): each change's element
// within its tile, as the index form names it, written as the records are checked.
Status PackedPositions(const DeltaInfo& info, const std::byte* payload, std::string_view bucket,
                       uint16_t* offs);

}  // namespace shardsync::delta_internal
