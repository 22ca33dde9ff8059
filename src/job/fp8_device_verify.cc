// Device mode's element check of block-FP8 parameters (fp8_verify.h VerifyFp8Device): per piece of
// an e4m3 weight, the synthetic values as the trainer holds them are generated on the GPU
// (FillSyntheticDevice), quantized by the GPU quantize-pack (held to the CPU quantizer bit for bit
// by tests/cuda/gpu_fp8_test.cc) and compared, every byte and every scale's bits, with what the
// sync landed in the engine's parameters. A CPU check of qwen3-8b's 7 billion quantized elements
// would take minutes; this takes about a second.
#include <cstring>
#include <map>
#include <vector>

#include "job/fp8_verify.h"
#include "shardsync/fp8.h"
#include "shardsync/gpu.h"
#include "shardsync/synthetic.h"

#if defined(SHARDSYNC_HAVE_CUDA)
#include "cuda/kernels/fp8_kernels.h"
#endif

namespace shardsync::job_internal {

Status VerifyFp8Device(const JobSpec& job, const std::vector<EngineParam>& params,
                       const std::vector<DestBinding>& dests, int device, void* stream,
                       RankResult& out) {
#if defined(SHARDSYNC_HAVE_CUDA)
  std::map<std::string, Shape> shapes;
  for (const HfTensor& h : HfTensorInventory(job.inputs.model)) shapes[h.name] = h.shape;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index[params[i].name] = i;
  const DType td = job.inputs.trainer_dtype;
  std::unique_ptr<gpu::DeviceBuffer> values, wire;
  std::vector<uint8_t> weight, scales, expect;
  auto mismatch = [&](const std::string& name, int64_t element) {
    if (out.element_mismatches++ == 0)
      out.first_mismatch = name + " element " + std::to_string(element);
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& w = params[i];
    if (w.dtype != DType::kF8E4M3) continue;
    auto it = index.find(WeightScaleName(w.name));
    if (it == index.end() || params[it->second].pieces.size() != w.pieces.size()) {
      return InternalError("engine parameter '" + w.name + "' has no matching weight_scale_inv");
    }
    const EngineParam& s = params[it->second];
    weight.resize(w.numel());
    scales.resize(s.numel() * 4);
    SS_RETURN_IF_ERROR(gpu::CopyToHost(weight.data(), dests[i].data, weight.size()));
    SS_RETURN_IF_ERROR(gpu::CopyToHost(scales.data(), dests[it->second].data, scales.size()));
    for (size_t k = 0; k < w.pieces.size(); ++k) {
      const Piece& pc = w.pieces[k];
      const Shape& hs = shapes.at(pc.source);
      const int64_t rows = pc.src.extent[0], cols = pc.src.extent[1];
      const size_t vbytes = rows * cols * DTypeSize(td), wbytes = Fp8WireBytes(rows, cols);
      if (!values || values->bytes() < vbytes) {
        values.reset();
        SS_ASSIGN_OR_RETURN(values, gpu::DeviceBuffer::Allocate(vbytes, device));
      }
      if (!wire || wire->bytes() < wbytes) {
        wire.reset();
        SS_ASSIGN_OR_RETURN(wire, gpu::DeviceBuffer::Allocate(wbytes, device));
      }
      SS_RETURN_IF_ERROR(gpu::FillSyntheticDevice(job.seed, SyntheticFor(pc.source, hs), hs, pc.src,
                                                  td, values->data(), stream));
      gpu::Fp8QuantizeTask t;
      t.src = values->data();
      t.dtype = td;
      t.src_row_stride = cols;
      t.rows = rows;
      t.cols = cols;
      t.out = wire->data();
      SS_ASSIGN_OR_RETURN(gpu::Fp8DeviceResult r, gpu::Fp8QuantizePackDevice({t}, 1, stream));
      (void)r;  // non-finite synthetic values do not occur; the bytes say the rest
      expect.resize(wbytes);
      SS_RETURN_IF_ERROR(gpu::CopyToHost(expect.data(), wire->data(), wbytes));
      int64_t at = 0;
      ForEachRun(pc.dst, w.shape, [&](int64_t off, int64_t len) {
        if (std::memcmp(weight.data() + off, expect.data() + at, len) != 0) {
          for (int64_t e = 0; e < len; ++e) {
            if (weight[off + e] != expect[at + e]) mismatch(w.name, off + e);
          }
        }
        at += len;
      });
      at = (rows * cols + 7) / 8 * 8;
      ForEachRun(s.pieces[k].dst, s.shape, [&](int64_t off, int64_t len) {
        for (int64_t e = 0; e < len; ++e) {
          if (std::memcmp(scales.data() + (off + e) * 4, expect.data() + at + 4 * e, 4) != 0) {
            mismatch(s.name, off + e);
          }
        }
        at += 4 * len;
      });
      out.elements_checked += pc.src.numel() + s.pieces[k].src.numel();
    }
  }
  return OkStatus();
#else
  (void)job, (void)params, (void)dests, (void)device, (void)stream, (void)out;
  return UnimplementedError("--device cuda: this build has no CUDA");
#endif
}

}  // namespace shardsync::job_internal
