#include "cuda/cuda_util.h"

#include <string>

namespace shardsync::gpu {

namespace internal {

Status UploadBlocking(void* dst, const void* src, size_t bytes, std::string_view what) {
  if (bytes == 0) return OkStatus();
  SS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), what);
  SS_CUDA(cudaDeviceSynchronize(), what);
  return OkStatus();
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
