#include <algorithm>
#include <cstring>

#include "common/cast.h"
#include "job/bench.h"
#include "shardsync/shard_map.h"
#include "shardsync/synthetic.h"
#include "sync/tags.h"

namespace shardsync::job_internal {
namespace {

// Copies region `sr` of a row-major tensor (shape ss) into region `dr` of another (shape ds),
// element i of one to element i of the other, row-major.
void CopyRegion(const unsigned char* src, const Shape& ss, const Region& sr, unsigned char* dst,
                const Shape& ds, const Region& dr, int es) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  ForEachRun(sr, ss, [&](int64_t off, int64_t len) { runs.emplace_back(off, len); });
  size_t k = 0;
  int64_t pos = 0;
  ForEachRun(dr, ds, [&](int64_t off, int64_t len) {
    for (int64_t done = 0; done < len;) {
      const int64_t n = std::min(len - done, runs[k].second - pos);
      std::memcpy(dst + (off + done) * es, src + (runs[k].first + pos) * es, n * es);
      done += n;
      pos += n;
      if (pos == runs[k].second) {
        ++k;
        pos = 0;
      }
    }
  });
}

}  // namespace

Status WaitXfers(Transport& tx, std::vector<XferId>& ids, Millis timeout, const std::string& what) {
  Status s = WaitAllXfers(tx, ids, timeout, what);
  ids.clear();
  return s;
}

Status FlushPeers(Transport& tx, const std::vector<int>& peers, Millis timeout) {
  std::vector<XferId> ids;
  for (int p : peers) {
    SS_ASSIGN_OR_RETURN(XferId id, tx.PostFlush(p));
    ids.push_back(id);
  }
  return WaitXfers(tx, ids, timeout, "flushing peers");
}

BroadcastBaseline::BroadcastBaseline(const JobSpec& job, Transport& tx)
    : job_(job),
      in_(job.inputs),
      tx_(tx),
      S_(in_.trainer.world()),
      world_(SyncWorldSize(in_)),
      ws_(DTypeSize(in_.options.wire_dtype)),
      inv_(HfTensorInventory(in_.model)) {
  buckets_ = BroadcastBuckets(inv_, ws_, in_.options.bucket_bytes, &tensor_offsets_);
  for (const BcastBucket& b : buckets_) max_bucket_ = std::max(max_bucket_, b.bytes);
}

void BroadcastBaseline::SetupSender() {
  const DType td = in_.trainer_dtype;
  const int ts = DTypeSize(td);
  int64_t total = 0;
  for (const HfTensor& t : inv_) total += t.numel() * ts;
  full_.resize(total);
  std::vector<float> tmp;
  int64_t at = 0;
  for (size_t t = 0; t < inv_.size(); ++t) {
    const int64_t n = inv_[t].numel();
    tmp.resize(n);
    FillSyntheticRegion(job_.seed, inv_[t].name, inv_[t].shape, Region::Full(inv_[t].shape),
                        tmp.data());
    StoreFloats(tmp.data(), n, td, full_.data() + at);
    at += n * ts;
  }
  stage_.assign(std::max<int64_t>(2 * max_bucket_, 1), 0);
}

void BroadcastBaseline::SetupReceiver(const std::vector<EngineParam>& params) {
  stage_.assign(std::max<int64_t>(2 * max_bucket_, 1), 0);
  std::map<std::string, size_t> index;
  for (size_t t = 0; t < inv_.size(); ++t) index[inv_[t].name] = t;
  slices_.resize(inv_.size());
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t k = 0; k < params[p].pieces.size(); ++k) {
      slices_[index.at(params[p].pieces[k].source)].emplace_back(p, k);
    }
  }
}

Status BroadcastBaseline::Send() {
  const int E = world_ - S_;
  const DType td = in_.trainer_dtype;
  const int ts = DTypeSize(td);
  std::vector<std::vector<XferId>> sends(buckets_.size());
  std::vector<std::vector<XferId>> acks(buckets_.size());
  std::vector<char> ack_bufs(buckets_.size() * E);
  std::vector<BenchControl> controls(buckets_.size());
  for (size_t k = 0; k < buckets_.size(); ++k) {
    if (k >= 2) {
      // Slot k % 2 is free once bucket k-2 left it and every receiver sliced it.
      SS_RETURN_IF_ERROR(Wait(sends[k - 2], "broadcast bucket " + std::to_string(k - 2)));
      SS_RETURN_IF_ERROR(Wait(acks[k - 2], "broadcast acks of bucket " + std::to_string(k - 2)));
    }
    const BcastBucket& b = buckets_[k];
    // Cast the bucket's full tensors to the wire dtype, as the trainer does before broadcasting.
    unsigned char* slot = stage_.data() + (k % 2) * max_bucket_;
    const int64_t elems = b.bytes / ws_;
    CastInto(full_.data() + (b.offset / ws_) * ts, td, slot, in_.options.wire_dtype, elems);
    const uint64_t remote = (k % 2) * max_bucket_;
    for (int e = 0; e < E; ++e) {
      const int dst = S_ + e;
      SS_ASSIGN_OR_RETURN(XferId a, tx_.PostRecv(dst, MakeTag(true, kBenchVersionBroadcast, k),
                                                 &ack_bufs[k * E + e], 1));
      acks[k].push_back(a);
      if (put()) {
        // Put, flush, then announce (the receiver slices only bytes that landed).
        std::vector<XferId> landed;
        SS_ASSIGN_OR_RETURN(XferId id,
                            tx_.PostPut(dst, slot, b.bytes, stage_region_.at(dst), remote));
        landed.push_back(id);
        SS_ASSIGN_OR_RETURN(XferId fl, tx_.PostFlush(dst));
        landed.push_back(fl);
        SS_RETURN_IF_ERROR(Wait(landed, "broadcast to sync rank " + std::to_string(dst)));
        SS_ASSIGN_OR_RETURN(XferId c, tx_.PostSend(dst, MakeTag(true, kBenchVersionBroadcast, k),
                                                   &controls[k], sizeof(BenchControl)));
        sends[k].push_back(c);
      } else {
        SS_ASSIGN_OR_RETURN(
            XferId id, tx_.PostSend(dst, MakeTag(false, kBenchVersionBroadcast, k), slot, b.bytes));
        sends[k].push_back(id);
      }
    }
  }
  for (size_t k = 0; k < buckets_.size(); ++k) {
    SS_RETURN_IF_ERROR(Wait(sends[k], "broadcast sends"));
    SS_RETURN_IF_ERROR(Wait(acks[k], "broadcast acks"));
  }
  std::vector<int> engines;
  for (int r = S_; r < world_; ++r) engines.push_back(r);
  return FlushPeers(tx_, engines, job_.timeout);
}

Status BroadcastBaseline::Receive(const std::vector<EngineParam>& params,
                                  const std::vector<DestBinding>& bound) {
  auto post = [&](size_t k) -> Result<XferId> {
    unsigned char* slot = stage_.data() + (k % 2) * max_bucket_;
    if (put()) {
      return tx_.PostRecv(0, MakeTag(true, kBenchVersionBroadcast, k), &control_,
                          sizeof(BenchControl));
    }
    return tx_.PostRecv(0, MakeTag(false, kBenchVersionBroadcast, k), slot, buckets_[k].bytes);
  };
  std::vector<XferId> acks;
  // Put mode: one control buffer, so one bucket announced at a time (the sender's acks keep
  // at most two buckets in flight anyway).
  const size_t ahead = put() ? 1 : 2;
  std::vector<XferId> posted;
  for (size_t k = 0; k < std::min(ahead, buckets_.size()); ++k) {
    SS_ASSIGN_OR_RETURN(XferId id, post(k));
    posted.push_back(id);
  }
  char ack = 1;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    std::vector<XferId> one{posted[k]};
    SS_RETURN_IF_ERROR(Wait(one, "broadcast bucket " + std::to_string(k) + " from sync rank 0"));
    const BcastBucket& b = buckets_[k];
    const unsigned char* slot = stage_.data() + (k % 2) * max_bucket_;
    for (size_t t = b.t_begin; t < b.t_end; ++t) {
      const unsigned char* tensor = slot + (tensor_offsets_[t] - b.offset);
      for (auto [p, pc] : slices_[t]) {
        const Piece& piece = params[p].pieces[pc];
        CopyRegion(tensor, inv_[t].shape, piece.src, static_cast<unsigned char*>(bound[p].data),
                   params[p].shape, piece.dst, ws_);
      }
    }
    if (k + ahead < buckets_.size()) {
      SS_ASSIGN_OR_RETURN(XferId id, post(k + ahead));
      posted.push_back(id);
    }
    SS_ASSIGN_OR_RETURN(XferId a,
                        tx_.PostSend(0, MakeTag(true, kBenchVersionBroadcast, k), &ack, 1));
    acks.push_back(a);
  }
  // Padding rows, as the engine's loader would zero them.
  for (size_t p = 0; p < params.size(); ++p) {
    for (const ZeroFill& z : params[p].zero_fills) {
      ForEachRun(z.dst, params[p].shape, [&](int64_t off, int64_t len) {
        std::memset(static_cast<unsigned char*>(bound[p].data) + off * ws_, 0, len * ws_);
      });
    }
  }
  SS_RETURN_IF_ERROR(Wait(acks, "broadcast acks"));
  return FlushPeers(tx_, {0}, job_.timeout);
}

}  // namespace shardsync::job_internal
