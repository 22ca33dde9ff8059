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

// Both forms carry the changed values; they differ in how positions are named. `changed` is
// clamped to `elements`. An element size other than 1, 2 or 4 (refused by every caller) gives
// kFull with 0 bytes.
SHARDSYNC_HD DeltaSize DeltaSizeRule(uint64_t elements, uint64_t element_size, uint64_t changed) {
  if (element_size != 1 && element_size != 2 && element_size != 4) return {};  // no delta form
  const uint64_t full = elements * element_size;
  if (changed > elements) changed = elements;
  const uint64_t index_bytes = DeltaIndexPayload(elements, element_size, changed).bytes;
  const uint64_t bitmap_bytes = DeltaBitmapBytes(elements) + changed * element_size;
  const bool index = index_bytes <= bitmap_bytes;
  const uint64_t bytes = kDeltaHeaderBytes + (index ? index_bytes : bitmap_bytes);
  DeltaSize s;
  if (bytes >= full) {
    s.kind = DeltaKind::kFull;
    s.bytes = full;
  } else {
    s.kind = index ? DeltaKind::kIndex : DeltaKind::kBitmap;
    s.bytes = bytes;
  }
  return s;
}

}  // namespace shardsync
