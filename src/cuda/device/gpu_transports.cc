// The GPU transports' factories and their registration (transport.h registry), and the calls
// gpu.h offers on them.
#include <cstdlib>

#include "cuda/cuda_ipc/cuda_ipc.h"

namespace shardsync::gpu {

std::unique_ptr<Transport> MakeCudaIpcTransport(int device) {
  return std::make_unique<ipc::CudaIpcTransport>(device);
}

Result<void*> CudaIpcRemotePointer(Transport& ipc, int peer, uint32_t region, uint64_t offset,
                                   uint64_t bytes) {
  auto* t = dynamic_cast<ipc::CudaIpcTransport*>(&ipc);
  if (!t) return InvalidArgumentError("CudaIpcRemotePointer: transport is not cuda_ipc");
  return t->RemotePointer(peer, region, offset, bytes);
}

Status NcclSetStream(Transport& t, void* stream, bool* matched);  // nccl_transport.cc

Status SetTransportStream(Transport& t, void* stream) {
  if (auto* ipc = dynamic_cast<ipc::CudaIpcTransport*>(&t)) {
    ipc->SetStream(static_cast<cudaStream_t>(stream));
    return OkStatus();
  }
  bool matched = false;
  SS_RETURN_IF_ERROR(NcclSetStream(t, stream, &matched));
  if (matched) return OkStatus();
  return InvalidArgumentError("SetTransportStream: transport '" + std::string(t.name()) +
                              "' is not a GPU transport");
}

Status RegisterGpuTransports() {
  static const Status once = [] {
    auto device_of = [](const TransportOptions& o) {
      auto it = o.params.find("device");
      return it == o.params.end() ? 0 : std::atoi(it->second.c_str());
    };
    TransportEntry ipc;
    ipc.name = "cuda_ipc";
    ipc.priority = 100;
    ipc.can_connect = [](const PeerInfo& a, const PeerInfo& b) {
      return a.hostname == b.hostname && a.mem == MemKind::kCuda && b.mem == MemKind::kCuda;
    };
    ipc.factory = [device_of](const TransportOptions& o) -> Result<std::unique_ptr<Transport>> {
      return MakeCudaIpcTransport(device_of(o));
    };
    SS_RETURN_IF_ERROR(RegisterTransport(std::move(ipc)));
    TransportEntry nccl;
    nccl.name = "nccl";
    nccl.priority = 200;
    nccl.can_connect = [](const PeerInfo& a, const PeerInfo& b) {
      return a.mem == MemKind::kCuda && b.mem == MemKind::kCuda && !SameGpu(a, b);
    };
    nccl.factory = [device_of](const TransportOptions& o) -> Result<std::unique_ptr<Transport>> {
      NcclOptions n;
      n.device = device_of(o);
      if (auto it = o.params.find("nccl_depth"); it != o.params.end()) {
        n.depth = std::atoi(it->second.c_str());
        if (n.depth < 1 || n.depth > 64) {
          return InvalidArgumentError("transport param nccl_depth: '" + it->second +
                                      "', expected 1..64");
        }
      }
      return MakeNcclTransport(n);
    };
    return RegisterTransport(std::move(nccl));
  }();
  return once;
}

}  // namespace shardsync::gpu
