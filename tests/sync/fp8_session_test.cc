// Block-FP8 sync sessions on loopback, one thread per sync rank (issue 25): Qwen3-8B and
// Qwen3-30B-A3B shapes at toy size, fsdp=4 -> SGLang tp2 pp2 and vLLM tp2 ep2, fp32 and bf16
// trainers. Every landed e4m3 byte and every scale is compared with the independent reference
// quantizer (tests/common/fp8_reference.h) applied to the trainer's values; unquantized
// parameters with the trainer's values in the wire dtype. Then the failure semantics: a flipped
// byte, a non-finite trainer value, bindings in the wrong dtype.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>

#include "common/fp8_reference.h"
#include "job/internal.h"
#include "job/test_util.h"
#include "session_harness.h"
#include "shardsync/fp8.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/synthetic.h"
#include "shardsync/transport.h"
#include "sync_expect.h"

namespace shardsync {
namespace {

using testing::ExpectAllOk;
using ::testing::HasSubstr;

// Qwen3-8B at toy size: head_dim 128, 4 q / 2 kv heads, intermediate 768 (192 rows per rank at
// fsdp=4: gate/up bands straddle trainer ranks, q/o bands do not), vocab 500 (padded rows).
std::string TinyQwen3Fp8() {
  return testing::WriteConfig("qwen3-fp8", R"({
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 512, "intermediate_size": 768,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 3,
  "vocab_size": 500, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "dynamic",
  "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})");
}

// Qwen3-30B-A3B at toy size: a dense first layer, 4 experts of 384 rows (96 per rank at fsdp=4).
std::string TinyQwen3MoeFp8() {
  return testing::WriteConfig("qwen3moe-fp8", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 3,
  "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "num_experts": 4, "moe_intermediate_size": 384, "num_experts_per_tok": 2,
  "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [0],
  "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "dynamic",
  "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})");
}

// The dense toy with 4 layers, for Megatron pipeline stages.
std::string TinyQwen3Fp8L4() {
  return testing::WriteConfig("qwen3-fp8-l4", R"({
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 512, "intermediate_size": 768,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 4,
  "vocab_size": 500, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "dynamic",
  "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})");
}

JobSpec Spec(const std::string& model, const std::string& rollout, const std::string& engine,
             const std::string& trainer_dtype, int64_t bucket = 256 << 10,
             const std::string& trainer = "fsdp=4", const std::string& split = "amax") {
  JobFlags f;
  f.fp8_split = split;
  f.model = model;
  f.trainer = trainer;
  f.rollout = rollout;
  f.engine = engine;
  f.trainer_dtype = trainer_dtype;
  f.bucket_bytes = bucket;
  f.transport = "loopback";
  f.timeout_ms = 20000;
  auto j = JobSpecFromFlags(f);
  EXPECT_TRUE(j.ok()) << j.status().ToString();
  return *j;
}

// The harness's job (loopback with the fault decorator around it), 5 s sync timeout by default.
class Fp8Job : public testing::SessionJob {
 public:
  explicit Fp8Job(JobSpec spec, Millis timeout = Millis(5000))
      : SessionJob(std::move(spec), timeout) {}
};

struct Counts {
  int64_t fp8_bytes = 0, scales = 0, copied = 0, mismatches = 0;
  std::string first;
};

// The trainer's values of a whole HF tensor as it holds them (trainer dtype), as fp32.
std::vector<float> TrainerValues(const JobSpec& spec, const HfTensor& t) {
  std::vector<float> f(t.numel());
  FillSyntheticRegion(spec.seed, t.name, t.shape, Region::Full(t.shape), f.data());
  for (float& v : f) {
    unsigned char b[4];
    job_internal::StoreFloats(&v, 1, spec.inputs.trainer_dtype, b);
    v = job_internal::LoadFloat(b, 0, spec.inputs.trainer_dtype);
  }
  return f;
}

// Every engine parameter of every engine rank against the reference quantizer (quantized
// weights and scales) or the trainer's values in the wire dtype (everything else).
Counts CompareWithReference(Fp8Job& job) {
  Counts c;
  const JobSpec& spec = job.spec();
  std::map<std::string, HfTensor> inv;
  for (const HfTensor& t : HfTensorInventory(spec.inputs.model)) inv[t.name] = t;
  std::map<std::string, fp8_reference::Quantized> ref;
  std::map<std::string, std::vector<float>> values;
  auto quantized = [&](const std::string& name) -> const fp8_reference::Quantized& {
    auto it = ref.find(name);
    if (it != ref.end()) return it->second;
    const HfTensor& t = inv.at(name);
    const auto x = TrainerValues(spec, t);
    return ref.emplace(name, fp8_reference::QuantizeMatrix(x.data(), t.shape[0], t.shape[1]))
        .first->second;
  };
  auto bad = [&](const std::string& what, int64_t n) {
    if (n > 0 && c.mismatches == 0) c.first = what;
    c.mismatches += n;
  };
  const DType wd = spec.inputs.options.wire_dtype;
  for (int r = job.trainers(); r < job.world(); ++r) {
    const auto& params = job.session(r).ExpectedParams();
    for (size_t i = 0; i < params.size(); ++i) {
      const EngineParam& p = params[i];
      const auto* got = static_cast<const uint8_t*>(job.params(r).bindings[i].data);
      for (const Piece& pc : p.pieces) {
        const bool weight = p.dtype == DType::kF8E4M3;
        const bool scale = !weight && IsFp8ScaleParam(p);
        const std::string src = scale ? pc.source.substr(0, pc.source.size() - 10) : pc.source;
        const Shape shape =
            scale ? Shape{Fp8Blocks(inv.at(src).shape[0]), Fp8Blocks(inv.at(src).shape[1])}
                  : inv.at(src).shape;
        std::vector<int64_t> src_runs;
        ForEachRun(pc.src, shape, [&](int64_t off, int64_t len) {
          for (int64_t e = 0; e < len; ++e) src_runs.push_back(off + e);
        });
        if (!weight && !scale && !values.count(src)) values[src] = TrainerValues(spec, inv.at(src));
        const std::vector<float>& x = values[src];
        size_t k = 0;
        ForEachRun(pc.dst, p.shape, [&](int64_t off, int64_t len) {
          for (int64_t e = 0; e < len; ++e, ++k) {
            const int64_t s = src_runs[k], d = off + e;
            const std::string where = p.name + " element " + std::to_string(d);
            if (weight) {
              bad(where, got[d] != quantized(src).q[s]);
              ++c.fp8_bytes;
            } else if (scale) {
              float v;
              std::memcpy(&v, got + 4 * d, 4);
              bad(where, fp8_reference::Bits(v) != fp8_reference::Bits(quantized(src).scales[s]));
              ++c.scales;
            } else {
              unsigned char want[4];
              job_internal::StoreFloats(&x[s], 1, wd, want);
              bad(where, std::memcmp(got + d * DTypeSize(wd), want, DTypeSize(wd)) != 0);
              ++c.copied;
            }
          }
        });
      }
    }
  }
  return c;
}

struct Layout {
  std::string (*model)();
  const char* rollout;
  const char* engine;
  const char* trainer_dtype;
  bool reference;  // compare with the (slow) reference quantizer too
  const char* split = "amax";
  const char* trainer = "fsdp=4";
};

TEST(Fp8Session, EveryLandedByteAndScaleEqualsTheReferenceQuantizer) {
  const Layout layouts[] = {
      // The amax exchange (the default) for blocks shared by trainer ranks.
      {TinyQwen3Fp8, "dp=1,tp=2,pp=2", "sglang", "fp32", true},
      {TinyQwen3MoeFp8, "dp=1,tp=2,pp=1,ep=2", "vllm", "bf16", true},
      // Chunks smaller than a block: 3 or 4 holders per band (fsdp 12 of 512 / 384 rows).
      {TinyQwen3MoeFp8, "dp=1,tp=2,pp=1,ep=2", "vllm", "fp32", true, "amax", "fsdp=12"},
      // Staged bands, and the other trainer dtypes, checked by the harness (the library
      // quantizer, which tests/common/fp8_test.cc holds to the reference bit for bit).
      {TinyQwen3Fp8, "dp=1,tp=2,pp=2", "sglang", "fp32", true, "stage"},
      {TinyQwen3MoeFp8, "dp=1,tp=2,pp=1,ep=2", "vllm", "bf16", true, "stage"},
      {TinyQwen3Fp8, "dp=1,tp=2,pp=2", "sglang", "bf16", false},
      {TinyQwen3MoeFp8, "dp=1,tp=2,pp=1,ep=2", "vllm", "fp32", false, "stage"},
  };
  for (const Layout& l : layouts) {
    SCOPED_TRACE(std::string(l.trainer) + " -> " + l.rollout + " " + l.engine + " " +
                 l.trainer_dtype + " " + l.split);
    JobSpec spec =
        Spec(l.model(), l.rollout, l.engine, l.trainer_dtype, 256 << 10, l.trainer, l.split);
    auto sum = SummarizePlan(spec.inputs);
    ASSERT_TRUE(sum.ok()) << sum.status().ToString();
    // Both paths run: blocks quantized by their sender and blocks shared by trainer ranks, by
    // their holders (amax) or staged to the receiver.
    if (std::string(l.trainer) == "fsdp=4") {
      EXPECT_GT(sum->sender_quantized_elements, 0);
    }
    if (std::string(l.split) == "amax") {
      EXPECT_GT(sum->amax_elements, 0);
      EXPECT_EQ(sum->receiver_quantized_elements, 0);
      EXPECT_EQ(sum->max_staging_bytes, 0);
    } else {
      EXPECT_GT(sum->receiver_quantized_elements, 0);
      EXPECT_EQ(sum->amax_elements, 0);
    }
    Fp8Job job(spec);
    job.BindAll();
    ExpectAllOk(job.Connect());
    for (uint64_t v = 1; v <= 3; ++v) {
      std::vector<SyncReport> reps;
      ExpectAllOk(job.Sync(v, &reps));
      EXPECT_GT(reps[0].checksums_total, 0);
      EXPECT_EQ(reps[0].checksums_ok, reps[0].checksums_total);
      EXPECT_EQ(reps[0].bytes, sum->total_bytes);
    }
    if (l.reference) {
      const Counts c = CompareWithReference(job);
      EXPECT_EQ(c.mismatches, 0) << "first: " << c.first;
      EXPECT_EQ(c.fp8_bytes, sum->sender_quantized_elements + sum->receiver_quantized_elements +
                                 sum->amax_elements);
      EXPECT_GT(c.scales, 0);
      EXPECT_GT(c.copied, 0);
    }
    // The harness's own element check (the library quantizer) agrees, and catches one byte.
    EXPECT_EQ(job.Mismatches(), 0);
    static_cast<uint8_t*>(job.params(job.world() - 1).bindings[1].data)[3] ^= 0x01;
    EXPECT_EQ(job.Mismatches(), 1);
  }
}

// Megatron-Core trainers (issue 28 x 25): senders quantize straight from their local parameters
// (linear_qkv's interleaved groups, linear_fc1's [gate; up], grouped experts), DP replicas
// sharing the work; every landed byte and scale equals the reference quantizer's.
TEST(Fp8Session, MegatronTrainersLandEveryByteAndScaleOfTheReferenceQuantizer) {
  struct Case {
    std::string (*model)();
    const char* trainer;
    const char* rollout;
    const char* engine;
    const char* trainer_dtype;
  } layouts[] = {
      {TinyQwen3Fp8L4, "megatron=tp=2,pp=2", "dp=1,tp=2,pp=2", "sglang", "fp32"},
      {TinyQwen3MoeFp8, "megatron=tp=2,ep=2,etp=1,dp=2", "dp=1,tp=2,pp=1,ep=2", "vllm", "bf16"},
  };
  for (const Case& l : layouts) {
    SCOPED_TRACE(std::string(l.trainer) + " -> " + l.rollout + " " + l.engine);
    JobSpec spec = Spec(l.model(), l.rollout, l.engine, l.trainer_dtype, 256 << 10, l.trainer);
    auto sum = SummarizePlan(spec.inputs);
    ASSERT_TRUE(sum.ok()) << sum.status().ToString();
    EXPECT_GT(sum->sender_quantized_elements, 0);
    EXPECT_EQ(sum->receiver_quantized_elements, 0);
    for (const auto& t : sum->trainer_ranks) EXPECT_GT(t.send_bytes, 0) << "rank " << t.rank;
    Fp8Job job(spec);
    job.BindAll();
    ExpectAllOk(job.Connect());
    for (uint64_t v = 1; v <= 2; ++v) {
      std::vector<SyncReport> reps;
      ExpectAllOk(job.Sync(v, &reps));
      EXPECT_GT(reps[0].checksums_total, 0);
      EXPECT_EQ(reps[0].checksums_ok, reps[0].checksums_total);
      EXPECT_EQ(reps[0].bytes, sum->total_bytes);
    }
    const Counts c = CompareWithReference(job);
    EXPECT_EQ(c.mismatches, 0) << "first: " << c.first;
    EXPECT_EQ(c.fp8_bytes, sum->sender_quantized_elements);
    EXPECT_GT(c.scales, 0);
    EXPECT_GT(c.copied, 0);
    EXPECT_EQ(job.Mismatches(), 0);
  }
}

JobSpec Small(const std::string& split = "amax") {
  return Spec(TinyQwen3Fp8(), "dp=1,tp=2,pp=2", "sglang", "fp32", 64 << 10, "fsdp=4", split);
}

TEST(Fp8Session, FlippedByteIsDataLossNamingTheParameter) {
  Fp8Job job(Small());
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(1));
  testing::ExpectFlippedByteIsDataLossThenRecovers(job);
}

// A NaN in the trainer's values: block FP8 cannot carry it. Whether its block is quantized by the
// sender, by the trainer ranks sharing it (amax exchange: every holder fails naming the tensor)
// or, staged, by the receiver, the sync fails with DataLoss naming the tensor or parameter, every
// engine rank stays poisoned, and a clean sync recovers.
class Fp8NonFinite : public ::testing::TestWithParam<const char*> {};

TEST_P(Fp8NonFinite, TrainerValueFailsTheSyncNamingTheTensor) {
  const bool amax = std::string(GetParam()) == "amax";
  Fp8Job job(Small(GetParam()));
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(1));
  auto value = [&](const std::string& name, int64_t local) -> float& {
    for (auto& b : job.shards(0).bindings) {
      if (b.hf_name == name) return const_cast<float*>(static_cast<const float*>(b.data))[local];
    }
    ADD_FAILURE() << name;
    static float none = 0;
    return none;
  };
  struct Case {
    const char* tensor;
    int64_t row;  // of trainer rank 0's shard (512 columns)
    const char* names;
  } cases[] = {
      // q_proj: 512 rows, 128 per rank: its blocks are quantized by trainer rank 0.
      {"model.layers.0.self_attn.q_proj.weight", 5, "model.layers.0.self_attn.q_proj.weight"},
      // gate_proj: 768 rows, 192 per rank: rows [128, 256) straddle ranks 0 and 1 (both
      // holders fail naming the tensor; staged: the receiver names its parameter).
      {"model.layers.0.mlp.gate_proj.weight", 150,
       amax ? "model.layers.0.mlp.gate_proj.weight" : "model.layers.0.mlp.gate_up_proj.weight"},
  };
  uint64_t v = 2;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.tensor);
    float& x = value(c.tensor, c.row * 512 + 7);
    const float keep = x;
    x = std::nanf("");
    auto st = job.Sync(v++);
    int named = 0;
    for (int r = 0; r < job.world(); ++r) {
      EXPECT_FALSE(st[r].ok()) << "rank " << r;
      if (st[r].code() == StatusCode::kDataLoss &&
          st[r].message().find("non-finite") != std::string::npos) {
        EXPECT_THAT(st[r].message(), HasSubstr(c.names));
        ++named;
      }
      if (r >= job.trainers()) {
        EXPECT_TRUE(job.session(r).IsPoisoned()) << "rank " << r;
      }
    }
    const bool shared = amax && std::string(c.tensor).find("gate_proj") != std::string::npos;
    EXPECT_EQ(named, shared ? 2 : 1);
    x = keep;
    ExpectAllOk(job.Sync(v++));
    EXPECT_EQ(job.Mismatches(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Splits, Fp8NonFinite, ::testing::Values("amax", "stage"));

// A holder of shared blocks that is gone (its session and store connection closed, as a killed
// process's) fails the next sync on every other rank well within the sync timeout, the holders
// waiting for its partial amaxes naming it; the engine ranks stay poisoned.
TEST(Fp8Session, AGoneHolderFailsTheAmaxExchangeNamingIt) {
  Fp8Job job(Small(), Millis(10000));
  job.BindAll();
  ExpectAllOk(job.Connect());
  ExpectAllOk(job.Sync(1));
  const int victim = 1;  // trainer rank 1 shares gate/up and k/v bands with ranks 0 and 2
  job.Drop(victim);
  const auto t0 = std::chrono::steady_clock::now();
  auto st =
      job.All([&](int r) { return r == victim ? OkStatus() : job.session(r).Sync(2).status(); });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 5.0) << "the sync timeout is 10 s";
  for (int r = 0; r < job.world(); ++r) {
    if (r == victim) continue;
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    if (r >= job.trainers()) {
      EXPECT_TRUE(job.session(r).IsPoisoned()) << "rank " << r;
    }
  }
  // Whoever saw it first (a holder waiting in the exchange, an engine rank waiting for
  // buckets) names it; the others fail with its abort, which carries the cause.
  for (int r = 0; r < job.world(); ++r) {
    if (r != victim) {
      EXPECT_THAT(st[r].message(), HasSubstr("sync rank 1 is gone")) << r;
    }
  }
}

TEST(Fp8Session, ParametersBindInTheirEngineDtypes) {
  Fp8Job job(Small());
  const int e = job.trainers();
  const auto& params = job.session(e).ExpectedParams();
  int weights = 0, scales = 0;
  for (const EngineParam& p : params) {
    std::vector<unsigned char> buf(p.numel() * 4);
    DestBinding b{p.name, buf.data(), DType::kBF16, p.shape, MemKind::kHost, -1};
    if (p.dtype == DType::kF8E4M3) {
      ++weights;
      Status s = job.session(e).BindDest(b);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_THAT(s.message(), HasSubstr(p.name));
      EXPECT_THAT(s.message(), HasSubstr("F8_E4M3"));
    } else if (IsFp8ScaleParam(p)) {
      ++scales;
      EXPECT_FALSE(job.session(e).BindDest(b).ok()) << p.name;
      b.dtype = DType::kF32;
      EXPECT_TRUE(job.session(e).BindDest(b).ok()) << p.name;
    }
  }
  EXPECT_GT(weights, 0);
  EXPECT_EQ(weights, scales);
}

}  // namespace
}  // namespace shardsync
