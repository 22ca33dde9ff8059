// Pieces of the UCX transport that need no UCX headers: the published connection record's
// encoding, host facts, and the options resolved from UcxOptions and the environment.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "shardsync/transport.h"

namespace shardsync::ucx_support {

// Little-endian record writer / bounds-checked reader for the published connection record.
struct Writer {
  std::string out;
  void U32(uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
  void U64(uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
  void Bytes(const void* p, size_t n) {
    U32(static_cast<uint32_t>(n));
    out.append(static_cast<const char*>(p), n);
  }
};
struct Reader {
  std::string_view in;
  bool ok = true;
  template <typename T>
  T Num() {
    T v{};
    if (in.size() < sizeof(T)) {
      ok = false;
      return v;
    }
    std::memcpy(&v, in.data(), sizeof(T));
    in.remove_prefix(sizeof(T));
    return v;
  }
  std::string_view Bytes() {
    uint32_t n = Num<uint32_t>();
    if (!ok || in.size() < n) {
      ok = false;
      return {};
    }
    std::string_view v = in.substr(0, n);
    in.remove_prefix(n);
    return v;
  }
};

// True one-sided puts into user memory need RDMA (UCX 1.13 emulates them over shm and tcp).
bool HasRdmaDevice();
// The host identity (transport.h HostIdentity) peers compare for "same host": emulated nodes
// (SHARDSYNC_HOST_ID) get UCX's peer-failure mode, which keeps their traffic off shared memory
// (TCP, as across nodes), and no process watch.
std::string HostName();
// This host's loopback interface ("lo" on Linux), found by its IFF_LOOPBACK flag.
std::string LoopbackInterface();

// UcxOptions after the environment (SHARDSYNC_UCX_MODE, SHARDSYNC_UCX_NET_DEVICES) and `auto`
// are resolved.
struct ResolvedUcxOptions {
  UcxMode mode = UcxMode::kTag;  // kPut or kTag
  // Value for UCX's NET_DEVICES, "" to leave UCX's own (its default, or UCX_NET_DEVICES).
  std::string net_devices;
};
// InvalidArgument naming the variable when one is malformed.
Result<ResolvedUcxOptions> ResolveUcxOptions(const UcxOptions& options);

}  // namespace shardsync::ucx_support
