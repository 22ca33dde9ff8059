// Store server, the requests: authentication, the key-value operations, and parked requests
// (Get / Wait / GetMany) answered when their keys exist, one dies, or their deadline passes.
// Every reply is bounded before it is built, and a memory failure fails that one request.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <new>

#include "store/server.h"

namespace shardsync::store_server {
namespace {

// A wrong token is answered this late (sshd and etcd slow failed logins down the same way).
constexpr auto kFailedHelloDelay = std::chrono::milliseconds(500);

// Keepalive on authenticated connections: a rank whose host died (no FIN ever comes) loses its
// ephemeral keys within about 5 s instead of never.
void KeepAlive(int fd) {
  int one = 1, idle = 2, intvl = 1, cnt = 3;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}

}  // namespace

void ServerImpl::HandleOne(Conn& c, Frame f) {
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

void ServerImpl::Handle(Conn& c, Frame f) {
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
    if (auto it = unauth_by_source_.find(c.source);
        it != unauth_by_source_.end() && --it->second == 0) {
      unauth_by_source_.erase(it);
    }
    KeepAlive(c.fd);
    served_ = true;
    Reply(c, StatusCode::kOk, "");
    return;
  }
  served_ = true;
  // Keys are names, not payloads: a long one would be held (and echoed in errors) at its length.
  const size_t nkeys = f.op == Op::kWait || f.op == Op::kGetMany ? f.args.size()
                       : f.op == Op::kHello                      ? 0
                                                                 : 1;
  for (size_t i = 0; i < nkeys; ++i) {
    if (f.args[i].size() > store_limits::kMaxKeyBytes) {
      return Reply(c, StatusCode::kInvalidArgument,
                   "store: a key of " + std::to_string(f.args[i].size()) + " bytes (at most " +
                       std::to_string(store_limits::kMaxKeyBytes) + ")");
    }
  }
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
    case Op::kMarkDead: {
      Status s = kv_.MarkDead(f.args[0], f.args[1].empty() ? "marked dead by a client" : f.args[1]);
      ReplyStatus(c, s, "");
      if (s.ok()) WakeParked();
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
      size_t bytes = 0;
      for (const std::string& k : p.keys) bytes += k.capacity() + sizeof(std::string);
      if (Held() + bytes > max_bytes_) {
        return Reply(c, StatusCode::kOutOfRange,
                     "store: parking a request on " + std::to_string(p.keys.size()) +
                         " keys would take the store past its quota of " +
                         std::to_string(max_bytes_) + " bytes");
      }
      c.pending = std::move(p);
      Recount(c);
      TryComplete(c, /*expired=*/false);
      return;
    }
    case Op::kReply:
      Drop(c, InvalidArgumentError("client sent a reply frame"));
      return;
  }
}

void ServerImpl::Reply(Conn& c, StatusCode code, std::string arg) {
  std::vector<std::string> args;
  args.push_back(std::move(arg));
  Reply(c, code, std::move(args));
}

void ServerImpl::Reply(Conn& c, StatusCode code, std::vector<std::string> args) {
  // Unread replies count against the quota: a large one that does not fit becomes an error (a
  // short reply always goes; a connection with replies to read is not read while the store is
  // over its quota, so those stay one per connection).
  size_t bytes = store_wire::kHeaderBytes + 12;
  for (const std::string& a : args) bytes += 4 + a.size();
  if (bytes > 4096 && Held() + bytes > max_bytes_) {
    code = StatusCode::kOutOfRange;
    args.assign(1, "store: a reply of " + std::to_string(bytes) +
                       " bytes would take the store past its quota of " +
                       std::to_string(max_bytes_) +
                       " bytes (unread replies count: read them first)");
  }
  Frame r;
  r.op = Op::kReply;
  r.num = static_cast<int64_t>(code);
  r.args = std::move(args);
  c.out += store_wire::EncodeFrame(r);
  Flush(c);
}

void ServerImpl::ReplyStatus(Conn& c, const Status& s, std::string ok_value) {
  if (s.ok()) return Reply(c, StatusCode::kOk, std::move(ok_value));
  Reply(c, s.code(), s.message());
}

bool ServerImpl::TryComplete(Conn& c, bool expired) {
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
  if (p.op == Op::kWait) {
    c.pending.reset();
    Reply(c, StatusCode::kOk, "");
    return true;
  }
  // Unread replies count against the quota, and this one is built in place in the connection's
  // output (no copy of the values on the way): it needs its own size of room.
  const size_t frame = store_wire::kHeaderBytes + reply_bytes;
  if (Held() + frame > max_bytes_) {
    std::string msg = "store get: a reply of " + std::to_string(frame) +
                      " bytes would take the store past its quota of " +
                      std::to_string(max_bytes_) + " bytes (unread replies count: read them first)";
    c.pending.reset();
    Reply(c, StatusCode::kOutOfRange, std::move(msg));
    return true;
  }
  c.out.reserve(c.out.size() + frame);
  store_wire::AppendReplyHeader(c.out, StatusCode::kOk, p.keys.size(), reply_bytes);
  for (const std::string& k : p.keys) store_wire::AppendArg(c.out, *kv_.Find(k));
  c.pending.reset();
  Flush(c);
  return true;
}

void ServerImpl::WakeParked() {
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

void ServerImpl::Expire() {
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
      Log(kLogHello, spdlog::level::warn, "closing connection from {}: no hello within 2 s",
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

}  // namespace shardsync::store_server
