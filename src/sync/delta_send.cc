// The delta encoding's send step (delta_send.h).
#include "sync/delta_send.h"

#include <algorithm>
#include <cstring>
#include <span>

namespace shardsync::sync_internal {

Status DeltaSender::Prepare(const std::vector<int>& msgs) {
  const RankPlan& plan = ctx_.plan;
  SS_ASSIGN_OR_RETURN(link_, DeltaLinkFromKnobs());
  slots_.assign(plan.sends.size(), {});
  for (int mi : msgs) {
    const Message& m = plan.sends[mi];
    if (!ctx_.tx.PeerCaps(m.dst).two_sided) {
      return UnimplementedError(
          Who() + ": encoding " + std::string(WireEncodingName(ctx_.in.options.encoding)) +
          " sends deltas as two-sided messages, which " + ctx_.tx.PeerTransport(m.dst) +
          " (to sync rank " + std::to_string(m.dst) + ") does not offer");
    }
    slots_[mi].resize(m.buckets.size());
  }
  return OkStatus();
}

Status DeltaSender::SetBases(int dst, std::string_view value) {
  for (size_t mi = 0; mi < ctx_.plan.sends.size(); ++mi) {
    if (ctx_.plan.sends[mi].dst != dst || slots_[mi].empty()) continue;
    SS_ASSIGN_OR_RETURN(std::vector<BucketBase> bases,
                        ParseBases(value, ctx_.rank, slots_[mi].size(), dst));
    for (size_t b = 0; b < bases.size(); ++b) {
      slots_[mi][b].base = bases[b];
      slots_[mi][b].base_known = true;
    }
  }
  return OkStatus();
}

Result<DeltaSender::Slot*> DeltaSender::Known(int mi, int bi) {
  Slot& slot = slots_[mi][bi];
  if (!slot.base_known) {
    return InternalError(Who() + ": no delta base from sync rank " +
                         std::to_string(ctx_.plan.sends[mi].dst) + " for bucket " +
                         std::to_string(bi));
  }
  return &slot;
}

Status DeltaSender::Settle(Out& out, const DeltaEncodeResult& r) {
  st_.changed += static_cast<int64_t>(r.changed);
  st_.elements += static_cast<int64_t>(r.elements);
  if (r.kind == DeltaKind::kFull) {
    out.reason = DeltaReason::kSize;
  } else if (ctx_.in.options.encoding == WireEncoding::kAuto) {
    SS_ASSIGN_OR_RETURN(const bool pays,
                        DeltaPays(link_, r.elements, DeltaElementSize(ctx_.in), r.changed));
    if (!pays) out.reason = DeltaReason::kCost;
  }
  if (out.reason == DeltaReason::kDelta) {
    out.form = r.kind;
    out.data = reinterpret_cast<const unsigned char*>(out.encoded->data());
    out.bytes = out.encoded->size();
  } else {
    out.encoded.reset();
  }
  return OkStatus();
}

void DeltaSender::Close(int mi, int bi, Out& out, uint64_t checksum, Clock::time_point t0) {
  const Message& m = ctx_.plan.sends[mi];
  Slot& slot = slots_[mi][bi];
  if (out.reason != DeltaReason::kDelta && out.reason != DeltaReason::kNoImage &&
      out.reason != DeltaReason::kSize && out.reason != DeltaReason::kCost &&
      st_.first_fallback.empty()) {
    st_.first_fallback = DescribeFallback(out.reason, m.dst, bi, slot.kept, slot.base);
  }
  Trace(ctx_.rank, guard_.version(), [&] {
    return DescribeFallback(out.reason, m.dst, bi, slot.kept, slot.base) + ", " +
           std::to_string(out.bytes) + " bytes";
  });
  // The kept image now holds the new one, which the receiver holds once this bucket verified; a
  // whole bucket leaves from it (the staging slot, if any, is reused for the next bucket).
  if (out.form == DeltaKind::kFull)
    out.data = reinterpret_cast<const unsigned char*>(slot.kept.bytes.data());
  slot.kept.version = guard_.version();
  slot.kept.checksum = checksum;
  CountBucket(st_, out.reason, static_cast<int64_t>(out.bytes), m.buckets[bi].bytes);
  st_.encode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
}

Result<DeltaSender::Out> DeltaSender::Encode(int mi, int bi, const unsigned char* img,
                                             uint64_t checksum) {
  const auto n = static_cast<size_t>(ctx_.plan.sends[mi].buckets[bi].bytes);
  SS_ASSIGN_OR_RETURN(Slot * slot, Known(mi, bi));
  const auto t0 = Clock::now();
  Out out;
  out.data = img;
  out.bytes = n;
  out.checksum = checksum;
  out.reason = CheckBase(slot->kept, slot->base);
  const std::span<const std::byte> next(reinterpret_cast<const std::byte*>(img), n);
  if (out.reason == DeltaReason::kDelta) {
    out.encoded = Buffer();
    // One pass over the kept and the new image: compared, and the kept one moved to the new
    // bytes (only the changed elements written); both checksums are known (kept, packed).
    SS_ASSIGN_OR_RETURN(
        const DeltaEncodeResult r,
        EncodeDeltaAdvance(slot->kept.bytes, next, DeltaElementSize(ctx_.in), slot->kept.version,
                           slot->kept.checksum, checksum, Name(mi, bi), out.encoded.get()));
    SS_RETURN_IF_ERROR(Settle(out, r));
  } else {
    slot->kept.bytes.assign(next.begin(), next.end());
  }
  Close(mi, bi, out, checksum, t0);
  return out;
}

Result<DeltaSender::Out> DeltaSender::EncodePacked(int mi, int bi, const PackFn& pack) {
  const auto n = static_cast<size_t>(ctx_.plan.sends[mi].buckets[bi].bytes);
  SS_ASSIGN_OR_RETURN(Slot * slot, Known(mi, bi));
  const auto t0 = Clock::now();
  Out out;
  out.bytes = n;
  out.reason = CheckBase(slot->kept, slot->base);
  LandedSum sum;
  auto packed_whole = [&]() -> Status {  // the packer filled exactly the bucket
    if (sum.bytes() == n) return OkStatus();
    return InternalError(Who() + ": packed " + std::to_string(sum.bytes()) + " bytes of a " +
                         std::to_string(n) + "-byte bucket to " + Name(mi, bi));
  };
  if (out.reason == DeltaReason::kDelta) {
    out.encoded = Buffer();
    DeltaAdvanceEncoder enc;
    SS_RETURN_IF_ERROR(
        enc.Begin(slot->kept.bytes, DeltaElementSize(ctx_.in), Name(mi, bi), out.encoded.get()));
    chunk_.resize(std::min(kChunkBytes, n));
    // Each chunk is packed, then compared while in cache; the kept image moves to the new bytes
    // as it goes, so on any error below it is no image of anything: forgotten.
    Status fed;
    for (size_t at = 0; at < n && fed.ok(); at += kChunkBytes) {
      const size_t len = std::min(kChunkBytes, n - at);
      pack(static_cast<int64_t>(at), static_cast<int64_t>(len), chunk_.data(), sum);
      fed = enc.Feed(
          at, std::span<const std::byte>(reinterpret_cast<const std::byte*>(chunk_.data()), len));
    }
    if (fed.ok()) fed = packed_whole();
    DeltaEncodeResult r;
    if (fed.ok()) {
      out.checksum = sum.Finish();
      auto done = enc.Finish(slot->kept.version, slot->kept.checksum, out.checksum);
      if (done.ok())
        r = *done;
      else
        fed = done.status();
    }
    if (!fed.ok()) {
      slot->kept = KeptImage{};
      return fed;
    }
    SS_RETURN_IF_ERROR(Settle(out, r));
  } else {
    // Nothing to compare: packed straight into the kept image.
    slot->kept.bytes.resize(n);
    pack(0, static_cast<int64_t>(n), reinterpret_cast<unsigned char*>(slot->kept.bytes.data()),
         sum);
    if (Status whole = packed_whole(); !whole.ok()) {
      slot->kept = KeptImage{};
      return whole;
    }
    out.checksum = sum.Finish();
  }
  Close(mi, bi, out, out.checksum, t0);
  return out;
}

std::shared_ptr<std::vector<std::byte>> DeltaSender::Buffer() {
  for (const auto& b : buffers_) {
    if (b.use_count() == 1) return b;  // its send completed (or it was not sent)
  }
  // The others are in flight, or kept by a failed sync: past a few, let them go.
  if (buffers_.size() >= 4)
    std::erase_if(buffers_, [](const auto& b) { return b.use_count() > 1; });
  return buffers_.emplace_back(std::make_shared<std::vector<std::byte>>());
}

int64_t DeltaSender::KeptBytes() const {
  int64_t n = 0;
  for (const auto& msg : slots_) {
    for (const Slot& s : msg) n += static_cast<int64_t>(s.kept.bytes.size());
  }
  return n;
}

DeltaSyncStats DeltaSender::Finish() {
  for (auto& msg : slots_) {
    for (Slot& s : msg) s.base_known = false;  // each sync advertises anew
  }
  DeltaSyncStats out = std::move(st_);
  st_ = DeltaSyncStats{};
  return out;
}

}  // namespace shardsync::sync_internal
