// Store server: one thread, poll() over every connection, so a blocking Get/Wait of one client
// never stalls the others (pending requests are parked with a deadline). Hand-written on POSIX
// sockets: no Debian library offers a small authenticated key-value rendezvous.
//
// Abuse it survives (docs/security.md): connections are capped by the descriptor limit with the
// unauthenticated ones capped again (the oldest evicted), running out of descriptors is handled
// without spinning (a spare descriptor drops the pending connection, then accepting backs off),
// log lines are rate-limited, a wrong token is answered only after a delay, replies are bounded
// before they are built and a memory failure fails the one request, and only authenticated
// requests keep the busy-poll window open.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <new>
#include <optional>
#include <thread>

#include "shardsync/store.h"
#include "store/frame.h"
#include "store/kv.h"
#include "store/limits.h"
#include "store/log.h"
#include "store/net.h"

namespace shardsync {
namespace {

using store_net::Clock;
using store_wire::Frame;
using store_wire::Op;

constexpr auto kHelloTimeout = std::chrono::seconds(10);
// A wrong token is answered this late (sshd and etcd slow failed logins down the same way).
constexpr auto kFailedHelloDelay = std::chrono::milliseconds(500);
// Out of descriptors with nothing to evict: stop accepting this long (doubling to the max).
constexpr auto kAcceptBackoffMin = std::chrono::milliseconds(50);
constexpr auto kAcceptBackoffMax = std::chrono::milliseconds(1000);

std::string SockAddrToString(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    std::string out = "[";  // built by appends: `"[" + std::string(...)` trips GCC 12's -Wrestrict
    out.append(host).append("]:").append(std::to_string(ntohs(a->sin6_port)));
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
  store_kv::OwnerId id = 0;
  int fd = -1;
  std::string peer;
  std::string in;
  std::string out;
  bool authed = false;
  bool close_after_flush = false;
  bool dead = false;
  Clock::time_point hello_deadline;
  std::optional<Pending> pending;
  std::string delayed;  // a refused hello's reply, sent at reply_at
  Clock::time_point reply_at;
  // Reads and request handling pause while a request is parked, the connection is closing, or
  // its replies pile up unread.
  bool Paused() const {
    return pending.has_value() || close_after_flush || out.size() >= store_limits::kOutHighWater;
  }
};

// Log lines the server rate-limits, one limiter each.
enum LogKind {
  kLogAccept,
  kLogFull,
  kLogEvict,
  kLogFrame,
  kLogToken,
  kLogHello,
  kLogMemory,
  kLogN
};

class StoreServerImpl final : public StoreServer {
 public:
  StoreServerImpl(int listen_fd, int wake_r, int wake_w, int spare_fd, std::string host, int port,
                  std::string token, store_limits::ConnLimits limits)
      : listen_fd_(listen_fd),
        wake_r_(wake_r),
        wake_w_(wake_w),
        spare_fd_(spare_fd),
        host_(std::move(host)),
        port_(port),
        token_(std::move(token)),
        limits_(limits),
        kv_(store_limits::kMaxStoreBytes) {
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
    for (Conn& c : conns_) {
      if (c.fd >= 0) close(c.fd);
    }
    conns_.clear();
    close(listen_fd_);
    close(wake_r_);
    close(wake_w_);
    if (spare_fd_ >= 0) close(spare_fd_);
  }

 private:
  template <typename... A>
  void Log(LogKind kind, spdlog::level::level_enum level, fmt::format_string<A...> f, A&&... args) {
    uint64_t suppressed = 0;
    if (!logs_[kind].Allow(Clock::now(), &suppressed)) return;
    std::string msg = fmt::format(f, std::forward<A>(args)...);
    if (suppressed > 0) msg += fmt::format(" ({} more like it suppressed)", suppressed);
    StoreLog().log(level, "store: {}", msg);
  }

  void Run() {
    std::vector<pollfd> fds;
    std::vector<Conn*> order;
    // Requests come in bursts (a sync's ready phase, then its verdicts one device copy later):
    // for a while after one, poll without blocking, so the next costs no thread wake-up. Woken
    // from a blocking poll, this thread answered ~100 us late on the H200 machine (traced syncs
    // in docs/benchmarks.md); the window spans a sync, and the thread yields while it spins.
    // Only an authenticated request opens it: stray bytes must not keep a core busy.
    constexpr auto kHotWindow = std::chrono::milliseconds(20);
    auto last_active = Clock::now() - kHotWindow;
    while (!stopping_.load()) {
      fds.clear();
      order.clear();
      const auto now = Clock::now();
      const bool accepting = now >= accept_paused_until_;
      fds.push_back({wake_r_, POLLIN, 0});
      fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
      auto next = now + std::chrono::hours(1);
      if (!accepting) next = std::min(next, accept_paused_until_);
      for (Conn& c : conns_) {
        if (c.dead) continue;
        short ev = 0;
        // A parked request stops reading: a client cannot pile up unbounded pipelined input.
        if (!c.Paused()) ev |= POLLIN;
        if (!c.out.empty()) ev |= POLLOUT;
        fds.push_back({c.fd, ev, 0});
        order.push_back(&c);
        if (!c.authed && !c.close_after_flush) next = std::min(next, c.hello_deadline);
        if (c.pending) next = std::min(next, c.pending->deadline);
        if (!c.delayed.empty()) next = std::min(next, c.reply_at);
      }
      const bool hot = now - last_active < kHotWindow;
      int rc = poll(fds.data(), fds.size(), hot ? 0 : store_net::MillisLeft(next));
      if (rc == 0 && hot) std::this_thread::yield();
      if (rc < 0 && errno != EINTR) {
        Log(kLogAccept, spdlog::level::err, "poll failed: {}", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (stopping_.load()) break;
      served_ = false;
      if (rc > 0) {
        if (fds[1].revents & POLLIN) Accept();
        for (size_t i = 0; i < order.size(); ++i) {
          Conn& c = *order[i];
          if (c.dead) continue;  // evicted by Accept above
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
      if (served_) last_active = Clock::now();
    }
  }

  // Closes the oldest unauthenticated connection to make room; false if there is none.
  bool EvictOldestUnauthenticated(const char* why) {
    for (Conn& c : conns_) {
      if (c.dead || c.authed || c.fd < 0) continue;
      Log(kLogEvict, spdlog::level::warn,
          "dropped unauthenticated connection from {} ({}; {} of at most {} open)", c.peer, why,
          unauthenticated_, limits_.unauthenticated);
      CloseConn(c, "evicted before authenticating");
      return true;
    }
    return false;
  }

  void Accept() {
    for (int i = 0; i < 64; ++i) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      int fd =
          accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK) return;
        if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
        if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
          // Out of descriptors (or kernel memory). Make room from an unauthenticated connection;
          // else take the pending connection on the spare descriptor and drop it, and stop
          // accepting for a while, so poll() does not report the listener ready forever.
          if (EvictOldestUnauthenticated("out of descriptors")) continue;
          DropPendingWithSpare();
          PauseAccepting();
          Log(kLogAccept, spdlog::level::warn,
              "accept failed: {}; refusing new connections for {} ms ({} open)", std::strerror(err),
              accept_backoff_.count(), open_);
          return;
        }
        PauseAccepting();
        Log(kLogAccept, spdlog::level::warn, "accept failed: {}", std::strerror(err));
        return;
      }
      accept_backoff_ = kAcceptBackoffMin;
      if (open_ >= limits_.total && !EvictOldestUnauthenticated("connection cap")) {
        Log(kLogFull, spdlog::level::warn,
            "refusing connection from {}: {} authenticated connections open (cap {} from the "
            "descriptor limit)",
            SockAddrToString(ss), open_, limits_.total);
        close(fd);
        continue;
      }
      if (unauthenticated_ >= limits_.unauthenticated) {
        EvictOldestUnauthenticated("unauthenticated cap");
      }
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      try {
        Conn c;
        c.id = next_id_++;
        c.fd = fd;
        c.peer = SockAddrToString(ss);
        c.hello_deadline = Clock::now() + kHelloTimeout;
        conns_.push_back(std::move(c));
      } catch (const std::bad_alloc&) {
        close(fd);
        Log(kLogMemory, spdlog::level::err, "out of memory accepting a connection");
        return;
      }
      ++open_;
      ++unauthenticated_;
    }
  }

  // The reserved-descriptor trick (libev, nginx): give the spare back, accept the pending
  // connection on it and close it, then take the spare again.
  void DropPendingWithSpare() {
    if (spare_fd_ < 0) return;
    close(spare_fd_);
    spare_fd_ = -1;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) close(fd);
    spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  }

  void PauseAccepting() {
    accept_paused_until_ = Clock::now() + accept_backoff_;
    accept_backoff_ = std::min(accept_backoff_ * 2, kAcceptBackoffMax);
  }

  // Keepalive on authenticated connections: a rank whose host died (no FIN ever comes) loses its
  // ephemeral keys within about 5 s instead of never.
  static void KeepAlive(int fd) {
    int one = 1, idle = 2, intvl = 1, cnt = 3;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  }

  void ReadFrom(Conn& c) {
    char buf[65536];
    while (true) {
      ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) {
        try {
          c.in.append(buf, static_cast<size_t>(n));
        } catch (const std::bad_alloc&) {
          Log(kLogMemory, spdlog::level::err, "out of memory reading from {}; closing it", c.peer);
          c.dead = true;
          return;
        }
        if (!Process(c)) return;
        // Stop reading while paused; the rest stays in the socket buffer.
        if (c.Paused()) return;
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
    while (!c.Paused() && !c.dead) {
      if (c.in.size() < store_wire::kHeaderBytes) return true;
      size_t limit = c.authed ? store_wire::kMaxPayloadBytes : store_wire::kMaxHelloPayloadBytes;
      auto header = store_wire::ParseFrameHeader(c.in, limit);
      if (!header.ok()) return Drop(c, header.status());
      size_t total = store_wire::kHeaderBytes + header->payload_bytes;
      if (c.in.size() < total) return true;
      try {
        auto frame = store_wire::ParseFrame(std::string_view(c.in).substr(0, total), limit);
        c.in.erase(0, total);
        if (!frame.ok()) return Drop(c, frame.status());
        HandleOne(c, std::move(*frame));
      } catch (const std::bad_alloc&) {
        Log(kLogMemory, spdlog::level::err, "out of memory parsing a request from {}; closing it",
            c.peer);
        c.dead = true;
      }
    }
    return !c.dead;
  }

  bool Drop(Conn& c, const Status& why) {
    Log(kLogFrame, spdlog::level::warn, "closing connection from {}: {}", c.peer, why.ToString());
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
    if (c.close_after_flush && c.delayed.empty()) c.dead = true;
  }

  // One request, its memory failure answered on its own: the server and every other connection
  // carry on.
  void HandleOne(Conn& c, Frame f) {
    try {
      Handle(c, std::move(f));
    } catch (const std::bad_alloc&) {
      c.pending.reset();
      Log(kLogMemory, spdlog::level::err, "out of memory serving a request from {}", c.peer);
      try {
        Reply(c, StatusCode::kUnavailable, "store: out of memory serving this request");
      } catch (const std::bad_alloc&) {
        c.dead = true;
      }
    }
  }

  void Handle(Conn& c, Frame f) {
    if (!c.authed) {
      if (f.op != Op::kHello) {
        Drop(c, PermissionDeniedError("first frame is not hello"));
        return;
      }
      if (!store_net::ConstantTimeEquals(f.args[0], token_)) {
        Log(kLogToken, spdlog::level::warn, "refused connection from {}: wrong token", c.peer);
        Frame r{Op::kReply,
                static_cast<int64_t>(StatusCode::kPermissionDenied),
                {"store refused the token (SHARDSYNC_TOKEN)"}};
        c.delayed = store_wire::EncodeFrame(r);
        c.reply_at = Clock::now() + kFailedHelloDelay;
        c.close_after_flush = true;
        return;
      }
      c.authed = true;
      --unauthenticated_;
      KeepAlive(c.fd);
      served_ = true;
      Reply(c, StatusCode::kOk, "");
      return;
    }
    served_ = true;
    switch (f.op) {
      case Op::kHello:
        Reply(c, StatusCode::kOk, "");
        return;
      case Op::kSet:
      case Op::kSetEphemeral: {
        Status s = kv_.Set(f.args[0], std::move(f.args[1]), c.id, f.op == Op::kSetEphemeral);
        ReplyStatus(c, s, "");
        if (s.ok()) WakeParked();
        return;
      }
      case Op::kSetIfAbsent: {
        auto r = kv_.SetIfAbsent(f.args[0], std::move(f.args[1]), c.id, f.num == 1);
        if (!r.ok()) return ReplyStatus(c, r.status(), "");
        Reply(c, StatusCode::kOk, std::move(*r));
        WakeParked();
        return;
      }
      case Op::kAdd: {
        auto r = kv_.Add(f.args[0], f.num, c.id);
        if (!r.ok()) return ReplyStatus(c, r.status(), "");
        Reply(c, StatusCode::kOk, std::to_string(*r));
        WakeParked();
        return;
      }
      case Op::kDeletePrefix:
        Reply(c, StatusCode::kOk, std::to_string(kv_.DeletePrefix(f.args[0])));
        return;
      case Op::kMarkDead:
        kv_.MarkDead(f.args[0], f.args[1].empty() ? "marked dead by a client" : f.args[1]);
        Reply(c, StatusCode::kOk, "");
        WakeParked();
        return;
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

  void ReplyStatus(Conn& c, const Status& s, std::string ok_value) {
    if (s.ok()) return Reply(c, StatusCode::kOk, std::move(ok_value));
    Reply(c, s.code(), s.message());
  }

  // Answers c's parked request if satisfied, expired, or naming a dead key; true if answered.
  bool TryComplete(Conn& c, bool expired) {
    Pending& p = *c.pending;
    const char* what = p.op == Op::kWait ? "wait" : "get";
    // Reply payload: i64 code, u32 nargs, then u32 length + bytes per value.
    size_t reply_bytes = 12;
    for (const std::string& k : p.keys) {
      if (const std::string* why = kv_.DeadReason(k)) {
        std::string msg = std::string("store ") + what + ": key '" + k + "' is dead: " + *why;
        c.pending.reset();
        Reply(c, StatusCode::kUnavailable, std::move(msg));
        return true;
      }
    }
    for (const std::string& k : p.keys) {
      const std::string* v = kv_.Find(k);
      if (v == nullptr) {
        if (!expired && Clock::now() < p.deadline) return false;
        std::string msg = std::string("store ") + what + ": key '" + k + "' not set within " +
                          std::to_string(p.timeout_ms) + " ms";
        c.pending.reset();
        Reply(c, StatusCode::kDeadlineExceeded, std::move(msg));
        return true;
      }
      if (p.op != Op::kWait) reply_bytes += 4 + v->size();
    }
    // Bound the reply before building it: one request naming a large value many times must not
    // make the server allocate gigabytes (the client refuses such a frame anyway).
    if (reply_bytes > store_wire::kMaxPayloadBytes) {
      std::string msg = "store get-many: the reply would be " + std::to_string(reply_bytes) +
                        " bytes, above the " + std::to_string(store_wire::kMaxPayloadBytes) +
                        "-byte frame limit (" + std::to_string(p.keys.size()) + " keys)";
      c.pending.reset();
      Reply(c, StatusCode::kOutOfRange, std::move(msg));
      return true;
    }
    std::vector<std::string> values;
    if (p.op == Op::kWait) {
      values.emplace_back();
    } else {
      values.reserve(p.keys.size());
      for (const std::string& k : p.keys) values.push_back(*kv_.Find(k));
    }
    c.pending.reset();
    Reply(c, StatusCode::kOk, std::move(values));
    return true;
  }

  void WakeParked() {
    for (Conn& c : conns_) {
      if (c.dead || !c.pending) continue;
      try {
        TryComplete(c, false);  // pipelined input behind it is handled by DrainBuffered
      } catch (const std::bad_alloc&) {
        c.pending.reset();
        Log(kLogMemory, spdlog::level::err, "out of memory answering {}; closing it", c.peer);
        c.dead = true;
      }
    }
  }

  void Expire() {
    auto now = Clock::now();
    for (Conn& c : conns_) {
      if (c.dead) continue;
      if (!c.delayed.empty() && now >= c.reply_at) {
        c.out += c.delayed;
        c.delayed.clear();
        Flush(c);
        continue;
      }
      if (!c.authed && now >= c.hello_deadline && !c.close_after_flush) {
        Log(kLogHello, spdlog::level::warn, "closing connection from {}: no hello within 10 s",
            c.peer);
        c.dead = true;
        continue;
      }
      if (c.pending && now >= c.pending->deadline) {
        try {
          TryComplete(c, true);
        } catch (const std::bad_alloc&) {
          c.dead = true;
        }
      }
    }
  }

  // Handles frames left buffered behind requests that were parked, until nothing changes.
  void DrainBuffered() {
    bool progress = true;
    while (progress) {
      progress = false;
      for (Conn& c : conns_) {
        if (c.dead || c.Paused()) continue;
        if (c.in.size() < store_wire::kHeaderBytes) continue;
        size_t before = c.in.size();
        Process(c);
        if (c.in.size() != before) progress = true;
      }
    }
  }

  // Closes c's descriptor now; what it held as ephemeral keys becomes dead.
  void CloseConn(Conn& c, const std::string& why) {
    if (c.fd >= 0) {
      close(c.fd);
      c.fd = -1;
      --open_;
      if (!c.authed) --unauthenticated_;
    }
    c.dead = true;
    if (kv_.ReleaseOwner(c.id, "its owner's store connection (" + c.peer + ") " + why) > 0) {
      released_ = true;
    }
  }

  void Reap() {
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (it->dead) {
        CloseConn(*it, "closed");
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
    if (released_) {
      released_ = false;
      WakeParked();  // waiters on those keys fail now, not at their timeout
    }
  }

  int listen_fd_, wake_r_, wake_w_, spare_fd_;
  std::string host_;
  int port_;
  std::string token_;
  store_limits::ConnLimits limits_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  std::list<Conn> conns_;  // list: Conn addresses stay valid while iterating; accept order
  store_kv::Kv kv_;
  store_kv::OwnerId next_id_ = 1;
  size_t open_ = 0;             // connections with an open descriptor
  size_t unauthenticated_ = 0;  // of which not authenticated
  bool served_ = false;         // an authenticated request was handled this round
  bool released_ = false;       // a closed connection's ephemeral keys died
  Clock::time_point accept_paused_until_{};
  std::chrono::milliseconds accept_backoff_ = kAcceptBackoffMin;
  std::array<store_limits::LogLimiter, kLogN> logs_;
};

}  // namespace

Result<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& host, int port,
                                                        const std::string& token) {
  if (port < 0 || port > 65535) {
    return InvalidArgumentError("store bind port " + std::to_string(port) + " out of range");
  }
  SS_RETURN_IF_ERROR(CheckStoreToken(token, "store token (SHARDSYNC_TOKEN)"));
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
  const int spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  rlimit rl{};
  uint64_t nofile = 1024;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    nofile = rl.rlim_cur == RLIM_INFINITY ? uint64_t{1} << 20 : static_cast<uint64_t>(rl.rlim_cur);
  }
  const store_limits::ConnLimits limits = store_limits::ConnectionLimits(nofile);
  StoreLog().debug("store: serving on {}:{} (at most {} connections, {} unauthenticated)",
                   bind_host, bound, limits.total, limits.unauthenticated);
  return std::unique_ptr<StoreServer>(
      new StoreServerImpl(fd, pipefd[0], pipefd[1], spare, bind_host, bound, token, limits));
}

}  // namespace shardsync
