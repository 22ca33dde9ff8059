// Internals of the job harness shared by its rank programs (rank.cc, bench.cc, device_rank.cc)
// and the tests that drive sessions with synthetic weights.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "job/launcher.h"
#include "shardsync/session.h"

namespace shardsync::job_internal {

// Reserved versions of the benchmark's baseline variants in the transfer tags
// (sync/tags.h MakeTag); sessions use versions from 1.
inline constexpr uint64_t kBenchVersionBroadcast = 0x7FF;
inline constexpr uint64_t kBenchVersionRaw = 0x7FE;

int64_t PeakRssBytes();

// bench --update-fraction: before sync i (not the first; the last restores them) the changed
// elements are their filled values times this factor, alternating per sync: a step of 1.6% or
// 3.1%, small as an optimizer's, which changes every bf16 / fp32 value it touches. Toward zero, so
// a block's FP8 amax moves only where its largest element is among the changed (the synthetic
// weights are uniform, so a step away from zero would move nearly every block's amax, and with
// it most codes, as setting the values outright did).
inline float BenchUpdateFactor(int i) { return i % 2 ? 1.0f - 1.0f / 32 : 1.0f - 1.0f / 64; }

struct TrainerShards {
  std::vector<SourceBinding> bindings;
  std::vector<std::unique_ptr<unsigned char[]>> buffers;
};
struct EngineParams {
  std::vector<DestBinding> bindings;
  std::vector<std::unique_ptr<unsigned char[]>> buffers;
};

// Broadcast-all baseline: whole HF tensors back to back (inventory order) in buckets under the
// cap; a tensor larger than the cap travels alone. The same on every rank.
struct BcastBucket {
  size_t t_begin = 0, t_end = 0;
  int64_t offset = 0;  // in the full model image
  int64_t bytes = 0;
};
std::vector<BcastBucket> BroadcastBuckets(const std::vector<HfTensor>& inv, int ws, int64_t cap,
                                          std::vector<int64_t>* tensor_offsets);

// Device mode (device_rank.cc): the GPU a sync rank runs on (trainer t on GPU t % gpus; engine
// rank (replica, pp, tp) where SGLang / vLLM place it, d*T*P + pp*T + tp, modulo the GPUs), and
// the rank program with device bindings (sync mode, or bench mode's variants).
Result<int> DeviceOfRank(const JobSpec& job, int rank);
Status RunDeviceRank(const JobSpec& job, int rank, const SyncRank& who, StoreClient& store,
                     Transport& transport, RankResult& res, const ProgressFn& progress);

// Every rank's setup (allocation, synthetic fill, bindings) before any rank connects
// (setup_barrier.cc): Begin when setup starts (an ephemeral key per rank: a rank that dies or
// calls Fail fails the others' Wait at once, naming it and its error), Wait when it is done, for
// every rank's, bounded by JobSpec::setup_timeout (--setup-timeout-s), not by --timeout-ms.
class SetupBarrier {
 public:
  SetupBarrier(const JobSpec& job, int rank, StoreClient& store)
      : job_(job), rank_(rank), store_(store) {}
  Status Begin();
  // Posts `why` where the other ranks' Wait sees it; returns it.
  Status Fail(const Status& why);
  Status Wait();
  double seconds() const { return seconds_; }  // this rank's wait for the others

 private:
  Status PeerGone(const Status& first, int world);

  const JobSpec& job_;
  const int rank_;
  StoreClient& store_;
  LaunchId launch_;
  double seconds_ = 0;
};

// The key a rank holds while it sets up; a launcher that saw the rank exit marks it dead.
std::string SetupAliveKey(const std::string& prefix, const std::string& launch, int rank);

// Bench mode of RunRank (bench.cc): sharded, broadcast-all and raw variants.
Status RunBenchRank(const JobSpec& job, int rank, const SyncRank& who, StoreClient& store,
                    Transport& transport, RankResult& res, const ProgressFn& progress);

void StoreFloats(const float* in, int64_t n, DType dtype, void* out);
float LoadFloat(const void* p, int64_t i, DType dtype);
Status CheckFloatDType(DType t, std::string_view field);
// Synthetic weights of every HF tensor region the trainer rank holds, in the trainer dtype;
// Megatron trainers: every local parameter of the rank's trainer map (bound by local name and
// chunk), its padded vocab rows left as garbage.
Result<TrainerShards> FillTrainerShards(const JobSpec& job, int trainer_rank);
// Parameters in `dtype`, filled with a garbage pattern (0xA5).
Result<EngineParams> AllocateEngineParams(const std::vector<EngineParam>& expected, DType dtype);
// Engine ranks with --dump-dir: the received parameters, in their own dtypes (e4m3 weights and
// fp32 scales for block FP8), as <dump_dir>/rank-<rank>.safetensors (refengine WriteEngineDump).
Status WriteRankDump(const JobSpec& job, int rank, const SyncRank& who,
                     const std::vector<EngineParam>& expected,
                     const std::vector<DestBinding>& bound);
// Element-by-element comparison with the synthetic HF values; adds to out's counters. Parameters
// an encoding writes (block FP8's e4m3 weights and their scales) are compared by its check
// (EncodedCheckOf).
void VerifyEngineParams(const JobSpec& job, const std::vector<EngineParam>& params,
                        const std::vector<DestBinding>& bound, RankResult& out);

// The harness's side of an encoding (plan.h Encoding): the engine parameters its ops write in a
// dtype of their own, and what a correct sync lands there, checked on the host and on the GPU.
// Every other parameter is a copy, bound in the wire dtype and compared value by value.
class EncodedParamCheck {
 public:
  virtual ~EncodedParamCheck() = default;
  // Whether `p` is written by the encoding (so bound in BoundDType and checked here).
  virtual bool Owns(const EngineParam& p) const = 0;
  virtual DType BoundDType(const EngineParam& p, DType wire) const = 0;
  // Host memory: the owned params[i] (with any companion the check reads beside it).
  virtual void VerifyHost(const JobSpec& job, const std::vector<EngineParam>& params, size_t i,
                          const std::vector<DestBinding>& bound, RankResult& out) const = 0;
  // Device memory: every owned parameter of an engine rank (`dests`); adds to out.
  virtual Status VerifyDevice(const JobSpec& job, const std::vector<EngineParam>& params,
                              const std::vector<DestBinding>& dests, int device, void* stream,
                              RankResult& out) const = 0;
};
// Block-quantized engine weights' check (block FP8: fp8_verify.cc, fp8_device_verify.cc).
const EncodedParamCheck& BlockQuantCheck();
// Every encoding's check the harness knows.
const std::vector<const EncodedParamCheck*>& EncodedChecks();
// The check owning `p`, or null for a copied parameter.
const EncodedParamCheck* EncodedCheckOf(const EngineParam& p);
// The dtype an engine rank binds `p` in: its encoding's, or the wire dtype.
DType BoundDType(const EngineParam& p, DType wire);
// One hash of every bound parameter's bytes in order (host memory; hex): the staged fault runs
// compare the live parameters before and after a failed sync.
std::string LiveHash(const std::vector<DestBinding>& bound);
// The environment of the local launcher's `shardsync run` children: the parent's less its launch
// contract, plus the job's (store, world, token, the launch's SHARDSYNC_JOB_ID and
// SHARDSYNC_JOB_SECRET) and, every rank being on this host, SHARDSYNC_UCX_NET_DEVICES=loopback
// unless the user named UCX's devices.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& parent,
                                          const std::string& store, int world,
                                          const std::string& token, const std::string& job_id,
                                          const std::string& job_secret = "");
// --emulate-nodes: sync rank `rank`'s process is node "<host>/node<rank>", as shardsync routes
// (SHARDSYNC_HOST_ID) and as NCCL places it (NCCL_HOSTID, the same string), replacing any the
// parent set: its GPU pairs cross NCCL's network transport as between machines.
void EmulateNode(std::vector<std::string>& env, const std::string& host, int rank);
// The host memory sync rank `rank` allocates (trainer shards or engine parameters, host memory),
// checked against HostMemoryBudget before anything is: InvalidArgument naming --model otherwise.
Status CheckRankFitsHost(const JobSpec& job, int rank);

}  // namespace shardsync::job_internal
