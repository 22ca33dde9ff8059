// Issue 35 on nccl pairs (src/cuda/nccl/delta_nccl.cc): the delta encoding's fallbacks over one
// GPU, two rank processes as two emulated nodes. NCCL refuses two ranks of one host on one GPU
// and threads share one environment, so the test re-runs this binary twice (posix_spawn of
// /proc/self/exe: CUDA does not survive a fork), each child one sync rank with its own
// SHARDSYNC_HOST_ID and NCCL_HOSTID (transport.h HostIdentity), joined through the parent's
// store: their pair is an nccl pair over NCCL's socket transport.
//
// The sequence (trainer rank 0, engine rank 1, 16 KiB buckets): v1 whole (no image); v2 deltas;
// a corrupted engine byte -> that bucket whole (base checksum); the engine rolled back to its v2
// bytes -> whole where they differ; the engine re-created (zeros) -> every bucket whole; then the
// trainer restores its first values and every engine element is checked against them. Every
// sync verifies its checksums. Last, a delta byte flipped on its way: the engine's decode refuses
// it, the sync fails on both ranks and the engine is poisoned; the pair's communicator is aborted
// (as for full nccl pairs), so the next sync fails with Aborted: the job re-connects.
//
// Two more scenarios on the same two-process pair: a staged commit (deltas over the committed
// bytes, landed in staging; a sync never committed sends the next whole by base version) and
// block FP8 (deltas of the wire image by byte; closed by default, opened by the test hook).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/delta/delta_fault.h"
#include "gpu_test_util.h"
#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "shardsync/gpu.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"

extern char** environ;

namespace shardsync::gpu {
namespace {

constexpr char kToken[] = "test-token-0123456789";
constexpr char kChildEnv[] = "SS_DELTA_NCCL_CHILD";  // "<rank> <mode> <store address>"

JobSpec Spec() {
  JobSpec s = testing::Job(testing::TinyQwen2(4, true), "fsdp=1", "dp=1", "sglang", 16 << 10);
  s.inputs.options.encoding = WireEncoding::kDelta;
  return s;
}

// Block FP8 (qwen3 shape): quantize and copy ops, 64 KiB buckets.
JobSpec Fp8Spec() {
  JobFlags f;
  f.model = testing::WriteConfig("qwen3-fp8-delta-nccl", R"({
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
  "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "torch_dtype": "bfloat16"})");
  f.quant = "fp8-block128";
  f.trainer = "fsdp=1";
  f.rollout = "dp=1";
  f.bucket_bytes = 64 << 10;
  f.transport = "loopback";
  f.encoding = "delta";
  return JobSpecFromFlags(f).value();
}

// One sync rank of the job in this process.
struct Rank {
  JobSpec spec = Spec();
  SessionOptions::Commit commit = SessionOptions::Commit::kInPlace;
  std::unique_ptr<StoreClient> store;
  std::unique_ptr<Transport> tx;
  std::unique_ptr<Packer> packer;
  std::unique_ptr<SyncSession> session;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  job_internal::TrainerShards shards;
  std::vector<std::vector<float>> first;  // trainer: its first values
  job_internal::EngineParams host;

  Status SetUp(int r, const std::string& address) {
    SS_RETURN_IF_ERROR(RegisterGpuTransports());
    SS_ASSIGN_OR_RETURN(store, StoreClient::Connect(address, kToken, Millis(10000)));
    SS_ASSIGN_OR_RETURN(PeerInfo self, DevicePeerInfo(r, 0));
    RouteOptions ro{self, "nccl", {}};
    ro.options.params["device"] = "0";
    SS_ASSIGN_OR_RETURN(tx, NewRoutedTransport(ro));
    packer = MakeCudaPacker(0, Millis(20000));
    SessionOptions o;
    o.packer = packer.get();
    o.sync_timeout = Millis(20000);
    o.connect_timeout = Millis(30000);
    o.commit = commit;
    SS_ASSIGN_OR_RETURN(session, SyncSession::Create(spec.inputs, r, *store, *tx, o));
    if (session->is_trainer()) {
      SS_ASSIGN_OR_RETURN(shards, job_internal::FillTrainerShards(spec, r));
      for (SourceBinding b : shards.bindings) {
        const size_t n = b.region.numel() * DTypeSize(b.dtype);
        const auto* f = static_cast<const float*>(b.data);
        first.emplace_back(f, f + b.region.numel());
        SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(n, 0));
        SS_RETURN_IF_ERROR(CopyToDevice(buf->data(), b.data, n));
        b.data = buf->data();
        b.mem = MemKind::kCuda;
        b.device = 0;
        SS_RETURN_IF_ERROR(session->BindSource(b));
        bufs.push_back(std::move(buf));
      }
    } else {
      SS_ASSIGN_OR_RETURN(host, job_internal::AllocateEngineParams(session->ExpectedParams(),
                                                                   spec.inputs.options.wire_dtype));
      for (DestBinding b : host.bindings) {
        const size_t n = NumElements(b.shape) * DTypeSize(b.dtype);
        SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(n, 0));
        SS_RETURN_IF_ERROR(Memset(buf->data(), 0xA5, n));
        b.data = buf->data();
        b.mem = MemKind::kCuda;
        b.device = 0;
        SS_RETURN_IF_ERROR(session->BindDest(b));
        bufs.push_back(std::move(buf));
      }
    }
    return session->Connect();
  }

  // Trainer: gpu_delta_session_test.cc's update (`restore`: back to the first values).
  void Update(uint64_t seed, double fraction, bool restore = false) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0, 1);
    for (size_t i = 0; i < shards.bindings.size(); ++i) {
      const SourceBinding& b = shards.bindings[i];
      float* x = static_cast<float*>(const_cast<void*>(b.data));
      for (int64_t j = 0; j < b.region.numel(); ++j) {
        const double p = u(rng);
        if (restore)
          x[j] = first[i][j];
        else if (p < fraction)
          x[j] = x[j] * (1.0f + 1.0f / 64) + 1e-3f;
        else if (p < fraction + 0.1)
          x[j] = x[j] * (1.0f + 1.0f / (1 << 20));
      }
      SS_ASSERT_OK(CopyToDevice(bufs[i]->data(), b.data, b.region.numel() * 4));
    }
  }
  std::vector<std::vector<unsigned char>> Snapshot() {
    std::vector<std::vector<unsigned char>> out;
    for (const auto& b : bufs) {
      out.emplace_back(b->bytes());
      EXPECT_TRUE(CopyToHost(out.back().data(), b->data(), b->bytes()).ok());
    }
    return out;
  }
  void Restore(const std::vector<std::vector<unsigned char>>& s) {
    for (size_t i = 0; i < bufs.size(); ++i) {
      SS_ASSERT_OK(CopyToDevice(bufs[i]->data(), s[i].data(), s[i].size()));
    }
  }
  // Engine: every element against the trainer's first values.
  int64_t Mismatches() {
    for (size_t i = 0; i < bufs.size(); ++i) {
      EXPECT_TRUE(CopyToHost(host.bindings[i].data, bufs[i]->data(), bufs[i]->bytes()).ok());
    }
    RankResult rr;
    job_internal::VerifyEngineParams(spec, session->ExpectedParams(), host.bindings, rr);
    EXPECT_GT(rr.elements_checked, 0);
    return rr.element_mismatches;
  }
};

#define SYNC_OK(rep, v)                                                  \
  SS_ASSERT_OK_AND_ASSIGN(const SyncReport rep, k.session->Sync(v));     \
  EXPECT_EQ(rep.checksums_ok, rep.checksums_total) << "version " << (v); \
  EXPECT_EQ(rep.delta.full_bytes, rep.bytes) << "version " << (v)

// This child's rank and scenario ("fallbacks", "staged", "fp8") and the parent's store.
struct ChildArgs {
  int rank = 0;
  std::string mode, address;
};
bool ChildArgsOf(ChildArgs* a) {
  const char* env = std::getenv(kChildEnv);
  if (env == nullptr) return false;
  const std::string arg = env;
  const size_t s1 = arg.find(' '), s2 = arg.find(' ', s1 + 1);
  a->rank = std::stoi(arg.substr(0, s1));
  a->mode = arg.substr(s1 + 1, s2 - s1 - 1);
  a->address = arg.substr(s2 + 1);
  return true;
}

void FallbacksChild(Rank& k);
void StagedChild(Rank& k);
void Fp8Child(Rank& k);

// One rank of the parent's job (run by the parent only: DISABLED_ outside it).
TEST(GpuDeltaNcclChild, DISABLED_Rank) {
  ChildArgs a;
  if (!ChildArgsOf(&a)) GTEST_SKIP() << kChildEnv << " is not set";
  Rank k;
  if (a.mode == "staged") k.commit = SessionOptions::Commit::kStaged;
  if (a.mode == "fp8") k.spec = Fp8Spec();
  SS_ASSERT_OK(k.SetUp(a.rank, a.address));
  // The pair is an nccl pair (not the cuda_ipc fallback of one host).
  ASSERT_EQ(k.tx->PeerTransport(1 - a.rank), "nccl");
  if (a.mode == "staged") return StagedChild(k);
  if (a.mode == "fp8") return Fp8Child(k);
  FallbacksChild(k);
}

// Staged commits: deltas over the committed bytes, landed in staging; a sync never committed
// sends the next one whole (base version differs); the first values restored as deltas and
// committed: every element checked.
void StagedChild(Rank& k) {
  const bool trainer = k.session->is_trainer();
  SYNC_OK(r1, 1);
  EXPECT_EQ(r1.delta.fallback_no_image, r1.delta.buckets_full);
  SS_ASSERT_OK(k.session->Commit(1).status());
  if (!trainer) {
    EXPECT_EQ(k.Mismatches(), 0);
  }
  const auto v1 = trainer ? decltype(k.Snapshot()){} : k.Snapshot();
  if (trainer) k.Update(2, 0.01);
  SYNC_OK(r2, 2);
  EXPECT_EQ(r2.delta.fallbacks(), 0);
  EXPECT_GT(r2.delta.buckets_delta, 0);
  EXPECT_LT(r2.delta.wire_bytes, r2.delta.full_bytes / 5);
  if (!trainer) {
    EXPECT_TRUE(k.Snapshot() == v1);  // in staging: the live bytes still serve v1
  }
  SS_ASSERT_OK(k.session->Commit(2).status());
  if (trainer) k.Update(3, 0.01);
  SYNC_OK(r3, 3);  // not committed
  EXPECT_GT(r3.delta.buckets_delta, 0);
  if (trainer) k.Update(4, 0.01);
  SYNC_OK(r4, 4);
  EXPECT_EQ(r4.delta.buckets_delta, 0);
  EXPECT_EQ(r4.delta.fallback_version, r4.delta.buckets_full);
  SS_ASSERT_OK(k.session->Commit(4).status());
  if (trainer) k.Update(0, 0, /*restore=*/true);
  SYNC_OK(r5, 5);
  EXPECT_EQ(r5.delta.fallbacks(), 0);
  EXPECT_GT(r5.delta.buckets_delta, 0);
  SS_ASSERT_OK(k.session->Commit(5).status());
  if (!trainer) {
    EXPECT_EQ(k.Mismatches(), 0);
  }
}

// Block FP8: deltas of the wire image by byte; a corrupted engine byte sends its bucket whole;
// the first values restored as deltas: every element checked.
void Fp8Child(Rank& k) {
  const bool trainer = k.session->is_trainer();
  SYNC_OK(r1, 1);
  EXPECT_EQ(r1.delta.fallback_no_image, r1.delta.buckets_full);
  EXPECT_GT(r1.delta.buckets_full, 1);
  if (!trainer) {
    EXPECT_EQ(k.Mismatches(), 0);
  }
  if (trainer) k.Update(2, 0.001);
  SYNC_OK(r2, 2);
  EXPECT_EQ(r2.delta.fallbacks(), 0);
  EXPECT_GT(r2.delta.buckets_delta, 0);
  EXPECT_GT(r2.delta.changed, 0);
  EXPECT_LT(r2.delta.wire_bytes, r2.delta.full_bytes / 2);
  if (!trainer) {
    unsigned char c = 0;
    auto* p = static_cast<unsigned char*>(k.bufs.front()->data()) + 1;
    SS_ASSERT_OK(CopyToHost(&c, p, 1));
    c ^= 0x10;
    SS_ASSERT_OK(CopyToDevice(p, &c, 1));
  }
  if (trainer) k.Update(3, 0.001);
  SYNC_OK(r3, 3);
  EXPECT_EQ(r3.delta.fallback_checksum, 1);
  EXPECT_EQ(r3.delta.fallbacks(), 1);
  EXPECT_GT(r3.delta.buckets_delta, 0);
  if (trainer) k.Update(0, 0, /*restore=*/true);
  SYNC_OK(r4, 4);
  EXPECT_EQ(r4.delta.fallbacks(), 0);
  EXPECT_GT(r4.delta.buckets_delta, 0);
  if (!trainer) {
    EXPECT_EQ(k.Mismatches(), 0);
  }
}

void FallbacksChild(Rank& k) {
  const bool trainer = k.session->is_trainer();
  SYNC_OK(r1, 1);
  EXPECT_EQ(r1.delta.buckets_delta, 0);
  EXPECT_GT(r1.delta.buckets_full, 1);
  EXPECT_EQ(r1.delta.fallback_no_image, r1.delta.buckets_full);
  if (!trainer) {
    EXPECT_EQ(k.Mismatches(), 0);
  }

  if (trainer) k.Update(2, 0.01);
  SYNC_OK(r2, 2);
  EXPECT_EQ(r2.delta.fallbacks(), 0);
  EXPECT_EQ(r2.delta.buckets_full, 0);
  EXPECT_LT(r2.delta.wire_bytes, r2.delta.full_bytes / 5);
  EXPECT_GT(r2.delta.changed, 0);
  const auto v2 = trainer ? decltype(k.Snapshot()){} : k.Snapshot();

  // A corrupted base byte: that bucket goes whole, the others as deltas.
  if (!trainer) {
    unsigned char c = 0;
    auto* p = static_cast<unsigned char*>(k.bufs.back()->data()) + 1;
    SS_ASSERT_OK(CopyToHost(&c, p, 1));
    c ^= 0x10;
    SS_ASSERT_OK(CopyToDevice(p, &c, 1));
  }
  if (trainer) k.Update(3, 0.01);
  SYNC_OK(r3, 3);
  EXPECT_EQ(r3.delta.fallback_checksum, 1);
  EXPECT_EQ(r3.delta.fallbacks(), 1);
  EXPECT_GT(r3.delta.buckets_delta, 0);
  if (trainer) {
    EXPECT_NE(r3.local.delta.first_fallback.find("base checksum differs (it holds v2 "),
              std::string::npos)
        << r3.local.delta.first_fallback;
  }

  // Rolled back: the engine's bytes of v2 again, verified at v3 as far as it knows.
  if (!trainer) k.Restore(v2);
  if (trainer) k.Update(4, 0.01);
  SYNC_OK(r4, 4);
  EXPECT_GT(r4.delta.fallback_checksum, 0);
  EXPECT_EQ(r4.delta.fallbacks(), r4.delta.fallback_checksum);

  // Re-created: fresh memory, every byte zero.
  if (!trainer) {
    for (auto& b : k.bufs) SS_ASSERT_OK(Memset(b->data(), 0, b->bytes()));
  }
  if (trainer) k.Update(5, 0.01);
  SYNC_OK(r5, 5);
  EXPECT_EQ(r5.delta.buckets_delta, 0);
  EXPECT_EQ(r5.delta.fallback_checksum, r5.delta.buckets_full);

  // Back to the first values, as deltas: every element checked.
  if (trainer) k.Update(0, 0, /*restore=*/true);
  SYNC_OK(r6, 6);
  EXPECT_EQ(r6.delta.fallbacks(), 0);
  EXPECT_GT(r6.delta.buckets_delta, 0);
  if (!trainer) {
    EXPECT_EQ(k.Mismatches(), 0);
  }

  // A delta byte flipped on its way (bucket 1): refused, nothing of it lands, the engine is
  // poisoned; the communicator goes with the failed sync.
  if (trainer) {
    FailNextDeltaForTesting(1, 50);
    k.Update(7, 0.01);
  }
  auto bad = k.session->Sync(7);
  ASSERT_FALSE(bad.ok());
  if (!trainer) {
    EXPECT_NE(bad.status().message().find("was refused, nothing of it landed"), std::string::npos)
        << bad.status().ToString();
    EXPECT_TRUE(k.session->IsPoisoned());
  }
  auto next = k.session->Sync(8);
  ASSERT_FALSE(next.ok());
  if (!trainer) {
    EXPECT_TRUE(k.session->IsPoisoned());
  }
}

// Runs the two ranks of scenario `mode` as child processes, each its own emulated node.
void RunChildren(const std::string& mode) {
  auto server = StoreServer::Start("127.0.0.1", 0, kToken);
  SS_ASSERT_OK(server.status());
  const std::string filter = "--gtest_filter=GpuDeltaNcclChild.DISABLED_Rank";
  std::vector<pid_t> kids;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string v = *e;
      if (!v.starts_with("SHARDSYNC_HOST_ID=") && !v.starts_with("NCCL_HOSTID=") &&
          !v.starts_with(std::string(kChildEnv) + "="))
        env.push_back(v);
    }
    const std::string node = "ss-delta-nccl-node" + std::to_string(r);
    env.push_back("SHARDSYNC_HOST_ID=" + node);
    env.push_back("NCCL_HOSTID=" + node);
    env.push_back(std::string(kChildEnv) + "=" + std::to_string(r) + " " + mode + " " +
                  (*server)->address());
    std::vector<char*> envp, argv;
    for (auto& v : env) envp.push_back(v.data());
    envp.push_back(nullptr);
    std::string self = "/proc/self/exe", also = "--gtest_also_run_disabled_tests";
    std::string f = filter;
    argv = {self.data(), f.data(), also.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data()), 0);
    kids.push_back(pid);
  }
  // Bounded: each sync waits at most its 20 s timeout; 120 s for the whole child.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (size_t i = 0; i < kids.size(); ++i) {
    int status = 0;
    pid_t got = 0;
    while ((got = waitpid(kids[i], &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (got == 0) {
      kill(kids[i], SIGKILL);
      waitpid(kids[i], &status, 0);
      ADD_FAILURE() << "rank " << i << " did not finish in 120 s";
      continue;
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << i << " failed (its output is above)";
  }
}

TEST(GpuDeltaNccl, FallbacksOverTwoEmulatedNodesVerifyAndARefusedDeltaPoisons) {
  SS_REQUIRE_GPU();
  if (!MakeNcclTransport({})) GTEST_SKIP() << "built without CUDA";
  RunChildren("fallbacks");
}

TEST(GpuDeltaNccl, StagedCommitsApplyDeltasToTheCommittedBytes) {
  SS_REQUIRE_GPU();
  if (!MakeNcclTransport({})) GTEST_SKIP() << "built without CUDA";
  RunChildren("staged");
}

TEST(GpuDeltaNccl, BlockFp8SendsDeltasOfTheWireImage) {
  SS_REQUIRE_GPU();
  if (!MakeNcclTransport({})) GTEST_SKIP() << "built without CUDA";
  RunChildren("fp8");
}

}  // namespace
}  // namespace shardsync::gpu
