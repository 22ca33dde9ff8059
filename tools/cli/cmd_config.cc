// `shardsync config --dump [--json]`: every environment knob's effective value, where it came
// from (default / environment) and its meaning (shardsync/settings.h, docs/environment.md). A
// malformed value exits 2 naming the knob and the value, as every other command would.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "command.h"
#include "shardsync/settings.h"

namespace shardsync::cli {
namespace {

std::string Origin(const Knob& k) {
  return k.origin == KnobOrigin::kShardsync ? "shardsync" : "third-party";
}

int Run(bool dump, bool json) {
  if (!dump) return ReportError(InvalidArgumentError("config: say --dump (the only action)"));
  auto all = EffectiveKnobs();
  if (!all.ok()) return ReportError(all.status());
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const KnobSetting& s : *all) {
      out.push_back({{"name", s.knob->name},
                     {"value", s.value},
                     {"source", s.from_env ? "environment" : "default"},
                     {"type", KnobTypeName(s.knob->type)},
                     {"range", KnobRange(*s.knob)},
                     {"default", s.knob->default_value},
                     {"origin", Origin(*s.knob)},
                     {"reader", s.knob->reader},
                     {"meaning", s.knob->meaning}});
    }
    std::printf("%s\n", out.dump(2).c_str());
    return kExitOk;
  }
  KnobOrigin group = KnobOrigin::kShardsync;
  std::printf("# shardsync knobs (docs/environment.md)\n");
  for (const KnobSetting& s : *all) {
    if (s.knob->origin != group) {
      group = s.knob->origin;
      std::printf("\n# other programs' variables shardsync reads\n");
    }
    const std::string value = s.value.empty() ? "(unset)" : s.value;
    std::printf("%-27s %-16s %-11s %s\n", s.knob->name, value.c_str(),
                s.from_env ? "environment" : "default", s.knob->meaning);
  }
  return kExitOk;
}

Registration reg({"config", [](CLI::App& app) {
                    auto* sub = app.add_subcommand(
                        "config",
                        "Print every environment knob: its effective value, source and meaning");
                    auto dump = std::make_shared<bool>(false);
                    auto json = std::make_shared<bool>(false);
                    sub->add_flag("--dump", *dump,
                                  "Print each knob's value, source (default / environment) and "
                                  "meaning; a malformed value exits 2 naming it");
                    sub->add_flag("--json", *json,
                                  "Print a JSON array of {name, value, source, type, range, "
                                  "default, origin, reader, meaning}");
                    return [dump, json] { return Run(*dump, *json); };
                  }});

}  // namespace
}  // namespace shardsync::cli
