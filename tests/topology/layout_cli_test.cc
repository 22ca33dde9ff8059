// `shardsync layout` end to end: output on good input; exit 2, empty stdout and the flag named on
// stderr for bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

namespace {

using ::testing::HasSubstr;

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

RunResult RunLayout(const std::string& args) {
  const std::string err_path =
      ::testing::TempDir() + "layout_cli_err_" + std::to_string(::getpid()) + ".txt";
  const std::string cmd =
      std::string("'") + SHARDSYNC_CLI_PATH + "' layout " + args + " 2>'" + err_path + "'";
  RunResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream f(err_path);
  std::stringstream ss;
  ss << f.rdbuf();
  r.err = ss.str();
  std::remove(err_path.c_str());
  return r;
}

TEST(LayoutCli, IssueExamplePrintsAReadableTable) {
  RunResult r = RunLayout("--nodes 2 --gpus-per-node 8 --dp 4 --tp 2 --pp 2 --engine sglang");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  EXPECT_THAT(r.out, HasSubstr("replica 3: head worker 12 on node 1"));
  EXPECT_THAT(r.out, HasSubstr("CUDA_VISIBLE_DEVICES=4,5,6,7"));
}

TEST(LayoutCli, JsonIsOneObject) {
  RunResult r = RunLayout(
      "--gpus-per-node-list 8,8,4 --dp 5 --tp 4 --engine vllm --json "
      "--trainer-world 4");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["workers"].size(), 20u);
  EXPECT_EQ(j["replicas"][4]["node"], 2);
  EXPECT_EQ(j["broadcast_world_size"], 21);
  EXPECT_EQ(j["sync"]["world_size"], 24);
}

TEST(LayoutCli, LaunchFormat) {
  RunResult r = RunLayout(
      "--nodes 1 --gpus-per-node 8 --dp 2 --tp 2 --pp 2 --engine sglang "
      "--format sglang-launch");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("CUDA_VISIBLE_DEVICES=4,5,6,7 python -m sglang.launch_server"));
}

struct BadCase {
  const char* args;
  const char* flag;
};

TEST(LayoutCli, BadInputExitsTwoWithNothingOnStdout) {
  const BadCase cases[] = {
      {"--nodes 2 --gpus-per-node 8 --dp 3 --tp 2 --pp 2 --engine sglang", "--dp"},
      {"--nodes 2 --gpus-per-node 6 --dp 3 --tp 4 --engine sglang", "--allow-multinode"},
      {"--nodes 1 --gpus-per-node 4 --dp 1 --tp 2 --pp 2 --engine sglang --gpu-id-step 2",
       "--gpu-id-step"},
      {"--nodes 1 --gpus-per-node 4 --dp 1 --tp 0 --engine sglang", "--tp"},
      {"--nodes 1 --gpus-per-node 4 --dp 1 --tp abc --engine sglang", "--tp"},
      {"--nodes 1 --gpus-per-node 4 --dp 1 --tp 4 --engine trt", "--engine"},
      {"--nodes 1 --gpus-per-node 4 --dp 1 --tp 4 --engine sglang --rollout-gpus 8",
       "--rollout-gpus"},
      {"--nodes 1 --gpus-per-node 4 --dp 1 --tp 4 --engine vllm --format sglang-launch",
       "--format"},
      {"--nodes 1 --gpus-per-node 4 --dp 1 --tp 4 --engine vllm --json --format vllm-launch",
       "--format"},
      {"--nodes 3 --gpus-per-node-list 4,4 --dp 2 --tp 4 --engine sglang", "--nodes"},
      {"--gpus-per-node-list 2,1 --dp 1 --pp 3 --engine sglang --allow-multinode", "--pp"},
      {"--dp 1 --tp 4 --engine sglang", "--gpus-per-node"},
      {"--nodes 1 --gpus-per-node 4 --tp 4 --engine sglang", "--dp"},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.args);
    RunResult r = RunLayout(c.args);
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, HasSubstr(c.flag));
  }
}

}  // namespace
