// Issue 33 through the CLI: `--commit staged` on demo and bench (VERIFIED, tokens MATCH, the
// transfer / stall / staging figures per engine rank), the fault run (`bench --kill-rank R`) for a
// trainer and an engine rank: every surviving engine rank's live parameters hash as after its
// last commit and the re-connected job commits; and the commit flags' bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli_harness.h"

namespace shardsync::clitest {
namespace {

using nlohmann::json;

std::string Tiny() { return Fixtures::Get().Expand("{DIR}/tiny/config.json"); }

RunOptions WithTimeout(double seconds) {
  RunOptions o;
  o.timeout_s = seconds;
  return o;
}

json Parse(const CliResult& r) {
  json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << r.Describe();
  return j;
}

TEST(CliStaged, DemoCommitsEveryVersionVerifiedWithTheStallPerEngineRank) {
  const CliResult r = RunCli({"demo", "--model", Tiny(), "--trainer", "fsdp=2", "--rollout",
                              "dp=1,tp=2,pp=2", "--transport", "loopback", "--launch", "threads",
                              "--syncs", "3", "--commit", "staged", "--json"},
                             WithTimeout(60));
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  const json j = Parse(r);
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["generation_match"], true);  // the reference engine on the committed bytes
  EXPECT_EQ(j["element_mismatches"], 0);
  EXPECT_EQ(j["commit"], "staged");
  EXPECT_EQ(j["committed_version"], 3);
  EXPECT_EQ(j["keep_previous"], "area");
  ASSERT_EQ(j["stall_seconds"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_GT(j["transfer_seconds"][i].get<double>(), 0);
    EXPECT_GT(j["stall_seconds"][i].get<double>(), 0);
    EXPECT_GT(j["staging_bytes"][i].get<int64_t>(), 0);
  }
}

TEST(CliStaged, BenchReportsTheStallBesideTheCopyItCannotBeat) {
  const CliResult r = RunCli(
      {"bench", "--model", Tiny(), "--trainer", "fsdp=2", "--rollout", "dp=1,tp=2,pp=1",
       "--transport", "loopback", "--launch", "threads", "--reps", "2", "--warmup", "0",
       "--commit", "staged", "--json"},
      WithTimeout(60));
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  const json j = Parse(r);
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["commit"], "staged");
  EXPECT_GT(j["stall_seconds"].get<double>(), 0);
  EXPECT_GT(j["commit_raw_seconds"].get<double>(), 0);
  EXPECT_GT(j["transfer_seconds"].get<double>(), 0);
  ASSERT_EQ(j["engine_ranks"].size(), 2u);
  for (const auto& e : j["engine_ranks"]) EXPECT_GT(e["staging_bytes"].get<int64_t>(), 0);
}

// A trainer rank (1) and an engine rank (3) SIGKILLed while the job syncs and commits back to
// back: every survivor fails, the surviving engine ranks' live parameters hash as after their
// last commit, and the re-connected job's sync commits.
TEST(CliStaged, KilledRankLeavesEverySurvivorsLiveParametersAsCommitted) {
  for (const char* rank : {"1", "3"}) {
    SCOPED_TRACE(std::string("--kill-rank ") + rank);
    const CliResult r = RunCli({"bench", "--model", Tiny(), "--trainer", "fsdp=2", "--rollout",
                                "dp=1,tp=2,pp=1", "--commit", "staged", "--kill-rank", rank,
                                "--timeout-ms", "5000", "--json"},
                               WithTimeout(120));
    ASSERT_EQ(r.exit_code, 0) << r.Describe();
    const json j = Parse(r);
    EXPECT_EQ(j["ok"], true);
    EXPECT_EQ(j["every_survivor_failed"], true);
    EXPECT_EQ(j["live_intact"], true);
    EXPECT_EQ(j["reconnect_ok"], true) << j["reconnect_error"];
    int engines = 0;
    for (const auto& s : j["survivors"]) {
      if (!s.contains("live_intact")) continue;
      ++engines;
      EXPECT_EQ(s["live_hash_after"], s["live_hash_committed"]) << s.dump();
      EXPECT_GT(s["committed_version"].get<int64_t>(), 0) << s.dump();
    }
    EXPECT_EQ(engines, std::string(rank) == "3" ? 1 : 2);
  }
}

TEST(CliStaged, CommitFlagsBadInputExitsTwoNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--commit", "later"}, "--commit"},
      {{"--commit", "staged", "--staging", "device"}, "--staging device"},
      {{"--keep-previous", "swap"}, "--keep-previous: only with --commit staged"},
      {{"--commit", "staged", "--commit-scope", "node"}, "--commit-scope"},
  };
  for (const auto& [extra, mention] : bad) {
    std::vector<std::string> args = {"demo", "--model", Tiny(), "--trainer", "fsdp=2",
                                     "--rollout", "dp=1,tp=2,pp=1"};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliResult r = RunCli(args, WithTimeout(30));
    EXPECT_EQ(r.exit_code, 2) << r.Describe();
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_NE(r.err.find(mention), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace shardsync::clitest
