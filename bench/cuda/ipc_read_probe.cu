// Exploration benchmark (not built by CMake): does a kernel read memory of another process on the
// same GPU, mapped with cudaIpcOpenMemHandle, as fast as its own? (Issue 28: one kernel packing
// for every co-located Megatron trainer read three quarters of its sources that way and ran 1.8x
// slower than the bytes' share; docs/benchmarks.md.) Build: nvcc -O3 -arch=sm_90 -o ipc_read_probe
// ipc_read_probe.cu. Run: `ipc_read_probe MODE [GiB]`, MODE = idle | poll | busy: what the
// exporting process does while the other measures (blocks on a pipe; polls cudaStreamQuery on an
// idle stream as the sessions do; launches small kernels). Optional: blocks per SM (8) and loads
// in flight per thread (4, or 1), and KiB per block's chunk (0: grid-stride; else each block copies
// chunks of its own, as the batch kernel does): `ipc_read_probe idle 4 3 1 256`.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__global__ void Copy(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a0 = __ldcs(in + i), a1 = __ldcs(in + i + stride), a2 = __ldcs(in + i + 2 * stride),
          a3 = __ldcs(in + i + 3 * stride);
    out[i] = a0;
    out[i + stride] = a1;
    out[i + 2 * stride] = a2;
    out[i + 3 * stride] = a3;
  }
  for (; i < n; i += stride) out[i] = __ldcs(in + i);
}

// One load in flight per thread (the landed pack kernel keeps about two): how a latency-bound
// reader fares on another process's memory.
__global__ void CopyOne(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    out[i] = in[i];
  }
}

// The batch kernel's way through memory: each block copies whole chunks of `chunk` vectors of
// its own (block b takes chunks b, b + grid, ...), two streams per thread over the halves.
__global__ void CopyChunked(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t n,
                            int64_t chunk) {
  for (int64_t c = blockIdx.x; c * chunk < n; c += gridDim.x) {
    const int64_t base = c * chunk, half = min(chunk, n - base) / 2;
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const uint4 a = in[base + i], b = in[base + half + i];
      out[base + i] = a;
      out[base + half + i] = b;
    }
  }
}

__global__ void Spin(int64_t cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

struct Handles {
  cudaIpcMemHandle_t src, dst;
};

static void Exporter(int wfd, int rfd, size_t bytes, const char* mode, int small) {
  for (int i = 0; i < small; ++i) {  // small allocations first, as a rank's counters and sums
    void* p = nullptr;
    CK(cudaMalloc(&p, 8 + 4096 * (i % 7)));
  }
  CK(cudaSetDevice(0));
  void *src = nullptr, *dst = nullptr;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemset(src, 0x5a, bytes));
  CK(cudaDeviceSynchronize());
  Handles h;
  CK(cudaIpcGetMemHandle(&h.src, src));
  CK(cudaIpcGetMemHandle(&h.dst, dst));
  if (write(wfd, &h, sizeof(h)) != sizeof(h)) std::exit(1);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  char c;
  if (std::strcmp(mode, "idle") == 0) {
    if (read(rfd, &c, 1) != 1) std::exit(1);
  } else {
    fcntl(rfd, F_SETFL, O_NONBLOCK);
    while (read(rfd, &c, 1) != 1) {
      if (std::strcmp(mode, "busy") == 0) {
        Spin<<<1, 32, 0, s>>>(100000);
        CK(cudaStreamSynchronize(s));
      } else {
        (void)cudaStreamQuery(s);
      }
    }
  }
  CK(cudaFree(src));
  CK(cudaFree(dst));
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "idle";
  const size_t bytes = (argc > 2 ? std::atoll(argv[2]) : 2) << 30;
  // Blocks per SM of the copy kernel (8 by default) and loads in flight per thread (4 or 1).
  const int per_sm = argc > 3 ? std::atoi(argv[3]) : 8;
  const int unroll = argc > 4 ? std::atoi(argv[4]) : 4;
  // KiB per block's chunk (CopyChunked, as the batch kernel walks memory); 0: grid-stride copy.
  const int64_t chunk_kib = argc > 5 ? std::atoll(argv[5]) : 0;
  // Bytes added to every allocation (the bench's buffers are not whole GiB: 4,106,660,608 B) and
  // small allocations the exporter makes first.
  const size_t extra = argc > 6 ? std::atoll(argv[6]) : 0;
  const int small = argc > 7 ? std::atoi(argv[7]) : 0;
  int up[2], down[2];
  if (pipe(up) || pipe(down)) return 1;
  const pid_t pid = fork();  // before any CUDA call: both processes initialize their own
  if (pid == 0) {
    Exporter(up[1], down[0], bytes + extra, mode, small);
    return 0;
  }
  Handles h;
  if (read(up[0], &h, sizeof(h)) != sizeof(h)) return 1;
  CK(cudaSetDevice(0));
  void *rsrc = nullptr, *rdst = nullptr, *lsrc = nullptr, *ldst = nullptr;
  CK(cudaIpcOpenMemHandle(&rsrc, h.src, cudaIpcMemLazyEnablePeerAccess));
  CK(cudaIpcOpenMemHandle(&rdst, h.dst, cudaIpcMemLazyEnablePeerAccess));
  CK(cudaMalloc(&lsrc, bytes + extra));
  CK(cudaMalloc(&ldst, bytes + extra));
  CK(cudaMemset(lsrc, 0x5a, bytes));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  struct Case {
    const char* name;
    void *in, *out;
  } cases[] = {{"local -> local", lsrc, ldst},
               {"ipc   -> local", rsrc, ldst},
               {"local -> ipc  ", lsrc, rdst},
               {"ipc   -> ipc  ", rsrc, rdst}};
  const int64_t n = static_cast<int64_t>(bytes / 16);
  std::printf(
      "exporter %s, %zu MiB per copy, %d SMs, %d blocks per SM, %d loads in flight, chunks of "
      "%lld KiB, allocations + %zu B, %d small ones first\n",
      mode, bytes >> 20, sms, per_sm, unroll, static_cast<long long>(chunk_kib), extra, small);
  for (int round = 0; round < 2; ++round) {
    for (const Case& c : cases) {
      for (int kind = 0; kind < 2; ++kind) {
        std::vector<float> ms;
        for (int r = 0; r < 11; ++r) {
          CK(cudaEventRecord(a, s));
          if (kind == 0 && chunk_kib > 0) {
            CopyChunked<<<sms * per_sm, 256, 0, s>>>(static_cast<const uint4*>(c.in),
                                                     static_cast<uint4*>(c.out), n,
                                                     chunk_kib * 1024 / 16);
          } else if (kind == 0 && unroll == 1) {
            CopyOne<<<sms * per_sm, 256, 0, s>>>(static_cast<const uint4*>(c.in),
                                                 static_cast<uint4*>(c.out), n);
          } else if (kind == 0) {
            Copy<<<sms * per_sm, 256, 0, s>>>(static_cast<const uint4*>(c.in),
                                              static_cast<uint4*>(c.out), n);
          } else {
            CK(cudaMemcpyAsync(c.out, c.in, bytes, cudaMemcpyDeviceToDevice, s));
          }
          CK(cudaEventRecord(b, s));
          CK(cudaEventSynchronize(b));
          float t = 0;
          CK(cudaEventElapsedTime(&t, a, b));
          if (r > 0) ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        const float med = ms[ms.size() / 2];
        std::printf("round %d  %s  %-10s median %.3f ms  %.0f GB/s (min %.3f max %.3f)\n", round,
                    c.name, kind == 0 ? "kernel" : "cudaMemcpy", med, 2.0 * bytes / med / 1e6,
                    ms.front(), ms.back());
      }
    }
  }
  CK(cudaIpcCloseMemHandle(rsrc));
  CK(cudaIpcCloseMemHandle(rdst));
  if (write(down[1], "x", 1) != 1) return 1;
  int st = 0;
  waitpid(pid, &st, 0);
  return 0;
}
