// The store server's state and its one thread (StoreServer::Start in store_server.cc builds it):
// connections and their parked requests, the key-value state, the limits it holds clients to.
// store_server.cc holds the poll loop, accepting and connection I/O; store_requests.cc the
// requests and their replies. Internal to the store layer.
#pragma once

#include <fmt/format.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <chrono>
#include <list>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardsync/store.h"
#include "store/frame.h"
#include "store/kv.h"
#include "store/limits.h"
#include "store/log.h"
#include "store/net.h"

namespace shardsync::store_server {

using store_net::Clock;
using store_wire::Frame;
using store_wire::Op;

// Out of descriptors with nothing to evict: stop accepting this long (doubling to the max).
inline constexpr auto kAcceptBackoffMin = std::chrono::milliseconds(50);
inline constexpr auto kAcceptBackoffMax = std::chrono::milliseconds(1000);

// "host:port" ("[v6]:port") of a peer address.
std::string SockAddrToString(const sockaddr_storage& ss);

// A Get / Wait / GetMany parked until its keys exist, one dies, or its deadline.
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

class ServerImpl final : public StoreServer {
 public:
  ServerImpl(int listen_fd, int wake_r, int wake_w, int spare_fd, std::string host, int port,
             std::string token, store_limits::ConnLimits limits);
  ~ServerImpl() override { Stop(); }

  int port() const override { return port_; }
  std::string address() const override;
  void Stop() override;

 private:
  template <typename... A>
  void Log(LogKind kind, spdlog::level::level_enum level, fmt::format_string<A...> f, A&&... args) {
    uint64_t suppressed = 0;
    if (!logs_[kind].Allow(Clock::now(), &suppressed)) return;
    std::string msg = fmt::format(f, std::forward<A>(args)...);
    if (suppressed > 0) msg += fmt::format(" ({} more like it suppressed)", suppressed);
    StoreLog().log(level, "store: {}", msg);
  }

  // ---- store_server.cc: the loop, accepting, connection I/O ----
  void Run();
  // Closes the oldest unauthenticated connection to make room; false if there is none.
  bool EvictOldestUnauthenticated(const char* why);
  void Accept();
  // The reserved-descriptor trick (libev, nginx): give the spare back, accept the pending
  // connection on it and close it, then take the spare again.
  void DropPendingWithSpare();
  void PauseAccepting();
  void ReadFrom(Conn& c);
  // Handles every complete frame buffered in c.in; false if the connection was dropped.
  bool Process(Conn& c);
  bool Drop(Conn& c, const Status& why);
  void Flush(Conn& c);
  // Handles frames left buffered behind requests that were parked, until nothing changes.
  void DrainBuffered();
  // Closes c's descriptor now; what it held as ephemeral keys becomes dead.
  void CloseConn(Conn& c, const std::string& why);
  void Reap();

  // ---- store_requests.cc: requests and replies ----
  // One request, its memory failure answered on its own: the server and every other connection
  // carry on.
  void HandleOne(Conn& c, Frame f);
  void Handle(Conn& c, Frame f);
  void Reply(Conn& c, StatusCode code, std::string arg);
  void Reply(Conn& c, StatusCode code, std::vector<std::string> args);
  void ReplyStatus(Conn& c, const Status& s, std::string ok_value);
  // Answers c's parked request if satisfied, expired, or naming a dead key; true if answered.
  bool TryComplete(Conn& c, bool expired);
  void WakeParked();
  // Delayed replies, hello deadlines and parked requests past their deadline.
  void Expire();

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

}  // namespace shardsync::store_server
