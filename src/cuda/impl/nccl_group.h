// A communicator over a group of ranks on distinct GPUs, for collectives: the broadcast-all
// baseline of the GPU bench broadcasts full HF tensors from one engine rank to the others, as
// the engines' own distributed weight update does. Non-blocking like the nccl transport: every
// call polls the communicator with a deadline, and Abort (or the destructor) aborts it.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "shardsync/status.h"
#include "shardsync/store.h"

namespace shardsync::gpu {

class NcclGroup {
 public:
  // Index `index` of `size` ranks; index 0 publishes the unique id under `key`.
  static Result<std::unique_ptr<NcclGroup>> Create(StoreClient& store, const std::string& key,
                                                   int index, int size, int device, Millis timeout);
  virtual ~NcclGroup() = default;
  // Enqueues an in-place broadcast of `bytes` at `buf` from group index `root` on `stream`
  // (cudaStream_t) and waits (at most `timeout`) until NCCL accepted it.
  virtual Status Broadcast(void* buf, size_t bytes, int root, void* stream, Millis timeout) = 0;
  // The communicator's asynchronous error, if any (a dead peer).
  virtual Status Check() = 0;
  virtual void Abort() = 0;
};

}  // namespace shardsync::gpu
