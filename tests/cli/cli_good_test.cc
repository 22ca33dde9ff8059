// Good invocations, every command: exit 0, well-formed output (JSON parses, has the keys
// docs/cli.md declares stable, and agrees with itself); plus end-to-end failure paths that need a
// live process (store, checkpoints). Tiny models only, so the whole suite stays fast.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/cli_harness.h"
#include "shardsync/settings.h"

namespace shardsync::clitest {
namespace {

using nlohmann::json;

std::string Tiny() { return Fixtures::Get().Expand("{DIR}/tiny/config.json"); }

// Runs a command expected to succeed; fails the test (with the output) otherwise.
CliResult Ok(const std::vector<std::string>& args, RunOptions opt = {}) {
  CliResult r = RunCli(args, opt);
  std::string cmdline = "shardsync";
  for (const auto& a : args) cmdline += " '" + a + "'";
  EXPECT_FALSE(r.timed_out) << cmdline << "\n" << r.Describe();
  EXPECT_EQ(r.exit_code, 0) << cmdline << "\n" << r.Describe();
  EXPECT_EQ(r.term_signal, 0) << cmdline << "\n" << r.Describe();
  return r;
}

RunOptions WithTimeout(double seconds) {
  RunOptions o;
  o.timeout_s = seconds;
  return o;
}

json ParseJson(const CliResult& r) {
  json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "stdout is not one JSON value:\n" << r.out.substr(0, 2000);
  return j;
}

// The build has no UCX transport (UCX is optional): the UCX cases cannot run.
bool NoUcx(const CliResult& r) {
  return r.err.find("not available in this build") != std::string::npos ||
         r.err.find("built without UCX") != std::string::npos;
}

// The keys docs/cli.md promises for a command's --json (other tools parse them).
void ExpectKeys(const json& j, std::initializer_list<const char*> keys, const std::string& what) {
  ASSERT_TRUE(j.is_object()) << what;
  for (const char* k : keys) EXPECT_TRUE(j.contains(k)) << what << " lacks '" << k << "'";
}

std::string ReadAll(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(CliGood, Version) {
  const std::regex want("shardsync [0-9]+\\.[0-9]+\\.[0-9]+\n");
  const CliResult a = Ok({"version"});
  EXPECT_TRUE(std::regex_match(a.out, want)) << a.out;
  EXPECT_EQ(a.err, "");
  const CliResult b = Ok({"--version"});
  EXPECT_TRUE(std::regex_match(b.out, want)) << b.out;
  EXPECT_EQ(a.out, b.out);
}

// Every command that prints a result takes --json.
TEST(CliGood, VersionGpuInfoStoreAndRunTakeJson) {
  const json v = ParseJson(Ok({"version", "--json"}));
  ExpectKeys(v, {"version", "cuda_build", "transports"}, "version");
  EXPECT_EQ(v["version"], SHARDSYNC_VERSION);
  EXPECT_FALSE(v["transports"].empty());
  const json g = ParseJson(Ok({"gpu-info", "--json"}));
  ExpectKeys(g, {"available", "reason", "devices", "nccl"}, "gpu-info");
  const CliResult text = Ok({"gpu-info"});
  EXPECT_EQ(text.out.rfind("CUDA: ", 0), 0u) << text.out;
  RunOptions opt;
  opt.env = {{"SHARDSYNC_TOKEN", "cli-test-token-0123456789"}};
  opt.sigterm_after_first_line = true;
  opt.timeout_s = 10;
  const json s = ParseJson(Ok({"store", "--bind", "127.0.0.1:0", "--json"}, opt));
  ExpectKeys(s, {"address", "port"}, "store");
  EXPECT_EQ(s["address"], "127.0.0.1:" + std::to_string(s["port"].get<int>()));
  const CliResult run = Ok({"run", "--help"});
  EXPECT_NE(run.out.find("--json"), std::string::npos);
}

// `config --dump`: every registered knob, its effective value and source; secrets never shown.
TEST(CliGood, ConfigDumpPrintsEveryKnob) {
  RunOptions opt;
  opt.env = {{"SHARDSYNC_CHUNK_KIB", "64"},
             {"SHARDSYNC_TOKEN", "cli-test-token-0123456789"},
             {"SHARDSYNC_FP8_STAGES", ""}};  // empty: unset
  const CliResult text = Ok({"config", "--dump"}, opt);
  for (const Knob& k : Knobs()) {
    EXPECT_NE(text.out.find(std::string(k.name) + " "), std::string::npos) << k.name;
  }
  EXPECT_TRUE(std::regex_search(text.out, std::regex("\\nSHARDSYNC_CHUNK_KIB +64 +environment ")))
      << text.out;
  EXPECT_TRUE(std::regex_search(text.out, std::regex("\\nSHARDSYNC_FP8_STAGES +2 +default ")))
      << text.out;
  EXPECT_EQ(text.out.find("cli-test-token-0123456789"), std::string::npos) << "secret printed";
  EXPECT_EQ(text.err, "");
  const json j = ParseJson(Ok({"config", "--dump", "--json"}, opt));
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), Knobs().size());
  std::map<std::string, json> by;
  for (const json& e : j) {
    ExpectKeys(
        e, {"name", "value", "source", "type", "range", "default", "origin", "reader", "meaning"},
        "config");
    by[e["name"].get<std::string>()] = e;
  }
  EXPECT_EQ(by["SHARDSYNC_CHUNK_KIB"]["value"], "64");
  EXPECT_EQ(by["SHARDSYNC_CHUNK_KIB"]["source"], "environment");
  EXPECT_EQ(by["SHARDSYNC_CHUNK_KIB"]["range"], "4..1048576");
  EXPECT_EQ(by["SHARDSYNC_TOKEN"]["value"], "(set, 25 chars)");
  EXPECT_EQ(by["SHARDSYNC_TRACE"]["source"], "default");
  EXPECT_EQ(by["RANK"]["origin"], "third-party");
}

TEST(CliGood, HelpListsEveryCommand) {
  const CliResult r = Ok({"--help"});
  for (const char* cmd : {"layout", "shards", "plan", "store", "run", "demo", "bench", "generate",
                          "inspect", "version", "config"}) {
    EXPECT_NE(r.out.find(cmd), std::string::npos) << cmd << " missing from --help";
  }
}

TEST(CliGood, EveryCommandHasHelp) {
  for (const char* cmd : {"layout", "shards", "plan", "store", "run", "demo", "bench", "generate",
                          "inspect", "version", "config"}) {
    const CliResult r = Ok({cmd, "--help"});
    EXPECT_NE(r.out.find(cmd), std::string::npos) << cmd << ":\n" << r.out;
    EXPECT_EQ(r.err, "") << cmd;
  }
}

TEST(CliGood, LayoutTableJsonAndLaunchLines) {
  const std::vector<std::string> base = {
      "layout", "--nodes", "2", "--gpus-per-node", "4",     "--dp", "2", "--tp",
      "2",      "--pp",    "2", "--engine",        "sglang"};
  const CliResult table = Ok(base);
  EXPECT_NE(table.out.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << table.out;
  EXPECT_EQ(table.err, "");

  auto args = base;
  args.push_back("--json");
  const CliResult r = Ok(args);
  const json j = ParseJson(r);
  ExpectKeys(j,
             {"engine", "dp", "tp", "pp", "base_gpu_id", "gpu_id_step", "allow_multinode",
              "node_gpus", "num_gpus", "collecting_rank", "workers", "replicas",
              "broadcast_world_size", "broadcast_rank_formula", "broadcast_rank_collision", "sync"},
             "layout");
  ExpectKeys(j["workers"][0], {"rank", "node", "gpu", "dp", "pp", "tp", "role", "head"},
             "layout worker");
  ExpectKeys(j["replicas"][0],
             {"dp", "head", "node", "cuda_visible_devices", "nodes", "rank_offset", "engine_ranks"},
             "layout replica");
  ExpectKeys(j["replicas"][0]["engine_ranks"][0],
             {"tp", "pp", "gpu", "worker", "global_rank", "node", "node_rank", "gpu_index",
              "broadcast_rank", "sync_rank"},
             "layout engine rank");
  ExpectKeys(j["sync"], {"trainer_world", "world_size", "engine_rank_formula"}, "layout sync");
  EXPECT_EQ(j["engine"], "sglang");
  EXPECT_EQ(j["num_gpus"], 8);
  EXPECT_EQ(j["node_gpus"], json::array({4, 4}));
  ASSERT_EQ(j["workers"].size(), 8u);
  ASSERT_EQ(j["replicas"].size(), 2u);
  // Every engine rank of every replica lands on a distinct (node, gpu).
  std::set<std::pair<int, int>> used;
  for (const auto& rep : j["replicas"]) {
    ASSERT_EQ(rep["engine_ranks"].size(), 4u);
    for (const auto& e : rep["engine_ranks"]) {
      EXPECT_TRUE(used.insert({e["node"].get<int>(), e["gpu"].get<int>()}).second) << e.dump();
    }
  }
  EXPECT_EQ(j["broadcast_world_size"], 2 * 2 * 2 + 1);

  args = base;
  args.insert(args.end(), {"--format", "sglang-launch"});
  const CliResult launch = Ok(args);
  EXPECT_NE(launch.out.find("sglang.launch_server"), std::string::npos) << launch.out;
  EXPECT_NE(launch.out.find("--tp-size 2"), std::string::npos) << launch.out;

  const CliResult vllm = Ok({"layout", "--gpus-per-node", "8", "--dp", "2", "--tp", "4", "--engine",
                             "vllm", "--format", "vllm-launch"});
  EXPECT_NE(vllm.out.find("vllm serve"), std::string::npos) << vllm.out;
}

// Element count of a box.
int64_t Numel(const json& extent) {
  int64_t n = 1;
  for (const auto& e : extent) n *= e.get<int64_t>();
  return n;
}

TEST(CliGood, ShardsJsonCoversEveryParamExactlyOnce) {
  for (const char* engine : {"sglang", "vllm"}) {
    const CliResult r =
        Ok({"shards", "--model", Tiny(), "--engine", engine, "--tp", "2", "--pp", "2", "--json"});
    const json j = ParseJson(r);
    ASSERT_TRUE(j.is_object());
    EXPECT_EQ(j["tp"], 2);
    EXPECT_EQ(j["pp"], 2);
    ASSERT_EQ(j["ranks"].size(), 4u);
    for (const auto& rank : j["ranks"]) {
      ASSERT_FALSE(rank["params"].empty());
      for (const auto& p : rank["params"]) {
        // Pieces and zero-fills tile the local parameter: their element counts add up to it.
        int64_t covered = 0;
        for (const auto& piece : p["pieces"]) covered += Numel(piece["extent"]);
        for (const auto& z : p["zero_fill"]) covered += Numel(z["extent"]);
        EXPECT_EQ(covered, Numel(p["shape"])) << engine << " " << p["name"];
      }
    }
  }
  const CliResult table = Ok({"shards", "--model", Tiny(), "--engine", "sglang", "--tp", "2"});
  EXPECT_NE(table.out.find("2 ranks"), std::string::npos) << table.out;
  const CliResult explain =
      Ok({"shards", "--model", Tiny(), "--engine", "vllm", "--tp", "2", "--rank", "1,0",
          "--explain", "model.layers.1.self_attn.qkv_proj.weight"});
  EXPECT_NE(explain.out.find("model.layers.1.self_attn.k_proj.weight"), std::string::npos)
      << explain.out;
  // An embedded model by name works too.
  const CliResult named =
      Ok({"shards", "--model", "qwen2.5-0.5b", "--engine", "sglang", "--tp", "2", "--json"});
  EXPECT_EQ(ParseJson(named)["ranks"].size(), 2u);
}

// `shards --trainer megatron=...`: every trainer rank's local parameters and the HF regions they
// hold; split tensors are held once over the tp x pp ranks, tp-replicated norms once per tp rank.
TEST(CliGood, ShardsTrainerMegatronJson) {
  const CliResult r =
      Ok({"shards", "--model", Tiny(), "--trainer", "megatron=tp=2,pp=2", "--json"});
  const json j = ParseJson(r);
  ExpectKeys(j, {"model", "trainer", "world", "padded_vocab", "ranks"}, "trainer shards");
  EXPECT_EQ(j["trainer"], "megatron=tp=2,pp=2");
  EXPECT_EQ(j["padded_vocab"], 256);  // 200 padded to a multiple of 128 * tp
  ASSERT_EQ(j["ranks"].size(), 4u);
  std::map<std::string, int64_t> held;
  for (const auto& rank : j["ranks"]) {
    ExpectKeys(rank, {"rank", "coords", "params"}, "trainer rank");
    ExpectKeys(rank["coords"], {"tp", "cp", "dp", "pp", "etp", "ep", "edp"}, "coords");
    for (const auto& p : rank["params"]) {
      ExpectKeys(p, {"name", "chunk", "shape", "dtype", "pieces"}, "trainer param");
      int64_t covered = 0;
      for (const auto& piece : p["pieces"]) {
        ExpectKeys(piece, {"source", "src_offset", "local_offset", "extent"}, "trainer piece");
        covered += Numel(piece["extent"]);
        held[piece["source"].get<std::string>()] += Numel(piece["extent"]);
      }
      EXPECT_LE(covered, Numel(p["shape"])) << p["name"];
    }
  }
  const json map = ParseJson(Ok({"shards", "--model", Tiny(), "--engine", "vllm", "--json"}));
  for (const auto& p : map["ranks"][0]["params"]) {
    for (const auto& piece : p["pieces"]) {
      const std::string src = piece["source"];
      const int64_t n = Numel(piece["extent"]);
      const bool norm = src.find("layernorm") != std::string::npos || src == "model.norm.weight";
      EXPECT_EQ(held[src], norm ? 2 * n : n) << src;
    }
  }
  const CliResult table = Ok({"shards", "--model", Tiny(), "--trainer", "megatron=tp=2,pp=2"});
  EXPECT_NE(table.out.find("megatron coordinates"), std::string::npos) << table.out;
  const CliResult explain =
      Ok({"shards", "--model", Tiny(), "--trainer", "megatron=tp=2", "--rank", "1", "--explain",
          "decoder.layers.0.self_attention.linear_qkv.weight"});
  EXPECT_NE(explain.out.find("model.layers.0.self_attn.v_proj.weight"), std::string::npos)
      << explain.out;
}

// The local spec builds SequentialMLP experts (models/backends.py LocalSpecProvider):
// norms=local on a MoE model lists local_experts names and no TEGroupedMLP weight{i}.
TEST(CliGood, ShardsTrainerMegatronLocalSpecListsSequentialMlp) {
  const json j =
      ParseJson(Ok({"shards", "--model", "qwen3-30b-a3b", "--trainer",
                    "megatron=tp=2,pp=2,ep=2,etp=1,norms=local", "--rank", "1", "--json"}));
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["trainer"], "megatron=tp=2,pp=2,ep=2,etp=1,norms=local");
  int sequential = 0, grouped = 0, input_norms = 0;
  const std::regex te_grouped(R"(mlp\.experts\.linear_fc[12]\.weight\d+$)");
  for (const auto& rank : j["ranks"]) {
    for (const auto& p : rank["params"]) {
      const std::string n = p["name"];
      sequential += n.find("mlp.experts.local_experts.") != std::string::npos;
      grouped += std::regex_search(n, te_grouped);
      input_norms += n.find(".input_layernorm.weight") != std::string::npos;
    }
  }
  EXPECT_EQ(sequential, 24 * 64 * 2);  // 24 layers per stage x 64 local experts x fc1 / fc2
  EXPECT_EQ(grouped, 0);
  EXPECT_EQ(input_norms, 24);
}

// `plan --trainer megatron=...`: receivers get their owned bytes; every op names the sender's
// local parameter and region.
TEST(CliGood, PlanMegatronDumpOps) {
  const fs::path ops = Fixtures::Get().dir / "out/megatron.ops.jsonl";
  fs::remove(ops);
  const json j =
      ParseJson(Ok({"plan", "--model", Tiny(), "--trainer", "megatron=tp=2,pp=2,dp=2", "--rollout",
                    "dp=1,tp=2,pp=2", "--json", "--dump-ops", ops.string()}));
  EXPECT_EQ(j["trainer"], "megatron=tp=2,pp=2,dp=2");
  ASSERT_EQ(j["trainer_ranks"].size(), 8u);
  for (const auto& e : j["engine_ranks"]) EXPECT_EQ(e["recv_bytes"], e["owned_bytes"]) << e.dump();
  std::istringstream lines(ReadAll(ops));
  int64_t n = 0, bytes = 0;
  for (std::string line; std::getline(lines, line); ++n) {
    const json op = json::parse(line, nullptr, false);
    ASSERT_FALSE(op.is_discarded()) << line;
    ExpectKeys(op, {"src_param", "src_chunk", "src_local"}, "megatron op");
    EXPECT_EQ(op["src_local"]["extent"], op["src_region"]["extent"]) << line;
    bytes += op["bytes"].get<int64_t>();
  }
  EXPECT_EQ(n, j["ops"].get<int64_t>());
  EXPECT_EQ(bytes, j["total_bytes"].get<int64_t>());
}

// A config path that is not UTF-8 (the model's name is its path): JSON output must still be
// produced and parse, not abort in the JSON library.
TEST(CliGood, ShardsJsonWithNonUtf8ModelPath) {
  const fs::path dir = Fixtures::Get().dir /
                       "bad\xff"
                       "dir";
  WriteFile(dir / "config.json", TinyConfig());
  const CliResult r =
      Ok({"shards", "--model", (dir / "config.json").string(), "--engine", "sglang", "--json"});
  const json j = ParseJson(r);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["ranks"].size(), 1u);
}

TEST(CliGood, PlanJsonDumpOpsAndSvgAgree) {
  const Fixtures& fx = Fixtures::Get();
  const fs::path ops = fx.dir / "out/good.ops.jsonl", all = fx.dir / "out/good.all.jsonl",
                 svg = fx.dir / "out/good.svg";
  fs::remove(ops);
  fs::remove(all);
  fs::remove(svg);
  const std::vector<std::string> base = {"plan",           "--model",  Tiny(),
                                         "--trainer",      "fsdp=2",   "--rollout",
                                         "dp=2,tp=2,pp=1", "--engine", "vllm"};
  auto args = base;
  args.insert(args.end(),
              {"--json", "--dump-ops", ops.string(), "--rank", "0", "--svg", svg.string()});
  const CliResult r = Ok(args);
  const json j = ParseJson(r);
  ExpectKeys(
      j,
      {"plan_hash", "plan_seconds", "ops", "messages", "total_bytes",
       "broadcast_recv_bytes_per_rank", "model_bytes", "trainer_ranks", "engine_ranks", "placement",
       "estimates", "model", "trainer", "rollout", "wire_dtype", "trainer_dtype", "bucket_bytes"},
      "plan");
  ExpectKeys(j["trainer_ranks"][0],
             {"rank", "send_bytes", "ops", "messages", "intra_node_bytes", "node"},
             "plan trainer rank");
  ExpectKeys(j["engine_ranks"][0],
             {"sync_rank", "replica", "tp_rank", "pp_rank", "recv_bytes", "owned_bytes", "ops",
              "messages", "intra_node_bytes", "node"},
             "plan engine rank");
  ExpectKeys(j["placement"], {"nodes", "gpus_per_node", "colocated"}, "plan placement");
  ExpectKeys(j["estimates"],
             {"intra_node_gbps", "inter_node_gbps", "plan_seconds", "broadcast_seconds",
              "lower_bound_seconds"},
             "plan estimates");
  EXPECT_TRUE(std::regex_match(j["plan_hash"].get<std::string>(), std::regex("[0-9a-f]{32}")))
      << j["plan_hash"];
  ASSERT_EQ(j["trainer_ranks"].size(), 2u);
  ASSERT_EQ(j["engine_ranks"].size(), 4u);
  int64_t sent = 0, recv = 0;
  for (const auto& t : j["trainer_ranks"]) sent += t["send_bytes"].get<int64_t>();
  for (const auto& e : j["engine_ranks"]) {
    recv += e["recv_bytes"].get<int64_t>();
    EXPECT_EQ(e["recv_bytes"], e["owned_bytes"]) << e.dump();
  }
  EXPECT_EQ(sent, j["total_bytes"].get<int64_t>());
  EXPECT_EQ(recv, j["total_bytes"].get<int64_t>());

  // Rank 0's ops: every line one JSON object; its send bytes add up to the summary's.
  ASSERT_TRUE(fs::exists(ops));
  std::istringstream lines(ReadAll(ops));
  int64_t rank0_send = 0, n = 0;
  for (std::string line; std::getline(lines, line);) {
    const json op = json::parse(line, nullptr, false);
    ASSERT_FALSE(op.is_discarded()) << line;
    if (op["src"] == 0) rank0_send += op["bytes"].get<int64_t>();
    ++n;
  }
  EXPECT_GT(n, 0);
  EXPECT_EQ(rank0_send, j["trainer_ranks"][0]["send_bytes"].get<int64_t>());

  ASSERT_TRUE(fs::exists(svg));
  const std::string s = ReadAll(svg);
  EXPECT_NE(s.find("<svg"), std::string::npos);
  EXPECT_NE(s.find("</svg>"), std::string::npos);

  // An engine rank's dump: what it receives adds up to its recv_bytes.
  const fs::path eng = fx.dir / "out/good.engine.jsonl";
  Ok({"plan", "--model", Tiny(), "--trainer", "fsdp=2", "--rollout", "dp=2,tp=2,pp=1", "--engine",
      "vllm", "--dump-ops", eng.string(), "--rank", "3"});
  std::istringstream eng_lines(ReadAll(eng));
  int64_t rank3_recv = 0;
  for (std::string line; std::getline(eng_lines, line);) {
    const json op = json::parse(line, nullptr, false);
    ASSERT_FALSE(op.is_discarded()) << line;
    EXPECT_EQ(op["dst"], 3) << line;
    rank3_recv += op["bytes"].get<int64_t>();
  }
  EXPECT_EQ(rank3_recv, j["engine_ranks"][1]["recv_bytes"].get<int64_t>());

  // Every op of the job once: the bytes add up to the job total.
  args = base;
  args.insert(args.end(), {"--dump-ops", all.string()});
  const CliResult text = Ok(args);
  EXPECT_NE(text.out.find("plan hash"), std::string::npos) << text.out;
  std::istringstream all_lines(ReadAll(all));
  int64_t all_bytes = 0;
  for (std::string line; std::getline(all_lines, line);) {
    const json op = json::parse(line, nullptr, false);
    ASSERT_FALSE(op.is_discarded()) << line;
    all_bytes += op["bytes"].get<int64_t>();
  }
  EXPECT_EQ(all_bytes, j["total_bytes"].get<int64_t>());
}

TEST(CliGood, StorePrintsAddressAndStopsOnSigterm) {
  RunOptions opt;
  opt.env = {{"SHARDSYNC_TOKEN", "cli-test-token-0123456789"}};
  opt.sigterm_after_first_line = true;
  opt.timeout_s = 10;
  const CliResult r = Ok({"store", "--bind", "127.0.0.1:0"}, opt);
  EXPECT_TRUE(std::regex_match(r.out, std::regex("127\\.0\\.0\\.1:[1-9][0-9]*\n"))) << r.out;
}

// Issue 26: without a token the store generates one and prints it as a second stdout line, or
// writes it to a new 0600 --token-file.
TEST(CliGood, StoreGeneratesATokenWhenNoneIsGiven) {
  RunOptions opt;
  opt.sigterm_after_first_line = true;
  opt.timeout_s = 10;
  const CliResult r = Ok({"store", "--bind", "127.0.0.1:0"}, opt);
  EXPECT_TRUE(std::regex_match(
      r.out, std::regex("127\\.0\\.0\\.1:[1-9][0-9]*\nSHARDSYNC_TOKEN=[0-9a-f]{32}\n")))
      << r.out;

  const std::string file = Fixtures::Get().Expand("{DIR}/out/store.token");
  const CliResult f = Ok({"store", "--bind", "127.0.0.1:0", "--token-file", file}, opt);
  EXPECT_TRUE(std::regex_match(f.out, std::regex("127\\.0\\.0\\.1:[1-9][0-9]*\n"))) << f.out;
  EXPECT_TRUE(std::regex_match(ReadAll(file), std::regex("[0-9a-f]{32}\n")));
  struct stat st {};
  ASSERT_EQ(stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::remove(file.c_str());
}

// Issue 26: a `demo` killed with SIGINT / SIGTERM left its temporary directory (engine dumps)
// and its ranks' logs behind. Now both live in one directory that the signal removes; the demo
// still dies of the signal.
TEST(CliGood, DemoRemovesItsTempDirAndLogsOnSigterm) {
  for (int sig : {SIGTERM, SIGINT}) {
    const fs::path tmp = Fixtures::Get().dir / ("demo-tmp-" + std::to_string(sig));
    fs::create_directories(tmp);
    std::vector<std::string> args = {SHARDSYNC_CLI_PATH, "demo",   "--model",   Tiny(),
                                     "--trainer",        "fsdp=2", "--rollout", "dp=1,tp=2,pp=1",
                                     "--transport",      "shm",    "--syncs",   "1000000"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env = {"TMPDIR=" + tmp.string(), "PATH=/usr/bin:/bin"};
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    pid_t pid = -1;
    ASSERT_EQ(posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
    // Wait until the ranks run: their logs sit in the demo's directory.
    bool running = false;
    for (int i = 0; i < 1000 && !running; ++i) {
      std::error_code ec;
      for (const auto& d : fs::recursive_directory_iterator(tmp, ec)) {
        running = running || d.path().filename().string().rfind("shardsync-rank-", 0) == 0;
      }
      if (!running) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(running) << "the demo's ranks never started";
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    kill(pid, sig);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    EXPECT_TRUE(fs::is_empty(tmp)) << "left behind in " << tmp;
    fs::remove_all(tmp);
  }
}

// `run` against a live standalone store: a wrong token is refused (exit 2, the variable named),
// a job whose peers never join ends at --timeout-ms (exit 1, the missing rank named), and a
// store nobody serves fails at the connect timeout. None of them hangs.
TEST(CliGood, RunAgainstStoreFailsBoundedAndNamed) {
  std::promise<std::pair<pid_t, std::string>> started;
  auto address = started.get_future();
  // Stops the store and joins its thread on every way out of the test, early ASSERTs included
  // (the store also ends by itself: RunCli kills it after 30 s).
  struct Server {
    std::thread thread;
    pid_t pid = -1;
    ~Server() {
      if (pid > 0) kill(pid, SIGTERM);
      if (thread.joinable()) thread.join();
    }
  } server;
  server.thread = std::thread([&] {
    RunOptions opt;
    opt.env = {{"SHARDSYNC_TOKEN", "right-token-0123456789"}};
    opt.timeout_s = 30;
    bool told = false;
    opt.on_stdout = [&](pid_t pid, const std::string& out) {
      const size_t nl = out.find('\n');
      if (!told && nl != std::string::npos) {
        started.set_value({pid, out.substr(0, nl)});
        told = true;
      }
    };
    const CliResult r = RunCli({"store", "--bind", "127.0.0.1:0"}, opt);
    if (!told) started.set_value({-1, ""});
    EXPECT_EQ(r.exit_code, 0) << r.Describe();
  });
  // The thread sets the promise either way: on the address line or when the store exits.
  const auto [store_pid, store] = address.get();
  ASSERT_GT(store_pid, 0) << "store did not start";
  server.pid = store_pid;
  const std::vector<std::string> job = {"run",    "--role",       "trainer",        "--rank",
                                        "0",      "--model",      Tiny(),           "--trainer",
                                        "fsdp=2", "--rollout",    "dp=1,tp=2,pp=1", "--transport",
                                        "ucx",    "--timeout-ms", "1000",           "--store",
                                        store};
  auto with = [&](std::vector<std::string> a, std::vector<std::string> extra) {
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const CliResult wrong = RunCli(with(job, {"--token", "wrong-token-0123456789"}));
  if (NoUcx(wrong)) GTEST_SKIP() << "this build has no UCX";
  EXPECT_EQ(wrong.exit_code, 2) << wrong.Describe();
  EXPECT_EQ(wrong.out, "");
  EXPECT_NE(wrong.err.find("SHARDSYNC_TOKEN"), std::string::npos) << wrong.Describe();

  const CliResult alone = RunCli(with(job, {"--token", "right-token-0123456789"}));
  EXPECT_EQ(alone.exit_code, 1) << alone.Describe();
  const json j = ParseJson(alone);  // run prints its rank's result even when it fails
  EXPECT_TRUE(j.is_object());
  if (j.is_object()) {
    EXPECT_EQ(j["ok"], false);
    EXPECT_NE(j["error"].get<std::string>().find("sync rank 1"), std::string::npos) << j.dump();
  }
  kill(store_pid, SIGTERM);
  server.thread.join();
  server.pid = -1;

  // The store is gone now: connecting fails at the timeout instead of waiting forever.
  const CliResult gone = RunCli(with(job, {"--token", "right-token-0123456789"}));
  EXPECT_EQ(gone.exit_code, 1) << gone.Describe();
  EXPECT_EQ(gone.out, "");
  EXPECT_NE(gone.err.find(store), std::string::npos) << gone.Describe();
}

// A "store" that accepts connections and never answers: run ends at --timeout-ms, exit 1.
TEST(CliGood, RunAgainstSilentStoreTimesOut) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(listen(fd, 8), 0);  // the kernel completes the handshake; nobody reads
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string store = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  const CliResult r =
      RunCli({"run", "--role", "trainer", "--rank", "0", "--model", Tiny(), "--trainer", "fsdp=2",
              "--rollout", "dp=1,tp=2,pp=1", "--transport", "ucx", "--timeout-ms", "1000",
              "--store", store, "--token", "test-token-0123456789"});
  close(fd);
  if (NoUcx(r)) GTEST_SKIP() << "this build has no UCX";
  EXPECT_FALSE(r.timed_out) << r.Describe();
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find(store), std::string::npos) << r.Describe();
}

TEST(CliGood, InspectFileAndDirectory) {
  const Fixtures& fx = Fixtures::Get();
  const CliResult r = Ok({"inspect", (fx.dir / "good.safetensors").string(), "--json"});
  const json j = ParseJson(r);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["num_tensors"], 2);
  EXPECT_EQ(j["total_bytes"], 24);
  ASSERT_EQ(j["tensors"].size(), 2u);
  EXPECT_EQ(j["tensors"][0]["name"], "a.weight");
  EXPECT_EQ(j["tensors"][0]["shape"], json::array({2, 2}));
  const CliResult table = Ok({"inspect", (fx.dir / "gooddir").string()});
  EXPECT_NE(table.out.find("b.bias"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("2 tensors"), std::string::npos) << table.out;
}

// Issue 37: a tensor name with an escape sequence was printed raw (it drives the terminal).
TEST(CliGood, InspectEscapesControlCharactersInNames) {
  const Fixtures& fx = Fixtures::Get();
  const std::filesystem::path file = fx.dir / "escapes.safetensors";
  WriteFile(file, Safetensors(R"({"evil\u001b[31m.weight": {"dtype": "F32", "shape": [1], )"
                              R"("data_offsets": [0, 4]}})",
                              std::string(4, '\x01')));
  const CliResult table = Ok({"inspect", file.string()});
  EXPECT_EQ(table.out.find('\x1b'), std::string::npos) << table.Describe();
  EXPECT_NE(table.out.find("evil\\x1b[31m.weight"), std::string::npos) << table.out;
}

TEST(CliGood, GenerateUnshardedAndShardedAgree) {
  const std::vector<std::string> base = {"generate", "--model",      Tiny(),  "--seed",
                                         "7",        "--prompt-ids", "1,2,3", "--max-new-tokens",
                                         "3",        "--json"};
  const json plain = ParseJson(Ok(base));
  ExpectKeys(
      plain,
      {"tokens", "logits", "prompt_ids", "model", "architecture", "weights", "layout", "seconds"},
      "generate");
  ASSERT_EQ(plain["logits"].size(), 200u);
  ASSERT_FALSE(plain["tokens"].empty());
  for (const auto& t : plain["tokens"]) {
    EXPECT_GE(t.get<int64_t>(), 0);
    EXPECT_LT(t.get<int64_t>(), 200);
  }
  for (const char* engine : {"sglang", "vllm"}) {
    auto args = base;
    args.insert(args.end(), {"--engine", engine, "--tp", "2", "--pp", "2"});
    const json sharded = ParseJson(Ok(args));
    ASSERT_TRUE(sharded.is_object());
    EXPECT_EQ(sharded["tokens"], plain["tokens"]) << engine;
  }
}

TEST(CliGood, DemoVerifiesTinyJob) {
  const CliResult r =
      Ok({"demo", "--model", Tiny(), "--trainer", "fsdp=2", "--rollout", "dp=1,tp=2,pp=2",
          "--transport", "loopback", "--launch", "threads", "--json"},
         WithTimeout(30));
  const json j = ParseJson(r);
  ExpectKeys(j,
             {"verified",
              "version",
              "bytes",
              "seconds",
              "gbps",
              "checksums_ok",
              "checksums_total",
              "recv_bytes_per_engine_rank",
              "owned_bytes_per_engine_rank",
              "peak_rss_bytes",
              "rank_seconds",
              "elements_checked",
              "element_mismatches",
              "transport",
              "plan_hash",
              "generation_match",
              "tokens",
              "reference_tokens",
              "prompt",
              "max_logit_diff",
              "logit_tolerance"},
             "demo");
  // The generation step: the engine-sharded forward on the synced bytes matches the trainer's.
  EXPECT_EQ(j["generation_match"], true) << r.out;
  EXPECT_EQ(j["tokens"], j["reference_tokens"]);
  EXPECT_FALSE(j["tokens"].empty());
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["element_mismatches"], 0);
  EXPECT_GT(j["checksums_total"].get<int64_t>(), 0);
  EXPECT_EQ(j["checksums_ok"], j["checksums_total"]);
  EXPECT_EQ(j["recv_bytes_per_engine_rank"], j["owned_bytes_per_engine_rank"]);
  // Not on a terminal: one stderr line per phase instead of a progress bar.
  EXPECT_NE(r.err.find("shardsync demo: [2/4] connected (every rank)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[4/4] elements verified"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\r'), std::string::npos);
}

// Megatron trainers (docs/megatron.md): each trainer rank fills its local parameters through its
// trainer map and binds them; the demo verifies every element and the reference engine's tokens.
TEST(CliGood, DemoVerifiesMegatronTrainers) {
  const std::string moe = Fixtures::Get().Expand("{DIR}/moe/config.json");
  struct Case {
    std::string model, trainer, rollout, engine, trainer_dtype, launch;
  };
  const Case cases[] = {
      {Tiny(), "megatron=tp=2,pp=2", "dp=1,tp=2,pp=2", "sglang", "fp32", "threads"},
      {moe, "megatron=tp=2,ep=2,etp=1", "dp=1,tp=2,pp=1,ep=2", "vllm", "bf16", "threads"},
      // One `shardsync run` process per sync rank (shm): the path torchrun / SLURM use.
      {moe, "megatron=tp=1,pp=2,ep=2,dp=2", "dp=1,tp=2,pp=2", "sglang", "bf16", "processes"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.trainer + " -> " + c.engine + " " + c.rollout);
    std::vector<std::string> args = {
        "demo",     c.model,        "--trainer", c.trainer, "--rollout",       c.rollout,
        "--engine", c.engine,       "--launch",  c.launch,  "--trainer-dtype", c.trainer_dtype,
        "--json",   "--gen-tokens", "4"};
    args.insert(args.begin() + 1, "--model");
    if (c.launch == "threads") args.insert(args.end(), {"--transport", "loopback"});
    const json j = ParseJson(Ok(args, WithTimeout(60)));
    ASSERT_TRUE(j.is_object());
    EXPECT_EQ(j["verified"], true) << j.dump();
    EXPECT_EQ(j["element_mismatches"], 0);
    EXPECT_GT(j["elements_checked"].get<int64_t>(), 0);
    EXPECT_EQ(j["recv_bytes_per_engine_rank"], j["owned_bytes_per_engine_rank"]);
    EXPECT_EQ(j["generation_match"], true) << j.dump();
    EXPECT_EQ(j["tokens"], j["reference_tokens"]);
  }
}

TEST(CliGood, BenchVerifiesMegatronTrainer) {
  const json j =
      ParseJson(Ok({"bench", "--model", Tiny(), "--trainer", "megatron=tp=1,pp=2", "--rollout",
                    "dp=1,tp=2,pp=1", "--trainer-dtype", "bf16", "--transport", "loopback",
                    "--launch", "threads", "--reps", "1", "--warmup", "0", "--json"},
                   WithTimeout(30)));
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["verified"], true) << j.dump();
  EXPECT_EQ(j["wire_bytes_equal_owned"], true);
}

// One `shardsync run` process per sync rank over UCX: the launcher path torchrun / SLURM use.
TEST(CliGood, DemoThroughRunProcesses) {
  const std::vector<std::string> args = {
      "demo",      "--model",        Tiny(),         "--trainer", "fsdp=2",
      "--rollout", "dp=1,tp=2,pp=1", "--transport",  "ucx",       "--launch",
      "processes", "--json",         "--timeout-ms", "15000",     "--job-timeout-s",
      "20"};
  const CliResult probe = RunCli(args, WithTimeout(30));
  if (NoUcx(probe)) GTEST_SKIP() << "this build has no UCX";
  ASSERT_EQ(probe.exit_code, 0) << probe.Describe();
  const json j = ParseJson(probe);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["verified"], true) << probe.out;
  EXPECT_EQ(j["transport"], "ucx");
  EXPECT_EQ(j["peak_rss_bytes"].size(), 4u);
}

TEST(CliGood, BenchVerifiesTinyJob) {
  const CliResult r = Ok(
      {"bench", "--model", Tiny(), "--trainer", "fsdp=2", "--rollout", "dp=1,tp=2,pp=1",
       "--transport", "loopback", "--launch", "threads", "--reps", "1", "--warmup", "0", "--json"},
      WithTimeout(30));
  const json j = ParseJson(r);
  ExpectKeys(j,
             {"sharded_gbps", "broadcast_gbps", "raw_transport_gbps", "ratio_to_raw",
              "speedup_vs_broadcast", "verified", "bytes", "sharded_seconds", "broadcast_seconds",
              "raw_seconds", "wire_bytes_equal_owned", "transport", "reps", "warmup"},
             "bench");
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["wire_bytes_equal_owned"], true);
  EXPECT_GT(j["bytes"].get<int64_t>(), 0);
  EXPECT_NE(r.err.find("shardsync bench: every rank finished"), std::string::npos) << r.err;
}

// --emulate-nodes: every rank process its own node, reported in --json (host memory over ucx).
TEST(CliGood, DemoEmulatedNodesReportsOneNodePerRank) {
  const CliResult r = RunCli({"demo", "--model", Tiny(), "--trainer", "fsdp=2", "--rollout",
                              "dp=1,tp=2,pp=1", "--transport", "ucx", "--emulate-nodes",
                              "--gen-tokens", "0", "--json", "--timeout-ms", "15000"},
                             WithTimeout(40));
  if (NoUcx(r)) GTEST_SKIP() << "this build has no UCX";
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  const json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["emulate_nodes"], true);
  EXPECT_EQ(j["nodes"], 4) << r.out;  // 2 trainer + 2 engine rank processes
}

// bench on host memory across emulated nodes (UCX over TCP): its barriers drive the transport, so
// the baselines' flushes complete (they hung while the peer waited on the store); small updates
// travel as deltas; every plan byte crosses a node.
TEST(CliGood, BenchEmulatedNodesHostUcx) {
  const CliResult r = RunCli({"bench",
                              "--model",
                              Tiny(),
                              "--trainer",
                              "fsdp=2",
                              "--rollout",
                              "dp=1,tp=2,pp=1",
                              "--transport",
                              "ucx",
                              "--emulate-nodes",
                              "--encoding",
                              "delta",
                              "--update-fraction",
                              "0.01",
                              "--warmup",
                              "1",
                              "--reps",
                              "2",
                              "--json",
                              "--timeout-ms",
                              "15000"},
                             WithTimeout(60));
  if (NoUcx(r)) GTEST_SKIP() << "this build has no UCX";
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  const json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["emulate_nodes"], true);
  EXPECT_EQ(j["nodes"], 4) << r.out;  // 2 trainer + 2 engine rank processes
  EXPECT_GT(j["bytes"].get<int64_t>(), 0);
  EXPECT_EQ(j["cross_node_bytes"], j["bytes"]) << r.out;  // each rank its own node
  EXPECT_GT(j["elements_checked"].get<int64_t>(), 0);
  EXPECT_EQ(j["element_mismatches"], 0);
  // The last sync restores the 1% the others changed: a delta, much smaller than the buckets.
  const json& d = j["delta"];
  EXPECT_GT(d["changed"].get<int64_t>(), 0) << r.out;
  EXPECT_GT(d["buckets_delta"].get<int64_t>(), 0) << r.out;
  EXPECT_LT(d["wire_bytes"].get<int64_t>() * 10, d["full_bytes"].get<int64_t>()) << r.out;
}

// HF tensor names and shapes of the tiny model, from `shards --json` at tp 1 (every source tensor
// is covered by its pieces).
std::map<std::string, std::vector<int64_t>> TinyHfShapes() {
  const json map = ParseJson(Ok({"shards", "--model", Tiny(), "--engine", "vllm", "--json"}));
  std::map<std::string, std::vector<int64_t>> shapes;
  if (!map.is_object()) return shapes;
  for (const auto& p : map["ranks"][0]["params"]) {
    for (const auto& piece : p["pieces"]) {
      auto& shape = shapes[piece["source"].get<std::string>()];
      const size_t nd = piece["extent"].size();
      shape.resize(nd, 0);
      for (size_t d = 0; d < nd; ++d) {
        shape[d] = std::max(
            shape[d], piece["src_offset"][d].get<int64_t>() + piece["extent"][d].get<int64_t>());
      }
    }
  }
  return shapes;
}

// Writes DIR/config.json and DIR/model.safetensors (small pseudo-random bf16 values); returns
// the data section's size. `values`: each tensor's bf16 bytes, when given.
size_t WriteCheckpoint(const fs::path& dir,
                       const std::map<std::string, std::vector<int64_t>>& shapes,
                       std::map<std::string, std::string>* values = nullptr) {
  json header = json::object();
  std::string data;
  uint32_t state = 12345;
  for (const auto& [name, shape] : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const size_t begin = data.size();
    for (int64_t i = 0; i < n; ++i) {
      state = state * 1664525u + 1013904223u;  // LCG: deterministic values in [-0.1, 0.1)
      const float v = (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 0.2f;
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      const uint16_t bf16 = static_cast<uint16_t>(bits >> 16);
      data.push_back(static_cast<char>(bf16 & 0xff));
      data.push_back(static_cast<char>(bf16 >> 8));
    }
    header[name] = {{"dtype", "BF16"}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
    if (values != nullptr) (*values)[name] = data.substr(begin);
  }
  WriteFile(dir / "config.json", TinyConfig());
  WriteFile(dir / "model.safetensors", Safetensors(header.dump(), data));
  return data.size();
}

// A real checkpoint of the tiny model: inspect lists exactly its tensors, and generate runs on
// them, unsharded and through both engines' layouts, to the same tokens.
TEST(CliCheckpoint, InspectAndGenerate) {
  const auto shapes = TinyHfShapes();
  ASSERT_EQ(shapes.count("model.embed_tokens.weight"), 1u);
  const fs::path ckpt = Fixtures::Get().dir / "ckpt";
  const size_t data_bytes = WriteCheckpoint(ckpt, shapes);

  const json listing = ParseJson(Ok({"inspect", ckpt.string(), "--json"}));
  ASSERT_TRUE(listing.is_object());
  EXPECT_EQ(listing["num_tensors"].get<size_t>(), shapes.size());
  EXPECT_EQ(listing["total_bytes"].get<size_t>(), data_bytes);
  for (const auto& t : listing["tensors"]) {
    ASSERT_EQ(shapes.count(t["name"].get<std::string>()), 1u) << t["name"];
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), shapes.at(t["name"].get<std::string>()));
    EXPECT_EQ(t["dtype"], "BF16");
  }

  const std::vector<std::string> base = {
      "generate", "--weights",        ckpt.string(), "--prompt-ids",
      "5,6,7",    "--max-new-tokens", "3",           "--json"};
  const json plain = ParseJson(Ok(base));
  ASSERT_TRUE(plain.is_object());
  ASSERT_EQ(plain["logits"].size(), 200u);
  EXPECT_EQ(plain["prompt_ids"], json::array({5, 6, 7}));
  auto file_args = base;
  file_args[2] = (ckpt / "model.safetensors").string();
  EXPECT_EQ(ParseJson(Ok(file_args))["tokens"], plain["tokens"]);
  for (const char* engine : {"sglang", "vllm"}) {
    auto args = base;
    args.insert(args.end(), {"--engine", engine, "--tp", "2", "--pp", "2"});
    EXPECT_EQ(ParseJson(Ok(args))["tokens"], plain["tokens"]) << engine;
  }
}

// Engine dumps as any client writes them (replica 0 of SGLang tp2 pp2: each rank's parameters,
// cut here from the checkpoint's values by the shard map `shards --json` prints, rank in
// __metadata__): `generate --engine-dump` runs the sharded forward on them and MATCHes the
// unsharded model; a dump whose final norm is zeroed is a MISMATCH, exit 1.
TEST(CliCheckpoint, GenerateOnEngineDumps) {
  const auto shapes = TinyHfShapes();
  const fs::path ckpt = Fixtures::Get().dir / "ckpt-dumps";
  std::map<std::string, std::string> values;
  WriteCheckpoint(ckpt, shapes, &values);
  const json map = ParseJson(Ok({"shards", "--model", (ckpt / "config.json").string(), "--engine",
                                 "sglang", "--tp", "2", "--pp", "2", "--json"}));
  ASSERT_TRUE(map.is_object());
  const fs::path dumps = Fixtures::Get().dir / "dumps";
  auto write_dumps = [&](bool zero_final_norm) {
    fs::remove_all(dumps);
    for (const auto& rank : map["ranks"]) {
      json header = json::object();
      std::string data;
      for (const auto& p : rank["params"]) {
        const auto shape = p["shape"].get<std::vector<int64_t>>();
        const int64_t cols = shape.size() > 1 ? shape[1] : 1;
        std::string buf(Numel(p["shape"]) * 2, '\0');  // zero-filled rows stay zero
        for (const auto& pc : p["pieces"]) {
          const std::string& src = values.at(pc["source"].get<std::string>());
          const auto& sshape = shapes.at(pc["source"].get<std::string>());
          const int64_t scols = sshape.size() > 1 ? sshape[1] : 1;
          const auto ext = pc["extent"].get<std::vector<int64_t>>();
          const auto so = pc["src_offset"].get<std::vector<int64_t>>();
          const auto dof = pc["dst_offset"].get<std::vector<int64_t>>();
          const int64_t rows = ext.size() > 1 ? ext[0] : 1,
                        width = ext.size() > 1 ? ext[1] : ext[0];
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t s0 = ext.size() > 1 ? (so[0] + r) * scols + so[1] : so[0];
            const int64_t d0 = ext.size() > 1 ? (dof[0] + r) * cols + dof[1] : dof[0];
            std::memcpy(&buf[d0 * 2], &src[s0 * 2], width * 2);
          }
        }
        if (zero_final_norm && p["name"] == "model.norm.weight") buf.assign(buf.size(), '\0');
        header[p["name"].get<std::string>()] = {
            {"dtype", "BF16"},
            {"shape", shape},
            {"data_offsets", {data.size(), data.size() + buf.size()}}};
        data += buf;
      }
      header["__metadata__"] = {{"shardsync.replica", "0"},
                                {"shardsync.tp_rank", std::to_string(rank["tp_rank"].get<int>())},
                                {"shardsync.pp_rank", std::to_string(rank["pp_rank"].get<int>())}};
      WriteFile(dumps / ("rank-" + std::to_string(rank["pp_rank"].get<int>()) +
                         std::to_string(rank["tp_rank"].get<int>()) + ".safetensors"),
                Safetensors(header.dump(), data));
    }
  };
  const std::vector<std::string> args = {
      "generate", ckpt.string(),   "--engine",     "sglang",           "--tp", "2",     "--pp",
      "2",        "--engine-dump", dumps.string(), "--max-new-tokens", "3",    "--json"};
  std::vector<std::string> cmd = args;
  cmd.insert(cmd.begin() + 1, "--weights");
  write_dumps(false);
  const json good = ParseJson(Ok(cmd));
  ASSERT_TRUE(good.is_object());
  EXPECT_EQ(good["match"], true) << good.dump();
  EXPECT_EQ(good["tokens"], good["reference_tokens"]);
  EXPECT_EQ(good["tokens"].size(), 3u);
  write_dumps(true);
  const CliResult bad = RunCli(cmd);
  EXPECT_EQ(bad.exit_code, 1) << bad.Describe();
  const json j = ParseJson(bad);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["match"], false);
}

// A checkpoint that does not fit its config.json: generate names the tensor, exits 2, and
// prints nothing on stdout.
TEST(CliCheckpoint, GenerateRejectsTensorsNotMatchingConfig) {
  const auto shapes = TinyHfShapes();
  ASSERT_EQ(shapes.count("model.norm.weight"), 1u);
  struct Bad {
    std::string dir, tensor;
    std::map<std::string, std::vector<int64_t>> shapes;
  };
  std::vector<Bad> cases;
  cases.push_back({"ckpt_missing", "model.norm.weight", shapes});
  cases.back().shapes.erase("model.norm.weight");
  cases.push_back({"ckpt_reshaped", "model.layers.1.mlp.down_proj.weight", shapes});
  cases.back().shapes["model.layers.1.mlp.down_proj.weight"] = {64, 64};
  for (const Bad& c : cases) {
    const fs::path dir = Fixtures::Get().dir / c.dir;
    WriteCheckpoint(dir, c.shapes);
    const CliResult r = RunCli({"generate", "--weights", dir.string(), "--max-new-tokens", "1"});
    EXPECT_EQ(r.exit_code, 2) << c.dir << "\n" << r.Describe();
    EXPECT_EQ(r.out, "") << c.dir;
    EXPECT_NE(r.err.find(c.tensor), std::string::npos) << c.dir << "\n" << r.Describe();
  }
}

}  // namespace
}  // namespace shardsync::clitest
