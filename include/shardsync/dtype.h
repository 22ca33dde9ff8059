// Element types, with the names safetensors, torch and HF configs use.
#pragma once

#include <cstdint>
#include <string_view>

#include "shardsync/status.h"

namespace shardsync {

enum class DType : uint8_t {
  kF32,
  kBF16,
  kF16,
  kF64,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
};

// Bytes per element.
int DTypeSize(DType t);
// Safetensors spelling: "F32", "BF16", "F8_E4M3", ...
std::string_view DTypeName(DType t);
// Torch spelling without the "torch." prefix: "float32", "bfloat16", ...
std::string_view DTypeTorchName(DType t);
// Accepts the safetensors names, torch names ("bfloat16", "torch.float16"), and short forms
// ("bf16", "fp32", "f16", "fp16", "float", "half"). Errors name `field`.
Result<DType> ParseDType(std::string_view s, std::string_view field = "dtype");

// bf16 <-> f32 conversions (round to nearest even, NaN kept quiet), the cast senders fuse into
// packing. Hand-written: no Debian library offers a scalar bf16 type for C++20.
inline uint16_t F32ToBF16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float BF16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

}  // namespace shardsync
