// The delta codec's size rule (delta.h "The size rule") as one inline function that host and
// device code both compile: DeltaEncodedBytes (delta.cc) and the device encoder's form choice
// (delta_gpu.h) call this, so there is one rule, not two.
#pragma once

#include <cstdint>

#include "shardsync/checksum.h"  // SHARDSYNC_HD
#include "shardsync/delta.h"

namespace shardsync {

inline constexpr uint64_t kDeltaIndexBytes = 4;  // u32 element index of an index record

SHARDSYNC_HD uint64_t DeltaBitmapBytes(uint64_t elements) { return (elements + 7) / 8; }

// Both forms carry the changed values; they differ in how positions are named. `changed` is
// clamped to `elements`.
SHARDSYNC_HD DeltaSize DeltaSizeRule(uint64_t elements, uint64_t element_size, uint64_t changed) {
  const uint64_t full = elements * element_size;
  if (changed > elements) changed = elements;
  const bool index = kDeltaIndexBytes * changed <= DeltaBitmapBytes(elements);
  const uint64_t bytes = kDeltaHeaderBytes + changed * element_size +
                         (index ? kDeltaIndexBytes * changed : DeltaBitmapBytes(elements));
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
