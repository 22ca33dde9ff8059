// Store client: one blocking request at a time over a socket, every step bounded by a deadline.
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <thread>

#include "shardsync/store.h"
#include "store/frame.h"
#include "store/net.h"

namespace shardsync {
namespace {

using store_net::Clock;
using store_wire::Frame;
using store_wire::Op;

// Opens a TCP connection before `deadline`, retrying refusals: rank 0 may still be starting
// the server when the other ranks come up.
Result<int> Dial(const std::string& host, int port, Clock::time_point deadline,
                 const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  Status last = DeadlineExceededError("store " + address + ": connect timed out");
  auto backoff = std::chrono::milliseconds(5);
  // Each attempt waits a short while first: a SYN the server's full backlog dropped (a flood of
  // connections) is resent by the kernel only after a second, a new attempt sends one now.
  auto attempt = std::chrono::milliseconds(250);
  while (true) {
    addrinfo* res = nullptr;
    int gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai != 0) {
      return UnavailableError("store " + address + ": cannot resolve host: " + gai_strerror(gai));
    }
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) continue;
      if (!store_net::SetNonBlocking(fd).ok()) {
        close(fd);
        continue;
      }
      int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
      int err = rc == 0 ? 0 : errno;
      if (rc != 0 && err == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        int pr = poll(&p, 1, store_net::MillisLeft(std::min(deadline, Clock::now() + attempt)));
        attempt = std::min(attempt * 2, std::chrono::milliseconds(4000));
        if (pr <= 0) {
          err = ETIMEDOUT;
        } else {
          socklen_t len = sizeof(err);
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        }
      }
      if (err == 0) {
        freeaddrinfo(res);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
      }
      last =
          store_net::ErrnoStatus(StatusCode::kUnavailable, "store " + address + ": connect", err);
      close(fd);
    }
    freeaddrinfo(res);
    if (Clock::now() + backoff >= deadline) {
      return Status(
          last.code() == StatusCode::kUnavailable ? StatusCode::kDeadlineExceeded : last.code(),
          last.message() + " (gave up at the connect timeout)");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

class StoreClientImpl final : public StoreClient {
 public:
  StoreClientImpl(int fd, std::string address, Millis io_timeout)
      : fd_(fd), address_(std::move(address)), io_timeout_(io_timeout) {}
  ~StoreClientImpl() override { close(fd_); }

  Status Hello(const std::string& token) {
    Frame f{Op::kHello, 0, {token}};
    return Call(f, Clock::now() + io_timeout_).status();
  }

  Status Set(const std::string& key, std::string_view value) override {
    SS_RETURN_IF_ERROR(CheckKey(key));
    SS_RETURN_IF_ERROR(CheckValue(key, value));
    Frame f{Op::kSet, 0, {key, std::string(value)}};
    return Call(f, Clock::now() + io_timeout_).status();
  }

  Result<std::string> Get(const std::string& key, Millis timeout) override {
    SS_RETURN_IF_ERROR(CheckKey(key));
    SS_RETURN_IF_ERROR(CheckTimeout(timeout, key));
    Frame f{Op::kGet, timeout.count(), {key}};
    return Call(f, Clock::now() + store_net::ClampWait(timeout) + io_timeout_);
  }

  Result<int64_t> Add(const std::string& key, int64_t delta) override {
    SS_RETURN_IF_ERROR(CheckKey(key));
    Frame f{Op::kAdd, delta, {key}};
    SS_ASSIGN_OR_RETURN(std::string v, Call(f, Clock::now() + io_timeout_));
    return ParseCount(v, "add '" + key + "'");
  }

  Result<std::vector<std::string>> GetMany(const std::vector<std::string>& keys,
                                           Millis timeout) override {
    return SetThenGetManyImpl(nullptr, keys, timeout);
  }

  Status SetMany(const std::vector<std::pair<std::string, std::string>>& kvs) override {
    std::vector<Frame> frames;
    for (const auto& [k, v] : kvs) {
      SS_RETURN_IF_ERROR(CheckKey(k));
      SS_RETURN_IF_ERROR(CheckValue(k, v));
      frames.push_back(Frame{Op::kSet, 0, {k, v}});
    }
    if (frames.empty()) return OkStatus();
    return CallChain(frames, Clock::now() + io_timeout_).status();
  }

  Result<std::vector<std::string>> SetThenGetMany(const std::string& key, std::string_view value,
                                                  const std::vector<std::string>& keys,
                                                  Millis timeout) override {
    SS_RETURN_IF_ERROR(CheckKey(key));
    SS_RETURN_IF_ERROR(CheckValue(key, value));
    Frame set{Op::kSet, 0, {key, std::string(value)}};
    return SetThenGetManyImpl(&set, keys, timeout);
  }

  Status Wait(const std::vector<std::string>& keys, Millis timeout) override {
    if (keys.empty()) return OkStatus();
    for (const std::string& k : keys) SS_RETURN_IF_ERROR(CheckKey(k));
    SS_RETURN_IF_ERROR(CheckTimeout(timeout, keys[0]));
    Frame f{Op::kWait, timeout.count(), keys};
    return Call(f, Clock::now() + store_net::ClampWait(timeout) + io_timeout_).status();
  }

  Result<int64_t> DeletePrefix(const std::string& prefix) override {
    if (prefix.empty()) {
      return InvalidArgumentError(
          "store delete-prefix: the prefix is empty (it would match every key)");
    }
    Frame f{Op::kDeletePrefix, 0, {prefix}};
    SS_ASSIGN_OR_RETURN(std::string v, Call(f, Clock::now() + io_timeout_));
    return ParseCount(v, "delete-prefix '" + prefix + "'");
  }

  Status DeletePrefixes(const std::vector<std::string>& prefixes) override {
    std::vector<Frame> frames;
    for (const std::string& p : prefixes) {
      if (p.empty()) {
        return InvalidArgumentError(
            "store delete-prefix: the prefix is empty (it would match every key)");
      }
      frames.push_back(Frame{Op::kDeletePrefix, 0, {p}});
    }
    if (frames.empty()) return OkStatus();
    return CallChain(frames, Clock::now() + io_timeout_).status();
  }

  Status SetEphemeral(const std::string& key, std::string_view value) override {
    SS_RETURN_IF_ERROR(CheckKey(key));
    SS_RETURN_IF_ERROR(CheckValue(key, value));
    Frame f{Op::kSetEphemeral, 0, {key, std::string(value)}};
    return Call(f, Clock::now() + io_timeout_).status();
  }

  Result<std::string> SetIfAbsent(const std::string& key, std::string_view value,
                                  bool ephemeral) override {
    SS_RETURN_IF_ERROR(CheckKey(key));
    SS_RETURN_IF_ERROR(CheckValue(key, value));
    Frame f{Op::kSetIfAbsent, ephemeral ? 1 : 0, {key, std::string(value)}};
    return Call(f, Clock::now() + io_timeout_);
  }

  Status MarkDead(const std::string& key, std::string_view reason) override {
    SS_RETURN_IF_ERROR(CheckKey(key));
    SS_RETURN_IF_ERROR(CheckValue(key, reason));
    Frame f{Op::kMarkDead, 0, {key, std::string(reason)}};
    return Call(f, Clock::now() + io_timeout_).status();
  }

  // Generation-counted so the same name can be reused: the k-th arrival (from 1) belongs to
  // round (k-1)/world, and the round's last arrival sets its done key.
  Status Barrier(const std::string& name, int world, Millis timeout) override {
    if (world < 1) {
      return InvalidArgumentError("store barrier '" + name + "': world must be >= 1, got " +
                                  std::to_string(world));
    }
    const std::string base = "__barrier/" + name;
    SS_ASSIGN_OR_RETURN(int64_t n, Add(base + "/arrived", 1));
    int64_t round = (n - 1) / world;
    std::string done = base + "/done/" + std::to_string(round);
    if (n % world == 0) SS_RETURN_IF_ERROR(Set(done, "1"));
    Status s = Wait({done}, timeout);
    if (s.code() == StatusCode::kDeadlineExceeded) {
      auto now = Add(base + "/arrived", 0);
      int64_t arrived = now.ok() ? std::min<int64_t>(*now - round * world, world) : -1;
      return DeadlineExceededError(
          "store barrier '" + name +
          "': " + (arrived >= 0 ? std::to_string(arrived) : std::string("?")) + " of " +
          std::to_string(world) + " participants arrived within " +
          std::to_string(timeout.count()) + " ms");
    }
    return s;
  }

 private:
  static Result<int64_t> ParseCount(const std::string& v, const std::string& what) {
    int64_t out = 0;
    auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc() || ptr != v.data() + v.size()) {
      return InternalError("store " + what + ": server replied a non-integer");
    }
    return out;
  }

  static Status CheckKey(const std::string& key) {
    if (key.empty()) return InvalidArgumentError("store: key is empty");
    return OkStatus();
  }
  // GetMany of `keys`, preceded in the same round trip by `set` when given.
  Result<std::vector<std::string>> SetThenGetManyImpl(const Frame* set,
                                                      const std::vector<std::string>& keys,
                                                      Millis timeout) {
    if (keys.empty()) {
      if (set) SS_RETURN_IF_ERROR(CallArgs(*set, Clock::now() + io_timeout_).status());
      return std::vector<std::string>{};
    }
    for (const std::string& k : keys) SS_RETURN_IF_ERROR(CheckKey(k));
    SS_RETURN_IF_ERROR(CheckTimeout(timeout, keys[0]));
    std::vector<Frame> frames;
    if (set) frames.push_back(*set);
    frames.push_back(Frame{Op::kGetMany, timeout.count(), keys});
    SS_ASSIGN_OR_RETURN(
        std::vector<std::string> values,
        CallChain(frames, Clock::now() + store_net::ClampWait(timeout) + io_timeout_));
    if (values.size() != keys.size()) {
      broken_ = true;
      return InternalError("store " + address_ + ": get-many of " + std::to_string(keys.size()) +
                           " keys answered with " + std::to_string(values.size()) + " values");
    }
    return values;
  }

  static Status CheckValue(const std::string& key, std::string_view value) {
    if (value.size() + key.size() + 64 > store_wire::kMaxPayloadBytes) {
      return OutOfRangeError("store set '" + key + "': value of " + std::to_string(value.size()) +
                             " bytes exceeds the 64 MiB frame limit");
    }
    return OkStatus();
  }
  static Status CheckTimeout(Millis t, const std::string& key) {
    if (t.count() < 0) {
      return InvalidArgumentError("store '" + key + "': negative timeout " +
                                  std::to_string(t.count()) + " ms");
    }
    return OkStatus();
  }

  Result<std::string> Call(const Frame& f, Clock::time_point deadline) {
    SS_ASSIGN_OR_RETURN(std::vector<std::string> args, CallArgs(f, deadline));
    return std::move(args[0]);
  }

  // One request and its reply's args (at least one; the parser refuses replies without).
  Result<std::vector<std::string>> CallArgs(const Frame& f, Clock::time_point deadline) {
    return CallChain({f}, deadline);
  }

  // Sends `frames` back to back, then reads their replies (the server answers a connection's
  // requests in order): one round trip for all. The first request's error if one failed (every
  // reply is read regardless, so the stream stays in step), else the last reply's args.
  Result<std::vector<std::string>> CallChain(const std::vector<Frame>& frames,
                                             Clock::time_point deadline) {
    if (broken_) {
      // Say what happened to it (a killed store: "server closed the connection"), not only
      // that the connection is gone.
      return UnavailableError("store " + address_ + " is unreachable: " + broken_why_ +
                              " (the store process died or was stopped?)");
    }
    auto r = CallChainOnce(frames, deadline);
    // Only a failure of the stream itself ends the connection: an error reply (a dead key, a
    // refused request) leaves it in step.
    if (!r.ok() && (io_failed_ || r.status().code() == StatusCode::kInternal)) {
      broken_ = true;
      broken_why_ = r.status().message();
    }
    return r;
  }

  Result<std::vector<std::string>> CallChainOnce(const std::vector<Frame>& frames,
                                                 Clock::time_point deadline) {
    io_failed_ = false;
    std::string bytes;
    for (const Frame& f : frames) bytes += store_wire::EncodeFrame(f);
    SS_RETURN_IF_ERROR(SendAll(bytes, deadline));
    Status first_error;
    Result<std::vector<std::string>> last = std::vector<std::string>{};
    for (size_t i = 0; i < frames.size(); ++i) {
      last = RecvReply(deadline);
      if (!last.ok() && io_failed_) return last.status();
      if (!last.ok() && first_error.ok()) first_error = last.status();
    }
    if (!first_error.ok()) return first_error;
    return last;
  }

  Result<std::vector<std::string>> RecvReply(Clock::time_point deadline) {
    std::string header(store_wire::kHeaderBytes, '\0');
    SS_RETURN_IF_ERROR(RecvAll(header.data(), header.size(), deadline));
    auto h = store_wire::ParseFrameHeader(header);
    if (!h.ok()) {
      io_failed_ = true;
      return InternalError("store " + address_ + ": bad reply: " + h.status().message());
    }
    std::string frame = header;
    frame.resize(store_wire::kHeaderBytes + h->payload_bytes);
    SS_RETURN_IF_ERROR(
        RecvAll(frame.data() + store_wire::kHeaderBytes, h->payload_bytes, deadline));
    auto r = store_wire::ParseFrame(frame);
    if (!r.ok() || r->op != Op::kReply) {
      io_failed_ = true;
      return InternalError("store " + address_ + ": malformed reply");
    }
    auto code = static_cast<StatusCode>(r->num);
    if (code != StatusCode::kOk) return Status(code, r->args[0]);
    return std::move(r->args);
  }

  Status SendAll(const std::string& bytes, Clock::time_point deadline) {
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        SS_RETURN_IF_ERROR(WaitFd(POLLOUT, deadline));
        continue;
      }
      io_failed_ = true;
      return store_net::ErrnoStatus(StatusCode::kUnavailable, "store " + address_ + ": send",
                                    errno);
    }
    return OkStatus();
  }

  Status RecvAll(char* buf, size_t bytes, Clock::time_point deadline) {
    size_t off = 0;
    while (off < bytes) {
      ssize_t n = recv(fd_, buf + off, bytes - off, 0);
      if (n > 0) {
        off += static_cast<size_t>(n);
        continue;
      }
      if (n == 0) {
        io_failed_ = true;
        return UnavailableError("store " + address_ + ": server closed the connection");
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        SS_RETURN_IF_ERROR(WaitFd(POLLIN, deadline));
        continue;
      }
      io_failed_ = true;
      return store_net::ErrnoStatus(StatusCode::kUnavailable, "store " + address_ + ": recv",
                                    errno);
    }
    return OkStatus();
  }

  Status WaitFd(short events, Clock::time_point deadline) {
    // A reply usually comes within tens of us: check without blocking for a short while first,
    // so it costs no thread wake-up (which is what a blocking poll costs on an idle host).
    const auto spin_until = std::min(deadline, Clock::now() + std::chrono::microseconds(300));
    while (Clock::now() < spin_until) {
      pollfd p{fd_, events, 0};
      const int rc = poll(&p, 1, 0);
      if (rc > 0) return OkStatus();
      if (rc < 0 && errno != EINTR) break;
      std::this_thread::yield();
    }
    while (true) {
      pollfd p{fd_, events, 0};
      int rc = poll(&p, 1, store_net::MillisLeft(deadline));
      if (rc > 0) return OkStatus();
      if (rc < 0 && errno == EINTR) continue;
      if (Clock::now() < deadline && rc == 0) continue;
      // A reply left in flight would desynchronize the stream: the connection is done.
      io_failed_ = true;
      return DeadlineExceededError("store " + address_ + ": no reply before the call timeout");
    }
  }

  int fd_;
  std::string address_;
  Millis io_timeout_;
  bool broken_ = false;
  std::string broken_why_;  // the failure that broke it
  bool io_failed_ = false;
};

}  // namespace

Result<std::pair<std::string, int>> ParseHostPort(std::string_view address, std::string_view what) {
  std::string a(address);
  auto bad = [&](const std::string& why) {
    return InvalidArgumentError(std::string(what) + " '" + a + "': " + why + " (want host:port)");
  };
  std::string host;
  std::string port_str;
  if (!a.empty() && a[0] == '[') {
    size_t close = a.find(']');
    if (close == std::string::npos || close + 1 >= a.size() || a[close + 1] != ':') {
      return bad("unterminated [ipv6] host");
    }
    host = a.substr(1, close - 1);
    port_str = a.substr(close + 2);
  } else {
    size_t colon = a.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    host = a.substr(0, colon);
    port_str = a.substr(colon + 1);
    if (host.find(':') != std::string::npos) return bad("ipv6 hosts need [brackets]");
  }
  if (host.empty()) return bad("empty host");
  int port = -1;
  auto [ptr, ec] = std::from_chars(port_str.data(), port_str.data() + port_str.size(), port);
  if (port_str.empty() || ec != std::errc() || ptr != port_str.data() + port_str.size() ||
      port < 0 || port > 65535) {
    return bad("port '" + port_str + "' is not in 0..65535");
  }
  return std::make_pair(host, port);
}

Result<std::unique_ptr<StoreClient>> StoreClient::Connect(const std::string& address,
                                                          const std::string& token,
                                                          Millis timeout) {
  SS_ASSIGN_OR_RETURN(auto hp, ParseHostPort(address, "store address"));
  if (hp.second == 0) return InvalidArgumentError("store address '" + address + "': port 0");
  // No server accepts a shorter token: say so now rather than after its failed-hello delay.
  SS_RETURN_IF_ERROR(CheckStoreToken(token, "SHARDSYNC_TOKEN"));
  if (timeout.count() <= 0) {
    return InvalidArgumentError("store connect timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
  }
  timeout = store_net::ClampWait(timeout);
  auto deadline = Clock::now() + timeout;
  auto backoff = std::chrono::milliseconds(2);
  while (true) {
    SS_ASSIGN_OR_RETURN(int fd, Dial(hp.first, hp.second, deadline, address));
    auto client = std::make_unique<StoreClientImpl>(fd, address, timeout);
    Status s = client->Hello(token);
    if (s.ok()) return std::unique_ptr<StoreClient>(std::move(client));
    if (s.code() == StatusCode::kPermissionDenied) {
      return PermissionDeniedError("store " + address + " refused the token (SHARDSYNC_TOKEN)");
    }
    // A store under a flood of unauthenticated connections may close a new one before reading
    // its hello (it keeps its slots for connections that authenticate): dial again.
    if (Clock::now() + backoff >= deadline) return s;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace shardsync
