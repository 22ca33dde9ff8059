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
#include <unordered_map>
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
// The host part alone ("127.0.0.1", "[::1]").
std::string SourceOf(const std::string& peer);

// An idle unauthenticated connection younger than this is not evicted for a newer one: a client
// connects and sends its hello at once, and needs the time for it to arrive.
inline constexpr auto kEvictMinAge = std::chrono::milliseconds(20);

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
  Clock::time_point opened;  // when it was accepted
  bool got_bytes = false;    // sent anything (an authentication in flight, if not authed)
  std::string source;        // SourceOf(peer)
  // Memory accounting (ServerImpl::Recount): bytes this connection holds for requests, as last
  // counted into ServerImpl::conn_bytes_; the size of the frame being received (reserved when its
  // header arrives); bytes of a refused frame still to be read and dropped.
  size_t counted = 0;
  size_t reserve = 0;
  size_t discard = 0;
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
             std::string token, store_limits::ConnLimits limits, size_t max_bytes);
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
  // Every byte held for requests: keys, values, dead keys' reasons (kv_) and what connections
  // hold (conn_bytes_); the quota bounds it (docs/security.md "What the store survives").
  size_t Held() const { return kv_.bytes() + conn_bytes_; }
  // Brings c's share of conn_bytes_ up to date: its input buffer (or the frame it reserved), its
  // unread replies and its parked request's keys.
  void Recount(Conn& c);
  // Not read now: c.Paused(), or the store is over its quota and c has replies to read first.
  bool Blocked(const Conn& c) const {
    return c.Paused() || (!c.out.empty() && Held() > max_bytes_);
  }
  // Closes an unauthenticated connection to make room (from `source` when not empty): the oldest
  // that failed its hello, else the oldest idle one (nothing received) open for at least
  // kEvictMinAge. Never one whose authentication is in flight. False if there is none.
  // `any_age`: idle ones however young (room for a connection whose hello is in flight).
  bool EvictUnauthenticated(const char* why, const std::string& source = "", bool any_age = false);
  // Takes a just-accepted connection: reads what it sent (a client's hello usually is there by
  // now, and authenticates it at once), then makes room under the caps or refuses it.
  void Admit(int fd, const sockaddr_storage& ss);
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
  size_t max_bytes_;
  size_t conn_bytes_ = 0;  // declared before kv_, which reads it
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  std::list<Conn> conns_;  // list: Conn addresses stay valid while iterating; accept order
  store_kv::Kv kv_;
  store_kv::OwnerId next_id_ = 1;
  size_t open_ = 0;             // connections with an open descriptor
  size_t unauthenticated_ = 0;  // of which not authenticated
  // Unauthenticated connections per source address (no port): one source may hold at most
  // limits_.per_source of them, so a flooding host cannot take every slot.
  std::unordered_map<std::string, size_t> unauth_by_source_;
  bool served_ = false;    // an authenticated request was handled this round
  bool released_ = false;  // a closed connection's ephemeral keys died
  Clock::time_point accept_paused_until_{};
  std::chrono::milliseconds accept_backoff_ = kAcceptBackoffMin;
  std::array<store_limits::LogLimiter, kLogN> logs_;
};

}  // namespace shardsync::store_server
