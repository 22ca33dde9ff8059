// Device plumbing of gpu.h: device queries, streams, allocations and synchronous copies.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "cuda/cuda_util.h"
#include "shardsync/gpu.h"

namespace shardsync::gpu {

using internal::CudaStatus;

bool Available(std::string* reason) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (reason) {
      *reason = e != cudaSuccess ? std::string("no CUDA device: ") + cudaGetErrorString(e)
                                 : "no CUDA device";
    }
    cudaGetLastError();
    return false;
  }
  return true;
}

Result<int> DeviceCount() {
  int n = 0;
  SS_CUDA(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  return n;
}

Result<DeviceInfo> QueryDevice(int device) {
  cudaDeviceProp p{};
  SS_CUDA(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties " + std::to_string(device));
  DeviceInfo info;
  info.index = device;
  info.name = p.name;
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) == cudaSuccess) info.pci_bus_id = bus;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.sm_count = p.multiProcessorCount;
  info.total_bytes = static_cast<int64_t>(p.totalGlobalMem);
  info.l2_bytes = p.l2CacheSize;
  int clock_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device);
  info.hbm_peak_gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
  return info;
}

Status SetDevice(int device) {
  SS_CUDA(cudaSetDevice(device), "cudaSetDevice " + std::to_string(device));
  return OkStatus();
}

Result<PeerInfo> DevicePeerInfo(int rank, int device) {
  PeerInfo p = LocalPeerInfo(rank, MemKind::kCuda, device);
  char bus[32] = {};
  SS_CUDA(cudaDeviceGetPCIBusId(bus, sizeof(bus), device),
          "cudaDeviceGetPCIBusId of device " + std::to_string(device));
  p.gpu_id = bus;
  return p;
}

Result<std::unique_ptr<Stream>> Stream::Create(int device) {
  SS_CUDA(cudaSetDevice(device), "stream: cudaSetDevice " + std::to_string(device));
  cudaStream_t s = nullptr;
  SS_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return std::unique_ptr<Stream>(new Stream(s, device));
}

Stream::~Stream() {
  if (handle_) cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
}

Status Stream::Synchronize(Millis timeout, std::string_view what) const {
  // Poll instead of cudaStreamSynchronize so a stuck stream becomes DeadlineExceeded.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(handle_));
    if (e == cudaSuccess) return OkStatus();
    if (e != cudaErrorNotReady) return CudaStatus(e, what);
    if (std::chrono::steady_clock::now() > deadline) {
      return DeadlineExceededError(std::string(what) + ": stream not done after " +
                                   std::to_string(timeout.count()) + " ms");
    }
  }
}

Result<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(size_t bytes, int device) {
  SS_CUDA(cudaSetDevice(device), "alloc: cudaSetDevice " + std::to_string(device));
  void* p = nullptr;
  SS_CUDA(cudaMalloc(&p, internal::IpcAllocBytes(bytes)),
          "cudaMalloc " + std::to_string(bytes) + " bytes on device " + std::to_string(device));
  return std::unique_ptr<DeviceBuffer>(new DeviceBuffer(p, bytes, device));
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}

Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  return internal::UploadBlocking(dst, src, bytes, "copy to device");
}
Status CopyToHost(void* dst, const void* src, size_t bytes) {
  SS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to host");
  return OkStatus();
}
Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, void* stream) {
  if (stream) {
    SS_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
            "copy device to device");
  } else {
    SS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "copy device to device");
  }
  return OkStatus();
}
Status Memset(void* dst, int value, size_t bytes) {
  SS_CUDA(cudaMemset(dst, value, bytes), "memset");
  return OkStatus();
}
Status Memset2D(void* dst, size_t pitch, int value, size_t width, size_t height) {
  SS_CUDA(cudaMemset2D(dst, pitch, value, width, height), "memset 2-d");
  SS_CUDA(cudaDeviceSynchronize(), "memset 2-d");
  return OkStatus();
}
Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
              size_t height) {
  SS_CUDA(cudaMemcpy2D(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault), "copy 2-d");
  return OkStatus();
}

}  // namespace shardsync::gpu
