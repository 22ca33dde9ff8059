// caps().tag_matching of the host transports: every one matches two-sided messages by
// (source, tag), FIFO per pair (the GPU transports: tests/cuda/gpu_transport_conformance_test.cc).
// The conformance suite runs its tag-matching tests only where this is true.
#include <gtest/gtest.h>

#include "shardsync/transport.h"

namespace shardsync {
namespace {

TEST(TransportCaps, HostTransportsMatchBySourceAndTag) {
  auto hub = NewLoopbackHub();
  EXPECT_TRUE(NewLoopbackTransport(hub)->caps().tag_matching) << "loopback";
  EXPECT_TRUE(NewFaultTransport(NewLoopbackTransport(hub))->caps().tag_matching)
      << "the fault wrapper passes its inner transport's matching through";
  auto shm = NewShmTransport();
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  EXPECT_TRUE((*shm)->caps().tag_matching) << "shm";
}

TEST(TransportCaps, UcxMatchesBySourceAndTagInEveryMode) {
  for (UcxMode mode : {UcxMode::kPut, UcxMode::kTag}) {
    UcxOptions o;
    o.mode = mode;
    o.mode_from_env = false;
    auto t = NewUcxTransport(o);
    if (!t.ok() && t.status().code() == StatusCode::kUnimplemented) {
      GTEST_SKIP() << "built without UCX";
    }
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_TRUE((*t)->caps().tag_matching) << "ucx mode " << static_cast<int>(mode);
  }
}

}  // namespace
}  // namespace shardsync
