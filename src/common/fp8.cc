// Block-FP8 quantizer on the CPU: one block at a time, the fused quantize-pack of a plan op, and
// whole-matrix helpers. The arithmetic is the inline definition in fp8.h; this file only walks
// memory. Hand-written: no Debian library quantizes to float8_e4m3fn.
#include "shardsync/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/fp8_lane.h"
#include "shardsync/checksum.h"

namespace shardsync {
namespace {

inline int64_t AlignUp8(int64_t n) { return (n + 7) & ~int64_t{7}; }

// Loads `n` values of `dtype` at `p` as fp32 (exact for every supported dtype).
__attribute__((target_clones("avx2", "default"))) void LoadRow(const unsigned char* p, DType dtype,
                                                               int64_t n, float* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, p, static_cast<size_t>(n) * 4);
      return;
    case DType::kBF16: {
      // bf16 is fp32's top half: widen by a shift (a loop the compiler vectorizes).
      auto* o = reinterpret_cast<unsigned char*>(out);
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        const uint32_t w = static_cast<uint32_t>(h) << 16;
        std::memcpy(o + 4 * i, &w, 4);
      }
      return;
    }
    default:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = F16ToF32(h);
      }
      return;
  }
}

bool Quantizable(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// The max of n values' magnitude bits (monotonic in the magnitude; at or above Inf's bits
// exactly for Inf and NaN), as the CUDA kernels take a block's amax.
__attribute__((target_clones("avx2", "default"))) uint32_t MaxMagnitudeBits(const float* x,
                                                                            int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    u &= 0x7fffffffu;
    m = u > m ? u : m;
  }
  return m;
}

// e4m3 codes of x[0, n) * inv.
__attribute__((target_clones("avx2", "default"))) void ConvertRow(const float* x, int64_t n,
                                                                  float inv, uint8_t* d) {
  for (int64_t c = 0; c < n; ++c) d[c] = E4M3Lane(x[c] * inv);
}

int64_t CountNonFinite(const float* x, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += !(std::fabs(x[i]) <= 3.402823466e38f);
  return bad;
}

// The tile as fp32, then amax, scale and the bytes. `tile` holds rows x cols values. The loops
// (MaxMagnitudeBits, ConvertRow) are plain C++ the compiler vectorizes, built twice (AVX2 where
// the CPU has it, picked at load time): 3.7x the scalar conversion's speed on this VM.
float QuantizeTile(const float* tile, int64_t rows, int64_t cols, uint8_t* dst, int64_t dst_stride,
                   int64_t* nonfinite) {
  const uint32_t m = MaxMagnitudeBits(tile, rows * cols);
  if (m >= 0x7f800000u) {
    *nonfinite += CountNonFinite(tile, rows * cols);
    for (int64_t r = 0; r < rows; ++r) std::memset(dst + r * dst_stride, kFp8E4M3Nan, cols);
    return Fp8BitsFloat(kFp8ScaleNanBits);
  }
  const float scale = Fp8BlockScale(Fp8BitsFloat(m));
  const float inv = Fp8InverseScale(scale);
  for (int64_t r = 0; r < rows; ++r) ConvertRow(tile + r * cols, cols, inv, dst + r * dst_stride);
  return scale;
}

}  // namespace

int64_t Fp8WireBytes(int64_t rows, int64_t cols) {
  return AlignUp8(rows * cols) + AlignUp8(Fp8Blocks(rows) * Fp8Blocks(cols) * 4);
}

float Fp8QuantizeBlock(const void* src, DType dtype, int64_t src_stride, int64_t rows, int64_t cols,
                       uint8_t* dst, int64_t dst_stride, int64_t* nonfinite) {
  float tile[kFp8Block * kFp8Block];
  const auto* s = static_cast<const unsigned char*>(src);
  const int es = DTypeSize(dtype);
  for (int64_t r = 0; r < rows; ++r) LoadRow(s + r * src_stride * es, dtype, cols, tile + r * cols);
  return QuantizeTile(tile, rows, cols, dst, dst_stride, nonfinite);
}

Result<Fp8PackResult> Fp8QuantizePack(const PackRegion& src, void* out) {
  const Region& r = src.region;
  if (!Quantizable(src.dtype)) {
    return InvalidArgumentError("fp8 quantize: source dtype " + std::string(DTypeName(src.dtype)) +
                                " is not f32, bf16 or f16");
  }
  if (src.base == nullptr || !RegionInside(r, src.shape) || r.ndim < 2 || r.ndim > 3 ||
      (r.ndim == 3 && r.extent[0] != 1) || src.wire_offset % 8 != 0) {
    return InvalidArgumentError("fp8 quantize: region " + r.ToString() + " of shape " +
                                ShapeToString(src.shape) +
                                " is not a 2-d matrix (or one 3-d slice) at an 8-byte wire offset");
  }
  const int d = r.ndim - 2;  // row dim
  const int64_t rows = r.extent[d], cols = r.extent[d + 1];
  const int64_t row_stride = src.shape[d + 1];  // elements between rows of the source tensor
  int64_t start = r.offset[d] * row_stride + r.offset[d + 1];
  if (d == 1) start += r.offset[0] * src.shape[1] * src.shape[2];
  const int es = DTypeSize(src.dtype);
  const auto* base = static_cast<const unsigned char*>(src.base) + start * es;
  auto* o = static_cast<uint8_t*>(out);
  const int64_t nbr = Fp8Blocks(rows), nbc = Fp8Blocks(cols);
  const int64_t fp8_bytes = AlignUp8(rows * cols);
  float* scales = reinterpret_cast<float*>(o + fp8_bytes);  // 8-aligned within the op
  Fp8PackResult res;
  std::vector<float> band;  // one block row of fp32 values: read the source once
  for (int64_t br = 0; br < nbr; ++br) {
    const int64_t r0 = br * kFp8Block, nr = std::min(kFp8Block, rows - r0);
    band.resize(static_cast<size_t>(nr * cols));
    for (int64_t i = 0; i < nr; ++i) {
      LoadRow(base + (r0 + i) * row_stride * es, src.dtype, cols, band.data() + i * cols);
    }
    float tile[kFp8Block * kFp8Block];
    for (int64_t bc = 0; bc < nbc; ++bc) {
      const int64_t c0 = bc * kFp8Block, nc = std::min(kFp8Block, cols - c0);
      for (int64_t i = 0; i < nr; ++i) {
        std::memcpy(tile + i * nc, band.data() + i * cols + c0, static_cast<size_t>(nc) * 4);
      }
      const float s = QuantizeTile(tile, nr, nc, o + r0 * cols + c0, cols, &res.nonfinite);
      std::memcpy(scales + br * nbc + bc, &s, 4);
    }
    // Checksum the band's bytes while they are in cache; the last band takes the zero pad.
    const int64_t b0 = r0 * cols;
    int64_t b1 = (r0 + nr) * cols;
    if (br + 1 == nbr) {
      std::memset(o + b1, 0, static_cast<size_t>(fp8_bytes - b1));
      b1 = fp8_bytes;
    }
    res.sum += ChecksumPartial(o + b0, static_cast<size_t>(b1 - b0),
                               static_cast<uint64_t>(src.wire_offset + b0));
  }
  const int64_t scale_bytes = nbr * nbc * 4, scale_padded = AlignUp8(scale_bytes);
  std::memset(o + fp8_bytes + scale_bytes, 0, static_cast<size_t>(scale_padded - scale_bytes));
  res.sum += ChecksumPartial(o + fp8_bytes, static_cast<size_t>(scale_padded),
                             static_cast<uint64_t>(src.wire_offset + fp8_bytes));
  return res;
}

namespace {

// A kAmax op's source: rows (<= 128) x cols of a 2-d matrix (or one 3-d slice).
struct PartRows {
  const unsigned char* base = nullptr;
  int64_t rows = 0, cols = 0, stride = 0;  // stride: elements between rows
  int es = 0;
};

Result<PartRows> PartRowsOf(const PackRegion& src, std::string_view what) {
  const Region& r = src.region;
  if (!Quantizable(src.dtype)) {
    return InvalidArgumentError(std::string(what) + ": source dtype " +
                                std::string(DTypeName(src.dtype)) + " is not f32, bf16 or f16");
  }
  if (src.base == nullptr || !RegionInside(r, src.shape) || r.ndim < 2 || r.ndim > 3 ||
      (r.ndim == 3 && r.extent[0] != 1) || src.wire_offset % 8 != 0 ||
      r.extent[r.ndim - 2] > kFp8Block) {
    return InvalidArgumentError(std::string(what) + ": region " + r.ToString() + " of shape " +
                                ShapeToString(src.shape) +
                                " is not at most 128 rows of a matrix at an 8-byte wire offset");
  }
  const int d = r.ndim - 2;
  PartRows p;
  p.rows = r.extent[d];
  p.cols = r.extent[d + 1];
  p.stride = src.shape[d + 1];
  int64_t start = r.offset[d] * p.stride + r.offset[d + 1];
  if (d == 1) start += r.offset[0] * src.shape[1] * src.shape[2];
  p.es = DTypeSize(src.dtype);
  p.base = static_cast<const unsigned char*>(src.base) + start * p.es;
  return p;
}

}  // namespace

Status Fp8PartialAmax(const PackRegion& src, uint32_t* out) {
  SS_ASSIGN_OR_RETURN(PartRows p, PartRowsOf(src, "fp8 partial amax"));
  const int64_t nbc = Fp8Blocks(p.cols);
  std::fill(out, out + nbc, 0u);
  std::vector<float> row(static_cast<size_t>(p.cols));
  for (int64_t i = 0; i < p.rows; ++i) {
    LoadRow(p.base + i * p.stride * p.es, src.dtype, p.cols, row.data());
    for (int64_t bc = 0; bc < nbc; ++bc) {
      const int64_t c0 = bc * kFp8Block, c1 = std::min(p.cols, c0 + kFp8Block);
      out[bc] = std::max(out[bc], MaxMagnitudeBits(row.data() + c0, c1 - c0));
    }
  }
  return OkStatus();
}

Result<Fp8PackResult> Fp8QuantizePackScaled(const PackRegion& src, const float* scales,
                                            bool with_scales, void* out) {
  SS_ASSIGN_OR_RETURN(PartRows p, PartRowsOf(src, "fp8 quantize"));
  const int64_t nbc = Fp8Blocks(p.cols);
  std::vector<float> inv(static_cast<size_t>(nbc));
  for (int64_t bc = 0; bc < nbc; ++bc) inv[bc] = Fp8InverseScale(scales[bc]);
  auto* o = static_cast<uint8_t*>(out);
  Fp8PackResult res;
  std::vector<float> row(static_cast<size_t>(p.cols));
  for (int64_t i = 0; i < p.rows; ++i) {
    LoadRow(p.base + i * p.stride * p.es, src.dtype, p.cols, row.data());
    uint8_t* d = o + i * p.cols;
    if (MaxMagnitudeBits(row.data(), p.cols) >= 0x7f800000u) {
      res.nonfinite += CountNonFinite(row.data(), p.cols);
    }
    for (int64_t bc = 0; bc < nbc; ++bc) {
      const int64_t c0 = bc * kFp8Block, c1 = std::min(p.cols, c0 + kFp8Block);
      ConvertRow(row.data() + c0, c1 - c0, inv[bc], d + c0);
    }
  }
  const int64_t q = p.rows * p.cols, qp = AlignUp8(q);
  std::memset(o + q, 0, static_cast<size_t>(qp - q));
  int64_t total = qp;
  if (with_scales) {
    const int64_t sb = nbc * 4, sp = AlignUp8(sb);
    std::memcpy(o + qp, scales, static_cast<size_t>(sb));
    std::memset(o + qp + sb, 0, static_cast<size_t>(sp - sb));
    total += sp;
  }
  res.sum = ChecksumPartial(o, static_cast<size_t>(total), static_cast<uint64_t>(src.wire_offset));
  return res;
}

int64_t Fp8QuantizeMatrix(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scales) {
  int64_t nonfinite = 0;
  const int64_t nbc = Fp8Blocks(cols);
  for (int64_t r0 = 0; r0 < rows; r0 += kFp8Block) {
    for (int64_t c0 = 0; c0 < cols; c0 += kFp8Block) {
      scales[(r0 / kFp8Block) * nbc + c0 / kFp8Block] =
          Fp8QuantizeBlock(x + r0 * cols + c0, DType::kF32, cols, std::min(kFp8Block, rows - r0),
                           std::min(kFp8Block, cols - c0), q + r0 * cols + c0, cols, &nonfinite);
    }
  }
  return nonfinite;
}

void Fp8DequantizeMatrix(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                         float* out) {
  const int64_t nbc = Fp8Blocks(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales + (r / kFp8Block) * nbc;
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = E4M3ToF32(q[r * cols + c]) * srow[c / kFp8Block];
    }
  }
}

}  // namespace shardsync
