// The bench's device baselines beside a device-mode sync (device_rank.h): the broadcast-all
// baseline (trainer 0 sends whole tensors in rounds through the same transport, each engine
// slices its pieces out), the staged commit's copy ceiling, and the raw ceilings: cudaMemcpy
// device-to-device of the same bytes, and NCCL send / recv of each nccl pair's bytes.
#include "job/device_rank.h"

namespace shardsync::job_internal {
namespace {

// Engine: round r's pieces out of slot r % 2 (prepared once, after the parameters are bound).
Status PrepareSlices(const std::vector<HfTensor>& inv, const std::vector<EngineParam>& params,
                     const std::vector<DestBinding>& dests,
                     const std::vector<job_internal::BcastBucket>& rounds,
                     const std::vector<int64_t>& full_offsets, unsigned char* slots,
                     int64_t slot_bytes, DType wire, int device,
                     std::vector<std::unique_ptr<gpu::CopyBatch>>* out) {
  std::map<std::string, size_t> index;
  for (size_t t = 0; t < inv.size(); ++t) index[inv[t].name] = t;
  const int ws = DTypeSize(wire);
  for (size_t r = 0; r < rounds.size(); ++r) {
    gpu::BatchSpec spec;
    spec.in_dtype = spec.out_dtype = wire;
    int64_t wire_at = 0;
    unsigned char* slot = slots + (r % 2) * slot_bytes;
    for (size_t p = 0; p < params.size(); ++p) {
      for (const Piece& pc : params[p].pieces) {
        const size_t t = index.at(pc.source);
        if (t < rounds[r].t_begin || t >= rounds[r].t_end) continue;
        gpu::AppendCoRuns(pc.src, inv[t].shape, slot + (full_offsets[t] - rounds[r].offset), ws,
                          pc.dst, params[p].shape, dests[p].data, ws, ws, 0, wire_at, &spec.runs);
        wire_at += pc.src.numel() * ws;
      }
    }
    if (wire_at == 0) {
      out->push_back(nullptr);
      continue;
    }
    spec.bucket_bytes = {wire_at};
    SS_ASSIGN_OR_RETURN(auto batch, gpu::CopyBatch::Prepare(spec, device));
    out->push_back(std::move(batch));
  }
  return OkStatus();
}

}  // namespace

Status DeviceRank::SetupBroadcast() {
  rounds_ = job_internal::BroadcastBuckets(inv_, DTypeSize(in_.options.wire_dtype),
                                           in_.options.bucket_bytes, &full_offsets_);
  for (const auto& r : rounds_) slot_bytes_ = std::max(slot_bytes_, Align(r.bytes));
  if (who_.is_trainer) return OkStatus();
  SS_ASSIGN_OR_RETURN(slots_, gpu::DeviceBuffer::Allocate(2 * slot_bytes_, device_));
  return OkStatus();
}

// Trainer 0's source of the broadcast-all rounds: the whole model in the wire dtype, as a gathered
// full_tensor() would be. When its own shards already are that image (this rank holds every
// tensor whole, in the wire dtype, at the offsets the rounds use), they are the source, read
// only: no third copy of the model on the GPU. Issue 36: qwen3-30b-a3b fsdp=1 on one H200 ran out
// of memory allocating this copy (61 GB) beside the trainer's and the engines' 122 GB.
Status DeviceRank::SetupBroadcastSource() {
  if (rank_ != 0) return OkStatus();
  bool own = in_.trainer_dtype == in_.options.wire_dtype &&
             in_.trainer.kind != TrainerSpec::Kind::kMegatron && offsets_.size() == inv_.size();
  for (size_t t = 0; own && t < inv_.size(); ++t) {
    own = offsets_[t] == full_offsets_[t] &&
          TrainerHeldRegion(in_.trainer, who_.trainer_rank, inv_[t].shape) ==
              Region::Full(inv_[t].shape);
  }
  if (own) {
    full_src_ = static_cast<const unsigned char*>(buf_->data());
    return OkStatus();
  }
  int64_t total = 0;
  for (const auto& r : rounds_) total += r.bytes;
  SS_ASSIGN_OR_RETURN(full_, gpu::DeviceBuffer::Allocate(std::max<int64_t>(total, 1), device_));
  for (size_t t = 0; t < inv_.size(); ++t) {  // the trainer's weights cast to the wire dtype
    SS_RETURN_IF_ERROR(gpu::FillSyntheticDevice(
        job_.seed, SyntheticFor(inv_[t].name, inv_[t].shape), inv_[t].shape,
        Region::Full(inv_[t].shape), in_.options.wire_dtype,
        static_cast<unsigned char*>(full_->data()) + full_offsets_[t], stream_->handle()));
  }
  full_src_ = static_cast<const unsigned char*>(full_->data());
  return SyncStream("broadcast fill");
}

// Trainer 0 sends every round to every engine rank: a put into its slot plus a control message
// where the pair's transport is one-sided (cuda_ipc), a send matched by order otherwise (nccl).
// The engine acks each round through the store once sliced, and slot r % 2 is refilled after
// the ack of round r - 2. (Acks over NCCL would open the engine -> trainer direction inside a
// group that also carries the next round: NCCL connects every peer of a group before it starts
// any of it, so neither side would move.)
Status DeviceRank::BroadcastSend() {
  const std::string rep = std::to_string(broadcast_rep_++);
  std::vector<uint64_t> ctrl(rounds_.size());
  auto ack = [&](int e, size_t r) -> Status {
    return store_
        .Get(Key("ack/" + rep + "/" + std::to_string(e) + "/" + std::to_string(r)), job_.timeout)
        .status()
        .Annotate("broadcast ack of sync rank " + std::to_string(e));
  };
  for (size_t r = 0; r < rounds_.size(); ++r) {
    ctrl[r] = r;
    const auto* src = full_src_ + rounds_[r].offset;
    std::vector<XferId> ids;
    for (int e = S_; e < world_; ++e) {
      if (r >= 2) SS_RETURN_IF_ERROR(ack(e, r - 2));
      if (tx_.PeerCaps(e).one_sided_put) {
        SS_ASSIGN_OR_RETURN(XferId put, tx_.PostPut(e, src, rounds_[r].bytes, slot_region_.at(e),
                                                    (r % 2) * slot_bytes_));
        SS_ASSIGN_OR_RETURN(XferId fl, tx_.PostFlush(e));
        SS_RETURN_IF_ERROR(WaitAllXfers(tx_, {put, fl}, job_.timeout, "broadcast put"));
        SS_ASSIGN_OR_RETURN(XferId c,
                            tx_.PostSend(e, MakeTag(true, kBenchVersionBroadcast, r), &ctrl[r], 8));
        ids.push_back(c);
      } else {
        SS_ASSIGN_OR_RETURN(XferId s, tx_.PostSend(e, MakeTag(false, kBenchVersionBroadcast, r),
                                                   src, rounds_[r].bytes));
        ids.push_back(s);
      }
    }
    SS_RETURN_IF_ERROR(WaitAllXfers(tx_, ids, job_.timeout, "broadcast sends"));
  }
  for (int e = S_; e < world_; ++e) {
    for (size_t r = rounds_.size() >= 2 ? rounds_.size() - 2 : 0; r < rounds_.size(); ++r) {
      SS_RETURN_IF_ERROR(ack(e, r));
    }
  }
  return OkStatus();
}

Status DeviceRank::BroadcastReceive() {
  if (slices_.empty()) {
    SS_RETURN_IF_ERROR(PrepareSlices(inv_, session_->ExpectedParams(), dests_, rounds_,
                                     full_offsets_, static_cast<unsigned char*>(slots_->data()),
                                     slot_bytes_, in_.options.wire_dtype, device_, &slices_));
  }
  const std::string rep = std::to_string(broadcast_rep_++);
  const bool put = tx_.PeerCaps(0).one_sided_put;
  std::vector<uint64_t> ctrl(rounds_.size());
  for (size_t r = 0; r < rounds_.size(); ++r) {
    void* slot = static_cast<unsigned char*>(slots_->data()) + (r % 2) * slot_bytes_;
    SS_ASSIGN_OR_RETURN(
        XferId id,
        put ? tx_.PostRecv(0, MakeTag(true, kBenchVersionBroadcast, r), &ctrl[r], 8)
            : tx_.PostRecv(0, MakeTag(false, kBenchVersionBroadcast, r), slot, rounds_[r].bytes));
    SS_RETURN_IF_ERROR(WaitXfer(tx_, id, job_.timeout, "broadcast round " + std::to_string(r)));
    if (slices_[r]) {
      SS_RETURN_IF_ERROR(slices_[r]->Launch(stream_->handle()));
      SS_RETURN_IF_ERROR(SyncStream("broadcast slice"));
    }
    SS_RETURN_IF_ERROR(
        store_.Set(Key("ack/" + rep + "/" + std::to_string(rank_) + "/" + std::to_string(r)), "1"));
  }
  return OkStatus();
}

// --commit staged: every rank starts the commit together (as an engine's pause would).
Status DeviceRank::TimedCommit(int i) {
  // The engines pause in place first (the step in flight ends), then commit together: the stall
  // is the commit alone, every engine rank starting it at once.
  const double c0 = decode_ ? decode_->Now() : 0;
  if (decode_) decode_->Pause();
  SS_RETURN_IF_ERROR(Barrier("commit/" + std::to_string(i)));
  auto committed = session_->Commit(version_);
  if (decode_) decode_->Resume();
  SS_ASSIGN_OR_RETURN(CommitReport c, std::move(committed));
  if (decode_ && i >= job_.bench_warmup) commit_spans_.emplace_back(c0, decode_->Now());
  if (who_.is_trainer) return OkStatus();
  if (i >= job_.bench_warmup) {
    res_.bench.stall.push_back(c.stall_seconds);
    res_.bench.commit_copy.push_back(c.copy_seconds);
  }
  res_.stall_seconds = c.stall_seconds;
  res_.transfer_seconds = res_.report.local.seconds;
  res_.keep_previous = c.keep_previous;
  res_.committed_version = c.version;
  return OkStatus();
}

// The copy a commit cannot beat: cudaMemcpy of each engine rank's parameter bytes, every engine
// rank at once.
Status DeviceRank::CommitCeiling(int total) {
  // The parameters' allocation copied onto itself, half by half: the same bytes as one
  // cudaMemcpy of it, no second buffer (the parameters are verified before and scrambled after).
  const size_t half = buf_ ? buf_->bytes() / 2 : 0;
  auto* p = buf_ ? static_cast<unsigned char*>(buf_->data()) : nullptr;
  for (int i = 0; i < total; ++i) {
    SS_RETURN_IF_ERROR(Barrier("commitraw/" + std::to_string(i)));
    const auto t0 = Clock::now();
    if (who_.is_trainer) continue;
    SS_RETURN_IF_ERROR(gpu::CopyDeviceToDevice(p + half, p, half, stream_->handle()));
    SS_RETURN_IF_ERROR(gpu::CopyDeviceToDevice(p, p + half, half, stream_->handle()));
    SS_RETURN_IF_ERROR(SyncStream("commit ceiling cudaMemcpy"));
    Record(res_.bench.commit_raw, i, t0);
  }
  return OkStatus();
}

// cudaMemcpy device-to-device of the bytes the plan lands job-wide, through one pair of buffers
// of at most 1 GiB (the rate does not depend on the size past a few MiB). The pair is the first
// 2 GiB of trainer 0's own shards when it holds that much: the last phase that reads them (the
// broadcast) is over, and nothing is allocated beside the job's memory.
Status DeviceRank::RawMemcpy() {
  const int64_t want = std::max<int64_t>(std::min<int64_t>(total_bytes_, int64_t{1} << 30), 1);
  unsigned char* a = nullptr;
  int64_t chunk = want;
  if (buf_ && static_cast<int64_t>(buf_->bytes()) >= 2 * want) {
    a = static_cast<unsigned char*>(buf_->data());
  } else {
    if (!raw_) {
      SS_ASSIGN_OR_RETURN(raw_, gpu::DeviceBuffer::Allocate(2 * want, device_));
    }
    chunk = static_cast<int64_t>(raw_->bytes() / 2);
    a = static_cast<unsigned char*>(raw_->data());
  }
  for (int64_t done = 0; done < total_bytes_; done += chunk) {
    const int64_t n = std::min(chunk, total_bytes_ - done);
    SS_RETURN_IF_ERROR(gpu::CopyDeviceToDevice(a + chunk, a, n, stream_->handle()));
  }
  return SyncStream("cudaMemcpy");
}

std::vector<int> DeviceRank::NcclPeers() const {
  std::vector<int> v;
  for (const Message& m : session_->plan().sends) {
    if (tx_.PeerTransport(m.dst) == "nccl") v.push_back(m.dst);
  }
  for (const Message& m : session_->plan().recvs) {
    if (tx_.PeerTransport(m.src) == "nccl") v.push_back(m.src);
  }
  return v;
}

// Every nccl pair's message bytes, all pairs at once, with the session's communicators.
Status DeviceRank::RawNccl() {
  const RankPlan& plan = session_->plan();
  int64_t max = 0;
  for (const auto* list : {&plan.sends, &plan.recvs}) {
    for (const Message& m : *list) max = std::max(max, m.bytes);
  }
  if (!raw_ || static_cast<int64_t>(raw_->bytes()) < max) {
    raw_.reset();
    SS_ASSIGN_OR_RETURN(raw_, gpu::DeviceBuffer::Allocate(std::max<int64_t>(max, 1), device_));
  }
  std::vector<XferId> ids;
  const uint64_t tag = MakeTag(false, kBenchVersionRaw, 0);
  for (const Message& m : plan.sends) {
    if (tx_.PeerTransport(m.dst) != "nccl") continue;
    SS_ASSIGN_OR_RETURN(XferId id, tx_.PostSend(m.dst, tag, raw_->data(), m.bytes));
    ids.push_back(id);
  }
  for (const Message& m : plan.recvs) {
    if (tx_.PeerTransport(m.src) != "nccl") continue;
    SS_ASSIGN_OR_RETURN(XferId id, tx_.PostRecv(m.src, tag, raw_->data(), m.bytes));
    ids.push_back(id);
  }
  return WaitAllXfers(tx_, ids, job_.timeout, "raw nccl");
}

}  // namespace shardsync::job_internal
