#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <string>
#include <thread>

#include "shardsync/settings.h"
#include "shardsync/transport.h"
#include "transport/process.h"

namespace shardsync {

namespace internal {

bool ProcessAlive(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == EPERM;
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return true;
  char buf[512] = {};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const char* close = nullptr;
  // Find the last ')' (the command name may contain one), then the state letter.
  for (const char* p = buf; p < buf + n; ++p) {
    if (*p == ')') close = p;
  }
  if (close == nullptr || close + 2 >= buf + n) return true;
  return close[2] != 'Z' && close[2] != 'X';
}

}  // namespace internal

Result<XferId> Transport::PostSendSummed(int, uint64_t, const void*, size_t, CopySum*) {
  return UnimplementedError("transport '" + std::string(name()) + "' has no summed copies");
}
Result<XferId> Transport::PostRecvSummed(int, uint64_t, void*, size_t, CopySum*) {
  return UnimplementedError("transport '" + std::string(name()) + "' has no summed copies");
}
Result<XferId> Transport::PostSendFilled(int, uint64_t, size_t, SendFill) {
  return UnimplementedError("transport '" + std::string(name()) + "' has no filled sends");
}

Status WaitXfer(Transport& t, XferId id, Millis timeout, std::string_view what) {
  return WaitAllXfers(t, {id}, timeout, what);
}

Status WaitAllXfers(Transport& t, const std::vector<XferId>& ids, Millis timeout,
                    std::string_view what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Clamped (30 days) so Millis::max() means "very long" rather than overflowing.
  const auto deadline = start + std::min(timeout, Millis(int64_t{30} * 24 * 3600 * 1000));
  size_t next = 0;  // ids before `next` are done
  uint64_t spins = 0;
  while (next < ids.size()) {
    auto st = t.Poll(ids[next]);
    if (!st.ok()) {
      Status s = st.status();
      s.Annotate(what);
      return s;
    }
    if (*st == XferState::kDone) {
      ++next;
      continue;
    }
    auto now = Clock::now();
    if (now >= deadline) {
      return DeadlineExceededError(std::string(what) + ": transfer not complete within " +
                                   std::to_string(timeout.count()) + " ms (" +
                                   std::to_string(ids.size() - next) + " of " +
                                   std::to_string(ids.size()) + " outstanding)");
    }
    // Poll drives progress (and for UCX's rendezvous and emulated puts, the peer's copy runs
    // inside our progress), so spin with yields while the wait is young; back off to short
    // sleeps on long waits so idle ranks leave the cores to the ranks doing work.
    if (now - start < Millis(200) || ++spins % 64 == 0) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return OkStatus();
}

std::string HostIdentity() {
  // Text knob: any non-empty value parses (the router refuses one its record cannot carry).
  auto id = TextKnob("SHARDSYNC_HOST_ID");
  if (id.ok() && !id->empty()) return *id;
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return "";
  return host;
}

PeerInfo LocalPeerInfo(int rank, MemKind mem, int device) {
  PeerInfo p;
  p.rank = rank;
  p.hostname = HostIdentity();
  p.mem = mem;
  p.device = device;
  return p;
}

bool SameGpu(const PeerInfo& a, const PeerInfo& b) {
  if (a.hostname != b.hostname || a.mem != MemKind::kCuda || b.mem != MemKind::kCuda) return false;
  if (!a.gpu_id.empty() && !b.gpu_id.empty()) return a.gpu_id == b.gpu_id;
  return a.device == b.device;
}

Result<std::unique_ptr<PreparedPair>> Transport::Prepare(StoreClient&, const PairSpec& spec,
                                                         Millis) {
  return UnimplementedError("transport '" + std::string(name()) +
                            "' has no prepared transfers (pair with rank " +
                            std::to_string(spec.peer) + ")");
}
TransportCaps Transport::PeerCaps(int) const { return caps(); }
std::string Transport::PeerTransport(int) const { return std::string(name()); }

}  // namespace shardsync
