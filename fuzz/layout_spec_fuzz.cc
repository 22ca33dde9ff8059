// libFuzzer entry for the layout strings users type (`--trainer`, `--rollout`, Python's
// `Plan(trainer=, rollout=)`): "TRAINER\nROLLOUT" must parse or fail with an error, never crash,
// hang or throw. A pair that parses must also check, map and plan for a small MoE model, and every
// rank's plan must stay inside the sync world.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shardsync/fp8_plan.h"
#include "shardsync/model.h"
#include "shardsync/plan.h"

namespace {

// A small Qwen3-MoE shape (built once): dense and expert layers, qk-norm, padded vocab.
const shardsync::ModelSpec& Model() {
  static const shardsync::ModelSpec m = [] {
    shardsync::ModelSpec s = shardsync::LoadModelSpec("qwen3-30b-a3b").value();
    s.hidden_size = 32;
    s.num_attention_heads = 8;
    s.num_key_value_heads = 4;
    s.head_dim = 8;
    s.num_hidden_layers = 8;
    s.intermediate_size = 48;
    s.vocab_size = 150;
    s.num_experts = 8;
    s.num_experts_per_tok = 2;
    s.moe_intermediate_size = 16;
    s.mlp_only_layers = {1};
    return s;
  }();
  return m;
}

// The same kind of model on the 128 grid with block-FP8 engine weights: the FP8 planner (FSDP and
// Megatron trainers) must plan a layout or refuse it with an error, never crash.
const shardsync::ModelSpec& Fp8Model() {
  static const shardsync::ModelSpec m = [] {
    shardsync::ModelSpec s = shardsync::LoadModelSpec("qwen3-30b-a3b").value();
    s.hidden_size = 256;
    s.num_attention_heads = 4;
    s.num_key_value_heads = 2;
    s.head_dim = 128;
    s.num_hidden_layers = 4;
    s.intermediate_size = 512;
    s.vocab_size = 300;
    s.num_experts = 4;
    s.num_experts_per_tok = 2;
    s.moe_intermediate_size = 256;
    s.mlp_only_layers = {1};
    s.quant = shardsync::ParseQuantFlag("fp8-block128").value();
    return s;
  }();
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const size_t nl = text.find('\n');
  const std::string_view trainer_text = text.substr(0, nl);
  const std::string_view rollout_text = nl == std::string_view::npos ? "" : text.substr(nl + 1);
  auto trainer = shardsync::ParseTrainerSpec(trainer_text);
  auto engine = shardsync::ParseEngineKind(rollout_text.size() % 2 ? "vllm" : "sglang");
  auto rollout = shardsync::ParseRolloutSpec(rollout_text, *engine);
  if (!trainer.ok()) return 0;
  (void)trainer->ToString();
  // Keep each input cheap: plan only modest worlds.
  if (trainer->world() > 64) return 0;
  if (!shardsync::CheckTrainerLayout(Model(), *trainer).ok()) return 0;
  for (int r : {0, trainer->world() - 1}) {
    auto params = shardsync::BuildTrainerParams(Model(), *trainer, r, shardsync::DType::kF32);
    if (!params.ok()) __builtin_trap();  // a layout that checks must map every rank
  }
  if (!rollout.ok() || rollout->world() > 64) return 0;
  shardsync::PlanInputs in;
  in.model = Model();
  in.trainer = *trainer;
  in.rollout = *rollout;
  if (!shardsync::ValidatePlanInputs(in).ok()) return 0;
  const int world = shardsync::SyncWorldSize(in);
  for (int r : {0, world - 1}) {
    auto plan = shardsync::PlanForRank(in, r);
    if (!plan.ok()) __builtin_trap();  // inputs that validate must plan
    for (const auto& m : plan->sends) {
      if (m.dst < 0 || m.dst >= world) __builtin_trap();
    }
  }
  // Block FP8: plans or refuses (a shard off the 128 grid), and a plan stays inside the world.
  in.model = Fp8Model();
  if (!shardsync::CheckTrainerLayout(in.model, *trainer).ok()) return 0;
  if (!shardsync::ValidatePlanInputs(in).ok()) return 0;
  for (int r : {0, world - 1}) {
    auto fp8 = shardsync::PlanForRank(in, r);
    if (!fp8.ok()) continue;
    for (const auto& m : fp8->sends) {
      if (m.dst < 0 || m.dst >= world) __builtin_trap();
    }
  }
  return 0;
}
