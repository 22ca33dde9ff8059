// The block-FP8 planner: exact cover (ValidatePlan) over many layouts, where blocks are
// quantized (sender vs staged), bucket splitting, determinism, and an in-memory execution of whole
// plans with the CPU quantize-pack whose every landed e4m3 byte and scale is compared with the
// independent reference quantizer applied to the trainer's values.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "common/fp8_reference.h"
#include "plan/fp8_planner.h"
#include "plan/planner.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/synthetic.h"

namespace shardsync {
namespace {

// Qwen3-8B's shape at toy size (head_dim 128 so every TP part is on the block grid at tp 2).
ModelSpec TinyQwen3() {
  ModelSpec m;
  m.name = "tiny-qwen3-fp8";
  m.arch = Architecture::kQwen3;
  m.hidden_size = 512;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.head_dim = 128;
  m.num_hidden_layers = 3;
  m.intermediate_size = 768;
  m.vocab_size = 500;  // padded 512: zero-filled rows
  m.qk_norm = true;
  m.quant = QuantConfig{};
  m.quant->origin = "--quant";
  return m;
}

// Qwen3-30B-A3B's shape at toy size: a dense first layer, then MoE.
ModelSpec TinyQwen3Moe() {
  ModelSpec m = TinyQwen3();
  m.name = "tiny-qwen3-moe-fp8";
  m.arch = Architecture::kQwen3Moe;
  m.hidden_size = 256;
  m.num_hidden_layers = 3;
  m.intermediate_size = 512;
  m.num_experts = 4;
  m.moe_intermediate_size = 256;
  m.num_experts_per_tok = 2;
  m.mlp_only_layers = {0};
  m.vocab_size = 300;
  return m;
}

PlanInputs Inputs(const ModelSpec& m, std::string_view trainer, std::string_view rollout,
                  EngineKind engine = EngineKind::kSglang) {
  PlanInputs in;
  in.model = m;
  in.trainer = *ParseTrainerSpec(trainer);
  in.rollout = *ParseRolloutSpec(rollout, engine);
  return in;
}

TEST(Fp8Plan, ExactCoverOverManyLayouts) {
  struct Case {
    ModelSpec (*model)();
    const char* trainer;
    const char* rollout;
    EngineKind engine;
    int64_t bucket;
    DType trainer_dtype;
  } cases[] = {
      {TinyQwen3, "fsdp=4", "dp=1,tp=2,pp=2", EngineKind::kSglang, 512 << 20, DType::kF32},
      {TinyQwen3, "fsdp=3", "dp=1,tp=2,pp=1", EngineKind::kVllm, 64 << 10, DType::kBF16},
      {TinyQwen3, "single", "dp=2,tp=1,pp=3", EngineKind::kSglang, 100 << 10, DType::kF32},
      {TinyQwen3, "hsdp=2x3", "dp=3,tp=2,pp=1", EngineKind::kVllm, 1 << 20, DType::kF32},
      {TinyQwen3, "replicate=3", "dp=1,tp=2,pp=2", EngineKind::kSglang, 1 << 20, DType::kBF16},
      {TinyQwen3, "fsdp=7", "dp=1,tp=1,pp=1", EngineKind::kSglang, 64 << 10, DType::kF32},
      {TinyQwen3Moe, "fsdp=4", "dp=1,tp=2,pp=1,ep=2", EngineKind::kVllm, 512 << 20, DType::kF32},
      {TinyQwen3Moe, "fsdp=4", "dp=1,tp=2,pp=2", EngineKind::kSglang, 64 << 10, DType::kBF16},
      {TinyQwen3Moe, "hsdp=2x2", "dp=1,tp=2,pp=1,ep=2", EngineKind::kSglang, 1 << 20, DType::kF32},
  };
  for (const Case& c : cases) {
    for (Fp8Split split : {Fp8Split::kAmax, Fp8Split::kStage}) {
      PlanInputs in = Inputs(c.model(), c.trainer, c.rollout, c.engine);
      in.options.bucket_bytes = c.bucket;
      in.trainer_dtype = c.trainer_dtype;
      in.options.straddle = split;
      Status st = ValidatePlan(in);
      EXPECT_TRUE(st.ok()) << c.trainer << " -> " << c.rollout << " " << Fp8SplitName(split) << ": "
                           << st.ToString();
    }
  }
}

TEST(Fp8Plan, SendersQuantizeWhereChunksFollowTheGridAndReceiversWhereTheyDoNot) {
  // fsdp=2 on the tiny dense model: every dim 0 (512, 256, 768 rows) splits on the grid.
  auto aligned = SummarizePlan(Inputs(TinyQwen3(), "fsdp=2", "dp=1,tp=2,pp=2"));
  ASSERT_TRUE(aligned.ok()) << aligned.status().ToString();
  EXPECT_EQ(aligned->stage_bytes, 0);
  EXPECT_EQ(aligned->staged_bands, 0);
  EXPECT_GT(aligned->sender_quantized_elements, 0);
  // fsdp=4: k/v_proj (256 rows: 64 per rank) and gate/up (768: 192) straddle.
  PlanInputs staged_in = Inputs(TinyQwen3(), "fsdp=4", "dp=1,tp=2,pp=2");
  staged_in.options.straddle = Fp8Split::kStage;
  auto ragged = SummarizePlan(staged_in);
  ASSERT_TRUE(ragged.ok()) << ragged.status().ToString();
  EXPECT_GT(ragged->staged_bands, 0);
  EXPECT_GT(ragged->stage_bytes, 0);
  EXPECT_GT(ragged->receiver_quantized_elements, 0);
  EXPECT_GT(ragged->max_staging_bytes, 0);
  // Same engine bytes either way; quantized elements split between senders and receivers.
  EXPECT_EQ(aligned->bound_write_bytes, ragged->bound_write_bytes);
  EXPECT_EQ(aligned->sender_quantized_elements,
            ragged->sender_quantized_elements + ragged->receiver_quantized_elements);
  // The wire carries e4m3 + scales for sender-quantized elements: about 1 byte each.
  EXPECT_LT(aligned->quantize_bytes, aligned->sender_quantized_elements * 102 / 100);
  int64_t owned = 0;
  for (const auto& e : aligned->engine_ranks) owned += e.owned_bytes;
  EXPECT_EQ(owned, aligned->bound_write_bytes);
  // Reads: every HF tensor once in the trainer dtype (fp32).
  EXPECT_EQ(aligned->bound_read_bytes, ModelNumElements(TinyQwen3()) * 4);
  EXPECT_EQ(aligned->amax_bands, 0);
  EXPECT_EQ(aligned->exchange_write_bytes, 0);
  // The same layout with the amax exchange (the default): the straddling elements travel as
  // e4m3 (+ one scale row per band), nothing is staged, and the exchange is 4 bytes per block
  // per holder.
  auto amax = SummarizePlan(Inputs(TinyQwen3(), "fsdp=4", "dp=1,tp=2,pp=2"));
  ASSERT_TRUE(amax.ok()) << amax.status().ToString();
  EXPECT_EQ(amax->staged_bands, 0);
  EXPECT_EQ(amax->stage_bytes, 0);
  EXPECT_EQ(amax->max_staging_bytes, 0);
  EXPECT_EQ(amax->receiver_quantized_elements, 0);
  EXPECT_EQ(amax->amax_elements, ragged->receiver_quantized_elements);
  EXPECT_EQ(amax->sender_quantized_elements, ragged->sender_quantized_elements);
  EXPECT_LT(amax->amax_bytes, amax->amax_elements * 102 / 100);
  EXPECT_LT(amax->total_bytes, ragged->total_bytes);
  EXPECT_GT(amax->amax_bands, 0);
  EXPECT_GT(amax->amax_blocks, 0);
  // Two holders per band at fsdp 4 here: each writes its partials once, reads the other's.
  EXPECT_EQ(amax->exchange_write_bytes, 2 * 4 * amax->amax_blocks);
  EXPECT_GT(amax->exchange_read_bytes, 0);
  EXPECT_EQ(amax->bound_write_bytes, ragged->bound_write_bytes);
}

TEST(Fp8Plan, BucketCapSplitsOnBlockBoundaries) {
  PlanInputs in = Inputs(TinyQwen3(), "fsdp=1", "dp=1,tp=1,pp=1");
  in.options.bucket_bytes = 64 << 10;  // < 128 rows of a 768-column weight
  ASSERT_TRUE(ValidatePlan(in).ok());
  auto rp = PlanForRank(in, 1);
  ASSERT_TRUE(rp.ok()) << rp.status().ToString();
  int quantize = 0, strided = 0;
  for (const Message& m : rp->recvs) {
    for (const TransferOp& op : m.ops) {
      if (op.encoding != Encoding::kQuantize) continue;
      ++quantize;
      EXPECT_LE(op.bytes, in.options.bucket_bytes);
      EXPECT_EQ(op.src.offset[0] % 128, 0);
      EXPECT_EQ(op.src.offset[1] % 128, 0);
      strided += op.dst.extent[1] < 384 ? 1 : 0;
    }
    for (const Bucket& b : m.buckets) EXPECT_LE(b.bytes, in.options.bucket_bytes);
  }
  EXPECT_GT(quantize, 0);
  EXPECT_GT(strided, 0);  // down_proj rows (768 columns) split by 128-column blocks
  in.options.bucket_bytes = 32 << 10;
  auto bad = PlanForRank(in, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--bucket-mb"), std::string::npos);
}

TEST(Fp8Plan, HashCoversTheQuantConfigAndBf16PlansAreUnchanged) {
  PlanInputs in = Inputs(TinyQwen3(), "fsdp=4", "dp=1,tp=2,pp=2");
  PlanInputs plain = in;
  plain.model.quant.reset();
  EXPECT_NE(PlanHash(in), PlanHash(plain));
  PlanInputs ignored = in;
  ignored.model.quant->ignored_modules = {"lm_head"};
  EXPECT_NE(PlanHash(in), PlanHash(ignored));
  // The split is in FP8 hashes (staged plans keep their hashes: the key is written only for
  // amax), not in bf16 ones.
  PlanInputs staged = in;
  staged.options.straddle = Fp8Split::kStage;
  EXPECT_NE(PlanHash(in), PlanHash(staged));
  PlanInputs plain_staged = plain;
  plain_staged.options.straddle = Fp8Split::kStage;
  EXPECT_EQ(PlanHash(plain), PlanHash(plain_staged));
  // The bf16 hash documented in docs/cli.md before FP8 existed.
  PlanInputs doc;
  doc.model = *LoadModelSpec("qwen3-30b-a3b");
  doc.trainer = *ParseTrainerSpec("fsdp=8");
  doc.rollout = *ParseRolloutSpec("dp=2,tp=2,pp=2", EngineKind::kSglang);
  EXPECT_EQ(PlanHash(doc), "cfce491aa55a4297cc15a765adc89cba");
  // Deterministic, and every rank agrees on the hash.
  auto a = PlanForRank(in, 5), b = PlanForRank(in, 5);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->plan_hash, PlanHash(in));
  ASSERT_EQ(a->recvs.size(), b->recvs.size());
  for (size_t i = 0; i < a->recvs.size(); ++i) EXPECT_EQ(a->recvs[i].bytes, b->recvs[i].bytes);
}

TEST(Fp8Plan, TheCopyPlannerRefusesQuantizedModels) {
  // A quantized model's plan is the codec's (its context dispatches to it): the copy planner,
  // whose ops would land plain copies into e4m3 weights, refuses it, and the codec's planner
  // refuses a model without a quantization config.
  PlanInputs in = Inputs(TinyQwen3(), "fsdp=4", "dp=1,tp=2,pp=2");
  auto ctx = plan_internal::MakeContext(in);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  EXPECT_EQ(ctx->codec().name(), "block-FP8");
  auto copy = ctx->PlanForRank(0);
  ASSERT_FALSE(copy.ok());
  EXPECT_EQ(copy.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(copy.status().message().find("block-FP8"), std::string::npos);
  auto detailed = SummarizePlanDetailed(in, SummaryOptions{});
  ASSERT_FALSE(detailed.ok());
  EXPECT_EQ(detailed.status().code(), StatusCode::kUnimplemented);
  auto rp = PlanForRank(in, 0);
  ASSERT_TRUE(rp.ok()) << rp.status().ToString();
  bool quantize = false;
  for (const Message& m : rp->sends) {
    for (const TransferOp& op : m.ops) quantize = quantize || op.encoding == Encoding::kQuantize;
  }
  EXPECT_TRUE(quantize);
  PlanInputs plain = in;
  plain.model.quant.reset();
  EXPECT_EQ(plan_internal::Fp8Context::Build(plain).status().code(),
            StatusCode::kFailedPrecondition);
  auto bf16 = PlanForRank(plain, 0);
  ASSERT_TRUE(bf16.ok()) << bf16.status().ToString();
  for (const Message& m : bf16->sends) {
    for (const TransferOp& op : m.ops) EXPECT_EQ(op.encoding, Encoding::kCopy);
  }
}

// ---- in-memory execution of a whole plan ----

std::vector<uint8_t> ToDType(const std::vector<float>& f, DType t) {
  std::vector<uint8_t> out(f.size() * DTypeSize(t));
  for (size_t i = 0; i < f.size(); ++i) {
    if (t == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &f[i], 4);
    } else {
      const uint16_t h = t == DType::kBF16 ? F32ToBF16(f[i]) : F32ToF16(f[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

float FromDType(const uint8_t* p, DType t) {
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == DType::kBF16 ? BF16ToF32(h) : F16ToF32(h);
}

void Cast(const uint8_t* in, DType a, uint8_t* out, DType b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = FromDType(in + i * DTypeSize(a), a);
    if (b == DType::kF32) {
      std::memcpy(out + 4 * i, &v, 4);
    } else {
      const uint16_t h = b == DType::kBF16 ? F32ToBF16(v) : F32ToF16(v);
      std::memcpy(out + 2 * i, &h, 2);
    }
  }
}

// Copies `bytes` region-wise between a contiguous buffer and a region of a row-major tensor.
void Scatter(const uint8_t* src, uint8_t* base, const Shape& shape, const Region& r, int es) {
  ForEachRun(r, shape, [&](int64_t off, int64_t len) {
    std::memcpy(base + off * es, src, len * es);
    src += len * es;
  });
}

struct ExecResult {
  int64_t fp8_bytes_checked = 0, scales_checked = 0, copies_checked = 0;
  int64_t mismatches = 0;
  int64_t buckets = 0;
  int64_t amax_ops = 0;  // kAmax ops packed
  std::string first_mismatch;
};

ExecResult Execute(const PlanInputs& in, uint64_t seed) {
  ExecResult res;
  auto ctx_or = plan_internal::Fp8Context::Build(in);
  EXPECT_TRUE(ctx_or.ok()) << ctx_or.status().ToString();
  const auto& ctx = *ctx_or;
  const auto& inv = ctx.inventory();
  const int S = ctx.trainer_world(), E = ctx.engine_per_replica(), D = ctx.replicas();
  const DType td = in.trainer_dtype, wd = in.options.wire_dtype;
  // The trainer's values: synthetic, held in the trainer dtype. FSDP-like ranks hold a dim-0
  // shard per HF tensor; Megatron ranks their local parameters (garbage where no piece lands).
  struct Held {
    std::vector<uint8_t> data;
    Shape shape;
    Region hf;  // FSDP-like: the HF region held
  };
  std::vector<std::vector<Held>> shard(S);
  for (int t = 0; t < S; ++t) {
    if (ctx.megatron()) {
      auto tp = BuildTrainerParams(in.model, in.trainer, t, td);
      EXPECT_TRUE(tp.ok()) << tp.status().ToString();
      for (const TrainerParam& p : tp->params) {
        Held h;
        h.shape = p.shape;
        h.data.assign(p.numel() * DTypeSize(td), 0x5a);
        for (const TrainerPiece& pc : p.pieces) {
          const auto it = std::find_if(inv.begin(), inv.end(),
                                       [&](const HfTensor& x) { return x.name == pc.source; });
          std::vector<float> f(pc.src.numel());
          FillSyntheticRegion(seed, pc.source, it->shape, pc.src, f.data());
          const auto typed = ToDType(f, td);
          Scatter(typed.data(), h.data.data(), h.shape, pc.local, DTypeSize(td));
        }
        shard[t].push_back(std::move(h));
      }
      continue;
    }
    for (size_t i = 0; i < inv.size(); ++i) {
      Held h;
      h.hf = TrainerHeldRegion(in.trainer, t, inv[i].shape);
      h.shape = h.hf.extents();
      std::vector<float> f(h.hf.numel());
      FillSyntheticRegion(seed, inv[i].name, inv[i].shape, h.hf, f.data());
      h.data = ToDType(f, td);
      shard[t].push_back(std::move(h));
    }
  }
  // The amax exchange (kAmax): every trainer rank's partials over the rows it holds of each
  // straddling band, then each band's scales from the max over its holders' partials.
  std::vector<RankPlan> tplans;
  std::vector<std::vector<uint32_t>> partials(S);
  for (int t = 0; t < S; ++t) {
    auto rp = ctx.PlanForRank(t);
    EXPECT_TRUE(rp.ok());
    partials[t].assign(rp->amax_blocks, 0);
    for (const AmaxBand& b : rp->amax_bands) {
      const Held& h = shard[t][b.tensor];
      PackRegion pr{h.data.data(), td, h.shape,
                    Region::Make({b.own0 - h.hf.offset[0], 0}, {b.own_rows, h.shape[1]}), 0};
      EXPECT_TRUE(Fp8PartialAmax(pr, partials[t].data() + b.slot).ok());
    }
    tplans.push_back(std::move(*rp));
  }
  auto band_scales = [&](int t, const TransferOp& op) {
    const RankPlan& rp = tplans[t];
    const auto it = std::find_if(rp.amax_bands.begin(), rp.amax_bands.end(), [&](const auto& b) {
      return b.tensor == op.tensor && b.row0 == op.src.offset[0] / 128 * 128;
    });
    EXPECT_NE(it, rp.amax_bands.end());
    std::vector<float> sc;
    for (int64_t cb = op.src.offset[1] / 128; cb * 128 < op.src.offset[1] + op.src.extent[1];
         ++cb) {
      uint32_t m = partials[t][it->slot + cb];
      for (const AmaxHolder& o : it->others) m = std::max(m, partials[o.rank][o.slot + cb]);
      sc.push_back(Fp8BlockScale(Fp8BitsFloat(m)));
    }
    return sc;
  };
  // Senders: pack every bucket with the fused CPU quantize-pack; the fused checksum terms must
  // equal the checksum of the bucket's bytes.
  std::map<std::pair<int, int>, std::vector<uint8_t>> wires;
  for (int t = 0; t < S; ++t) {
    const RankPlan* rp = &tplans[t];
    for (const Message& m : rp->sends) {
      std::vector<uint8_t> wire(m.bytes, 0);
      for (const Bucket& b : m.buckets) {
        uint64_t sum = 0;
        for (int32_t i = b.op_begin; i < b.op_end; ++i) {
          const TransferOp& op = m.ops[i];
          EXPECT_EQ(m.local.size(), ctx.megatron() ? m.ops.size() : 0);
          const Held& h = shard[t][ctx.megatron() ? m.local[i].param : op.tensor];
          PackRegion pr;
          pr.base = h.data.data();
          pr.dtype = td;
          pr.shape = h.shape;
          pr.region = ctx.megatron() ? m.local[i].region : op.src;
          for (int d = 0; !ctx.megatron() && d < op.src.ndim; ++d) {
            pr.region.offset[d] -= h.hf.offset[d];
          }
          pr.wire_offset = op.wire_offset - b.wire_offset;
          uint8_t* out = wire.data() + op.wire_offset;
          if (op.encoding == Encoding::kQuantize) {
            auto r = Fp8QuantizePack(pr, out);
            EXPECT_TRUE(r.ok()) << r.status().ToString();
            EXPECT_EQ(r->nonfinite, 0);
            sum += r->sum;
            continue;
          }
          if (op.encoding == Encoding::kAmax) {
            ++res.amax_ops;
            const std::vector<float> sc = band_scales(t, op);
            auto r = Fp8QuantizePackScaled(pr, sc.data(), op.scale_param >= 0, out);
            EXPECT_TRUE(r.ok()) << r.status().ToString();
            EXPECT_EQ(r->nonfinite, 0);
            sum += r->sum;
            continue;
          }
          const int es = DTypeSize(td);
          std::vector<uint8_t> vals;
          ForEachRun(pr.region, pr.shape, [&](int64_t off, int64_t len) {
            vals.insert(vals.end(), h.data.begin() + off * es, h.data.begin() + (off + len) * es);
          });
          if (op.encoding == Encoding::kCopy) {
            Cast(vals.data(), td, out, wd, op.src.numel());
          } else {
            std::memcpy(out, vals.data(), vals.size());
          }
          sum += ChecksumPartial(out, op.bytes, pr.wire_offset);
        }
        EXPECT_EQ(ChecksumFinish(sum, b.bytes), Checksum(wire.data() + b.wire_offset, b.bytes));
        ++res.buckets;
      }
      wires[{m.src, m.dst}] = std::move(wire);
    }
  }
  // Receivers: land, quantize staged bands, then compare with the reference quantizer.
  std::map<std::string, fp8_reference::Quantized> refq;  // per HF tensor, computed once
  for (int j = 0; j < D * E; ++j) {
    const EngineRankShards& rank = ctx.map().ranks[j % E];
    auto rp = ctx.PlanForRank(S + j);
    EXPECT_TRUE(rp.ok());
    std::vector<std::vector<uint8_t>> params(rank.params.size());
    for (size_t p = 0; p < params.size(); ++p) {
      params[p].assign(rank.params[p].bytes(), 0xa5);
    }
    std::vector<uint8_t> staging(rp->staging_bytes, 0);
    for (const Message& m : rp->recvs) {
      const std::vector<uint8_t>& wire = wires.at({m.src, m.dst});
      for (const TransferOp& op : m.ops) {
        const uint8_t* w = wire.data() + op.wire_offset;
        const EngineParam& p = rank.params[op.param];
        switch (op.encoding) {
          case Encoding::kCopy: {
            std::vector<uint8_t> v(op.dst.numel() * DTypeSize(p.dtype));
            Cast(w, wd, v.data(), p.dtype, op.dst.numel());
            Scatter(v.data(), params[op.param].data(), p.shape, op.dst, DTypeSize(p.dtype));
            break;
          }
          case Encoding::kAmax:
          case Encoding::kQuantize: {
            Scatter(w, params[op.param].data(), p.shape, op.dst, 1);
            if (op.scale_param < 0) break;
            const int64_t fp8 = (op.dst.numel() + 7) & ~int64_t{7};
            Scatter(w + fp8, params[op.scale_param].data(), rank.params[op.scale_param].shape,
                    op.scale_dst, 4);
            break;
          }
          case Encoding::kStage: {
            const StagedBand& band = rp->staged[op.stage];
            Scatter(w, staging.data() + band.staging_offset,
                    {band.src.extent[0], band.src.extent[1]}, op.dst, DTypeSize(td));
            break;
          }
        }
      }
    }
    for (const StagedBand& band : rp->staged) {
      const EngineParam& p = rank.params[band.param];
      const int dr = band.dst.ndim - 2;
      const int64_t rows = band.src.extent[0], cols = band.src.extent[1], C = p.shape.back();
      int64_t start = band.dst.offset[dr] * C + band.dst.offset[dr + 1];
      if (dr == 1) start += band.dst.offset[0] * p.shape[1] * C;
      const uint8_t* st = staging.data() + band.staging_offset;
      for (int64_t c0 = 0; c0 < cols; c0 += 128) {
        int64_t bad = 0;
        const float s = Fp8QuantizeBlock(st + c0 * DTypeSize(td), td, cols, rows,
                                         std::min<int64_t>(128, cols - c0),
                                         params[band.param].data() + start + c0, C, &bad);
        Region one = band.scale_dst;
        one.offset[one.ndim - 1] += c0 / 128;
        one.extent[one.ndim - 1] = 1;
        Scatter(reinterpret_cast<const uint8_t*>(&s), params[band.scale_param].data(),
                rank.params[band.scale_param].shape, one, 4);
      }
    }
    for (size_t pi = 0; pi < rank.params.size(); ++pi) {
      for (const ZeroFill& z : rank.params[pi].zero_fills) {
        std::vector<uint8_t> zeros(
            z.dst.numel() * rank.params[pi].bytes() / rank.params[pi].numel(), 0);
        Scatter(zeros.data(), params[pi].data(), rank.params[pi].shape, z.dst,
                DTypeSize(rank.params[pi].dtype));
      }
    }
    // Expected bytes: unquantized params through the trainer and wire dtypes; quantized ones from
    // the reference quantizer on whole HF tensors (trainer values as fp32).
    auto ref_of = [&](const std::string& name,
                      const Shape& shape) -> const fp8_reference::Quantized& {
      auto it = refq.find(name);
      if (it != refq.end()) return it->second;
      std::vector<float> f(NumElements(shape));
      FillSyntheticRegion(seed, name, shape, Region::Full(shape), f.data());
      const auto typed = ToDType(f, td);
      for (size_t i = 0; i < f.size(); ++i) f[i] = FromDType(typed.data() + i * DTypeSize(td), td);
      return refq.emplace(name, fp8_reference::QuantizeMatrix(f.data(), shape[0], shape[1]))
          .first->second;
    };
    for (size_t pi = 0; pi < rank.params.size(); ++pi) {
      const EngineParam& p = rank.params[pi];
      std::vector<uint8_t> want(p.bytes(), 0);
      const int es = DTypeSize(p.dtype);
      for (const Piece& pc : p.pieces) {
        std::vector<uint8_t> v;
        if (p.dtype == DType::kF8E4M3 || p.dtype == DType::kF32) {
          const bool scale = p.dtype == DType::kF32;
          const std::string w = scale ? pc.source.substr(0, pc.source.size() - 10) : pc.source;
          const Shape& hs = inv[std::find_if(inv.begin(), inv.end(),
                                             [&](const HfTensor& h) { return h.name == w; }) -
                                inv.begin()]
                                .shape;
          const auto& q = ref_of(w, hs);
          const Shape src_shape = scale ? Shape{(hs[0] + 127) / 128, (hs[1] + 127) / 128} : hs;
          ForEachRun(pc.src, src_shape, [&](int64_t off, int64_t len) {
            const uint8_t* b =
                scale ? reinterpret_cast<const uint8_t*>(q.scales.data() + off) : q.q.data() + off;
            v.insert(v.end(), b, b + len * es);
          });
        } else {
          const Shape& hs =
              inv[std::find_if(inv.begin(), inv.end(),
                               [&](const HfTensor& h) { return h.name == pc.source; }) -
                  inv.begin()]
                  .shape;
          std::vector<float> f(pc.src.numel());
          FillSyntheticRegion(seed, pc.source, hs, pc.src, f.data());
          const auto typed = ToDType(f, td);
          std::vector<uint8_t> wire(f.size() * DTypeSize(wd));
          Cast(typed.data(), td, wire.data(), wd, pc.src.numel());
          v.resize(f.size() * es);
          Cast(wire.data(), wd, v.data(), p.dtype, pc.src.numel());
        }
        Scatter(v.data(), want.data(), p.shape, pc.dst, es);
      }
      for (size_t k = 0; k < want.size(); ++k) {
        if (params[pi][k] != want[k]) {
          if (res.mismatches++ == 0) {
            res.first_mismatch = fmt::format("sync rank {} '{}' byte {}: {} != {}", S + j, p.name,
                                             k, int{params[pi][k]}, int{want[k]});
          }
        }
      }
      (p.dtype == DType::kF8E4M3 ? res.fp8_bytes_checked
       : p.dtype == DType::kF32  ? res.scales_checked
                                 : res.copies_checked) += static_cast<int64_t>(want.size());
    }
  }
  return res;
}

TEST(Fp8PlanExecution, EveryLandedByteAndScaleEqualsTheReferenceQuantizer) {
  struct Case {
    ModelSpec (*model)();
    const char* trainer;
    const char* rollout;
    EngineKind engine;
    DType trainer_dtype;
    int64_t bucket;
  } cases[] = {
      // The CPU layouts, at toy size: fsdp=4 -> SGLang tp2 pp2, and -> vLLM tp2 ep2.
      {TinyQwen3, "fsdp=4", "dp=1,tp=2,pp=2", EngineKind::kSglang, DType::kF32, 512 << 20},
      {TinyQwen3Moe, "fsdp=4", "dp=1,tp=2,pp=1,ep=2", EngineKind::kVllm, DType::kF32, 512 << 20},
      // bf16 trainer, small buckets, ragged chunks, replicas.
      {TinyQwen3Moe, "fsdp=3", "dp=1,tp=2,pp=2", EngineKind::kSglang, DType::kBF16, 64 << 10},
      {TinyQwen3, "hsdp=2x3", "dp=2,tp=2,pp=1", EngineKind::kVllm, DType::kBF16, 96 << 10},
  };
  for (const Case& c : cases) {
    for (Fp8Split split : {Fp8Split::kAmax, Fp8Split::kStage}) {
      PlanInputs in = Inputs(c.model(), c.trainer, c.rollout, c.engine);
      in.trainer_dtype = c.trainer_dtype;
      in.options.bucket_bytes = c.bucket;
      in.options.straddle = split;
      const ExecResult r = Execute(in, 17);
      EXPECT_EQ(r.mismatches, 0) << c.trainer << " -> " << c.rollout << " " << Fp8SplitName(split)
                                 << ": " << r.first_mismatch;
      EXPECT_GT(r.fp8_bytes_checked, 100000);
      EXPECT_GT(r.scales_checked, 0);
      EXPECT_GT(r.copies_checked, 0);
      EXPECT_GT(r.buckets, 0);
    }
  }
}

// Qwen3-30B-A3B's 768-row experts at toy width (tp 2: 384 rows per engine rank, on the grid).
ModelSpec TinyQwen3Moe768() {
  ModelSpec m = TinyQwen3Moe();
  m.moe_intermediate_size = 768;
  return m;
}

TEST(Fp8PlanExecution, AmaxExchangeLandsTheReferenceBytesWhereSeveralRanksShareABlock) {
  struct Case {
    ModelSpec (*model)();
    const char* trainer;
    const char* rollout;
    EngineKind engine;
    DType trainer_dtype;
    int64_t bucket;
    int min_holders;  // most trainer ranks sharing one band
  } cases[] = {
      // fsdp=4 with 768-row experts: 192 rows per rank, bands [128, 256) and [512, 640) shared.
      {TinyQwen3Moe768, "fsdp=4", "dp=1,tp=2,pp=1,ep=2", EngineKind::kVllm, DType::kF32, 512 << 20,
       2},
      {TinyQwen3Moe768, "fsdp=4", "dp=1,tp=2,pp=2", EngineKind::kSglang, DType::kBF16, 64 << 10, 2},
      // Chunks smaller than a block: 256-row experts at fsdp 8 (32 rows each: 4 holders per band),
      // the dense toy at fsdp 12 (43 rows of 512: 3 or 4 holders), with replica groups, ragged
      // chunks and caps that split bands by columns.
      {TinyQwen3Moe, "fsdp=8", "dp=1,tp=2,pp=1,ep=2", EngineKind::kVllm, DType::kF32, 512 << 20, 4},
      {TinyQwen3, "fsdp=12", "dp=1,tp=2,pp=2", EngineKind::kSglang, DType::kF32, 64 << 10, 3},
      {TinyQwen3Moe, "hsdp=2x6", "dp=2,tp=2,pp=1", EngineKind::kSglang, DType::kBF16, 96 << 10, 3},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} -> {} {}", c.trainer, EngineKindName(c.engine), c.rollout));
    PlanInputs in = Inputs(c.model(), c.trainer, c.rollout, c.engine);
    in.trainer_dtype = c.trainer_dtype;
    in.options.bucket_bytes = c.bucket;
    const Status st = ValidatePlan(in);
    EXPECT_TRUE(st.ok()) << st.ToString();
    auto sum = SummarizePlan(in);
    ASSERT_TRUE(sum.ok()) << sum.status().ToString();
    EXPECT_EQ(sum->staged_bands, 0);
    EXPECT_EQ(sum->max_staging_bytes, 0);
    EXPECT_GT(sum->amax_elements, 0);
    size_t holders = 0;
    for (int t = 0; t < in.trainer.world(); ++t) {
      auto rp = PlanForRank(in, t);
      ASSERT_TRUE(rp.ok());
      for (const AmaxBand& b : rp->amax_bands) holders = std::max(holders, b.others.size() + 1);
    }
    EXPECT_GE(holders, static_cast<size_t>(c.min_holders));
    const ExecResult r = Execute(in, 29);
    EXPECT_EQ(r.mismatches, 0) << r.first_mismatch;
    EXPECT_GT(r.amax_ops, 0);
    EXPECT_GT(r.fp8_bytes_checked, 100000);
    EXPECT_GT(r.scales_checked, 0);
  }
}

// ---- Megatron-Core trainers ----

// The dense toy with 4 layers (pp 2, vpp 2) or 6 (pp 4 with uneven first / last stages).
ModelSpec TinyQwen3Layers(int64_t layers) {
  ModelSpec m = TinyQwen3();
  m.num_hidden_layers = layers;
  return m;
}
ModelSpec TinyQwen3L4() { return TinyQwen3Layers(4); }
ModelSpec TinyQwen3L6() { return TinyQwen3Layers(6); }

struct MegatronCase {
  ModelSpec (*model)();
  const char* trainer;
  const char* rollout;
  EngineKind engine;
  DType trainer_dtype;
  int64_t bucket;
};

// The Megatron layouts -> SGLang tp2 pp2 / vLLM tp2 (ep2 for the MoE), plus DP replicas
// on both sides, a bf16 trainer and small buckets.
const MegatronCase kMegatronCases[] = {
    {TinyQwen3L4, "megatron=tp=2,pp=2", "dp=1,tp=2,pp=2", EngineKind::kSglang, DType::kF32,
     512 << 20},
    {TinyQwen3L4, "megatron=tp=2,pp=2,vpp=2", "dp=1,tp=2,pp=2", EngineKind::kSglang, DType::kF32,
     512 << 20},
    {TinyQwen3L6, "megatron=tp=1,pp=4,first=1,last=1", "dp=1,tp=2,pp=2", EngineKind::kSglang,
     DType::kBF16, 64 << 10},
    {TinyQwen3L4, "megatron=tp=2,pp=2,dp=2", "dp=2,tp=2,pp=1", EngineKind::kVllm, DType::kBF16,
     96 << 10},
    {TinyQwen3Moe, "megatron=tp=2,pp=1,ep=2,etp=1", "dp=1,tp=2,pp=1,ep=2", EngineKind::kVllm,
     DType::kF32, 512 << 20},
    {TinyQwen3Moe, "megatron=tp=2,pp=1,ep=2,etp=1", "dp=1,tp=2,pp=1", EngineKind::kSglang,
     DType::kF32, 512 << 20},
    {TinyQwen3Moe, "megatron=tp=2,ep=2,etp=2,dp=2", "dp=1,tp=2,pp=1,ep=2", EngineKind::kSglang,
     DType::kBF16, 64 << 10},
};

TEST(Fp8PlanMegatron, ExactCoverAndEveryLandedByteEqualsTheReferenceQuantizer) {
  for (const MegatronCase& c : kMegatronCases) {
    SCOPED_TRACE(fmt::format("{} -> {} {}", c.trainer, EngineKindName(c.engine), c.rollout));
    PlanInputs in = Inputs(c.model(), c.trainer, c.rollout, c.engine);
    in.trainer_dtype = c.trainer_dtype;
    in.options.bucket_bytes = c.bucket;
    const Status st = ValidatePlan(in);
    EXPECT_TRUE(st.ok()) << st.ToString();
    auto sum = SummarizePlan(in);
    ASSERT_TRUE(sum.ok()) << sum.status().ToString();
    // Megatron ranks hold whole blocks: every quantized element by a sender, nothing staged.
    EXPECT_EQ(sum->staged_bands, 0);
    EXPECT_EQ(sum->stage_bytes, 0);
    EXPECT_GT(sum->sender_quantized_elements, 0);
    EXPECT_EQ(sum->bound_read_bytes, ModelNumElements(in.model) * DTypeSize(c.trainer_dtype));
    const ExecResult r = Execute(in, 23);
    EXPECT_EQ(r.mismatches, 0) << r.first_mismatch;
    EXPECT_GT(r.fp8_bytes_checked, 100000);
    EXPECT_GT(r.scales_checked, 0);
    EXPECT_GT(r.copies_checked, 0);
  }
}

TEST(Fp8PlanMegatron, SendersReadLocalParametersAndReplicasShareTheWork) {
  PlanInputs in = Inputs(TinyQwen3L4(), "megatron=tp=2,pp=2,dp=2", "dp=1,tp=2,pp=2");
  auto sum = SummarizePlan(in);
  ASSERT_TRUE(sum.ok()) << sum.status().ToString();
  ASSERT_EQ(sum->trainer_ranks.size(), 8u);
  // Every rank of the 2 x 2 x dp 2 grid sends: the two DP replicas of each (tp, pp) split it.
  for (const auto& t : sum->trainer_ranks) EXPECT_GT(t.send_bytes, 0) << "rank " << t.rank;
  // Dense rank numbering tp-cp-ep-dp-pp: ranks 0 and 2 are the dp replicas of (tp 0, pp 0).
  const double a = static_cast<double>(sum->trainer_ranks[0].send_bytes);
  const double b = static_cast<double>(sum->trainer_ranks[2].send_bytes);
  EXPECT_LT(std::abs(a - b) / (a + b), 0.25) << a << " vs " << b;
  // Ops carry the local region of linear_qkv / linear_fc1 etc., not HF slabs.
  auto rp = PlanForRank(in, 0);
  ASSERT_TRUE(rp.ok()) << rp.status().ToString();
  auto tp = BuildTrainerParams(in.model, in.trainer, 0, in.trainer_dtype);
  ASSERT_TRUE(tp.ok());
  bool qkv = false;
  for (const Message& m : rp->sends) {
    ASSERT_EQ(m.local.size(), m.ops.size());
    for (size_t i = 0; i < m.ops.size(); ++i) {
      const TrainerParam& p = tp->params[m.local[i].param];
      EXPECT_TRUE(RegionInside(m.local[i].region, p.shape));
      if (p.name.find("linear_qkv.weight") != std::string::npos &&
          m.ops[i].encoding == Encoding::kQuantize) {
        qkv = true;
      }
    }
  }
  EXPECT_TRUE(qkv);
  // Deterministic; a Megatron FP8 plan has its own hash (the bf16 and FSDP ones are pinned above).
  EXPECT_EQ(PlanForRank(in, 0)->sends.size(), rp->sends.size());
  PlanInputs fsdp = Inputs(TinyQwen3L4(), "fsdp=8", "dp=1,tp=2,pp=2");
  PlanInputs plain = in;
  plain.model.quant.reset();
  EXPECT_NE(PlanHash(in), PlanHash(fsdp));
  EXPECT_NE(PlanHash(in), PlanHash(plain));
  EXPECT_EQ(rp->plan_hash, PlanHash(in));
}

TEST(Fp8PlanMegatron, ShardsThatCutBlocksAreRefusedNamingTensorRowsAndRank) {
  // tp 4: linear_fc1 holds 768 / 4 = 192 rows of gate_proj per rank, inside SGLang tp 2's
  // 384-row part.
  PlanInputs in = Inputs(TinyQwen3(), "megatron=tp=4,pp=1", "dp=1,tp=2,pp=1");
  auto rp = PlanForRank(in, 0);
  ASSERT_FALSE(rp.ok());
  EXPECT_EQ(rp.status().code(), StatusCode::kInvalidArgument);
  const std::string msg(rp.status().message());
  EXPECT_NE(msg.find("--trainer megatron=tp=4,pp=1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Megatron rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rows [0, 192)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'model.layers.0.mlp.gate_proj.weight'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("linear_fc1.weight"), std::string::npos) << msg;
  EXPECT_FALSE(SummarizePlan(in).ok());
  EXPECT_FALSE(ValidatePlan(in).ok());
  // head_dim 64: a k head is 64 rows of a 128-row block, and Megatron tp 2 holds one kv head of
  // each block per rank.
  ModelSpec h64 = TinyQwen3();
  h64.num_attention_heads = 8;
  h64.head_dim = 64;
  auto small = PlanForRank(Inputs(h64, "megatron=tp=2,pp=1", "dp=1,tp=1,pp=1"), 0);
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("k_proj.weight"), std::string::npos)
      << small.status().message();
  // The same models plan in bf16.
  in.model.quant.reset();
  EXPECT_TRUE(PlanForRank(in, 0).ok());
}

}  // namespace
}  // namespace shardsync
