// `shardsync version [--json]`: the version, and with --json what this build carries.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "command.h"
#include "shardsync/gpu.h"
#include "shardsync/transport.h"

namespace shardsync::cli {
namespace {

int Run(bool json) {
  if (!json) {
    std::printf("shardsync %s\n", SHARDSYNC_VERSION);
    return kExitOk;
  }
  // Registering the GPU transports makes no CUDA call; it fails only in a build without CUDA.
  const bool cuda = gpu::RegisterGpuTransports().ok();
  nlohmann::json j = {
      {"version", SHARDSYNC_VERSION}, {"cuda_build", cuda}, {"transports", RegisteredTransports()}};
  std::printf("%s\n", j.dump().c_str());
  return kExitOk;
}

Registration reg({"version", [](CLI::App& app) {
                    auto* sub = app.add_subcommand("version", "Print the shardsync version");
                    auto json = std::make_shared<bool>(false);
                    sub->add_flag("--json", *json,
                                  "Print {version, cuda_build, transports} as one JSON object");
                    return [json] { return Run(*json); };
                  }});

}  // namespace
}  // namespace shardsync::cli
