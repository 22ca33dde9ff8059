// Synthetic weights on the device: the fill and the element check of the job harness, with the
// same arithmetic as synthetic.h (no FMA contraction), so device and host values are bit-equal.
#include <algorithm>
#include <string>

#include "cuda/cuda_util.h"
#include "cuda/kernels/kernels.cuh"

namespace shardsync::gpu {

using internal::CudaStatus;
using kernels::F32BitsToBF16;

namespace {

__device__ __forceinline__ float SyntheticValueDev(uint64_t seed, uint64_t key, float scale,
                                                   float center, int64_t element) {
  uint64_t z =
      seed * 0x9E3779B97F4A7C15ull ^ key ^ (static_cast<uint64_t>(element) * 0xBF58476D1CE4E5B9ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u =
      __fmul_rn(static_cast<float>(static_cast<int64_t>(z >> 40) - (1 << 23)), 1.0f / (1 << 23));
  return __fadd_rn(center, __fmul_rn(scale, u));
}

struct RegionDev {
  int ndim;
  int64_t offset[kMaxDims];
  int64_t extent[kMaxDims];
  int64_t stride[kMaxDims];  // of the tensor
};

RegionDev MakeRegionDev(const Region& r, const Shape& shape) {
  RegionDev d{};
  d.ndim = r.ndim;
  int64_t s = 1;
  for (int i = r.ndim - 1; i >= 0; --i) {
    d.offset[i] = r.offset[i];
    d.extent[i] = r.extent[i];
    d.stride[i] = s;
    s *= shape[i];
  }
  return d;
}

// Tensor element index of the k-th element (row-major) of the region.
__device__ __forceinline__ int64_t RegionElement(const RegionDev& r, int64_t k) {
  int64_t off = 0;
  for (int i = r.ndim - 1; i >= 0; --i) {
    const int64_t q = k / r.extent[i];
    off += (r.offset[i] + (k - q * r.extent[i])) * r.stride[i];
    k = q;
  }
  return off;
}

__global__ void FillSyntheticKernel(uint64_t seed, uint64_t key, float scale, float center,
                                    RegionDev r, int64_t n, bool bf16, void* out) {
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < n;
       k += int64_t{gridDim.x} * blockDim.x) {
    const float v = SyntheticValueDev(seed, key, scale, center, RegionElement(r, k));
    if (bf16) {
      static_cast<uint16_t*>(out)[k] = F32BitsToBF16(__float_as_uint(v));
    } else {
      static_cast<float*>(out)[k] = v;
    }
  }
}

__global__ void CountMismatchKernel(uint64_t seed, uint64_t key, float scale, float center,
                                    RegionDev src, RegionDev dst, int64_t n, const uint16_t* param,
                                    unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < n;
       k += int64_t{gridDim.x} * blockDim.x) {
    const float v = SyntheticValueDev(seed, key, scale, center, RegionElement(src, k));
    bad += param[RegionElement(dst, k)] != F32BitsToBF16(__float_as_uint(v));
  }
  for (int o = 16; o > 0; o >>= 1) bad += __shfl_down_sync(0xffffffffu, bad, o);
  if ((threadIdx.x & 31) == 0 && bad) atomicAdd(mismatches, bad);
}

int GridFor(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 132 * 16));
}

}  // namespace

Status FillSyntheticDevice(uint64_t seed, const SyntheticTensor& t, const Shape& shape,
                           const Region& r, DType dtype, void* out, void* stream) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return InvalidArgumentError("FillSyntheticDevice: dtype must be F32 or BF16");
  }
  const int64_t n = r.numel();
  if (n == 0) return OkStatus();
  FillSyntheticKernel<<<GridFor(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      seed, t.key, t.scale, t.center, MakeRegionDev(r, shape), n, dtype == DType::kBF16, out);
  SS_CUDA(cudaGetLastError(), "FillSyntheticDevice");
  return OkStatus();
}

namespace {

__global__ void ScaleStridedKernel(unsigned char* dst, size_t pitch, const unsigned char* saved,
                                   size_t rows, bool bf16, float factor) {
  for (size_t r = blockIdx.x * size_t{blockDim.x} + threadIdx.x; r < rows;
       r += size_t{gridDim.x} * blockDim.x) {
    if (bf16) {
      const uint16_t h = reinterpret_cast<const uint16_t*>(saved)[r];
      const float v = __fmul_rn(__uint_as_float(uint32_t{h} << 16), factor);
      *reinterpret_cast<uint16_t*>(dst + r * pitch) = F32BitsToBF16(__float_as_uint(v));
    } else {
      const float v = __fmul_rn(reinterpret_cast<const float*>(saved)[r], factor);
      *reinterpret_cast<float*>(dst + r * pitch) = v;
    }
  }
}

}  // namespace

Status ScaleStrided(void* dst, size_t pitch, const void* saved, size_t rows, DType dtype,
                    float factor) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return InvalidArgumentError("ScaleStrided: dtype " + std::string(DTypeName(dtype)) +
                                ", not F32 or BF16");
  }
  if (rows == 0) return OkStatus();
  ScaleStridedKernel<<<GridFor(static_cast<int64_t>(rows)), 256>>>(
      static_cast<unsigned char*>(dst), pitch, static_cast<const unsigned char*>(saved), rows,
      dtype == DType::kBF16, factor);
  SS_CUDA(cudaGetLastError(), "ScaleStrided");
  SS_CUDA(cudaDeviceSynchronize(), "ScaleStrided");
  return OkStatus();
}

Status CountSyntheticMismatches(uint64_t seed, const SyntheticTensor& t, const Shape& src_shape,
                                const Region& src, const Shape& dst_shape, const Region& dst,
                                const void* param, unsigned long long* d_mismatches, void* stream) {
  const int64_t n = src.numel();
  if (n != dst.numel()) {
    return InvalidArgumentError("CountSyntheticMismatches: src " + src.ToString() + " and dst " +
                                dst.ToString() + " differ in element count");
  }
  if (n == 0) return OkStatus();
  CountMismatchKernel<<<GridFor(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      seed, t.key, t.scale, t.center, MakeRegionDev(src, src_shape), MakeRegionDev(dst, dst_shape),
      n, static_cast<const uint16_t*>(param), d_mismatches);
  SS_CUDA(cudaGetLastError(), "CountSyntheticMismatches");
  return OkStatus();
}

}  // namespace shardsync::gpu
