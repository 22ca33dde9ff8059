// cuda_ipc send pairs launched together (cuda_ipc.h): a trainer's posted send pairs go out as
// ONE kernel over all their buckets once every one's receiver is ready, which spares the GPU each
// launch's ramp-up and tail (measured on an H200, docs/benchmarks.md). Sender processes sharing a
// GPU launch one at a time, each while it holds the GPU's turn (gpu_turnstile.h).
#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "cuda/impl/cuda_ipc.h"

namespace shardsync::gpu::ipc {
namespace {

// The send pairs' batches as one: buckets renumbered after each other's, in member order, landed
// sums to `lsum` (8 bytes per bucket). Nullopt when they do not share one kernel (dtypes).
std::optional<BatchSpec> MergeSpecs(const std::vector<IpcSendPair*>& members, void* lsum) {
  const BatchSpec& first = members[0]->spec();
  BatchSpec m;
  m.mode = first.mode;
  m.in_dtype = first.in_dtype;
  m.out_dtype = first.out_dtype;
  bool fp8 = false, staged = false;
  for (const IpcSendPair* p : members) {
    const BatchSpec& s = p->spec();
    if (s.mode != m.mode || s.in_dtype != m.in_dtype || s.out_dtype != m.out_dtype) {
      return std::nullopt;
    }
    const auto base = static_cast<int32_t>(m.bucket_bytes.size());
    for (CopyRun r : s.runs) {
      r.bucket += base;
      m.runs.push_back(r);
    }
    for (CopyRun r : s.landed_runs) {
      r.bucket += base;
      m.landed_runs.push_back(r);
    }
    for (Fp8Task q : s.quantize) {
      q.bucket += base;
      m.quantize.push_back(q);
    }
    // Block-FP8 pairs' copies tile a compact image of each bucket; a plain pair's tile it all.
    const auto& copies = s.copy_bytes.empty() ? s.bucket_bytes : s.copy_bytes;
    m.copy_bytes.insert(m.copy_bytes.end(), copies.begin(), copies.end());
    fp8 = fp8 || !s.copy_bytes.empty();
    // Block-FP8 stage ops (raw trainer values into the receivers' staging): zero bytes for the
    // buckets of pairs without any.
    if (!s.stage_bytes.empty()) {
      if (staged && s.stage_dtype != m.stage_dtype) return std::nullopt;
      staged = true;
      m.stage_dtype = s.stage_dtype;
      for (CopyRun r : s.stage_runs) {
        r.bucket += base;
        m.stage_runs.push_back(r);
      }
      for (CopyRun r : s.stage_landed_runs) {
        r.bucket += base;
        m.stage_landed_runs.push_back(r);
      }
    }
    if (s.stage_bytes.empty()) {
      m.stage_bytes.resize(base + s.bucket_bytes.size(), 0);
    } else {
      m.stage_bytes.insert(m.stage_bytes.end(), s.stage_bytes.begin(), s.stage_bytes.end());
    }
    m.bucket_bytes.insert(m.bucket_bytes.end(), s.bucket_bytes.begin(), s.bucket_bytes.end());
  }
  if (!fp8) m.copy_bytes.clear();
  if (!staged) m.stage_bytes.clear();
  for (size_t b = 0; b < m.bucket_bytes.size(); ++b) {
    m.landed_sums.push_back(static_cast<unsigned char*>(lsum) + 8 * b);
  }
  return m;
}

}  // namespace

Status CudaIpcTransport::SendPosted() {
  for (const IpcSendPair* p : sends_) {
    if (!p->posted()) return OkStatus();  // the rest follow (or the first Poll launches)
  }
  return LaunchPostedSends();
}

Status CudaIpcTransport::FinishLaunch(const MergedLaunch* group, IpcSendPair* self) {
  SS_ASSIGN_OR_RETURN(std::vector<uint64_t> packed, group->batch->Checksums());
  SS_ASSIGN_OR_RETURN(std::vector<uint64_t> landed, group->batch->LandedSums());
  const std::vector<int64_t> nonfinite = group->batch->NonFinite();
  Status mine;
  for (IpcSendPair* p : sends_) {
    if (p->group() != group) continue;
    Status s = p->Finished(packed, landed, nonfinite);
    if (p == self) mine = s;
  }
  return mine;
}

Status CudaIpcTransport::LaunchPostedSends() {
  std::vector<IpcSendPair*> members;
  bool all_ready = true;
  for (IpcSendPair* p : sends_) {
    if (!p->posted()) continue;
    members.push_back(p);
    SS_ASSIGN_OR_RETURN(bool ready, p->Ready());
    all_ready = all_ready && ready;
  }
  if (members.empty() || !all_ready || !MayLaunch()) return OkStatus();
  // A launch that failed before any kernel went out gives the turn back at once.
  Status s = LaunchMembers(members);
  if (!s.ok() && launches_ == 0) DropTurn();
  return s;
}

Status CudaIpcTransport::LaunchMembers(const std::vector<IpcSendPair*>& members) {
  SS_CUDA(cudaSetDevice(device_), "cuda_ipc: cudaSetDevice");
  if (members.size() == 1) return members[0]->LaunchAlone(stream_);
  auto it = merged_.find(members);
  if (it == merged_.end()) {
    auto g = std::make_unique<MergedLaunch>();
    g->device = device_;
    for (const IpcSendPair* p : members) g->buckets += p->spec().bucket_bytes.size();
    SS_ASSIGN_OR_RETURN(g->lsum, DeviceBuffer::Allocate(g->buckets * 8, device_));
    SS_CUDA(cudaMemset(g->lsum->data(), 0, g->buckets * 8), "cuda_ipc: zero landed sums");
    SS_CUDA(cudaEventCreateWithFlags(&g->done, cudaEventDisableTiming), "cuda_ipc: launch event");
    if (std::optional<BatchSpec> spec = MergeSpecs(members, g->lsum->data())) {
      SS_ASSIGN_OR_RETURN(g->batch, CopyBatch::Prepare(*spec, device_));
    }
    it = merged_.emplace(members, std::move(g)).first;
  }
  MergedLaunch& g = *it->second;
  if (!g.batch) {  // no common kernel: one launch each
    for (IpcSendPair* p : members) SS_RETURN_IF_ERROR(p->LaunchAlone(stream_));
    return OkStatus();
  }
  SS_RETURN_IF_ERROR(g.batch->LaunchSignaled(stream_, ++g.seq));
  LaunchStarted();
  SS_CUDA(cudaEventRecord(g.done, stream_), "cuda_ipc: launch event");
  TraceLaunch("launched", g.buckets);
  size_t first = 0;
  for (IpcSendPair* p : members) {
    p->LaunchedIn(&g, first);
    first += p->spec().bucket_bytes.size();
  }
  return OkStatus();
}

bool CudaIpcTransport::MayLaunch() {
  if (!turn_) return true;
  const internal::GpuTurnstile::Turn t = turn_->TryTake();
  if (t == internal::GpuTurnstile::Turn::kBusy) {
    if (!turn_waiting_) {
      turn_waiting_ = true;
      turn_wait_start_ = std::chrono::steady_clock::now();
      trace::Line("cuda_ipc: the GPU's turn is held (pid %d): launch waits", turn_->HolderPid());
    }
    return false;
  }
  if (trace::On()) {
    const double us = turn_waiting_ ? std::chrono::duration<double, std::micro>(
                                          std::chrono::steady_clock::now() - turn_wait_start_)
                                          .count()
                                    : 0.0;
    trace::Line(t == internal::GpuTurnstile::Turn::kMine
                    ? "cuda_ipc: took the GPU's turn (waited %.0f us)"
                    : "cuda_ipc: the GPU's turn was held too long (%.0f us): launching without it",
                us);
  }
  turn_waiting_ = false;
  return true;
}

void CudaIpcTransport::LaunchCompleted() {
  if (launches_ > 0) --launches_;
  if (launches_ == 0 && turn_ && turn_->held()) {
    turn_->Give();
    trace::Line("cuda_ipc: gave the GPU's turn back");
  }
}

void CudaIpcTransport::DropTurn() {
  launches_ = 0;
  turn_waiting_ = false;
  if (turn_) turn_->Give();
}

std::string CudaIpcTransport::TurnNote() const {
  if (!turn_ || !turn_waiting_) return "";
  return ", waiting for the GPU's turn (held by pid " + std::to_string(turn_->HolderPid()) + ")";
}

void CudaIpcTransport::OpenTurnstile() {
  if (turn_opened_) return;
  turn_opened_ = true;
  if (const char* v = std::getenv("SHARDSYNC_GPU_TURNSTILE"); v && std::string_view(v) == "0") {
    return;
  }
  char bus[64] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device_) != cudaSuccess) {
    cudaGetLastError();
    trace::Line("cuda_ipc: no PCI bus id for device %d: launches unordered", device_);
    return;
  }
  auto t = internal::GpuTurnstile::Open(internal::GpuTurnstile::Name(prefix_, bus));
  if (!t.ok()) {
    trace::Line("cuda_ipc: %s: launches unordered", t.status().ToString().c_str());
    return;
  }
  turn_ = std::move(t).value();
}

}  // namespace shardsync::gpu::ipc
