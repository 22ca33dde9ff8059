// One conformance suite every transport instantiates:
//   INSTANTIATE_TEST_SUITE_P(Name, TransportConformance, ::testing::Values(TransportParam{...}));
// The TEST_P bodies live in transport_conformance_test.cc; a test binary of another layer adds
// that file to its SOURCES (shardsync_add_tests(... SOURCES .../transport_conformance_test.cc)).
// Ranks are Transport objects driven from their own threads in this process; transports that
// work across processes (multiprocess = true) also run the peer-death test with a forked peer.
// GPU transports (tests/cuda/gpu_transport_conformance_test.cc) say which GPUs they need
// (`require`, which skips visibly), where each rank lives (`device_of`) and in which memory its
// regions are (`mem`); tests needing a capability a transport lacks (caps()) skip with the reason.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shardsync/store.h"
#include "shardsync/transport.h"

namespace shardsync::testing {

using namespace std::chrono_literals;

struct TransportParam {
  std::string name;
  // Makes the transport of one rank; `hub` is shared by the ranks of one test (loopback).
  std::function<std::unique_ptr<Transport>(const std::shared_ptr<LoopbackHub>& hub)> make;
  bool multiprocess = false;

  // ---- What GPU transports need; the defaults describe a host transport. ----
  // Runs first in every test (SetUp); GTEST_SKIPs with the reason ("GPU test skipped: ...") on
  // machines that cannot run the transport. (`requires` is a C++20 keyword, hence `require`.)
  std::function<void()> require{};
  // When set, rank r's transport is make_on_device(device_of(r)) instead of make(hub).
  std::function<std::unique_ptr<Transport>(int device)> make_on_device{};
  std::function<int(int rank)> device_of{};
  // Memory of registered regions, put sources and data buffers (ManyOutstandingOps). kCuda:
  // alloc(bytes, device) (zero-filled; null on failure) on the rank's device, read and written
  // through the copies; control messages stay in host memory.
  MemKind mem = MemKind::kHost;
  std::function<std::shared_ptr<void>(size_t bytes, int device)> alloc{};
  using Copy = std::function<void(void* dst, const void* src, size_t bytes)>;
  Copy to_device{}, to_host{};
  // Largest two-sided message (cuda_ipc: one 64 KiB mailbox slot); tests clamp sizes to it.
  size_t max_message = SIZE_MAX;
  // Receives must be posted with the message's exact size (nccl: NCCL needs equal counts on both
  // sides and cannot report a mismatch), so the receive-size tests do not apply.
  bool exact_recv_size = false;
};

inline void PrintTo(const TransportParam& p, std::ostream* os) { *os << p.name; }

inline std::string ParamName(const ::testing::TestParamInfo<TransportParam>& info) {
  return info.param.name;
}

constexpr char kToken[] = "conformance-token";
constexpr Millis kTimeout = 10000ms;

// Runs fn(rank) for every rank in its own thread and joins them.
inline void ParallelRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back([&, r] { fn(r); });
  for (auto& t : ts) t.join();
}

inline std::vector<char> Pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 8)) & 0xff);
  return v;
}

// ---- Child processes ------------------------------------------------------------------------
// Multi-process tests re-execute this test binary (fork + exec) with SHARDSYNC_TEST_CHILD=<role>;
// a global test environment runs the role before any test and exits with its code. The exec
// matters: a child that only forks inherits locks held by the parent's other threads (the store
// server thread) and was seen deadlocking inside UCX's memory hooks during ucp_init.
using ChildRole = std::function<int()>;  // returns the exit code
inline std::map<std::string, ChildRole>& ChildRoles() {
  static std::map<std::string, ChildRole> roles;
  return roles;
}
struct RegisterChildRole {
  RegisterChildRole(const std::string& name, ChildRole fn) { ChildRoles()[name] = std::move(fn); }
};
// Transports a conformance child can build, by TransportParam name (multiprocess params).
inline std::map<std::string, std::function<std::unique_ptr<Transport>()>>& ChildTransports() {
  static std::map<std::string, std::function<std::unique_ptr<Transport>()>> m;
  return m;
}
struct RegisterChildTransport {
  RegisterChildTransport(const std::string& name, std::function<std::unique_ptr<Transport>()> f) {
    ChildTransports()[name] = std::move(f);
  }
};

inline std::string ChildEnv(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// Starts `role` in a fresh image of this binary with the extra environment; -1 on failure.
inline pid_t SpawnChild(const std::string& role,
                        const std::vector<std::pair<std::string, std::string>>& env) {
  char exe[4096] = {};
  if (readlink("/proc/self/exe", exe, sizeof(exe) - 1) <= 0) return -1;
  pid_t pid = fork();
  if (pid != 0) return pid;
  setenv("SHARDSYNC_TEST_CHILD", role.c_str(), 1);
  for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
  execl(exe, exe, "--gtest_brief=1", static_cast<char*>(nullptr));
  _exit(127);
}

// Waits for a child at most `timeout`, then kills it; returns the wait status (-1 if killed).
inline int WaitChild(pid_t pid, Millis timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int wst = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid, &wst, WNOHANG) == pid) return wst;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &wst, 0);
  return -1;
}

// memcmp that accepts the null data() of empty vectors.
inline bool SameBytes(const void* a, const void* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

// A zero-filled buffer of one rank in the parameter's memory: host, or device memory on the
// rank's GPU (GPU transports move device memory; cuda_ipc refuses to register host memory).
class TestBuffer {
 public:
  TestBuffer(const TransportParam& p, int device, size_t n) : p_(&p), n_(n), device_(device) {
    if (p.mem == MemKind::kHost) {
      mem_ = std::shared_ptr<char[]>(new char[std::max<size_t>(n, 1)]());
    } else {
      mem_ = p.alloc(std::max<size_t>(n, 1), device);
      if (!mem_) ADD_FAILURE() << "cannot allocate " << n << " bytes on device " << device;
    }
  }
  char* data() const { return static_cast<char*>(mem_.get()); }
  size_t size() const { return n_; }
  MemRegion region() const { return {mem_.get(), n_, p_->mem, device_}; }
  std::vector<char> Read() const {
    std::vector<char> v(n_);
    if (!mem_ || n_ == 0) return v;
    if (p_->mem == MemKind::kHost) {
      std::memcpy(v.data(), data(), n_);
    } else {
      p_->to_host(v.data(), data(), n_);
    }
    return v;
  }
  void Write(size_t offset, const std::vector<char>& bytes) {
    if (!mem_ || bytes.empty()) return;
    if (p_->mem == MemKind::kHost) {
      std::memcpy(data() + offset, bytes.data(), bytes.size());
    } else {
      p_->to_device(data() + offset, bytes.data(), bytes.size());
    }
  }

 private:
  const TransportParam* p_;
  std::shared_ptr<void> mem_;
  size_t n_;
  int device_;
};

class TransportConformance : public ::testing::TestWithParam<TransportParam> {
 protected:
  void SetUp() override {
    if (GetParam().require) {
      GetParam().require();
      if (IsSkipped() || HasFatalFailure()) return;  // gtest then skips the test body
    }
    auto s = StoreServer::Start("127.0.0.1", 0, kToken);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
    hub_ = NewLoopbackHub();
  }

  // Rank `rank`'s transport (GPU transports: on the rank's device).
  std::unique_ptr<Transport> Make(int rank = 0) {
    const TransportParam& p = GetParam();
    return p.make_on_device ? p.make_on_device(Device(rank)) : p.make(hub_);
  }
  int Device(int rank) const { return GetParam().device_of ? GetParam().device_of(rank) : -1; }
  TransportCaps Caps() { return Make()->caps(); }
  // A message size within the transport's limit.
  size_t Msg(size_t bytes) const { return std::min(bytes, GetParam().max_message); }
  TestBuffer Buffer(int rank, size_t bytes) const {
    return TestBuffer(GetParam(), Device(rank), bytes);
  }
  // Store prefix unique to this process: transports name OS objects after it (cuda_ipc's shm
  // mailboxes), and test binaries may run concurrently (ctest -j).
  static std::string Prefix(const std::string& base) {
    return base + "-" + std::to_string(getpid());
  }

  std::unique_ptr<StoreClient> Store() {
    auto c = StoreClient::Connect(server_->address(), kToken, 5000ms);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Creates `n` ranks, registers regions[r] for rank r, connects all to all concurrently.
  std::vector<std::unique_ptr<Transport>> World(int n,
                                                const std::vector<std::vector<MemRegion>>& regions,
                                                const std::string& prefix = Prefix("job")) {
    std::vector<std::unique_ptr<Transport>> ts;
    for (int r = 0; r < n; ++r) ts.push_back(Make(r));
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < regions[r].size(); ++i) {
        auto id = ts[r]->RegisterMemory(regions[r][i]);
        EXPECT_TRUE(id.ok()) << id.status().ToString();
        if (id.ok()) {
          EXPECT_EQ(*id, i);
        }
      }
    }
    ParallelRanks(n, [&](int r) {
      auto store = Store();
      std::vector<int> peers;
      for (int p = 0; p < n; ++p) {
        if (p != r) peers.push_back(p);
      }
      Status s = ts[r]->Connect(*store, prefix, r, peers, kTimeout);
      EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.ToString();
    });
    return ts;
  }

  std::unique_ptr<StoreServer> server_;
  std::shared_ptr<LoopbackHub> hub_;
};

}  // namespace shardsync::testing
