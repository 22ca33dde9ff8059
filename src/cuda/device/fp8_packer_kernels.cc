// The block-FP8 codec's steps on the CUDA packer's device (fp8.h Fp8Kernels): a receiver's quantize
// pass over staged bands (a prepared block-quantize batch, fp8_batch.cu) and the amax exchange's
// partials (fp8_amax.cu), each prepared once per set of tasks and launched on the packer's stream.
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda/device/packer_access.h"
#include "cuda/kernels/fp8_kernels.h"
#include "shardsync/fp8.h"
#include "shardsync/gpu.h"

namespace shardsync::gpu {
namespace {

class CudaFp8Kernels final : public Fp8Kernels {
 public:
  explicit CudaFp8Kernels(PackerAccess& packer) : packer_(packer) {}
  ~CudaFp8Kernels() override {
    amax_.clear();
    bands_.clear();
  }

  // One bucket per band so a non-finite count names its band; the e4m3 words are "read back" from
  // where they were written (local memory: nothing else to check).
  Result<std::vector<int64_t>> QuantizeBands(const std::vector<Fp8BandTask>& bands) override {
    SS_RETURN_IF_ERROR(packer_.Ready());
    if (bands.empty()) return std::vector<int64_t>{};
    std::string key(1, 'q');  // field by field: no padding bytes in the key
    for (const Fp8BandTask& b : bands) {
      const int64_t f[] = {reinterpret_cast<int64_t>(b.src),
                           static_cast<int64_t>(b.dtype),
                           b.rows,
                           b.cols,
                           reinterpret_cast<int64_t>(b.weight),
                           b.weight_stride,
                           reinterpret_cast<int64_t>(b.scales),
                           b.scale_stride};
      key.append(reinterpret_cast<const char*>(f), sizeof(f));
    }
    auto it = bands_.find(key);
    if (it == bands_.end()) {
      BatchSpec spec;
      spec.mode = BatchMode::kPack;
      for (size_t i = 0; i < bands.size(); ++i) {
        const Fp8BandTask& b = bands[i];
        EncodedTask t;
        t.encoding = Encoding::kQuantize;
        t.src = b.src;
        t.dtype = b.dtype;
        t.src_stride = b.cols;
        t.rows = b.rows;
        t.cols = b.cols;
        t.weight = b.weight;
        t.weight_stride = b.weight_stride;
        t.scales = b.scales;
        t.scale_stride = b.scale_stride;
        t.landed_weight = b.weight;
        t.landed_weight_stride = b.weight_stride;
        t.landed_scales = b.scales;
        t.landed_scale_stride = b.scale_stride;
        t.bucket = static_cast<int32_t>(i);
        t.wire_offset = 0;
        spec.encoded.push_back(t);
        spec.bucket_bytes.push_back(Fp8WireBytes(b.rows, b.cols));
        spec.copy_bytes.push_back(0);
      }
      auto batch = CopyBatch::Prepare(spec, packer_.device());
      if (!batch.ok()) {
        Status e = batch.status();
        return e.Annotate("cuda packer: quantizing " + std::to_string(bands.size()) +
                          " staged block-FP8 bands");
      }
      if (bands_.size() > 4096) bands_.clear();
      it = bands_.emplace(key, std::move(batch).value()).first;
    }
    SS_RETURN_IF_ERROR(it->second->Launch(packer_.stream()));
    SS_RETURN_IF_ERROR(packer_.Wait());
    return it->second->NonFinite();
  }

  Status PartialAmax(const std::vector<Fp8AmaxTask>& tasks, uint32_t* out,
                     int64_t out_len) override {
    SS_RETURN_IF_ERROR(packer_.Ready());
    std::string key(1, 'a');
    key.append(reinterpret_cast<const char*>(&out_len), sizeof(out_len));
    std::vector<Fp8AmaxPart> parts;
    for (const Fp8AmaxTask& t : tasks) {
      const int64_t f[] = {reinterpret_cast<int64_t>(t.src),
                           static_cast<int64_t>(t.dtype),
                           t.src_stride,
                           t.rows,
                           t.cols,
                           t.slot};
      key.append(reinterpret_cast<const char*>(f), sizeof(f));
      parts.push_back({t.src, t.dtype, t.src_stride, t.rows, t.cols, t.slot});
    }
    auto it = amax_.find(key);
    if (it == amax_.end()) {
      auto batch = Fp8AmaxBatch::Prepare(parts, out_len, packer_.device());
      if (!batch.ok()) {
        Status e = batch.status();
        return e.Annotate("cuda packer: partial amaxes of " + std::to_string(tasks.size()) +
                          " shared block-FP8 bands");
      }
      if (amax_.size() > 64) amax_.clear();
      it = amax_.emplace(key, std::move(batch).value()).first;
    }
    SS_RETURN_IF_ERROR(it->second->Launch(packer_.stream()));
    SS_RETURN_IF_ERROR(packer_.Wait());
    if (out_len > 0) std::memcpy(out, it->second->host(), static_cast<size_t>(out_len) * 4);
    return OkStatus();
  }

 private:
  PackerAccess& packer_;
  std::map<std::string, std::unique_ptr<CopyBatch>> bands_;    // QuantizeBands', by tasks
  std::map<std::string, std::unique_ptr<Fp8AmaxBatch>> amax_;  // PartialAmax's, by tasks
};

}  // namespace

std::unique_ptr<CodecKernels> MakeCudaBlockQuantizeKernels(PackerAccess& packer) {
  return std::make_unique<CudaFp8Kernels>(packer);
}

}  // namespace shardsync::gpu
