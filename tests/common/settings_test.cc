// The knob registry (shardsync/settings.h): each type parses good values and refuses malformed
// ones naming the knob and the value; the table is well formed; and, against the source tree,
// every knob is documented, no getenv escapes the registry and no SHARDSYNC_* name is unregistered.
#include "shardsync/settings.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#ifndef SHARDSYNC_SOURCE_DIR
#error "SHARDSYNC_SOURCE_DIR: the source tree (tests/common/CMakeLists.txt)"
#endif

namespace shardsync {
namespace {

namespace fs = std::filesystem;

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// The error names the knob and the value as the user typed it.
void ExpectRefused(const Status& s, const std::string& name, const std::string& value) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(name + "='" + value + "'"), std::string::npos) << s.ToString();
}

TEST(Settings, IntParsesInRangeAndDefaults) {
  EXPECT_EQ(*IntKnob("SHARDSYNC_CHUNK_KIB", Env({{"SHARDSYNC_CHUNK_KIB", "128"}})), 128);
  EXPECT_EQ(*IntKnob("SHARDSYNC_CHUNK_KIB", Env({{"SHARDSYNC_CHUNK_KIB", "4"}})), 4);
  EXPECT_EQ(*IntKnob("SHARDSYNC_CHUNK_KIB", Env({{"SHARDSYNC_CHUNK_KIB", "1048576"}})), 1 << 20);
  EXPECT_EQ(*IntKnob("SHARDSYNC_CHUNK_KIB", Env({})), 256);  // the registered default
  EXPECT_EQ(*IntKnob("SHARDSYNC_FP8_STAGES", Env({{"SHARDSYNC_FP8_STAGES", ""}})), 2);  // empty
  EXPECT_FALSE(ReadIntKnob("SHARDSYNC_CHUNK_KIB", Env({}))->has_value());
  EXPECT_EQ(**ReadIntKnob("SHARDSYNC_FP8_STAGES", Env({{"SHARDSYNC_FP8_STAGES", "0"}})), 0);
}

TEST(Settings, IntRefusesMalformedNamingKnobAndValue) {
  for (const char* v : {"abc", "-5", "1e9", "3", "1048577", "99999999999999999999", " 64", "64 ",
                        "0x40", "+64", "64k"}) {
    SCOPED_TRACE(v);
    ExpectRefused(IntKnob("SHARDSYNC_CHUNK_KIB", Env({{"SHARDSYNC_CHUNK_KIB", v}})).status(),
                  "SHARDSYNC_CHUNK_KIB", v);
  }
  const Status range =
      IntKnob("SHARDSYNC_FP8_STAGES", Env({{"SHARDSYNC_FP8_STAGES", "9"}})).status();
  ExpectRefused(range, "SHARDSYNC_FP8_STAGES", "9");
  EXPECT_NE(range.message().find("0..4"), std::string::npos) << range.ToString();
}

TEST(Settings, BoolParsesBothWaysAndRefusesOthers) {
  for (const char* v : {"1", "true", "on", "yes"}) {
    EXPECT_TRUE(*BoolKnob("SHARDSYNC_FP8_OVERLAP", Env({{"SHARDSYNC_FP8_OVERLAP", v}}))) << v;
  }
  for (const char* v : {"0", "false", "off", "no"}) {
    EXPECT_FALSE(*BoolKnob("SHARDSYNC_FP8_OVERLAP", Env({{"SHARDSYNC_FP8_OVERLAP", v}}))) << v;
  }
  EXPECT_TRUE(*BoolKnob("SHARDSYNC_VERDICT_BOARD", Env({})));  // default 1
  for (const char* v : {"maybe", "2", "TRUE ", "-1"}) {
    SCOPED_TRACE(v);
    ExpectRefused(BoolKnob("SHARDSYNC_FP8_OVERLAP", Env({{"SHARDSYNC_FP8_OVERLAP", v}})).status(),
                  "SHARDSYNC_FP8_OVERLAP", v);
  }
}

TEST(Settings, ChoiceParsesListedValuesOnly) {
  EXPECT_EQ(*TextKnob("SHARDSYNC_TRACE", Env({{"SHARDSYNC_TRACE", "buffered"}})), "buffered");
  EXPECT_EQ(*TextKnob("SHARDSYNC_TRACE", Env({})), "0");
  EXPECT_EQ(*TextKnob("SHARDSYNC_UCX_MODE", Env({})), "");  // no default: the session's option
  EXPECT_EQ(*TextKnob("SHARDSYNC_GPU_SHARED_LAUNCH", Env({{"SHARDSYNC_GPU_SHARED_LAUNCH", "2"}})),
            "2");
  ExpectRefused(TextKnob("SHARDSYNC_TRACE", Env({{"SHARDSYNC_TRACE", "yes please"}})).status(),
                "SHARDSYNC_TRACE", "yes please");
  const Status s = TextKnob("SHARDSYNC_UCX_MODE", Env({{"SHARDSYNC_UCX_MODE", "bogus"}})).status();
  ExpectRefused(s, "SHARDSYNC_UCX_MODE", "bogus");
  EXPECT_NE(s.message().find("put | tag | auto"), std::string::npos) << s.ToString();
  // A prefix of a choice is not the choice.
  ExpectRefused(TextKnob("SHARDSYNC_UCX_MODE", Env({{"SHARDSYNC_UCX_MODE", "pu"}})).status(),
                "SHARDSYNC_UCX_MODE", "pu");
}

TEST(Settings, TextTakesAnyValueAndItsDefault) {
  EXPECT_EQ(*TextKnob("SHARDSYNC_NCCL_LIB", Env({})), "libnccl.so.2");
  EXPECT_EQ(*TextKnob("SHARDSYNC_NCCL_LIB", Env({{"SHARDSYNC_NCCL_LIB", "/opt/nccl.so"}})),
            "/opt/nccl.so");
  EXPECT_EQ(*TextKnob("TMPDIR", Env({})), "/tmp");
}

TEST(Settings, UnregisteredAndMistypedReadsAreErrors) {
  EXPECT_EQ(ReadKnob("SHARDSYNC_NO_SUCH_KNOB", Env({})).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(IntKnob("SHARDSYNC_TRACE", Env({})).status().code(), StatusCode::kInternal);
  EXPECT_EQ(BoolKnob("SHARDSYNC_CHUNK_KIB", Env({})).status().code(), StatusCode::kInternal);
  EXPECT_EQ(TextKnob("SHARDSYNC_FP8_OVERLAP", Env({})).status().code(), StatusCode::kInternal);
  // No default registered: the caller must say what unset means.
  EXPECT_EQ(IntKnob("SHARDSYNC_REPLICA", Env({})).status().code(), StatusCode::kInternal);
}

TEST(Settings, CheckKnobsCoversOwnKnobsOnly) {
  EXPECT_TRUE(CheckKnobs(Env({{"SHARDSYNC_TRACE", "1"}, {"SHARDSYNC_CHUNK_KIB", "64"}})).ok());
  ExpectRefused(CheckKnobs(Env({{"SHARDSYNC_TRACE", "1"}, {"SHARDSYNC_FP8_OVERLAP", "maybe"}})),
                "SHARDSYNC_FP8_OVERLAP", "maybe");
  // A launcher's variable is parsed where it is read (launch_env), not by every session.
  EXPECT_TRUE(CheckKnobs(Env({{"RANK", "abc"}})).ok());
  ExpectRefused(EffectiveKnobs(Env({{"RANK", "abc"}})).status(), "RANK", "abc");
}

TEST(Settings, EffectiveKnobsSaySourceAndHideSecrets) {
  auto all = EffectiveKnobs(Env(
      {{"SHARDSYNC_CHUNK_KIB", "64"}, {"SHARDSYNC_TOKEN", "abcdefghijklmnopqrstuvwxyz012345"}}));
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), Knobs().size());
  std::map<std::string, KnobSetting> by;
  for (const KnobSetting& s : *all) by.emplace(s.knob->name, s);
  EXPECT_EQ(by.at("SHARDSYNC_CHUNK_KIB").value, "64");
  EXPECT_TRUE(by.at("SHARDSYNC_CHUNK_KIB").from_env);
  EXPECT_EQ(by.at("SHARDSYNC_FP8_STAGES").value, "2");
  EXPECT_FALSE(by.at("SHARDSYNC_FP8_STAGES").from_env);
  EXPECT_EQ(by.at("SHARDSYNC_TOKEN").value, "(set, 32 chars)");
}

TEST(Settings, RegistryIsWellFormed) {
  std::set<std::string> names;
  std::string last;
  KnobOrigin origin = KnobOrigin::kShardsync;
  for (const Knob& k : Knobs()) {
    SCOPED_TRACE(k.name);
    EXPECT_TRUE(names.insert(k.name).second) << "registered twice";
    if (k.origin != origin) {
      EXPECT_EQ(origin, KnobOrigin::kShardsync) << "shardsync's knobs come first";
      origin = k.origin;
      last.clear();
    }
    EXPECT_LT(last, std::string(k.name)) << "sorted by name within its origin";
    last = k.name;
    EXPECT_EQ(std::string(k.name).rfind("SHARDSYNC_", 0) == 0, k.origin == KnobOrigin::kShardsync);
    EXPECT_STRNE(k.meaning, "");
    EXPECT_STRNE(k.reader, "");
    if (*k.default_value) {
      EXPECT_TRUE(CheckKnobValue(k, k.default_value).ok());
    }
    if (k.type == KnobType::kInt) {
      EXPECT_LE(k.min, k.max);
    }
    EXPECT_EQ(k.type == KnobType::kChoice, *k.choices != '\0');
    EXPECT_TRUE(!k.secret || k.type == KnobType::kText) << "a secret is never echoed in an error";
    EXPECT_EQ(FindKnob(k.name), &k);
  }
}

// --- against the source tree ---

std::string Slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<fs::path> SourceFiles(const std::vector<std::string>& dirs) {
  std::vector<fs::path> out;
  for (const std::string& d : dirs) {
    const fs::path root = fs::path(SHARDSYNC_SOURCE_DIR) / d;
    if (!fs::exists(root)) continue;
    for (const auto& e : fs::recursive_directory_iterator(root)) {
      const std::string ext = e.path().extension().string();
      if (e.is_regular_file() &&
          (ext == ".cc" || ext == ".h" || ext == ".cu" || ext == ".cuh" || ext == ".py")) {
        out.push_back(e.path());
      }
    }
  }
  return out;
}

TEST(SettingsSource, EveryKnobIsInDocsEnvironment) {
  const std::string doc = Slurp(fs::path(SHARDSYNC_SOURCE_DIR) / "docs/environment.md");
  ASSERT_FALSE(doc.empty());
  for (const Knob& k : Knobs()) {
    EXPECT_NE(doc.find("| `" + std::string(k.name) + "` |"), std::string::npos)
        << k.name << " has no row in docs/environment.md";
  }
}

TEST(SettingsSource, NoGetenvOutsideTheRegistry) {
  const std::regex raw(R"(\bgetenv\s*\(|secure_getenv|os\.getenv)");
  const auto files = SourceFiles({"src", "tools", "python/src"});
  ASSERT_GT(files.size(), 50u);
  for (const fs::path& p : files) {
    if (p.filename() == "settings.cc") continue;
    EXPECT_FALSE(std::regex_search(Slurp(p), raw))
        << p << " reads the environment itself: read a knob (shardsync/settings.h)";
  }
}

TEST(SettingsSource, EverySHARDSYNCNameIsRegistered) {
  // Compile-time macros, not environment variables.
  const std::set<std::string> macros = {"SHARDSYNC_HAVE_CUDA", "SHARDSYNC_HAVE_UCX", "SHARDSYNC_HD",
                                        "SHARDSYNC_VERSION"};
  const std::regex name(R"(\bSHARDSYNC_[A-Z0-9_]+)");
  for (const fs::path& p :
       SourceFiles({"src", "tools", "include", "python/src", "python/shardsync"})) {
    const std::string text = Slurp(p);
    for (std::sregex_iterator it(text.begin(), text.end(), name), end; it != end; ++it) {
      const std::string n = it->str();
      EXPECT_TRUE(macros.count(n) || FindKnob(n) != nullptr)
          << p << " names " << n << ", which is not in the settings registry";
    }
  }
}

}  // namespace
}  // namespace shardsync
