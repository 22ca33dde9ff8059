// Helpers for the sync tests: tiny model configs written to a temp dir, job specs.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "job/launcher.h"

namespace shardsync::testing {

// The temp dirs this test process made, removed when it exits (by the process that made them,
// not by a forked child).
class TempDirs {
 public:
  ~TempDirs() {
    if (getpid() != owner_) return;
    std::error_code ec;
    for (const auto& d : dirs_) std::filesystem::remove_all(d, ec);
  }
  void Add(const std::filesystem::path& d) {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(dirs_.begin(), dirs_.end(), d) == dirs_.end()) dirs_.push_back(d);
  }

 private:
  pid_t owner_ = getpid();
  std::mutex mu_;
  std::vector<std::filesystem::path> dirs_;
};
inline TempDirs& TestTempDirs() {
  static TempDirs dirs;
  return dirs;
}

// A tiny Qwen2 / Qwen3-MoE config.json in a fresh temp dir; returns its path.
inline std::string WriteConfig(const std::string& name, const std::string& json) {
  auto dir = std::filesystem::temp_directory_path() /
             ("shardsync-sync-test-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::create_directories(dir);
  TestTempDirs().Add(dir);
  auto path = dir / "config.json";
  std::ofstream(path) << json;
  return path.string();
}

// Qwen2: 8 heads, 2 kv heads (kv replication once tp > 2), q/k/v biases, vocab 1000 (padded to
// 1024: zero-filled rows).
inline std::string TinyQwen2(int layers = 4, bool tied = true) {
  return WriteConfig(
      "qwen2-" + std::to_string(layers) + (tied ? "t" : "u"), R"({
  "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
  "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": )" +
                                                                  std::to_string(layers) + R"(,
  "vocab_size": 1000, "tie_word_embeddings": )" + (tied ? "true" : "false") +
                                                                  R"(,
  "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
  "torch_dtype": "bfloat16"})");
}

// Qwen3-MoE: 8 experts, qk norm, one dense layer (mlp_only_layers).
inline std::string TinyQwen3Moe() {
  return WriteConfig("qwen3moe", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3,
  "vocab_size": 500, "tie_word_embeddings": false, "max_position_embeddings": 512,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 8, "moe_intermediate_size": 32,
  "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 1,
  "mlp_only_layers": [1], "torch_dtype": "bfloat16"})");
}

inline JobSpec Job(const std::string& model, const std::string& trainer, const std::string& rollout,
                   const std::string& engine = "sglang", int64_t bucket_bytes = 64 << 10,
                   const std::string& pp_partition = "") {
  JobFlags f;
  f.model = model;
  f.trainer = trainer;
  f.rollout = rollout;
  f.engine = engine;
  f.bucket_bytes = bucket_bytes;
  f.pp_partition = pp_partition;
  f.transport = "loopback";
  f.timeout_ms = 20000;
  auto j = JobSpecFromFlags(f);
  if (!j.ok()) {
    std::fprintf(stderr, "bad test job: %s\n", j.status().ToString().c_str());
    std::abort();
  }
  return *j;
}

}  // namespace shardsync::testing
