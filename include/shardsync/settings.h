// Every environment variable shardsync reads, in one registry (docs/environment.md lists them).
// Each knob has a type, a default, an allowed range or set and one line of meaning, and parses
// strictly: a malformed value is an InvalidArgument naming the knob and the value, never 0 or the
// default in disguise. Nothing in src/, tools/ or python/src calls getenv outside settings.cc
// (tests/common/settings_test.cc checks both rules against the source tree).
//
// Hand-written: Debian packages no library for typed environment registries (CLI11 parses
// flags, not the environment of a library that is linked into someone else's process), and the
// registry is a table plus four parsers. NCCL's `NCCL_PARAM` and NIXL's config are the same idea.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/status.h"

namespace shardsync {

enum class KnobType {
  kBool,    // 0 / 1 (also false / true, off / on, no / yes)
  kInt,     // a decimal integer in [min, max]
  kChoice,  // one of `choices`
  kText,    // any non-empty text (a path, a device list, an id); the reader checks the rest
};

// Who defines a variable: shardsync's own knobs, or another program's variable shardsync reads
// (a launcher's RANK, UCX's UCX_NET_DEVICES, POSIX TMPDIR). Third-party variables are parsed
// where they are read (a launch contract needs RANK; `shardsync plan` does not), so only
// shardsync's own knobs are checked up front by CheckKnobs.
enum class KnobOrigin { kShardsync, kThirdParty };

struct Knob {
  const char* name;
  KnobType type;
  // The value in effect when the variable is unset or empty, as text; "" when unset means "off"
  // or "not given" (the meaning says which).
  const char* default_value;
  int64_t min = 0, max = 0;  // kInt: the accepted range, inclusive
  const char* choices = "";  // kChoice: the accepted values, '|'-separated
  const char* reader = "";   // the component that reads it (docs/architecture.md's names)
  const char* meaning = "";  // one line
  KnobOrigin origin = KnobOrigin::kShardsync;
  bool secret = false;  // its value is never printed (config --dump shows "(set, N chars)")
};

// The environment as a function: tests and the CLI (flags overriding variables) pass their own.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
// This process's environment (getenv), the one place shardsync reads it.
const EnvLookup& ProcessEnvironment();

// Every registered knob, shardsync's first, each group sorted by name.
std::span<const Knob> Knobs();
// Null when `name` is not registered.
const Knob* FindKnob(std::string_view name);

// A knob's raw value after the strict parse: nullopt when unset or empty. InvalidArgument
// "NAME='value': <why>" when malformed; NotFound for an unregistered name (a programming
// error the tests catch).
Result<std::optional<std::string>> ReadKnob(std::string_view name,
                                            const EnvLookup& env = ProcessEnvironment());
// Typed reads; the Or-less forms return the registered default when unset.
Result<std::optional<int64_t>> ReadIntKnob(std::string_view name,
                                           const EnvLookup& env = ProcessEnvironment());
Result<int64_t> IntKnob(std::string_view name, const EnvLookup& env = ProcessEnvironment());
Result<bool> BoolKnob(std::string_view name, const EnvLookup& env = ProcessEnvironment());
// kChoice / kText: the value, or the registered default ("" when none).
Result<std::string> TextKnob(std::string_view name, const EnvLookup& env = ProcessEnvironment());

// Parses `value` as `knob` would (what ReadKnob does after the lookup).
Status CheckKnobValue(const Knob& knob, std::string_view value);

// Every shardsync knob set in `env` parses: the first malformed one's error otherwise. Sessions
// and the CLI call this before anything else, so a knob read where no error can be returned
// (once, deep in a GPU path) has been checked already.
Status CheckKnobs(const EnvLookup& env = ProcessEnvironment());

// For readers with no error path (a value cached in a static on a hot path): the knob's error on
// stderr, once per process and knob, and the registered default. CheckKnobs has refused such a
// value before any session started, so this is reached only by tools that skip it.
void ReportKnobError(const Status& status);

// One knob as `shardsync config --dump` shows it.
struct KnobSetting {
  const Knob* knob;
  std::string value;  // the effective value (the default when unset); secrets: "(set, N chars)"
  bool from_env;      // set (non-empty) in the environment
};
// Every knob's effective value; the first malformed one's error (any origin) otherwise.
Result<std::vector<KnobSetting>> EffectiveKnobs(const EnvLookup& env = ProcessEnvironment());

// "bool" / "int" / "choice" / "text".
std::string_view KnobTypeName(KnobType type);
// The accepted values in words: "0 or 1", "4..1048576", "put | tag | auto", "text".
std::string KnobRange(const Knob& knob);

}  // namespace shardsync
