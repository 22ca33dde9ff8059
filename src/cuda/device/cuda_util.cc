#include "cuda/cuda_util.h"

#include <string>
#include <thread>

namespace shardsync::gpu {

namespace internal {

Status UploadBlocking(void* dst, const void* src, size_t bytes, std::string_view what,
                      std::chrono::milliseconds timeout) {
  if (bytes == 0) return OkStatus();
  cudaStream_t s = nullptr;
  SS_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), what);
  Status st = CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), what);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (st.ok()) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      st = CudaStatus(e, what);
    } else if (std::chrono::steady_clock::now() > deadline) {
      st = DeadlineExceededError(std::string(what) + ": an upload of " + std::to_string(bytes) +
                                 " bytes did not land within " + std::to_string(timeout.count()) +
                                 " ms");
    } else {
      std::this_thread::yield();
    }
  }
  cudaStreamDestroy(s);
  return st;
}

Status AllocationRange(const void* ptr, void** base, size_t* size) {
  using Fn = int (*)(unsigned long long*, size_t*, unsigned long long);
  static Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<Fn>(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  if (!fn) return InternalError("cuMemGetAddressRange entry point not found in the driver");
  unsigned long long b = 0;
  const int rc = fn(&b, size, reinterpret_cast<unsigned long long>(ptr));
  if (rc != 0) {
    return InvalidArgumentError("cuMemGetAddressRange failed (CUresult " + std::to_string(rc) +
                                "): pointer is not device memory from cudaMalloc");
  }
  *base = reinterpret_cast<void*>(b);
  return OkStatus();
}

}  // namespace internal

}  // namespace shardsync::gpu
