// Store server: one thread, poll() over every connection, so a blocking Get/Wait of one client
// never stalls the others (pending requests are parked with a deadline). Hand-written on POSIX
// sockets: no Debian library offers a small authenticated key-value rendezvous. This file: the
// listener, the poll loop, accepting and connection I/O; store_requests.cc: the requests.
//
// Abuse it survives (docs/security.md): connections are capped by the descriptor limit with the
// unauthenticated ones capped again (the oldest evicted), running out of descriptors is handled
// without spinning (a spare descriptor drops the pending connection, then accepting backs off),
// log lines are rate-limited, a wrong token is answered only after a delay, replies are bounded
// before they are built and a memory failure fails the one request, and only authenticated
// requests keep the busy-poll window open.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "store/server.h"

namespace shardsync {
namespace store_server {
namespace {

// A client sends its hello as soon as it is connected: an unauthenticated connection is short.
constexpr auto kHelloTimeout = std::chrono::seconds(2);

}  // namespace

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

std::string SourceOf(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

ServerImpl::ServerImpl(int listen_fd, int wake_r, int wake_w, int spare_fd, std::string host,
                       int port, std::string token, store_limits::ConnLimits limits,
                       size_t max_bytes)
    : listen_fd_(listen_fd),
      wake_r_(wake_r),
      wake_w_(wake_w),
      spare_fd_(spare_fd),
      host_(std::move(host)),
      port_(port),
      token_(std::move(token)),
      limits_(limits),
      max_bytes_(max_bytes),
      kv_(max_bytes, &conn_bytes_) {
  thread_ = std::thread([this] { Run(); });
}

std::string ServerImpl::address() const {
  bool v6 = host_.find(':') != std::string::npos;
  return (v6 ? "[" + host_ + "]" : host_) + ":" + std::to_string(port_);
}

void ServerImpl::Stop() {
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

void ServerImpl::Run() {
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
      if (!Blocked(c)) ev |= POLLIN;
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

bool ServerImpl::EvictUnauthenticated(const char* why, const std::string& source, bool any_age) {
  const auto now = Clock::now();
  Conn* victim = nullptr;
  for (Conn& c : conns_) {  // accept order: the first match is the oldest
    if (c.dead || c.authed || c.fd < 0) continue;
    if (!source.empty() && c.source != source) continue;
    if (c.close_after_flush) {  // failed its hello: waits only to be told so
      victim = &c;
      break;
    }
    if (victim == nullptr && !c.got_bytes && (any_age || now - c.opened >= kEvictMinAge)) {
      victim = &c;
    }
  }
  if (victim == nullptr) return false;
  Log(kLogEvict, spdlog::level::warn,
      "dropped unauthenticated connection from {} ({}; {} of at most {} open)", victim->peer, why,
      unauthenticated_, limits_.unauthenticated);
  CloseConn(*victim, "evicted before authenticating");
  return true;
}

void ServerImpl::Accept() {
  // Drain the backlog each round: a flood must not leave a job's connections queued behind it
  // (a full backlog drops SYNs, and a client resends one only after a second).
  for (int i = 0; i < 1024; ++i) {
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
        // Any idle one, however young: the pending connection may carry a hello, and is not
        // seen until it is accepted.
        if (EvictUnauthenticated("out of descriptors", "", /*any_age=*/true)) continue;
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
    Admit(fd, ss);
  }
}

void ServerImpl::Admit(int fd, const sockaddr_storage& ss) {
  if (open_ >= limits_.total && !EvictUnauthenticated("connection cap")) {
    Log(kLogFull, spdlog::level::warn,
        "refusing connection from {}: {} connections open, none of them evictable (cap {} from "
        "the descriptor limit)",
        SockAddrToString(ss), open_, limits_.total);
    close(fd);
    return;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  try {
    Conn c;
    c.id = next_id_++;
    c.fd = fd;
    c.peer = SockAddrToString(ss);
    c.source = SourceOf(c.peer);
    c.opened = Clock::now();
    c.hello_deadline = c.opened + kHelloTimeout;
    conns_.push_back(std::move(c));
  } catch (const std::bad_alloc&) {
    close(fd);
    Log(kLogMemory, spdlog::level::err, "out of memory accepting a connection");
    return;
  }
  ++open_;
  ++unauthenticated_;
  size_t& from_source = ++unauth_by_source_[conns_.back().source];
  Conn& c = conns_.back();
  ReadFrom(c);  // a hello already here authenticates it now, taking no unauthenticated slot
  if (c.dead || c.authed) return;
  // It needs an unauthenticated slot, under its source's cap and the global one. Room is made
  // from connections that failed their hello, then idle ones (nothing received): for a new idle
  // one only those open long enough to have sent a hello, for one whose hello is in flight any.
  // Never from one whose authentication is in flight; without room the new one goes.
  const bool in_flight = c.got_bytes && !c.close_after_flush;
  const bool source_full = from_source > limits_.per_source;
  const bool all_full = unauthenticated_ > limits_.unauthenticated;
  if ((source_full && !EvictUnauthenticated("per-source cap", c.source, in_flight)) ||
      (all_full && !source_full && !EvictUnauthenticated("unauthenticated cap", "", in_flight))) {
    Log(kLogFull, spdlog::level::warn,
        "refusing connection from {}: {} unauthenticated connections open ({} from {}; caps {} "
        "and {} per source)",
        c.peer, unauthenticated_, from_source, c.source, limits_.unauthenticated,
        limits_.per_source);
    CloseConn(c, "refused before authenticating");
  }
}

void ServerImpl::DropPendingWithSpare() {
  if (spare_fd_ < 0) return;
  close(spare_fd_);
  spare_fd_ = -1;
  int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) close(fd);
  spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

void ServerImpl::PauseAccepting() {
  accept_paused_until_ = Clock::now() + accept_backoff_;
  accept_backoff_ = std::min(accept_backoff_ * 2, kAcceptBackoffMax);
}

void ServerImpl::Recount(Conn& c) {
  if (c.fd < 0) return;  // closed: CloseConn released its share
  size_t keys = 0;
  if (c.pending) {
    for (const std::string& k : c.pending->keys) keys += k.capacity() + sizeof(std::string);
  }
  const size_t now =
      std::max(c.in.capacity(), c.reserve) + c.out.capacity() + c.delayed.capacity() + keys;
  conn_bytes_ = conn_bytes_ - c.counted + now;
  c.counted = now;
}

void ServerImpl::ReadFrom(Conn& c) {
  char buf[65536];
  while (true) {
    ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      c.got_bytes = true;
      size_t skip = std::min(c.discard, static_cast<size_t>(n));  // a refused frame's rest
      c.discard -= skip;
      try {
        c.in.append(buf + skip, static_cast<size_t>(n) - skip);
      } catch (const std::bad_alloc&) {
        Log(kLogMemory, spdlog::level::err, "out of memory reading from {}; closing it", c.peer);
        c.dead = true;
        return;
      }
      if (!Process(c)) return;
      // Stop reading while paused; the rest stays in the socket buffer.
      if (Blocked(c)) return;
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

bool ServerImpl::Process(Conn& c) {
  // Small frames need no reservation: the 64 KiB read buffer bounds what one read adds.
  constexpr size_t kReserveAbove = 64 << 10;
  while (!Blocked(c) && !c.dead && c.discard == 0) {
    if (c.in.size() < store_wire::kHeaderBytes) break;
    size_t limit = c.authed ? store_wire::kMaxPayloadBytes : store_wire::kMaxHelloPayloadBytes;
    auto header = store_wire::ParseFrameHeader(c.in, limit);
    if (!header.ok()) return Drop(c, header.status());
    size_t total = store_wire::kHeaderBytes + header->payload_bytes;
    if (c.in.size() < total) {
      if (total > kReserveAbove && c.reserve < total) {
        // The frame's bytes count from its header on; one that would take the store past its
        // quota is read and dropped, and answered with an error.
        if (Held() - c.counted + total > max_bytes_) {
          c.discard = total - c.in.size();
          c.in.clear();
          Reply(c, StatusCode::kOutOfRange,
                "store: a request of " + std::to_string(total) +
                    " bytes would take the store past its quota of " + std::to_string(max_bytes_) +
                    " bytes (keys, values, dead keys' reasons and requests in flight)");
          break;
        }
        c.reserve = total;
        c.in.reserve(total);  // grown once: appending by doubling would hold up to twice that
      }
      break;
    }
    try {
      auto frame = store_wire::ParseFrame(std::string_view(c.in).substr(0, total), limit);
      c.in.erase(0, total);
      c.reserve = 0;
      if (!frame.ok()) return Drop(c, frame.status());
      HandleOne(c, std::move(*frame));
    } catch (const std::bad_alloc&) {
      Log(kLogMemory, spdlog::level::err, "out of memory parsing a request from {}; closing it",
          c.peer);
      c.dead = true;
    }
  }
  if (c.in.empty() && c.in.capacity() > kReserveAbove) std::string().swap(c.in);
  Recount(c);
  return !c.dead;
}

bool ServerImpl::Drop(Conn& c, const Status& why) {
  Log(kLogFrame, spdlog::level::warn, "closing connection from {}: {}", c.peer, why.ToString());
  c.dead = true;
  return false;
}

void ServerImpl::Flush(Conn& c) {
  while (!c.out.empty()) {
    ssize_t n = send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n > 0) {
      c.out.erase(0, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    c.dead = true;
    break;
  }
  if (c.out.empty() && c.out.capacity() > (64 << 10)) std::string().swap(c.out);
  Recount(c);
  if (c.out.empty() && c.close_after_flush && c.delayed.empty()) c.dead = true;
}

void ServerImpl::DrainBuffered() {
  bool progress = true;
  while (progress) {
    progress = false;
    for (Conn& c : conns_) {
      if (c.dead || Blocked(c)) continue;
      if (c.in.size() < store_wire::kHeaderBytes) continue;
      size_t before = c.in.size();
      Process(c);
      if (c.in.size() != before) progress = true;
    }
  }
}

void ServerImpl::CloseConn(Conn& c, const std::string& why) {
  if (c.fd >= 0) {
    close(c.fd);
    c.fd = -1;
    --open_;
    if (!c.authed) {
      --unauthenticated_;
      auto it = unauth_by_source_.find(c.source);
      if (it != unauth_by_source_.end() && --it->second == 0) unauth_by_source_.erase(it);
    }
  }
  c.dead = true;
  c.pending.reset();
  std::string().swap(c.in);
  std::string().swap(c.out);
  std::string().swap(c.delayed);
  c.reserve = 0;
  conn_bytes_ -= c.counted;
  c.counted = 0;
  if (kv_.ReleaseOwner(c.id, "its owner's store connection (" + c.peer + ") " + why) > 0) {
    released_ = true;
  }
}

void ServerImpl::Reap() {
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

}  // namespace store_server

Result<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& host, int port,
                                                        const std::string& token) {
  return Start(host, port, token, StoreServerOptions{});
}

Result<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& host, int port,
                                                        const std::string& token,
                                                        const StoreServerOptions& options) {
  if (options.max_bytes < (size_t{1} << 20)) {
    return InvalidArgumentError("store quota of " + std::to_string(options.max_bytes) +
                                " bytes: at least 1 MiB");
  }
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
    // The longest backlog the kernel allows (net.core.somaxconn): under a connection flood a full
    // backlog drops a job's SYNs, and a client resends one only after a second.
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) break;
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
  // The kernel hands over a connection only once its first bytes arrived (or after 2 s, the
  // hello timeout): a client sends its hello at once, so the job's connections are accepted
  // with it and authenticate on the spot, while idle flood connections wait in the kernel.
  int defer = 2;
  setsockopt(fd, IPPROTO_TCP, TCP_DEFER_ACCEPT, &defer, sizeof(defer));
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
  return std::unique_ptr<StoreServer>(new store_server::ServerImpl(
      fd, pipefd[0], pipefd[1], spare, bind_host, bound, token, limits, options.max_bytes));
}

}  // namespace shardsync
