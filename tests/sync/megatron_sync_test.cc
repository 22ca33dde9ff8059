// Megatron-Core trainers through real sessions (loopback, one thread per sync rank). Every trainer
// rank fills its local parameters from the synthetic HF values through its trainer map (padded
// vocab rows left as garbage), binds them by local name and model chunk, and syncs; every engine
// element must equal its HF value, each engine rank must receive exactly its owned bytes, and the
// reference engine's greedy tokens on the received parameters must match the unsharded model's.
// Then the binding checks: names, chunks, shapes, dtypes and missing parameters, each named.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "job/internal.h"
#include "job/launcher.h"
#include "plan/megatron_models.h"
#include "shardsync/refengine.h"
#include "shardsync/session.h"
#include "shardsync/shard_map.h"
#include "shardsync/store.h"
#include "shardsync/transport.h"
#include "sync_expect.h"

namespace shardsync {
namespace {

using ::testing::HasSubstr;
constexpr char kToken[] = "test-token-0123456789";

JobSpec MegatronJob(const ModelSpec& model, const std::string& layout, EngineKind engine,
                    const std::string& rollout, DType trainer_dtype) {
  JobSpec j;
  j.inputs.model = model;
  auto t = ParseTrainerSpec("megatron=" + layout);
  EXPECT_TRUE(t.ok()) << layout << ": " << t.status().ToString();
  if (t.ok()) j.inputs.trainer = *t;
  auto r = ParseRolloutSpec(rollout, engine);
  EXPECT_TRUE(r.ok()) << rollout << ": " << r.status().ToString();
  if (r.ok()) j.inputs.rollout = *r;
  j.inputs.options.wire_dtype = DType::kBF16;
  j.inputs.options.bucket_bytes = 8 << 10;  // several buckets per message
  j.inputs.trainer_dtype = trainer_dtype;
  j.seed = 7;
  return j;
}

// One in-process job: a session per sync rank, bound as the rank program binds them.
class LoopbackJob {
 public:
  LoopbackJob(JobSpec spec, StoreServer& server, const std::string& prefix,
              Millis connect_timeout = Millis(20000))
      : spec_(std::move(spec)), hub_(NewLoopbackHub()), world_(SyncWorldSize(spec_.inputs)) {
    ranks_.resize(world_);
    for (int r = 0; r < world_; ++r) {
      Rank& k = ranks_[r];
      auto c = StoreClient::Connect(server.address(), kToken, Millis(5000));
      EXPECT_TRUE(c.ok()) << c.status().ToString();
      if (!c.ok()) return;
      k.store = std::move(c).value();
      k.tx = NewLoopbackTransport(hub_);
      SessionOptions o;
      o.prefix = prefix;
      o.connect_timeout = connect_timeout;
      o.sync_timeout = Millis(20000);
      auto s = SyncSession::Create(spec_.inputs, r, *k.store, *k.tx, o);
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      if (!s.ok()) return;
      k.session = std::move(s).value();
    }
    created_ = true;
  }
  bool created() const { return created_; }

  // Binds every rank as the rank program does but `skip`. as_local: FSDP-like shards bound as
  // local parameters (named like their HF tensor) instead of HF regions.
  void BindAll(bool as_local = false) { BindAllBut(-1, as_local); }
  void BindAllBut(int skip, bool as_local = false) {
    for (int r = 0; r < world_; ++r) {
      if (r == skip) continue;
      Rank& k = ranks_[r];
      if (k.session->is_trainer()) {
        auto t = job_internal::FillTrainerShards(spec_, k.session->plan().rank);
        ASSERT_TRUE(t.ok()) << t.status().ToString();
        k.shards = std::move(t).value();
        for (SourceBinding b : k.shards.bindings) {
          if (as_local && b.local.empty()) {
            b.local = b.hf_name;
            b.hf_name.clear();
            b.region = Region::Full(b.region.extents());
          }
          Status s = k.session->BindSource(b);
          ASSERT_TRUE(s.ok()) << s.ToString();
        }
      } else {
        auto p = job_internal::AllocateEngineParams(k.session->ExpectedParams(),
                                                    spec_.inputs.options.wire_dtype);
        ASSERT_TRUE(p.ok());
        k.params = std::move(p).value();
        for (const DestBinding& b : k.params.bindings) ASSERT_TRUE(k.session->BindDest(b).ok());
      }
    }
  }
  std::vector<Status> Connect() {
    return testing::RunOnAll(world_, [&](int r) { return ranks_[r].session->Connect(); });
  }
  std::vector<Status> Sync(uint64_t v) {
    return testing::RunOnAll(world_, [&](int r) -> Status {
      auto rep = ranks_[r].session->Sync(v);
      if (rep.ok()) ranks_[r].report = *rep;
      return rep.status();
    });
  }
  int64_t Mismatches() { return testing::EngineMismatches(spec_, ranks_); }

  // Replica `d`'s received parameters in ShardMap::ranks order (pp * tp + tp_rank).
  std::vector<EngineBuffers> Received(int d) const {
    const ShardSpec& sh = spec_.inputs.rollout.shard;
    std::vector<EngineBuffers> out(sh.tp * sh.pp);
    const int first = spec_.inputs.trainer.world() + d * sh.tp * sh.pp;
    for (int e = 0; e < sh.tp * sh.pp; ++e) {
      const Rank& k = ranks_[first + e];
      const auto& expected = k.session->ExpectedParams();
      for (size_t i = 0; i < expected.size(); ++i) {
        HostTensor& h = out[e][expected[i].name];
        h.dtype = k.params.bindings[i].dtype;
        h.shape = expected[i].shape;
        const auto* p = static_cast<const uint8_t*>(k.params.bindings[i].data);
        h.data.assign(p, p + expected[i].numel() * DTypeSize(h.dtype));
      }
    }
    return out;
  }

  int world() const { return world_; }
  int trainers() const { return spec_.inputs.trainer.world(); }
  SyncSession& session(int r) { return *ranks_[r].session; }
  const SyncReport& report(int r) const { return ranks_[r].report; }
  job_internal::TrainerShards& shards(int r) { return ranks_[r].shards; }

 private:
  struct Rank {
    std::unique_ptr<StoreClient> store;
    std::unique_ptr<Transport> tx;
    std::unique_ptr<SyncSession> session;
    job_internal::TrainerShards shards;
    job_internal::EngineParams params;
    SyncReport report;
  };
  JobSpec spec_;
  std::shared_ptr<LoopbackHub> hub_;
  int world_ = 0;
  bool created_ = false;
  std::vector<Rank> ranks_;
};

class MegatronSync : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    auto s = StoreServer::Start("127.0.0.1", 0, kToken);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(s).value().release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static StoreServer* server_;
};
StoreServer* MegatronSync::server_ = nullptr;

ModelSpec ModelByName(const std::string& n) {
  if (n == "qwen3_8b") return testing::SmallQwen3_8B();
  if (n == "llama31_8b") return testing::SmallLlama31_8B();
  return testing::SmallQwen3_30B_A3B();
}

// The Megatron layouts (docs/megatron.md "Tests" spells out each).
const char* kLayouts[] = {
    "tp=2,pp=2",
    "tp=4,pp=1",
    "tp=2,pp=2,vpp=2",
    "tp=1,pp=4,first=1,last=3",                      // uneven stages 1,2,2,3
    "tp=2,ep=4,etp=1,dp=2",                          // ep4 etp1
    "tp=2,pp=2,ep=2,etp=2,dp=2,experts=sequential",  // ep2 etp2
    "tp=8",                                          // num_query_groups (4 or 2) < tp
};

// The engine layouts. Its "tp1 pp2 ep2" is no valid engine layout (SGLang and vLLM put
// experts inside the TP group: ep must divide tp): MoE models take tp2 pp2 ep2 instead, dense
// ones (no experts) tp1 pp2 with two replicas.
struct EngineCase {
  EngineKind engine;
  const char* rollout;
};
const EngineCase kEngines[] = {
    {EngineKind::kSglang, "dp=1,tp=2,pp=2"},
    {EngineKind::kSglang, "dp=1,tp=4,pp=1"},
    {EngineKind::kSglang, "ep"},
    {EngineKind::kVllm, "dp=1,tp=2,pp=2"},
    {EngineKind::kVllm, "dp=1,tp=4,pp=1"},
    {EngineKind::kVllm, "ep"},
};

TEST_P(MegatronSync, EveryLayoutIntoEveryEngineVerifiedAndGenerating) {
  const ModelSpec model = ModelByName(GetParam());
  int runs = 0;
  for (const char* layout : kLayouts) {
    for (const EngineCase& ec : kEngines) {
      const std::string rollout = std::string(ec.rollout) != "ep" ? ec.rollout
                                  : model.is_moe()                ? "dp=1,tp=2,pp=2,ep=2"
                                                                  : "dp=2,tp=1,pp=2";
      // Both trainer dtypes: bf16 senders cast nothing, f32 senders cast while packing.
      const DType td = ec.engine == EngineKind::kVllm ? DType::kBF16 : DType::kF32;
      SCOPED_TRACE(fmt::format("{} megatron={} -> {} {} ({} trainer)", model.name, layout,
                               EngineKindName(ec.engine), rollout, DTypeName(td)));
      const JobSpec spec = MegatronJob(model, layout, ec.engine, rollout, td);
      LoopbackJob job(spec, *server_, fmt::format("{}/{}/", GetParam(), runs));
      ASSERT_TRUE(job.created());
      job.BindAll();
      if (HasFatalFailure()) return;
      testing::ExpectAllOk(job.Connect());
      testing::ExpectAllOk(job.Sync(1));
      if (HasFailure()) return;
      // Every engine element equals its HF value (padding rows zero), checksums all verified.
      EXPECT_EQ(job.Mismatches(), 0);
      const SyncReport& rep = job.report(0);
      EXPECT_GT(rep.checksums_total, 0);
      EXPECT_EQ(rep.checksums_ok, rep.checksums_total);
      // Byte accounting: each engine rank receives exactly its owned bytes.
      auto sum = SummarizePlan(spec.inputs);
      ASSERT_TRUE(sum.ok());
      for (size_t i = 0; i < sum->engine_ranks.size(); ++i) {
        EXPECT_EQ(rep.ranks.at(job.trainers() + i).recv_bytes, sum->engine_ranks[i].owned_bytes)
            << "engine rank " << i;
      }
      // The reference engine on replica 0's received parameters generates what the unsharded
      // model generates.
      auto map = BuildShardMap(spec.inputs.model, spec.inputs.rollout.shard);
      ASSERT_TRUE(map.ok());
      ModelSpec ref_spec = spec.inputs.model;
      ref_spec.dtype = spec.inputs.options.wire_dtype;
      SyntheticWeightSource reference(ref_spec, spec.seed);
      auto gen = CheckGeneration(*map, job.Received(0), reference, DefaultPrompt(), 4);
      ASSERT_TRUE(gen.ok()) << gen.status().ToString();
      EXPECT_TRUE(gen->match) << "max diff " << gen->max_logit_diff << " tol " << gen->tolerance;
      EXPECT_EQ(gen->engine_tokens, gen->reference_tokens);
      ++runs;
    }
  }
  EXPECT_EQ(runs, std::size(kLayouts) * std::size(kEngines));
}

INSTANTIATE_TEST_SUITE_P(Models, MegatronSync,
                         ::testing::Values("qwen3_8b", "llama31_8b", "qwen3_30b_a3b"));

// Every way a binding can be wrong is refused at bind, naming the parameter (and its chunk); a
// local parameter the plan reads but nobody bound is NotFound at Connect, naming it.
TEST_F(MegatronSync, BindingErrorsNameTheLocalParameter) {
  const JobSpec spec = MegatronJob(testing::SmallQwen3_8B(), "tp=2,pp=2,vpp=2", EngineKind::kSglang,
                                   "dp=1,tp=2,pp=2", DType::kF32);
  // Connect fails on rank 0; the others then wait for it until their connect timeout.
  LoopbackJob job(spec, *server_, "binding-errors/", Millis(1500));
  ASSERT_TRUE(job.created());
  SyncSession& t = job.session(0);
  const std::vector<TrainerParam>& expected = t.ExpectedSources();
  auto want = BuildTrainerParams(spec.inputs.model, spec.inputs.trainer, 0, DType::kF32);
  ASSERT_TRUE(want.ok());
  ASSERT_EQ(expected.size(), want->params.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(expected[i].name, want->params[i].name);
    EXPECT_EQ(expected[i].chunk, want->params[i].chunk);
    EXPECT_EQ(expected[i].shape, want->params[i].shape);
  }
  EXPECT_TRUE(job.session(job.trainers()).ExpectedSources().empty());
  // Chunk 1 of pipeline rank 0 holds decoder.layers.0 too (global layer 4): a qkv of chunk 1.
  const TrainerParam* qkv = nullptr;
  for (const TrainerParam& p : expected) {
    if (p.chunk == 1 && p.name == "decoder.layers.0.self_attention.linear_qkv.weight") qkv = &p;
  }
  ASSERT_NE(qkv, nullptr);
  std::vector<float> buf(qkv->numel() + 64);
  SourceBinding b;
  b.data = buf.data();
  b.dtype = DType::kF32;
  b.region = Region::Full(qkv->shape);
  b.local = qkv->name;
  b.chunk = 1;
  // An HF shard on a Megatron rank.
  SourceBinding hf = b;
  hf.local.clear();
  hf.hf_name = "model.embed_tokens.weight";
  Status s = t.BindSource(hf);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_THAT(s.message(), HasSubstr("Megatron local parameters"));
  // No such name; a name that only another chunk has (chunk 0 holds no final layernorm).
  SourceBinding bad = b;
  bad.local = "decoder.layers.9.self_attention.linear_qkv.weight";
  s = t.BindSource(bad);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("decoder.layers.9.self_attention.linear_qkv.weight"));
  EXPECT_THAT(s.message(), HasSubstr("not a local parameter of trainer rank 0"));
  bad.local = "embedding.word_embeddings.weight";
  s = t.BindSource(bad);
  EXPECT_THAT(s.message(), HasSubstr("(chunk 1)"));
  EXPECT_THAT(s.message(), HasSubstr("model chunk(s) 0 hold one"));
  // Shape and dtype.
  bad = b;
  Shape wrong = qkv->shape;
  wrong[0] += 1;
  bad.region = Region::Full(wrong);
  s = t.BindSource(bad);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(qkv->name));
  EXPECT_THAT(s.message(), HasSubstr(ShapeToString(wrong)));
  EXPECT_THAT(s.message(), HasSubstr("says " + ShapeToString(qkv->shape)));
  bad = b;
  bad.dtype = DType::kBF16;
  s = t.BindSource(bad);
  EXPECT_THAT(s.message(), HasSubstr("dtype BF16"));
  bad = b;
  bad.data = nullptr;
  EXPECT_THAT(t.BindSource(bad).message(), HasSubstr("null data"));
  bad = b;
  bad.mem = MemKind::kCuda;
  bad.device = 0;
  EXPECT_THAT(t.BindSource(bad).message(), HasSubstr("device memory needs a packer"));
  // Bound twice.
  ASSERT_TRUE(t.BindSource(b).ok());
  s = t.BindSource(b);
  EXPECT_THAT(s.message(), HasSubstr("bound twice"));
  EXPECT_THAT(s.message(), HasSubstr(qkv->name + "' (chunk 1)"));
  // Every other rank binds everything; rank 0 only that one parameter: Connect names the first
  // local parameter the plan reads and nobody bound.
  job.BindAllBut(0);
  auto st = job.Connect();
  EXPECT_EQ(st[0].code(), StatusCode::kNotFound) << st[0].ToString();
  EXPECT_THAT(st[0].message(), HasSubstr("local parameter '"));
  EXPECT_THAT(st[0].message(), HasSubstr("is read by the plan but was not bound"));
}

// FSDP-like trainers may bind by local parameter too (one per HF tensor, named like it): the same
// verified sync as HF shard bindings.
TEST_F(MegatronSync, FsdpTrainerBindsByLocalParameterToo) {
  JobSpec spec = MegatronJob(testing::SmallLlama31_8B(), "tp=2", EngineKind::kVllm,
                             "dp=1,tp=2,pp=2", DType::kF32);
  spec.inputs.trainer = ParseTrainerSpec("fsdp=3").value();
  LoopbackJob job(spec, *server_, "fsdp-local/");
  ASSERT_TRUE(job.created());
  job.BindAll(/*as_local=*/true);
  if (HasFatalFailure()) return;
  testing::ExpectAllOk(job.Connect());
  testing::ExpectAllOk(job.Sync(1));
  EXPECT_EQ(job.Mismatches(), 0);
  // A local binding whose shape is not the held shard's is refused, naming both.
  const TrainerParam& p = job.session(0).ExpectedSources().at(0);
  std::vector<float> buf(p.numel() + 64);
  SourceBinding b;
  b.data = buf.data();
  b.region = Region::Full({p.shape[0] + 1, p.shape[1]});
  b.local = p.name;
  LoopbackJob other(spec, *server_, "fsdp-local-2/");
  ASSERT_TRUE(other.created());
  Status s = other.session(0).BindSource(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(p.name));
  EXPECT_THAT(s.message(), HasSubstr(ShapeToString(p.shape)));
}

}  // namespace
}  // namespace shardsync
