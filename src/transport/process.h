// Same-host peer liveness, shared by the transports that watch a peer's process (ucx on one host,
// shm): neither UCX 1.13's shared-memory transports nor a shared ring notice a peer's death.
#pragma once

#include <sys/types.h>

namespace shardsync::internal {

// False once `pid` has exited (or is a zombie awaiting its parent's wait).
bool ProcessAlive(pid_t pid);

}  // namespace shardsync::internal
