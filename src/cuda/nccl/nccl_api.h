// libnccl, loaded at run time: dlopen-ed (SHARDSYNC_NCCL_LIB, else libnccl.so.2) so one build
// runs with whatever NCCL the user's PyTorch ships and builds without NCCL; nccl.h supplies the
// types only.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "shardsync/status.h"

namespace shardsync::gpu::nccl {

struct NcclApi {
  void* lib = nullptr;
  std::string error;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;
};

// The loaded library (lib null, error set, when it cannot be loaded).
const NcclApi& Nccl();
Status LoadNccl();
// An NCCL result as a Status naming `what` (and the communicator's last error).
Status NcclStatus(ncclResult_t r, ncclComm_t comm, const std::string& what);

}  // namespace shardsync::gpu::nccl
