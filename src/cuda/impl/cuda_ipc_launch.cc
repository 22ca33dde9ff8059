// cuda_ipc send pairs launched together (cuda_ipc.h): a trainer's posted send pairs go out as
// ONE kernel over all their buckets once every one's receiver is ready, which spares the GPU each
// launch's ramp-up and tail (measured on an H200, docs/benchmarks.md). The senders of one GPU
// take turns (gpu_turnstile.h), and the one holding the turn packs for the others that are ready
// (gpu_launch_board.h, cuda_ipc_share.cc).
#include <cstdlib>
#include <optional>
#include <string_view>

#include "cuda/impl/cuda_ipc.h"

namespace shardsync::gpu::ipc {

Status CudaIpcTransport::SendPosted() {
  for (const IpcSendPair* p : sends_) {
    if (!p->posted()) return OkStatus();  // the rest follow (or the first Poll launches)
  }
  return LaunchPostedSends();
}

Status CudaIpcTransport::FinishLaunch(const MergedLaunch* group, IpcSendPair* self) {
  SS_ASSIGN_OR_RETURN(std::vector<uint64_t> packed, group->batch->Checksums());
  SS_ASSIGN_OR_RETURN(std::vector<uint64_t> landed, group->batch->LandedSums());
  // The senders packed for first: they wait on this alone.
  for (const MergedLaunch::Remote& r : group->remote) {
    if (r.first + r.peer.buckets > packed.size()) {
      board_->Fail(r.peer, group->version);
      continue;
    }
    board_->Complete(r.peer, group->version, packed.data() + r.first, landed.data() + r.first);
  }
  if (inflight_shared_ == group) inflight_shared_ = nullptr;
  Status mine;
  for (IpcSendPair* p : sends_) {
    if (p->group() != group) continue;
    Status s = p->Finished(packed, landed);
    if (p == self) mine = s;
  }
  return mine;
}

// Shared launches (gpu_launch_board.h): a rank whose receivers are all in posts its version on
// the board; if another sender claimed it meanwhile, that one packs for it. The rank holding the
// GPU's turn launches: its own pairs and every other sender ready for the same version, after
// waiting up to kGatherWait for those not ready yet (one launch spares the GPU a switch between
// processes, about 0.15 ms).
Status CudaIpcTransport::LaunchPostedSends() {
  std::vector<IpcSendPair*> members;
  bool all_ready = true;
  for (IpcSendPair* p : sends_) {
    if (!p->posted()) continue;
    members.push_back(p);
    SS_ASSIGN_OR_RETURN(bool ready, p->Ready());
    all_ready = all_ready && ready;
  }
  if (members.empty() || !all_ready) return OkStatus();
  const uint64_t v = members[0]->version();
  const bool shared = Shareable(members);
  if (shared) {
    if (board_->ClaimedFor(v)) return AdoptRemote(members, v);
    if (posted_ready_ != v) {
      board_->PostReady(v);
      posted_ready_ = v;
    }
  }
  if (!MayLaunch()) return OkStatus();
  if (shared && board_->ClaimedFor(v)) {  // claimed just before this rank took the turn
    if (launches_ == 0 && turn_) turn_->Give();
    return AdoptRemote(members, v);
  }
  std::vector<internal::GpuLaunchBoard::Peer> peers;
  if (board_ && turn_->held()) {  // only the turn's holder packs for others
    int pending = 0;
    board_->Survey(v, &peers, &pending);
    const auto now = std::chrono::steady_clock::now();
    if (gather_version_ != v) {
      gather_version_ = v;
      gather_start_ = now;
    }
    if (pending > 0 && now - gather_start_ < kGatherWait) return OkStatus();  // keeps the turn
  }
  // A launch that failed before any kernel went out gives the turn back at once.
  Status s = LaunchMembers(members, peers, v);
  if (!s.ok() && launches_ == 0) DropTurn();
  return s;
}

Status CudaIpcTransport::LaunchMembers(const std::vector<IpcSendPair*>& members,
                                       const std::vector<internal::GpuLaunchBoard::Peer>& peers,
                                       uint64_t version) {
  SS_CUDA(cudaSetDevice(device_), "cuda_ipc: cudaSetDevice");
  if (board_ && posted_ready_ == version) board_->ClaimOwn(version);  // no one packs it again
  posted_ready_ = 0;
  // The peers this launch packs for: their batches decode here, and they are still ready.
  std::vector<internal::GpuLaunchBoard::Peer> claimed;
  for (const auto& p : peers) {
    auto b = PeerBatch(p, members[0]->spec());  // decoded once per published batch
    if (!b.ok()) continue;
    if (board_->Claim(p, version)) claimed.push_back(p);
  }
  if (!claimed.empty()) {
    auto g = SharedGroup(members, claimed);
    if (!g.ok()) {
      for (const auto& p : claimed) board_->Fail(p, version);
      return g.status();
    }
    MergedLaunch& sg = **g;
    sg.version = version;
    Status s = sg.batch->LaunchSignaled(stream_, ++sg.seq);
    if (s.ok()) {
      s = internal::CudaStatus(cudaEventRecord(sg.done, stream_), "cuda_ipc: launch event");
    }
    if (!s.ok()) {
      FailShared(&sg);
      return s;
    }
    LaunchStarted();
    inflight_shared_ = &sg;
    if (trace::On()) {
      std::string ranks;
      for (const auto& p : claimed) {
        ranks += ' ';
        ranks += std::to_string(p.rank);
      }
      trace::Line("cuda_ipc: launched (%zu buckets) for this rank and sync ranks%s", sg.buckets,
                  ranks.c_str());
    }
    size_t first = 0;
    for (IpcSendPair* p : members) {
      p->LaunchedIn(&sg, first);
      first += p->buckets();
    }
    return OkStatus();
  }
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
  if (!turn_ || turn_->held()) return true;
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
  FailShared(inflight_shared_);  // the senders it packed for stop waiting
  if (board_ && posted_ready_ != 0) board_->Withdraw(posted_ready_);
  posted_ready_ = 0;
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
  if (const char* v = std::getenv("SHARDSYNC_GPU_SHARED_LAUNCH"); v && std::string_view(v) == "0") {
    return;
  }
  auto b = internal::GpuLaunchBoard::Open(internal::GpuLaunchBoard::Name(prefix_, bus), rank_);
  if (!b.ok()) {
    trace::Line("cuda_ipc: %s: no shared launches", b.status().ToString().c_str());
    return;
  }
  board_ = std::move(b).value();
}

}  // namespace shardsync::gpu::ipc
