// Device delta codec throughput (delta_gpu.h) against the HBM bound of the same traffic,
// measured in the same process on the same buffers.
//
// Every timed op is queued behind a ~300 us spin kernel, so the two events around it measure the
// GPU's own time for its kernels (and the gaps between them), not the host's launch latency.
//   encode   EnqueueDeltaEncode(base, next) ... (its Finish after the stop event);
//   decode   EnqueueDeltaDecode over a bucket holding the base: the delta base -> next and then
//            next -> base alternate, so every decode applies a valid delta;
//   bound    one streaming kernel (16-byte loads, 4 in flight per thread) that reads and writes
//            the op's bytes: encode reads base and next and writes the encoded bytes; decode
//            reads the bucket and the encoding and writes the changed elements' bytes (written
//            contiguously: the bound is optimistic for decode's scattered writes).
//   sectors  decode's second bound: the bucket and the encoding read once, plus every 32-byte
//            sector of the bucket holding a changed element read and written once more (counted
//            on the same buffers: a partly written sector costs DRAM a read and a write, and the
//            go / no-go needs the whole bucket read before any write). Still optimistic: the
//            apply also reads the bitmap and the values a second time.
// ratio = bound seconds / op seconds (1.0: the op runs at the HBM speed of its own traffic).
// Medians of --reps runs. Elements change at random with the given density (each changed
// element's top byte flipped, or with --changes step its bit pattern moved by one).
//
// Usage: delta_device_bench [--sizes-mib 64,512] [--densities 0.01,0.04,0.1] [--reps 9]
//                           [--changes flip|step]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "shardsync/delta_gpu.h"
#include "shardsync/gpu.h"

namespace {

using shardsync::Status;
namespace gpu = shardsync::gpu;

#define CHECK_CUDA(x)                                                                          \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

void CheckOk(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

__device__ __forceinline__ uint64_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

__global__ void FillRandom(uint64_t* p, uint64_t words, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < words;
       i += uint64_t{gridDim.x} * blockDim.x)
    p[i] = Hash(i ^ seed);
}

// next = base with each element changed with probability `density`: its top byte flipped
// (`step` false), or its bit pattern moved by one up or down, as an optimizer's step of an ulp
// moves a weight (`step` true: a 2-byte change the packed form carries in a byte).
__global__ void Mutate(const unsigned char* base, unsigned char* next, uint64_t elements, int e,
                       uint32_t threshold, uint64_t seed, bool step) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < elements;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t hsh = Hash(i * 0x9E3779B97F4A7C15ull + seed);
    const bool change = static_cast<uint32_t>(hsh) < threshold;
    uint64_t v = 0;
    for (int b = 0; b < e; ++b) v |= uint64_t{base[i * e + b]} << (8 * b);
    if (change)
      v = step ? v + ((hsh >> 40 & 1) ? 1 : ~uint64_t{0}) : v ^ (uint64_t{0x80} << (8 * (e - 1)));
    for (int b = 0; b < e; ++b) next[i * e + b] = static_cast<unsigned char>(v >> (8 * b));
  }
}

__global__ void Spin(uint64_t ns) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  uint64_t t = t0;
  while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}

// Reads a (na 16-byte vectors) and b (nb), writes nw vectors of out: the bound's traffic.
__global__ void __launch_bounds__(256)
    Bound(const uint4* a, uint64_t na, const uint4* b, uint64_t nb, uint4* out, uint64_t nw,
          unsigned int* sink) {
  constexpr int kU = 4;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const uint64_t n = na + nb;
  uint32_t acc = 0;
  for (uint64_t i0 = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i0 < n; i0 += kU * stride) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint64_t i = i0 + u * stride;
      v[u] = i < na ? a[i] : (i < n ? b[i - na] : make_uint4(0, 0, 0, 0));
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint64_t i = i0 + u * stride;
      if (i < nw) out[i] = v[u];
      acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (acc == 0x12345678u) atomicAdd(sink, 1u);
}

__global__ void CountDiff(const uint64_t* a, const uint64_t* b, uint64_t words,
                          unsigned long long* out) {
  unsigned long long d = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < words;
       i += uint64_t{gridDim.x} * blockDim.x)
    d += a[i] != b[i];
  if (d) atomicAdd(out, d);
}

// Sectors (32 bytes) where a and b differ.
__global__ void CountSectors(const uint4* a, const uint4* b, uint64_t sectors,
                             unsigned long long* out) {
  unsigned long long d = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < sectors;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint4 x0 = a[2 * i], x1 = a[2 * i + 1], y0 = b[2 * i], y1 = b[2 * i + 1];
    d += ((x0.x ^ y0.x) | (x0.y ^ y0.y) | (x0.z ^ y0.z) | (x0.w ^ y0.w) | (x1.x ^ y1.x) |
          (x1.y ^ y1.y) | (x1.z ^ y1.z) | (x1.w ^ y1.w)) != 0;
  }
  if (d) atomicAdd(out, d);
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
  }
  // Spin, start, op, stop; waits for the stop; returns ms.
  template <typename F>
  float Time(cudaStream_t s, F&& op) {
    Spin<<<1, 1, 0, s>>>(300000);
    CHECK_CUDA(cudaEventRecord(a, s));
    op();
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<double> ParseList(const char* s) {
  std::vector<double> v;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    v.push_back(std::strtod(p, &end));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p) break;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> sizes_mib = {64, 512}, densities = {0.01, 0.04, 0.10};
  int reps = 9;
  bool step = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--changes") {
      step = std::string(argv[i + 1]) == "step";
      if (!step && std::string(argv[i + 1]) != "flip") {
        std::fprintf(stderr, "--changes must be flip or step\n");
        return 2;
      }
      continue;
    }
    if (k == "--sizes-mib") {
      sizes_mib = ParseList(argv[i + 1]);
    } else if (k == "--densities") {
      densities = ParseList(argv[i + 1]);
    } else if (k == "--reps") {
      reps = std::max(1, std::atoi(argv[i + 1]));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  std::string why;
  if (!gpu::Available(&why)) {
    std::fprintf(stderr, "no GPU: %s\n", why.c_str());
    return 1;
  }
  CheckOk(gpu::SetDevice(0), "set device");
  auto info = gpu::QueryDevice(0);
  CheckOk(info.status(), "query");
  std::printf("device: %s, %d SMs, HBM peak %.0f GB/s\n", info->name.c_str(), info->sm_count,
              info->hbm_peak_gbps);
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const uint64_t max_bytes =
      static_cast<uint64_t>(*std::max_element(sizes_mib.begin(), sizes_mib.end())) << 20;
  auto scratch = gpu::DeltaGpuScratch::Allocate(max_bytes, 1, 0);
  CheckOk(scratch.status(), "scratch");
  std::printf("scratch: %.1f MiB for buckets up to %llu MiB\n",
              gpu::DeltaGpuScratch::Bytes(max_bytes, 1) / 1048576.0,
              static_cast<unsigned long long>(max_bytes >> 20));
  unsigned char *base, *next, *bucket, *enc_f, *enc_b;
  unsigned int* sink;
  unsigned long long* diff;
  for (auto** p : {&base, &next, &bucket, &enc_f, &enc_b}) CHECK_CUDA(cudaMalloc(p, max_bytes));
  unsigned char *big, *wbuf;  // the sector bound's reads (encoding + touched sectors), writes
  CHECK_CUDA(cudaMalloc(&big, 2 * max_bytes));
  CHECK_CUDA(cudaMalloc(&wbuf, max_bytes));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMalloc(&diff, 8));
  Timer timer;
  const std::chrono::milliseconds kTimeout(60000);
  const int grid = info->sm_count * 8;

  // The memcpy reference: device-to-device copy of the largest bucket (read + write).
  {
    std::vector<float> t;
    for (int r = 0; r < reps; ++r)
      t.push_back(timer.Time(s, [&] {
        CHECK_CUDA(cudaMemcpyAsync(enc_f, base, max_bytes, cudaMemcpyDeviceToDevice, s));
      }));
    std::printf("cudaMemcpy D2D %llu MiB: %.1f GB/s of read + write\n",
                static_cast<unsigned long long>(max_bytes >> 20),
                2.0 * max_bytes / (Median(t) * 1e-3) / 1e9);
  }
  std::printf("%-5s %5s %7s %6s %9s %9s %10s %8s %7s %9s %9s %10s %8s %8s %10s %8s %7s\n", "dtype",
              "MiB", "density", "form", "wire_%", "enc_ms", "enc_bound", "enc_GB/s", "enc_x",
              "dec_ms", "dec_bound", "dec_GB/s", "dec_x", "sect_%", "sect_bound", "sect_x", "ok");
  for (const int e : {2, 1}) {
    const char* dtype = e == 2 ? "bf16" : "e4m3";
    for (const double mib : sizes_mib) {
      const uint64_t n = static_cast<uint64_t>(mib) << 20;
      FillRandom<<<grid, 256, 0, s>>>(reinterpret_cast<uint64_t*>(base), n / 8, 17 + e);
      for (const double density : densities) {
        const uint32_t threshold = static_cast<uint32_t>(density * 4294967296.0);
        Mutate<<<grid, 256, 0, s>>>(base, next, n / e, e, threshold, 99, step);
        CHECK_CUDA(cudaStreamSynchronize(s));
        gpu::DeltaGpuEncodeArgs fa{base, next, n, e, 1, enc_f, "bench"};
        gpu::DeltaGpuEncodeArgs ba{next, base, n, e, 2, enc_b, "bench"};
        auto f = gpu::EncodeDeltaDevice(fa, scratch->get(), s, kTimeout);
        CheckOk(f.status(), "encode base -> next");
        auto b = gpu::EncodeDeltaDevice(ba, scratch->get(), s, kTimeout);
        CheckOk(b.status(), "encode next -> base");
        if (f->result.kind == shardsync::DeltaKind::kFull) {
          std::printf("%-5s %5.0f %7.3f full: skipped\n", dtype, mib, density);
          continue;
        }
        const uint64_t enc_bytes = f->bytes;
        // Encode.
        std::vector<float> te, tb, td, tdb;
        for (int r = 0; r < reps; ++r) {
          te.push_back(timer.Time(s, [&] {
            CheckOk(gpu::EnqueueDeltaEncode(fa, scratch->get(), s), "enqueue encode");
          }));
          CheckOk(gpu::FinishDeltaEncode(scratch->get(), kTimeout).status(), "finish encode");
          tb.push_back(timer.Time(s, [&] {
            Bound<<<grid, 256, 0, s>>>(reinterpret_cast<const uint4*>(base), n / 16,
                                       reinterpret_cast<const uint4*>(next), n / 16,
                                       reinterpret_cast<uint4*>(bucket), enc_bytes / 16, sink);
          }));
        }
        // Decode, alternating base -> next and next -> base over `bucket`.
        CHECK_CUDA(cudaMemcpyAsync(bucket, base, n, cudaMemcpyDeviceToDevice, s));
        const uint64_t changed_bytes = f->result.changed * e;
        bool ok = true;
        for (int r = 0; r < 2 * reps; ++r) {
          const bool fwd = r % 2 == 0;
          gpu::DeltaGpuDecodeArgs d{fwd ? enc_f : enc_b,
                                    fwd ? f->bytes : b->bytes,
                                    bucket,
                                    n,
                                    {"bench", e, fwd ? 1u : 2u}};
          td.push_back(timer.Time(s, [&] {
            CheckOk(gpu::EnqueueDeltaDecode(d, scratch->get(), s), "enqueue decode");
          }));
          const Status st = gpu::FinishDeltaDecode(scratch->get(), kTimeout);
          if (!st.ok()) {
            std::fprintf(stderr, "decode: %s\n", st.ToString().c_str());
            ok = false;
          }
        }
        for (int r = 0; r < reps; ++r)
          tdb.push_back(timer.Time(s, [&] {
            Bound<<<grid, 256, 0, s>>>(
                reinterpret_cast<const uint4*>(next), n / 16, reinterpret_cast<const uint4*>(enc_f),
                enc_bytes / 16, reinterpret_cast<uint4*>(enc_b) + n / 32, changed_bytes / 16, sink);
          }));
        // The sector bound: sectors where base and next differ, counted on the device.
        CHECK_CUDA(cudaMemsetAsync(diff, 0, 8, s));
        CountSectors<<<grid, 256, 0, s>>>(reinterpret_cast<const uint4*>(base),
                                          reinterpret_cast<const uint4*>(next), n / 32, diff);
        unsigned long long touched = 0;
        CHECK_CUDA(cudaMemcpyAsync(&touched, diff, 8, cudaMemcpyDeviceToHost, s));
        CHECK_CUDA(cudaStreamSynchronize(s));
        const uint64_t touched_bytes = touched * 32;
        std::vector<float> tds;
        for (int r = 0; r < reps; ++r)
          tds.push_back(timer.Time(s, [&] {
            Bound<<<grid, 256, 0, s>>>(reinterpret_cast<const uint4*>(next), n / 16,
                                       reinterpret_cast<const uint4*>(big),
                                       (enc_bytes + touched_bytes) / 16,
                                       reinterpret_cast<uint4*>(wbuf), touched_bytes / 16, sink);
          }));
        // After an even number of decodes the bucket holds the base again.
        CHECK_CUDA(cudaMemsetAsync(diff, 0, 8, s));
        CountDiff<<<grid, 256, 0, s>>>(reinterpret_cast<const uint64_t*>(bucket),
                                       reinterpret_cast<const uint64_t*>(base), n / 8, diff);
        unsigned long long nd = 0;
        CHECK_CUDA(cudaMemcpyAsync(&nd, diff, 8, cudaMemcpyDeviceToHost, s));
        CHECK_CUDA(cudaStreamSynchronize(s));
        ok = ok && nd == 0;
        const float me = Median(te), mb = Median(tb), md = Median(td), mdb = Median(tdb),
                    mds = Median(tds);
        std::printf(
            "%-5s %5.0f %7.3f %6s %9.2f %9.4f %10.4f %8.0f %7.3f %9.4f %9.4f %10.0f %8.3f %8.1f "
            "%10.4f %8.3f %7s\n",
            dtype, mib, density, shardsync::DeltaKindName(f->result.kind).data(),
            100.0 * enc_bytes / n, me, mb, n / (me * 1e-3) / 1e9, mb / me, md, mdb,
            n / (md * 1e-3) / 1e9, mdb / md, 100.0 * touched_bytes / n, mds, mds / md,
            ok ? "yes" : "NO");
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
