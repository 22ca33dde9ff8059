// Block FP8: float8_e4m3fn values with one fp32 scale per 128 x 128 block, the format SGLang and
// vLLM load for `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`
// (DeepSeek-V3 / Qwen3-FP8 checkpoints: `weight` in e4m3 and `weight_scale_inv` fp32
// [ceil(out/128), ceil(in/128)], the dequantization multiplier despite its name).
//
// The quantizer, bit for bit (docs/fp8.md), follows the engines' own block quantizer,
// `per_block_cast_to_fp8` in vllm/utils/deep_gemm.py (taken from DeepGEMM
// deep_gemm/utils/math.py@dd6ed14; SGLang's copy in srt/layers/quantization/fp8_utils.py differs
// only by rounding the scale to a power of two for DeepGEMM's UE8M0 requantization), and slime's
// `blockwise_cast_to_fp8_triton`, which all compute, per block of the 2-d weight aligned at (0, 0):
//   x      = the value as fp32 (bf16 / fp16 / fp32 inputs convert exactly)
//   amax   = max |x| over the block, then max(amax, 1e-4f)      (`.clamp(1e-4)`: zero blocks)
//   scale  = amax / 448.0f                                       (fp32, round to nearest even)
//   inv    = 1.0f / scale                                        (fp32: they multiply by 1/scale)
//   q      = e4m3(x * inv)   fp32 product, then round to nearest even, saturated to +-448
// Saturation never triggers for finite inputs (|x * inv| <= 448 * (1 + 2^-22)); it makes the CPU
// and the GPU (cvt.rn.satfinite) agree by construction. Non-finite inputs (NaN, +-Inf) have no
// meaningful scale: a block holding one is written as scale NaN and every byte 0x7f (NaN), and
// the caller is told how many non-finite inputs it saw so the sync can fail instead of shipping
// them (the engines' quantizers would produce NaN or garbage for such blocks too).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/pack.h"
#include "shardsync/status.h"

#if !defined(SHARDSYNC_HD)
#if defined(__CUDACC__)
#define SHARDSYNC_HD __host__ __device__ __forceinline__
#else
#define SHARDSYNC_HD inline
#endif
#endif

namespace shardsync {

inline constexpr int64_t kFp8Block = 128;      // weight_block_size [128, 128]
inline constexpr float kFp8E4M3Max = 448.0f;   // torch.finfo(torch.float8_e4m3fn).max
inline constexpr float kFp8AmaxFloor = 1e-4f;  // the engines' amax.clamp(1e-4)
inline constexpr uint8_t kFp8E4M3Nan = 0x7f;   // S.1111.111
inline constexpr uint32_t kFp8ScaleNanBits = 0x7fc00000u;

SHARDSYNC_HD uint32_t Fp8FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}
SHARDSYNC_HD float Fp8BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}

// fp32 -> float8_e4m3fn, round to nearest even, saturating to +-448; NaN -> 0x7f with the sign.
// Integer arithmetic only, so host and device give the same byte for every input.
SHARDSYNC_HD uint8_t F32ToE4M3(float f) {
  const uint32_t u = Fp8FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | kFp8E4M3Nan;
  if (a >= 0x43e00000u) return sign | 0x7eu;      // >= 448 (and +-Inf): saturate
  const int e = static_cast<int>(a >> 23) - 127;  // unbiased exponent (-127 for fp32 denormals)
  if (e >= -6) {
    // Normal e4m3: exponent field e + 7, top 3 mantissa bits, round on the other 20. A carry out
    // of the mantissa bumps the exponent, which is the right encoding; 448 < x < 464 rounds to
    // 0x7e, and (464, 480) would give 0x7f (NaN): saturate.
    uint32_t q = (static_cast<uint32_t>(e + 7) << 3) | ((a >> 20) & 7u);
    const uint32_t rem = a & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q > 0x7eu ? 0x7eu : q);
  }
  // Subnormal e4m3: value = m * 2^-9, m in [0, 8] (8 encodes the smallest normal, 2^-6).
  // x = m24 * 2^(e - 23) with the implicit bit, so x / 2^-9 = m24 >> (14 - e).
  if (a < 0x00800000u) return sign;  // fp32 denormals are < 2^-126: round to zero
  const uint32_t m24 = (a & 0x7fffffu) | 0x800000u;
  const int s = 14 - e;      // >= 21
  if (s >= 25) return sign;  // below 2^-10 = half the smallest subnormal: rounds to zero
  uint32_t q = m24 >> s;
  const uint32_t rem = m24 & ((1u << s) - 1u), half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint8_t>(q);
}

// float8_e4m3fn -> fp32 (exact).
SHARDSYNC_HD float E4M3ToF32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  if (e == 15 && m == 7) return Fp8BitsFloat(sign | 0x7fc00000u);
  if (e == 0) {
    // m * 2^-9: m has at most 3 bits, so the fp32 encoding is exact.
    const float v = static_cast<float>(m) * 0.001953125f;
    return sign ? -v : v;
  }
  return Fp8BitsFloat(sign | ((e - 7 + 127) << 23) | (m << 20));
}

// The block scale (weight_scale_inv) from the block's max |x| (amax >= 0, or NaN / Inf when the
// block held a non-finite value).
SHARDSYNC_HD float Fp8BlockScale(float amax) {
  if (!(amax <= 3.402823466e38f)) return Fp8BitsFloat(kFp8ScaleNanBits);  // NaN or Inf
  const float a = amax < kFp8AmaxFloor ? kFp8AmaxFloor : amax;
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, kFp8E4M3Max);  // IEEE division whatever the build's -prec-div
#else
  return a / kFp8E4M3Max;
#endif
}

// The quantization multiplier 1 / scale and one element's code, both IEEE round to nearest
// even on host and device.
SHARDSYNC_HD float Fp8InverseScale(float scale) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(1.0f, scale);
#else
  return 1.0f / scale;
#endif
}
SHARDSYNC_HD uint8_t Fp8QuantizeValue(float x, float inv) {
#if defined(__CUDA_ARCH__)
  return F32ToE4M3(__fmul_rn(x, inv));  // never contracted into an FMA
#else
  return F32ToE4M3(x * inv);
#endif
}

// ---- host primitives ----

// Bytes an op of `rows` x `cols` quantized elements puts on the wire: the e4m3 bytes row-major,
// zero-padded to 8, then the fp32 scales of its blocks [ceil(rows/128), ceil(cols/128)]
// row-major, zero-padded to 8 (every section starts on a checksum word).
int64_t Fp8WireBytes(int64_t rows, int64_t cols);
inline int64_t Fp8Blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// Quantizes one block (rows, cols <= 128) of `dtype` values (f32 / bf16 / f16) read from `src`
// with a row stride of `src_stride` elements into `dst` (row stride `dst_stride` bytes); returns
// its scale and adds the number of non-finite inputs to *nonfinite.
float Fp8QuantizeBlock(const void* src, DType dtype, int64_t src_stride, int64_t rows, int64_t cols,
                       uint8_t* dst, int64_t dst_stride, int64_t* nonfinite);

// Wire bytes of a kAmax op: rows (< 128) of one block row; the e4m3 bytes zero-padded to 8,
// then, for the holder that sends them, the block row's fp32 scales zero-padded to 8.
inline int64_t Fp8PartWireBytes(int64_t rows, int64_t cols, bool with_scales) {
  const int64_t q = (rows * cols + 7) & ~int64_t{7};
  return q + (with_scales ? ((Fp8Blocks(cols) * 4 + 7) & ~int64_t{7}) : 0);
}

// The max over |x| of a fp32 value as magnitude bits: for non-negative floats the integer order
// is the float order, and NaN (above 0x7f800000) and Inf (0x7f800000) rank above every finite
// value, so the max of partials sees them.
SHARDSYNC_HD uint32_t Fp8MagnitudeBits(float x) { return Fp8FloatBits(x) & 0x7fffffffu; }
inline bool Fp8AmaxBitsFinite(uint32_t bits) { return bits < 0x7f800000u; }

struct Fp8PackResult {
  uint64_t sum = 0;       // ChecksumPartial of the op's wire bytes at its wire offset
  int64_t nonfinite = 0;  // non-finite inputs seen (their blocks are NaN on the wire)
};

// The fused CPU quantize-pack of one op: reads `src` (a 2-d region of a trainer tensor, or 3-d
// with leading extent 1; its origin must sit on the block grid of the HF tensor, which the plan
// guarantees) once, writes the op's Fp8WireBytes at `out` and returns the checksum terms of those
// bytes as the CPU packer computes them (checksum.h: ChecksumPartial at byte offset
// src.wire_offset, a multiple of 8). InvalidArgument for a bad region or dtype.
Result<Fp8PackResult> Fp8QuantizePack(const PackRegion& src, void* out);

// Blocks split across holders (the amax exchange, fp8_plan.h kAmax). The partial amax of `src`
// (rows of one block row, 2-d, or 3-d with leading extent 1) per 128-column block as magnitude
// bits (Fp8MagnitudeBits), into out[Fp8Blocks(cols)]. InvalidArgument for a bad region or dtype.
Status Fp8PartialAmax(const PackRegion& src, uint32_t* out);
// The quantize-pack of such rows with the block row's scales given (scales[Fp8Blocks(cols)],
// from Fp8BlockScale of the combined amax): writes Fp8PartWireBytes(rows, cols, with_scales) at
// `out` with the checksum terms, as Fp8QuantizePack does for whole blocks.
Result<Fp8PackResult> Fp8QuantizePackScaled(const PackRegion& src, const float* scales,
                                            bool with_scales, void* out);

// Whole-tensor helpers (reference engine, tests): quantize a row-major [rows, cols] fp32 matrix
// into e4m3 bytes [rows * cols] and scales [ceil(rows/128) * ceil(cols/128)]; dequantize back
// (q * scale per block, fp32).
int64_t Fp8QuantizeMatrix(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scales);
void Fp8DequantizeMatrix(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                         float* out);

// One band of block-FP8 weights an engine rank quantizes itself (plan.h StagedBand):
// `rows` (<= 128) x `cols` raw trainer values of `dtype` (f32 / bf16 / f16) at `src`, row-major
// and contiguous, quantized per 128 x 128 block into e4m3 rows at `weight` (row stride
// `weight_stride` bytes) and fp32 scales at `scales` (row stride `scale_stride` floats).
struct Fp8BandTask {
  const void* src = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0;
  void* weight = nullptr;
  int64_t weight_stride = 0;
  float* scales = nullptr;
  int64_t scale_stride = 0;
};

// A trainer rank's rows of one band of block-FP8 weights shared with other trainer ranks (the
// amax exchange, plan.h AmaxBand): `rows` (<= 128) x `cols` values of `dtype` (f32 / bf16 / f16)
// at `src`, `src_stride` elements apart, whose partial amax per 128-column block goes to entry
// `slot + column block` of the rank's partials.
struct Fp8AmaxTask {
  const void* src = nullptr;
  DType dtype = DType::kF32;
  int64_t src_stride = 0;
  int64_t rows = 0, cols = 0;
  int64_t slot = 0;
};

// The block-FP8 codec's steps over a packer's memory (pack.h CodecKernels): the CPU packer's
// (host memory) and the CUDA packer's (device memory) are bit-exact with the functions above.
class Fp8Kernels : public CodecKernels {
 public:
  // Quantizes every band (in memory the packer reads and writes; a non-finite value makes its
  // block's scale NaN and bytes 0x7f) and returns, per band, the non-finite values met. Waits at
  // most the packer's timeout. A receiver passes the same bands every sync: a device packer
  // prepares them once.
  virtual Result<std::vector<int64_t>> QuantizeBands(const std::vector<Fp8BandTask>& bands) = 0;
  // The amax exchange of a trainer whose shards live in the packer's memory: each task's partial
  // amax per 128-column block, as magnitude bits (Fp8PartialAmax's, bit for bit on finite values;
  // a non-finite value ranks above every finite one), into out[task.slot + block]; entries of
  // `out` (out_len of them) no task covers are zero. Waits at most the packer's timeout. A
  // trainer passes the same tasks every sync: a device packer prepares them once.
  virtual Status PartialAmax(const std::vector<Fp8AmaxTask>& tasks, uint32_t* out,
                             int64_t out_len) = 0;
};
// The CPU packer's (host memory; fp8_kernels.cc).
std::unique_ptr<CodecKernels> MakeCpuBlockQuantizeKernels();

}  // namespace shardsync
