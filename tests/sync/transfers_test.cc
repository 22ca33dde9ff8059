// How buckets are cut into transfers, and the sender's zero-copy path: runs that are contiguous
// in the trainer's memory and already in the wire dtype leave from that memory (no staging copy),
// the rest is packed; both kinds share buckets, both are checksummed, and receivers in two-sided
// mode post exactly the sender's split.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <list>
#include <thread>

#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "shardsync/checksum.h"
#include "shardsync/session.h"
#include "shardsync/shard_map.h"
#include "shardsync/transport.h"
#include "sync/transfers.h"
#include "sync_expect.h"

namespace shardsync {
namespace {

using sync_internal::BucketTransfers;
using sync_internal::WireRun;
using ::testing::HasSubstr;

// Large enough that column-parallel runs exceed kMinDirectBytes (q_proj rows of one FSDP shard:
// 256 x 512 bf16 = 256 KiB) while row-parallel ones (o_proj, down_proj: 512-byte rows under
// tp=2) stay short and get packed; the embedding (4 MiB) spans several transfers.
std::string MidQwen2() {
  return testing::WriteConfig("qwen2-mid", R"({
  "architectures": ["Qwen2ForCausalLM"], "hidden_size": 512, "intermediate_size": 1024,
  "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
  "vocab_size": 4096, "tie_word_embeddings": true, "max_position_embeddings": 512,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16"})");
}

JobSpec MidJob(const std::string& trainer_dtype, const std::string& rollout = "dp=1,tp=2,pp=2",
               const std::string& trainer = "fsdp=2") {
  JobFlags f;
  f.model = MidQwen2();
  f.trainer = trainer;
  f.rollout = rollout;
  f.trainer_dtype = trainer_dtype;
  f.bucket_bytes = 3 << 20;  // several buckets per message, some mixing both kinds of transfer
  f.transport = "loopback";
  f.timeout_ms = 20000;
  auto j = JobSpecFromFlags(f);
  EXPECT_TRUE(j.ok()) << j.status().ToString();
  return *j;
}

struct SplitCounts {
  int direct = 0, packed = 0, mixed_buckets = 0;
};

// Checks every bucket's transfers on both ends against a reference pack of the sender's shards.
void CheckSplits(const JobSpec& job, SplitCounts& c) {
  const PlanInputs& in = job.inputs;
  const auto inventory = HfTensorInventory(in.model);
  auto map = BuildShardMap(in.model, in.rollout.shard);
  EXPECT_TRUE(map.ok());
  const int ws = DTypeSize(in.options.wire_dtype);
  auto packer = MakeCpuPacker();
  for (int t = 0; t < in.trainer.world(); ++t) {
    auto plan = PlanForRank(in, t);
    EXPECT_TRUE(plan.ok());
    auto shards = job_internal::FillTrainerShards(job, t);
    EXPECT_TRUE(shards.ok());
    // FSDP-like senders: bindings by HF tensor; Megatron: by local parameter (the trainer map's
    // order, which FillTrainerShards keeps), the op's bytes at Message::local.
    std::map<int, const SourceBinding*> by_tensor;
    for (const SourceBinding& b : shards->bindings) {
      for (size_t i = 0; i < inventory.size(); ++i) {
        if (inventory[i].name == b.hf_name) by_tensor[static_cast<int>(i)] = &b;
      }
    }
    auto tp = BuildTrainerParams(in.model, in.trainer, t, in.trainer_dtype);
    EXPECT_TRUE(tp.ok());
    const bool megatron = tp->megatron;
    auto local_shape = [&](int p) -> const Shape* { return &tp->params.at(p).shape; };
    auto source = [&](int id) -> const SourceBinding& {
      return megatron ? shards->bindings.at(id) : *by_tensor.at(id);
    };
    for (const Message& m : plan->sends) {
      auto who = DescribeSyncRank(in, m.dst);
      EXPECT_TRUE(who.ok());
      const auto& params = map->rank(who->tp_rank, who->pp_rank).params;
      auto shape = [&](int p) -> const Shape& { return params.at(p).shape; };
      auto recv_plan = PlanForRank(in, m.dst);
      EXPECT_TRUE(recv_plan.ok());
      const Message* rm = nullptr;
      for (const Message& r : recv_plan->recvs) {
        if (r.src == t) rm = &r;
      }
      EXPECT_NE(rm, nullptr);
      for (size_t bi = 0; bi < m.buckets.size(); ++bi) {
        const Bucket& b = m.buckets[bi];
        const auto xfers = BucketTransfers(in, inventory, t, m, b, shape, local_shape);
        // The receiver derives the same split from its own view of the plan.
        const auto rx =
            BucketTransfers(in, inventory, t, *rm, rm->buckets.at(bi), shape, local_shape);
        ASSERT_EQ(rx.size(), xfers.size()) << "trainer " << t << " -> " << m.dst;
        // Reference wire image of the bucket (the packer's strided pass).
        std::vector<PackRegion> regions;
        for (int i = b.op_begin; i < b.op_end; ++i) {
          const TransferOp& op = m.ops[i];
          if (megatron) {
            const SourceBinding& sb = source(m.local.at(i).param);
            regions.push_back({sb.data, sb.dtype, sb.region.extents(), m.local[i].region,
                               op.wire_offset - b.wire_offset});
            continue;
          }
          const SourceBinding& sb = *by_tensor.at(op.tensor);
          PackRegion r{sb.data, sb.dtype, sb.region.extents(), op.src,
                       op.wire_offset - b.wire_offset};
          for (int d = 0; d < r.region.ndim; ++d) r.region.offset[d] -= sb.region.offset[d];
          regions.push_back(r);
        }
        std::vector<unsigned char> ref(b.bytes);
        ASSERT_TRUE(packer->Pack(regions, in.options.wire_dtype, ref.data(), b.bytes).ok());
        int64_t at = 0;
        int direct = 0, packed = 0;
        for (size_t i = 0; i < xfers.size(); ++i) {
          const WireRun& x = xfers[i];
          EXPECT_EQ(x.wire_offset, at);
          EXPECT_GT(x.len, 0u);
          EXPECT_LE(x.len, sync_internal::kMaxTransferBytes);
          EXPECT_EQ(x.len % ws, 0u);
          EXPECT_EQ(rx[i].wire_offset, x.wire_offset);
          EXPECT_EQ(rx[i].len, x.len);
          EXPECT_EQ(rx[i].param, x.param);
          EXPECT_EQ(rx[i].param_offset, x.param_offset);
          at += static_cast<int64_t>(x.len);
          if (x.direct) {
            ++direct;
            // The source bytes are exactly the wire bytes.
            const auto* src = static_cast<const unsigned char*>(source(x.tensor).data);
            EXPECT_EQ(std::memcmp(src + x.src_offset, ref.data() + x.wire_offset, x.len), 0)
                << "direct transfer " << i << " of bucket " << bi << " to " << m.dst;
          } else {
            ++packed;
          }
        }
        EXPECT_EQ(at, b.bytes);
        c.direct += direct;
        c.packed += packed;
        c.mixed_buckets += direct > 0 && packed > 0;
      }
    }
  }
}

TEST(BucketTransfers, DirectRunsAreTheSourceBytesAndBothEndsAgree) {
  SplitCounts c;
  CheckSplits(MidJob("bf16"), c);
  EXPECT_GT(c.direct, 0);
  EXPECT_GT(c.packed, 0);
  EXPECT_GT(c.mixed_buckets, 0);
}

TEST(BucketTransfers, CastingTrainerPacksEverything) {
  SplitCounts c;
  CheckSplits(MidJob("fp32"), c);
  EXPECT_EQ(c.direct, 0);
  EXPECT_GT(c.packed, 0);
}

// Megatron senders: direct runs leave from the local parameters (linear_qkv slabs, the vocab
// rows) at the plan's local regions, and the receiver, from its senders' trainer maps, cuts the
// same transfers.
TEST(BucketTransfers, MegatronLocalRegionsGoDirectAndBothEndsAgree) {
  for (const char* trainer : {"megatron=tp=2,pp=2", "megatron=tp=2,dp=2,vocab_div=1"}) {
    SCOPED_TRACE(trainer);
    SplitCounts c;
    CheckSplits(MidJob("bf16", "dp=1,tp=2,pp=2", trainer), c);
    EXPECT_GT(c.direct, 0);
    EXPECT_GT(c.packed, 0);
  }
}

TEST(BucketTransfers, ReplicatedTrainerAndVllmLayout) {
  JobFlags f;
  f.model = MidQwen2();
  f.trainer = "replicate=2";
  f.rollout = "dp=2,tp=2,pp=1";
  f.engine = "vllm";
  f.trainer_dtype = "bf16";
  f.bucket_bytes = 1 << 20;
  f.transport = "loopback";
  auto j = JobSpecFromFlags(f);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  SplitCounts c;
  CheckSplits(*j, c);
  EXPECT_GT(c.direct, 0);
  EXPECT_GT(c.packed, 0);
}

// Wraps a transport: optionally hides one-sided puts (so sessions run the two-sided protocol
// that UCX tag mode uses), records whether each data post leaves from the trainer's bound
// source memory, and can corrupt (in a copy) the next post that does.
class Recorder final : public Transport {
 public:
  Recorder(std::unique_ptr<Transport> inner, bool two_sided_only)
      : inner_(std::move(inner)), two_sided_only_(two_sided_only) {}
  void AddSource(const void* p, size_t n) {
    sources_.emplace_back(static_cast<const unsigned char*>(p), n);
  }
  int direct_posts = 0, staged_posts = 0;
  bool corrupt_next_direct = false;
  int corrupted = 0;

  std::string_view name() const override { return "recorder"; }
  TransportCaps caps() const override {
    TransportCaps c = inner_->caps();
    if (two_sided_only_) c.one_sided_put = false;
    return c;
  }
  bool CanConnect(const PeerInfo& a, const PeerInfo& b) const override {
    return inner_->CanConnect(a, b);
  }
  Result<uint32_t> RegisterMemory(const MemRegion& r) override { return inner_->RegisterMemory(r); }
  Status Connect(StoreClient& s, const std::string& prefix, int rank, const std::vector<int>& peers,
                 Millis timeout) override {
    return inner_->Connect(s, prefix, rank, peers, timeout);
  }
  Result<XferId> PostPut(int peer, const void* src, size_t bytes, uint32_t region,
                         uint64_t off) override {
    if (two_sided_only_) return FailedPreconditionError("recorder: puts hidden");
    return inner_->PostPut(peer, Data(src, bytes), bytes, region, off);
  }
  Result<XferId> PostFlush(int peer) override { return inner_->PostFlush(peer); }
  Result<XferId> PostSend(int peer, uint64_t tag, const void* buf, size_t bytes) override {
    const bool control = (tag >> 47) & 1;
    return inner_->PostSend(peer, tag, control ? buf : Data(buf, bytes), bytes);
  }
  Result<XferId> PostRecv(int peer, uint64_t tag, void* buf, size_t bytes) override {
    return inner_->PostRecv(peer, tag, buf, bytes);
  }
  // Summed sends (shm): a corrupted one emulates a flip in the ring, after the sender's copy
  // summed the true bytes: the sum comes from the original, the corrupted copy travels plain.
  Result<XferId> PostSendSummed(int peer, uint64_t tag, const void* buf, size_t bytes,
                                CopySum* sum) override {
    const void* data = Data(buf, bytes);
    if (data == buf) return inner_->PostSendSummed(peer, tag, buf, bytes, sum);
    const uint64_t h = SummedHead(sum->key, bytes), t = SummedTail(sum->key, bytes);
    sum->sum += ChecksumPartial(static_cast<const unsigned char*>(buf) + h, t - h, sum->key + h);
    return inner_->PostSend(peer, tag, data, bytes);
  }
  // Filled sends are packed straight into the transport's staging: never from the sources.
  Result<XferId> PostSendFilled(int peer, uint64_t tag, size_t bytes, SendFill fill) override {
    ++staged_posts;
    return inner_->PostSendFilled(peer, tag, bytes, std::move(fill));
  }
  Result<XferId> PostRecvSummed(int peer, uint64_t tag, void* buf, size_t bytes,
                                CopySum* sum) override {
    return inner_->PostRecvSummed(peer, tag, buf, bytes, sum);
  }
  Result<XferState> Poll(XferId id) override { return inner_->Poll(id); }
  void Abort() override { inner_->Abort(); }

 private:
  const void* Data(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    bool direct = false;
    for (auto [base, len] : sources_) direct |= c >= base && c + n <= base + len;
    ++(direct ? direct_posts : staged_posts);
    if (!direct || !corrupt_next_direct || n == 0) return p;
    corrupt_next_direct = false;
    ++corrupted;
    copies_.emplace_back(c, c + n);
    copies_.back()[n / 2] ^= 0x01;
    return copies_.back().data();
  }
  std::unique_ptr<Transport> inner_;
  bool two_sided_only_;
  std::vector<std::pair<const unsigned char*, size_t>> sources_;
  std::list<std::vector<unsigned char>> copies_;  // corrupted sends, alive until the end
};

// Every rank of a job in this process on loopback, each behind a Recorder.
class RecordedJob {
 public:
  // external_packer: every rank gets a packer through SessionOptions (the path device packers
  // take: whole buckets packed into staging, receivers verify through the packer).
  // transport: "loopback" or "shm" (each rank's own segment, connected through the store).
  RecordedJob(JobSpec spec, bool two_sided_only, bool external_packer = false,
              const std::string& transport = "loopback")
      : spec_(std::move(spec)) {
    auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
    EXPECT_TRUE(server.ok());
    server_ = std::move(server).value();
    auto hub = NewLoopbackHub();
    world_ = SyncWorldSize(spec_.inputs);
    ranks_.resize(world_);
    for (int r = 0; r < world_; ++r) {
      Rank& k = ranks_[r];
      auto c = StoreClient::Connect(server_->address(), "test-token-0123456789", Millis(5000));
      EXPECT_TRUE(c.ok());
      k.store = std::move(c).value();
      k.tx = std::make_unique<Recorder>(
          transport == "shm" ? std::move(NewShmTransport()).value() : NewLoopbackTransport(hub),
          two_sided_only);
      SessionOptions o;
      o.sync_timeout = Millis(10000);
      if (external_packer) {
        k.packer = MakeCpuPacker();
        o.packer = k.packer.get();
      }
      auto s = SyncSession::Create(spec_.inputs, r, *k.store, *k.tx, o);
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      k.session = std::move(s).value();
      auto who = DescribeSyncRank(spec_.inputs, r);
      EXPECT_TRUE(who.ok());
      if (who->is_trainer) {
        auto t = job_internal::FillTrainerShards(spec_, who->trainer_rank);
        EXPECT_TRUE(t.ok());
        k.shards = std::move(t).value();
        for (auto& b : k.shards.bindings) {
          EXPECT_TRUE(k.session->BindSource(b).ok());
          k.tx->AddSource(b.data, b.region.numel() * DTypeSize(b.dtype));
        }
      } else {
        auto p = job_internal::AllocateEngineParams(k.session->ExpectedParams(),
                                                    spec_.inputs.options.wire_dtype);
        EXPECT_TRUE(p.ok());
        k.params = std::move(p).value();
        for (auto& b : k.params.bindings) EXPECT_TRUE(k.session->BindDest(b).ok());
      }
    }
    for (const Status& s : All([&](int r) { return ranks_[r].session->Connect(); })) {
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
  std::vector<Status> All(const std::function<Status(int)>& fn) {
    return testing::RunOnAll(world_, fn);
  }
  std::vector<Status> Sync(uint64_t v) {
    return All([&](int r) { return ranks_[r].session->Sync(v).status(); });
  }
  int64_t Mismatches() { return testing::EngineMismatches(spec_, ranks_); }
  int trainers() const { return spec_.inputs.trainer.world(); }
  int world() const { return world_; }
  Recorder& tx(int r) { return *ranks_[r].tx; }
  const SourceBinding& source(int r, size_t i) { return ranks_[r].shards.bindings.at(i); }
  SyncSession& session(int r) { return *ranks_[r].session; }
  int direct_posts() const {
    int n = 0;
    for (const auto& k : ranks_) n += k.tx->direct_posts;
    return n;
  }
  int staged_posts() const {
    int n = 0;
    for (const auto& k : ranks_) n += k.tx->staged_posts;
    return n;
  }

 private:
  struct Rank {
    std::unique_ptr<StoreClient> store;
    std::unique_ptr<Packer> packer;  // outlives the session (declared before it)
    std::unique_ptr<Recorder> tx;
    std::unique_ptr<SyncSession> session;
    job_internal::TrainerShards shards;
    job_internal::EngineParams params;
  };
  JobSpec spec_;
  std::unique_ptr<StoreServer> server_;
  int world_ = 0;
  std::vector<Rank> ranks_;
};

using testing::ExpectAllOk;

// Param: "put" and "two_sided" on loopback (puts hidden for the second, as UCX tag mode), and
// "shm" (two-sided with summed copies: the checksum rides on the transport's copies).
class ZeroCopy : public ::testing::TestWithParam<std::string> {
 protected:
  RecordedJob Job(const char* trainer_dtype, bool external_packer = false,
                  const std::string& trainer = "fsdp=2") const {
    const bool shm = GetParam() == "shm";
    return RecordedJob(MidJob(trainer_dtype, "dp=1,tp=2,pp=2", trainer), GetParam() != "put",
                       external_packer, shm ? "shm" : "loopback");
  }
};

TEST_P(ZeroCopy, MixedDirectAndPackedTransfersVerifyEveryElement) {
  RecordedJob job = Job("bf16");
  ExpectAllOk(job.Sync(1));
  EXPECT_EQ(job.Mismatches(), 0);
  EXPECT_GT(job.direct_posts(), 0) << "no transfer left from the trainer's memory";
  EXPECT_GT(job.staged_posts(), 0) << "row-parallel runs should be packed";
  // Again (the same buffers and split are replayed).
  ExpectAllOk(job.Sync(2));
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST_P(ZeroCopy, CastingTrainerSendsOnlyFromStaging) {
  RecordedJob job = Job("fp32");
  ExpectAllOk(job.Sync(1));
  EXPECT_EQ(job.Mismatches(), 0);
  EXPECT_EQ(job.direct_posts(), 0);
  EXPECT_GT(job.staged_posts(), 0);
}

TEST_P(ZeroCopy, CorruptedDirectTransferIsDataLossNamingTheParameter) {
  RecordedJob job = Job("bf16");
  ExpectAllOk(job.Sync(1));
  job.tx(1).corrupt_next_direct = true;
  auto st = job.Sync(2);
  EXPECT_EQ(job.tx(1).corrupted, 1);
  testing::ExpectOneDataLossFrom(job, st, 1);
  ExpectAllOk(job.Sync(3));
  EXPECT_EQ(job.Mismatches(), 0);
  for (int r = job.trainers(); r < job.world(); ++r) EXPECT_FALSE(job.session(r).IsPoisoned());
}

// Direct transfers read the trainer's memory as it is at each sync (nothing stale is kept in
// staging): a changed source element arrives, with a matching checksum, and changing it back
// restores the parameters.
TEST_P(ZeroCopy, DirectTransfersCarryTheSourceAsItIsAtSyncTime) {
  RecordedJob job = Job("bf16");
  ExpectAllOk(job.Sync(1));
  EXPECT_EQ(job.Mismatches(), 0);
  // Trainer rank 0's embedding shard: its rows are contiguous on both ends (direct).
  auto* emb = static_cast<unsigned char*>(const_cast<void*>(job.source(0, 0).data));
  emb[1] ^= 0x40;  // high byte of bf16 element 0
  ExpectAllOk(job.Sync(2));
  EXPECT_GE(job.Mismatches(), 1);
  emb[1] ^= 0x40;
  ExpectAllOk(job.Sync(3));
  EXPECT_EQ(job.Mismatches(), 0);
}

// A packer passed in packs whole buckets into staging and sends the same split from there; the
// receivers (same split, verification through the packer) accept it.
TEST_P(ZeroCopy, PackerPassedInSendsTheSameSplitFromStaging) {
  RecordedJob job = Job("bf16", /*external_packer=*/true);
  ExpectAllOk(job.Sync(1));
  EXPECT_EQ(job.Mismatches(), 0);
  EXPECT_EQ(job.direct_posts(), 0);
  EXPECT_GT(job.staged_posts(), 0);
  job.tx(0).corrupt_next_direct = true;  // nothing leaves from the sources: nothing corrupted
  ExpectAllOk(job.Sync(2));
  EXPECT_EQ(job.tx(0).corrupted, 0);
}

// Megatron trainers on the same paths: direct transfers from the local parameters, packed ones
// from their strided regions, a corrupted direct transfer caught, and a packer passed in (the
// device path's shape) packing whole buckets from the local regions.
TEST_P(ZeroCopy, MegatronLocalParametersDirectPackedAndCorrupted) {
  RecordedJob job = Job("bf16", false, "megatron=tp=2,pp=2");
  ExpectAllOk(job.Sync(1));
  EXPECT_EQ(job.Mismatches(), 0);
  EXPECT_GT(job.direct_posts(), 0) << "no transfer left from the local parameters";
  EXPECT_GT(job.staged_posts(), 0);
  job.tx(1).corrupt_next_direct = true;
  auto st = job.Sync(2);
  EXPECT_EQ(job.tx(1).corrupted, 1);
  testing::ExpectOneDataLossFrom(job, st, 1);
  ExpectAllOk(job.Sync(3));
  EXPECT_EQ(job.Mismatches(), 0);
}

TEST_P(ZeroCopy, MegatronWithAPackerPassedIn) {
  RecordedJob job = Job("fp32", /*external_packer=*/true, "megatron=tp=1,pp=2,dp=2");
  ExpectAllOk(job.Sync(1));
  EXPECT_EQ(job.Mismatches(), 0);
  EXPECT_EQ(job.direct_posts(), 0);
  EXPECT_GT(job.staged_posts(), 0);
}

INSTANTIATE_TEST_SUITE_P(Modes, ZeroCopy, ::testing::Values("two_sided", "put", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardsync
