// Store server: one thread, poll() over every connection, so a blocking Get/Wait of one client
// never stalls the others (pending requests are parked with a deadline). Hand-written on POSIX
// sockets: no Debian library offers a small authenticated key-value rendezvous.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <list>
#include <map>
#include <optional>
#include <thread>

#include "store/log.h"

#include "shardsync/store.h"
#include "store/frame.h"
#include "store/net.h"

namespace shardsync {
namespace {

using store_net::Clock;
using store_wire::Frame;
using store_wire::Op;

constexpr auto kHelloTimeout = std::chrono::seconds(10);
// Bounds descriptors and memory an unauthenticated flood can take; far above any job's ranks.
constexpr size_t kMaxConnections = 16384;

std::string SockAddrToString(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    std::string out = "[";
    out.append(host).append("]:").append(std::to_string(port));
    return out;
  }
  return "?";
}

struct Pending {
  Op op = Op::kGet;
  std::vector<std::string> keys;
  Clock::time_point deadline;
  int64_t timeout_ms = 0;
};

struct Conn {
  int fd = -1;
  std::string peer;
  std::string in;
  std::string out;
  bool authed = false;
  bool close_after_flush = false;
  bool dead = false;
  Clock::time_point hello_deadline;
  std::optional<Pending> pending;
};

class StoreServerImpl final : public StoreServer {
 public:
  StoreServerImpl(int listen_fd, int wake_r, int wake_w, std::string host, int port,
                  std::string token)
      : listen_fd_(listen_fd),
        wake_r_(wake_r),
        wake_w_(wake_w),
        host_(std::move(host)),
        port_(port),
        token_(std::move(token)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~StoreServerImpl() override { Stop(); }

  int port() const override { return port_; }
  std::string address() const override {
    bool v6 = host_.find(':') != std::string::npos;
    return (v6 ? "[" + host_ + "]" : host_) + ":" + std::to_string(port_);
  }

  void Stop() override {
    if (stopping_.exchange(true)) return;
    char b = 1;
    while (write(wake_w_, &b, 1) < 0 && errno == EINTR) {
    }
    if (thread_.joinable()) thread_.join();
    for (Conn& c : conns_) close(c.fd);
    conns_.clear();
    close(listen_fd_);
    close(wake_r_);
    close(wake_w_);
  }

 private:
  void Run() {
    std::vector<pollfd> fds;
    std::vector<Conn*> order;
    // Requests come in bursts (a sync's ready phase, then its verdicts one device copy later):
    // for a while after one, poll without blocking, so the next costs no thread wake-up. Woken
    // from a blocking poll, this thread answered ~100 us late on the H200 machine (traced syncs
    // in docs/benchmarks.md); the window spans a sync, and the thread yields while it spins.
    constexpr auto kHotWindow = std::chrono::milliseconds(20);
    auto last_active = Clock::now() - kHotWindow;
    while (!stopping_.load()) {
      fds.clear();
      order.clear();
      fds.push_back({wake_r_, POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      auto next = Clock::now() + std::chrono::hours(1);
      for (Conn& c : conns_) {
        short ev = 0;
        // A parked request stops reading: a client cannot pile up unbounded pipelined input.
        if (!c.pending && !c.close_after_flush) ev |= POLLIN;
        if (!c.out.empty()) ev |= POLLOUT;
        fds.push_back({c.fd, ev, 0});
        order.push_back(&c);
        if (!c.authed) next = std::min(next, c.hello_deadline);
        if (c.pending) next = std::min(next, c.pending->deadline);
      }
      const bool hot = Clock::now() - last_active < kHotWindow;
      int rc = poll(fds.data(), fds.size(), hot ? 0 : store_net::MillisLeft(next));
      if (rc > 0) last_active = Clock::now();
      if (rc == 0 && hot) std::this_thread::yield();
      if (rc < 0 && errno != EINTR) {
        StoreLog().error("store: poll failed: {}", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (stopping_.load()) break;
      if (rc > 0) {
        if (fds[1].revents & POLLIN) Accept();
        for (size_t i = 0; i < order.size(); ++i) {
          Conn& c = *order[i];
          short re = fds[i + 2].revents;
          if (re & (POLLERR | POLLNVAL)) {
            c.dead = true;
            continue;
          }
          if (re & (POLLIN | POLLHUP)) ReadFrom(c);
          if (!c.dead && (re & POLLOUT)) Flush(c);
        }
      }
      Expire();
      DrainBuffered();
      Reap();
    }
  }

  void Accept() {
    for (int i = 0; i < 64; ++i) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      int fd = accept(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
      if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          StoreLog().warn("store: accept failed: {}", std::strerror(errno));
        }
        return;
      }
      if (conns_.size() >= kMaxConnections) {
        StoreLog().warn("store: refusing connection from {}: {} connections open",
                        SockAddrToString(ss), conns_.size());
        close(fd);
        continue;
      }
      if (!store_net::SetNonBlocking(fd).ok()) {
        close(fd);
        continue;
      }
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      Conn c;
      c.fd = fd;
      c.peer = SockAddrToString(ss);
      c.hello_deadline = Clock::now() + kHelloTimeout;
      conns_.push_back(std::move(c));
    }
  }

  void ReadFrom(Conn& c) {
    char buf[65536];
    while (true) {
      ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        if (!Process(c)) return;
        // Stop reading while a request is parked; the rest stays in the socket buffer.
        if (c.pending || c.close_after_flush) return;
        continue;
      }
      if (n == 0) {
        c.dead = true;
        return;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;
      return;
    }
  }

  // Handles every complete frame buffered in c.in; false if the connection was dropped.
  bool Process(Conn& c) {
    while (!c.pending && !c.close_after_flush && !c.dead) {
      if (c.in.size() < store_wire::kHeaderBytes) return true;
      size_t limit = c.authed ? store_wire::kMaxPayloadBytes : store_wire::kMaxHelloPayloadBytes;
      auto header = store_wire::ParseFrameHeader(c.in, limit);
      if (!header.ok()) return Drop(c, header.status());
      size_t total = store_wire::kHeaderBytes + header->payload_bytes;
      if (c.in.size() < total) return true;
      auto frame = store_wire::ParseFrame(std::string_view(c.in).substr(0, total), limit);
      c.in.erase(0, total);
      if (!frame.ok()) return Drop(c, frame.status());
      Handle(c, std::move(*frame));
    }
    return !c.dead;
  }

  bool Drop(Conn& c, const Status& why) {
    StoreLog().warn("store: closing connection from {}: {}", c.peer, why.ToString());
    c.dead = true;
    return false;
  }

  void Reply(Conn& c, StatusCode code, std::string arg) {
    std::vector<std::string> args;
    args.push_back(std::move(arg));
    Reply(c, code, std::move(args));
  }
  void Reply(Conn& c, StatusCode code, std::vector<std::string> args) {
    Frame r;
    r.op = Op::kReply;
    r.num = static_cast<int64_t>(code);
    r.args = std::move(args);
    c.out += store_wire::EncodeFrame(r);
    Flush(c);
  }

  void Flush(Conn& c) {
    while (!c.out.empty()) {
      ssize_t n = send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      c.dead = true;
      return;
    }
    if (c.close_after_flush) c.dead = true;
  }

  void Handle(Conn& c, Frame f) {
    if (!c.authed) {
      if (f.op != Op::kHello) {
        Drop(c, PermissionDeniedError("first frame is not hello"));
        return;
      }
      if (!store_net::ConstantTimeEquals(f.args[0], token_)) {
        StoreLog().warn("store: refused connection from {}: wrong token", c.peer);
        c.close_after_flush = true;
        Reply(c, StatusCode::kPermissionDenied, "store refused the token (SHARDSYNC_TOKEN)");
        return;
      }
      c.authed = true;
      Reply(c, StatusCode::kOk, "");
      return;
    }
    switch (f.op) {
      case Op::kHello:
        Reply(c, StatusCode::kOk, "");
        return;
      case Op::kSet:
        kv_[f.args[0]] = std::move(f.args[1]);
        Reply(c, StatusCode::kOk, "");
        WakeParked();
        return;
      case Op::kAdd: {
        int64_t cur = 0;
        auto it = kv_.find(f.args[0]);
        if (it != kv_.end()) {
          const std::string& v = it->second;
          auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), cur);
          if (ec != std::errc() || ptr != v.data() + v.size()) {
            Reply(c, StatusCode::kInvalidArgument,
                  "store add: key '" + f.args[0] + "' holds a non-integer value");
            return;
          }
        }
        int64_t next = 0;
        if (__builtin_add_overflow(cur, f.num, &next)) {
          Reply(c, StatusCode::kOutOfRange, "store add: key '" + f.args[0] + "' overflows");
          return;
        }
        kv_[f.args[0]] = std::to_string(next);
        Reply(c, StatusCode::kOk, std::to_string(next));
        WakeParked();
        return;
      }
      case Op::kGet:
      case Op::kWait:
      case Op::kGetMany: {
        Pending p;
        p.op = f.op;
        p.keys = std::move(f.args);
        p.timeout_ms = f.num;
        p.deadline = Clock::now() + store_net::ClampWait(std::chrono::milliseconds(f.num));
        c.pending = std::move(p);
        TryComplete(c, /*expired=*/false);
        return;
      }
      case Op::kReply:
        Drop(c, InvalidArgumentError("client sent a reply frame"));
        return;
    }
  }

  // Answers c's parked request if satisfied (or expired); true if answered.
  bool TryComplete(Conn& c, bool expired) {
    Pending& p = *c.pending;
    for (const std::string& k : p.keys) {
      if (kv_.find(k) == kv_.end()) {
        if (!expired && Clock::now() < p.deadline) return false;
        std::string msg = std::string("store ") + (p.op == Op::kWait ? "wait" : "get") + ": key '" +
                          k + "' not set within " + std::to_string(p.timeout_ms) + " ms";
        c.pending.reset();
        Reply(c, StatusCode::kDeadlineExceeded, std::move(msg));
        return true;
      }
    }
    std::vector<std::string> values;
    if (p.op == Op::kWait) {
      values.emplace_back();
    } else {
      for (const std::string& k : p.keys) values.push_back(kv_[k]);
    }
    c.pending.reset();
    Reply(c, StatusCode::kOk, std::move(values));
    return true;
  }

  void WakeParked() {
    for (Conn& c : conns_) {
      if (c.dead || !c.pending) continue;
      TryComplete(c, false);  // pipelined input behind it is handled by DrainBuffered
    }
  }

  void Expire() {
    auto now = Clock::now();
    for (Conn& c : conns_) {
      if (c.dead) continue;
      if (!c.authed && now >= c.hello_deadline && !c.close_after_flush) {
        Drop(c, DeadlineExceededError("no hello within 10 s"));
        continue;
      }
      if (c.pending && now >= c.pending->deadline) {
        TryComplete(c, true);
      }
    }
  }

  // Handles frames left buffered behind requests that were parked, until nothing changes.
  void DrainBuffered() {
    bool progress = true;
    while (progress) {
      progress = false;
      for (Conn& c : conns_) {
        if (c.dead || c.pending || c.close_after_flush) continue;
        if (c.in.size() < store_wire::kHeaderBytes) continue;
        size_t before = c.in.size();
        Process(c);
        if (c.in.size() != before) progress = true;
      }
    }
  }

  void Reap() {
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (it->dead) {
        close(it->fd);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }

  int listen_fd_, wake_r_, wake_w_;
  std::string host_;
  int port_;
  std::string token_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  std::list<Conn> conns_;  // list: Conn addresses stay valid while iterating
  std::map<std::string, std::string> kv_;
};

}  // namespace

Result<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& host, int port,
                                                        const std::string& token) {
  if (port < 0 || port > 65535) {
    return InvalidArgumentError("store bind port " + std::to_string(port) + " out of range");
  }
  if (token.empty()) return InvalidArgumentError("store token is empty (set SHARDSYNC_TOKEN)");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string bind_host = host.empty() ? "127.0.0.1" : host;
  int gai = getaddrinfo(bind_host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0) {
    return InvalidArgumentError("store bind host '" + bind_host + "': " + gai_strerror(gai));
  }
  int fd = -1;
  Status last = UnavailableError("store bind " + bind_host + ": no usable address");
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 512) == 0) break;
    last = store_net::ErrnoStatus(StatusCode::kUnavailable,
                                  "store bind " + bind_host + ":" + std::to_string(port), errno);
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) return last;
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  int bound = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  Status nb = store_net::SetNonBlocking(fd);
  int pipefd[2];
  if (!nb.ok() || pipe2(pipefd, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(fd);
    return InternalError("store: cannot set up the server's descriptors");
  }
  StoreLog().debug("store: serving on {}:{}", bind_host, bound);
  return std::unique_ptr<StoreServer>(
      new StoreServerImpl(fd, pipefd[0], pipefd[1], bind_host, bound, token));
}

}  // namespace shardsync
