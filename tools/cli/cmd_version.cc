#include <cstdio>

#include "command.h"

namespace shardsync::cli {
namespace {
Registration reg({"version", [](CLI::App& app) {
                    app.add_subcommand("version", "Print the shardsync version");
                    return [] {
                      std::printf("shardsync %s\n", SHARDSYNC_VERSION);
                      return kExitOk;
                    };
                  }});
}  // namespace
}  // namespace shardsync::cli
