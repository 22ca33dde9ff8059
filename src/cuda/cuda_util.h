// Internal helpers of the cuda layer: CUDA error -> Status, driver entry points.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <string>
#include <string_view>

#include "shardsync/status.h"

namespace shardsync::gpu::internal {

inline Status CudaStatus(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return OkStatus();
  std::string msg =
      std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
      e == cudaErrorDevicesUnavailable) {
    return UnavailableError(std::move(msg));
  }
  if (e == cudaErrorMemoryAllocation) return OutOfRangeError(std::move(msg));
  if (e == cudaErrorInvalidValue || e == cudaErrorInvalidDevicePointer ||
      e == cudaErrorInvalidDevice) {
    return InvalidArgumentError(std::move(msg));
  }
  return InternalError(std::move(msg));
}

#define SS_CUDA(expr, what) \
  SS_RETURN_IF_ERROR(::shardsync::gpu::internal::CudaStatus((expr), (what)))

// A copy from pageable host memory to the device returns once the bytes are staged for DMA,
// before they reach `dst` (CUDA's "API synchronization behavior"), and our streams are
// non-blocking, so a kernel launched next on one of them could read the old bytes: the block FP8
// band pass read half-uploaded task descriptors (cudaErrorIllegalAddress) that way. Uploads that
// a kernel reads go on a stream of their own (current device) and are waited for, at most
// `timeout`: no other stream of the process is waited on (a device-wide synchronize would wait
// for the framework's compute too, without a bound).
Status UploadBlocking(void* dst, const void* src, size_t bytes, std::string_view what,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Bytes to cudaMalloc for a buffer of `bytes` that other processes may map (CUDA IPC): a whole
// number of 2 MiB pages from 1 MiB up. An allocation of another size is mapped by the importing
// process with small pages, and kernels there run up to 2x slower on it (TLB misses): on an H200
// a copy between two imported 4 GiB + 12345 B buffers took 4.56 ms against 2.15 ms for whole
// GiB (bench/cuda/ipc_read_probe.cu, docs/benchmarks.md). The owner's own accesses are not
// affected.
inline size_t IpcAllocBytes(size_t bytes) {
  constexpr size_t kPage = size_t{2} << 20;
  if (bytes < (size_t{1} << 20)) return bytes > 0 ? bytes : 1;
  return (bytes + kPage - 1) / kPage * kPage;
}

// cuMemGetAddressRange through the runtime's driver entry point, so the layer does not link
// libcuda (CI machines have no driver; the test binaries must still load there and skip).
Status AllocationRange(const void* ptr, void** base, size_t* size);

}  // namespace shardsync::gpu::internal
