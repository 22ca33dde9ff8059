// SyncSession with device bindings end to end (in-process ranks, one thread each): routed
// transports pick cuda_ipc for pairs on one GPU and nccl across GPUs (with the nccl hint), the
// session runs each pair as a prepared pair (cuda_ipc: one launch with the landed readback; nccl:
// pipelined rounds), and every engine element is compared with the synthetic HF value. The
// multi-process path (real IPC handles, killed peers) runs through `shardsync bench --device cuda`.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "cuda/gpu_launch_board.h"
#include "gpu_test_util.h"
#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/gpu.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"

namespace shardsync::gpu {
namespace {

struct DeviceRank {
  std::unique_ptr<StoreClient> store;
  std::unique_ptr<Transport> tx;
  std::unique_ptr<Packer> packer;
  std::unique_ptr<SyncSession> session;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  job_internal::EngineParams host;  // engine: the parameters copied back for the element check
  int device = 0;
};

// Trainer t on GPU t % gpus, engine rank (pp, tp) on GPU (pp * T + tp) % gpus.
int GpuOf(const PlanInputs& in, int rank, int gpus) {
  auto who = DescribeSyncRank(in, rank);
  if (who->is_trainer) return who->trainer_rank % gpus;
  return (who->pp_rank * in.rollout.shard.tp + who->tp_rank) % gpus;
}

Status SetUpRank(const JobSpec& job, int r, int gpus, const std::string& hint,
                 const std::string& addr, DeviceRank& k) {
  k.device = GpuOf(job.inputs, r, gpus);
  SS_RETURN_IF_ERROR(RegisterGpuTransports());
  SS_ASSIGN_OR_RETURN(k.store, StoreClient::Connect(addr, "test-token-0123456789", Millis(10000)));
  SS_ASSIGN_OR_RETURN(PeerInfo self, DevicePeerInfo(r, k.device));
  RouteOptions ro{self, hint, {}};
  ro.options.params["device"] = std::to_string(k.device);
  SS_ASSIGN_OR_RETURN(k.tx, NewRoutedTransport(ro));
  k.packer = MakeCudaPacker(k.device, Millis(20000));
  SessionOptions o;
  o.packer = k.packer.get();
  o.sync_timeout = Millis(20000);
  o.connect_timeout = Millis(20000);
  SS_ASSIGN_OR_RETURN(k.session, SyncSession::Create(job.inputs, r, *k.store, *k.tx, o));
  if (k.session->is_trainer()) {
    SS_ASSIGN_OR_RETURN(auto shards, job_internal::FillTrainerShards(job, r));
    for (SourceBinding b : shards.bindings) {
      const size_t n = b.region.numel() * DTypeSize(b.dtype);
      SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(n, k.device));
      SS_RETURN_IF_ERROR(CopyToDevice(buf->data(), b.data, n));
      b.data = buf->data();
      b.mem = MemKind::kCuda;
      b.device = k.device;
      SS_RETURN_IF_ERROR(k.session->BindSource(b));
      k.bufs.push_back(std::move(buf));
    }
  } else {
    SS_ASSIGN_OR_RETURN(k.host, job_internal::AllocateEngineParams(k.session->ExpectedParams(),
                                                                   job.inputs.options.wire_dtype));
    for (DestBinding b : k.host.bindings) {
      const size_t n = NumElements(b.shape) * DTypeSize(b.dtype);
      SS_ASSIGN_OR_RETURN(auto buf, DeviceBuffer::Allocate(n, k.device));
      SS_RETURN_IF_ERROR(Memset(buf->data(), 0xA5, n));  // garbage: a missed byte shows
      b.data = buf->data();
      b.mem = MemKind::kCuda;
      b.device = k.device;
      SS_RETURN_IF_ERROR(k.session->BindDest(b));
      k.bufs.push_back(std::move(buf));
    }
  }
  return k.session->Connect();
}

void RunJob(int gpus, const std::string& hint, const std::string& want_cross,
            JobSpec job = testing::Job(testing::TinyQwen2(4), "fsdp=2", "dp=1,tp=2,pp=2", "sglang",
                                       16 << 10)) {
  auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
  ASSERT_TRUE(server.ok());
  const int world = SyncWorldSize(job.inputs);
  std::vector<DeviceRank> ranks(world);
  std::vector<Status> st(world);
  auto all = [&](const std::function<Status(int)>& fn) {
    std::vector<std::thread> ts;
    for (int r = 0; r < world; ++r) ts.emplace_back([&, r] { st[r] = fn(r); });
    for (auto& t : ts) t.join();
    for (int r = 0; r < world; ++r)
      ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
  };
  all([&](int r) { return SetUpRank(job, r, gpus, hint, (*server)->address(), ranks[r]); });
  // Routing: same-GPU pairs over cuda_ipc, the others as the hint says; pairs without a message
  // in the trainer's plan (a Megatron pp stage sends only to the engine ranks holding its layers)
  // get no transport.
  for (int t = 0; t < job.inputs.trainer.world(); ++t) {
    for (int e = job.inputs.trainer.world(); e < world; ++e) {
      bool planned = false;
      for (const Message& m : ranks[t].session->plan().sends) planned = planned || m.dst == e;
      const bool same = ranks[t].device == ranks[e].device;
      EXPECT_EQ(ranks[t].tx->PeerTransport(e), !planned ? "none"
                                               : same   ? "cuda_ipc"
                                                        : want_cross)
          << "trainer " << t << " -> engine rank " << e;
    }
  }
  for (uint64_t v = 1; v <= 3; ++v) {
    all([&](int r) { return ranks[r].session->Sync(v).status(); });
  }
  int64_t checked = 0;
  for (int r = job.inputs.trainer.world(); r < world; ++r) {
    DeviceRank& k = ranks[r];
    for (size_t i = 0; i < k.bufs.size(); ++i) {
      const DestBinding& b = k.host.bindings[i];
      ASSERT_TRUE(CopyToHost(b.data, k.bufs[i]->data(), k.bufs[i]->bytes()).ok());
    }
    RankResult rr;
    job_internal::VerifyEngineParams(job, k.session->ExpectedParams(), k.host.bindings, rr);
    EXPECT_EQ(rr.element_mismatches, 0) << "rank " << r << " first: " << rr.first_mismatch;
    EXPECT_FALSE(k.session->IsPoisoned());
    checked += rr.elements_checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(GpuSession, OneGpuEveryPairPreparedOverCudaIpc) {
  SS_REQUIRE_GPU();
  RunJob(1, "", "cuda_ipc");
}

TEST(GpuSession, TwoGpusCrossPairsOverNcclSameGpuPairsOverCudaIpc) {
  SS_REQUIRE_GPUS(2);
  RunJob(2, "nccl", "nccl");
}

TEST(GpuSession, TwoGpusAutoPicksCudaIpcOnOneNode) {
  SS_REQUIRE_GPUS(2);
  RunJob(2, "", "cuda_ipc");
}

JobSpec MegatronJob(const std::string& trainer, DType trainer_dtype) {
  JobSpec job = testing::Job(testing::TinyQwen2(4), trainer, "dp=1,tp=2,pp=2", "sglang", 16 << 10);
  job.inputs.trainer_dtype = trainer_dtype;
  return job;
}

// Megatron trainers: local parameters in device memory (padded vocab rows garbage), the CUDA
// packer reading the plan's local regions, cast (f32) or not (bf16).
TEST(GpuSession, MegatronOneGpuOverCudaIpc) {
  SS_REQUIRE_GPU();
  RunJob(1, "", "cuda_ipc", MegatronJob("megatron=tp=2,pp=2", DType::kF32));
  RunJob(1, "", "cuda_ipc", MegatronJob("megatron=tp=2,pp=2,vpp=2", DType::kBF16));
}

// Shared launches (SHARDSYNC_GPU_SHARED_LAUNCH, gpu_launch_board.h): the GPU's launcher (its
// trainer of lowest rank) packs for the other trainers of the GPU, in one kernel (1) or one kernel
// per trainer from its stream (2); every engine element still lands, each trainer's receivers
// get their sums, and the launcher did pack for others (claims made). Threads of one process
// here: the same board, claims and sums as separate processes, with pointers used as they are.
struct SharedLaunchOn {
  explicit SharedLaunchOn(const char* mode) { setenv("SHARDSYNC_GPU_SHARED_LAUNCH", mode, 1); }
  ~SharedLaunchOn() { unsetenv("SHARDSYNC_GPU_SHARED_LAUNCH"); }
};

TEST(GpuSession, SharedLaunchesOneGpuOverCudaIpc) {
  SS_REQUIRE_GPU();
  for (const char* mode : {"1", "2", "0"}) {  // 1 is the default; 0 each sender in turn
    SharedLaunchOn on(mode);
    const uint64_t before = internal::GpuLaunchBoard::ClaimsMade();
    RunJob(1, "", "cuda_ipc", MegatronJob("megatron=tp=2,pp=2", DType::kBF16));
    RunJob(1, "", "cuda_ipc", MegatronJob("megatron=tp=2,pp=2,vpp=2", DType::kF32));
    RunJob(1, "", "cuda_ipc");  // fsdp=2
    if (std::string_view(mode) == "0") {
      EXPECT_EQ(internal::GpuLaunchBoard::ClaimsMade(), before) << "mode 0 packs for no one";
    } else {
      EXPECT_GT(internal::GpuLaunchBoard::ClaimsMade(), before) << "mode " << mode;
    }
  }
}

TEST(GpuSession, MegatronTwoGpusOverNccl) {
  SS_REQUIRE_GPUS(2);
  RunJob(2, "nccl", "nccl", MegatronJob("megatron=tp=2,pp=2,vpp=2", DType::kBF16));
}

// A Qwen3 with block-FP8 engine weights: at fsdp=2 and intermediate 512 the FSDP chunks fall on
// the 128 grid; at fsdp=4 and 768 (192 rows per trainer rank) gate/up bands straddle trainer
// ranks and are staged to the receiver (or, with split "amax", quantized by their holders after
// the amax exchange).
JobSpec Fp8Job(const std::string& trainer, int64_t intermediate,
               const std::string& trainer_dtype = "fp32", const std::string& split = "stage") {
  JobFlags f;
  f.fp8_split = split;
  f.model = testing::WriteConfig("qwen3-fp8-" + std::to_string(intermediate),
                                 R"({
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": )" +
                                     std::to_string(intermediate) +
                                     R"(,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
  "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "torch_dtype": "bfloat16"})");
  f.quant = "fp8-block128";
  f.trainer = trainer;
  f.trainer_dtype = trainer_dtype;
  f.rollout = "dp=1,tp=2,pp=2";
  f.bucket_bytes = 256 << 10;
  f.transport = "loopback";
  return JobSpecFromFlags(f).value();
}

// The flags of a qwen3-30b-a3b FP8 job on `--device cuda` (vLLM tp2 ep2), for flag-time checks.
JobFlags MoeFlags(const std::string& trainer, const std::string& split) {
  JobFlags f;
  f.model = "qwen3-30b-a3b";
  f.quant = "fp8-block128";
  f.trainer = trainer;
  f.rollout = "dp=1,tp=2,pp=1,ep=2";
  f.engine = "vllm";
  f.device = "cuda";
  f.trainer_dtype = "bf16";
  f.fp8_split = split;
  return f;
}

// Sets up every rank of `job` on `gpus` GPUs at once (routing `hint`) and expects each to fail at
// Connect; returns how many failed Unimplemented with both `a` and `b` in the message (the
// refusal, named).
int RefusedAtConnect(const JobSpec& job, const std::string& a, const std::string& b, int gpus = 1,
                     const std::string& hint = "") {
  auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
  EXPECT_TRUE(server.ok());
  if (!server.ok()) return 0;
  const int world = SyncWorldSize(job.inputs);
  std::vector<DeviceRank> ranks(world);
  std::vector<Status> st(world);
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back(
        [&, r] { st[r] = SetUpRank(job, r, gpus, hint, (*server)->address(), ranks[r]); });
  }
  for (auto& t : ts) t.join();
  int named = 0;
  for (int r = 0; r < world; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    named += st[r].code() == StatusCode::kUnimplemented &&
             st[r].message().find(a) != std::string::npos &&
             st[r].message().find(b) != std::string::npos;
  }
  EXPECT_GT(named, 0) << "rank 0: " << st[0].ToString();
  return named;
}

// Block FP8 over cuda_ipc: the trainer's kernel quantizes straight into the engine's e4m3 and
// scale parameters; every byte and scale is then checked against the quantizer on the host.
TEST(GpuSession, OneGpuBlockFp8OverCudaIpc) {
  SS_REQUIRE_GPU();
  RunJob(1, "", "cuda_ipc", Fp8Job("fsdp=2", 512));
}

// Block-FP8 batches are never shared (they launch under the turn, as without the switch).
TEST(GpuSession, SharedLaunchesLeaveBlockFp8Alone) {
  SS_REQUIRE_GPU();
  SharedLaunchOn on("1");
  const uint64_t before = internal::GpuLaunchBoard::ClaimsMade();
  RunJob(1, "", "cuda_ipc", Fp8Job("fsdp=2", 512));
  EXPECT_EQ(internal::GpuLaunchBoard::ClaimsMade(), before);
}

// Block FP8 across GPUs over nccl (the cross-GPU pairs; same-GPU pairs stay cuda_ipc): each round
// goes as the plan's FP8 wire image, quantized by the sender into its slot and scattered by the
// receiver (cuda/nccl/fp8_rounds.h); 256 KiB buckets make several rounds per pair, so slots are
// reused. Every e4m3 byte and scale is checked against the quantizer on the host, for fp32 and
// bf16 trainers and for stacked experts (vLLM tp2 ep2, 3-d destinations).
TEST(GpuSession, TwoGpusBlockFp8OverNccl) {
  SS_REQUIRE_GPUS(2);
  for (const char* td : {"fp32", "bf16"}) {
    SCOPED_TRACE(td);
    RunJob(2, "nccl", "nccl", Fp8Job("fsdp=2", 512, td));
  }
}

// Bands straddling trainer ranks over cuda_ipc: each trainer copies its rows raw (fp32 or bf16,
// no cast) into the receiver's device staging in the same launch as its other ops, under the same
// checksums; the receiver quantizes the bands once the sync verified. RunJob's element check
// (VerifyEngineParams -> VerifyFp8Param) quantizes every piece's HF region on the host, so the
// staged bands' e4m3 bytes and scales are held to the CPU quantizer like every other block.
TEST(GpuSession, OneGpuBlockFp8StagedBandsOverCudaIpc) {
  SS_REQUIRE_GPU();
  for (const char* td : {"fp32", "bf16"}) {
    SCOPED_TRACE(td);
    JobSpec job = Fp8Job("fsdp=4", 768, td);  // gate/up: 192 rows per trainer rank
    auto sum = SummarizePlan(job.inputs);
    ASSERT_TRUE(sum.ok());
    ASSERT_GT(sum->staged_bands, 0);
    ASSERT_GT(sum->sender_quantized_elements, 0);
    RunJob(1, "", "cuda_ipc", job);
  }
  // Not refused at flag time when switched on.
  auto j = JobSpecFromFlags(MoeFlags("fsdp=4", "stage"));
  EXPECT_TRUE(j.ok()) << j.status().ToString();
}

// A Qwen3-MoE with block-FP8 experts (vLLM tp2 ep2: stacked w13 / w2 of 3 dims): fsdp=2 cuts
// every expert on the 128 grid (senders quantize), fsdp=4 gives 192 rows of each gate / up
// per trainer rank (staged bands).
JobSpec Fp8MoeJob(const std::string& trainer, int64_t hidden, const std::string& split = "stage") {
  JobFlags f;
  f.fp8_split = split;
  f.model = testing::WriteConfig("qwen3moe-fp8-" + std::to_string(hidden), R"({
  "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": )" + std::to_string(hidden) +
                                                                               R"(,
  "intermediate_size": 1024, "moe_intermediate_size": 768, "num_experts": 8,
  "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 1,
  "mlp_only_layers": [], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
  "num_hidden_layers": 2, "vocab_size": 300, "max_position_embeddings": 512,
  "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"})");
  f.quant = "fp8-block128";
  f.trainer = trainer;
  f.trainer_dtype = "bf16";
  f.rollout = "dp=1,tp=2,pp=1,ep=2";
  f.engine = "vllm";
  f.bucket_bytes = 1 << 20;
  f.transport = "loopback";
  return JobSpecFromFlags(f).value();
}

TEST(GpuSession, TwoGpusBlockFp8ExpertsOverNccl) {
  SS_REQUIRE_GPUS(2);
  RunJob(2, "nccl", "nccl", Fp8MoeJob("fsdp=2", 256));  // on the 128 grid: senders quantize
}

// Staged bands are written into the receiver's staging by a one-sided pair (cuda_ipc); an nccl
// pair carrying one is refused at Connect on both ends, naming the tensor and the ways out.
TEST(GpuSession, TwoGpusBlockFp8StagedBandsOverNcclAreRefused) {
  SS_REQUIRE_GPUS(2);
  EXPECT_GE(RefusedAtConnect(Fp8Job("fsdp=4", 768), "share 128-row blocks", "not this pair's nccl",
                             2, "nccl"),
            2);
}

// Measured on an H200 (docs/fp8.md): passes, as does a qwen3-30b-a3b-shaped MoE of 2 layers and
// 16 experts in `bench` (compute-sanitizer clean); 8 layers of 128 experts failed there.
TEST(GpuSession, OneGpuBlockFp8ExpertsOverCudaIpc) {
  SS_REQUIRE_GPU();
  for (int64_t hidden : {256, 2048}) {
    for (const char* trainer : {"fsdp=2", "fsdp=4"}) {
      SCOPED_TRACE(std::string(trainer) + " hidden " + std::to_string(hidden));
      RunJob(1, "", "cuda_ipc", Fp8MoeJob(trainer, hidden));
    }
  }
}

// A NaN in a staged band (rows [128, 256) of gate_proj straddle trainer ranks 0 and 1): the
// receiver's quantize pass meets it after the checksums verified and fails the sync with DataLoss
// naming the parameter; every engine rank stays poisoned until a clean sync, which then lands
// every element right.
TEST(GpuSession, BlockFp8NanInAStagedBandIsDataLossNamingTheParameter) {
  SS_REQUIRE_GPU();
  JobSpec job = Fp8Job("fsdp=4", 768);
  auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
  ASSERT_TRUE(server.ok());
  const int world = SyncWorldSize(job.inputs);
  const int trainers = job.inputs.trainer.world();
  std::vector<DeviceRank> ranks(world);
  std::vector<Status> st(world);
  auto all = [&](const std::function<Status(int)>& fn) {
    std::vector<std::thread> ts;
    for (int r = 0; r < world; ++r) ts.emplace_back([&, r] { st[r] = fn(r); });
    for (auto& t : ts) t.join();
  };
  auto expect_ok = [&] {
    for (int r = 0; r < world; ++r)
      ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
  };
  all([&](int r) { return SetUpRank(job, r, 1, "", (*server)->address(), ranks[r]); });
  expect_ok();
  if (HasFatalFailure()) return;
  all([&](int r) { return ranks[r].session->Sync(1).status(); });
  expect_ok();
  if (HasFatalFailure()) return;
  // Trainer rank 0's device copy of gate_proj (its rows [0, 192), fp32): row 150, column 7.
  auto shards = job_internal::FillTrainerShards(job, 0);
  ASSERT_TRUE(shards.ok());
  void* at = nullptr;
  for (size_t i = 0; i < shards->bindings.size(); ++i) {
    const SourceBinding& b = shards->bindings[i];
    if (b.hf_name != "model.layers.0.mlp.gate_proj.weight") continue;
    ASSERT_EQ(b.region.offset[0], 0);
    at = static_cast<float*>(ranks[0].bufs[i]->data()) + 150 * b.region.extent[1] + 7;
  }
  ASSERT_NE(at, nullptr);
  float keep = 0;
  ASSERT_TRUE(CopyToHost(&keep, at, 4).ok());
  const float nan = std::nanf("");
  ASSERT_TRUE(CopyToDevice(at, &nan, 4).ok());
  all([&](int r) { return ranks[r].session->Sync(2).status(); });
  int named = 0;
  for (int r = 0; r < world; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    if (st[r].code() == StatusCode::kDataLoss &&
        st[r].message().find("non-finite") != std::string::npos) {
      EXPECT_NE(st[r].message().find("model.layers.0.mlp.gate_up_proj.weight"), std::string::npos)
          << st[r].ToString();
      EXPECT_NE(st[r].message().find("staged"), std::string::npos) << st[r].ToString();
      ++named;
    }
    if (r >= trainers) {
      EXPECT_TRUE(ranks[r].session->IsPoisoned()) << "rank " << r;
    }
  }
  EXPECT_EQ(named, 1) << "rank 0: " << st[0].ToString();
  ASSERT_TRUE(CopyToDevice(at, &keep, 4).ok());
  all([&](int r) { return ranks[r].session->Sync(3).status(); });
  expect_ok();
  if (HasFatalFailure()) return;
  for (int r = trainers; r < world; ++r) {
    DeviceRank& k = ranks[r];
    for (size_t i = 0; i < k.bufs.size(); ++i) {
      const DestBinding& b = k.host.bindings[i];
      ASSERT_TRUE(CopyToHost(b.data, k.bufs[i]->data(), k.bufs[i]->bytes()).ok());
    }
    RankResult rr;
    job_internal::VerifyEngineParams(job, k.session->ExpectedParams(), k.host.bindings, rr);
    EXPECT_EQ(rr.element_mismatches, 0) << "rank " << r << " first: " << rr.first_mismatch;
    EXPECT_GT(rr.elements_checked, 0);
    EXPECT_FALSE(k.session->IsPoisoned());
  }
}

// `--device cuda` takes staged bands (`--fp8-split stage`; the runs above sync them): blocks
// shared by trainer ranks pass flag time with the stage split, on the grid or off it.
TEST(GpuSession, BlockFp8StagedBandsPassFlagTimeOnDevice) {
  SS_REQUIRE_GPU();
  EXPECT_TRUE(JobSpecFromFlags(MoeFlags("fsdp=4", "stage")).ok());  // experts: 192 rows per rank
  EXPECT_TRUE(JobSpecFromFlags(MoeFlags("fsdp=2", "stage")).ok());  // 384 rows: on the grid
}

// Blocks shared by trainer ranks under the amax exchange (the default split) over cuda_ipc: each
// holder's partial amaxes by the packer's kernel, exchanged through the store, the agreed scales
// uploaded before its pairs launch, and its rows quantized with them straight into the engine
// (the holder of a band's first row writes the scales). RunJob checks every e4m3 byte and scale
// against the CPU quantizer of whole blocks, for fp32 and bf16 trainers, dense gate/up and
// stacked experts (vLLM tp2 ep2). `--device cuda` takes the split at flag time; with the nccl
// hint (its cross-GPU pairs cannot carry amax ops) it is refused there.
TEST(GpuSession, OneGpuBlockFp8AmaxExchangeOverCudaIpc) {
  SS_REQUIRE_GPU();
  for (const char* td : {"fp32", "bf16"}) {
    SCOPED_TRACE(td);
    JobSpec job = Fp8Job("fsdp=4", 768, td, "amax");  // gate/up: 192 rows per trainer rank
    auto sum = SummarizePlan(job.inputs);
    ASSERT_TRUE(sum.ok());
    ASSERT_GT(sum->amax_elements, 0);
    ASSERT_EQ(sum->staged_bands, 0);
    RunJob(1, "", "cuda_ipc", job);
  }
  RunJob(1, "", "cuda_ipc", Fp8MoeJob("fsdp=4", 256, "amax"));
  auto on = JobSpecFromFlags(MoeFlags("fsdp=4", "amax"));
  EXPECT_TRUE(on.ok()) << on.status().ToString();
  JobFlags nccl = MoeFlags("fsdp=4", "amax");
  nccl.transport = "nccl";
  auto off = JobSpecFromFlags(nccl);
  ASSERT_FALSE(off.ok());
  EXPECT_EQ(off.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(off.status().message().find("not over nccl pairs"), std::string::npos);
  EXPECT_TRUE(JobSpecFromFlags(MoeFlags("fsdp=2", "amax")).ok());  // on the grid: none shared
}

// Amax ops cross only one-sided pairs (the sender writes the receiver's parameters): an nccl pair
// carrying one is refused at Connect on both ends, naming the tensor and the ways out.
TEST(GpuSession, TwoGpusBlockFp8AmaxExchangeOverNcclIsRefused) {
  SS_REQUIRE_GPUS(2);
  EXPECT_GE(RefusedAtConnect(Fp8Job("fsdp=4", 768, "fp32", "amax"), "share 128-row blocks",
                             "not over nccl pairs", 2, "nccl"),
            2);
}

// A NaN in rows shared by trainer ranks 0 and 1 (gate_proj rows [128, 256); rank 0's row 150)
// under the amax exchange over cuda_ipc: both holders fail with DataLoss naming the HF tensor
// (the one holding it at once, the other when it combines the partials), no pair of theirs
// launches, and every engine rank is poisoned. (The sync aborts with the engines' receives
// posted, which cancels them for good, as any aborted device sync does: the job re-connects, as
// after a killed rank; docs/fp8.md.)
TEST(GpuSession, BlockFp8NanInSharedRowsFailsEveryHolderNamingTheTensor) {
  SS_REQUIRE_GPU();
  JobSpec job = Fp8Job("fsdp=4", 768, "fp32", "amax");
  auto server = StoreServer::Start("127.0.0.1", 0, "test-token-0123456789");
  ASSERT_TRUE(server.ok());
  const int world = SyncWorldSize(job.inputs);
  const int trainers = job.inputs.trainer.world();
  std::vector<DeviceRank> ranks(world);
  std::vector<Status> st(world);
  auto all = [&](const std::function<Status(int)>& fn) {
    std::vector<std::thread> ts;
    for (int r = 0; r < world; ++r) ts.emplace_back([&, r] { st[r] = fn(r); });
    for (auto& t : ts) t.join();
  };
  auto expect_ok = [&] {
    for (int r = 0; r < world; ++r)
      ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
  };
  all([&](int r) { return SetUpRank(job, r, 1, "", (*server)->address(), ranks[r]); });
  expect_ok();
  if (HasFatalFailure()) return;
  all([&](int r) { return ranks[r].session->Sync(1).status(); });
  expect_ok();
  if (HasFatalFailure()) return;
  auto shards = job_internal::FillTrainerShards(job, 0);
  ASSERT_TRUE(shards.ok());
  void* at = nullptr;
  for (size_t i = 0; i < shards->bindings.size(); ++i) {
    const SourceBinding& b = shards->bindings[i];
    if (b.hf_name != "model.layers.0.mlp.gate_proj.weight") continue;
    ASSERT_EQ(b.region.offset[0], 0);
    at = static_cast<float*>(ranks[0].bufs[i]->data()) + 150 * b.region.extent[1] + 7;
  }
  ASSERT_NE(at, nullptr);
  float keep = 0;
  ASSERT_TRUE(CopyToHost(&keep, at, 4).ok());
  const float nan = std::nanf("");
  ASSERT_TRUE(CopyToDevice(at, &nan, 4).ok());
  all([&](int r) { return ranks[r].session->Sync(2).status(); });
  std::vector<int> named;
  for (int r = 0; r < world; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    if (st[r].code() == StatusCode::kDataLoss &&
        st[r].message().find("non-finite") != std::string::npos) {
      EXPECT_NE(st[r].message().find("'model.layers.0.mlp.gate_proj.weight'"), std::string::npos)
          << st[r].ToString();
      named.push_back(r);
    }
    if (r >= trainers) {
      EXPECT_TRUE(ranks[r].session->IsPoisoned()) << "rank " << r;
    }
  }
  EXPECT_EQ(named, (std::vector<int>{0, 1})) << "rank 0: " << st[0].ToString();
  (void)keep;
}

}  // namespace
}  // namespace shardsync::gpu
