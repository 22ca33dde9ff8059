#include "sync/host_send.h"

#include <algorithm>

namespace shardsync::sync_internal {
namespace {

// How many wire bytes a sender keeps posted but not yet completed (the CPU packer's path): the
// receivers' CMA copies then read bytes the sender packed or checksummed moments before, from
// cache, and a fast sender does not pack far ahead of what its receivers take.
constexpr size_t kSendWindowBytes = size_t{2} << 20;
// The CPU packer's staging ring. Transfers complete (as the sender sees them) in posting order
// and at most kSendWindowBytes - len are outstanding when a transfer of len bytes is packed, so
// the outstanding ones occupy at most that much of the ring plus one skipped tail (< one
// transfer) at the wrap: the next len bytes are always free.
constexpr size_t kRingBytes = kSendWindowBytes + kMaxTransferBytes;

}  // namespace

Status HostSender::Prepare(const Bindings& bindings, PeerShapes& shapes, PreparedPairs& pairs,
                           std::map<int, uint32_t> regbase) {
  const RankPlan& plan = ctx_.plan;
  bindings_ = &bindings;
  pairs_ = &pairs;
  regbase_ = std::move(regbase);
  SS_RETURN_IF_ERROR(ResolveAuto(ctx_, delta_));
  std::vector<int> msgs;  // the host path's
  for (size_t mi = 0; mi < plan.sends.size(); ++mi) {
    if (!pairs.sends(mi)) msgs.push_back(static_cast<int>(mi));
  }
  SS_RETURN_IF_ERROR(codec_.PrepareSend(bindings, msgs));
  if (delta_) SS_RETURN_IF_ERROR(delta_->Prepare(msgs));
  if (!image() && ctx_.builtin_packer()) {
    // The CPU packer packs transfer by transfer into a small ring (kRingBytes says why it is
    // never overwritten while in flight): it stays in cache, so packing writes cost no DRAM
    // traffic, and staging memory no longer grows with the bucket cap.
    if (!plan.sends.empty()) {
      SS_ASSIGN_OR_RETURN(staging_[0], ctx_.packer->AllocStaging(kRingBytes));
    }
  } else {
    // Staging: two buckets (double buffering), bounded by the plan's bucket cap; prepared pairs
    // stage (or not) on their own. Under the delta encoding one: a bucket leaves from the image
    // the delta step kept (or as its delta), so the slot is free again once the step returned.
    int64_t max_bucket = 0;
    for (int mi : msgs) {
      for (const Bucket& b : plan.sends[mi].buckets) max_bucket = std::max(max_bucket, b.bytes);
    }
    // The copy codec with the built-in packer under the delta encoding: none, the delta step
    // packs each bucket itself (DeltaSender::EncodePacked, chunk by chunk).
    packed_by_delta_ = delta_ && codec_.in_place() && ctx_.builtin_packer();
    for (auto& s : staging_) {
      if (max_bucket == 0 || packed_by_delta_ || (delta_ && &s != &staging_[0])) break;
      SS_ASSIGN_OR_RETURN(s, codec_.AllocSlot(static_cast<size_t>(max_bucket)));
    }
    if (delta_) {
      delta_staging_bytes_ = packed_by_delta_
                                 ? static_cast<int64_t>(std::min<size_t>(
                                       DeltaSender::kChunkBytes, static_cast<size_t>(max_bucket)))
                                 : max_bucket;
    }
  }
  // Every bucket's transfers, computed once: both ends replay them each sync. In place, they
  // land straight in the parameters (BucketTransfers); an image travels in plain pieces.
  buckets_.assign(plan.sends.size(), {});
  for (size_t mi = 0; mi < plan.sends.size(); ++mi) {
    const Message& m = plan.sends[mi];
    for (const Bucket& b : m.buckets) {
      if (codec_.in_place()) {
        // The delta encoding sends a whole bucket as encoding full does (each transfer lands in
        // its parameter), from the kept image.
        buckets_[mi].push_back(MakeSendBucket(ctx_, bindings, shapes, m, b));
        continue;
      }
      SendBucket& sb = buckets_[mi].emplace_back();
      if (delta_) {
        // A whole bucket as one message (into the receiver's rebuilt image).
        sb.xfers.push_back(WireRun{.wire_offset = 0, .len = static_cast<size_t>(b.bytes)});
        continue;
      }
      ForEachImageTransfer(b.bytes, [&](int64_t off, int64_t len) {
        WireRun r;
        r.wire_offset = off;
        r.len = static_cast<size_t>(len);
        sb.xfers.push_back(r);
      });
    }
    has_buckets_ = has_buckets_ || (!pairs.sends(mi) && !m.buckets.empty());
  }
  return OkStatus();
}

Status HostSender::Send(RankSyncStats& st) {
  HostSend hs = Plan();
  struct KeepOnFailure {
    std::vector<std::shared_ptr<void>>& yard;
    std::shared_ptr<void> sums;
    bool done = false;
    ~KeepOnFailure() {
      if (!done && sums) yard.push_back(std::move(sums));
    }
  } keep{graveyard_, hs.summed ? hs.send_sums : nullptr};
  Status s = SendAll(hs, st);
  if (!s.ok()) {
    // The transport may still read the control messages of buckets in flight.
    for (InFlight& f : hs.flying) {
      if (f.control) graveyard_.push_back(std::shared_ptr<void>(std::move(f.control)));
      if (f.delta.encoded) graveyard_.push_back(f.delta.encoded);
      // A whole bucket leaves from the kept image: it stays alive too.
      if (delta_) graveyard_.push_back(delta_->Forget(f.msg, f.bucket));
    }
    if (delta_) st.delta.Add(delta_->Finish());
    for (auto& c : hs.sent_controls) graveyard_.push_back(std::shared_ptr<void>(std::move(c)));
    return s;
  }
  // Every transfer completed: the transport no longer writes the sums.
  keep.done = true;
  if (delta_) {
    st.delta.Add(delta_->Finish());
    st.delta.held_bytes = delta_->KeptBytes() + delta_staging_bytes_;
  }
  if (!delta_ && ctx_.in.options.encoding == WireEncoding::kAuto) {
    // Encoding auto ran as full here (ResolveAuto): the report says so, bucket by bucket.
    for (size_t mi = 0; mi < ctx_.plan.sends.size(); ++mi) {
      if (pairs_->sends(mi)) continue;
      for (const Bucket& b : ctx_.plan.sends[mi].buckets) CountAutoFull(st.delta, b.bytes);
    }
  }
  return OkStatus();
}

Status HostSender::SendAll(HostSend& hs, RankSyncStats& st) {
  for (auto [mi, bi] : hs.order) {
    if (hs.flying.size() == 2) SS_RETURN_IF_ERROR(FinishOldest(hs, st));
    SS_RETURN_IF_ERROR(guard_.CheckDeadline("while sending"));
    SS_RETURN_IF_ERROR(PostBucket(hs, mi, bi));
  }
  while (!hs.flying.empty()) SS_RETURN_IF_ERROR(FinishOldest(hs, st));
  return guard_.WaitAll(hs.ctrl_ids, "sending control messages");
}

HostSender::HostSend HostSender::Plan() const {
  HostSend hs;
  // Buckets round-robin over receivers, so every receiver verifies while others still land.
  // Each sender starts the round at a different receiver (rotated by its trainer rank): if
  // every sender began with the same receiver, that one would be flooded while the last one
  // idles until every sender had packed all earlier buckets.
  size_t max_buckets = 0;
  for (const Message& m : ctx_.plan.sends) max_buckets = std::max(max_buckets, m.buckets.size());
  const size_t nmsg = ctx_.plan.sends.size();
  const size_t first = nmsg ? static_cast<size_t>(ctx_.who.trainer_rank) % nmsg : 0;
  for (size_t b = 0; b < max_buckets; ++b) {
    for (size_t k = 0; k < nmsg; ++k) {
      const size_t m = (first + k) % nmsg;
      if (!pairs_->sends(m) && b < ctx_.plan.sends[m].buckets.size()) hs.order.emplace_back(m, b);
    }
  }
  // One-sided puts land in the receiver's parameters: only bytes that are theirs (in place).
  hs.put = !image() && ctx_.tx.caps().one_sided_put;
  // The copy codec with the built-in CPU packer (host memory): pack or checksum each transfer
  // just before posting it, and post direct transfers from the source memory itself. Otherwise
  // the codec packs whole buckets into a staging slot; the same transfers then leave from there.
  hs.fused = !image() && ctx_.builtin_packer();
  // Direct transfers checksummed by the transport's own copy (shm): no separate read.
  hs.summed = hs.fused && !hs.put && ctx_.tx.caps().summed_copy;
  // Packed transfers cast / gathered straight into the transport's staging (shm ring slots)
  // instead of into ours and then copied.
  hs.filled = hs.summed && ctx_.tx.caps().filled_send;
  if (hs.summed) {
    size_t n = 0;
    for (auto [mi, bi] : hs.order) {
      for (const WireRun& r : buckets_[mi][bi].xfers) n += r.direct;
    }
    hs.send_sums->reserve(n);
    hs.sum_words.reserve(n);
  }
  hs.next_seq.assign(ctx_.plan.sends.size(), 0);
  return hs;
}

std::unique_ptr<Control> HostSender::MakeControl(const InFlight& f) const {
  auto c = std::make_unique<Control>();
  c->bucket = static_cast<uint32_t>(f.bucket);
  c->version = guard_.version();
  c->bytes = static_cast<uint64_t>(ctx_.plan.sends[f.msg].buckets[f.bucket].bytes);
  c->checksum = f.checksum;
  c->job = ctx_.job_tag;
  c->payload = c->bytes;
  if (delta_) {
    c->form = static_cast<uint32_t>(f.delta.form);
    c->reason = static_cast<uint32_t>(f.delta.reason);
    c->payload = f.delta.bytes;
  }
  return c;
}

Status HostSender::Drain(HostSend& hs, size_t limit) {
  int idle = 0;
  while (hs.outstanding > limit) {
    bool progressed = false;
    for (InFlight& f : hs.flying) {
      size_t done = 0;
      for (; done < f.xfers.size() && hs.outstanding > limit; ++done) {
        auto state = ctx_.tx.Poll(f.xfers[done]);
        if (!state.ok()) {
          Status e = state.status();
          return e.Annotate("sync rank " + std::to_string(ctx_.rank) + ": sending to sync rank " +
                            std::to_string(ctx_.plan.sends[f.msg].dst));
        }
        if (*state == XferState::kInProgress) break;
        hs.outstanding -= f.lens[done];
      }
      progressed |= done > 0;
      f.xfers.erase(f.xfers.begin(), f.xfers.begin() + done);
      f.lens.erase(f.lens.begin(), f.lens.begin() + done);
      if (!f.xfers.empty()) break;  // completions arrive roughly in posting order
    }
    if (hs.outstanding <= limit) break;
    SS_RETURN_IF_ERROR(guard_.CheckDeadline("while sending"));
    SyncGuard::Backoff(progressed, idle);
  }
  return OkStatus();
}

Status HostSender::FinishOldest(HostSend& hs, RankSyncStats& st) {
  InFlight& f = hs.flying.front();
  const Message& m = ctx_.plan.sends[f.msg];
  SS_RETURN_IF_ERROR(guard_.WaitAll(f.xfers, "sending to sync rank " + std::to_string(m.dst)));
  for (size_t n : f.lens) hs.outstanding -= n;
  if (f.sum) {
    for (size_t i = f.sums_begin; i < f.sums_end; ++i) {
      f.sum->AddWords((*hs.send_sums)[i].sum, hs.sum_words[i]);
    }
    SS_RETURN_IF_ERROR(CheckPacked(m, f.bucket, f.sum->bytes()));
    f.checksum = f.sum->Finish();
  }
  if (hs.put || hs.summed) {
    // The flush completed: the bytes are visible at the receiver before it hears of them.
    auto c = MakeControl(f);
    SS_ASSIGN_OR_RETURN(XferId id, ctx_.tx.PostSend(m.dst, ControlTag(guard_.version(), f.bucket),
                                                    c.get(), sizeof(Control)));
    hs.ctrl_ids.push_back(id);
    hs.sent_controls.push_back(std::move(c));
  }
  st.send_bytes += m.buckets[f.bucket].bytes;
  hs.flying.pop_front();
  return OkStatus();
}

Status HostSender::CheckPacked(const Message& m, int bucket, uint64_t bytes) const {
  const auto want = static_cast<uint64_t>(m.buckets[bucket].bytes);
  if (bytes == want) return OkStatus();
  return InternalError("sync rank " + std::to_string(ctx_.rank) + ": packed " +
                       std::to_string(bytes) + " bytes of a " + std::to_string(want) +
                       "-byte bucket to sync rank " + std::to_string(m.dst));
}

Status HostSender::PostBucket(HostSend& hs, int mi, int bi) {
  const Message& m = ctx_.plan.sends[mi];
  const Bucket& b = m.buckets[bi];
  hs.flying.emplace_back();
  InFlight& f = hs.flying.back();
  f.msg = mi;
  f.bucket = bi;
  f.slot = delta_ ? 0 : hs.next_slot;
  hs.next_slot ^= 1;
  unsigned char* stage = hs.fused ? nullptr : staging_[f.slot].get();
  if (!hs.fused && !packed_by_delta_) {
    SS_ASSIGN_OR_RETURN(f.checksum, codec_.Pack(m, b, stage));
  }
  f.sum = std::make_shared<LandedSum>();
  f.sums_begin = hs.send_sums->size();
  if (delta_) {
    // The delta step: the image (now the kept one), or its delta against the receiver's base.
    // The receiver posted both forms' receives: the whole bucket's transfers (into its
    // parameters, or its rebuilt image) and one for a delta. The form not taken gets empty
    // messages, so no receive stays posted and nothing lands where the other form goes.
    if (packed_by_delta_) {
      const SendBucket& sb = buckets_[mi][bi];
      SS_ASSIGN_OR_RETURN(
          f.delta, delta_->EncodePacked(
                       mi, bi, [&](int64_t from, int64_t len, unsigned char* out, LandedSum& sum) {
                         PackRange(sb, ctx_.in.trainer_dtype, ctx_.in.options.wire_dtype, from, len,
                                   out, sum);
                       }));
      f.checksum = f.delta.checksum;
    } else {
      SS_ASSIGN_OR_RETURN(f.delta, delta_->Encode(mi, bi, stage, f.checksum));
    }
    const bool whole = f.delta.form == DeltaKind::kFull;
    auto post = [&](const unsigned char* data, size_t len) -> Status {
      SS_ASSIGN_OR_RETURN(
          XferId id,
          ctx_.tx.PostSend(m.dst, DataTag(guard_.version(), hs.next_seq[mi]++), data, len));
      f.xfers.push_back(id);
      f.lens.push_back(len);
      hs.outstanding += len;
      return OkStatus();
    };
    for (const WireRun& r : buckets_[mi][bi].xfers) {
      SS_RETURN_IF_ERROR(post(f.delta.data + (whole ? r.wire_offset : 0), whole ? r.len : 0));
    }
    SS_RETURN_IF_ERROR(post(f.delta.data, whole ? 0 : static_cast<size_t>(f.delta.bytes)));
  } else {
    for (const WireRun& r : buckets_[mi][bi].xfers) {
      SS_ASSIGN_OR_RETURN(XferId id, PostTransfer(hs, f, r, stage));
      ++hs.next_seq[mi];
      f.xfers.push_back(id);
      f.lens.push_back(r.len);
      hs.outstanding += r.len;
    }
  }
  if (hs.fused) {
    f.sums_end = hs.send_sums->size();
    // Summed: the checksum (and this check) completes in FinishOldest.
    if (!hs.summed) {
      SS_RETURN_IF_ERROR(CheckPacked(m, bi, f.sum->bytes()));
      f.checksum = f.sum->Finish();
      f.sum.reset();
    }
  } else {
    f.sum.reset();
  }
  if (hs.put) {
    SS_ASSIGN_OR_RETURN(XferId fl, ctx_.tx.PostFlush(m.dst));
    f.xfers.push_back(fl);
    f.lens.push_back(0);
  } else if (!hs.summed) {
    // Two-sided: the receiver waits for the data receives and the control message alike.
    f.control = MakeControl(f);
    SS_ASSIGN_OR_RETURN(XferId id, ctx_.tx.PostSend(m.dst, ControlTag(guard_.version(), f.bucket),
                                                    f.control.get(), sizeof(Control)));
    f.xfers.push_back(id);
    f.lens.push_back(0);
  }
  return OkStatus();
}

Result<XferId> HostSender::PostTransfer(HostSend& hs, InFlight& f, const WireRun& r,
                                        unsigned char* stage) {
  const Message& m = ctx_.plan.sends[f.msg];
  const SendBucket& sb = buckets_[f.msg][f.bucket];
  LandedSum& sum = *f.sum;
  const unsigned char* src = hs.fused ? nullptr : stage + r.wire_offset;
  CopySum* copy_sum = nullptr;
  Transport::SendFill fill;
  if (hs.fused) {
    SS_RETURN_IF_ERROR(Drain(hs, kSendWindowBytes > r.len ? kSendWindowBytes - r.len : 0));
    if (r.direct) {
      const auto* data = static_cast<const unsigned char*>(bindings_->SourceData(r.tensor));
      src = data + r.src_offset;
      const auto key = static_cast<uint64_t>(r.wire_offset);
      if (hs.summed) {
        // The transport sums the whole words as it copies them out; the edges are ours.
        const uint64_t h = SummedHead(key, r.len), t = SummedTail(key, r.len);
        sum.Add(src, h, key);
        sum.Add(src + t, r.len - t, key + t);
        hs.send_sums->push_back(CopySum{key, 0});
        hs.sum_words.push_back(static_cast<size_t>(t - h));
        copy_sum = &hs.send_sums->back();
      } else {
        // Straight from the trainer's memory: checksummed right before it is posted, so
        // the receiver's copy finds it in cache.
        sum.Add(src, r.len, key);
      }
    } else if (hs.filled) {
      // PackRange, from the transport's progress, into each slot as it frees up.
      fill = [this, bucket = &sb, sum = f.sum, at = r.wire_offset](void* dst, uint64_t off,
                                                                   uint64_t len) {
        PackRange(*bucket, ctx_.in.trainer_dtype, ctx_.in.options.wire_dtype,
                  at + static_cast<int64_t>(off), static_cast<int64_t>(len),
                  static_cast<unsigned char*>(dst), *sum);
      };
    } else {
      if (hs.ring_at + r.len > kRingBytes) hs.ring_at = 0;
      unsigned char* out = staging_[0].get() + hs.ring_at;
      hs.ring_at += r.len;
      PackRange(sb, ctx_.in.trainer_dtype, ctx_.in.options.wire_dtype, r.wire_offset,
                static_cast<int64_t>(r.len), out, sum);
      src = out;
    }
  }
  const uint64_t tag = DataTag(guard_.version(), hs.next_seq[f.msg]);
  if (hs.put) {
    return ctx_.tx.PostPut(m.dst, src, r.len, regbase_.at(m.dst) + static_cast<uint32_t>(r.param),
                           r.param_offset);
  }
  if (fill) return ctx_.tx.PostSendFilled(m.dst, tag, r.len, std::move(fill));
  if (copy_sum) return ctx_.tx.PostSendSummed(m.dst, tag, src, r.len, copy_sum);
  return ctx_.tx.PostSend(m.dst, tag, src, r.len);
}

}  // namespace shardsync::sync_internal
