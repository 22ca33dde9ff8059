// Built when shardsync is configured without CUDA: every GPU entry point says so, so the rest of
// shardsync links and callers get a clear Unimplemented instead of a link error.
#include "shardsync/gpu.h"
#include "shardsync/pack.h"

namespace shardsync::gpu {

namespace {
Status NoCuda(std::string_view what) {
  return UnimplementedError(std::string(what) +
                            ": built without CUDA (configure with "
                            "-DSHARDSYNC_CUDA=ON and nvcc present)");
}
}  // namespace

bool Available(std::string* reason) {
  if (reason) *reason = "built without CUDA";
  return false;
}
Result<int> DeviceCount() { return NoCuda("DeviceCount"); }
Result<DeviceInfo> QueryDevice(int) { return NoCuda("QueryDevice"); }
Status SetDevice(int) { return NoCuda("SetDevice"); }
Result<PeerInfo> DevicePeerInfo(int, int) { return NoCuda("DevicePeerInfo"); }
Result<std::unique_ptr<Stream>> Stream::Create(int) { return NoCuda("Stream::Create"); }
Stream::~Stream() = default;
Status Stream::Synchronize(Millis, std::string_view) const { return NoCuda("Stream"); }
Result<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(size_t, int) {
  return NoCuda("DeviceBuffer::Allocate");
}
DeviceBuffer::~DeviceBuffer() = default;
Status CopyToDevice(void*, const void*, size_t) { return NoCuda("CopyToDevice"); }
Status CopyToHost(void*, const void*, size_t) { return NoCuda("CopyToHost"); }
Status CopyDeviceToDevice(void*, const void*, size_t, void*) {
  return NoCuda("CopyDeviceToDevice");
}
Status Memset(void*, int, size_t) { return NoCuda("Memset"); }
Status Memset2D(void*, size_t, int, size_t, size_t) { return NoCuda("Memset2D"); }
Status Copy2D(void*, size_t, const void*, size_t, size_t, size_t) { return NoCuda("Copy2D"); }
Status ScaleStrided(void*, size_t, const void*, size_t, DType, float) {
  return NoCuda("ScaleStrided");
}
Status LaunchReadPass(const void*, size_t, void*) { return NoCuda("LaunchReadPass"); }
Result<std::unique_ptr<CopyBatch>> CopyBatch::Prepare(const BatchSpec&, int) {
  return NoCuda("CopyBatch::Prepare");
}
Result<uint64_t> DeviceChecksumPartial(const void*, size_t, uint64_t) {
  return NoCuda("DeviceChecksumPartial");
}
Status FillSyntheticDevice(uint64_t, const SyntheticTensor&, const Shape&, const Region&, DType,
                           void*, void*) {
  return NoCuda("FillSyntheticDevice");
}
Status CountSyntheticMismatches(uint64_t, const SyntheticTensor&, const Shape&, const Region&,
                                const Shape&, const Region&, const void*, unsigned long long*,
                                void*) {
  return NoCuda("CountSyntheticMismatches");
}
std::unique_ptr<Transport> MakeCudaIpcTransport(int) { return nullptr; }
std::unique_ptr<Transport> MakeNcclTransport(const NcclOptions&) { return nullptr; }
Result<void*> CudaIpcRemotePointer(Transport&, int, uint32_t, uint64_t, uint64_t) {
  return NoCuda("CudaIpcRemotePointer");
}
Status SetTransportStream(Transport&, void*) { return NoCuda("SetTransportStream"); }
// Nothing to register: SelectTransport then never offers cuda_ipc / nccl.
Status RegisterGpuTransports() { return OkStatus(); }
Result<int> NcclVersion() { return NoCuda("NcclVersion"); }
std::unique_ptr<Packer> MakeCudaPacker(int, Millis) { return nullptr; }

}  // namespace shardsync::gpu
