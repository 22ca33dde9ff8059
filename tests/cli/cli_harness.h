// Runs the built `shardsync` binary as a child process (stdout and stderr captured separately,
// killed after a deadline so a hang fails the test instead of hanging ctest) and writes the
// fixture files the CLI conformance tests point it at.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

extern char** environ;

namespace shardsync::clitest {

namespace fs = std::filesystem;

struct CliResult {
  int exit_code = -1;   // -1 when killed by a signal
  int term_signal = 0;  // the signal that ended it (a crash: SIGSEGV, SIGABRT, ...)
  bool timed_out = false;
  std::string out, err;
  std::string Describe() const {
    return "exit " + std::to_string(exit_code) +
           (term_signal ? " signal " + std::to_string(term_signal) : "") +
           (timed_out ? " TIMED OUT" : "") + "\n--- stdout ---\n" + out.substr(0, 2000) +
           "\n--- stderr ---\n" + err.substr(0, 2000);
  }
};

struct RunOptions {
  double timeout_s = 20;
  // Extra environment variables (the launch-contract ones are always cleared first).
  std::map<std::string, std::string> env;
  // Send SIGTERM once stdout holds a full line (for `store`, which serves until signalled).
  bool sigterm_after_first_line = false;
  // Called with the child's pid and its stdout so far, whenever stdout grows.
  std::function<void(pid_t, const std::string&)> on_stdout;
};

inline CliResult RunCli(const std::vector<std::string>& args, const RunOptions& opt = {}) {
  CliResult r;
  // Hermetic environment: a developer's SHARDSYNC_TOKEN / RANK must not change what a case means.
  static const char* kCleared[] = {"SHARDSYNC_TOKEN", "SHARDSYNC_STORE", "RANK",      "WORLD_SIZE",
                                   "SLURM_PROCID",    "SLURM_NTASKS",    "LOCAL_RANK"};
  std::vector<std::string> env_strs;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv(*e);
    const std::string key = kv.substr(0, kv.find('='));
    bool drop = opt.env.count(key) > 0;
    for (const char* c : kCleared) drop = drop || key == c;
    if (!drop) env_strs.push_back(kv);
  }
  for (const auto& [k, v] : opt.env) env_strs.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strs) envp.push_back(s.data());
  envp.push_back(nullptr);

  std::vector<std::string> argv_strs = {SHARDSYNC_CLI_PATH};
  argv_strs.insert(argv_strs.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_strs) argv.push_back(s.data());
  argv.push_back(nullptr);

  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    r.err = "harness: pipe failed";
    return r;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_pipe[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, err_pipe[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (rc != 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    r.err = std::string("harness: posix_spawn failed: ") + std::strerror(rc);
    return r;
  }
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(opt.timeout_s);
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  bool termed = false;
  while (open_fds > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      r.timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    if (poll(fds, 2, static_cast<int>(std::min<int64_t>(left, 1000))) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      char buf[65536];
      const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
        if (i == 0 && opt.on_stdout) opt.on_stdout(pid, r.out);
      } else if (n == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
    if (opt.sigterm_after_first_line && !termed && r.out.find('\n') != std::string::npos) {
      kill(pid, SIGTERM);
      termed = true;
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) close(f.fd);
  }
  int status = 0;
  // The pipes closed (or it was killed); wait with a short grace period, then SIGKILL.
  for (int i = 0; i < 500; ++i) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      pid = -1;
      break;
    }
    usleep(10000);
  }
  if (pid > 0) {
    r.timed_out = true;
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.term_signal = WTERMSIG(status);
  return r;
}

inline void WriteFile(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// A safetensors file: 8-byte little-endian header length, the JSON header, the data.
inline std::string Safetensors(const std::string& header_json, const std::string& data) {
  std::string s(8, '\0');
  uint64_t n = header_json.size();
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s + header_json + data;
}

// The tiny model of every case: Qwen2, hidden 64, 2 layers, vocab 200, 4 heads / 2 kv heads.
inline std::string TinyConfig(const std::string& drop_field = "",
                              const std::string& replace_field = "",
                              const std::string& replace_value = "") {
  const std::vector<std::pair<std::string, std::string>> fields = {
      {"architectures", R"(["Qwen2ForCausalLM"])"},
      {"hidden_size", "64"},
      {"intermediate_size", "128"},
      {"num_attention_heads", "4"},
      {"num_key_value_heads", "2"},
      {"num_hidden_layers", "2"},
      {"vocab_size", "200"},
      {"tie_word_embeddings", "false"},
      {"max_position_embeddings", "512"},
      {"rms_norm_eps", "1e-6"},
      {"rope_theta", "10000.0"},
      {"torch_dtype", R"("bfloat16")"}};
  std::string j = "{";
  for (const auto& [k, v] : fields) {
    if (k == drop_field) continue;
    if (j.size() > 1) j += ", ";
    j += "\"" + k + "\": " + (k == replace_field ? replace_value : v);
  }
  return j + "}";
}

// A block-FP8 Qwen3 (head_dim 128, every TP part of tp 2 on the 128 grid), with the
// quantization_config Qwen3-8B-FP8 publishes.
inline std::string Fp8Config() {
  return R"({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 256,)"
         R"( "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,)"
         R"( "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,)"
         R"( "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "dynamic",)"
         R"( "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})";
}

// A complete F32 checkpoint of the TinyConfig model (every value 0.01), except that tensor
// `odd` is stored with `odd_dtype` (same element count) and, when `odd_fill` is given, filled
// with that byte pattern.
inline std::string TinyCheckpoint(const std::string& odd = "", const std::string& odd_dtype = "",
                                  const std::string& odd_fill = "") {
  const int64_t H = 64, I = 128, V = 200, kv = 32;
  std::vector<std::pair<std::string, std::vector<int64_t>>> ts = {
      {"model.embed_tokens.weight", {V, H}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ts.push_back({p + "input_layernorm.weight", {H}});
    ts.push_back({p + "self_attn.q_proj.weight", {H, H}});
    ts.push_back({p + "self_attn.q_proj.bias", {H}});
    ts.push_back({p + "self_attn.k_proj.weight", {kv, H}});
    ts.push_back({p + "self_attn.k_proj.bias", {kv}});
    ts.push_back({p + "self_attn.v_proj.weight", {kv, H}});
    ts.push_back({p + "self_attn.v_proj.bias", {kv}});
    ts.push_back({p + "self_attn.o_proj.weight", {H, H}});
    ts.push_back({p + "post_attention_layernorm.weight", {H}});
    ts.push_back({p + "mlp.gate_proj.weight", {I, H}});
    ts.push_back({p + "mlp.up_proj.weight", {I, H}});
    ts.push_back({p + "mlp.down_proj.weight", {H, I}});
  }
  ts.push_back({"model.norm.weight", {H}});
  ts.push_back({"lm_head.weight", {V, H}});
  std::string header = "{", data;
  const float v = 0.01f;
  for (const auto& [name, shape] : ts) {
    int64_t n = 1;
    std::string dims;
    for (int64_t d : shape) {
      n *= d;
      if (!dims.empty()) dims += ",";
      dims += std::to_string(d);
    }
    const bool is_odd = name == odd;
    const std::string dtype = is_odd && !odd_dtype.empty() ? odd_dtype : "F32";
    const int64_t elem = dtype == "F32" ? 4 : dtype == "I8" || dtype == "U8" ? 1 : 2;
    const size_t begin = data.size();
    for (int64_t i = 0; i < n; ++i) {
      if (is_odd && !odd_fill.empty()) {
        data += odd_fill.substr(0, elem);
      } else if (elem == 4) {
        data.append(reinterpret_cast<const char*>(&v), 4);
      } else {
        data.append(elem, '\x01');
      }
    }
    // Appends, not `"..." + name`: GCC 12 flags the latter with a bogus -Wrestrict.
    if (header.size() > 1) header += ",";
    header.append("\"").append(name).append("\":{\"dtype\":\"").append(dtype);
    header.append("\",\"shape\":[").append(dims).append("],\"data_offsets\":[");
    header.append(std::to_string(begin)).append(",").append(std::to_string(data.size()));
    header.append("]}");
  }
  return Safetensors(header + "}", data);
}

// Per-process fixture directory (ctest runs the cases as separate processes, maybe in parallel).
class Fixtures {
 public:
  static const Fixtures& Get() {
    static Fixtures f;
    return f;
  }
  fs::path dir;
  // Replaces {DIR} in an argument with the fixture directory.
  std::string Expand(const std::string& s) const {
    std::string out = s;
    for (size_t p; (p = out.find("{DIR}")) != std::string::npos;) {
      out.replace(p, 5, dir.string());
    }
    return out;
  }
  ~Fixtures() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }

 private:
  Fixtures() {
    dir = fs::temp_directory_path() / ("shardsync-cli-test-" + std::to_string(getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir / "out");
    WriteFile(dir / "tiny/config.json", TinyConfig());
    WriteFile(dir / "notjson/config.json", "{\"hidden_size\": 64, ");
    WriteFile(dir / "nohidden/config.json", TinyConfig("hidden_size"));
    WriteFile(dir / "strhidden/config.json", TinyConfig("", "hidden_size", "\"64\""));
    WriteFile(dir / "neglayers/config.json", TinyConfig("", "num_hidden_layers", "-2"));
    WriteFile(dir / "badarch/config.json",
              TinyConfig("", "architectures", R"(["FrobnicatorForCausalLM"])"));
    WriteFile(dir / "toparray/config.json", "[1, 2]");
    WriteFile(dir / "kvnotdiv/config.json", TinyConfig("", "num_key_value_heads", "3"));
    WriteFile(dir / "hugevocab/config.json", TinyConfig("", "vocab_size", "9223372036854775807"));
    WriteFile(dir / "tiedstr/config.json", TinyConfig("", "tie_word_embeddings", "\"yes\""));
    // A small valid Qwen3-MoE (4 experts, one dense layer) for Megatron expert layouts.
    WriteFile(dir / "moe/config.json",
              TinyConfig("", "architectures",
                         R"(["Qwen3MoeForCausalLM"], "head_dim": 16, "num_experts": 4,)"
                         R"( "moe_intermediate_size": 32, "num_experts_per_tok": 2,)"
                         R"( "mlp_only_layers": [1])"));
    WriteFile(dir / "moetopk/config.json",
              TinyConfig("", "architectures",
                         R"(["Qwen3MoeForCausalLM"], "head_dim": 16,)"
                         R"( "num_experts": 4, "moe_intermediate_size": 32,)"
                         R"( "num_experts_per_tok": 8)"));
    // Block FP8: a Qwen3 small enough for generate, on the 128 grid at tp 2; a config whose
    // quantization_config is not block FP8.
    WriteFile(dir / "fp8/config.json", Fp8Config());
    WriteFile(dir / "awq/config.json",
              TinyConfig("", "torch_dtype",
                         R"("bfloat16", "quantization_config": {"quant_method": "awq",)"
                         R"( "bits": 4, "group_size": 128})"));
    WriteFile(dir / "emptydir/.keep", "");
    // Safetensors: one good file, and the broken kinds inspect/generate must reject.
    const std::string good_header =
        R"({"__metadata__": {"format": "pt"},)"
        R"( "a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},)"
        R"( "b.bias": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}})";
    WriteFile(dir / "good.safetensors", Safetensors(good_header, std::string(24, '\x01')));
    WriteFile(dir / "gooddir/model.safetensors", Safetensors(good_header, std::string(24, '\x01')));
    WriteFile(dir / "garbage.safetensors", "this is not a safetensors file at all, just text\n");
    WriteFile(dir / "short.safetensors", "abc");
    // Header promises 24 data bytes for the tensors; only 10 are there.
    WriteFile(dir / "truncated.safetensors", Safetensors(good_header, std::string(10, '\x01')));
    WriteFile(dir / "badjson.safetensors", Safetensors("{\"a.weight\": {\"dtype\": ", ""));
    // Header length far beyond the file.
    {
      std::string s = Safetensors(good_header, std::string(24, '\x01'));
      s[5] = '\x7f';
      WriteFile(dir / "hugelen.safetensors", s);
    }
    WriteFile(dir / "baddtype.safetensors",
              Safetensors(R"({"a.weight": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}})",
                          std::string(2, '\0')));
    WriteFile(
        dir / "badoffsets.safetensors",
        Safetensors(R"({"a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})",
                    std::string(16, '\0')));
    // Checkpoint dirs for generate --weights: config.json beside a broken / incomplete file.
    WriteFile(dir / "w_garbage/config.json", TinyConfig());
    WriteFile(dir / "w_garbage/model.safetensors", "garbage garbage garbage garbage");
    WriteFile(dir / "w_truncated/config.json", TinyConfig());
    WriteFile(dir / "w_truncated/model.safetensors",
              Safetensors(good_header, std::string(10, '\x01')));
    WriteFile(dir / "w_incomplete/config.json", TinyConfig());
    WriteFile(dir / "w_incomplete/model.safetensors",
              Safetensors(good_header, std::string(24, '\x01')));
    WriteFile(dir / "w_noconfig/model.safetensors",
              Safetensors(good_header, std::string(24, '\x01')));
    // Issue 26: weights the reference engine must refuse (exit 2 naming the tensor).
    const std::string nan_f32("\x00\x00\xc0\x7f", 4);  // a quiet NaN, little-endian
    WriteFile(dir / "w_nan/config.json", TinyConfig());
    WriteFile(dir / "w_nan/model.safetensors",
              TinyCheckpoint("model.layers.1.mlp.down_proj.weight", "F32", nan_f32));
    WriteFile(dir / "w_inf_bf16/config.json", TinyConfig());
    WriteFile(dir / "w_inf_bf16/model.safetensors",
              TinyCheckpoint("model.norm.weight", "BF16", std::string("\x80\x7f", 2)));
    WriteFile(dir / "w_i8/config.json", TinyConfig());
    WriteFile(dir / "w_i8/model.safetensors",
              TinyCheckpoint("model.layers.0.self_attn.k_proj.weight", "I8"));
    WriteFile(dir / "w_ok/config.json", TinyConfig());
    WriteFile(dir / "w_ok/model.safetensors", TinyCheckpoint());
    // Valid by every field's own rule, absurd in size: ~2^61 weights (fp32: past int64 bytes).
    WriteFile(dir / "absurd/config.json",
              R"({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 536870912,)"
              R"( "intermediate_size": 2, "num_attention_heads": 4, "num_key_value_heads": 2,)"
              R"( "num_hidden_layers": 1, "vocab_size": 2147483648, "torch_dtype": "bfloat16"})");
    WriteFile(dir / "w_badconfig/config.json", "not json");
    WriteFile(dir / "w_badconfig/model.safetensors",
              Safetensors(good_header, std::string(24, '\x01')));
  }
};

}  // namespace shardsync::clitest
