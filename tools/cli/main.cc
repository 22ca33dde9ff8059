// shardsync CLI: a thin main over the command registry; logic lives in the library.
#include <algorithm>
#include <cstdio>
#include <iostream>

#include "command.h"

namespace shardsync::cli {

std::vector<Command>& Registry() {
  static std::vector<Command> commands;
  return commands;
}

int ReportError(const Status& status) {
  std::fprintf(stderr, "shardsync: %s\n", status.ToString().c_str());
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kOutOfRange:
    case StatusCode::kPermissionDenied:
      return kExitUsage;
    default:
      return kExitFailure;
  }
}

int ReportInputError(Status status, std::string_view field) {
  status.Annotate(field);
  if (status.code() == StatusCode::kDataLoss) {
    return ReportError(InvalidArgumentError(status.message()));
  }
  return ReportError(status);
}

}  // namespace shardsync::cli

int main(int argc, char** argv) {
  using namespace shardsync::cli;
  CLI::App app{"shardsync: shard-aware weight sync from RL trainers into SGLang / vLLM engines"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("shardsync ") + SHARDSYNC_VERSION);
  auto& reg = Registry();
  std::sort(reg.begin(), reg.end(),
            [](const Command& a, const Command& b) { return a.name < b.name; });
  std::vector<std::pair<CLI::App*, std::function<int()>>> runs;
  for (auto& c : reg) {
    auto before = app.get_subcommands({}).size();
    auto run = c.setup(app);
    auto subs = app.get_subcommands({});
    if (subs.size() > before) runs.emplace_back(subs.back(), std::move(run));
  }
  // CLI11 reports an unknown command as "A subcommand is required"; name the word instead.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    if (std::none_of(reg.begin(), reg.end(), [&](const Command& c) { return c.name == word; })) {
      std::string names;
      for (const auto& c : reg) names += (names.empty() ? "" : ", ") + c.name;
      std::fprintf(stderr, "shardsync: unknown command '%s' (commands: %s)\n", word.c_str(),
                   names.c_str());
      return kExitUsage;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "shardsync: %s\n", e.what());
    return kExitUsage;
  }
  for (auto& [sub, run] : runs) {
    if (!sub->parsed()) continue;
    // A malformed knob stops every command before it starts (`config` reports its own).
    if (sub->get_name() != "config") {
      if (shardsync::Status s = shardsync::CheckKnobs(); !s.ok()) return ReportError(s);
    }
    return run();
  }
  return kExitUsage;
}
