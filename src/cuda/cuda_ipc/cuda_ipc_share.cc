// Shared launches of one GPU's senders (gpu_launch_board.h): this rank's batch published for
// the others (every pointer as the CUDA IPC handle of its allocation and an offset), a peer's
// batch decoded into this process's mappings, and the launch of this rank's pairs by a peer.
#include <cstring>

#include "cuda/cuda_ipc/cuda_ipc.h"

namespace shardsync::gpu::ipc {

using internal::CudaStatus;
using internal::GpuLaunchBoard;

namespace {

constexpr uint64_t kBatchMagic = 0x3154414248535353ull;  // "SSSHBAT1"

struct BlobHeader {
  uint64_t magic;
  uint32_t mode, in_dtype, out_dtype, handles, buckets, pad;
  uint64_t runs, landed;
};
struct BlobHandle {
  cudaIpcMemHandle_t handle;
  int32_t pid, pad;
  uint64_t base;   // in the owner's process (a same-process reader uses it as is)
  uint64_t bytes;  // of the allocation
};
struct BlobRun {
  int32_t in_h, out_h, bucket, pad;  // handle indices (-1: null pointer)
  uint64_t in_off, out_off;
  int64_t in_stride, out_stride, row_elems, rows, wire_offset;
};

// Bytes a run spans from its start: (rows - 1) strides and a row.
int64_t Extent(int64_t rows, int64_t stride, int64_t row_elems, int elem) {
  if (rows <= 0 || row_elems <= 0) return 0;
  return ((rows - 1) * stride + row_elems) * elem;
}

template <typename T>
void Put(std::string& blob, const T& v) {
  blob.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

}  // namespace

bool CudaIpcTransport::Shareable(const std::vector<IpcSendPair*>& members) {
  if (!board_ || share_ == Share::kNo) return false;
  if (share_ == Share::kYes) return members == published_;
  // First ready sync: publish this rank's batch (pairs in launch order, no landed sums).
  auto publish = [&]() -> Status {
    std::optional<BatchSpec> spec = MergeSpecs(members, nullptr);
    if (!spec) return InvalidArgumentError("the pairs' dtypes differ");
    // Image batches (encoded and stage ops: block FP8) keep to their own launches under the turn.
    if (!spec->encoded.empty() || !spec->copy_bytes.empty() || !spec->stage_runs.empty() ||
        !spec->stage_bytes.empty()) {
      return FailedPreconditionError("block-FP8 batches are not shared");
    }
    std::vector<BlobHandle> handles;
    std::map<uint64_t, int> index;  // allocation base in this process -> handle
    auto locate = [&](const void* p, int32_t* h, uint64_t* off) -> Status {
      *h = -1;
      *off = 0;
      if (!p) return OkStatus();
      const auto a = reinterpret_cast<uint64_t>(p);
      auto it = index.upper_bound(a);
      if (it != index.begin()) {
        --it;
        const BlobHandle& k = handles[it->second];
        if (a < it->first + k.bytes) {
          *h = it->second;
          *off = a - it->first;
          return OkStatus();
        }
      }
      void* base = nullptr;
      size_t bytes = 0;
      SS_RETURN_IF_ERROR(internal::AllocationRange(p, &base, &bytes));
      const auto b = reinterpret_cast<uint64_t>(base);
      BlobHandle k{};
      k.bytes = bytes;
      if (auto m = allocs_.find(b); m != allocs_.end()) {  // a peer's, mapped here
        k.handle = m->second.handle;
        k.pid = m->second.pid;
        k.base = m->second.base;
      } else {  // this process's own (the trainer's parameters)
        SS_CUDA(cudaIpcGetMemHandle(&k.handle, base), "cudaIpcGetMemHandle of a source");
        k.pid = getpid();
        k.base = b;
      }
      index[b] = static_cast<int>(handles.size());
      handles.push_back(k);
      *h = static_cast<int32_t>(handles.size() - 1);
      *off = a - b;
      return OkStatus();
    };
    std::vector<BlobRun> runs, landed;
    for (auto [list, out] :
         {std::pair{&spec->runs, &runs}, std::pair{&spec->landed_runs, &landed}}) {
      for (const CopyRun& r : *list) {
        BlobRun b{};
        SS_RETURN_IF_ERROR(locate(r.in, &b.in_h, &b.in_off));
        SS_RETURN_IF_ERROR(locate(list == &spec->runs ? r.out : nullptr, &b.out_h, &b.out_off));
        b.bucket = r.bucket;
        b.in_stride = r.in_stride;
        b.out_stride = r.out_stride;
        b.row_elems = r.row_elems;
        b.rows = r.rows;
        b.wire_offset = r.wire_offset;
        out->push_back(b);
      }
    }
    BlobHeader hd{kBatchMagic,
                  static_cast<uint32_t>(spec->mode),
                  static_cast<uint32_t>(spec->in_dtype),
                  static_cast<uint32_t>(spec->out_dtype),
                  static_cast<uint32_t>(handles.size()),
                  static_cast<uint32_t>(spec->bucket_bytes.size()),
                  0,
                  runs.size(),
                  landed.size()};
    std::string blob;
    Put(blob, hd);
    for (const BlobHandle& k : handles) Put(blob, k);
    for (const BlobRun& r : runs) Put(blob, r);
    for (const BlobRun& r : landed) Put(blob, r);
    for (int64_t b : spec->bucket_bytes) Put(blob, b);
    return board_->Publish(blob, static_cast<uint32_t>(spec->bucket_bytes.size()));
  };
  Status s = publish();
  if (!s.ok()) {
    cudaGetLastError();
    trace::Line("cuda_ipc: rank %d packs for itself (its batch cannot be shared: %s)", rank_,
                s.ToString().c_str());
    share_ = Share::kNo;
    board_->MarkUnshareable();
    return false;
  }
  share_ = Share::kYes;
  published_ = members;
  return true;
}

Result<void*> CudaIpcTransport::OpenShared(const void* handle, int pid, uint64_t base) {
  if (pid == getpid()) return reinterpret_cast<void*>(base);
  const std::string key(static_cast<const char*>(handle), sizeof(cudaIpcMemHandle_t));
  auto o = opened_.find(key);
  if (o == opened_.end()) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle, sizeof(h));
    void* p = nullptr;
    SS_CUDA(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
            "cuda_ipc: cudaIpcOpenMemHandle of an allocation of pid " + std::to_string(pid));
    o = opened_.emplace(key, p).first;
    allocs_.try_emplace(reinterpret_cast<uint64_t>(p), AllocInfo{h, pid, base, 0});
  }
  return o->second;
}

Result<const BatchSpec*> CudaIpcTransport::PeerBatch(const GpuLaunchBoard::Peer& p,
                                                     const BatchSpec& own) {
  const std::vector<uint64_t> key{static_cast<uint64_t>(p.slot), p.token, p.generation};
  if (auto it = peer_batches_.find(key); it != peer_batches_.end()) {
    if (it->second) return it->second.get();
    return FailedPreconditionError("cuda_ipc: the batch of sync rank " + std::to_string(p.rank) +
                                   " could not be used before");
  }
  // A batch that cannot be used is remembered as such (null): not tried again every sync.
  auto decoded = DecodePeerBatch(p, own);
  if (!decoded.ok()) {
    cudaGetLastError();
    trace::Line("cuda_ipc: not packing for sync rank %d: %s", p.rank,
                decoded.status().ToString().c_str());
    peer_batches_.emplace(key, nullptr);
    return decoded.status();
  }
  return peer_batches_.emplace(key, std::move(decoded).value()).first->second.get();
}

Result<std::unique_ptr<BatchSpec>> CudaIpcTransport::DecodePeerBatch(const GpuLaunchBoard::Peer& p,
                                                                     const BatchSpec& own) {
  const std::string who = "the batch of sync rank " + std::to_string(p.rank);
  const std::string blob = board_->Spec(p);
  BlobHeader hd{};
  if (blob.size() >= sizeof(hd)) std::memcpy(&hd, blob.data(), sizeof(hd));
  const size_t want = sizeof(hd) + hd.handles * sizeof(BlobHandle) +
                      (hd.runs + hd.landed) * sizeof(BlobRun) + hd.buckets * sizeof(int64_t);
  if (blob.size() < sizeof(hd) || hd.magic != kBatchMagic || hd.runs > blob.size() ||
      hd.landed > blob.size() || blob.size() != want || hd.buckets != p.buckets) {
    return DataLossError(who + " on the launch board is malformed (" + std::to_string(blob.size()) +
                         " bytes)");
  }
  if (hd.mode != static_cast<uint32_t>(own.mode) ||
      hd.in_dtype != static_cast<uint32_t>(own.in_dtype) ||
      hd.out_dtype != static_cast<uint32_t>(own.out_dtype)) {
    return InvalidArgumentError(who + " has other dtypes than this rank's");
  }
  const char* at = blob.data() + sizeof(hd);
  std::vector<unsigned char*> bases(hd.handles);
  std::vector<uint64_t> sizes(hd.handles);
  for (uint32_t i = 0; i < hd.handles; ++i, at += sizeof(BlobHandle)) {
    BlobHandle k;
    std::memcpy(&k, at, sizeof(k));
    SS_ASSIGN_OR_RETURN(void* b, OpenShared(&k.handle, k.pid, k.base));
    bases[i] = static_cast<unsigned char*>(b);
    sizes[i] = k.bytes;
  }
  const int in_size = DTypeSize(own.in_dtype), out_size = DTypeSize(own.out_dtype);
  auto batch = std::make_unique<BatchSpec>();
  batch->mode = own.mode;
  batch->in_dtype = own.in_dtype;
  batch->out_dtype = own.out_dtype;
  // Every run inside its allocation: a damaged batch must not make the kernel write elsewhere.
  auto resolve = [&](int32_t h, uint64_t off, int64_t extent, void** out) -> Status {
    if (h < 0) {
      *out = nullptr;
      return OkStatus();
    }
    if (static_cast<uint32_t>(h) >= hd.handles || extent < 0 || off > sizes[h] ||
        static_cast<uint64_t>(extent) > sizes[h] - off) {
      return DataLossError(who + ": a run lies outside its allocation");
    }
    *out = bases[h] + off;
    return OkStatus();
  };
  for (uint64_t i = 0; i < hd.runs + hd.landed; ++i, at += sizeof(BlobRun)) {
    BlobRun b;
    std::memcpy(&b, at, sizeof(b));
    const bool landed = i >= hd.runs;
    CopyRun r;
    void* in = nullptr;
    SS_RETURN_IF_ERROR(
        resolve(b.in_h, b.in_off,
                Extent(b.rows, b.in_stride, b.row_elems, landed ? out_size : in_size), &in));
    SS_RETURN_IF_ERROR(
        resolve(b.out_h, b.out_off, Extent(b.rows, b.out_stride, b.row_elems, out_size), &r.out));
    r.in = in;
    r.in_stride = b.in_stride;
    r.out_stride = b.out_stride;
    r.row_elems = b.row_elems;
    r.rows = b.rows;
    r.bucket = b.bucket;
    r.wire_offset = b.wire_offset;
    (landed ? batch->landed_runs : batch->runs).push_back(r);
  }
  batch->bucket_bytes.resize(hd.buckets);
  if (hd.buckets) std::memcpy(batch->bucket_bytes.data(), at, hd.buckets * sizeof(int64_t));
  return batch;
}

Result<MergedLaunch*> CudaIpcTransport::SharedGroup(
    const std::vector<IpcSendPair*>& members, const std::vector<GpuLaunchBoard::Peer>& peers) {
  std::vector<uint64_t> key;
  for (const IpcSendPair* p : members) key.push_back(reinterpret_cast<uint64_t>(p));
  for (const auto& p : peers) {
    key.insert(key.end(), {static_cast<uint64_t>(p.slot), p.token, p.generation});
  }
  if (auto it = shared_.find(key); it != shared_.end()) return it->second.get();
  const auto t0 = std::chrono::steady_clock::now();
  auto g = std::make_unique<MergedLaunch>();
  g->device = device_;
  std::optional<BatchSpec> own = MergeSpecs(members, nullptr);
  if (!own) return InvalidArgumentError("cuda_ipc: this rank's pairs' dtypes differ");
  // The batches in launch order (this rank's first), each with its first bucket in the launch.
  std::vector<std::pair<BatchSpec, size_t>> parts;
  size_t nb = own->bucket_bytes.size();
  parts.emplace_back(std::move(*own), 0);
  for (const auto& p : peers) {
    SS_ASSIGN_OR_RETURN(const BatchSpec* b, PeerBatch(p, parts[0].first));
    g->remote.push_back({p, nb});
    parts.emplace_back(*b, nb);
    nb += b->bucket_bytes.size();
  }
  g->buckets = nb;
  SS_ASSIGN_OR_RETURN(g->lsum, DeviceBuffer::Allocate(g->buckets * 8, device_));
  SS_CUDA(cudaMemset(g->lsum->data(), 0, g->buckets * 8), "cuda_ipc: zero landed sums");
  auto* lsum = static_cast<unsigned char*>(g->lsum->data());
  SS_CUDA(cudaEventCreateWithFlags(&g->done, cudaEventDisableTiming), "cuda_ipc: launch event");
  size_t chunks = 0;
  if (share_mode_ == 2) {  // one batch per sender, launched back to back
    for (auto& [spec, first] : parts) {
      for (size_t b = 0; b < spec.bucket_bytes.size(); ++b) {
        spec.landed_sums.push_back(lsum + 8 * (first + b));
      }
      SS_ASSIGN_OR_RETURN(auto batch, CopyBatch::Prepare(spec, device_));
      chunks += batch->num_chunks();
      g->before.emplace_back(std::move(batch), first);
    }
    g->batch = std::move(g->before.back().first);
    g->before.pop_back();
  } else {  // one batch over all: buckets renumbered after each other's
    BatchSpec& m = parts[0].first;
    for (size_t i = 1; i < parts.size(); ++i) {
      const BatchSpec& b = parts[i].first;
      const auto base = static_cast<int32_t>(parts[i].second);
      AppendRenumbered(b.runs, base, &m.runs);
      AppendRenumbered(b.landed_runs, base, &m.landed_runs);
      m.bucket_bytes.insert(m.bucket_bytes.end(), b.bucket_bytes.begin(), b.bucket_bytes.end());
    }
    for (size_t b = 0; b < g->buckets; ++b) m.landed_sums.push_back(lsum + 8 * b);
    SS_ASSIGN_OR_RETURN(g->batch, CopyBatch::Prepare(m, device_));
    chunks = g->batch->num_chunks();
  }
  std::string ranks = std::to_string(rank_);
  for (const auto& p : peers) ranks += "," + std::to_string(p.rank);
  g->what = "for sync ranks " + ranks + " (" + std::to_string(g->buckets) + " buckets, " +
            std::to_string(chunks) + " chunks, " +
            (share_mode_ == 2 ? std::to_string(parts.size()) + " kernels" : "one kernel") + ")";
  trace::Line(
      "cuda_ipc: shared launch %s prepared in %.1f ms", g->what.c_str(),
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  return shared_.emplace(key, std::move(g)).first->second.get();
}

Status CudaIpcTransport::AdoptRemote(const std::vector<IpcSendPair*>& members, uint64_t version) {
  board_->ClaimedFor(version, &remote_rank_, &remote_pid_);
  remote_version_ = version;
  posted_ready_ = 0;
  turn_waiting_ = false;
  size_t first = 0;
  for (IpcSendPair* p : members) {
    p->LaunchedIn(&remote_marker_, first);
    first += p->buckets();
  }
  trace::Line("cuda_ipc: sync rank %d (pid %d) launched this rank's pack", remote_rank_,
              remote_pid_);
  return OkStatus();
}

Result<bool> CudaIpcTransport::PollRemote(IpcSendPair* self) {
  std::vector<uint64_t> packed, landed;
  const std::string who = "cuda_ipc: the pack launched for this rank by sync rank " +
                          std::to_string(remote_rank_) + " (pid " + std::to_string(remote_pid_) +
                          ")";
  switch (board_->Collect(remote_version_, &packed, &landed)) {
    case GpuLaunchBoard::Outcome::kPending:
      return false;
    case GpuLaunchBoard::Outcome::kFailed:
      return AbortedError(who + " failed there");
    case GpuLaunchBoard::Outcome::kLauncherGone:
      return UnavailableError(who + ": that process exited");
    case GpuLaunchBoard::Outcome::kDone:
      break;
  }
  trace::Line("cuda_ipc: launch complete (by sync rank %d)", remote_rank_);
  Status mine;
  for (IpcSendPair* p : sends_) {
    if (p->group() != &remote_marker_) continue;
    Status s = p->Finished(packed, landed, {});
    if (p == self) mine = s;
  }
  SS_RETURN_IF_ERROR(mine);
  return true;
}

void CudaIpcTransport::FailShared(const MergedLaunch* group) {
  if (!board_ || !group) return;
  for (const auto& r : group->remote) board_->Fail(r.peer, group->version);
  if (inflight_shared_ == group) inflight_shared_ = nullptr;
}

}  // namespace shardsync::gpu::ipc
