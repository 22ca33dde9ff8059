// What packing works on: a strided region of a tensor and where its elements sit in a wire image.
// Shared by the session's Packer (session.h) and the transports' prepared pairs (transport.h).
#pragma once

#include <cstdint>

#include "shardsync/dtype.h"
#include "shardsync/region.h"

namespace shardsync {

// A strided region of a row-major tensor at `base`, whose elements occupy wire bytes
// [wire_offset, wire_offset + region.numel() * wire size) of one bucket, in row-major order.
struct PackRegion {
  const void* base = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Region region;
  int64_t wire_offset = 0;
};

}  // namespace shardsync
