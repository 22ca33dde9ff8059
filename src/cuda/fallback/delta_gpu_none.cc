// delta_gpu.h without CUDA: the scratch size is still computed (a planner may size memory on a
// machine without a GPU); every device call returns Unimplemented.
#include "cuda/delta/delta_fault.h"
#include "cuda/kernels/delta_kernels.h"
#include "shardsync/delta_gpu.h"

namespace shardsync::gpu {

namespace {
Status NoCudaDelta(std::string_view what) {
  return UnimplementedError(std::string(what) + ": built without CUDA");
}
}  // namespace

size_t DeltaGpuScratch::Bytes(uint64_t max_bucket_bytes, int /*min_element_size*/) {
  return delta::LayoutScratch(max_bucket_bytes).total;
}
Result<std::unique_ptr<DeltaGpuScratch>> DeltaGpuScratch::Allocate(uint64_t, int, int) {
  return NoCudaDelta("DeltaGpuScratch::Allocate");
}
Status EnqueueDeltaEncode(const DeltaGpuEncodeArgs&, DeltaGpuScratch*, void*) {
  return NoCudaDelta("EnqueueDeltaEncode");
}
Result<DeltaGpuEncoded> FinishDeltaEncode(DeltaGpuScratch*, std::chrono::milliseconds) {
  return NoCudaDelta("FinishDeltaEncode");
}
Status EnqueueDeltaDecode(const DeltaGpuDecodeArgs&, DeltaGpuScratch*, void*) {
  return NoCudaDelta("EnqueueDeltaDecode");
}
Status FinishDeltaDecode(DeltaGpuScratch*, std::chrono::milliseconds) {
  return NoCudaDelta("FinishDeltaDecode");
}
Result<DeltaGpuEncoded> EncodeDeltaDevice(const DeltaGpuEncodeArgs&, DeltaGpuScratch*, void*,
                                          std::chrono::milliseconds) {
  return NoCudaDelta("EncodeDeltaDevice");
}
Status DecodeDeltaDevice(const DeltaGpuDecodeArgs&, DeltaGpuScratch*, void*,
                         std::chrono::milliseconds) {
  return NoCudaDelta("DecodeDeltaDevice");
}

// No device delta pairs exist to fail; tests/cuda links it and skips without a GPU.
void FailNextDeltaForTesting(int64_t, int64_t) {}
void CorruptNextKeptImageForTesting(int64_t) {}

}  // namespace shardsync::gpu
