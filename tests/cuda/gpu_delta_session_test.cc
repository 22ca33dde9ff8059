// Issue 35 on device pairs: the delta encoding over cuda_ipc (src/cuda/cuda_ipc/delta_ipc.cc), one
// GPU, in-process ranks (one thread each). Each delta job runs beside a twin job under encoding
// full with the same trainer values; after every sync every byte of every engine parameter must
// equal the twin's (whose first sync is checked element by element against the synthetic
// weights). Fallbacks: a corrupted base byte, engines whose bytes are gone, a sync that failed
// (the base version differs); a delta the receiver's device decode refuses fails the sync and
// poisons. Staged commits: deltas apply to the committed bytes and land in staging (an
// uncommitted sync, a rollback: the base version differs). Block FP8 (closed by default, opened
// here by the test hook): deltas of the wire image (e4m3 codes, scales, copies, pads) by byte, in
// place and staged.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "cuda/delta/delta_fault.h"
#include "gpu_test_util.h"
#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "shardsync/delta_rule.h"
#include "shardsync/gpu.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"

namespace shardsync::gpu {
namespace {

constexpr char kToken[] = "test-token-0123456789";

JobSpec Spec(WireEncoding enc) {
  // 2 trainer ranks, 4 engine ranks (tp 2 x pp 2), 16 KiB buckets: several buckets per pair.
  JobSpec s =
      testing::Job(testing::TinyQwen2(4, true), "fsdp=2", "dp=1,tp=2,pp=2", "sglang", 16 << 10);
  s.inputs.options.encoding = enc;
  return s;
}

class DeviceJob {
 public:
  explicit DeviceJob(JobSpec spec, SessionOptions::Commit commit = SessionOptions::Commit::kInPlace)
      : spec_(std::move(spec)), commit_(commit) {
    server_ = std::move(StoreServer::Start("127.0.0.1", 0, kToken)).value();
    world_ = SyncWorldSize(spec_.inputs);
    ranks_.resize(world_);
  }

  std::vector<Status> All(const std::function<Status(int)>& fn) {
    std::vector<Status> st(world_);
    std::vector<std::thread> ts;
    for (int r = 0; r < world_; ++r) ts.emplace_back([&, r] { st[r] = fn(r); });
    for (auto& t : ts) t.join();
    return st;
  }
  std::vector<Status> Connect() {
    return All([&](int r) { return SetUp(r); });
  }
  std::vector<Status> Sync(uint64_t v, std::vector<SyncReport>* reps = nullptr) {
    if (reps) reps->assign(world_, {});
    return All([&](int r) {
      auto rep = ranks_[r].session->Sync(v);
      if (rep.ok() && reps) (*reps)[r] = *rep;
      return rep.status();
    });
  }
  // The delta session test's update (tests/sync/delta_session_test.cc Update) of every trainer
  // rank's fp32 values, then uploaded to its device copies.
  void Update(uint64_t seed, double fraction) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0, 1);
    for (int r = 0; r < trainers(); ++r) {
      Rank& k = ranks_[r];
      for (size_t i = 0; i < k.shards.bindings.size(); ++i) {
        const SourceBinding& b = k.shards.bindings[i];
        ASSERT_EQ(b.dtype, DType::kF32);
        float* x = static_cast<float*>(const_cast<void*>(b.data));
        for (int64_t j = 0; j < b.region.numel(); ++j) {
          const double p = u(rng);
          if (p < fraction)
            x[j] = x[j] * (1.0f + 1.0f / 64) + 1e-3f;
          else if (p < fraction + 0.1)
            x[j] = x[j] * (1.0f + 1.0f / (1 << 20));
        }
        SS_ASSERT_OK(CopyToDevice(k.bufs[i]->data(), b.data, b.region.numel() * 4));
      }
    }
  }
  // Every engine rank's parameters (device), byte for byte.
  std::vector<std::vector<unsigned char>> Engines() {
    std::vector<std::vector<unsigned char>> out;
    for (int r = trainers(); r < world_; ++r) {
      std::vector<unsigned char> all;
      for (const auto& buf : ranks_[r].bufs) {
        std::vector<unsigned char> h(buf->bytes());
        EXPECT_TRUE(CopyToHost(h.data(), buf->data(), h.size()).ok());
        all.insert(all.end(), h.begin(), h.end());
      }
      out.push_back(std::move(all));
    }
    return out;
  }
  // Element check of every engine parameter against the synthetic weights (the first sync).
  int64_t Mismatches() {
    int64_t bad = 0;
    for (int r = trainers(); r < world_; ++r) {
      Rank& k = ranks_[r];
      for (size_t i = 0; i < k.bufs.size(); ++i) {
        EXPECT_TRUE(
            CopyToHost(k.host.bindings[i].data, k.bufs[i]->data(), k.bufs[i]->bytes()).ok());
      }
      RankResult rr;
      job_internal::VerifyEngineParams(spec_, k.session->ExpectedParams(), k.host.bindings, rr);
      EXPECT_GT(rr.elements_checked, 0);
      bad += rr.element_mismatches;
    }
    return bad;
  }
  std::vector<Status> Commit(uint64_t v) {
    return All([&](int r) { return ranks_[r].session->Commit(v).status(); });
  }
  std::vector<Status> Rollback() {
    return All([&](int r) { return r < trainers() ? OkStatus() : ranks_[r].session->Rollback(); });
  }
  // Engine rank r's device buffer i.
  DeviceBuffer& engine_buf(int r, size_t i) { return *ranks_[r].bufs[i]; }
  size_t engine_bufs(int r) const { return ranks_[r].bufs.size(); }
  SyncSession& session(int r) { return *ranks_[r].session; }
  int world() const { return world_; }
  int trainers() const { return spec_.inputs.trainer.world(); }

 private:
  struct Rank {
    std::unique_ptr<StoreClient> store;
    std::unique_ptr<Transport> tx;
    std::unique_ptr<Packer> packer;
    std::unique_ptr<SyncSession> session;
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    job_internal::TrainerShards shards;  // trainer: the host values (updated, then uploaded)
    job_internal::EngineParams host;     // engine: room for the element check
  };

  Status SetUp(int r) {
    Rank& k = ranks_[r];
    SS_RETURN_IF_ERROR(RegisterGpuTransports());
    SS_ASSIGN_OR_RETURN(k.store, StoreClient::Connect(server_->address(), kToken, Millis(10000)));
    SS_ASSIGN_OR_RETURN(PeerInfo self, DevicePeerInfo(r, 0));
    RouteOptions ro{self, "", {}};
    ro.options.params["device"] = "0";
    SS_ASSIGN_OR_RETURN(k.tx, NewRoutedTransport(ro));
    k.packer = MakeCudaPacker(0, Millis(20000));
    SessionOptions o;
    o.packer = k.packer.get();
    o.sync_timeout = Millis(20000);
    o.connect_timeout = Millis(20000);
    o.commit = commit_;
    SS_ASSIGN_OR_RETURN(k.session, SyncSession::Create(spec_.inputs, r, *k.store, *k.tx, o));
    if (k.session->is_trainer()) {
      SS_ASSIGN_OR_RETURN(k.shards, job_internal::FillTrainerShards(spec_, r));
      for (SourceBinding b : k.shards.bindings) {
        const size_t n = b.region.numel() * DTypeSize(b.dtype);
        SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(n, 0));
        SS_RETURN_IF_ERROR(CopyToDevice(buf->data(), b.data, n));
        b.data = buf->data();
        b.mem = MemKind::kCuda;
        b.device = 0;
        SS_RETURN_IF_ERROR(k.session->BindSource(b));
        k.bufs.push_back(std::move(buf));
      }
    } else {
      SS_ASSIGN_OR_RETURN(k.host,
                          job_internal::AllocateEngineParams(k.session->ExpectedParams(),
                                                             spec_.inputs.options.wire_dtype));
      for (DestBinding b : k.host.bindings) {
        const size_t n = NumElements(b.shape) * DTypeSize(b.dtype);
        SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(n, 0));
        SS_RETURN_IF_ERROR(Memset(buf->data(), 0xA5, n));  // garbage: a missed byte shows
        b.data = buf->data();
        b.mem = MemKind::kCuda;
        b.device = 0;
        SS_RETURN_IF_ERROR(k.session->BindDest(b));
        k.bufs.push_back(std::move(buf));
      }
    }
    return k.session->Connect();
  }

  JobSpec spec_;
  SessionOptions::Commit commit_;
  std::unique_ptr<StoreServer> server_;
  int world_ = 0;
  std::vector<Rank> ranks_;
};

void ExpectAllOk(const std::vector<Status>& st) {
  for (size_t r = 0; r < st.size(); ++r)
    EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
}

// A delta job and its twin under encoding full, synced and updated in step.
struct Twins {
  explicit Twins(WireEncoding enc = WireEncoding::kDelta) : Twins(Spec(enc), Spec(kFull)) {}
  Twins(JobSpec d, JobSpec f, SessionOptions::Commit commit = SessionOptions::Commit::kInPlace)
      : delta(std::move(d), commit), full(std::move(f)) {
    ExpectAllOk(delta.Connect());
    ExpectAllOk(full.Connect());
  }
  static constexpr WireEncoding kFull = WireEncoding::kFull;
  SyncReport Sync(uint64_t v) {
    ExpectAllOk(delta.Sync(v, &last));
    ExpectAllOk(full.Sync(v));
    for (const SyncReport& r : last) {
      // Every rank reports the same job-wide delta figures.
      EXPECT_EQ(r.delta.wire_bytes, last[0].delta.wire_bytes);
      EXPECT_EQ(r.delta.buckets_delta, last[0].delta.buckets_delta);
      EXPECT_EQ(r.delta.fallbacks(), last[0].delta.fallbacks());
    }
    return last[0];
  }
  void Update(uint64_t seed, double fraction) {
    delta.Update(seed, fraction);
    full.Update(seed, fraction);
  }
  void ExpectSame() { EXPECT_TRUE(delta.Engines() == full.Engines()); }
  DeviceJob delta, full;
  std::vector<SyncReport> last;
};

TEST(GpuDeltaSession, SyncsOfSmallUpdatesOverCudaIpcLandEveryByte) {
  SS_REQUIRE_GPU();
  Twins t;
  SyncReport r1 = t.Sync(1);
  EXPECT_EQ(t.delta.Mismatches(), 0);
  t.ExpectSame();
  EXPECT_EQ(r1.delta.buckets_delta, 0);
  EXPECT_GT(r1.delta.fallback_no_image, 0);
  EXPECT_EQ(r1.delta.fallback_no_image, r1.delta.buckets_full);
  EXPECT_EQ(r1.delta.wire_bytes, r1.delta.full_bytes);
  EXPECT_EQ(r1.delta.full_bytes, r1.bytes);
  for (uint64_t v = 2; v <= 6; ++v) {
    t.Update(v, 0.01);
    SyncReport r = t.Sync(v);
    t.ExpectSame();
    EXPECT_EQ(r.delta.fallbacks(), 0) << "version " << v;
    EXPECT_GT(r.delta.buckets_delta, 0) << "version " << v;
    EXPECT_LT(r.delta.wire_bytes, r.delta.full_bytes / 5) << "version " << v;
    EXPECT_EQ(r.delta.full_bytes, r.bytes);
    EXPECT_GT(r.delta.changed, 0);
    EXPECT_LT(r.delta.changed, r.delta.elements / 20);
    EXPECT_GT(r.delta.encode_seconds, 0);
    EXPECT_GT(r.delta.decode_seconds, 0);
    EXPECT_EQ(r.checksums_ok, r.checksums_total);
    // The engine ranks count what they landed, by the senders' reasons.
    for (int e = t.delta.trainers(); e < t.delta.world(); ++e) {
      EXPECT_GT(r.ranks[e].delta.buckets_delta, 0) << "engine " << e;
      EXPECT_GT(r.ranks[e].delta.decode_seconds, 0) << "engine " << e;
    }
  }
  // A version with no update: every delta is its header and a zero running count per 16 KiB
  // tile of its bucket (the index form, delta.h).
  SyncReport r = t.Sync(7);
  t.ExpectSame();
  EXPECT_EQ(r.delta.changed, 0);
  EXPECT_EQ(r.delta.buckets_full, 0);
  const int64_t tiles_lo = r.delta.full_bytes / int64_t{kDeltaTileBytes};
  EXPECT_GE(r.delta.wire_bytes,
            r.delta.buckets_delta * static_cast<int64_t>(kDeltaHeaderBytes) + 4 * tiles_lo);
  EXPECT_LE(r.delta.wire_bytes,
            r.delta.buckets_delta * static_cast<int64_t>(kDeltaHeaderBytes + 4) + 4 * tiles_lo);
  // A large update: no delta form is smaller than the bucket.
  t.Update(8, 0.97);
  SyncReport big = t.Sync(8);
  t.ExpectSame();
  EXPECT_GT(big.delta.full_by_size, 0);
  EXPECT_EQ(big.delta.fallbacks(), 0);
}

TEST(GpuDeltaSession, ACorruptedBaseByteOnTheEngineSendsThatBucketWhole) {
  SS_REQUIRE_GPU();
  Twins t;
  t.Sync(1);
  t.Update(2, 0.01);
  t.Sync(2);
  // One byte of the last engine rank's last parameter changes behind the session's back.
  const int e = t.delta.world() - 1;
  DeviceBuffer& b = t.delta.engine_buf(e, t.delta.engine_bufs(e) - 1);
  unsigned char c = 0;
  SS_ASSERT_OK(CopyToHost(&c, static_cast<unsigned char*>(b.data()) + 1, 1));
  c ^= 0x10;
  SS_ASSERT_OK(CopyToDevice(static_cast<unsigned char*>(b.data()) + 1, &c, 1));
  t.Update(3, 0.01);
  SyncReport r = t.Sync(3);
  t.ExpectSame();  // the bucket went whole: the corrupted byte is gone
  EXPECT_EQ(r.delta.fallback_checksum, 1);
  EXPECT_EQ(r.delta.fallbacks(), 1);
  EXPECT_GT(r.delta.buckets_delta, 0);
  int said = 0;
  for (int k = 0; k < t.delta.trainers(); ++k) {
    const std::string& why = t.last[k].local.delta.first_fallback;
    if (why.empty()) continue;
    ++said;
    EXPECT_NE(why.find("to sync rank " + std::to_string(e)), std::string::npos) << why;
    EXPECT_NE(why.find("base checksum differs (it holds v2 "), std::string::npos) << why;
  }
  EXPECT_EQ(said, 1);
  EXPECT_EQ(r.ranks.back().delta.fallback_checksum, 1);
}

TEST(GpuDeltaSession, EnginesWhoseBytesAreGoneFallBackEverywhereInTheSameSync) {
  SS_REQUIRE_GPU();
  Twins t;
  t.Sync(1);
  t.Update(2, 0.01);
  t.Sync(2);
  // A re-created engine's fresh memory: every byte zero.
  for (int e = t.delta.trainers(); e < t.delta.world(); ++e) {
    for (size_t i = 0; i < t.delta.engine_bufs(e); ++i) {
      DeviceBuffer& b = t.delta.engine_buf(e, i);
      SS_ASSERT_OK(Memset(b.data(), 0, b.bytes()));
    }
  }
  t.Update(3, 0.01);
  SyncReport r = t.Sync(3);
  t.ExpectSame();
  EXPECT_EQ(r.delta.buckets_delta, 0);
  EXPECT_GT(r.delta.buckets_full, 0);
  EXPECT_EQ(r.delta.fallback_checksum, r.delta.buckets_full);
}

// An encode whose own base sum is not the kept image's (here: a kept byte flipped just before
// it; on the H200 a block-FP8 image of 511 MiB did it unprovoked) sends that bucket whole in the
// same sync, under the checksum reason, instead of a delta the engine would refuse.
TEST(GpuDeltaSession, AnEncodeThatReadAnotherBaseSendsTheBucketWhole) {
  SS_REQUIRE_GPU();
  Twins t;
  t.Sync(1);
  t.Update(2, 0.01);
  CorruptNextKeptImageForTesting(1);
  SyncReport r = t.Sync(2);
  t.ExpectSame();
  EXPECT_EQ(r.checksums_ok, r.checksums_total);
  EXPECT_EQ(r.delta.fallback_checksum, 1);
  EXPECT_EQ(r.delta.fallbacks(), 1);
  EXPECT_GT(r.delta.buckets_delta, 0);
  int said = 0;
  for (int k = 0; k < t.delta.trainers(); ++k) {
    said +=
        t.last[k].local.delta.first_fallback.find("the device encoder's sums") != std::string::npos;
  }
  EXPECT_EQ(said, 1);
  // The whole bucket became the kept image: the next sync is deltas again.
  t.Update(3, 0.01);
  SyncReport r3 = t.Sync(3);
  t.ExpectSame();
  EXPECT_EQ(r3.delta.fallbacks(), 0);
  EXPECT_EQ(r3.delta.buckets_full, 0);
}

TEST(GpuDeltaSession, ARefusedDeltaFailsAndPoisonsThenTheNextSyncFallsBackAndVerifies) {
  SS_REQUIRE_GPU();
  Twins t;
  t.Sync(1);
  t.Update(2, 0.01);
  t.Sync(2);
  t.Update(3, 0.01);
  // The first delta copied for bucket 1 of a pair has a byte of its records flipped: that
  // receiver's decode must refuse it (its bucket 0 landed already).
  FailNextDeltaForTesting(1, 50);
  auto st = t.delta.Sync(3);
  ExpectAllOk(t.full.Sync(3));
  int refused = 0;
  for (int r = 0; r < t.delta.world(); ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    refused += st[r].message().find("was refused, nothing of it landed") != std::string::npos;
    if (r >= t.delta.trainers()) {
      EXPECT_TRUE(t.delta.session(r).IsPoisoned()) << "rank " << r;
    }
  }
  EXPECT_GE(refused, 1);
  // The next sync: bucket 0 of that pair landed in the failed sync (its base is of no verified
  // version now) and bucket 1 was never acknowledged (the sender forgot it): both go whole.
  t.Update(4, 0.01);
  SyncReport r = t.Sync(4);
  t.ExpectSame();
  EXPECT_GT(r.delta.fallback_version, 0);
  EXPECT_GT(r.delta.fallback_no_image, 0);
  EXPECT_GT(r.delta.buckets_delta, 0);
  for (int e = t.delta.trainers(); e < t.delta.world(); ++e)
    EXPECT_FALSE(t.delta.session(e).IsPoisoned());
}

// A block-FP8 job (qwen3 shape, 128-row blocks on the fsdp=2 grid: quantize and copy ops only).
JobSpec Fp8Spec(WireEncoding enc) {
  JobFlags f;
  f.model = testing::WriteConfig("qwen3-fp8-delta", R"({
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
  "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "torch_dtype": "bfloat16"})");
  f.quant = "fp8-block128";
  f.trainer = "fsdp=2";
  f.rollout = "dp=1,tp=2,pp=2";
  f.bucket_bytes = 64 << 10;
  f.transport = "loopback";
  f.encoding = std::string(WireEncodingName(enc));
  return JobSpecFromFlags(f).value();
}

// One corrupted byte of the last engine rank's first parameter (live bytes).
void CorruptEngineByte(DeviceJob& j) {
  const int e = j.world() - 1;
  DeviceBuffer& b = j.engine_buf(e, 0);
  unsigned char c = 0;
  SS_ASSERT_OK(CopyToHost(&c, static_cast<unsigned char*>(b.data()) + 1, 1));
  c ^= 0x10;
  SS_ASSERT_OK(CopyToDevice(static_cast<unsigned char*>(b.data()) + 1, &c, 1));
}

// Block FP8 over cuda_ipc: each bucket's whole wire image diffed by byte, landed from the
// verified slot by the FP8 landing; every byte as the full twin's, the fallbacks as for bf16.
TEST(GpuDeltaSession, BlockFp8OverCudaIpcSendsDeltasOfTheWireImage) {
  SS_REQUIRE_GPU();
  Twins t(Fp8Spec(WireEncoding::kDelta), Fp8Spec(WireEncoding::kFull));
  SyncReport r1 = t.Sync(1);
  t.ExpectSame();
  EXPECT_EQ(t.full.Mismatches(), 0);
  EXPECT_EQ(r1.delta.fallback_no_image, r1.delta.buckets_full);
  EXPECT_GT(r1.delta.buckets_full, 4);
  for (uint64_t v = 2; v <= 3; ++v) {
    t.Update(v, 0.001);
    SyncReport r = t.Sync(v);
    t.ExpectSame();
    EXPECT_EQ(r.delta.fallbacks(), 0) << "version " << v;
    EXPECT_GT(r.delta.buckets_delta, 0) << "version " << v;
    EXPECT_GT(r.delta.changed, 0) << "version " << v;
    EXPECT_LT(r.delta.wire_bytes, r.delta.full_bytes / 2) << "version " << v;
    if (r.delta.full_by_size == 0) {  // every bucket compared, by byte
      EXPECT_EQ(r.delta.elements, r.delta.full_bytes) << "version " << v;
    }
    EXPECT_EQ(r.checksums_ok, r.checksums_total);
  }
  SyncReport same = t.Sync(4);  // no update: headers alone
  t.ExpectSame();
  EXPECT_EQ(same.delta.changed, 0);
  EXPECT_EQ(same.delta.buckets_full, 0);
  CorruptEngineByte(t.delta);  // an e4m3 code or scale byte
  t.Update(5, 0.001);
  SyncReport r5 = t.Sync(5);
  t.ExpectSame();
  EXPECT_EQ(r5.delta.fallback_checksum, 1);
  EXPECT_EQ(r5.delta.fallbacks(), 1);
}

// Staged commits over delta pairs: the base is the committed (live) bytes at the committed
// version; the result lands in staging and the commit serves it. A sync never committed, or a
// rollback, leaves the live bytes at another version than the trainer kept: whole, by reason.
void StagedScenario(JobSpec delta, JobSpec full) {
  Twins t(std::move(delta), std::move(full), SessionOptions::Commit::kStaged);
  SyncReport r1 = t.Sync(1);
  EXPECT_EQ(r1.delta.fallback_no_image, r1.delta.buckets_full);
  ExpectAllOk(t.delta.Commit(1));
  t.ExpectSame();
  t.Update(2, 0.001);
  const auto v1 = t.delta.Engines();
  SyncReport r2 = t.Sync(2);
  EXPECT_TRUE(t.delta.Engines() == v1);  // in staging: the live bytes still serve v1
  EXPECT_EQ(r2.delta.fallbacks(), 0);
  EXPECT_GT(r2.delta.buckets_delta, 0);
  EXPECT_EQ(r2.checksums_ok, r2.checksums_total);
  ExpectAllOk(t.delta.Commit(2));
  t.ExpectSame();
  // Synced, never committed: the next sync's base (live v2) is not the kept v3.
  t.Update(3, 0.001);
  SyncReport r3 = t.Sync(3);
  EXPECT_EQ(r3.delta.fallbacks(), 0);
  EXPECT_GT(r3.delta.buckets_delta, 0);
  t.Update(4, 0.001);
  SyncReport r4 = t.Sync(4);
  EXPECT_EQ(r4.delta.buckets_delta, 0);
  EXPECT_EQ(r4.delta.fallback_version, r4.delta.buckets_full);
  ExpectAllOk(t.delta.Commit(4));
  t.ExpectSame();
  // A corrupted live byte: that bucket whole.
  CorruptEngineByte(t.delta);
  t.Update(5, 0.001);
  SyncReport r5 = t.Sync(5);
  EXPECT_EQ(r5.delta.fallback_checksum, 1);
  EXPECT_EQ(r5.delta.fallbacks(), 1);
  ExpectAllOk(t.delta.Commit(5));
  t.ExpectSame();
  // Rolled back to v4: the base version differs from the kept v5.
  ExpectAllOk(t.delta.Rollback());
  t.Update(6, 0.001);
  SyncReport r6 = t.Sync(6);
  EXPECT_EQ(r6.delta.buckets_delta, 0);
  EXPECT_EQ(r6.delta.fallback_version, r6.delta.buckets_full);
  ExpectAllOk(t.delta.Commit(6));
  t.ExpectSame();
  t.Update(7, 0.001);
  SyncReport r7 = t.Sync(7);
  EXPECT_EQ(r7.delta.fallbacks(), 0);
  EXPECT_GT(r7.delta.buckets_delta, 0);
  ExpectAllOk(t.delta.Commit(7));
  t.ExpectSame();
}

TEST(GpuDeltaSession, StagedCommitAppliesDeltasToTheCommittedBytes) {
  SS_REQUIRE_GPU();
  StagedScenario(Spec(WireEncoding::kDelta), Spec(WireEncoding::kFull));
}

TEST(GpuDeltaSession, StagedCommitOfBlockFp8AppliesDeltasToTheCommittedImage) {
  SS_REQUIRE_GPU();
  StagedScenario(Fp8Spec(WireEncoding::kDelta), Fp8Spec(WireEncoding::kFull));
}

// Encoding auto over cuda_ipc pairs where no delta can pay at the knobs' speeds (the defaults:
// NVLink's 450 GB/s against the device steps' 200 GB/s together) prepares ordinary full pairs:
// no delta figures, every byte as the twin's.
TEST(GpuDeltaSession, AutoAtTheDefaultKnobsRunsFullPairs) {
  SS_REQUIRE_GPU();
  for (const char* knob : {"SHARDSYNC_DELTA_IPC_LINK_MBPS", "SHARDSYNC_DELTA_DEVICE_ENCODE_MBPS",
                           "SHARDSYNC_DELTA_DEVICE_DECODE_MBPS"}) {
    if (std::getenv(knob) != nullptr) GTEST_SKIP() << knob << " is set";
  }
  Twins t(WireEncoding::kAuto);
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) t.Update(v, 0.01);
    SyncReport r = t.Sync(v);
    t.ExpectSame();
    EXPECT_EQ(r.checksums_ok, r.checksums_total) << "version " << v;
    EXPECT_EQ(r.delta.buckets_delta, 0) << "version " << v;
    EXPECT_GT(r.delta.full_by_auto, 0) << "version " << v;
    EXPECT_EQ(r.delta.full_by_auto, r.delta.buckets_full) << "version " << v;
    EXPECT_EQ(r.delta.wire_bytes, r.delta.full_bytes) << "version " << v;
    if (v == 1) {
      EXPECT_EQ(t.delta.Mismatches(), 0);  // the synthetic weights, before any update
    }
  }
}

// nccl pairs carry the delta encoding (delta_nccl.cc) for copy plans and block FP8's image pairs;
// an image pair with ops the delta pairs do not build (stage ops, amax-exchanged rows) refuses it
// when prepared (at Connect), naming the pair and the op. The check comes before any communicator
// or CUDA call, so it runs without a GPU.
TEST(GpuDeltaSession, NcclImagePairsWithStageOpsRefuseTheDeltaEncodingNamingThePair) {
  std::unique_ptr<Transport> t = MakeNcclTransport({});
  if (!t) GTEST_SKIP() << "built without CUDA";
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  ASSERT_TRUE(server.ok());
  auto store = StoreClient::Connect((*server)->address(), kToken, Millis(5000));
  ASSERT_TRUE(store.ok());
  PairSpec spec;
  spec.peer = 1;
  PairBucket bucket;
  bucket.bytes = 4096;
  EncodedRegion stage;
  stage.encoding = static_cast<uint8_t>(Encoding::kStage);
  bucket.encoded.push_back(stage);
  spec.buckets.push_back(bucket);
  spec.delta.on = true;
  spec.delta.element_size = 1;
  spec.image = true;
  auto p = t->Prepare(**store, spec, Millis(1000));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(p.status().message().find("nccl: delta pair to rank 1"), std::string::npos)
      << p.status().ToString();
  EXPECT_NE(p.status().message().find("encoding 'stage'"), std::string::npos)
      << p.status().ToString();
}

}  // namespace
}  // namespace shardsync::gpu
