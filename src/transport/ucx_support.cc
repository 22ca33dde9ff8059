#include "transport/ucx_support.h"

#include <ifaddrs.h>
#include <net/if.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>

#include "shardsync/settings.h"

namespace shardsync::ucx_support {

bool HasRdmaDevice() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/sys/class/infiniband", ec);
  return !ec && it != std::filesystem::directory_iterator();
}

std::string HostName() { return HostIdentity(); }

std::string LoopbackInterface() {
  ifaddrs* all = nullptr;
  std::string name = "lo";
  if (getifaddrs(&all) != 0) return name;
  for (ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if (i->ifa_name != nullptr && (i->ifa_flags & IFF_LOOPBACK) && (i->ifa_flags & IFF_UP)) {
      name = i->ifa_name;
      break;
    }
  }
  freeifaddrs(all);
  return name;
}

Result<ResolvedUcxOptions> ResolveUcxOptions(const UcxOptions& options) {
  ResolvedUcxOptions r;
  UcxMode mode = options.mode;
  std::string devices = options.net_devices;
  if (options.mode_from_env) {
    SS_ASSIGN_OR_RETURN(const std::string v, TextKnob("SHARDSYNC_UCX_MODE"));  // checked
    if (v == "put") {
      mode = UcxMode::kPut;
    } else if (v == "tag") {
      mode = UcxMode::kTag;
    } else if (v == "auto") {
      mode = UcxMode::kAuto;
    }
  }
  if (options.net_devices_from_env) {
    SS_ASSIGN_OR_RETURN(const std::string d, TextKnob("SHARDSYNC_UCX_NET_DEVICES"));
    if (!d.empty()) devices = d;
  }
  // Nothing named (here, SHARDSYNC_UCX_NET_DEVICES or UCX's own UCX_NET_DEVICES): loopback only,
  // so no UCX listener opens on a routable address the store token does not cover. "all" is
  // UCX's own choice (every device), for jobs across hosts that name none.
  if (devices.empty()) {
    SS_ASSIGN_OR_RETURN(const std::string ucx, TextKnob("UCX_NET_DEVICES"));
    if (ucx.empty()) devices = "loopback";
  } else if (devices == "all") {
    devices.clear();
  }
  // UCX_NET_DEVICES syntax: comma-separated device names, "dev:port" for RDMA ports.
  for (char c : devices) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != ',' && c != ':' && c != '_' &&
        c != '-' && c != '.') {
      return InvalidArgumentError("SHARDSYNC_UCX_NET_DEVICES / net_devices '" + devices +
                                  "': want 'loopback', 'all' or device names like 'eth0,mlx5_0:1'");
    }
  }
  r.mode = mode == UcxMode::kAuto ? (HasRdmaDevice() ? UcxMode::kPut : UcxMode::kTag) : mode;
  r.net_devices = devices == "loopback" ? LoopbackInterface() : devices;
  return r;
}

}  // namespace shardsync::ucx_support
