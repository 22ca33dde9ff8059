// The element check of block-FP8 engine parameters (fp8_verify.h VerifyFp8Param, behind
// internal.h BlockQuantCheck): what a correct
// sync lands is fp8.h's quantizer applied to the trainer's values, block by block. Every shard
// map piece of a quantized weight starts on the HF tensor's 128 grid and is a whole number of
// blocks (or ends the tensor), so quantizing the piece's HF region on its own gives the engine's
// blocks exactly.
#include <cstring>
#include <map>
#include <vector>

#include "job/fp8_verify.h"
#include "shardsync/fp8.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/synthetic.h"

namespace shardsync::job_internal {

namespace {

// e4m3 weights and their fp32 weight_scale_inv, bound as the shard map gives them
// (fp8_plan.h Fp8DestDType); a weight's check reads its scale, so a scale needs none of its own.
class BlockFp8Check final : public EncodedParamCheck {
 public:
  bool Owns(const EngineParam& p) const override {
    return p.dtype == DType::kF8E4M3 || IsFp8ScaleParam(p);
  }
  DType BoundDType(const EngineParam& p, DType wire) const override {
    return Fp8DestDType(p, wire);
  }
  void VerifyHost(const JobSpec& job, const std::vector<EngineParam>& params, size_t i,
                  const std::vector<DestBinding>& bound, RankResult& out) const override {
    if (params[i].dtype == DType::kF8E4M3) VerifyFp8Param(job, params, i, bound, out);
  }
  Status VerifyDevice(const JobSpec& job, const std::vector<EngineParam>& params,
                      const std::vector<DestBinding>& dests, int device, void* stream,
                      RankResult& out) const override {
    return VerifyFp8Device(job, params, dests, device, stream, out);
  }
};

}  // namespace

const EncodedParamCheck& BlockQuantCheck() {
  static const BlockFp8Check check;
  return check;
}

void VerifyFp8Param(const JobSpec& job, const std::vector<EngineParam>& params, size_t i,
                    const std::vector<DestBinding>& bound, RankResult& out) {
  const EngineParam& w = params[i];
  auto mismatch = [&](const std::string& name, int64_t element, int64_t n) {
    if (n > 0 && out.element_mismatches == 0) {
      out.first_mismatch = name + " element " + std::to_string(element);
    }
    out.element_mismatches += n;
  };
  const std::string scale_name = WeightScaleName(w.name);
  size_t si = params.size();
  for (size_t k = 0; k < params.size(); ++k) {
    if (params[k].name == scale_name) si = k;
  }
  if (si == params.size() || params[si].pieces.size() != w.pieces.size()) {
    mismatch(w.name + " (no matching weight_scale_inv)", 0, 1);
    return;
  }
  const EngineParam& s = params[si];
  std::map<std::string, Shape> shapes;
  for (const HfTensor& h : HfTensorInventory(job.inputs.model)) shapes[h.name] = h.shape;
  const DType td = job.inputs.trainer_dtype;
  std::vector<float> x;
  std::vector<uint8_t> q;
  std::vector<float> scales;
  for (size_t k = 0; k < w.pieces.size(); ++k) {
    const Piece& pc = w.pieces[k];
    const Shape& hs = shapes.at(pc.source);
    const int64_t rows = pc.src.extent[0], cols = pc.src.extent[1];
    x.resize(rows * cols);
    FillSyntheticRegion(job.seed, pc.source, hs, pc.src, x.data());
    // The value as the trainer holds it (trainer dtype), read back as fp32.
    for (float& v : x) {
      unsigned char t[4];
      StoreFloats(&v, 1, td, t);
      v = LoadFloat(t, 0, td);
    }
    q.resize(rows * cols);
    scales.resize(Fp8Blocks(rows) * Fp8Blocks(cols));
    Fp8QuantizeMatrix(x.data(), rows, cols, q.data(), scales.data());
    // Weight bytes, in the piece's row-major order.
    const auto* wb = static_cast<const uint8_t*>(bound[i].data);
    int64_t at = 0;
    ForEachRun(pc.dst, w.shape, [&](int64_t off, int64_t len) {
      if (std::memcmp(wb + off, q.data() + at, len) != 0) {
        for (int64_t e = 0; e < len; ++e) mismatch(w.name, off + e, wb[off + e] != q[at + e]);
      }
      at += len;
    });
    // Scales, compared as bits (a NaN scale never equals the quantizer's).
    const Piece& sp = s.pieces[k];
    const auto* sb = static_cast<const unsigned char*>(bound[si].data);
    at = 0;
    ForEachRun(sp.dst, s.shape, [&](int64_t off, int64_t len) {
      for (int64_t e = 0; e < len; ++e) {
        mismatch(s.name, off + e, std::memcmp(sb + (off + e) * 4, &scales[at + e], 4) != 0);
      }
      at += len;
    });
    out.elements_checked += pc.src.numel() + sp.src.numel();
  }
}

}  // namespace shardsync::job_internal
