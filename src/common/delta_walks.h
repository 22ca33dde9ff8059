// Internal to the delta codec (delta.cc): walks over a checked encoding's changes, in element
// order, for the decode's checksum prediction and its apply: the bitmap form's (Records), the
// index form's tile by tile (IndexWalk) and the packed form's subtile by subtile (PackedWalk).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "common/delta_internal.h"
#include "shardsync/delta.h"
#include "shardsync/delta_rule.h"

namespace shardsync::delta_internal {

// The bitmap form's changes of a checked encoding in order: element index and value, one at a
// time (the decode walks them alongside its pass over the bucket). The index form has IndexWalk
// (below); over an index-form encoding this walk is empty.
template <int E>
class Records {
 public:
  Records(const DeltaInfo& info, const std::byte* payload)
      : payload_(payload), left_(info.kind == DeltaKind::kBitmap ? info.changed : 0) {
    nbits_ = BitmapBytes(info.elements);
    vals_ = payload + nbits_;
    byte_ = -1;
    Next();
  }
  bool done() const { return done_; }
  uint64_t index() const { return index_; }
  const std::byte* value() const { return value_; }
  [[gnu::always_inline]] void Next() {
    if (left_ == 0) {
      done_ = true;
      return;
    }
    --left_;
    while (mask_ == 0) {  // the count matched the bitmap's popcount: a set bit is ahead
      ++byte_;
      if (byte_ % 8 == 0 && byte_ + 8 <= nbits_ && Get<uint64_t>(payload_ + byte_) == 0) {
        byte_ += 7;  // eight empty bytes at once
        continue;
      }
      mask_ = static_cast<unsigned>(payload_[byte_]);
    }
    index_ = byte_ * 8 + std::countr_zero(mask_);
    mask_ &= mask_ - 1;
    value_ = vals_;
    vals_ += E;
  }

 private:
  const std::byte* payload_;
  uint64_t left_;
  bool done_ = false;
  uint64_t index_ = 0;
  const std::byte* value_ = nullptr;
  uint64_t nbits_ = 0, byte_ = 0;    // its bytes, the current one
  unsigned mask_ = 0;                // bits of byte_ not yet visited
  const std::byte* vals_ = nullptr;  // the next value
};

// The index form's changes tile by tile (a checked encoding): change k is element tile_start +
// its u16 offset while k < tile_end; Seek moves to the tile holding change k. Kept apart from
// Records so the hot walks (Predict, Apply) run a tight loop per tile.
template <int E>
struct IndexWalk {
  IndexWalk(const DeltaInfo& info, const std::byte* payload) : ends(payload), count(info.changed) {
    const DeltaIndexLayout l = DeltaIndexPayload(info.elements, E, info.changed);
    offs = payload + l.offsets;
    vals = payload + l.values;
  }
  // The packed form expanded (its running counts are the index form's): a u16 element within
  // its tile per change (PackedPositions), the new values (the prediction's).
  IndexWalk(const std::byte* e, const std::byte* o, const std::byte* v, uint64_t c)
      : ends(e), offs(o), vals(v), count(c) {}
  void Seek() {
    while (k >= tile_end) {
      tile_start = tile * (kDeltaTileBytes / E);
      tile_end = Get<uint32_t>(ends + 4 * tile++);
    }
  }
  uint64_t Index(uint64_t j) const { return tile_start + Get<uint16_t>(offs + 2 * j); }
  const std::byte* ends;
  const std::byte* offs = nullptr;
  const std::byte* vals = nullptr;
  uint64_t count, k = 0, tile = 0, tile_end = 0, tile_start = 0;
};

// The packed form's changes subtile by subtile (a checked encoding): change k is element
// sub_start + its u8 offset while k < sub_end; its new value comes from its value byte and, for
// 2-byte elements, the old value or the next escape. Over another form the walk is empty.
template <int E>
struct PackedWalk {
  PackedWalk(const DeltaInfo& info, const std::byte* payload)
      : count(info.kind == DeltaKind::kPacked ? info.changed : 0) {
    const DeltaPackedLayout l = DeltaPackedPayload(info.elements, E, info.changed, info.escapes);
    subs = payload + l.subs;
    offs = payload + l.offsets;
    vals = payload + l.values;
    escs = payload + l.escapes;
  }
  void Seek() {
    while (k >= sub_end) {
      sub_start = sub * kDeltaSubtileElems;
      sub_end += static_cast<uint8_t>(subs[sub++]);
    }
  }
  uint64_t Index(uint64_t j) const { return sub_start + static_cast<uint8_t>(offs[j]); }
  // Change j's new value from the element's old one; takes the next escape when it is escaped
  // (so called once per change, in order).
  uint64_t Value(uint64_t j, uint64_t old) {
    const auto vb = static_cast<uint8_t>(vals[j]);
    if constexpr (E == 1) {
      return vb;
    } else {
      if (vb == kDeltaEscape) return Get<uint16_t>(escs + 2 * esc++);
      return (old + static_cast<uint64_t>(static_cast<int64_t>(static_cast<int8_t>(vb)))) & 0xFFFF;
    }
  }
  const std::byte *subs = nullptr, *offs = nullptr, *vals = nullptr, *escs = nullptr;
  uint64_t count, k = 0, sub = 0, sub_end = 0, sub_start = 0, esc = 0;
};

}  // namespace shardsync::delta_internal
