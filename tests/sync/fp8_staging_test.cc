// Staged block-FP8 bands on prepared (device) pairs, the CPU-checkable parts (docs/fp8.md "The
// sync"): each sender places its stage ops' raw rows at Fp8StageTargetOf(op) in the receiver's
// staging, computed from its OWN plan, and the receiver quantizes Fp8BandTasks(its plan) from
// there. Run with the CPU packer (the CUDA packer runs the same tasks through the prepared FP8
// batch: tests/cuda), the two plans must meet: every staging byte written exactly once, and every
// band's e4m3 bytes and scales equal the reference quantizer of the trainer's values. A NaN in a
// staged band is DataLoss naming the parameter.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>

#include "common/fp8_reference.h"
#include "job/internal.h"
#include "job/test_util.h"
#include "shardsync/fp8.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/session.h"
#include "shardsync/synthetic.h"
#include "sync/fp8_outline.h"

namespace shardsync {
namespace {

using ::testing::HasSubstr;

// Qwen3-8B at toy size, intermediate 768: 192 rows per rank at fsdp=4, so gate/up bands straddle
// trainer ranks.
std::string TinyQwen3Fp8() {
  return testing::WriteConfig("qwen3-fp8-staging", R"({
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 768,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
  "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "dynamic",
  "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})");
}

// Qwen3-30B-A3B at toy size: experts of 384 rows, 96 per rank at fsdp=4 (3-d expert params).
std::string TinyQwen3MoeFp8() {
  return testing::WriteConfig("qwen3moe-fp8-staging", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
  "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "num_experts": 4, "moe_intermediate_size": 384, "num_experts_per_tok": 2,
  "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [0],
  "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "dynamic",
  "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})");
}

JobSpec Spec(const std::string& model, const std::string& rollout, const std::string& engine,
             const std::string& trainer_dtype) {
  JobFlags f;
  f.model = model;
  f.trainer = "fsdp=4";
  f.rollout = rollout;
  f.engine = engine;
  f.trainer_dtype = trainer_dtype;
  f.bucket_bytes = 64 << 10;  // stage ops cut into several per band
  f.transport = "loopback";
  f.fp8_split = "stage";  // the default exchanges amaxes instead
  auto j = JobSpecFromFlags(f);
  EXPECT_TRUE(j.ok()) << j.status().ToString();
  return *j;
}

// One engine rank's staging, filled by every trainer rank's stage ops as a device sender would
// write them, and its parameters.
struct Receiver {
  RankPlan plan;
  std::vector<EngineParam> params;
  job_internal::EngineParams bound;
  std::vector<unsigned char> staging;
  std::vector<int> written;  // per staging byte
};

Receiver Stage(const JobSpec& spec, int engine) {
  const PlanInputs& in = spec.inputs;
  Receiver rx;
  rx.plan = PlanForRank(in, engine).value();
  const SyncRank who = DescribeSyncRank(in, engine).value();
  rx.params =
      BuildShardMap(in.model, in.rollout.shard).value().rank(who.tp_rank, who.pp_rank).params;
  rx.bound = job_internal::AllocateEngineParams(rx.params, in.options.wire_dtype).value();
  rx.staging.assign(static_cast<size_t>(rx.plan.staging_bytes), 0xA5);
  rx.written.assign(rx.staging.size(), 0);
  const std::vector<HfTensor> inv = HfTensorInventory(in.model);
  const int es = DTypeSize(in.trainer_dtype);
  for (int t = 0; t < in.trainer.world(); ++t) {
    const RankPlan sp = PlanForRank(in, t).value();
    const auto shards = job_internal::FillTrainerShards(spec, t).value();
    for (const Message& m : sp.sends) {
      if (m.dst != engine) continue;
      for (const TransferOp& op : m.ops) {
        if (op.encoding != Encoding::kStage) continue;
        const SourceBinding* sb = nullptr;
        for (const SourceBinding& b : shards.bindings) {
          if (b.hf_name == inv.at(op.tensor).name) sb = &b;
        }
        EXPECT_NE(sb, nullptr) << inv.at(op.tensor).name;
        if (sb == nullptr) continue;
        // The sender's bytes in row-major order, then where its own plan says they land.
        Region rel = op.src;
        for (int d = 0; d < rel.ndim; ++d) rel.offset[d] -= sb->region.offset[d];
        std::vector<unsigned char> raw;
        ForEachRun(rel, sb->region.extents(), [&](int64_t off, int64_t len) {
          const auto* p = static_cast<const unsigned char*>(sb->data) + off * es;
          raw.insert(raw.end(), p, p + len * es);
        });
        const sync_internal::Fp8StageTarget tg = sync_internal::Fp8StageTargetOf(op);
        size_t k = 0;
        ForEachRun(tg.dst, tg.shape, [&](int64_t off, int64_t len) {
          for (int64_t b = 0; b < len * es; ++b, ++k) {
            const int64_t at = tg.offset + off * es + b;
            ASSERT_LT(at, rx.plan.staging_bytes);
            rx.staging[at] = raw[k];
            ++rx.written[at];
          }
        });
        EXPECT_EQ(k, raw.size());
      }
    }
  }
  return rx;
}

TEST(Fp8Staging, SendersPlaceStagedRowsWhereTheReceiverQuantizesThem) {
  struct Layout {
    std::string (*model)();
    const char* rollout;
    const char* engine;
    const char* trainer_dtype;
  } layouts[] = {
      {TinyQwen3Fp8, "dp=1,tp=2,pp=2", "sglang", "fp32"},
      {TinyQwen3Fp8, "dp=1,tp=2,pp=2", "sglang", "bf16"},
      {TinyQwen3MoeFp8, "dp=1,tp=2,pp=1,ep=2", "vllm", "bf16"},
  };
  for (const Layout& l : layouts) {
    SCOPED_TRACE(std::string(l.rollout) + " " + l.engine + " " + l.trainer_dtype);
    const JobSpec spec = Spec(l.model(), l.rollout, l.engine, l.trainer_dtype);
    const PlanInputs& in = spec.inputs;
    const std::vector<HfTensor> list = HfTensorInventory(in.model);
    std::map<std::string, fp8_reference::Quantized> ref;
    auto packer = MakeCpuPacker();
    int64_t bands = 0, checked = 0, mismatches = 0;
    for (int e = in.trainer.world(); e < SyncWorldSize(in); ++e) {
      Receiver rx = Stage(spec, e);
      // Every byte of every band written once; the pads between bands never.
      std::vector<int> want(rx.staging.size(), 0);
      for (const StagedBand& b : rx.plan.staged) {
        for (int64_t i = 0; i < b.bytes; ++i) want[b.staging_offset + i] = 1;
      }
      EXPECT_EQ(rx.written, want) << "engine rank " << e;
      const auto tasks = sync_internal::Fp8BandTasks(rx.plan, rx.bound.bindings, rx.staging.data());
      ASSERT_EQ(tasks.size(), rx.plan.staged.size());
      auto bad = KernelsOf<Fp8Kernels>(*packer)->QuantizeBands(tasks);
      ASSERT_TRUE(bad.ok()) << bad.status().ToString();
      EXPECT_EQ(*bad, std::vector<int64_t>(tasks.size(), 0));
      EXPECT_TRUE(sync_internal::Fp8BandsStatus(e, rx.plan, rx.bound.bindings, *bad).ok());
      for (const StagedBand& b : rx.plan.staged) {
        ++bands;
        const HfTensor& h = list.at(b.tensor);
        auto it = ref.find(h.name);
        if (it == ref.end()) {
          std::vector<float> x(h.numel());
          FillSyntheticRegion(spec.seed, h.name, h.shape, Region::Full(h.shape), x.data());
          for (float& v : x) {  // as the trainer holds it
            unsigned char t[4];
            job_internal::StoreFloats(&v, 1, in.trainer_dtype, t);
            v = job_internal::LoadFloat(t, 0, in.trainer_dtype);
          }
          it = ref.emplace(h.name, fp8_reference::QuantizeMatrix(x.data(), h.shape[0], h.shape[1]))
                   .first;
        }
        const fp8_reference::Quantized& q = it->second;
        const DestBinding& w = rx.bound.bindings[b.param];
        const DestBinding& s = rx.bound.bindings[b.scale_param];
        const int64_t rows = b.src.extent[0], cols = b.src.extent[1];
        const int64_t w0 = RegionStartElement(b.dst, w.shape),
                      s0 = RegionStartElement(b.scale_dst, s.shape);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            const uint8_t got = static_cast<const uint8_t*>(w.data)[w0 + r * w.shape.back() + c];
            mismatches += got != q.q[(b.src.offset[0] + r) * h.shape[1] + b.src.offset[1] + c];
            ++checked;
          }
        }
        const int64_t nbc = Fp8Blocks(h.shape[1]);
        for (int64_t k = 0; k < Fp8Blocks(cols); ++k) {
          const float got = static_cast<const float*>(s.data)[s0 + k];
          const float exp =
              q.scales[(b.src.offset[0] / kFp8Block) * nbc + b.src.offset[1] / kFp8Block + k];
          mismatches += fp8_reference::Bits(got) != fp8_reference::Bits(exp);
        }
      }
    }
    EXPECT_GT(bands, 0);
    EXPECT_GT(checked, 0);
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(Fp8Staging, NonFiniteStagedValueIsDataLossNamingTheParameter) {
  const JobSpec spec = Spec(TinyQwen3Fp8(), "dp=1,tp=2,pp=2", "sglang", "fp32");
  const int e = spec.inputs.trainer.world();
  Receiver rx = Stage(spec, e);
  ASSERT_GT(rx.plan.staged.size(), 1u);
  const StagedBand& b = rx.plan.staged[1];
  const float nan = std::nanf("");
  std::memcpy(rx.staging.data() + b.staging_offset + 4 * 37, &nan, 4);
  const auto tasks = sync_internal::Fp8BandTasks(rx.plan, rx.bound.bindings, rx.staging.data());
  auto bad = KernelsOf<Fp8Kernels>(*MakeCpuPacker())->QuantizeBands(tasks);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ((*bad)[0], 0);
  EXPECT_EQ((*bad)[1], 1);
  const Status s = sync_internal::Fp8BandsStatus(e, rx.plan, rx.bound.bindings, *bad);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(rx.bound.bindings[b.param].name));
  EXPECT_THAT(s.message(), HasSubstr("non-finite"));
  EXPECT_THAT(s.message(), HasSubstr(b.src.ToString()));
  // The block is marked, not left as it was: scale NaN, bytes 0x7f.
  const DestBinding& sc = rx.bound.bindings[b.scale_param];
  EXPECT_TRUE(
      std::isnan(static_cast<const float*>(sc.data)[RegionStartElement(b.scale_dst, sc.shape)]));
}

// The CPU packer's side of the amax exchange over prepared pairs (session.h): PartialAmax over
// host rows equals Fp8PartialAmax at each task's slot (other entries zero; a NaN ranks above every
// finite value), a task past the value's end is refused, and Upload copies.
TEST(Fp8Staging, CpuPackerTakesPartialAmaxesAndUploads) {
  const int64_t rows = 200, cols = 300;  // 3 column blocks, the last of 44 columns
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = std::sin(0.37 * i) * (1 + i % 7);
  x[150 * cols + 280] = std::nanf("");
  auto packer = MakeCpuPacker();
  std::vector<Fp8AmaxTask> tasks = {{x.data() + 128 * cols, DType::kF32, cols, 22, cols, 1},
                                    {x.data() + 150 * cols, DType::kF32, cols, 50, cols, 5}};
  std::vector<uint32_t> out(9, 0xdeadbeef);
  ASSERT_TRUE(KernelsOf<Fp8Kernels>(*packer)->PartialAmax(tasks, out.data(), 9).ok());
  std::vector<uint32_t> want(9, 0);
  for (const Fp8AmaxTask& t : tasks) {
    const int64_t r0 = (static_cast<const float*>(t.src) - x.data()) / cols;
    PackRegion pr{x.data(), DType::kF32, {rows, cols}, Region::Make({r0, 0}, {t.rows, cols}), 0};
    ASSERT_TRUE(Fp8PartialAmax(pr, want.data() + t.slot).ok());
  }
  EXPECT_EQ(out, want);
  EXPECT_EQ(out[0], 0u);
  EXPECT_TRUE(Fp8AmaxBitsFinite(out[1]) && Fp8AmaxBitsFinite(out[3]));
  EXPECT_FALSE(Fp8AmaxBitsFinite(out[7]));  // the NaN: rank 150's task, column block 2
  EXPECT_EQ(KernelsOf<Fp8Kernels>(*packer)->PartialAmax(tasks, out.data(), 7).code(),
            StatusCode::kInvalidArgument);
  const float scales[3] = {1.5f, 2.5f, 3.5f};
  float dst[3] = {};
  ASSERT_TRUE(packer->Upload(dst, scales, sizeof(scales)).ok());
  EXPECT_EQ(std::memcmp(dst, scales, sizeof(scales)), 0);
}

}  // namespace
}  // namespace shardsync
