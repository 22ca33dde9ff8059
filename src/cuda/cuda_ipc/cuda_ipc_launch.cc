// cuda_ipc send pairs launched together (cuda_ipc.h): a trainer's posted send pairs go out as
// ONE kernel over all their buckets once every one's receiver is ready, which spares the GPU each
// launch's ramp-up and tail (measured on an H200, docs/benchmarks.md). Sender processes sharing a
// GPU launch one at a time, each while it holds the GPU's turn (gpu_turnstile.h); with shared
// launches (SHARDSYNC_GPU_SHARED_LAUNCH, gpu_launch_board.h, cuda_ipc_share.cc) the GPU's
// launcher packs for the others that are ready in its own launch.
#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "cuda/cuda_ipc/cuda_ipc.h"

namespace shardsync::gpu::ipc {

using internal::GpuLaunchBoard;

void AppendRenumbered(const std::vector<CopyRun>& from, int32_t base, std::vector<CopyRun>* to) {
  for (CopyRun r : from) {
    r.bucket += base;
    to->push_back(r);
  }
}

std::optional<BatchSpec> MergeSpecs(const std::vector<IpcSendPair*>& members, void* lsum) {
  const BatchSpec& first = members[0]->spec();
  BatchSpec m;
  m.mode = first.mode;
  m.in_dtype = first.in_dtype;
  m.out_dtype = first.out_dtype;
  bool image = false, staged = false;
  for (const IpcSendPair* p : members) {
    const BatchSpec& s = p->spec();
    if (s.mode != m.mode || s.in_dtype != m.in_dtype || s.out_dtype != m.out_dtype) {
      return std::nullopt;
    }
    const auto base = static_cast<int32_t>(m.bucket_bytes.size());
    AppendRenumbered(s.runs, base, &m.runs);
    AppendRenumbered(s.landed_runs, base, &m.landed_runs);
    for (EncodedTask q : s.encoded) {
      q.bucket += base;
      m.encoded.push_back(q);
    }
    // Block-FP8 pairs' copies tile a compact image of each bucket; a plain pair's tile it all.
    const auto& copies = s.copy_bytes.empty() ? s.bucket_bytes : s.copy_bytes;
    m.copy_bytes.insert(m.copy_bytes.end(), copies.begin(), copies.end());
    image = image || !s.copy_bytes.empty();
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
  if (!image) m.copy_bytes.clear();
  if (!staged) m.stage_bytes.clear();
  for (size_t b = 0; lsum && b < m.bucket_bytes.size(); ++b) {
    m.landed_sums.push_back(static_cast<unsigned char*>(lsum) + 8 * b);
  }
  return m;
}

Status MergedLaunch::Sums(std::vector<uint64_t>* packed, std::vector<uint64_t>* landed,
                          std::vector<int64_t>* nonfinite) const {
  packed->clear();
  landed->clear();
  nonfinite->clear();
  auto add = [&](const CopyBatch& b) -> Status {
    SS_ASSIGN_OR_RETURN(std::vector<uint64_t> p, b.Checksums());
    SS_ASSIGN_OR_RETURN(std::vector<uint64_t> l, b.LandedSums());
    std::vector<int64_t> n = b.NonFinite();
    if (!n.empty() || !nonfinite->empty()) {
      nonfinite->resize(packed->size(), 0);
      n.resize(p.size(), 0);
      nonfinite->insert(nonfinite->end(), n.begin(), n.end());
    }
    packed->insert(packed->end(), p.begin(), p.end());
    landed->insert(landed->end(), l.begin(), l.end());
    return OkStatus();
  };
  for (const auto& [b, first] : before) SS_RETURN_IF_ERROR(add(*b));
  return add(*batch);
}

Status CudaIpcTransport::SendPosted() {
  for (const IpcSendPair* p : sends_) {
    if (!p->posted()) return OkStatus();  // the rest follow (or the first Poll launches)
  }
  return LaunchPostedSends();
}

Status CudaIpcTransport::FinishLaunch(const MergedLaunch* group, IpcSendPair* self) {
  std::vector<uint64_t> packed, landed;
  std::vector<int64_t> nonfinite;
  Status sums = group->Sums(&packed, &landed, &nonfinite);
  // The senders packed for first: they wait on this alone.
  for (const MergedLaunch::Remote& r : group->remote) {
    if (!sums.ok() || r.first + r.peer.buckets > packed.size()) {
      board_->Fail(r.peer, group->version);
      continue;
    }
    board_->Complete(r.peer, group->version, packed.data() + r.first, landed.data() + r.first);
  }
  if (inflight_shared_ == group) inflight_shared_ = nullptr;
  TraceEnd(*group);
  SS_RETURN_IF_ERROR(sums);
  Status mine;
  for (IpcSendPair* p : sends_) {
    if (p->group() != group) continue;
    Status s = p->Finished(packed, landed, nonfinite);
    if (p == self) mine = s;
  }
  return mine;
}

// Shared launches (gpu_launch_board.h): the GPU's launcher (the sender of lowest sync rank)
// takes the turn once its own receivers are in, waits up to kGatherWait for the other senders to
// be ready (their receivers in too), claims them and launches for all; every other sender posts
// its version and waits to be claimed, launching for itself only when the launcher went without
// it, is gone, or did not claim it within kClaimWait.
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
    SS_ASSIGN_OR_RETURN(bool go, ShareStep(members, v));
    if (!go) return OkStatus();
  }
  if (!MayLaunch()) return OkStatus();
  std::vector<GpuLaunchBoard::Peer> peers;
  if (shared && leader_ == board_->slot()) {  // only the GPU's launcher packs for others
    int pending = 0;
    board_->Survey(v, &peers, &pending);
    const auto now = std::chrono::steady_clock::now();
    if (gather_version_ != v) {
      gather_version_ = v;
      gather_start_ = now;
    }
    if (pending > 0 && now - gather_start_ < kGatherWait) return OkStatus();  // keeps the turn
    if (pending > 0) {
      trace::Line(
          "cuda_ipc: launching without %d sender(s) of this GPU not ready after %lld us", pending,
          static_cast<long long>(
              std::chrono::duration_cast<std::chrono::microseconds>(now - gather_start_).count()));
    }
  }
  // A launch that failed before any kernel went out gives the turn back at once.
  Status s = LaunchMembers(members, peers, v);
  if (!s.ok() && launches_ == 0) DropTurn();
  return s;
}

Result<bool> CudaIpcTransport::ShareStep(const std::vector<IpcSendPair*>& members,
                                         uint64_t version) {
  const auto now = std::chrono::steady_clock::now();
  if (share_version_ != version) {
    share_version_ = version;
    share_start_ = now;
    next_leader_check_ = now + kWaitCheckEvery;
    claim_taken_ = false;
    leader_ = board_->Leader();
  }
  if (board_->ClaimedFor(version)) {
    SS_RETURN_IF_ERROR(AdoptRemote(members, version));
    return false;
  }
  if (claim_taken_) {  // a launcher took the post; its name follows within microseconds
    if (now - share_start_ > internal::GpuTurnstile::kMaxWait) {
      return UnavailableError("cuda_ipc: sync rank " + std::to_string(rank_) +
                              ": a launcher claimed this rank's pack for version " +
                              std::to_string(version) + " but never said who it is");
    }
    return false;
  }
  if (now >= next_leader_check_) {  // the launcher may have exited (a syscall per live slot)
    next_leader_check_ = now + kWaitCheckEvery;
    leader_ = board_->Leader();
  }
  const bool leader = leader_ == board_->slot();
  if (!leader && posted_ready_ != version) {
    board_->PostReady(version);
    posted_ready_ = version;
    return false;  // claimed from here on, or launched alone below on a later poll
  }
  if (!leader) {
    const bool went = leader_ < 0 || board_->LaunchedFor(leader_, version);
    const bool late = now - share_start_ >= kClaimWait;
    if (!went && !late) return false;
    if (posted_ready_ == version) {
      trace::Line("cuda_ipc: sync rank %d launches for itself (the GPU's launcher %s)", rank_,
                  went ? "went without it" : "did not claim it in time");
    }
  }
  return WithdrawPost(version);
}

// A group this launcher could not prepare: it packs for no one from here on (its slot is marked
// unshareable, so the next sender of lowest rank becomes the GPU's launcher).
void CudaIpcTransport::StopSharing(const Status& why) {
  trace::Line("cuda_ipc: sync rank %d stops packing for other senders: %s", rank_,
              why.ToString().c_str());
  share_ = Share::kNo;
  if (board_) board_->MarkUnshareable();
}

bool CudaIpcTransport::WithdrawPost(uint64_t version) {
  if (posted_ready_ != version) return true;
  posted_ready_ = 0;
  if (board_->Withdraw(version)) return true;
  claim_taken_ = true;  // claimed first: wait for that launch (ShareStep adopts it)
  return false;
}

Status CudaIpcTransport::LaunchMembers(const std::vector<IpcSendPair*>& members,
                                       const std::vector<GpuLaunchBoard::Peer>& peers,
                                       uint64_t version) {
  SS_CUDA(cudaSetDevice(device_), "cuda_ipc: cudaSetDevice");
  const bool sharing = board_ && share_ == Share::kYes;  // before a StopSharing below
  // The peers this launch packs for: their batches decode here, and the group over them is
  // prepared BEFORE any is claimed, so a group that cannot be prepared (memory, a malformed
  // batch) fails none of them: this rank stops sharing and they launch for themselves.
  std::vector<GpuLaunchBoard::Peer> ready;
  for (const auto& p : peers) {
    if (PeerBatch(p, members[0]->spec()).ok()) ready.push_back(p);  // decoded once per batch
  }
  if (!ready.empty()) {
    auto pre = SharedGroup(members, ready);  // cached: prepared once per set of peers
    if (!pre.ok()) {
      StopSharing(pre.status());
      ready.clear();
    }
  }
  std::vector<GpuLaunchBoard::Peer> claimed;
  for (const auto& p : ready) {
    if (board_->Claim(p, version)) claimed.push_back(p);  // still ready: not withdrawn
  }
  // Then this rank's own slot: senders waiting on the launcher see it went (and without them).
  if (sharing) board_->ClaimOwn(version);
  if (!claimed.empty()) {
    // The prepared group unless a peer withdrew between the survey and its claim.
    auto g = SharedGroup(members, claimed);
    if (!g.ok()) {
      for (const auto& p : claimed) board_->Fail(p, version);
      StopSharing(g.status());
      return g.status();
    }
    MergedLaunch& sg = **g;
    sg.version = version;
    ++sg.seq;
    TraceStart(sg);
    Status s;
    for (auto& [b, first] : sg.before) {
      if (s.ok()) s = b->LaunchSignaled(stream_, sg.seq);
    }
    if (s.ok()) s = sg.batch->LaunchSignaled(stream_, sg.seq);
    if (s.ok()) {
      s = internal::CudaStatus(cudaEventRecord(sg.done, stream_), "cuda_ipc: launch event");
    }
    if (!s.ok()) {
      FailShared(&sg);
      return s;
    }
    if (sg.t1) cudaEventRecord(sg.t1, stream_);
    LaunchStarted();
    inflight_shared_ = &sg;
    trace::Line("cuda_ipc: launched %s", sg.what.c_str());
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
      g->what = "this rank's " + std::to_string(members.size()) + " pairs, " +
                std::to_string(g->buckets) + " buckets, " + std::to_string(g->batch->num_chunks()) +
                " chunks";
    }
    it = merged_.emplace(members, std::move(g)).first;
  }
  MergedLaunch& g = *it->second;
  if (!g.batch) {  // no common kernel: one launch each
    for (IpcSendPair* p : members) SS_RETURN_IF_ERROR(p->LaunchAlone(stream_));
    return OkStatus();
  }
  TraceStart(g);
  SS_RETURN_IF_ERROR(g.batch->LaunchSignaled(stream_, ++g.seq));
  LaunchStarted();
  SS_CUDA(cudaEventRecord(g.done, stream_), "cuda_ipc: launch event");
  if (g.t1) cudaEventRecord(g.t1, stream_);
  trace::Line("cuda_ipc: launched %s", g.what.c_str());
  size_t first = 0;
  for (IpcSendPair* p : members) {
    p->LaunchedIn(&g, first);
    first += p->spec().bucket_bytes.size();
  }
  return OkStatus();
}

void CudaIpcTransport::TraceStart(MergedLaunch& g) {
  if (!trace::On()) return;
  if (!g.t0 && (cudaEventCreate(&g.t0) != cudaSuccess || cudaEventCreate(&g.t1) != cudaSuccess)) {
    cudaGetLastError();
    return;
  }
  if (cudaEventRecord(g.t0, stream_) != cudaSuccess) cudaGetLastError();
}

void CudaIpcTransport::TraceEnd(const MergedLaunch& g) {
  if (!trace::On() || !g.t0 || !g.t1) return;
  float ms = -1;
  // The kernel signaled: its event follows within microseconds (the trace only waits for it).
  if (cudaEventSynchronize(g.t1) != cudaSuccess ||
      cudaEventElapsedTime(&ms, g.t0, g.t1) != cudaSuccess) {
    cudaGetLastError();
  }
  trace::Line("cuda_ipc: launch complete: %.3f ms of GPU time for %s", ms, g.what.c_str());
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
  // A post claimed meanwhile is launched anyway: the session's abort tells its receivers.
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
  // Knobs checked when the session began (CheckKnobs); a tool that skipped that is told here.
  auto turnstile = BoolKnob("SHARDSYNC_GPU_TURNSTILE");
  if (!turnstile.ok()) ReportKnobError(turnstile.status());
  if (turnstile.ok() && !*turnstile) return;
  char bus[64] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device_) != cudaSuccess) {
    cudaGetLastError();
    trace::Line("cuda_ipc: no PCI bus id for device %d: launches unordered", device_);
    return;
  }
  // The turnstile orders the physical GPU's contexts: shared by every process on it, emulated
  // nodes (SHARDSYNC_HOST_ID) included, since they time-slice it all the same.
  auto t = internal::GpuTurnstile::Open(internal::GpuTurnstile::Name(prefix_, bus));
  if (!t.ok()) {
    trace::Line("cuda_ipc: %s: launches unordered", t.status().ToString().c_str());
    return;
  }
  turn_ = std::move(t).value();
  // Shared launches: 1 (the default) one kernel for every sender of the GPU, 2 (an experiment)
  // one kernel per sender from the launcher's stream, 0 each sender its own under the turn. On one
  // H200, qwen3-8b megatron tp2 pp2 -> tp2 pp2: 9.02 ms shared against 9.66-9.71 ms in turn
  // (docs/benchmarks.md, eleventh session).
  auto v = TextKnob("SHARDSYNC_GPU_SHARED_LAUNCH");  // 0 | 1 | 2
  if (!v.ok()) ReportKnobError(v.status());
  share_mode_ = v.ok() && *v == "0" ? 0 : v.ok() && *v == "2" ? 2 : 1;
  if (share_mode_ == 0) return;
  // Shared launches open the other senders' memory, a same-host path: scoped by the host
  // identity too, so an emulated node never packs for another's senders.
  auto b = internal::GpuLaunchBoard::Open(
      internal::GpuLaunchBoard::Name(prefix_ + "@" + HostIdentity(), bus), rank_);
  if (!b.ok()) {
    trace::Line("cuda_ipc: %s: no shared launches", b.status().ToString().c_str());
    return;
  }
  board_ = std::move(b).value();
}

}  // namespace shardsync::gpu::ipc
