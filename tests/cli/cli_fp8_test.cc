// Block FP8 on the command line: a config's quantization_config and `--quant` are honoured
// (shards, plan, generate, demo, bench, run) or refused (other quantization methods, layouts the
// engines refuse), never ignored.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli_harness.h"

namespace shardsync::clitest {
namespace {

using json = nlohmann::json;

std::vector<std::string> Expand(std::vector<std::string> args) {
  for (auto& a : args) a = Fixtures::Get().Expand(a);
  return args;
}

CliResult Ok(const std::vector<std::string>& args, double timeout_s = 60) {
  RunOptions opt;
  opt.timeout_s = timeout_s;
  CliResult r = RunCli(Expand(args), opt);
  EXPECT_EQ(r.exit_code, 0) << r.Describe();
  return r;
}

void ExpectRefused(const std::vector<std::string>& args, std::vector<std::string> mentions) {
  const CliResult r = RunCli(Expand(args));
  std::string cmd;
  for (const auto& a : args) cmd += " " + a;
  SCOPED_TRACE(cmd + "\n" + r.Describe());
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.term_signal, 0);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "") << "bad input must write nothing to stdout";
  std::string err = r.err;
  std::transform(err.begin(), err.end(), err.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  for (auto m : mentions) {
    std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return std::tolower(c); });
    EXPECT_NE(err.find(m), std::string::npos) << "stderr does not name '" << m << "'";
  }
}

TEST(CliFp8, ShardsHonoursTheConfigAndTheFlag) {
  const CliResult cfg = Ok(
      {"shards", "--model", "{DIR}/fp8/config.json", "--engine", "sglang", "--tp", "2", "--json"});
  const json j = json::parse(cfg.out);
  bool fp8 = false, scale = false;
  for (const auto& p : j["ranks"][0]["params"]) {
    fp8 = fp8 || p["dtype"] == "float8_e4m3fn";
    scale = scale || p["name"] == "model.layers.0.self_attn.qkv_proj.weight_scale_inv";
  }
  EXPECT_TRUE(fp8 && scale);
  const CliResult flag = Ok({"shards", "--model", "qwen3-0.6b", "--engine", "vllm", "--tp", "2",
                             "--quant", "fp8-block128"});
  EXPECT_NE(flag.out.find("block FP8 (fp8 e4m3 128x128, from --quant)"), std::string::npos);
  const CliResult none = Ok({"shards", "--model", "{DIR}/fp8/config.json", "--engine", "vllm",
                             "--quant", "none", "--json"});
  EXPECT_EQ(none.out.find("float8_e4m3fn"), std::string::npos);
}

TEST(CliFp8, PlanShowsWhereBlocksAreQuantized) {
  const std::string ops = Fixtures::Get().Expand("{DIR}/out/fp8_ops.jsonl");
  const CliResult r =
      Ok({"plan", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=4", "--rollout",
          "dp=1,tp=2,pp=1", "--fp8-split", "stage", "--json", "--dump-ops", ops, "--rank", "4"});
  const json j = json::parse(r.out);
  EXPECT_EQ(j["quant"]["weight_block_size"], json::array({128, 128}));
  EXPECT_EQ(j["quant"]["origin"], "quantization_config");
  EXPECT_GT(j["sender_quantized_elements"].get<int64_t>(), 0);
  // fsdp=4 on 256-row k/v/gate/up/down weights: 64 rows per rank, every band straddles ranks.
  EXPECT_GT(j["receiver_quantized_elements"].get<int64_t>(), 0);
  EXPECT_GT(j["bound_write_bytes"].get<int64_t>(), 0);
  std::ifstream f(ops);
  std::string line;
  int quantize = 0, stage = 0, staged = 0;
  while (std::getline(f, line)) {
    const json o = json::parse(line);
    if (o.contains("staged")) {
      ++staged;
    } else if (o["kind"] == "quantize") {
      ++quantize;
      EXPECT_TRUE(o.contains("scale_region"));
    } else if (o["kind"] == "stage") {
      ++stage;
    }
  }
  EXPECT_GT(quantize, 0);
  EXPECT_GT(stage, 0);
  EXPECT_GT(staged, 0);
  // The text summary names both paths; --quant none plans the bf16 engine instead.
  const CliResult text = Ok({"plan", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2",
                             "--rollout", "dp=1,tp=2,pp=1"});
  EXPECT_NE(text.out.find("quantized by senders"), std::string::npos);
  EXPECT_NE(text.out.find("memory-bound work"), std::string::npos);
  const CliResult bf16 = Ok({"plan", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2",
                             "--rollout", "dp=1,tp=2,pp=1", "--quant", "none", "--json"});
  EXPECT_FALSE(json::parse(bf16.out).contains("quant"));
}

TEST(CliFp8, GenerateShardedMatchesUnshardedOnFp8Weights) {
  const CliResult one =
      Ok({"generate", "--model", "{DIR}/fp8/config.json", "--max-new-tokens", "4", "--json"});
  const CliResult tp = Ok({"generate", "--model", "{DIR}/fp8/config.json", "--max-new-tokens", "4",
                           "--engine", "vllm", "--tp", "2", "--pp", "2", "--json"});
  const json a = json::parse(one.out), b = json::parse(tp.out);
  EXPECT_EQ(a["tokens"], b["tokens"]);
  EXPECT_NE(a["weights"].get<std::string>().find("block FP8"), std::string::npos) << a["weights"];
  // --quant none runs the model dtype: other logits.
  const CliResult none = Ok({"generate", "--model", "{DIR}/fp8/config.json", "--max-new-tokens",
                             "1", "--quant", "none", "--json"});
  EXPECT_NE(json::parse(none.out)["logits"], a["logits"]);
}

// Issue 25's CPU proof: an FP8 sync through real sessions (one process per rank, shm) lands
// every e4m3 byte and scale as the quantizer computes them from the trainer's values, and the
// sharded FP8 engine generates the unsharded FP8 reference's tokens.
TEST(CliFp8, DemoSyncsBlockFp8AndGenerationMatches) {
  for (const char* quant : {"", "fp8-block128"}) {
    SCOPED_TRACE(quant);
    std::vector<std::string> args = {"demo",   "--model",   "{DIR}/fp8/config.json", "--trainer",
                                     "fsdp=4", "--rollout", "dp=1,tp=2,pp=1",        "--json"};
    if (*quant) args.insert(args.end(), {"--quant", quant});
    const json j = json::parse(Ok(args).out);
    EXPECT_TRUE(j["verified"].get<bool>());
    EXPECT_TRUE(j["generation_match"].get<bool>());
    EXPECT_EQ(j["tokens"], j["reference_tokens"]);
    EXPECT_EQ(j["element_mismatches"], 0);
    EXPECT_GT(j["elements_checked"].get<int64_t>(), 0);
    EXPECT_EQ(j["checksums_ok"], j["checksums_total"]);
    EXPECT_EQ(j["quant"]["origin"], *quant ? "--quant" : "quantization_config");
    EXPECT_GT(j["quant"]["sender_quantized_elements"].get<int64_t>(), 0);
  }
  // --quant none drops the config's quantization_config in every rank process: a bf16 sync.
  const json none = json::parse(
      Ok({"demo", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2", "--rollout",
          "dp=1,tp=2,pp=1", "--gen-tokens", "0", "--quant", "none", "--json"})
          .out);
  EXPECT_TRUE(none["verified"].get<bool>());
  EXPECT_FALSE(none.contains("quant"));
}

// Issue 28 x 25: a Megatron-Core trainer (tp 2 x pp 2, quantizing from its local parameters)
// into the FP8 engine, one process per rank: every byte and scale verified, tokens MATCH.
TEST(CliFp8, DemoSyncsBlockFp8FromMegatronAndGenerationMatches) {
  const json j = json::parse(Ok({"demo", "--model", "{DIR}/fp8/config.json", "--trainer",
                                 "megatron=tp=2,pp=2", "--rollout", "dp=1,tp=2,pp=2", "--json"})
                                 .out);
  EXPECT_TRUE(j["verified"].get<bool>());
  EXPECT_TRUE(j["generation_match"].get<bool>());
  EXPECT_EQ(j["tokens"], j["reference_tokens"]);
  EXPECT_EQ(j["element_mismatches"], 0);
  EXPECT_GT(j["elements_checked"].get<int64_t>(), 0);
  EXPECT_EQ(j["checksums_ok"], j["checksums_total"]);
  EXPECT_GT(j["quant"]["sender_quantized_elements"].get<int64_t>(), 0);
  EXPECT_EQ(j["quant"]["receiver_quantized_elements"], 0);
  // Megatron tp 4 holds 64 of gate_proj's rows per rank: a block on two ranks, refused at plan
  // time naming the tensor, its rows and the Megatron rank.
  ExpectRefused({"demo", "--model", "{DIR}/fp8/config.json", "--trainer", "megatron=tp=4,pp=1",
                 "--rollout", "dp=1,tp=1,pp=1"},
                {"gate_proj.weight", "rows [0, 64)", "Megatron rank 0", "--trainer megatron"});
}

TEST(CliFp8, BenchTimesFp8NextToBf16) {
  const json j =
      json::parse(Ok({"bench", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2",
                      "--rollout", "dp=1,tp=2,pp=1", "--warmup", "0", "--reps", "1", "--json"})
                      .out);
  EXPECT_TRUE(j["verified"].get<bool>());
  EXPECT_GT(j["fp8_seconds"].get<double>(), 0);
  EXPECT_GT(j["bf16_seconds"].get<double>(), 0);
  EXPECT_GT(j["ceiling_seconds"].get<double>(), 0);
  EXPECT_EQ(j["ceiling"], "raw_transport");
  EXPECT_EQ(j["element_mismatches"], 0);
  EXPECT_GT(j["quant"]["bound_write_bytes"].get<int64_t>(), 0);
  EXPECT_FALSE(j["emulate_nodes"].get<bool>());
  EXPECT_EQ(j["nodes"], 1);  // every rank process on this host
  EXPECT_EQ(j["cross_node_bytes"], 0);
}

// --encoding delta with small updates: the FP8 run's and the bf16 run's delta figures are in the
// JSON, and the update (a 1.6-3.1% step toward zero of 1% of the trainer's elements) changes a
// small part of the FP8 image, as an optimizer's step does (setting values outright moved most
// blocks' amax).
TEST(CliFp8, BenchWithDeltaReportsBothRunsDeltaFigures) {
  const json j =
      json::parse(Ok({"bench", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2",
                      "--rollout", "dp=1,tp=2,pp=1", "--encoding", "delta", "--update-fraction",
                      "0.01", "--warmup", "1", "--reps", "2", "--json"})
                      .out);
  EXPECT_TRUE(j["verified"].get<bool>()) << j.dump();
  EXPECT_EQ(j["element_mismatches"], 0);
  EXPECT_EQ(j["encoding"], "delta");
  for (const char* k : {"delta", "bf16_delta"}) {
    SCOPED_TRACE(k);
    ASSERT_TRUE(j.contains(k)) << j.dump();
    const json& d = j[k];
    EXPECT_GT(d["changed"].get<int64_t>(), 0) << d.dump();
    EXPECT_GT(d["buckets_delta"].get<int64_t>(), 0) << d.dump();
    EXPECT_LT(d["wire_bytes"].get<int64_t>(), d["full_bytes"].get<int64_t>()) << d.dump();
  }
  EXPECT_LT(j["delta"]["density"].get<double>(), 0.05) << j["delta"].dump();
  EXPECT_NEAR(j["bf16_delta"]["density"].get<double>(), 0.01, 0.002) << j["bf16_delta"].dump();
  // Without --encoding delta there are no delta figures.
  const json full =
      json::parse(Ok({"bench", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2",
                      "--rollout", "dp=1,tp=2,pp=1", "--warmup", "0", "--reps", "1", "--json"})
                      .out);
  EXPECT_EQ(full["encoding"], "full");
  EXPECT_FALSE(full.contains("delta"));
}

// --emulate-nodes: each rank process its own node, the FP8 sync over UCX's TCP between them; the
// JSON says how many nodes and how many of the FP8 plan's bytes crossed between them (all: no
// trainer rank shares a node with an engine rank).
TEST(CliFp8, BenchAcrossEmulatedNodesReportsTheNodes) {
  RunOptions opt;
  opt.timeout_s = 90;
  const CliResult r =
      RunCli(Expand({"bench", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2",
                     "--rollout", "dp=1,tp=2,pp=1", "--transport", "ucx", "--emulate-nodes",
                     "--warmup", "0", "--reps", "1", "--json", "--timeout-ms", "15000"}),
             opt);
  if (r.err.find("not available in this build") != std::string::npos ||
      r.err.find("built without UCX") != std::string::npos) {
    GTEST_SKIP() << "this build has no UCX";
  }
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  const json j = json::parse(r.out);
  EXPECT_TRUE(j["verified"].get<bool>());
  EXPECT_TRUE(j["emulate_nodes"].get<bool>());
  EXPECT_EQ(j["nodes"], 4);
  EXPECT_GT(j["cross_node_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(j["cross_node_bytes"], j["fp8_wire_bytes"]) << j.dump();
}

// Issue 32: --dump-dir holds the FP8 run's engine parameters (e4m3 weights, fp32 scales), not the
// bf16 comparison run's, which used to overwrite them.
TEST(CliFp8, BenchDumpDirHoldsTheFp8RunsParameters) {
  const std::string dir = Fixtures::Get().Expand("{DIR}/out/bench-fp8-dump");
  ExpectRefused({"bench", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2", "--rollout",
                 "dp=1,tp=2,pp=1", "--dump-dir", dir},
                {"--dump-dir", "not a directory"});
  fs::create_directories(dir);
  const json j = json::parse(
      Ok({"bench", "--model", "{DIR}/fp8/config.json", "--trainer", "fsdp=2", "--rollout",
          "dp=1,tp=2,pp=1", "--warmup", "0", "--reps", "1", "--dump-dir", dir, "--json"})
          .out);
  EXPECT_TRUE(j["verified"].get<bool>());
  for (const char* rank : {"rank-2", "rank-3"}) {  // the engine ranks: sync ranks 2 and 3
    SCOPED_TRACE(rank);
    const json t = json::parse(Ok({"inspect", dir + "/" + rank + ".safetensors", "--json"}).out);
    std::map<std::string, std::string> dtype;
    for (const auto& e : t["tensors"]) dtype[e["name"]] = e["dtype"];
    for (const std::string p :
         {"model.layers.0.self_attn.qkv_proj.", "model.layers.1.mlp.down_proj."}) {
      EXPECT_EQ(dtype[p + "weight"], "F8_E4M3");
      EXPECT_EQ(dtype[p + "weight_scale_inv"], "F32");
    }
  }
}

TEST(CliFp8, RefusalsNameTheFieldOrFlag) {
  const std::string fp8 = "{DIR}/fp8/config.json";
  // Other quantization methods, for every command that reads a config.
  ExpectRefused({"shards", "--model", "{DIR}/awq/config.json", "--engine", "sglang"},
                {"quantization_config", "awq"});
  ExpectRefused({"plan", "--model", "{DIR}/awq/config.json", "--trainer", "fsdp=2", "--rollout",
                 "dp=1,tp=2,pp=1"},
                {"quantization_config"});
  ExpectRefused({"generate", "--model", "{DIR}/awq/config.json"}, {"quantization_config"});
  ExpectRefused({"demo", "--model", "{DIR}/awq/config.json"}, {"quantization_config"});
  // A bad --quant value.
  ExpectRefused({"shards", "--model", fp8, "--engine", "sglang", "--quant", "int4"}, {"--quant"});
  // Deltas need the engine's landed image, which staged bands do not have: refused when planned.
  ExpectRefused({"demo", "--model", fp8, "--trainer", "fsdp=4", "--rollout", "dp=1,tp=2,pp=1",
                 "--fp8-split", "stage", "--encoding", "delta"},
                {"--encoding delta", "--fp8-split stage"});
  ExpectRefused({"generate", "--model", fp8, "--quant", "fp8"}, {"--quant"});
  // Layouts the engines refuse: the tiny Qwen2 (head_dim 16) has 16-row kv parts.
  ExpectRefused({"shards", "--model", "{DIR}/tiny/config.json", "--engine", "sglang", "--tp", "2",
                 "--quant", "fp8-block128"},
                {"qkv_proj.weight", "block_n = 128", "--tp 2"});
  ExpectRefused({"plan", "--model", "{DIR}/tiny/config.json", "--trainer", "fsdp=2", "--rollout",
                 "dp=1,tp=2,pp=1", "--quant", "fp8-block128"},
                {"qkv_proj.weight", "not divisible"});
  // The sync commands refuse the same layouts at plan time, naming the tensor, before any rank
  // starts.
  ExpectRefused({"demo", "--model", "{DIR}/tiny/config.json", "--quant", "fp8-block128"},
                {"qkv_proj.weight", "block_n = 128"});
  ExpectRefused({"bench", "--model", "{DIR}/tiny/config.json", "--rollout", "dp=1,tp=2,pp=1",
                 "--quant", "fp8-block128"},
                {"qkv_proj.weight", "not divisible"});
  ExpectRefused({"run", "--model", "{DIR}/tiny/config.json", "--trainer", "fsdp=2", "--rollout",
                 "dp=1,tp=2,pp=1", "--quant", "fp8-block128", "--role", "trainer", "--rank", "0"},
                {"qkv_proj.weight"});
  ExpectRefused({"demo", "--model", fp8, "--quant", "fp8"}, {"--quant"});
  ExpectRefused({"plan", "--model", fp8, "--trainer", "fsdp=2", "--rollout", "dp=1,tp=2,pp=1",
                 "--svg", "{DIR}/out/fp8.svg"},
                {"--svg"});
}

}  // namespace
}  // namespace shardsync::clitest
