#include "shardsync/dtype.h"

#include <cmath>
#include <cstring>
#include <string>

namespace shardsync {

int DTypeSize(DType t) {
  switch (t) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
    case DType::kI16:
      return 2;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kI8:
    case DType::kU8:
    case DType::kBool:
      return 1;
  }
  return 0;
}

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF64:
      return "F64";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E5M2:
      return "F8_E5M2";
    case DType::kI64:
      return "I64";
    case DType::kI32:
      return "I32";
    case DType::kI16:
      return "I16";
    case DType::kI8:
      return "I8";
    case DType::kU8:
      return "U8";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

std::string_view DTypeTorchName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF64:
      return "float64";
    case DType::kF8E4M3:
      return "float8_e4m3fn";
    case DType::kF8E5M2:
      return "float8_e5m2";
    case DType::kI64:
      return "int64";
    case DType::kI32:
      return "int32";
    case DType::kI16:
      return "int16";
    case DType::kI8:
      return "int8";
    case DType::kU8:
      return "uint8";
    case DType::kBool:
      return "bool";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view s, std::string_view field) {
  std::string v(s);
  if (v.rfind("torch.", 0) == 0) v = v.substr(6);
  for (auto& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  struct Alias {
    const char* name;
    DType t;
  };
  static const Alias kAliases[] = {
      {"f32", DType::kF32},
      {"fp32", DType::kF32},
      {"float32", DType::kF32},
      {"float", DType::kF32},
      {"bf16", DType::kBF16},
      {"bfloat16", DType::kBF16},
      {"f16", DType::kF16},
      {"fp16", DType::kF16},
      {"float16", DType::kF16},
      {"half", DType::kF16},
      {"f64", DType::kF64},
      {"float64", DType::kF64},
      {"double", DType::kF64},
      {"f8_e4m3", DType::kF8E4M3},
      {"float8_e4m3fn", DType::kF8E4M3},
      {"f8_e5m2", DType::kF8E5M2},
      {"float8_e5m2", DType::kF8E5M2},
      {"i64", DType::kI64},
      {"int64", DType::kI64},
      {"i32", DType::kI32},
      {"int32", DType::kI32},
      {"i16", DType::kI16},
      {"int16", DType::kI16},
      {"i8", DType::kI8},
      {"int8", DType::kI8},
      {"u8", DType::kU8},
      {"uint8", DType::kU8},
      {"bool", DType::kBool},
  };
  for (const auto& a : kAliases) {
    if (v == a.name) return a.t;
  }
  return InvalidArgumentError(std::string(field) + ": unknown dtype '" + std::string(s) + "'");
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    f = mant ? NAN : INFINITY;
  } else {
    f = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -f : f;
}

uint16_t F32ToF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const float a = std::fabs(f);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7e00);
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00);
  if (a < 6.103515625e-05f) {  // subnormal: round to nearest even multiple of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t ax;
  std::memcpy(&ax, &a, 4);
  ax += 0xfff + ((ax >> 13) & 1);  // round to nearest even at bit 13
  const uint32_t exp = ((ax >> 23) - 112) << 10;
  return static_cast<uint16_t>(sign | (exp + ((ax >> 13) & 0x3ff)));
}

}  // namespace shardsync
