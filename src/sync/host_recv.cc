#include "sync/host_recv.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shardsync/checksum.h"

namespace shardsync::sync_internal {
namespace {

// A zeroed receive slot whose pages cost memory only once written (anonymous mapping): a slot
// sized for a whole bucket that only ever holds deltas stays nearly free.
Result<std::shared_ptr<unsigned char>> LazySlot(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return UnavailableError("cannot map a " + std::to_string(bytes) +
                            "-byte receive slot: " + std::strerror(errno));
  }
  return std::shared_ptr<unsigned char>(static_cast<unsigned char*>(p),
                                        [bytes](unsigned char* q) { munmap(q, bytes); });
}

// The bytes of [p, p + bytes) (a LazySlot) backed by memory now: the pages written so far.
int64_t ResidentBytes(const unsigned char* p, size_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((bytes + page - 1) / page);
  if (mincore(const_cast<unsigned char*>(p), bytes, in.data()) != 0) return 0;
  int64_t n = 0;
  for (unsigned char v : in) n += (v & 1) ? static_cast<int64_t>(page) : 0;
  return n;
}

}  // namespace

Status HostReceiver::Prepare(const Bindings& bindings, const PreparedPairs& pairs) {
  bindings_ = &bindings;
  pairs_ = &pairs;
  SS_RETURN_IF_ERROR(ResolveAuto(ctx_, delta_));
  const RankPlan& plan = ctx_.plan;
  std::vector<int> msgs;  // the host path's
  for (size_t mi = 0; mi < plan.recvs.size(); ++mi) {
    if (!pairs.recvs(mi)) msgs.push_back(static_cast<int>(mi));
  }
  SS_RETURN_IF_ERROR(codec_.PrepareRecv(bindings, msgs));
  if (delta_) SS_RETURN_IF_ERROR(delta_->Prepare(bindings, msgs));
  runs_.assign(plan.recvs.size(), {});
  slot_bytes_.assign(plan.recvs.size(), 0);
  for (size_t mi = 0; mi < plan.recvs.size(); ++mi) {
    const Message& m = plan.recvs[mi];
    if (!codec_.in_place()) {
      // An image: plain pieces into a receive slot, as the sender cuts them (the delta
      // encoding: one message, into the image the delta step rebuilt).
      for (const Bucket& b : m.buckets) {
        slot_bytes_[mi] = std::max(slot_bytes_[mi], b.bytes);
        std::vector<WireRun>& runs = runs_[mi].emplace_back();
        if (delta_) {
          runs.push_back(WireRun{.wire_offset = 0, .len = static_cast<size_t>(b.bytes)});
          continue;
        }
        ForEachImageTransfer(b.bytes, [&](int64_t off, int64_t len) {
          WireRun r;
          r.wire_offset = off;
          r.len = static_cast<size_t>(len);
          runs.push_back(r);
        });
      }
      continue;
    }
    SS_ASSIGN_OR_RETURN(SyncRank src, DescribeSyncRank(ctx_.in, m.src));
    for (const Bucket& b : m.buckets) {
      // The delta encoding: a delta lands in a slot, a whole bucket in place as encoding full's.
      if (delta_) slot_bytes_[mi] = std::max(slot_bytes_[mi], b.bytes);
      runs_[mi].push_back(BucketTransfers(
          ctx_.in, ctx_.inventory, src.trainer_rank, m, b,
          [&](int param) -> const Shape& { return bindings.dest(param).shape; },
          [&](int param) { return bindings.LocalShape(m, param); }));
    }
  }
  return OkStatus();
}

Status HostReceiver::Receive(RankSyncStats& st) {
  HostRecv hr;
  // One-sided puts land in the parameters: only bytes that are theirs (in place).
  hr.put = !image() && ctx_.tx.caps().one_sided_put;
  // Host parameters with the built-in packer in tag mode: checksum each run right after it
  // lands, while its bytes are still in cache, instead of re-reading the whole bucket from
  // memory once its control message arrives.
  hr.incremental = !image() && !hr.put && ctx_.builtin_packer();
  // ... or let the transport sum the words as it copies them in (shm): no read at all.
  hr.summed = hr.incremental && ctx_.tx.caps().summed_copy;
  codec_.BeginRecv();
  Status s = Post(hr, st);
  if (s.ok()) s = Poll(hr, st);
  if (!s.ok()) {
    graveyard_.push_back(hr.ctrl);
    if (hr.summed) graveyard_.push_back(hr.sums);
    for (auto& img : hr.images) graveyard_.push_back(std::move(img));
    slots_.clear();
    slot_msg_.clear();
    // Whole buckets land where they go before they are verified: those posted and not verified
    // may hold any bytes now.
    if (delta_) {
      for (size_t mi = 0; mi < hr.next.size(); ++mi) {
        for (int bi = 0; bi < hr.next[mi]; ++bi) {
          if (auto gone = delta_->Unverify(static_cast<int>(mi), bi)) graveyard_.push_back(gone);
        }
      }
    }
    if (delta_) st.delta.Add(delta_->Finish());
    return s;
  }
  if (delta_) {
    st.delta.Add(delta_->Finish());
    st.delta.held_bytes = delta_->ImageBytes();
    for (size_t k = 0; k < slots_.size(); ++k) {
      const auto bytes = static_cast<size_t>(std::max<int64_t>(slot_bytes_[slot_msg_[k]], 8));
      st.delta.held_bytes += ResidentBytes(slots_[k].get(), bytes);
    }
  }
  if (!delta_ && ctx_.in.options.encoding == WireEncoding::kAuto) {
    // Encoding auto ran as full here (ResolveAuto): the report says so, bucket by bucket.
    for (size_t mi = 0; mi < ctx_.plan.recvs.size(); ++mi) {
      if (pairs_->recvs(mi)) continue;
      for (const Bucket& b : ctx_.plan.recvs[mi].buckets) CountAutoFull(st.delta, b.bytes);
    }
  }
  return codec_.FinishRecv();
}

Status HostReceiver::Post(HostRecv& hr, RankSyncStats& st) {
  size_t total = 0, msgs = 0;  // buckets and messages of the host path (pairs count their own)
  for (size_t mi = 0; mi < ctx_.plan.recvs.size(); ++mi) {
    if (pairs_->recvs(mi)) continue;
    total += ctx_.plan.recvs[mi].buckets.size();
    ++msgs;
  }
  st.checksums_total = static_cast<int64_t>(total);
  const bool image = this->image();
  hr.ctrl = std::make_shared<std::vector<Control>>(image ? 2 * msgs : total);
  if (hr.summed) {
    size_t runs = 0;
    for (const auto& m : runs_) {
      for (const auto& b : m) runs += b.size();
    }
    hr.sums->reserve(runs);
  }
  hr.next.assign(ctx_.plan.recvs.size(), 0);
  hr.seq.assign(ctx_.plan.recvs.size(), 0);
  size_t k = 0;
  for (size_t mi = 0; mi < ctx_.plan.recvs.size(); ++mi) {
    if (pairs_->recvs(mi)) continue;
    const int n = image ? 2 : static_cast<int>(ctx_.plan.recvs[mi].buckets.size());
    for (int i = 0; i < n; ++i, ++k) {
      if (image) {
        // Zeroed, at least 8 bytes, allocated once and reused while syncs succeed: a failed
        // sync's slots may still be written into (Receive gives them up). Untouched pages
        // (LazySlot): a delta's slot costs memory only for the bytes deltas filled.
        if (slots_.size() <= k) {
          auto slot = LazySlot(static_cast<size_t>(std::max<int64_t>(slot_bytes_[mi], 8)));
          if (!slot.ok()) {
            return slot.status().Annotate("sync rank " + std::to_string(ctx_.rank) +
                                          ", receiving from sync rank " +
                                          std::to_string(ctx_.plan.recvs[mi].src));
          }
          slots_.push_back(std::move(*slot));
          slot_msg_.push_back(static_cast<int>(mi));
        }
        hr.images.push_back(slots_[k]);
      }
      SS_RETURN_IF_ERROR(PostNext(hr, static_cast<int>(mi), k, hr.pending));
    }
  }
  return OkStatus();
}

Status HostReceiver::PostNext(HostRecv& hr, int mi, size_t k, std::vector<Expect>& into) {
  const Message& m = ctx_.plan.recvs[mi];
  if (hr.next[mi] >= static_cast<int>(m.buckets.size())) return OkStatus();
  Expect e;
  e.msg = mi;
  e.bucket = hr.next[mi]++;
  e.slot = k;
  if (image()) e.img = hr.images[k].get();
  if (!hr.put) {
    // Two-sided: receive each run straight into its parameter (no staging copy), or into the
    // image's slot. The delta encoding: the whole bucket's runs where its delta step lands them
    // (in place, or into its rebuilt image), then the delta into the slot; the sender fills the
    // form it did not take with empty messages.
    e.runs = &runs_[mi][e.bucket];
    e.sums_at = hr.sums->size();
    for (const WireRun& r : *e.runs) {
      auto* dst = delta_ ? delta_->WholeTarget(mi, e.bucket, r)
                  : e.img != nullptr
                      ? hr.images[k].get() + r.wire_offset
                      : static_cast<unsigned char*>(bindings_->dest(r.param).data) + r.param_offset;
      const uint64_t tag = DataTag(guard_.version(), hr.seq[mi]++);
      Result<XferId> id = XferId{0};
      if (hr.summed) {
        hr.sums->push_back(CopySum{static_cast<uint64_t>(r.wire_offset), 0});
        id = ctx_.tx.PostRecvSummed(m.src, tag, dst, r.len, &hr.sums->back());
      } else {
        id = ctx_.tx.PostRecv(m.src, tag, dst, r.len);
      }
      SS_RETURN_IF_ERROR(id.status());
      e.ids.push_back(*id);
    }
    if (delta_) {
      SS_ASSIGN_OR_RETURN(
          XferId id, ctx_.tx.PostRecv(m.src, DataTag(guard_.version(), hr.seq[mi]++),
                                      hr.images[k].get(), static_cast<size_t>(slot_bytes_[mi])));
      e.ids.push_back(id);
    }
  }
  SS_ASSIGN_OR_RETURN(XferId id, ctx_.tx.PostRecv(m.src, ControlTag(guard_.version(), e.bucket),
                                                  &(*hr.ctrl)[k], sizeof(Control)));
  e.ids.push_back(id);
  into.push_back(std::move(e));
  return OkStatus();
}

Status HostReceiver::Poll(HostRecv& hr, RankSyncStats& st) {
  int idle = 0;
  std::vector<Expect> next;  // image codecs: the buckets posted into slots that freed up
  while (!hr.pending.empty()) {
    size_t keep = 0;
    bool progressed = false;
    for (size_t i = 0; i < hr.pending.size(); ++i) {
      Expect& e = hr.pending[i];
      const Message& m = ctx_.plan.recvs[e.msg];
      // In posting order, stopping at the first one still in flight: completions arrive
      // roughly in order, and every Poll drives the transport's progress engine.
      size_t done = 0;
      for (; done < e.ids.size(); ++done) {
        auto state = ctx_.tx.Poll(e.ids[done]);
        if (!state.ok()) {
          Status s = state.status();
          return s.Annotate("sync rank " + std::to_string(ctx_.rank) +
                            ": receiving from sync rank " + std::to_string(m.src));
        }
        if (*state == XferState::kInProgress) break;
      }
      progressed |= done > 0;
      if (hr.incremental) AddLanded(hr, e, done);
      e.ids.erase(e.ids.begin(), e.ids.begin() + done);
      if (!e.ids.empty()) {
        if (keep != i) hr.pending[keep] = std::move(e);
        ++keep;
        continue;
      }
      SS_RETURN_IF_ERROR(VerifyBucket(m, e.bucket, (*hr.ctrl)[e.slot],
                                      hr.incremental ? &e.landed : nullptr, e.img));
      ++st.checksums_ok;
      st.recv_bytes += m.buckets[e.bucket].bytes;
      if (e.img != nullptr) SS_RETURN_IF_ERROR(PostNext(hr, e.msg, e.slot, next));
    }
    hr.pending.resize(keep);
    for (Expect& e : next) hr.pending.push_back(std::move(e));
    next.clear();
    if (hr.pending.empty()) break;
    SS_RETURN_IF_ERROR(guard_.CheckDeadline(
        "waiting for " + std::to_string(hr.pending.size()) + " buckets (first from sync rank " +
        std::to_string(ctx_.plan.recvs[hr.pending[0].msg].src) + ")"));
    SyncGuard::Backoff(progressed, idle);
  }
  return OkStatus();
}

void HostReceiver::AddLanded(HostRecv& hr, Expect& e, size_t done) {
  for (size_t d = 0; d < done && e.runs && e.runs_done < e.runs->size(); ++d, ++e.runs_done) {
    const WireRun& r = (*e.runs)[e.runs_done];
    const auto* at =
        static_cast<const unsigned char*>(bindings_->dest(r.param).data) + r.param_offset;
    const auto key = static_cast<uint64_t>(r.wire_offset);
    if (hr.summed) {
      const uint64_t h = SummedHead(key, r.len), t = SummedTail(key, r.len);
      e.landed.Add(at, h, key);
      e.landed.AddWords((*hr.sums)[e.sums_at + e.runs_done].sum, t - h);
      e.landed.Add(at + t, r.len - t, key + t);
    } else {
      e.landed.Add(at, r.len, key);
    }
  }
}

Status CheckControl(const Control& c, const std::string& where, int bucket, uint64_t job_tag,
                    uint64_t version, int64_t bytes) {
  if (c.magic != kControlMagic || c.bucket != static_cast<uint32_t>(bucket)) {
    return DataLossError(where + ": malformed control message");
  }
  if (c.job != job_tag) {
    return DataLossError(where + ": control message of job " + Hex(c.job) +
                         ", this rank is in job " + Hex(job_tag));
  }
  if (c.version != version) {
    return FailedPreconditionError(where + ": sender syncs version " + std::to_string(c.version) +
                                   ", this rank " + std::to_string(version));
  }
  if (c.bytes != static_cast<uint64_t>(bytes)) {
    return DataLossError(where + ": sender reports " + std::to_string(c.bytes) +
                         " bytes, the plan " + std::to_string(bytes));
  }
  return OkStatus();
}

Status HostReceiver::VerifyBucket(const Message& m, int bucket, const Control& c, LandedSum* landed,
                                  const unsigned char* img) {
  const Bucket& b = m.buckets[bucket];
  const std::string where = "message from sync rank " + std::to_string(m.src) + " to sync rank " +
                            std::to_string(ctx_.rank) + ", bucket " + std::to_string(bucket);
  SS_RETURN_IF_ERROR(CheckControl(c, where, bucket, ctx_.job_tag, guard_.version(), b.bytes));
  // The delta encoding: its step lands the bucket (whole or a delta over this rank's base)
  // verified against the sender's checksum.
  if (delta_) return delta_->Receive(static_cast<int>(&m - ctx_.plan.recvs.data()), bucket, c, img);
  uint64_t got = 0;
  if (landed != nullptr) {
    if (landed->bytes() != static_cast<uint64_t>(b.bytes)) {
      return InternalError(where + ": checksummed " + std::to_string(landed->bytes()) +
                           " landed bytes, expected " + std::to_string(b.bytes));
    }
    got = landed->Finish();
  } else if (img != nullptr) {
    got = Checksum(img, static_cast<size_t>(b.bytes));
  } else {
    SS_ASSIGN_OR_RETURN(got, ctx_.packer->ChecksumLanded(bindings_->LandedRegions(m, b), b.bytes));
  }
  if (got != c.checksum)
    return bindings_->MismatchError(m, bucket, guard_.version(), c.checksum, got);
  return img != nullptr ? codec_.Land(m, bucket, img) : OkStatus();
}

}  // namespace shardsync::sync_internal
