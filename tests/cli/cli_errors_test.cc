// Bad input, every command: exit 2 (or the documented code), nothing on stdout, a message on
// stderr naming the flag / field / tensor at fault, no output file created, no crash, no hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "cli/cli_harness.h"

namespace shardsync::clitest {
namespace {

struct BadCase {
  std::string name;                           // gtest name suffix
  std::vector<std::string> args;              // {DIR} expands to the fixture directory
  std::vector<std::string> mentions;          // each must appear in stderr (case-insensitive)
  std::vector<std::string> not_created = {};  // output paths that must not exist afterwards
  int code = 2;
  std::map<std::string, std::string> env = {};
};

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class BadInvocation : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInvocation, RejectsCleanly) {
  const BadCase& c = GetParam();
  const Fixtures& fx = Fixtures::Get();
  std::vector<std::string> args;
  for (const auto& a : c.args) args.push_back(fx.Expand(a));
  std::vector<fs::path> outputs;
  for (const auto& p : c.not_created) {
    outputs.emplace_back(fx.Expand(p));
    fs::remove(outputs.back());
  }
  RunOptions opt;
  opt.env = c.env;
  const CliResult r = RunCli(args, opt);
  std::string cmdline = "shardsync";
  for (const auto& a : args) cmdline += " '" + a + "'";
  SCOPED_TRACE(cmdline + "\n" + r.Describe());
  ASSERT_FALSE(r.timed_out) << "hang";
  ASSERT_EQ(r.term_signal, 0) << "crash";
  EXPECT_EQ(r.exit_code, c.code);
  EXPECT_EQ(r.out, "") << "bad input must write nothing to stdout";
  EXPECT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << "uncaught exception";
  const std::string err = Lower(r.err);
  for (const auto& m : c.mentions) {
    EXPECT_NE(err.find(Lower(fx.Expand(m))), std::string::npos)
        << "stderr does not name '" << m << "'";
  }
  for (const auto& p : outputs) EXPECT_FALSE(fs::exists(p)) << p << " was created";
}

std::string CaseName(const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; }

#define SS_BAD_SUITE(suite, table) \
  INSTANTIATE_TEST_SUITE_P(suite, BadInvocation, ::testing::ValuesIn(table), CaseName)

// ---------------------------------------------------------------- top level
const std::vector<BadCase> kTopLevel = {
    {"no_subcommand", {}, {"subcommand"}},
    {"unknown_subcommand", {"frobnicate"}, {"frobnicate"}},
    {"unknown_global_flag", {"--frobnicate"}, {"subcommand"}},
    {"version_extra_arg", {"version", "extra"}, {"extra"}},
};
SS_BAD_SUITE(TopLevel, kTopLevel);

// ---------------------------------------------------------------- knobs (docs/environment.md)
// A malformed environment knob: `config --dump` and every other command exit 2 naming the knob
// and the value, before doing anything.
const std::vector<BadCase> kKnobs = {
    {"config_without_dump", {"config"}, {"--dump"}},
    {"config_int_not_a_number",
     {"config", "--dump"},
     {"SHARDSYNC_CHUNK_KIB='abc'", "not an integer"},
     {},
     2,
     {{"SHARDSYNC_CHUNK_KIB", "abc"}}},
    {"config_int_negative",
     {"config", "--dump", "--json"},
     {"SHARDSYNC_CHUNK_KIB='-5'", "out of range"},
     {},
     2,
     {{"SHARDSYNC_CHUNK_KIB", "-5"}}},
    {"config_int_exponent",
     {"config", "--dump"},
     {"SHARDSYNC_CHUNK_KIB='1e9'"},
     {},
     2,
     {{"SHARDSYNC_CHUNK_KIB", "1e9"}}},
    {"config_int_out_of_range",
     {"config", "--dump"},
     {"SHARDSYNC_CHUNK_KIB='1000000000'", "4..1048576"},
     {},
     2,
     {{"SHARDSYNC_CHUNK_KIB", "1000000000"}}},
    {"config_bool_maybe",
     {"config", "--dump"},
     {"SHARDSYNC_FP8_OVERLAP='maybe'", "0 or 1"},
     {},
     2,
     {{"SHARDSYNC_FP8_OVERLAP", "maybe"}}},
    {"config_choice",
     {"config", "--dump"},
     {"SHARDSYNC_TRACE='verbose'", "buffered"},
     {},
     2,
     {{"SHARDSYNC_TRACE", "verbose"}}},
    {"config_third_party_rank", {"config", "--dump"}, {"RANK='-1'"}, {}, 2, {{"RANK", "-1"}}},
    {"version_refuses_malformed_knob",
     {"version"},
     {"SHARDSYNC_FP8_STAGES='9'", "0..4"},
     {},
     2,
     {{"SHARDSYNC_FP8_STAGES", "9"}}},
    {"layout_refuses_malformed_knob",
     {"layout", "--dp", "1", "--tp", "2", "--engine", "sglang", "--gpus-per-node", "2"},
     {"SHARDSYNC_VERDICT_BOARD='maybe'"},
     {},
     2,
     {{"SHARDSYNC_VERDICT_BOARD", "maybe"}}},
};
SS_BAD_SUITE(Knobs, kKnobs);

// ---------------------------------------------------------------- layout
std::vector<std::string> Layout(std::vector<std::string> extra) {
  std::vector<std::string> a = {"layout"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}
const std::vector<BadCase> kLayout = {
    {"missing_dp", Layout({"--gpus-per-node", "8", "--engine", "sglang"}), {"--dp"}},
    {"missing_engine", Layout({"--gpus-per-node", "8", "--dp", "8"}), {"--engine"}},
    {"missing_gpus", Layout({"--dp", "1", "--engine", "sglang"}), {"--gpus-per-node"}},
    {"unknown_engine",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "trtllm"}),
     {"--engine", "trtllm"}},
    {"dp_zero", Layout({"--gpus-per-node", "8", "--dp", "0", "--engine", "sglang"}), {"--dp"}},
    {"dp_negative", Layout({"--gpus-per-node", "8", "--dp", "-2", "--engine", "sglang"}), {"--dp"}},
    {"dp_not_a_number",
     Layout({"--gpus-per-node", "8", "--dp", "two", "--engine", "sglang"}),
     {"--dp"}},
    {"tp_zero",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--tp", "0", "--engine", "sglang"}),
     {"--tp"}},
    {"pp_negative",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--pp", "-1", "--engine", "vllm"}),
     {"--pp"}},
    {"gpus_per_node_zero",
     Layout({"--gpus-per-node", "0", "--dp", "1", "--engine", "sglang"}),
     {"--gpus-per-node"}},
    {"gpus_per_node_overflow",
     Layout({"--gpus-per-node", "99999999999", "--dp", "1", "--engine", "sglang"}),
     {"--gpus-per-node"}},
    {"nodes_zero",
     Layout({"--nodes", "0", "--gpus-per-node", "8", "--dp", "1", "--engine", "sglang"}),
     {"--nodes"}},
    {"product_mismatch",
     Layout({"--gpus-per-node", "8", "--dp", "3", "--engine", "sglang"}),
     {"--dp"}},
    {"rollout_gpus_mismatch",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "sglang", "--rollout-gpus", "4"}),
     {"--rollout-gpus"}},
    {"nodes_disagree_with_list",
     Layout({"--nodes", "3", "--gpus-per-node-list", "4,4", "--dp", "2", "--tp", "4", "--engine",
             "sglang"}),
     {"--nodes", "--gpus-per-node-list"}},
    {"list_with_zero",
     Layout({"--gpus-per-node-list", "4,0", "--dp", "1", "--tp", "4", "--engine", "sglang"}),
     {"--gpus-per-node-list"}},
    {"list_not_numbers",
     Layout({"--gpus-per-node-list", "4,x", "--dp", "1", "--tp", "4", "--engine", "sglang"}),
     {"--gpus-per-node-list"}},
    // CLI11's delimiter would drop the empty entry and plan 2 nodes instead of rejecting it.
    {"list_empty_entry",
     Layout({"--gpus-per-node-list", "8,,8", "--dp", "2", "--tp", "8", "--engine", "sglang"}),
     {"--gpus-per-node-list"}},
    {"list_trailing_comma",
     Layout({"--gpus-per-node-list", "8,8,", "--dp", "2", "--tp", "8", "--engine", "sglang"}),
     {"--gpus-per-node-list"}},
    {"list_empty",
     Layout({"--gpus-per-node-list", "", "--dp", "2", "--tp", "8", "--engine", "sglang"}),
     {"--gpus-per-node-list"}},
    {"list_and_gpus_per_node",
     Layout({"--gpus-per-node-list", "4,4", "--gpus-per-node", "4", "--dp", "2", "--engine",
             "sglang"}),
     {"--gpus-per-node"}},
    {"replica_straddles_node",
     Layout(
         {"--nodes", "2", "--gpus-per-node", "4", "--dp", "1", "--tp", "8", "--engine", "sglang"}),
     {"--allow-multinode"}},
    {"gpu_id_step_collision",
     Layout({"--gpus-per-node", "4", "--dp", "1", "--tp", "2", "--pp", "2", "--gpu-id-step", "2",
             "--engine", "sglang"}),
     {"--gpu-id-step"}},
    {"vllm_base_gpu_id",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "vllm", "--base-gpu-id", "1"}),
     {"--base-gpu-id"}},
    {"base_gpu_id_negative",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "sglang", "--base-gpu-id", "-1"}),
     {"--base-gpu-id"}},
    {"trainer_world_zero",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "sglang", "--trainer-world", "0"}),
     {"--trainer-world"}},
    {"unknown_format",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "sglang", "--format", "yaml"}),
     {"--format", "yaml"}},
    {"format_engine_mismatch",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "vllm", "--format", "sglang-launch"}),
     {"--format"}},
    {"format_and_json",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "sglang", "--json", "--format",
             "sglang-launch"}),
     {"--format"}},
    {"unknown_flag",
     Layout({"--gpus-per-node", "8", "--dp", "8", "--engine", "sglang", "--bogus"}),
     {"--bogus"}},
};
SS_BAD_SUITE(Layout, kLayout);

// ---------------------------------------------------------------- shards
std::vector<std::string> Shards(std::vector<std::string> extra,
                                const std::string& model = "{DIR}/tiny/config.json") {
  std::vector<std::string> a = {"shards", "--model", model, "--engine", "sglang"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}
const std::vector<BadCase> kShards = {
    {"missing_model", {"shards", "--engine", "sglang"}, {"--model"}},
    {"missing_engine", {"shards", "--model", "{DIR}/tiny/config.json"}, {"--engine"}},
    {"unknown_engine",
     {"shards", "--model", "{DIR}/tiny/config.json", "--engine", "tgi"},
     {"--engine", "tgi"}},
    {"model_path_missing", Shards({}, "{DIR}/nope/config.json"), {"{DIR}/nope"}},
    {"model_unknown_name", Shards({}, "qwen9-1t"), {"qwen9-1t"}},
    {"model_dir_without_config", Shards({}, "{DIR}/emptydir"), {"config.json"}},
    {"config_not_json", Shards({}, "{DIR}/notjson/config.json"), {"{DIR}/notjson/config.json"}},
    {"config_missing_hidden", Shards({}, "{DIR}/nohidden/config.json"), {"hidden_size"}},
    {"config_string_hidden", Shards({}, "{DIR}/strhidden/config.json"), {"hidden_size"}},
    {"config_negative_layers", Shards({}, "{DIR}/neglayers/config.json"), {"num_hidden_layers"}},
    {"config_unknown_arch", Shards({}, "{DIR}/badarch/config.json"), {"FrobnicatorForCausalLM"}},
    {"config_top_level_array", Shards({}, "{DIR}/toparray/config.json"), {"object"}},
    {"config_kv_heads_not_dividing",
     Shards({}, "{DIR}/kvnotdiv/config.json"),
     {"num_key_value_heads"}},
    {"config_vocab_overflow", Shards({}, "{DIR}/hugevocab/config.json"), {"vocab_size"}},
    {"config_tied_not_bool", Shards({}, "{DIR}/tiedstr/config.json"), {"tie_word_embeddings"}},
    {"config_moe_topk_above_experts",
     Shards({}, "{DIR}/moetopk/config.json"),
     {"num_experts_per_tok"}},
    {"tp_not_dividing_heads", Shards({"--tp", "3"}), {"--tp", "num_attention_heads"}},
    {"tp_above_heads", Shards({"--tp", "8"}), {"--tp", "num_attention_heads"}},
    {"tp_zero", Shards({"--tp", "0"}), {"--tp"}},
    {"tp_negative", Shards({"--tp", "-2"}), {"--tp"}},
    {"tp_not_a_number", Shards({"--tp", "2x"}), {"--tp"}},
    {"pp_above_layers", Shards({"--pp", "3"}), {"--pp", "num_hidden_layers"}},
    {"pp_zero", Shards({"--pp", "0"}), {"--pp"}},
    {"pp_partition_wrong_length",
     Shards({"--pp", "2", "--pp-partition", "1,1,0"}),
     {"--pp-partition"}},
    {"pp_partition_wrong_sum", Shards({"--pp", "2", "--pp-partition", "1,2"}), {"--pp-partition"}},
    {"pp_partition_empty_stage",
     Shards({"--pp", "2", "--pp-partition", "2,0"}),
     {"--pp-partition", "positive"}},
    {"pp_partition_not_numbers",
     Shards({"--pp", "2", "--pp-partition", "a,b"}),
     {"--pp-partition"}},
    {"ep_on_dense_model", Shards({"--tp", "2", "--ep", "2"}), {"--ep"}},
    {"ep_zero", Shards({"--ep", "0"}), {"--ep"}},
    {"rank_outside", Shards({"--tp", "2", "--rank", "2,0"}), {"--rank"}},
    {"rank_malformed", Shards({"--tp", "2", "--rank", "1"}), {"--rank"}},
    {"rank_trailing_garbage", Shards({"--tp", "2", "--rank", "1,0x"}), {"--rank"}},
    {"explain_unknown_param",
     Shards({"--explain", "model.layers.0.nonexistent.weight"}),
     {"model.layers.0.nonexistent.weight"}},
    // Explicitly empty values are errors, not "flag absent".
    {"explain_empty", Shards({"--explain", ""}), {"--explain"}},
    {"rank_empty", Shards({"--rank", ""}), {"--rank"}},
    {"pp_partition_empty", Shards({"--pp-partition", ""}), {"--pp-partition"}},
    {"explain_and_json", Shards({"--json", "--explain", "lm_head.weight"}), {"--explain"}},
    // --trainer: trainer ranks instead of engine ranks.
    {"trainer_and_engine", Shards({"--trainer", "megatron=tp=2"}), {"--engine", "--trainer"}},
    {"trainer_bad_field",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=2,zz=1"},
     {"--trainer megatron", "zz"}},
    {"trainer_tp_not_dividing_heads",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=3"},
     {"--trainer megatron=tp=3", "num_attention_heads"}},
    {"trainer_pp_not_dividing_layers",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=1,pp=3"},
     {"--trainer", "pp"}},
    {"trainer_local_spec_with_cp",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=2,cp=2,norms=local"},
     {"--trainer megatron=tp=2,pp=1,cp=2,norms=local cp", "DotProductAttention"}},
    {"trainer_glu_interleave_dense",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=2,glu_interleave=8"},
     {"glu_interleave", "no MoE layers"}},
    {"trainer_with_engine_flag",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=2", "--tp", "2"},
     {"--tp", "--trainer"}},
    {"trainer_rank_outside",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=2", "--rank", "2"},
     {"--rank"}},
    {"trainer_rank_malformed",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=2", "--rank", "1,0"},
     {"--rank"}},
    {"trainer_explain_unknown",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=2", "--explain",
      "decoder.layers.9.nothing"},
     {"decoder.layers.9.nothing"}},
    {"trainer_dtype_unknown",
     {"shards", "--model", "{DIR}/tiny/config.json", "--trainer", "megatron=tp=2",
      "--trainer-dtype", "fp7"},
     {"--trainer-dtype"}},
};
SS_BAD_SUITE(Shards, kShards);

// ---------------------------------------------------------------- plan
std::vector<std::string> Plan(std::vector<std::string> extra, const std::string& trainer = "fsdp=2",
                              const std::string& rollout = "dp=1,tp=2,pp=1") {
  std::vector<std::string> a = {
      "plan", "--model", "{DIR}/tiny/config.json", "--trainer", trainer, "--rollout", rollout};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}
const std::vector<std::string> kPlanOut = {"{DIR}/out/plan.ops.jsonl", "{DIR}/out/plan.svg"};
std::vector<std::string> WithOutputs(std::vector<std::string> a) {
  a.insert(a.end(), {"--dump-ops", kPlanOut[0], "--svg", kPlanOut[1]});
  return a;
}
const std::vector<BadCase> kPlan = {
    {"missing_model", {"plan", "--trainer", "fsdp=2", "--rollout", "dp=1,tp=2,pp=1"}, {"--model"}},
    {"missing_trainer",
     {"plan", "--model", "{DIR}/tiny/config.json", "--rollout", "dp=1,tp=2,pp=1"},
     {"--trainer"}},
    {"missing_rollout",
     {"plan", "--model", "{DIR}/tiny/config.json", "--trainer", "fsdp=2"},
     {"--rollout"}},
    {"model_path_missing",
     WithOutputs({"plan", "--model", "{DIR}/nope/config.json", "--trainer", "fsdp=2", "--rollout",
                  "dp=1,tp=2,pp=1"}),
     {"{DIR}/nope"},
     kPlanOut},
    {"config_missing_hidden",
     WithOutputs({"plan", "--model", "{DIR}/nohidden/config.json", "--trainer", "fsdp=2",
                  "--rollout", "dp=1,tp=2,pp=1"}),
     {"hidden_size"},
     kPlanOut},
    {"trainer_fsdp_zero", WithOutputs(Plan({}, "fsdp=0")), {"--trainer"}, kPlanOut},
    {"trainer_fsdp_negative", WithOutputs(Plan({}, "fsdp=-4")), {"--trainer"}, kPlanOut},
    {"trainer_fsdp_not_a_number", WithOutputs(Plan({}, "fsdp=four")), {"--trainer"}, kPlanOut},
    {"trainer_hsdp_no_x", WithOutputs(Plan({}, "hsdp=2")), {"--trainer"}, kPlanOut},
    {"trainer_hsdp_zero", WithOutputs(Plan({}, "hsdp=0x2")), {"--trainer"}, kPlanOut},
    {"trainer_unknown_kind", WithOutputs(Plan({}, "zero3=2")), {"--trainer", "zero3"}, kPlanOut},
    {"trainer_empty", WithOutputs(Plan({}, "")), {"--trainer"}, kPlanOut},
    {"rollout_dp_zero",
     WithOutputs(Plan({}, "fsdp=2", "dp=0,tp=2,pp=1")),
     {"--rollout dp"},
     kPlanOut},
    {"rollout_field_twice",
     WithOutputs(Plan({}, "fsdp=2", "dp=1,tp=2,tp=1")),
     {"--rollout", "tp"},
     kPlanOut},
    {"rollout_empty", WithOutputs(Plan({}, "fsdp=2", "")), {"--rollout"}, kPlanOut},
    {"rollout_unknown_key",
     WithOutputs(Plan({}, "fsdp=2", "dp=1,tp=2,xx=3")),
     {"--rollout", "xx"},
     kPlanOut},
    {"rollout_not_a_number",
     WithOutputs(Plan({}, "fsdp=2", "dp=1,tp=two")),
     {"--rollout tp", "two"},
     kPlanOut},
    {"rollout_tp_not_dividing_heads",
     WithOutputs(Plan({}, "fsdp=2", "dp=1,tp=3,pp=1")),
     {"num_attention_heads"},
     kPlanOut},
    {"rollout_pp_above_layers",
     WithOutputs(Plan({}, "fsdp=2", "dp=1,tp=1,pp=3")),
     {"num_hidden_layers"},
     kPlanOut},
    {"rollout_ep_on_dense",
     WithOutputs(Plan({}, "fsdp=2", "dp=1,tp=2,pp=1,ep=2")),
     {"ep 2", "experts"},
     kPlanOut},
    {"unknown_engine", WithOutputs(Plan({"--engine", "tgi"})), {"--engine", "tgi"}, kPlanOut},
    {"dump_ops_empty_name", Plan({"--dump-ops", ""}), {"--dump-ops"}},
    {"svg_unwritable_writes_no_ops",
     Plan({"--dump-ops", kPlanOut[0], "--svg", "/nonexistent-dir/x.svg"}),
     {"--svg"},
     kPlanOut},
    {"pp_partition_not_numbers",
     WithOutputs(Plan({"--pp-partition", "1,x"}, "fsdp=2", "dp=1,tp=1,pp=2")),
     {"--pp-partition"},
     kPlanOut},
    {"pp_partition_wrong_sum",
     WithOutputs(Plan({"--pp-partition", "1,2"}, "fsdp=2", "dp=1,tp=1,pp=2")),
     {"--pp-partition", "num_hidden_layers"},
     kPlanOut},
    {"nodes_too_few",
     WithOutputs(Plan({"--nodes", "1", "--gpus-per-node", "1"})),
     {"--nodes"},
     kPlanOut},
    {"gpus_per_node_zero",
     WithOutputs(Plan({"--gpus-per-node", "0"})),
     {"--gpus-per-node"},
     kPlanOut},
    {"rank_outside_world",
     Plan({"--dump-ops", kPlanOut[0], "--rank", "99"}),
     {"--rank", "99"},
     kPlanOut},
    {"rank_negative",
     Plan({"--dump-ops", kPlanOut[0], "--rank", "-1"}),
     {"--rank", "-1"},
     kPlanOut},
    {"rank_without_dump_ops", Plan({"--rank", "0"}), {"--rank", "--dump-ops"}},
    {"wire_dtype_int", WithOutputs(Plan({"--wire-dtype", "int8"})), {"--wire-dtype"}, kPlanOut},
    {"wire_dtype_unknown", WithOutputs(Plan({"--wire-dtype", "fp7"})), {"--wire-dtype"}, kPlanOut},
    {"trainer_dtype_unknown",
     WithOutputs(Plan({"--trainer-dtype", "fp7"})),
     {"--trainer-dtype"},
     kPlanOut},
    {"bucket_mb_zero", WithOutputs(Plan({"--bucket-mb", "0"})), {"--bucket-mb"}, kPlanOut},
    {"bucket_mb_negative", WithOutputs(Plan({"--bucket-mb", "-5"})), {"--bucket-mb"}, kPlanOut},
    {"bucket_mb_too_big", WithOutputs(Plan({"--bucket-mb", "2000000"})), {"--bucket-mb"}, kPlanOut},
    {"bucket_mb_not_a_number",
     WithOutputs(Plan({"--bucket-mb", "lots"})),
     {"--bucket-mb"},
     kPlanOut},
    {"megatron_unknown_field",
     WithOutputs(Plan({}, "megatron=tp=2,wp=2")),
     {"--trainer megatron", "wp"},
     kPlanOut},
    {"megatron_vpp_without_pp",
     WithOutputs(Plan({}, "megatron=tp=2,vpp=2")),
     {"--trainer megatron", "vpp"},
     kPlanOut},
    {"megatron_ep_not_fitting_world",
     WithOutputs(Plan({}, "megatron=tp=2,ep=4")),
     {"--trainer megatron", "ep"},
     kPlanOut},
    {"megatron_tp_not_dividing_heads",
     WithOutputs(Plan({}, "megatron=tp=8")),
     {"--trainer megatron=tp=8", "num_attention_heads"},
     kPlanOut},
};
SS_BAD_SUITE(Plan, kPlan);

// ---------------------------------------------------------------- store
const std::vector<BadCase> kStore = {
    // Tokens shorter than 16 characters are refused before anything is served.
    {"token_too_short", {"store", "--bind", "127.0.0.1:0", "--token", "short"}, {"--token"}},
    {"token_env_too_short",
     {"store", "--bind", "127.0.0.1:0"},
     {"SHARDSYNC_TOKEN", "16"},
     {},
     2,
     {{"SHARDSYNC_TOKEN", "t"}}},
    {"token_file_exists",
     {"store", "--bind", "127.0.0.1:0", "--token-file", "{DIR}/tiny/config.json"},
     {"--token-file", "already exists"}},
    {"bind_no_port",
     {"store", "--bind", "127.0.0.1"},
     {"--bind"},
     {},
     2,
     {{"SHARDSYNC_TOKEN", "test-token-0123456789"}}},
    {"bind_port_out_of_range",
     {"store", "--bind", "127.0.0.1:99999"},
     {"--bind"},
     {},
     2,
     {{"SHARDSYNC_TOKEN", "test-token-0123456789"}}},
    {"bind_port_not_a_number",
     {"store", "--bind", "127.0.0.1:http"},
     {"--bind"},
     {},
     2,
     {{"SHARDSYNC_TOKEN", "test-token-0123456789"}}},
    {"bind_empty",
     {"store", "--bind", ""},
     {"--bind"},
     {},
     2,
     {{"SHARDSYNC_TOKEN", "test-token-0123456789"}}},
};
SS_BAD_SUITE(Store, kStore);

// ---------------------------------------------------------------- run / demo / bench job flags
// `extra` is FLAG VALUE pairs; a flag given there replaces the default of the same name (CLI11
// rejects a repeated option, which would hide the error under test).
std::vector<std::string> Job(const std::string& cmd, std::vector<std::string> extra) {
  std::vector<std::pair<std::string, std::string>> flags = {{"--model", "{DIR}/tiny/config.json"},
                                                            {"--trainer", "fsdp=2"},
                                                            {"--rollout", "dp=1,tp=2,pp=1"},
                                                            {"--transport", "loopback"}};
  if (cmd == "run") {
    flags.insert(flags.end(), {{"--role", "trainer"},
                               {"--rank", "0"},
                               {"--store", "127.0.0.1:1"},
                               {"--token", "test-token-0123456789"},
                               {"--timeout-ms", "2000"}});
  }
  for (size_t i = 0; i + 1 < extra.size(); i += 2) {
    bool replaced = false;
    for (auto& f : flags) {
      if (f.first == extra[i]) {
        f.second = extra[i + 1];
        replaced = true;
      }
    }
    if (!replaced) flags.emplace_back(extra[i], extra[i + 1]);
  }
  std::vector<std::string> a = {cmd};
  for (const auto& [k, v] : flags) a.insert(a.end(), {k, v});
  return a;
}
std::vector<std::string> Emulated(std::vector<std::string> args) {
  args.push_back("--emulate-nodes");
  return args;
}
// Flag errors every job command shares (validated before any rank starts).
std::vector<BadCase> JobCases(const std::string& cmd) {
  return {
      {cmd + "_model_path_missing",
       Job(cmd, {"--model", "{DIR}/nope/config.json"}),
       {"{DIR}/nope"}},
      {cmd + "_config_unknown_arch",
       Job(cmd, {"--model", "{DIR}/badarch/config.json"}),
       {"FrobnicatorForCausalLM"}},
      {cmd + "_trainer_fsdp_zero", Job(cmd, {"--trainer", "fsdp=0"}), {"--trainer"}},
      {cmd + "_trainer_unknown_kind", Job(cmd, {"--trainer", "zero3=2"}), {"--trainer"}},
      {cmd + "_trainer_megatron_bad_field",
       Job(cmd, {"--trainer", "megatron=tp=2,foo=1"}),
       {"--trainer megatron", "foo"}},
      {cmd + "_trainer_megatron_not_fitting_model",
       Job(cmd, {"--trainer", "megatron=tp=3"}),
       {"--trainer megatron=tp=3", "num_attention_heads"}},
      {cmd + "_rollout_tp_not_dividing_heads",
       Job(cmd, {"--rollout", "dp=1,tp=3,pp=1"}),
       {"num_attention_heads"}},
      {cmd + "_rollout_malformed", Job(cmd, {"--rollout", "dp=1;tp=2"}), {"--rollout"}},
      {cmd + "_unknown_engine", Job(cmd, {"--engine", "tgi"}), {"--engine"}},
      {cmd + "_pp_partition_not_numbers",
       Job(cmd, {"--rollout", "dp=1,tp=1,pp=2", "--pp-partition", "1,x"}),
       {"--pp-partition"}},
      {cmd + "_wire_dtype_unknown", Job(cmd, {"--wire-dtype", "fp7"}), {"--wire-dtype"}},
      {cmd + "_bucket_mb_zero", Job(cmd, {"--bucket-mb", "0"}), {"--bucket-mb"}},
      {cmd + "_syncs_zero", Job(cmd, {"--syncs", "0"}), {"--syncs"}},
      {cmd + "_transport_unknown", Job(cmd, {"--transport", "carrier-pigeon"}), {"--transport"}},
      {cmd + "_timeout_zero", Job(cmd, {"--timeout-ms", "0"}), {"--timeout-ms"}},
      {cmd + "_mode_unknown", Job(cmd, {"--mode", "turbo"}), {"--mode"}},
      {cmd + "_reps_not_a_number", Job(cmd, {"--reps", "many"}), {"--reps"}},
  };
}
std::vector<BadCase> Concat(std::vector<BadCase> a, const std::vector<BadCase>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const std::vector<BadCase> kRun = Concat(
    JobCases("run"),
    {
        {"missing_role", {"run", "--model", "{DIR}/tiny/config.json", "--rank", "0"}, {"--role"}},
        {"unknown_role", Job("run", {"--role", "observer"}), {"--role"}},
        {"role_mismatch", Job("run", {"--role", "engine"}), {"--role"}},
        {"rank_outside_world", Job("run", {"--rank", "99"}), {"rank=99"}},
        {"rank_negative", Job("run", {"--rank", "-1"}), {"rank=-1"}},
        {"store_missing",
         {"run", "--model", "{DIR}/tiny/config.json", "--trainer", "fsdp=2", "--rollout",
          "dp=1,tp=2,pp=1", "--role", "trainer", "--rank", "0", "--token", "test-token-0123456789"},
         {"SHARDSYNC_STORE"}},
        {"token_missing",
         {"run", "--model", "{DIR}/tiny/config.json", "--trainer", "fsdp=2", "--rollout",
          "dp=1,tp=2,pp=1", "--role", "trainer", "--rank", "0", "--store", "127.0.0.1:1"},
         {"SHARDSYNC_TOKEN"}},
        {"store_malformed", Job("run", {"--store", "nohostport"}), {"SHARDSYNC_STORE"}},
        {"rank_env_not_a_number",
         {"run", "--model", "{DIR}/tiny/config.json", "--trainer", "fsdp=2", "--rollout",
          "dp=1,tp=2,pp=1", "--role", "trainer", "--store", "127.0.0.1:1", "--token",
          "test-token-0123456789"},
         {"RANK"},
         {},
         2,
         {{"RANK", "zero"}}},
        // Issue 26: an absurd but valid config is refused before the rank allocates (it used to
        // abort on bad_alloc), trainer and engine ranks alike.
        {"absurd_config_trainer",
         Job("run", {"--model", "{DIR}/absurd/config.json", "--trainer", "fsdp=1", "--rollout",
                     "dp=1,tp=1,pp=1", "--transport", "shm"}),
         {"--model", "sync rank 0", "more than"}},
        {"absurd_config_engine",
         Job("run", {"--model", "{DIR}/absurd/config.json", "--trainer", "fsdp=1", "--rollout",
                     "dp=1,tp=1,pp=1", "--transport", "shm", "--role", "engine", "--rank", "1"}),
         {"--model", "sync rank 1", "parameters", "more than"}},
    });
SS_BAD_SUITE(Run, kRun);

const std::vector<BadCase> kDemo =
    Concat(JobCases("demo"),
           {
               {"job_timeout_zero", Job("demo", {"--job-timeout-s", "0"}), {"--job-timeout-s"}},
               {"gen_tokens_negative", Job("demo", {"--gen-tokens", "-1"}), {"--gen-tokens"}},
               {"gen_tokens_too_many", Job("demo", {"--gen-tokens", "100000"}), {"--gen-tokens"}},
               {"launch_unknown", Job("demo", {"--launch", "rockets"}), {"--launch"}},
               // --emulate-nodes needs rank processes on a transport that routes by host.
               {"emulate_nodes_threads",
                Emulated(Job("demo", {"--transport", "ucx", "--launch", "threads"})),
                {"--emulate-nodes", "threads"}},
               {"emulate_nodes_shm",
                Emulated(Job("demo", {"--transport", "shm"})),
                {"--emulate-nodes", "--transport shm", "--device cuda"}},
               // Issue 26: refused before a rank starts (ranks used to abort on bad_alloc).
               {"absurd_config",
                Job("demo", {"--model", "{DIR}/absurd/config.json", "--trainer", "fsdp=1",
                             "--rollout", "dp=1,tp=1,pp=1"}),
                {"--model", "more than"}},
           });
SS_BAD_SUITE(Demo, kDemo);

const std::vector<BadCase> kBench = Concat(
    JobCases("bench"),
    {
        {"job_timeout_zero", Job("bench", {"--job-timeout-s", "0"}), {"--job-timeout-s"}},
        {"device_unknown", Job("bench", {"--device", "tpu"}), {"--device"}},
        {"launch_unknown", Job("bench", {"--launch", "rockets"}), {"--launch"}},
        {"emulate_nodes_loopback", Emulated(Job("bench", {})), {"--emulate-nodes", "threads"}},
        {"emulate_nodes_host_auto",
         Emulated(Job("bench", {"--transport", "auto"})),
         {"--emulate-nodes", "--transport ucx"}},
        {"emulate_nodes_kill_rank_shm",
         Emulated(Job("bench", {"--transport", "shm", "--kill-rank", "1"})),
         {"--emulate-nodes", "--transport shm"}},
    });
SS_BAD_SUITE(Bench, kBench);

// ---------------------------------------------------------------- generate
std::vector<std::string> Gen(std::vector<std::string> extra) {
  std::vector<std::string> a = {"generate", "--model", "{DIR}/tiny/config.json", "--max-new-tokens",
                                "1"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}
const std::vector<BadCase> kGenerate = {
    {"neither_weights_nor_model", {"generate"}, {"--weights", "--model"}},
    {"both_weights_and_model",
     {"generate", "--model", "{DIR}/tiny/config.json", "--weights", "{DIR}/w_garbage"},
     {"--weights", "--model"}},
    {"seed_with_weights", {"generate", "--weights", "{DIR}/w_garbage", "--seed", "3"}, {"--seed"}},
    {"model_path_missing", {"generate", "--model", "{DIR}/nope/config.json"}, {"{DIR}/nope"}},
    {"config_not_json",
     {"generate", "--model", "{DIR}/notjson/config.json"},
     {"{DIR}/notjson/config.json"}},
    {"config_missing_hidden",
     {"generate", "--model", "{DIR}/nohidden/config.json"},
     {"hidden_size"}},
    {"max_new_tokens_negative", Gen({"--max-new-tokens", "-1"}), {"--max-new-tokens"}},
    {"max_new_tokens_too_many", Gen({"--max-new-tokens", "5000"}), {"--max-new-tokens"}},
    {"max_new_tokens_not_a_number", Gen({"--max-new-tokens", "few"}), {"--max-new-tokens"}},
    {"prompt_ids_not_numbers", Gen({"--prompt-ids", "1,x,3"}), {"--prompt-ids"}},
    {"prompt_ids_negative", Gen({"--prompt-ids", "1,-3"}), {"--prompt-ids"}},
    {"prompt_ids_empty_entry", Gen({"--prompt-ids", "1,,3"}), {"--prompt-ids"}},
    {"prompt_ids_empty", Gen({"--prompt-ids", ""}), {"--prompt-ids"}},
    {"seed_negative", Gen({"--seed", "-1"}), {"--seed"}},
    {"prompt_id_outside_vocab", Gen({"--prompt-ids", "1,200"}), {"--prompt-ids", "200"}},
    {"prompt_id_overflow", Gen({"--prompt-ids", "99999999999999999999"}), {"--prompt-ids"}},
    {"tp_without_engine", Gen({"--tp", "2"}), {"--engine"}},
    {"engine_dump_without_engine", Gen({"--engine-dump", "{DIR}/nope"}), {"--engine-dump"}},
    {"engine_dump_missing",
     Gen({"--engine", "sglang", "--tp", "2", "--engine-dump", "{DIR}/nope"}),
     {"--engine-dump", "{DIR}/nope"}},
    {"unknown_engine", Gen({"--engine", "tgi"}), {"--engine"}},
    {"tp_not_dividing_heads", Gen({"--engine", "sglang", "--tp", "3"}), {"num_attention_heads"}},
    {"tp_zero", Gen({"--engine", "sglang", "--tp", "0"}), {"--tp"}},
    {"pp_above_layers", Gen({"--engine", "vllm", "--pp", "3"}), {"num_hidden_layers"}},
    {"pp_partition_wrong_sum",
     Gen({"--engine", "sglang", "--pp", "2", "--pp-partition", "1,2"}),
     {"--pp-partition"}},
    {"pp_partition_not_numbers",
     Gen({"--engine", "sglang", "--pp", "2", "--pp-partition", "1,y"}),
     {"--pp-partition"}},
    {"ep_on_dense_model", Gen({"--engine", "sglang", "--tp", "2", "--ep", "2"}), {"--ep"}},
    {"weights_path_missing", {"generate", "--weights", "{DIR}/nope"}, {"{DIR}/nope"}},
    {"weights_dir_without_checkpoint",
     {"generate", "--weights", "{DIR}/emptydir"},
     {"model.safetensors"}},
    {"weights_missing_config", {"generate", "--weights", "{DIR}/w_noconfig"}, {"config.json"}},
    {"weights_bad_config", {"generate", "--weights", "{DIR}/w_badconfig"}, {"config.json"}},
    {"weights_missing_tensors",
     {"generate", "--weights", "{DIR}/w_incomplete"},
     {"model.embed_tokens.weight"}},
    {"weights_garbage", {"generate", "--weights", "{DIR}/w_garbage"}, {"model.safetensors"}},
    {"weights_truncated",
     {"generate", "--weights", "{DIR}/w_truncated"},
     {"--weights", "a.weight"}},
    {"weights_garbage_file",
     {"generate", "--weights", "{DIR}/garbage.safetensors"},
     {"garbage.safetensors"}},
    // Issue 26: NaN / infinity and non-float weights are refused naming the tensor (they used to
    // decode to tokens 0,0,0,0 with exit 0, and exit 1, respectively).
    {"weights_nan",
     {"generate", "--weights", "{DIR}/w_nan"},
     {"model.layers.1.mlp.down_proj.weight", "non-finite"}},
    {"weights_inf_bf16", {"generate", "--weights", "{DIR}/w_inf_bf16"}, {"model.norm.weight"}},
    {"weights_i8",
     {"generate", "--weights", "{DIR}/w_i8"},
     {"model.layers.0.self_attn.k_proj.weight", "I8"}},
    {"weights_nan_sharded",
     {"generate", "--weights", "{DIR}/w_nan", "--engine", "sglang", "--tp", "2"},
     {"model.layers.1.mlp.down_proj.weight", "non-finite"}},
    // An absurd but valid config is refused before anything is allocated (it used to abort).
    {"absurd_config", {"generate", "--model", "{DIR}/absurd/config.json"}, {"more than"}},
    {"absurd_config_sharded",
     {"generate", "--model", "{DIR}/absurd/config.json", "--engine", "sglang", "--tp", "2"},
     {"more than"}},
};
SS_BAD_SUITE(Generate, kGenerate);

// ---------------------------------------------------------------- inspect
// A truncated or corrupt file is bad input like a malformed header: exit 2, the file named,
// nothing on stdout.
const std::vector<BadCase> kInspect = {
    {"missing_path", {"inspect"}, {"path"}},
    {"path_missing", {"inspect", "{DIR}/nope.safetensors"}, {"{DIR}/nope.safetensors"}},
    {"dir_without_checkpoint", {"inspect", "{DIR}/emptydir"}, {"model.safetensors"}},
    {"header_not_json", {"inspect", "{DIR}/badjson.safetensors"}, {"badjson.safetensors"}},
    {"unknown_dtype", {"inspect", "{DIR}/baddtype.safetensors"}, {"a.weight"}},
    {"offsets_disagree_with_shape", {"inspect", "{DIR}/badoffsets.safetensors"}, {"a.weight"}},
    {"unknown_flag", {"inspect", "{DIR}/good.safetensors", "--yaml"}, {"--yaml"}},
    {"garbage_file", {"inspect", "{DIR}/garbage.safetensors"}, {"garbage.safetensors"}},
    {"shorter_than_length_prefix", {"inspect", "{DIR}/short.safetensors"}, {"short.safetensors"}},
    {"header_length_beyond_file",
     {"inspect", "{DIR}/hugelen.safetensors"},
     {"hugelen.safetensors"}},
    {"truncated_data",
     {"inspect", "{DIR}/truncated.safetensors"},
     {"a.weight", "truncated.safetensors"}},
};
SS_BAD_SUITE(Inspect, kInspect);

}  // namespace
}  // namespace shardsync::clitest
