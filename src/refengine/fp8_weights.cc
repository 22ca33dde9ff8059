// Block-FP8 views of weight sources: quantize unquantized HF values into the FP8 checkpoint a
// block-FP8 engine loads, and dequantize an FP8 checkpoint back into the fp32 weights the engine
// computes with. Both work block-aligned: a region read covers the whole 128 x 128 blocks it
// touches, so any piece of a shard map reads the same bytes as the whole tensor would.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "refengine/dequantize.h"
#include "shardsync/fp8.h"
#include "shardsync/refengine.h"

namespace shardsync {
namespace {

constexpr int64_t B = kFp8Block;
constexpr std::string_view kScaleSuffix = "_scale_inv";

// The weight a "<weight>_scale_inv" name belongs to, or empty.
std::string_view ScaleOf(std::string_view name) {
  if (name.size() <= kScaleSuffix.size() ||
      name.substr(name.size() - kScaleSuffix.size()) != kScaleSuffix) {
    return {};
  }
  return name.substr(0, name.size() - kScaleSuffix.size());
}

// The block-aligned cover of a 2-d region of a [rows, cols] tensor.
Region Cover(const Region& r, const Shape& shape) {
  Region c = r;
  for (int i = 0; i < 2; ++i) {
    c.offset[i] = r.offset[i] / B * B;
    c.extent[i] = std::min(shape[i], (r.offset[i] + r.extent[i] + B - 1) / B * B) - c.offset[i];
  }
  return c;
}

// Copies sub-region `r` of a row-major [c.extent] buffer whose origin is `c.offset` to `out`.
void CopyOut(const uint8_t* cover, const Region& c, const Region& r, int es, void* out) {
  auto* o = static_cast<uint8_t*>(out);
  const Shape cs = {c.extent[0], c.extent[1]};
  Region local = Region::Make({r.offset[0] - c.offset[0], r.offset[1] - c.offset[1]},
                              {r.extent[0], r.extent[1]});
  ForEachRun(local, cs, [&](int64_t off, int64_t len) {
    std::memcpy(o, cover + off * es, static_cast<size_t>(len * es));
    o += len * es;
  });
}

Status CheckInside(std::string_view name, const Region& r, const Shape& shape) {
  if (r.ndim != 2 || !RegionInside(r, shape)) {
    return OutOfRangeError(fmt::format("region {} is outside tensor '{}' of shape {}", r.ToString(),
                                       name, ShapeToString(shape)));
  }
  return OkStatus();
}

Shape BlockShape(const Shape& s) { return {(s[0] + B - 1) / B, (s[1] + B - 1) / B}; }

}  // namespace

// ---- QuantizedWeightSource ----

QuantizedWeightSource::QuantizedWeightSource(const WeightSource& values, ModelSpec spec)
    : values_(values), spec_(std::move(spec)) {}

Result<TensorInfo> QuantizedWeightSource::Describe(std::string_view hf_name) const {
  const std::string_view weight = ScaleOf(hf_name);
  if (!weight.empty() && IsQuantizedWeight(spec_, weight)) {
    SS_ASSIGN_OR_RETURN(TensorInfo w, values_.Describe(weight));
    if (w.shape.size() != 2) return InternalError(fmt::format("'{}' is not a matrix", weight));
    return TensorInfo{DType::kF32, BlockShape(w.shape)};
  }
  SS_ASSIGN_OR_RETURN(TensorInfo t, values_.Describe(hf_name));
  if (IsQuantizedWeight(spec_, hf_name)) t.dtype = DType::kF8E4M3;
  return t;
}

Status QuantizedWeightSource::Read(std::string_view hf_name, const Region& r, DType dtype,
                                   void* out) const {
  const std::string_view weight = ScaleOf(hf_name);
  const bool scale = !weight.empty() && IsQuantizedWeight(spec_, weight);
  if (!scale && !IsQuantizedWeight(spec_, hf_name)) return values_.Read(hf_name, r, dtype, out);
  const std::string_view w = scale ? weight : hf_name;
  if (dtype != (scale ? DType::kF32 : DType::kF8E4M3)) {
    return InvalidArgumentError(fmt::format("tensor '{}' is block-FP8 ({}); read as {}", hf_name,
                                            scale ? "F32 scales" : "F8_E4M3", DTypeName(dtype)));
  }
  SS_ASSIGN_OR_RETURN(TensorInfo info, values_.Describe(w));
  const Shape& shape = info.shape;
  if (shape.size() != 2) return InternalError(fmt::format("'{}' is not a matrix", w));
  // The weight region whose blocks are needed: for scales, the blocks themselves.
  Region need = r;
  if (scale) {
    SS_RETURN_IF_ERROR(CheckInside(hf_name, r, BlockShape(shape)));
    for (int i = 0; i < 2; ++i) {
      need.offset[i] = r.offset[i] * B;
      need.extent[i] = std::min(shape[i], (r.offset[i] + r.extent[i]) * B) - need.offset[i];
    }
  } else {
    SS_RETURN_IF_ERROR(CheckInside(hf_name, r, shape));
  }
  const Region c = Cover(need, shape);
  std::vector<float> x(static_cast<size_t>(c.numel()));
  SS_RETURN_IF_ERROR(values_.Read(w, c, DType::kF32, x.data()));
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(
      static_cast<size_t>(((c.extent[0] + B - 1) / B) * ((c.extent[1] + B - 1) / B)));
  const int64_t bad = Fp8QuantizeMatrix(x.data(), c.extent[0], c.extent[1], q.data(), s.data());
  if (bad > 0) {
    return DataLossError(fmt::format(
        "tensor '{}' holds {} non-finite values in {}: not quantizable", w, bad, c.ToString()));
  }
  if (!scale) {
    CopyOut(q.data(), c, r, 1, out);
    return OkStatus();
  }
  const Region cb = Region::Make({c.offset[0] / B, c.offset[1] / B},
                                 {(c.extent[0] + B - 1) / B, (c.extent[1] + B - 1) / B});
  CopyOut(reinterpret_cast<const uint8_t*>(s.data()), cb, r, 4, out);
  return OkStatus();
}

// ---- DequantizedWeightSource ----

DequantizedWeightSource::DequantizedWeightSource(const WeightSource& fp8, ModelSpec spec)
    : fp8_(fp8), spec_(std::move(spec)) {}

Result<TensorInfo> DequantizedWeightSource::Describe(std::string_view hf_name) const {
  SS_ASSIGN_OR_RETURN(TensorInfo t, fp8_.Describe(hf_name));
  if (IsQuantizedWeight(spec_, hf_name)) t.dtype = DType::kF32;
  return t;
}

Status DequantizedWeightSource::Read(std::string_view hf_name, const Region& r, DType dtype,
                                     void* out) const {
  if (!IsQuantizedWeight(spec_, hf_name)) return fp8_.Read(hf_name, r, dtype, out);
  SS_ASSIGN_OR_RETURN(TensorInfo info, fp8_.Describe(hf_name));
  if (info.dtype != DType::kF8E4M3) {
    return InvalidArgumentError(fmt::format(
        "tensor '{}' is {} in the checkpoint, but quantization_config makes it block-FP8 "
        "(F8_E4M3 with {}{})",
        hf_name, DTypeName(info.dtype), hf_name, kScaleSuffix));
  }
  const Shape& shape = info.shape;
  SS_RETURN_IF_ERROR(CheckInside(hf_name, r, shape));
  const std::string scale_name = WeightScaleName(hf_name);
  SS_ASSIGN_OR_RETURN(TensorInfo sinfo, fp8_.Describe(scale_name));
  if (sinfo.shape != BlockShape(shape)) {
    return InvalidArgumentError(fmt::format(
        "scale tensor '{}' has shape {}, '{}' {} needs {}", scale_name, ShapeToString(sinfo.shape),
        hf_name, ShapeToString(shape), ShapeToString(BlockShape(shape))));
  }
  const Region c = Cover(r, shape);
  const Region cb = Region::Make({c.offset[0] / B, c.offset[1] / B},
                                 {(c.extent[0] + B - 1) / B, (c.extent[1] + B - 1) / B});
  std::vector<uint8_t> q(static_cast<size_t>(c.numel()));
  std::vector<float> s(static_cast<size_t>(cb.numel())), x(q.size());
  SS_RETURN_IF_ERROR(fp8_.Read(hf_name, c, DType::kF8E4M3, q.data()));
  SS_RETURN_IF_ERROR(fp8_.Read(scale_name, cb, DType::kF32, s.data()));
  Fp8DequantizeMatrix(q.data(), s.data(), c.extent[0], c.extent[1], x.data());
  std::vector<float> sub(static_cast<size_t>(r.numel()));
  CopyOut(reinterpret_cast<const uint8_t*>(x.data()), c, r, 4, sub.data());
  return ConvertElements(DType::kF32, sub.data(), dtype, out, r.numel());
}

bool HoldsFp8Weights(const WeightSource& weights, const ModelSpec& spec) {
  for (const HfTensor& t : HfTensorInventory(spec)) {
    if (!IsQuantizedWeight(spec, t.name)) continue;
    auto info = weights.Describe(t.name);
    return info.ok() && info->dtype == DType::kF8E4M3;
  }
  return false;
}

// A block-FP8 parameter (e4m3 [.., rows, cols]) times its weight_scale_inv block by block, as
// the engines' block_quant_dequant does (sglang srt/layers/quantization/fp8_utils.py).
Status DequantizeEngineParam(const EngineBuffers& buffers, const EngineParam& p,
                             const std::string& who, float* out) {
  const std::string scale_name = WeightScaleName(p.name);
  auto it = buffers.find(scale_name);
  const int64_t R = p.shape[p.shape.size() - 2], C = p.shape.back();
  const int64_t groups = p.numel() / (R * C);
  const int64_t nb = Fp8Blocks(R) * Fp8Blocks(C);
  if (it == buffers.end() || it->second.dtype != DType::kF32 ||
      it->second.data.size() != static_cast<size_t>(groups * nb * 4)) {
    return InvalidArgumentError(
        fmt::format("{}: block-FP8 parameter '{}' needs '{}' (F32, {} blocks)", who, p.name,
                    scale_name, groups * nb));
  }
  const auto& q = buffers.at(p.name).data;
  const float* s = reinterpret_cast<const float*>(it->second.data.data());
  for (int64_t g = 0; g < groups; ++g) {
    Fp8DequantizeMatrix(q.data() + g * R * C, s + g * nb, R, C, out + g * R * C);
  }
  return OkStatus();
}

}  // namespace shardsync
