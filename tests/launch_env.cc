// Every test binary is one launch, as `shardsync run`, torchrun or srun would start its ranks:
// sessions created without job_id / job_secret take this launch's id and secret from the
// environment (store.h LaunchIdFromEnvironment), as a job of several ranks must have one
// (docs/security.md "Job identity"). Tests of launches and their refusals pass their own. Linked
// into every test binary (CMakeLists.txt shardsync_add_tests).
#include <sys/random.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

[[maybe_unused]] const bool kLaunchSet = [] {
  if (std::getenv("SHARDSYNC_JOB_ID") == nullptr) {
    setenv("SHARDSYNC_JOB_ID", ("test-" + std::to_string(getpid())).c_str(), 0);
  }
  if (std::getenv("SHARDSYNC_JOB_SECRET") == nullptr) {
    unsigned char b[16] = {};
    if (getrandom(b, sizeof(b), 0) != static_cast<ssize_t>(sizeof(b))) std::abort();
    char hex[33];
    for (int i = 0; i < 16; ++i) std::snprintf(hex + 2 * i, 3, "%02x", b[i]);
    setenv("SHARDSYNC_JOB_SECRET", hex, 0);
  }
  return true;
}();

}  // namespace
