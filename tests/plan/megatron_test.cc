// Megatron-Core trainer layouts: parsing, rank coordinates, layer assignment, the trainer map's
// names and shapes, and a round trip: every trainer rank's local tensors are packed from seeded
// HF values by an implementation of Megatron's packing written here from Megatron's formulas (not
// from the trainer map), the plan's ops are executed (local region -> engine region), and every
// engine element must equal what the engine shard map says it holds.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <functional>
#include <map>
#include <set>

#include "plan/megatron_models.h"
#include "plan/planner.h"
#include "shardsync/plan.h"

namespace shardsync {
namespace {

// ---- small models with the real configs' structure (megatron_models.h) ----

ModelSpec Qwen3_8B() { return testing::SmallQwen3_8B(); }
ModelSpec Llama31_8B() { return testing::SmallLlama31_8B(); }
ModelSpec Qwen3_30B_A3B() { return testing::SmallQwen3_30B_A3B(); }
ModelSpec Qwen3_06B_Tied() { return testing::SmallQwen3_06B_Tied(); }

TrainerSpec Megatron(const std::string& s) {
  auto t = ParseTrainerSpec("megatron=" + s);
  EXPECT_TRUE(t.ok()) << s << ": " << t.status().ToString();
  return t.ok() ? *t : TrainerSpec{};
}

// ---- an independent Megatron: coordinates, layers, packing ----

// Megatron's global rank of dense / expert coordinates: RankGenerator order tp-cp-ep-dp-pp
// (parallel_state.py), enumerated here by nested loops, fastest first.
struct Coords {
  int tp, cp, dp, pp, etp, ep, edp;
};
std::vector<Coords> EnumerateRanks(const MegatronLayout& m) {
  const int world = m.tp * m.cp * m.dp * m.pp;
  std::vector<Coords> out(world);
  int r = 0;
  for (int pp = 0; pp < m.pp; ++pp)
    for (int dp = 0; dp < m.dp; ++dp)
      for (int cp = 0; cp < m.cp; ++cp)
        for (int tp = 0; tp < m.tp; ++tp) {
          out[r].tp = tp, out[r].cp = cp, out[r].dp = dp, out[r].pp = pp;
          ++r;
        }
  const int edp_n = world / (m.etp * m.ep * m.pp);
  r = 0;
  for (int pp = 0; pp < m.pp; ++pp)
    for (int edp = 0; edp < edp_n; ++edp)
      for (int ep = 0; ep < m.ep; ++ep)
        for (int etp = 0; etp < m.etp; ++etp) {
          out[r].etp = etp, out[r].ep = ep, out[r].edp = edp;
          EXPECT_EQ(out[r].pp, pp);
          ++r;
        }
  return out;
}

// Layers of every (pp, chunk): Megatron's documented assignment, built by dealing layers out
// stage by stage per virtual round (transformer_block.py comment: 8 layers, 2 stages, vpp 2 ->
// stage 0 [0,1] [4,5], stage 1 [2,3] [6,7]); uneven first/last stages take their counts.
std::vector<std::vector<std::vector<int64_t>>> DealLayers(const MegatronLayout& m, int64_t L) {
  std::vector<int64_t> per_stage(m.pp);
  if (m.first == 0 && m.last == 0) {
    for (auto& n : per_stage) n = L / m.pp;
  } else {
    const int mids = m.pp - (m.first > 0) - (m.last > 0);
    const int64_t mid = (L - m.first - m.last) / std::max(mids, 1);
    for (int p = 0; p < m.pp; ++p) per_stage[p] = mid;
    if (m.first > 0) per_stage[0] = m.first;
    if (m.last > 0) per_stage[m.pp - 1] = m.last;
  }
  std::vector<std::vector<std::vector<int64_t>>> out(m.pp,
                                                     std::vector<std::vector<int64_t>>(m.vpp));
  int64_t next = 0;
  for (int v = 0; v < m.vpp; ++v) {
    for (int p = 0; p < m.pp; ++p) {
      for (int64_t i = 0; i < per_stage[p] / m.vpp; ++i) out[p][v].push_back(next++);
    }
  }
  EXPECT_EQ(next, L);
  return out;
}

// Values: HF element e of tensor t is (t + 1) << 32 | e; padding rows -1; never written -2.
constexpr int64_t kPad = -1, kUnset = -2;
int64_t Id(int64_t tensor, int64_t elem) { return ((tensor + 1) << 32) | elem; }

struct Tensor {
  Shape shape;
  std::vector<int64_t> v;
  int64_t rows() const { return shape[0]; }
  int64_t cols() const { return shape.size() > 1 ? shape[1] : 1; }
};

class Hf {
 public:
  explicit Hf(const ModelSpec& m) : inv_(HfTensorInventory(m)) {
    for (size_t i = 0; i < inv_.size(); ++i) index_[inv_[i].name] = static_cast<int64_t>(i);
  }
  Tensor Get(const std::string& name) const {
    const int64_t t = index_.at(name);
    Tensor x{inv_[t].shape, {}};
    x.v.resize(inv_[t].numel());
    for (int64_t e = 0; e < inv_[t].numel(); ++e) x.v[e] = Id(t, e);
    return x;
  }
  const std::vector<HfTensor>& inv() const { return inv_; }

 private:
  std::vector<HfTensor> inv_;
  std::map<std::string, int64_t> index_;
};

Tensor RowsOf(const Tensor& a, int64_t r0, int64_t n) {
  Tensor o{a.shape, {}};
  o.shape[0] = n;
  o.v.assign(a.v.begin() + r0 * a.cols(), a.v.begin() + (r0 + n) * a.cols());
  return o;
}
Tensor ColsOf(const Tensor& a, int64_t c0, int64_t n) {
  Tensor o{{a.rows(), n}, {}};
  for (int64_t r = 0; r < a.rows(); ++r) {
    for (int64_t c = 0; c < n; ++c) o.v.push_back(a.v[r * a.cols() + c0 + c]);
  }
  return o;
}
Tensor Cat(const std::vector<Tensor>& parts) {  // along dim 0
  Tensor o{parts[0].shape, {}};
  o.shape[0] = 0;
  for (const Tensor& p : parts) {
    o.shape[0] += p.rows();
    o.v.insert(o.v.end(), p.v.begin(), p.v.end());
  }
  return o;
}
Tensor PadRows(const Tensor& a, int64_t rows) {
  Tensor o = a;
  o.shape[0] = rows;
  o.v.resize(rows * a.cols(), kPad);
  return o;
}

// One Megatron rank's local tensors ("chunk:name" -> tensor), from Megatron's formulas.
std::map<std::string, Tensor> PackRank(const ModelSpec& model, const MegatronLayout& m,
                                       const Coords& c) {
  Hf hf(model);
  std::map<std::string, Tensor> out;
  const int64_t tp = m.tp, np = model.num_attention_heads, ng = model.num_key_value_heads,
                hd = model.head_dim, V = model.vocab_size;
  const int64_t mult = int64_t{m.vocab_div} * m.tp;
  const int64_t Vp = (V + mult - 1) / mult * mult;  // vocab_size_with_padding
  auto vocab = [&](const std::string& hf_name) {
    return RowsOf(PadRows(hf.Get(hf_name), Vp), c.tp * Vp / tp, Vp / tp);  // VocabParallel
  };
  auto col_split = [&](const Tensor& full, int64_t ranks, int64_t r) {  // ColumnParallel
    return RowsOf(full, r * full.rows() / ranks, full.rows() / ranks);
  };
  auto row_split = [&](const Tensor& full, int64_t ranks, int64_t r) {  // RowParallel
    return ColsOf(full, r * full.cols() / ranks, full.cols() / ranks);
  };
  auto swiglu = [&](const Tensor& gate, const Tensor& up, int64_t ranks, int64_t r) {
    return Cat({col_split(gate, ranks, r), col_split(up, ranks, r)});  // [gate_r; up_r]
  };
  const auto layers = DealLayers(m, model.num_hidden_layers);
  const bool te = !m.local_norms;
  for (int v = 0; v < m.vpp; ++v) {
    auto put = [&](const std::string& name, Tensor t) {
      out[fmt::format("{}:{}", v, name)] = std::move(t);
    };
    const bool pre = c.pp == 0 && v == 0, post = c.pp == m.pp - 1 && v == m.vpp - 1;
    if (pre) put("embedding.word_embeddings.weight", vocab("model.embed_tokens.weight"));
    for (size_t i = 0; i < layers[c.pp][v].size(); ++i) {
      const int64_t l = layers[c.pp][v][i];
      const std::string p = fmt::format("decoder.layers.{}.", i);
      const std::string h = fmt::format("model.layers.{}.", l);
      if (!te) put(p + "input_layernorm.weight", hf.Get(h + "input_layernorm.weight"));
      if (te) {
        put(p + "self_attention.linear_qkv.layer_norm_weight",
            hf.Get(h + "input_layernorm.weight"));
      }
      // Interleaved [q_g (np/ng heads) | k_g | v_g] per query group, then ColumnParallel.
      std::vector<Tensor> groups;
      std::vector<Tensor> bgroups;
      for (int64_t g = 0; g < ng; ++g) {
        for (const char* w : {"weight", "bias"}) {
          if (std::string(w) == "bias" && !model.qkv_bias) continue;
          auto& dst = std::string(w) == "weight" ? groups : bgroups;
          dst.push_back(
              RowsOf(hf.Get(h + "self_attn.q_proj." + w), g * (np / ng) * hd, (np / ng) * hd));
          dst.push_back(RowsOf(hf.Get(h + "self_attn.k_proj." + w), g * hd, hd));
          dst.push_back(RowsOf(hf.Get(h + "self_attn.v_proj." + w), g * hd, hd));
        }
      }
      put(p + "self_attention.linear_qkv.weight", col_split(Cat(groups), tp, c.tp));
      if (model.qkv_bias) {
        put(p + "self_attention.linear_qkv.bias", col_split(Cat(bgroups), tp, c.tp));
      }
      put(p + "self_attention.linear_proj.weight",
          row_split(hf.Get(h + "self_attn.o_proj.weight"), tp, c.tp));
      if (model.qk_norm) {
        put(p + "self_attention.q_layernorm.weight", hf.Get(h + "self_attn.q_norm.weight"));
        put(p + "self_attention.k_layernorm.weight", hf.Get(h + "self_attn.k_norm.weight"));
      }
      const Tensor post_norm = hf.Get(h + "post_attention_layernorm.weight");
      if (!model.IsMoeLayer(l)) {
        put(p + (te ? "mlp.linear_fc1.layer_norm_weight" : "pre_mlp_layernorm.weight"), post_norm);
        put(p + "mlp.linear_fc1.weight",
            swiglu(hf.Get(h + "mlp.gate_proj.weight"), hf.Get(h + "mlp.up_proj.weight"), tp, c.tp));
        put(p + "mlp.linear_fc2.weight", row_split(hf.Get(h + "mlp.down_proj.weight"), tp, c.tp));
        continue;
      }
      put(p + "pre_mlp_layernorm.weight", post_norm);
      put(p + "mlp.router.weight", hf.Get(h + "mlp.gate.weight"));
      const int64_t n = model.num_experts / m.ep;
      for (int64_t i = 0; i < n; ++i) {
        const std::string e = fmt::format("{}mlp.experts.{}.", h, c.ep * n + i);
        Tensor fc1 =
            swiglu(hf.Get(e + "gate_proj.weight"), hf.Get(e + "up_proj.weight"), m.etp, c.etp);
        if (m.glu_interleave > 0) {
          // TEGroupedMLP with moe_mlp_glu_interleave_size G: the forward's
          // _remove_glu_interleaving turns rows [b][s][j] (block b, s 0 gate / 1 up, row j < G)
          // into [s][b][j]; the stored rows are the inverse: row (b, s, j) = [gate; up] row
          // s*per + b*G + j.
          const int64_t per = fc1.rows() / 2, G = m.glu_interleave;
          std::vector<Tensor> blocks;
          for (int64_t b = 0; b < per / G; ++b) {
            for (int64_t half = 0; half < 2; ++half)
              blocks.push_back(RowsOf(fc1, half * per + b * G, G));
          }
          fc1 = Cat(blocks);
        }
        Tensor fc2 = row_split(hf.Get(e + "down_proj.weight"), m.etp, c.etp);
        if (m.sequential_experts) {
          put(fmt::format("{}mlp.experts.local_experts.{}.linear_fc1.weight", p, i), fc1);
          put(fmt::format("{}mlp.experts.local_experts.{}.linear_fc2.weight", p, i), fc2);
        } else {
          put(fmt::format("{}mlp.experts.linear_fc1.weight{}", p, i), fc1);
          put(fmt::format("{}mlp.experts.linear_fc2.weight{}", p, i), fc2);
        }
      }
    }
    if (post) {
      put("decoder.final_layernorm.weight", hf.Get("model.norm.weight"));
      if (!model.tie_word_embeddings) {
        put("output_layer.weight", vocab("lm_head.weight"));
      } else if (!pre) {
        put("output_layer.weight", vocab("model.embed_tokens.weight"));  // the tied copy
      }
    }
  }
  return out;
}

// Reads / writes a region of a row-major tensor in row-major order of the region.
std::vector<int64_t> Read(const Tensor& t, const Region& r) {
  std::vector<int64_t> out;
  ForEachRun(r, t.shape, [&](int64_t off, int64_t len) {
    out.insert(out.end(), t.v.begin() + off, t.v.begin() + off + len);
  });
  return out;
}

// ---- the round trip ----

struct RoundTripResult {
  int64_t ops = 0;
  int64_t bytes = 0;
};

// Executes every trainer rank's sends into fresh engine buffers and checks each engine element
// against the shard map.
void RoundTrip(const PlanInputs& in, RoundTripResult* res) {
  const MegatronLayout& m = in.trainer.megatron;
  const auto coords = EnumerateRanks(m);
  auto ctx = plan_internal::MakeContext(in);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  const ShardMap& map = ctx->map();
  const auto& inv = ctx->inventory();
  const int S = in.trainer.world(), E = static_cast<int>(map.ranks.size()), D = in.rollout.dp;
  // Engine buffers [replica][erank][param].
  std::vector<std::vector<std::vector<Tensor>>> eng(D, std::vector<std::vector<Tensor>>(E));
  for (int d = 0; d < D; ++d) {
    for (int e = 0; e < E; ++e) {
      for (const EngineParam& p : map.ranks[e].params) {
        eng[d][e].push_back(Tensor{p.shape, std::vector<int64_t>(p.numel(), kUnset)});
      }
    }
  }
  for (int r = 0; r < S; ++r) {
    const auto local = PackRank(in.model, m, coords[r]);
    auto tp = BuildTrainerParams(in.model, in.trainer, r, in.trainer_dtype);
    ASSERT_TRUE(tp.ok()) << tp.status().ToString();
    // The trainer map lists exactly the tensors Megatron's formulas build, with their shapes.
    std::set<std::string> listed;
    for (const TrainerParam& p : tp->params) {
      const std::string key = fmt::format("{}:{}", p.chunk, p.name);
      listed.insert(key);
      auto it = local.find(key);
      ASSERT_NE(it, local.end()) << "rank " << r << ": trainer map lists " << key;
      EXPECT_EQ(p.shape, it->second.shape) << key;
    }
    EXPECT_EQ(listed.size(), local.size()) << "rank " << r;
    auto rp = ctx->PlanForRank(r);
    ASSERT_TRUE(rp.ok()) << rp.status().ToString();
    for (const Message& msg : rp->sends) {
      const int j = msg.dst - S, d = j / E, e = j % E;
      ASSERT_EQ(msg.local.size(), msg.ops.size());
      for (size_t oi = 0; oi < msg.ops.size(); ++oi) {
        const TransferOp& op = msg.ops[oi];
        const LocalSource& ls = msg.local[oi];
        const TrainerParam& sp = tp->params.at(ls.param);
        const Tensor& src = local.at(fmt::format("{}:{}", sp.chunk, sp.name));
        ASSERT_TRUE(RegionInside(ls.region, src.shape)) << sp.name;
        const std::vector<int64_t> vals = Read(src, ls.region);
        Tensor& dst = eng[d][e][op.param];
        size_t k = 0;
        ForEachRun(op.dst, dst.shape, [&](int64_t off, int64_t len) {
          for (int64_t i = 0; i < len; ++i, ++k) {
            ASSERT_EQ(dst.v[off + i], kUnset) << "written twice";
            dst.v[off + i] = vals.at(k);
          }
        });
        ASSERT_EQ(k, vals.size());
        ++res->ops;
        res->bytes += op.bytes;
      }
    }
  }
  // Every engine element holds what the shard map says; zero-fills are never written.
  for (int d = 0; d < D; ++d) {
    for (int e = 0; e < E; ++e) {
      for (size_t pi = 0; pi < map.ranks[e].params.size(); ++pi) {
        const EngineParam& p = map.ranks[e].params[pi];
        std::vector<int64_t> want(p.numel(), kUnset);
        for (const Piece& pc : p.pieces) {
          int64_t t = -1;
          for (size_t i = 0; i < inv.size(); ++i) {
            if (inv[i].name == pc.source) t = static_cast<int64_t>(i);
          }
          std::vector<int64_t> ids;
          ForEachRun(pc.src, inv[t].shape, [&](int64_t off, int64_t len) {
            for (int64_t x = 0; x < len; ++x) ids.push_back(Id(t, off + x));
          });
          size_t k = 0;
          ForEachRun(pc.dst, p.shape, [&](int64_t off, int64_t len) {
            for (int64_t x = 0; x < len; ++x) want[off + x] = ids[k++];
          });
        }
        const auto& got = eng[d][e][pi].v;
        for (int64_t i = 0; i < p.numel(); ++i) {
          ASSERT_EQ(got[i], want[i])
              << "replica " << d << " engine rank " << e << " param " << p.name << " element " << i;
        }
      }
    }
  }
}

const char* kLayouts[] = {
    "tp=2,pp=2",
    "tp=4,pp=1",
    "tp=2,pp=2,vpp=2",
    "tp=1,pp=4,first=1,last=3",                      // uneven stages 1,2,2,3
    "tp=2,ep=4,etp=1,dp=2",                          // ep4 etp1
    "tp=2,pp=2,ep=2,etp=2,dp=2,experts=sequential",  // ep2 etp2
    "tp=8",                                          // num_query_groups < tp
    "tp=1,pp=2,cp=2,dp=2,vocab_div=1",               // cp and dp replicas
    "tp=2,pp=2,norms=local",                         // local spec: SequentialMLP experts
    "tp=2,pp=2,ep=2,etp=1,dp=2,glu_interleave=4",    // TEGroupedMLP fc1 rows interleaved
};

struct EngineCase {
  EngineKind engine;
  const char* rollout;
};
const EngineCase kEngines[] = {
    {EngineKind::kSglang, "dp=1,tp=2,pp=2"},      {EngineKind::kSglang, "dp=1,tp=4,pp=1"},
    {EngineKind::kSglang, "dp=2,tp=2,pp=2,ep=2"}, {EngineKind::kVllm, "dp=1,tp=2,pp=2"},
    {EngineKind::kVllm, "dp=1,tp=4,pp=1"},        {EngineKind::kVllm, "dp=2,tp=2,pp=2,ep=2"},
};

class MegatronRoundTrip : public ::testing::TestWithParam<std::string> {};

ModelSpec ModelByName(const std::string& n) {
  if (n == "qwen3_8b") return Qwen3_8B();
  if (n == "llama31_8b") return Llama31_8B();
  if (n == "qwen3_30b_a3b") return Qwen3_30B_A3B();
  return Qwen3_06B_Tied();
}

TEST_P(MegatronRoundTrip, EveryLayoutIntoEveryEngine) {
  const ModelSpec model = ModelByName(GetParam());
  int runs = 0;
  for (const char* layout : kLayouts) {
    // moe_mlp_glu_interleave_size only changes experts: dense models refuse it (ModelErrors).
    if (!model.is_moe() && std::string(layout).find("glu_interleave") != std::string::npos) {
      runs += std::size(kEngines);
      continue;
    }
    for (const EngineCase& ec : kEngines) {
      std::string rollout = ec.rollout;
      if (!model.is_moe() && rollout.find("ep=2") != std::string::npos) {
        rollout = "dp=2,tp=2,pp=2";  // dense models: the same engine without EP
      }
      PlanInputs in;
      in.model = model;
      in.trainer = Megatron(layout);
      in.rollout = ParseRolloutSpec(rollout, ec.engine).value();
      in.options.bucket_bytes = 4096;  // splits the larger ops
      SCOPED_TRACE(fmt::format("{} megatron={} -> {} {}", model.name, layout,
                               EngineKindName(ec.engine), rollout));
      // (a) exact cover, senders hold what they send, summary agrees.
      const Status v = ValidatePlan(in);
      ASSERT_TRUE(v.ok()) << v.ToString();
      // (b) round trip through an independent packing.
      RoundTripResult rt;
      RoundTrip(in, &rt);
      if (HasFatalFailure()) return;
      // (c) byte accounting: each engine rank receives its owned bytes once; trainers send
      // exactly what engines receive.
      auto sum = SummarizePlan(in);
      ASSERT_TRUE(sum.ok());
      int64_t owned = 0, sent = 0;
      for (const auto& e : sum->engine_ranks) {
        EXPECT_EQ(e.recv_bytes, e.owned_bytes);
        owned += e.owned_bytes;
      }
      for (const auto& t : sum->trainer_ranks) sent += t.send_bytes;
      EXPECT_EQ(sent, owned);
      EXPECT_EQ(rt.bytes, owned);
      EXPECT_EQ(rt.ops, sum->ops);
      ++runs;
    }
  }
  EXPECT_EQ(runs, std::size(kLayouts) * std::size(kEngines));
}

INSTANTIATE_TEST_SUITE_P(Models, MegatronRoundTrip,
                         ::testing::Values("qwen3_8b", "llama31_8b", "qwen3_30b_a3b",
                                           "qwen3_06b_tied"));

// ---- parsing, coordinates, layers, names ----

TEST(MegatronLayout, ParsesCanonically) {
  EXPECT_EQ(Megatron("tp=2,pp=2").ToString(), "megatron=tp=2,pp=2");
  EXPECT_EQ(Megatron("pp=2,tp=2,etp=2,vocab_div=128,experts=grouped,norms=te").ToString(),
            "megatron=tp=2,pp=2");  // defaults, in any order, spell the same
  const std::string all =
      "megatron=tp=2,pp=4,vpp=2,ep=2,etp=1,cp=2,dp=2,first=2,last=2,vocab_div=64,"
      "experts=sequential";
  auto t = ParseTrainerSpec(all);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->ToString(), all);
  EXPECT_EQ(t->world(), 2 * 2 * 2 * 4);
  EXPECT_EQ(t->megatron.expert_dp(), 32 / (1 * 2 * 4));
  EXPECT_EQ(Megatron("tp=4").megatron.etp, 4);  // etp defaults to tp
  // The local spec builds SequentialMLP (models/backends.py LocalSpecProvider): norms=local
  // implies experts=sequential, which its canonical spelling leaves out.
  const TrainerSpec local = Megatron("tp=2,pp=2,ep=2,etp=1,norms=local");
  EXPECT_TRUE(local.megatron.sequential_experts);
  EXPECT_EQ(local.ToString(), "megatron=tp=2,pp=2,ep=2,etp=1,norms=local");
  EXPECT_EQ(Megatron("norms=local,experts=sequential,tp=2,etp=1,pp=2,ep=2").ToString(),
            local.ToString());
  const TrainerSpec glu = Megatron("tp=2,dp=2,glu_interleave=32,ep=2");
  EXPECT_EQ(glu.megatron.glu_interleave, 32);
  EXPECT_EQ(glu.ToString(), "megatron=tp=2,pp=1,ep=2,dp=2,glu_interleave=32");
}

TEST(MegatronLayout, ErrorsNameTheField) {
  struct Case {
    const char* in;
    const char* field;
  } cases[] = {
      {"megatron=", "--trainer megatron"},
      {"megatron=tp=0", "--trainer megatron tp"},
      {"megatron=tp=2,tp=2", "tp: given twice"},
      {"megatron=tp=2,xp=1", "unknown field 'xp'"},
      {"megatron=tp=2,pp", "key=value"},
      {"megatron=vpp=2", "vpp"},           // needs pp > 1
      {"megatron=first=2", "first/last"},  // needs pp > 1
      {"megatron=tp=2,ep=4", "ep/etp"},    // world 2 not divisible by etp*ep*pp = 8
      {"megatron=tp=2,experts=fused", "experts"},
      {"megatron=tp=2,norms=rms", "norms"},
      {"megatron=tp=99999999", "--trainer megatron tp"},
      // DotProductAttention (the local spec's) refuses context parallelism.
      {"megatron=tp=2,cp=2,norms=local",
       "cp: the local spec (norms=local) uses "
       "DotProductAttention, which refuses context parallelism"},
      {"megatron=tp=2,norms=local,experts=grouped",
       "experts: experts=grouped (TEGroupedMLP) "
       "needs the Transformer-Engine spec"},
      {"megatron=tp=2,experts=sequential,glu_interleave=4", "glu_interleave: only TEGroupedMLP"},
      {"megatron=tp=2,norms=local,glu_interleave=4", "glu_interleave: only TEGroupedMLP"},
      {"megatron=tp=2,glu_interleave=0", "--trainer megatron glu_interleave"},
  };
  for (const auto& c : cases) {
    auto t = ParseTrainerSpec(c.in);
    ASSERT_FALSE(t.ok()) << c.in;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << c.in;
    EXPECT_NE(t.status().message().find(c.field), std::string::npos) << t.status().message();
  }
}

TEST(MegatronLayout, ModelErrorsNameTheField) {
  struct Case {
    ModelSpec model;
    const char* layout;
    const char* field;
    StatusCode code;
  } cases[] = {
      {Qwen3_8B(), "tp=3", "num_attention_heads", StatusCode::kInvalidArgument},
      {Llama31_8B(), "tp=1,pp=3", "not divisible by pp", StatusCode::kInvalidArgument},
      {Llama31_8B(), "tp=1,pp=4,first=3,last=2", "first/last", StatusCode::kInvalidArgument},
      {Llama31_8B(), "tp=1,pp=2,vpp=3", "vpp", StatusCode::kInvalidArgument},
      {Qwen3_30B_A3B(), "tp=1,ep=3,dp=3", "num_experts", StatusCode::kInvalidArgument},
      {Qwen3_30B_A3B(), "tp=1,ep=1,etp=32,dp=32", "moe_intermediate_size",
       StatusCode::kInvalidArgument},
      {LoadModelSpec("qwen2.5-0.5b").value(), "tp=3", "num_attention_heads",
       StatusCode::kInvalidArgument},
      {Qwen3_8B(), "tp=2,glu_interleave=4", "has no MoE layers", StatusCode::kInvalidArgument},
      {Qwen3_30B_A3B(), "tp=1,ep=2,dp=2,glu_interleave=3", "glu_interleave: moe_intermediate_size",
       StatusCode::kInvalidArgument},
  };
  for (const auto& c : cases) {
    const Status s = CheckTrainerLayout(c.model, Megatron(c.layout));
    ASSERT_FALSE(s.ok()) << c.layout;
    EXPECT_EQ(s.code(), c.code) << s.ToString();
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s.message();
    PlanInputs in;
    in.model = c.model;
    in.trainer = Megatron(c.layout);
    in.rollout = ParseRolloutSpec("dp=1,tp=1,pp=1", EngineKind::kSglang).value();
    auto sum = SummarizePlan(in);  // the planner refuses it the same way
    ASSERT_FALSE(sum.ok());
    EXPECT_EQ(sum.status().message(), s.message());
  }
  // Llama with attention_bias has no exact Megatron counterpart (add_bias_linear adds MLP biases).
  ModelSpec biased = Llama31_8B();
  biased.attention_bias = true;
  const Status s = CheckTrainerLayout(biased, Megatron("tp=2"));
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.ToString();
  EXPECT_NE(s.message().find("attention_bias"), std::string::npos);
}

TEST(MegatronLayout, RanksFollowRankGenerator) {
  for (const char* s : {"tp=2,pp=2,ep=2,etp=1,dp=2", "tp=2,pp=2,cp=2,dp=2,ep=4,etp=1",
                        "tp=4,pp=2,ep=2,etp=2,dp=1", "tp=1,pp=3,dp=4,ep=2,etp=2"}) {
    const MegatronLayout m = Megatron(s).megatron;
    const auto want = EnumerateRanks(m);
    for (int r = 0; r < m.world(); ++r) {
      const MegatronCoords c = MegatronRankCoords(m, r);
      const Coords& w = want[r];
      EXPECT_EQ(std::tie(c.tp, c.cp, c.dp, c.pp, c.etp, c.ep, c.edp),
                std::tie(w.tp, w.cp, w.dp, w.pp, w.etp, w.ep, w.edp))
          << s << " rank " << r;
      EXPECT_EQ(MegatronDenseRank(m, c.tp, c.cp, c.dp, c.pp), r);
      EXPECT_EQ(MegatronExpertRank(m, c.etp, c.ep, c.edp, c.pp), r);
    }
  }
}

TEST(MegatronLayout, ChunkLayersMatchMegatron) {
  auto layers = [](const std::string& s, int64_t L) {
    const MegatronLayout m = Megatron(s).megatron;
    std::vector<std::vector<std::pair<int64_t, int64_t>>> out(m.pp);
    for (int p = 0; p < m.pp; ++p) {
      for (int v = 0; v < m.vpp; ++v) out[p].push_back(MegatronChunkLayers(m, L, p, v).value());
    }
    return out;
  };
  using V = std::vector<std::vector<std::pair<int64_t, int64_t>>>;
  // transformer_block.py get_num_layers_to_build's own example.
  EXPECT_EQ(layers("tp=1,pp=2,vpp=2", 8), (V{{{0, 2}, {4, 6}}, {{2, 4}, {6, 8}}}));
  EXPECT_EQ(layers("tp=1,pp=2,vpp=4", 8),
            (V{{{0, 1}, {2, 3}, {4, 5}, {6, 7}}, {{1, 2}, {3, 4}, {5, 6}, {7, 8}}}));
  EXPECT_EQ(layers("tp=1,pp=4,first=1,last=3", 8), (V{{{0, 1}}, {{1, 3}}, {{3, 5}}, {{5, 8}}}));
  EXPECT_EQ(layers("tp=1,pp=3,last=2", 8), (V{{{0, 3}}, {{3, 6}}, {{6, 8}}}));
  // Uneven with vpp: first stage 2 (1 per chunk), middle 4 each (2), last 2 (1); chunk rounds of
  // 1 + 2 + 2 + 1 = 6 layers.
  EXPECT_EQ(layers("tp=1,pp=4,vpp=2,first=2,last=2", 12),
            (V{{{0, 1}, {6, 7}}, {{1, 3}, {7, 9}}, {{3, 5}, {9, 11}}, {{5, 6}, {11, 12}}}));
  // Every layout deals every layer once, in the order the test's independent dealer gives.
  for (const char* s : {"tp=1,pp=2,vpp=2", "tp=1,pp=4,first=1,last=3",
                        "tp=1,pp=4,vpp=2,first=2,last=2", "tp=1,pp=3,last=2"}) {
    const MegatronLayout m = Megatron(s).megatron;
    const int64_t L = m.first > 0 && m.vpp > 1 ? 12 : 8;
    const auto dealt = DealLayers(m, L);
    for (int p = 0; p < m.pp; ++p) {
      for (int v = 0; v < m.vpp; ++v) {
        const auto r = MegatronChunkLayers(m, L, p, v).value();
        ASSERT_FALSE(dealt[p][v].empty()) << s;
        EXPECT_EQ(r.first, dealt[p][v].front()) << s << " pp " << p << " chunk " << v;
        EXPECT_EQ(r.second, dealt[p][v].back() + 1) << s << " pp " << p << " chunk " << v;
      }
    }
  }
}

TEST(MegatronTrainerMap, NamesAndPieces) {
  const ModelSpec m = Qwen3_30B_A3B();  // layer 1 dense, the others MoE; ng 2, hd 4, np 8
  const TrainerSpec t = Megatron("tp=4,pp=2,ep=2,etp=1,dp=2");
  // Rank 5: dense tp 1 of pp 0 (dp 1); expert ep 1, etp 0 (rank = etp + ep*1 + 2*edp).
  auto r = BuildTrainerParams(m, t, 5, DType::kBF16);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->coords.tp, 1);
  EXPECT_EQ(r->coords.ep, 1);
  auto find = [&](const std::string& n) -> const TrainerParam* {
    for (const auto& p : r->params) {
      if (p.name == n) return &p;
    }
    ADD_FAILURE() << "no " << n;
    return nullptr;
  };
  const TrainerParam* emb = find("embedding.word_embeddings.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->shape, (Shape{512 / 4, 32}));  // 150 padded to 128*4 = 512
  ASSERT_EQ(emb->pieces.size(), 1u);
  EXPECT_EQ(emb->pieces[0].src, Region::Make({128, 0}, {22, 32}));  // rows 128..149 are real
  // qkv: ng 2 groups of (4 q + k + v) heads of 4 rows = 24 rows; tp 4 -> 12 rows per rank: rank
  // 1 holds q heads 3 of group 0 (4 rows) then k and v of group 0.
  const TrainerParam* qkv = find("decoder.layers.0.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->shape, (Shape{12, 32}));
  ASSERT_EQ(qkv->pieces.size(), 3u);
  EXPECT_EQ(qkv->pieces[0].source, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(qkv->pieces[0].src, Region::Make({12, 0}, {4, 32}));
  EXPECT_EQ(qkv->pieces[1].source, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(qkv->pieces[1].local, Region::Make({4, 0}, {4, 32}));
  EXPECT_EQ(qkv->pieces[2].source, "model.layers.0.self_attn.v_proj.weight");
  for (const char* n :
       {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.router.weight",
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.1.mlp.linear_fc2.weight",
        "decoder.layers.3.mlp.experts.linear_fc2.weight3"}) {
    find(n);
  }
  // Local expert 3 of ep rank 1 is global expert 7: fc1 = [gate; up] whole (etp 1).
  const TrainerParam* fc1 = find("decoder.layers.0.mlp.experts.linear_fc1.weight3");
  ASSERT_NE(fc1, nullptr);
  EXPECT_EQ(fc1->shape, (Shape{32, 32}));
  ASSERT_EQ(fc1->pieces.size(), 2u);
  EXPECT_EQ(fc1->pieces[0].source, "model.layers.0.mlp.experts.7.gate_proj.weight");
  EXPECT_EQ(fc1->pieces[1].source, "model.layers.0.mlp.experts.7.up_proj.weight");
  EXPECT_EQ(fc1->pieces[1].local, Region::Make({16, 0}, {16, 32}));
  // The last stage has the final norm and the output layer, and only 4 local layers.
  auto last = BuildTrainerParams(m, t, 8, DType::kBF16);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->params.back().name, "output_layer.weight");
  EXPECT_EQ(last->params[last->params.size() - 2].name, "decoder.final_layernorm.weight");
  for (const auto& p : last->params) EXPECT_EQ(p.name.find("decoder.layers.4."), std::string::npos);
  EXPECT_EQ(BuildTrainerParams(m, t, 16, DType::kBF16).status().code(), StatusCode::kOutOfRange);
  // FSDP is the trivial map: one parameter per HF tensor, one piece.
  auto f = BuildTrainerParams(m, *ParseTrainerSpec("fsdp=4"), 1, DType::kF32);
  ASSERT_TRUE(f.ok());
  const auto inv = HfTensorInventory(m);
  ASSERT_EQ(f->params.size(), inv.size());
  EXPECT_EQ(f->params[0].name, inv[0].name);
  EXPECT_EQ(f->params[0].pieces[0].src,
            TrainerHeldRegion(*ParseTrainerSpec("fsdp=4"), 1, inv[0].shape));
}

// moe_mlp_glu_interleave_size G: a TEGroupedMLP expert's fc1 rows are blocks [gate G | up G]
// of the rank's gate and up slices; other parameters are unchanged.
TEST(MegatronTrainerMap, InterleavedGluRows) {
  const ModelSpec m = Qwen3_30B_A3B();  // moe_intermediate_size 16
  auto plain = BuildTrainerParams(m, Megatron("tp=2,ep=2,etp=2,dp=2"), 1, DType::kF32);
  auto inter =
      BuildTrainerParams(m, Megatron("tp=2,ep=2,etp=2,dp=2,glu_interleave=4"), 1, DType::kF32);
  ASSERT_TRUE(plain.ok() && inter.ok()) << inter.status().ToString();
  ASSERT_EQ(plain->params.size(), inter->params.size());
  const std::string fc1 = "decoder.layers.0.mlp.experts.linear_fc1.weight1";
  for (size_t i = 0; i < plain->params.size(); ++i) {
    const TrainerParam &a = plain->params[i], &b = inter->params[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.shape, b.shape);
    if (b.name.find("experts.linear_fc1") == std::string::npos) {
      EXPECT_EQ(a.pieces.size(), b.pieces.size()) << a.name;
      continue;
    }
    // Rank 1: etp 1 of ep 0 holds rows [8, 16) of gate and up (16 / etp 2 = 8 per rank).
    ASSERT_EQ(b.pieces.size(), 4u) << b.name;  // 2 blocks of G 4, gate then up each
    EXPECT_EQ(b.shape, (Shape{16, 32}));
    if (b.name != fc1) continue;
    EXPECT_EQ(b.pieces[0].source, "model.layers.0.mlp.experts.1.gate_proj.weight");
    EXPECT_EQ(b.pieces[0].src, Region::Make({8, 0}, {4, 32}));
    EXPECT_EQ(b.pieces[0].local, Region::Make({0, 0}, {4, 32}));
    EXPECT_EQ(b.pieces[1].source, "model.layers.0.mlp.experts.1.up_proj.weight");
    EXPECT_EQ(b.pieces[1].src, Region::Make({8, 0}, {4, 32}));
    EXPECT_EQ(b.pieces[1].local, Region::Make({4, 0}, {4, 32}));
    EXPECT_EQ(b.pieces[2].source, "model.layers.0.mlp.experts.1.gate_proj.weight");
    EXPECT_EQ(b.pieces[2].src, Region::Make({12, 0}, {4, 32}));
    EXPECT_EQ(b.pieces[2].local, Region::Make({8, 0}, {4, 32}));
    EXPECT_EQ(b.pieces[3].local, Region::Make({12, 0}, {4, 32}));
  }
}

TEST(MegatronTrainerMap, TiedEmbeddingsUnderPp) {
  const ModelSpec m = Qwen3_06B_Tied();
  ASSERT_TRUE(m.tie_word_embeddings);
  // pp 1: the output layer has no weight of its own.
  auto one = BuildTrainerParams(m, Megatron("tp=2"), 0, DType::kF32);
  ASSERT_TRUE(one.ok());
  for (const auto& p : one->params) EXPECT_NE(p.name, "output_layer.weight");
  // pp 2: the last stage's output_layer.weight is a copy of the embedding.
  auto last = BuildTrainerParams(m, Megatron("tp=2,pp=2"), 3, DType::kF32);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->params.back().name, "output_layer.weight");
  EXPECT_EQ(last->params.back().pieces[0].source, "model.embed_tokens.weight");
}

// Dense and expert data-parallel replicas share the sending: max within 1% of the mean for a
// layout whose every source has the same number of holders.
TEST(MegatronPlan, ReplicasShareTheSending) {
  const ModelSpec m = LoadModelSpec("qwen3-8b").value();
  PlanInputs in;
  in.model = m;
  in.trainer = Megatron("tp=2,pp=2,dp=2");
  in.rollout = ParseRolloutSpec("dp=3,tp=4,pp=2", EngineKind::kSglang).value();
  auto s = SummarizePlan(in);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  int64_t mx = 0, total = 0;
  for (const auto& t : s->trainer_ranks) {
    mx = std::max(mx, t.send_bytes);
    total += t.send_bytes;
    EXPECT_GT(t.send_bytes, 0);
  }
  EXPECT_LE(mx, total / 8.0 * 1.01);
  for (const auto& e : s->engine_ranks) EXPECT_EQ(e.recv_bytes, e.owned_bytes);
}

TEST(MegatronPlan, HashCoversTheLayoutAndIsStable) {
  PlanInputs in;
  in.model = LoadModelSpec("qwen3-8b").value();
  in.trainer = Megatron("tp=2,pp=2");
  in.rollout = ParseRolloutSpec("dp=1,tp=2,pp=2", EngineKind::kSglang).value();
  PlanInputs again = in;
  again.trainer = Megatron("pp=2,tp=2,etp=2,vocab_div=128");  // the same layout, spelled otherwise
  EXPECT_EQ(PlanHash(in), PlanHash(again));
  // Golden: the plan hash every machine must compute for this job (kPlannerVersion
  // "shardsync-plan/1"); a change here changes what ranks agree on.
  EXPECT_EQ(PlanHash(in), "dd90298671cad5e9f81564a459bc0282");
  for (const char* other : {"tp=2,pp=2,vpp=2", "tp=2,pp=2,dp=2", "tp=2,pp=2,etp=1",
                            "tp=2,pp=2,vocab_div=64", "tp=2,pp=2,first=16", "tp=2,pp=2,norms=local",
                            "tp=2,pp=2,experts=sequential", "tp=2,pp=2,cp=2"}) {
    PlanInputs v = in;
    v.trainer = Megatron(other);
    EXPECT_NE(PlanHash(v), PlanHash(in)) << other;
  }
  // Plans are the same when computed twice.
  auto a = PlanForRank(in, 1), b = PlanForRank(again, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->sends.size(), b->sends.size());
  for (size_t i = 0; i < a->sends.size(); ++i) {
    ASSERT_EQ(a->sends[i].ops.size(), b->sends[i].ops.size());
    ASSERT_EQ(a->sends[i].local.size(), a->sends[i].ops.size());
    for (size_t k = 0; k < a->sends[i].ops.size(); ++k) {
      const TransferOp &x = a->sends[i].ops[k], &y = b->sends[i].ops[k];
      const LocalSource &u = a->sends[i].local[k], &v = b->sends[i].local[k];
      EXPECT_TRUE(x.src == y.src && x.dst == y.dst && u.region == v.region && u.param == v.param &&
                  x.wire_offset == y.wire_offset);
    }
  }
}

}  // namespace
}  // namespace shardsync
