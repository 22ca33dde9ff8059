// The block-FP8 codec's steps on the CPU (fp8.h Fp8Kernels): the CPU packer's, over host memory.
#include <algorithm>
#include <string>

#include "shardsync/fp8.h"

namespace shardsync {
namespace {

class CpuFp8Kernels final : public Fp8Kernels {
 public:
  // fp8.h's block quantizer, block by block (what the host receiver runs per band as it lands).
  Result<std::vector<int64_t>> QuantizeBands(const std::vector<Fp8BandTask>& bands) override {
    std::vector<int64_t> bad(bands.size(), 0);
    for (size_t i = 0; i < bands.size(); ++i) {
      const Fp8BandTask& t = bands[i];
      if (!t.src || !t.weight || !t.scales || t.rows < 1 || t.rows > kFp8Block || t.cols < 1 ||
          t.weight_stride < t.cols || t.scale_stride < Fp8Blocks(t.cols) ||
          (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16)) {
        return InvalidArgumentError("quantize bands: band " + std::to_string(i) +
                                    " is malformed (1..128 rows, f32 / bf16 / f16 values, "
                                    "non-null pointers, strides covering a row)");
      }
      const int es = DTypeSize(t.dtype);
      const auto* src = static_cast<const unsigned char*>(t.src);
      auto* q = static_cast<uint8_t*>(t.weight);
      for (int64_t c0 = 0; c0 < t.cols; c0 += kFp8Block) {
        t.scales[c0 / kFp8Block] = Fp8QuantizeBlock(src + c0 * es, t.dtype, t.cols, t.rows,
                                                    std::min<int64_t>(kFp8Block, t.cols - c0),
                                                    q + c0, t.weight_stride, &bad[i]);
      }
    }
    return bad;
  }

  // Host memory: the amax exchange's partials as the host path takes them.
  Status PartialAmax(const std::vector<Fp8AmaxTask>& tasks, uint32_t* out,
                     int64_t out_len) override {
    std::fill(out, out + out_len, 0u);
    for (size_t i = 0; i < tasks.size(); ++i) {
      const Fp8AmaxTask& t = tasks[i];
      if (t.slot < 0 || t.src_stride < t.cols || t.slot + Fp8Blocks(t.cols) > out_len) {
        return InvalidArgumentError("partial amax: task " + std::to_string(i) +
                                    " is malformed (a stride covering a row, its blocks inside " +
                                    std::to_string(out_len) + " entries)");
      }
      SS_RETURN_IF_ERROR(Fp8PartialAmax(
          {t.src, t.dtype, {t.rows, t.src_stride}, Region::Make({0, 0}, {t.rows, t.cols}), 0},
          out + t.slot));
    }
    return OkStatus();
  }
};

}  // namespace

std::unique_ptr<CodecKernels> MakeCpuBlockQuantizeKernels() {
  return std::make_unique<CpuFp8Kernels>();
}

}  // namespace shardsync
