// Wire format of the rendezvous store (hand-written: no Debian library offers a small
// authenticated key-value protocol; gRPC/etcd clients would be far heavier than this).
//
// Frame = 12-byte header + payload, little-endian:
//   u32 magic "SSST" | u16 version | u16 op | u32 payload_bytes
//   payload: i64 num | u32 nargs | nargs x (u32 len | len bytes)
// `num` is the op's integer (timeout ms, add delta, reply status code). Header-only and
// inline so the fuzzer compiles it with coverage instrumentation.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/status.h"

namespace shardsync::store_wire {

inline constexpr uint32_t kMagic = 0x54535353;  // bytes 'S' 'S' 'S' 'T'
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 12;
inline constexpr size_t kMaxPayloadBytes = size_t{64} << 20;
inline constexpr size_t kMaxHelloPayloadBytes = 4096;  // before authentication
inline constexpr uint32_t kMaxArgs = 65536;

enum class Op : uint16_t {
  kHello = 1,    // args: token
  kSet = 2,      // args: key, value
  kGet = 3,      // args: key; num: timeout ms
  kAdd = 4,      // args: key; num: delta
  kWait = 5,     // args: keys...; num: timeout ms
  kReply = 6,    // num: StatusCode; args: value(s) or error message
  kGetMany = 7,  // args: keys...; num: timeout ms; reply: one value per key, in order
  // Added in place (old servers close the connection on them; no old client sends them):
  kDeletePrefix = 8,  // args: prefix; reply: how many keys were deleted
  kSetEphemeral = 9,  // args: key, value; the key is bound to this connection
  kSetIfAbsent = 10,  // args: key, value; num: 1 = ephemeral; reply: the value the key holds
  kMarkDead = 11,     // args: key, reason; the key is removed and recorded as dead
};
inline constexpr Op kLastOp = Op::kMarkDead;

struct FrameHeader {
  Op op = Op::kReply;
  uint32_t payload_bytes = 0;
};

struct Frame {
  Op op = Op::kReply;
  int64_t num = 0;
  std::vector<std::string> args;
};

namespace detail {
inline uint64_t LoadLE(const char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
inline void StoreLE(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
}  // namespace detail

// Validates the fixed header; `max_payload` is the limit for this connection's state.
inline Result<FrameHeader> ParseFrameHeader(std::string_view bytes,
                                            size_t max_payload = kMaxPayloadBytes) {
  if (bytes.size() < kHeaderBytes) {
    return InvalidArgumentError("store frame: header truncated (" + std::to_string(bytes.size()) +
                                " of 12 bytes)");
  }
  const char* p = bytes.data();
  if (detail::LoadLE(p, 4) != kMagic) return InvalidArgumentError("store frame: bad magic");
  uint64_t version = detail::LoadLE(p + 4, 2);
  if (version != kVersion) {
    return InvalidArgumentError("store frame: version " + std::to_string(version) +
                                " unsupported (want " + std::to_string(kVersion) + ")");
  }
  uint64_t op = detail::LoadLE(p + 6, 2);
  if (op < static_cast<uint64_t>(Op::kHello) || op > static_cast<uint64_t>(kLastOp)) {
    return InvalidArgumentError("store frame: unknown op " + std::to_string(op));
  }
  uint64_t len = detail::LoadLE(p + 8, 4);
  if (len > max_payload) {
    return OutOfRangeError("store frame: payload of " + std::to_string(len) +
                           " bytes exceeds the limit of " + std::to_string(max_payload));
  }
  if (len < 12) return InvalidArgumentError("store frame: payload shorter than 12 bytes");
  return FrameHeader{static_cast<Op>(op), static_cast<uint32_t>(len)};
}

// Parses exactly one complete frame (header + payload, no trailing bytes). Pure function.
inline Result<Frame> ParseFrame(std::string_view bytes, size_t max_payload = kMaxPayloadBytes) {
  SS_ASSIGN_OR_RETURN(FrameHeader h, ParseFrameHeader(bytes, max_payload));
  if (bytes.size() != kHeaderBytes + h.payload_bytes) {
    return InvalidArgumentError("store frame: " + std::to_string(bytes.size()) +
                                " bytes but header announces " +
                                std::to_string(kHeaderBytes + h.payload_bytes));
  }
  std::string_view p = bytes.substr(kHeaderBytes);
  Frame f;
  f.op = h.op;
  f.num = static_cast<int64_t>(detail::LoadLE(p.data(), 8));
  uint64_t nargs = detail::LoadLE(p.data() + 8, 4);
  if (nargs > kMaxArgs) {
    return InvalidArgumentError("store frame: " + std::to_string(nargs) + " args (limit " +
                                std::to_string(kMaxArgs) + ")");
  }
  size_t pos = 12;
  for (uint64_t i = 0; i < nargs; ++i) {
    if (p.size() - pos < 4) return InvalidArgumentError("store frame: arg length truncated");
    uint64_t len = detail::LoadLE(p.data() + pos, 4);
    pos += 4;
    if (p.size() - pos < len) {
      return InvalidArgumentError("store frame: arg " + std::to_string(i) + " truncated");
    }
    f.args.emplace_back(p.substr(pos, len));
    pos += len;
  }
  if (pos != p.size()) return InvalidArgumentError("store frame: trailing bytes after args");

  auto want_args = [&](size_t n, const char* what) -> Status {
    if (f.args.size() != n) {
      return InvalidArgumentError(std::string("store frame: ") + what + " takes " +
                                  std::to_string(n) + " args, got " +
                                  std::to_string(f.args.size()));
    }
    return OkStatus();
  };
  switch (f.op) {
    case Op::kHello:
      SS_RETURN_IF_ERROR(want_args(1, "hello"));
      break;
    case Op::kSet:
    case Op::kSetEphemeral:
    case Op::kSetIfAbsent:
    case Op::kMarkDead:
      SS_RETURN_IF_ERROR(want_args(2, f.op == Op::kSet ? "set" : "ephemeral set or mark-dead"));
      break;
    case Op::kGet:
    case Op::kAdd:
    case Op::kDeletePrefix:
      SS_RETURN_IF_ERROR(want_args(1, f.op == Op::kGet ? "get" : "add or delete-prefix"));
      break;
    case Op::kWait:
    case Op::kGetMany:
      if (f.args.empty()) {
        return InvalidArgumentError(std::string("store frame: ") +
                                    (f.op == Op::kWait ? "wait" : "get-many") + " without keys");
      }
      break;
    case Op::kReply:
      if (f.args.empty()) return InvalidArgumentError("store frame: reply without args");
      if (f.num < 0 || f.num > static_cast<int64_t>(StatusCode::kOutOfRange)) {
        return InvalidArgumentError("store frame: reply status code " + std::to_string(f.num) +
                                    " unknown");
      }
      break;
  }
  const bool many = f.op == Op::kWait || f.op == Op::kGetMany;
  if ((f.op == Op::kGet || many) && f.num < 0) {
    return InvalidArgumentError("store frame: negative timeout " + std::to_string(f.num));
  }
  if (f.op != Op::kHello && f.op != Op::kReply) {
    size_t nkeys = many ? f.args.size() : 1;
    for (size_t i = 0; i < nkeys; ++i) {
      if (f.args[i].empty()) return InvalidArgumentError("store frame: empty key");
    }
  }
  return f;
}

// A reply frame written in place: its header for `nargs` args and `payload_bytes` of payload
// (12 + 4 + size per arg), then each arg with AppendArg. EncodeFrame's bytes, without building
// the args first (the store server's large replies).
inline void AppendReplyHeader(std::string& out, StatusCode code, size_t nargs,
                              size_t payload_bytes) {
  detail::StoreLE(out, kMagic, 4);
  detail::StoreLE(out, kVersion, 2);
  detail::StoreLE(out, static_cast<uint16_t>(Op::kReply), 2);
  detail::StoreLE(out, payload_bytes, 4);
  detail::StoreLE(out, static_cast<uint64_t>(static_cast<int64_t>(code)), 8);
  detail::StoreLE(out, nargs, 4);
}
inline void AppendArg(std::string& out, std::string_view a) {
  detail::StoreLE(out, a.size(), 4);
  out.append(a);
}

inline std::string EncodeFrame(const Frame& f) {
  std::string payload;
  detail::StoreLE(payload, static_cast<uint64_t>(f.num), 8);
  detail::StoreLE(payload, f.args.size(), 4);
  for (const std::string& a : f.args) {
    detail::StoreLE(payload, a.size(), 4);
    payload += a;
  }
  std::string out;
  out.reserve(kHeaderBytes + payload.size());
  detail::StoreLE(out, kMagic, 4);
  detail::StoreLE(out, kVersion, 2);
  detail::StoreLE(out, static_cast<uint16_t>(f.op), 2);
  detail::StoreLE(out, payload.size(), 4);
  out += payload;
  return out;
}

}  // namespace shardsync::store_wire
