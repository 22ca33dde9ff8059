#include "cuda/nccl/nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <type_traits>

#include "shardsync/gpu.h"
#include "shardsync/settings.h"

namespace shardsync::gpu {
namespace nccl {

const NcclApi& Nccl() {
  static NcclApi api = [] {
    NcclApi a;
    auto lib = TextKnob("SHARDSYNC_NCCL_LIB");  // default libnccl.so.2 (settings.cc)
    if (!lib.ok()) {
      a.error = lib.status().message();
      return a;
    }
    const std::string path = *lib;
    a.lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!a.lib) {
      const char* e = dlerror();
      a.error = "cannot load NCCL '" + path + "' (set SHARDSYNC_NCCL_LIB): " + (e ? e : "?");
      return a;
    }
    bool ok = true;
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(a.lib, name));
      if (!fn) {
        ok = false;
        a.error += std::string(a.error.empty() ? "" : ", ") + "missing symbol " + name;
      }
    };
    load(a.GetVersion, "ncclGetVersion");
    load(a.GetUniqueId, "ncclGetUniqueId");
    load(a.CommInitRankConfig, "ncclCommInitRankConfig");
    load(a.CommGetAsyncError, "ncclCommGetAsyncError");
    load(a.CommAbort, "ncclCommAbort");
    load(a.Send, "ncclSend");
    load(a.Recv, "ncclRecv");
    load(a.GroupStart, "ncclGroupStart");
    load(a.GroupEnd, "ncclGroupEnd");
    load(a.GetErrorString, "ncclGetErrorString");
    load(a.GetLastError, "ncclGetLastError");
    if (!ok) {
      a.error = "NCCL '" + path + "': " + a.error;
      dlclose(a.lib);
      a.lib = nullptr;
    }
    return a;
  }();
  return api;
}

Status LoadNccl() {
  if (!Nccl().lib) return UnavailableError(Nccl().error);
  return OkStatus();
}

Status NcclStatus(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  if (r == ncclSuccess || r == ncclInProgress) return OkStatus();
  std::string msg = what + ": " + Nccl().GetErrorString(r);
  if (comm) {
    const char* last = Nccl().GetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  if (r == ncclRemoteError || r == ncclSystemError) return UnavailableError(msg);
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return InvalidArgumentError(msg);
  return InternalError(msg);
}

}  // namespace nccl

Result<int> NcclVersion() {
  SS_RETURN_IF_ERROR(nccl::LoadNccl());
  int v = 0;
  SS_RETURN_IF_ERROR(nccl::NcclStatus(nccl::Nccl().GetVersion(&v), nullptr, "ncclGetVersion"));
  return v;
}

}  // namespace shardsync::gpu
