// The delta codec's size rule (delta.h "The size rule") as one inline function that host and
// device code both compile: DeltaEncodedBytes (delta.cc) and the device encoder's form choice
// (delta_gpu.h) call this, so there is one rule, not two.
#pragma once

#include <cstdint>

#include "shardsync/checksum.h"  // SHARDSYNC_HD
#include "shardsync/delta.h"

namespace shardsync {

// The index form names each change by its tile (kDeltaTileBytes of the bucket: 16384 / e
// elements) and its element within the tile (u16): per tile, a u32 with the changes up to and
// including that tile (a running count), then a u16 per change, then the values (delta.h "Encoded
// form"). The tile is the device codec's tile, so a tile's changes are one contiguous run for it.
inline constexpr uint64_t kDeltaTileBytes = 16384;

SHARDSYNC_HD uint64_t DeltaBitmapBytes(uint64_t elements) { return (elements + 7) / 8; }

// The index form's payload (after the header): `ends` at 0 (u32 per tile), the u16 offsets at
// `offsets`, zero padding to a multiple of 4, the values at `values`; `bytes` in all.
struct DeltaIndexLayout {
  uint64_t tiles = 0;       // ceil(elements / tile elements)
  uint64_t tile_elems = 0;  // kDeltaTileBytes / element size
  uint64_t offsets = 0;     // 4 x tiles
  uint64_t values = 0;      // offsets + 2 x changed, rounded up to a multiple of 4
  uint64_t bytes = 0;       // values + changed x element size
};
SHARDSYNC_HD DeltaIndexLayout DeltaIndexPayload(uint64_t elements, uint64_t element_size,
                                                uint64_t changed) {
  DeltaIndexLayout l;
  // An element size the codec refuses (not 1, 2 or 4) gets no tiles rather than a division by 0.
  l.tile_elems = element_size == 0 ? 0 : kDeltaTileBytes / element_size;
  l.tiles = l.tile_elems == 0 ? 0 : (elements + l.tile_elems - 1) / l.tile_elems;
  l.offsets = 4 * l.tiles;
  l.values = (l.offsets + 2 * changed + 3) / 4 * 4;
  l.bytes = l.values + changed * element_size;
  return l;
}

// The packed form (delta.h "Encoded form"): a change named by its 128-element subtile (a u8 count
// per subtile) and its element within it (u8), its value one byte: the new byte for a byte image,
// for 2-byte elements the difference new - old of the bit patterns when it lies in [-127, 127],
// else kDeltaEscape and the new value in the escapes (a u16 each). A u32 per tile with the changes
// up to and including it, for 2-byte elements a second one with the escapes.
inline constexpr uint64_t kDeltaSubtileElems = 128;
inline constexpr uint8_t kDeltaEscape = 0x80;

// Whether a 2-byte change from `old_bits` to `new_bits` is escaped (its difference out of a byte).
SHARDSYNC_HD bool DeltaEscaped(uint32_t old_bits, uint32_t new_bits) {
  const int32_t d = static_cast<int16_t>(static_cast<uint16_t>(new_bits - old_bits));
  return d < -127 || d > 127;
}
// The value byte of a 2-byte change that is not escaped.
SHARDSYNC_HD uint8_t DeltaByte(uint32_t old_bits, uint32_t new_bits) {
  return static_cast<uint8_t>(new_bits - old_bits);
}

// The packed form's payload (after the header): `ends` at 0 (u32 per tile), for element size 2
// the escape running counts at `escape_ends` (u32 per tile), the subtile counts at `subs` (u8 per
// subtile), the offsets at `offsets` and the value bytes at `values` (u8 per change), for element
// size 2 a zero byte when needed to reach an even offset, then the escapes at `escapes` (u16
// each); `bytes` in all. Element size 1 has no escape counts and no escapes (its value byte is
// the new byte).
struct DeltaPackedLayout {
  uint64_t tiles = 0, tile_elems = 0, subtiles = 0;
  uint64_t escape_ends = 0, subs = 0, offsets = 0, values = 0, escapes = 0, bytes = 0;
};
SHARDSYNC_HD DeltaPackedLayout DeltaPackedPayload(uint64_t elements, uint64_t element_size,
                                                  uint64_t changed, uint64_t escapes) {
  DeltaPackedLayout l;
  l.tile_elems = element_size == 0 ? 0 : kDeltaTileBytes / element_size;
  l.tiles = l.tile_elems == 0 ? 0 : (elements + l.tile_elems - 1) / l.tile_elems;
  l.subtiles = (elements + kDeltaSubtileElems - 1) / kDeltaSubtileElems;
  const bool wide = element_size == 2;
  l.escape_ends = 4 * l.tiles;
  l.subs = (wide ? 8 : 4) * l.tiles;
  l.offsets = l.subs + l.subtiles;
  l.values = l.offsets + changed;
  l.escapes = wide ? (l.values + changed + 1) / 2 * 2 : l.values + changed;
  l.bytes = l.escapes + (wide ? 2 * escapes : 0);
  return l;
}

// Whether the packed form may carry `changed` changes: element size 1 or 2, and the index form
// no larger than the bitmap form (so a delta's changes stay under 1/16 of its elements: the
// encoders keep records up to there, the device decoder expands them into its scratch).
SHARDSYNC_HD bool DeltaPackedAllowed(uint64_t elements, uint64_t element_size, uint64_t changed) {
  return (element_size == 1 || element_size == 2) && changed <= elements &&
         DeltaIndexPayload(elements, element_size, changed).values <= DeltaBitmapBytes(elements);
}

// Every form carries the changes; they differ in how positions and values are named. `changed`
// is clamped to `elements`; `escapes` (the 2-byte changes whose difference is out of a byte,
// DeltaEscaped) counts only for element size 2 and is clamped to `changed`. The smallest form
// wins, ties to the index form, then packed. An element size other than 1, 2 or 4 (refused by
// every caller) gives kFull with 0 bytes.
SHARDSYNC_HD DeltaSize DeltaSizeRule(uint64_t elements, uint64_t element_size, uint64_t changed,
                                     uint64_t escapes = 0) {
  if (element_size != 1 && element_size != 2 && element_size != 4) return {};  // no delta form
  const uint64_t full = elements * element_size;
  if (changed > elements) changed = elements;
  if (element_size != 2) escapes = 0;
  if (escapes > changed) escapes = changed;
  const uint64_t index_bytes = DeltaIndexPayload(elements, element_size, changed).bytes;
  const uint64_t bitmap_bytes = DeltaBitmapBytes(elements) + changed * element_size;
  DeltaKind kind = index_bytes <= bitmap_bytes ? DeltaKind::kIndex : DeltaKind::kBitmap;
  uint64_t payload = kind == DeltaKind::kIndex ? index_bytes : bitmap_bytes;
  if (DeltaPackedAllowed(elements, element_size, changed)) {
    const uint64_t packed = DeltaPackedPayload(elements, element_size, changed, escapes).bytes;
    if (packed < payload) {
      kind = DeltaKind::kPacked;
      payload = packed;
    }
  }
  const uint64_t bytes = kDeltaHeaderBytes + payload;
  DeltaSize s;
  if (bytes >= full) {
    s.kind = DeltaKind::kFull;
    s.bytes = full;
  } else {
    s.kind = kind;
    s.bytes = bytes;
  }
  return s;
}

}  // namespace shardsync
