// The transport conformance suite (tests/transport/transport_conformance_test.cc) on the GPU
// transports, with device memory on each rank's GPU. Without a GPU (CI, builds without CUDA)
// every test skips visibly ("GPU test skipped: ..."), so the suite is compiled everywhere.
//   cuda_ipc_1gpu: every rank on GPU 0 (the colocated layout).
//   cuda_ipc_2gpu: rank r on GPU r % 2 (puts cross GPUs).
//   nccl_2gpu:     rank r on GPU r % 2; NCCL refuses two ranks of one communicator on one GPU, so
//                  no test may put two ranks of a pair on the same GPU (the one 3-rank test needs
//                  tag matching, which nccl lacks, and skips).
// The forked-peer death test runs for every one of them: the child re-executes this binary and
// only then opens its device (SS_CHILD_DEVICE).
#include <cstdlib>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "gpu_test_util.h"
#include "shardsync/gpu.h"
#include "shardsync/transport.h"
#include "transport/transport_conformance.h"

namespace shardsync::testing {
namespace {

// Zero-filled device memory on `device`, freed with the last reference; null on failure.
std::shared_ptr<void> DeviceAlloc(size_t bytes, int device) {
  auto b = gpu::DeviceBuffer::Allocate(bytes, device);
  if (!b.ok()) {
    ADD_FAILURE() << b.status().ToString();
    return nullptr;
  }
  std::shared_ptr<gpu::DeviceBuffer> owner = std::move(*b);
  // Allocate made `device` current on this thread, which cudaMemset needs.
  Status s = gpu::Memset(owner->data(), 0, bytes);
  if (!s.ok()) {
    ADD_FAILURE() << s.ToString();
    return nullptr;
  }
  return std::shared_ptr<void>(owner, owner->data());
}

void ToDevice(void* dst, const void* src, size_t n) {
  Status s = gpu::CopyToDevice(dst, src, n);
  EXPECT_TRUE(s.ok()) << s.ToString();
}
void ToHost(void* dst, const void* src, size_t n) {
  Status s = gpu::CopyToHost(dst, src, n);
  EXPECT_TRUE(s.ok()) << s.ToString();
}

TransportParam GpuParam(std::string name, int gpus, bool nccl) {
  TransportParam p;
  p.name = std::move(name);
  p.multiprocess = true;  // processes share GPUs through CUDA IPC / NCCL
  p.require = [gpus, nccl] {
    SS_REQUIRE_GPUS(gpus);
    if (nccl) {
      auto v = gpu::NcclVersion();
      if (!v.ok()) GTEST_SKIP() << "GPU test skipped: " << v.status().ToString();
    }
  };
  p.device_of = [gpus](int rank) { return rank % gpus; };
  if (nccl) {
    p.make_on_device = [](int device) { return gpu::MakeNcclTransport({device}); };
    p.exact_recv_size = true;  // NCCL receives need the sender's count
  } else {
    p.make_on_device = [](int device) { return gpu::MakeCudaIpcTransport(device); };
    p.max_message = 64 << 10;  // control messages go through one 64 KiB mailbox slot
  }
  p.mem = MemKind::kCuda;
  p.alloc = DeviceAlloc;
  p.to_device = ToDevice;
  p.to_host = ToHost;
  return p;
}

INSTANTIATE_TEST_SUITE_P(Gpu, TransportConformance,
                         ::testing::Values(GpuParam("cuda_ipc_1gpu", 1, false),
                                           GpuParam("cuda_ipc_2gpu", 2, false),
                                           GpuParam("nccl_2gpu", 2, true)),
                         ParamName);

int ChildDevice() { return std::atoi(ChildEnv("SS_CHILD_DEVICE").c_str()); }
RegisterChildTransport child_ipc1("cuda_ipc_1gpu",
                                  [] { return gpu::MakeCudaIpcTransport(ChildDevice()); });
RegisterChildTransport child_ipc2("cuda_ipc_2gpu",
                                  [] { return gpu::MakeCudaIpcTransport(ChildDevice()); });
RegisterChildTransport child_nccl("nccl_2gpu",
                                  [] { return gpu::MakeNcclTransport({ChildDevice()}); });

// caps() must say how two-sided messages match; the conformance tests pick their checks by it.
// Construction and caps() touch no CUDA (that starts at Connect; the destructors' cudaSetDevice
// just fails without a GPU), so this runs wherever the build has CUDA, GPU or not.
TEST(GpuTransportCaps, TagMatching) {
  auto ipc = gpu::MakeCudaIpcTransport(0);
  auto nccl = gpu::MakeNcclTransport({0});
  if (!ipc || !nccl) GTEST_SKIP() << "GPU test skipped: built without CUDA";
  EXPECT_TRUE(ipc->caps().tag_matching) << "cuda_ipc's mailbox matches (source, tag)";
  EXPECT_FALSE(nccl->caps().tag_matching) << "NCCL matches by order per pair";
  EXPECT_TRUE(ipc->caps().two_sided);
  EXPECT_TRUE(nccl->caps().two_sided);
}

}  // namespace
}  // namespace shardsync::testing
