// CLI command registry: each cmd_*.cc registers one subcommand with a static Registration.
// Convention: a command's run function returns the process exit code. Bad input: print the
// Status message to stderr, write nothing to stdout, return 2 (UsageError / ExitWithStatus).
#pragma once

#include <stdlib.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/settings.h"
#include "shardsync/status.h"

namespace shardsync::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the job ran and failed (sync error, mismatch)
inline constexpr int kExitUsage = 2;    // bad input: nothing was written

// `bench` / `demo --emulate-nodes` (LocalJobOptions::emulate_nodes).
inline constexpr const char* kEmulateNodesHelp =
    "Each rank process its own node (SHARDSYNC_HOST_ID and NCCL_HOSTID <host>/node<rank>), to test "
    "cross-node paths on one machine: --device cuda pairs take nccl over NCCL's socket transport "
    "(a slow link: about 2.8 GB/s on one H200 host), host memory needs --transport ucx (TCP)";

struct Command {
  std::string name;
  // Adds the subcommand to `app` and returns a function that runs it after parsing.
  std::function<std::function<int()>(CLI::App& app)> setup;
};

std::vector<Command>& Registry();

struct Registration {
  explicit Registration(Command c) { Registry().push_back(std::move(c)); }
};

// Prints "shardsync: <status message>" to stderr and returns the exit code for its code
// (InvalidArgument / NotFound / OutOfRange / PermissionDenied -> 2, otherwise 1).
int ReportError(const Status& status);
// For errors reading a user-given input file: names `field` (the flag or argument) and treats a
// malformed file (DataLoss from a parser) as bad input, exit 2 like any other.
int ReportInputError(Status status, std::string_view field);

// Paths removed if SIGINT or SIGTERM ends the command (signal_cleanup.cc): the first call
// installs the handlers; the process then still dies of the signal.
void RemoveOnSignal(const std::string& path);
void ForgetOnSignal(const std::string& path);

// A temporary directory (engine dumps, rank logs) removed however the command ends, SIGINT and
// SIGTERM included.
struct TempDir {
  std::string path;
  // Creates $TMPDIR/shardsync-<what>-XXXXXX (default /tmp; mode 0700); Unavailable when it
  // cannot.
  Status Create(const std::string& what) {
    SS_ASSIGN_OR_RETURN(const std::string base, TextKnob("TMPDIR"));  // default /tmp
    std::string tmpl = base + "/shardsync-" + what + "-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      return UnavailableError("cannot create a temporary directory for engine dumps");
    }
    path = tmpl;
    RemoveOnSignal(path);
    return OkStatus();
  }
  ~TempDir() {
    if (path.empty()) return;
    ForgetOnSignal(path);
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// For uint64 options (seeds): CLI11 would wrap "-1" around to 2^64-1; refuse a sign instead.
inline CLI::Validator NonNegativeInteger() {
  return CLI::Validator(
      [](std::string& v) {
        return !v.empty() && v[0] == '-' ? std::string("must be a non-negative integer, got ") + v
                                         : std::string();
      },
      "UINT64");
}

}  // namespace shardsync::cli
