// Exploration benchmark (not built by CMake): the prepared block-FP8 pack of cuda_ipc pairs
// (fp8_batch.cu, through CopyBatch::Prepare) on qwen3-8b's shapes as ONE trainer (fsdp=1, bf16)
// sends them to SGLang tp2 pp2 on the same GPU: 36 layers x 7 quantized linears cut for tp 2
// (column-parallel rows, row-parallel columns), embed_tokens / lm_head copied (vocab-parallel
// rows). Times, with CUDA events, the whole prepared pack, its quantize kernels alone, its copies
// alone and cudaMemcpy of the same HBM traffic, for each SHARDSYNC_FP8_STAGES value given
// (0: one CTA per block), and checks every variant's packed and landed sums agree.
// Build, from the repo root after a CUDA build in build/:
//   nvcc -O3 -std=c++20 -arch=sm_90 -Iinclude -Isrc bench/cuda/fp8_probe.cu -o build/fp8_probe \
//     -Xlinker --start-group build/src/cuda/libss_cuda.a build/src/common/libss_common.a \
//     build/src/transport/libss_transport.a build/src/store/libss_store.a -Xlinker --end-group
// Run: [PROBE_LAYERS=n] build/fp8_probe [reps] [stages...]   (default: 10 reps, stages 2)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "shardsync/fp8.h"
#include "shardsync/gpu.h"

using namespace shardsync;
using namespace shardsync::gpu;

namespace {

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

template <typename T>
T Must(Result<T> r, const char* what) {
  if (!r.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, r.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(r).value();
}
void Must(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// bf16 values of weight-like magnitudes from a hash of the index.
__global__ void Fill(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    const float v = (static_cast<float>(h & 0xffff) - 32768.f) * 3e-7f * (1 + ((h >> 16) & 7));
    p[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);
  }
}

struct Layout {
  BatchSpec full, quant, copies;
  double quant_bytes = 0, copy_bytes = 0;  // HBM traffic: read once + write once
};

constexpr int64_t kH = 4096, kI = 12288, kQ = 4096, kKV = 1024, kVocab = 151936;
int64_t kLayers = 36;

Layout Build(unsigned char* src, unsigned char* dst, unsigned char* scales, unsigned char* csrc,
             unsigned char* cdst, unsigned char* lsums) {
  Layout L;
  int64_t s_at = 0, d_at = 0, sc_at = 0;  // bytes into the three buffers
  std::vector<int64_t> qwire, cbytes;
  auto bucket_of = [&](int pp, int tp, int64_t layer) {  // 5 buckets per engine rank
    return (pp * 2 + tp) * 6 + static_cast<int>((layer % 18) / 4 % 5);
  };
  const int nb = 24;
  qwire.assign(nb, 0);
  cbytes.assign(nb, 0);
  for (int64_t l = 0; l < kLayers; ++l) {
    const int pp = static_cast<int>(l * 2 / kLayers);
    // HF tensors of the layer: [rows, cols], bf16.
    struct Hf {
      int64_t rows, cols;
      unsigned char* p;
    };
    auto hf = [&](int64_t r, int64_t c) {
      Hf h{r, c, src + s_at};
      s_at += r * c * 2;
      return h;
    };
    const Hf q = hf(kQ, kH), k = hf(kKV, kH), v = hf(kKV, kH), o = hf(kH, kQ), g = hf(kI, kH),
             u = hf(kI, kH), dn = hf(kH, kI);
    for (int tp = 0; tp < 2; ++tp) {
      const int b = bucket_of(pp, tp, l);
      struct Param {
        int64_t rows, cols;
        unsigned char* w;
        float* s;
      };
      auto param = [&](int64_t r, int64_t c) {
        Param p{r, c, dst + d_at, reinterpret_cast<float*>(scales + sc_at)};
        d_at += r * c;
        sc_at += Fp8Blocks(r) * Fp8Blocks(c) * 4;
        return p;
      };
      const Param qkv = param((kQ + 2 * kKV) / 2, kH), op = param(kH, kQ / 2),
                  gu = param(2 * kI / 2, kH), dp = param(kH, kI / 2);
      // (HF tensor, its rows / cols region) -> (param, first row)
      auto task = [&](const Hf& h, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                      const Param& p, int64_t pr) {
        EncodedTask t;
        t.src = h.p + (r0 * h.cols + c0) * 2;
        t.dtype = DType::kBF16;
        t.src_stride = h.cols;
        t.rows = rows;
        t.cols = cols;
        t.weight = p.w + pr * p.cols;
        t.weight_stride = p.cols;
        t.scales = p.s + (pr / 128) * Fp8Blocks(p.cols);
        t.scale_stride = Fp8Blocks(p.cols);
        t.landed_weight = t.weight;
        t.landed_weight_stride = t.weight_stride;
        t.landed_scales = t.scales;
        t.landed_scale_stride = t.scale_stride;
        t.bucket = b;
        t.wire_offset = qwire[b];
        qwire[b] += Fp8WireBytes(rows, cols);
        L.full.encoded.push_back(t);
        L.quant_bytes += rows * cols * 3.0 + Fp8Blocks(rows) * Fp8Blocks(cols) * 4.0;
      };
      task(q, tp * kQ / 2, 0, kQ / 2, kH, qkv, 0);
      task(k, tp * kKV / 2, 0, kKV / 2, kH, qkv, kQ / 2);
      task(v, tp * kKV / 2, 0, kKV / 2, kH, qkv, kQ / 2 + kKV / 2);
      task(o, 0, tp * kQ / 2, kH, kQ / 2, op, 0);
      task(g, tp * kI / 2, 0, kI / 2, kH, gu, 0);
      task(u, tp * kI / 2, 0, kI / 2, kH, gu, kI / 2);
      task(dn, 0, tp * kI / 2, kH, kI / 2, dp, 0);
    }
  }
  // embed_tokens to pp 0, lm_head to pp 1: vocab rows split by tp, bucket 5 of each rank.
  for (int which = 0; which < 2; ++which) {
    for (int tp = 0; tp < 2; ++tp) {
      const int b = (which * 2 + tp) * 6 + 5;
      const int64_t n = kVocab / 2 * kH;
      CopyRun r;
      r.in = csrc + (which * kVocab + tp * kVocab / 2) * kH * 2;
      r.out = cdst + (which * kVocab + tp * kVocab / 2) * kH * 2;
      r.row_elems = n;
      r.bucket = b;
      r.wire_offset = cbytes[b];
      cbytes[b] += n * 2;
      L.full.runs.push_back(r);
      CopyRun lr = r;
      lr.in = r.out;
      L.full.landed_runs.push_back(lr);
      L.copy_bytes += n * 4.0;
    }
  }
  L.full.mode = BatchMode::kPack;
  L.full.in_dtype = L.full.out_dtype = DType::kBF16;
  for (int b = 0; b < nb; ++b) {
    L.full.bucket_bytes.push_back(qwire[b] + cbytes[b]);
    L.full.copy_bytes.push_back(cbytes[b]);
    L.full.landed_sums.push_back(lsums + 8 * b);
  }
  L.quant = L.full;
  L.quant.runs.clear();
  L.quant.landed_runs.clear();
  L.quant.copy_bytes.assign(nb, 0);
  L.copies = L.full;
  L.copies.encoded.clear();
  L.copies.bucket_bytes = L.full.copy_bytes;
  L.copies.copy_bytes.clear();
  std::printf(
      "probe: %zu quantize ops, %.2f GB of quantize traffic, %.2f GB of copies, %d buckets\n",
      L.full.encoded.size(), L.quant_bytes / 1e9, L.copy_bytes / 1e9, nb);
  return L;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median ms of `reps` signaled launches (after 2 warm-ups).
double Time(CopyBatch& b, cudaStream_t s, int reps, uint64_t* seq) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> ms;
  for (int i = 0; i < reps + 2; ++i) {
    CK(cudaEventRecord(e0, s));
    Must(b.LaunchSignaled(s, ++*seq), "launch");
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return Median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
  if (const char* l = std::getenv("PROBE_LAYERS")) kLayers = std::atoi(l);
  std::vector<std::string> variants;
  for (int i = 2; i < argc; ++i) variants.push_back(argv[i]);
  if (variants.empty()) variants.push_back("2");
  CK(cudaSetDevice(0));
  int64_t src_bytes = 0, dst_bytes = 0, sc_bytes = 0;
  for (int64_t l = 0; l < kLayers; ++l) {
    src_bytes += (2 * kQ * kH + 2 * kKV * kH + 3 * kI * kH) * 2;
  }
  dst_bytes = src_bytes / 2;
  sc_bytes = 64 << 20;
  const int64_t c_bytes = 2 * kVocab * kH * 2;
  unsigned char *src, *dst, *scales, *csrc, *cdst, *lsums;
  CK(cudaMalloc(&src, src_bytes));
  CK(cudaMalloc(&dst, dst_bytes));
  CK(cudaMalloc(&scales, sc_bytes));
  CK(cudaMalloc(&csrc, c_bytes));
  CK(cudaMalloc(&cdst, c_bytes));
  CK(cudaMalloc(&lsums, 8 * 64));
  CK(cudaMemset(lsums, 0, 8 * 64));
  Fill<<<4096, 256>>>(reinterpret_cast<uint16_t*>(src), src_bytes / 2, 1);
  Fill<<<4096, 256>>>(reinterpret_cast<uint16_t*>(csrc), c_bytes / 2, 2);
  CK(cudaDeviceSynchronize());
  Layout L = Build(src, dst, scales, csrc, cdst, lsums);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t seq = 0;
  // cudaMemcpy moving the same HBM traffic (half of it read, half written).
  const double bound = L.quant_bytes + L.copy_bytes;
  double memcpy_ms = 0;
  {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<double> ms;
    const int64_t n = static_cast<int64_t>(bound / 2) / 16 * 16;
    unsigned char *tmp, *from;
    CK(cudaMalloc(&tmp, n));
    CK(cudaMalloc(&from, n));
    CK(cudaMemset(from, 1, n));
    for (int i = 0; i < reps + 2; ++i) {
      CK(cudaEventRecord(e0, s));
      CK(cudaMemcpyAsync(tmp, from, n, cudaMemcpyDeviceToDevice, s));
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float t = 0;
      CK(cudaEventElapsedTime(&t, e0, e1));
      if (i >= 2) ms.push_back(t);
    }
    CK(cudaFree(tmp));
    CK(cudaFree(from));
    memcpy_ms = Median(ms);
    std::printf("memcpy of the bound's traffic (%.2f GB): %.3f ms = %.0f GB/s\n", bound / 1e9,
                memcpy_ms, bound / memcpy_ms / 1e6);
  }
  {
    auto c = Must(CopyBatch::Prepare(L.copies, 0), "prepare copies");
    const double ms = Time(*c, s, reps, &seq);
    std::printf("copies alone (landed bf16 pack): %.3f ms = %.0f GB/s\n", ms,
                L.copy_bytes / ms / 1e6);
  }
  std::vector<uint64_t> ref_sums, ref_landed;
  bool agree = true;
  for (const std::string& v : variants) {
    setenv("SHARDSYNC_FP8_STAGES", v.c_str(), 1);
    auto q = Must(CopyBatch::Prepare(L.quant, 0), "prepare quantize");
    const double qms = Time(*q, s, reps, &seq);
    auto f = Must(CopyBatch::Prepare(L.full, 0), "prepare full");
    const double fms = Time(*f, s, reps, &seq);
    const auto sums = Must(f->Sums(), "sums");
    auto landed = Must(f->LandedSums(), "landed");
    const auto nf = f->NonFinite();
    int64_t bad = 0;
    for (int64_t x : nf) bad += x;
    // The landed sums accumulate over every launch; the packed sums are per launch.
    if (ref_sums.empty()) ref_sums = sums;
    agree = agree && sums == ref_sums && landed == sums && bad == 0;
    std::printf(
        "stages %s: quantize kernels %.3f ms = %.0f GB/s; whole pack %.3f ms = %.0f GB/s = %.3fx "
        "of memcpy; sums %s, landed %s\n",
        v.c_str(), qms, L.quant_bytes / qms / 1e6, fms, bound / fms / 1e6, memcpy_ms / fms,
        sums == ref_sums ? "as the first variant" : "DIFFER",
        landed == sums ? "= packed" : "DIFFER");
  }
  std::printf("%s\n", agree ? "every variant's sums agree" : "SUMS DISAGREE");
  return agree ? 0 : 1;
}
