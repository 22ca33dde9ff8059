// The delta encoding's receive steps (delta_recv.h).
#include "sync/delta_recv.h"

#include <cstring>
#include <span>

#include "shardsync/checksum.h"

namespace shardsync::sync_internal {

Status DeltaReceiver::Prepare(const Bindings& bindings, const std::vector<int>& msgs) {
  bindings_ = &bindings;
  const RankPlan& plan = ctx_.plan;
  const std::string enc(WireEncodingName(ctx_.in.options.encoding));
  slots_.assign(plan.recvs.size(), {});
  for (int mi : msgs) {
    const Message& m = plan.recvs[mi];
    if (!ctx_.builtin_packer()) {
      return UnimplementedError(Who() + ": encoding " + enc +
                                " applies deltas in host memory, so it needs the built-in CPU "
                                "packer (host-memory parameters); use encoding full");
    }
    if (!ctx_.tx.PeerCaps(m.src).two_sided) {
      return UnimplementedError(Who() + ": encoding " + enc +
                                " receives deltas as two-sided messages, which " +
                                ctx_.tx.PeerTransport(m.src) + " (from sync rank " +
                                std::to_string(m.src) + ") does not offer");
    }
    SS_ASSIGN_OR_RETURN(SyncRank src, DescribeSyncRank(ctx_.in, m.src));
    for (const Bucket& b : m.buckets) {
      Slot s;
      // An image codec lands the verified image with its own step (Codec::Land).
      if (codec_.in_place())
        s.runs = BucketTransfers(
            ctx_.in, ctx_.inventory, src.trainer_rank, m, b,
            [&](int param) -> const Shape& { return bindings.dest(param).shape; },
            [&](int param) { return bindings.LocalShape(m, param); });
      slots_[mi].push_back(std::move(s));
    }
  }
  return OkStatus();
}

std::string DeltaReceiver::Where(int mi, int bi) const {
  return "message from sync rank " + std::to_string(ctx_.plan.recvs[mi].src) + " to sync rank " +
         std::to_string(ctx_.rank) + ", bucket " + std::to_string(bi);
}

void* DeltaReceiver::Live(int param) const {
  // Under a staged commit the bound parameters are redirected to staging: the live ones are the
  // engine's, which hold the committed version.
  return staged_.on() ? staged_.live()[param].data : bindings_->dest(param).data;
}

Status DeltaReceiver::Rebuild(int mi, int bi) {
  const Message& m = ctx_.plan.recvs[mi];
  const Bucket& b = m.buckets[bi];
  image_.resize(static_cast<size_t>(b.bytes));
  return codec_.RebuildImage(
      *bindings_, m, b, [this](int param) { return Live(param); },
      reinterpret_cast<unsigned char*>(image_.data()));
}

unsigned char* DeltaReceiver::Landing(const WireRun& r) const {
  return static_cast<unsigned char*>(bindings_->dest(r.param).data) + r.param_offset;
}

Result<std::string> DeltaReceiver::Advertise() {
  const auto t0 = Clock::now();
  std::vector<std::pair<int, std::vector<BucketBase>>> by_src;
  for (size_t mi = 0; mi < slots_.size(); ++mi) {
    if (slots_[mi].empty()) continue;
    std::vector<BucketBase> bases;
    for (size_t bi = 0; bi < slots_[mi].size(); ++bi) {
      Slot& s = slots_[mi][bi];
      // Recomputed every sync over the image rebuilt from the live bytes: a corrupted byte or
      // restored older bytes show here, whatever the version says.
      SS_RETURN_IF_ERROR(Rebuild(static_cast<int>(mi), static_cast<int>(bi)));
      s.advertised.version = staged_.on() ? staged_.committed() : s.verified;
      s.advertised.checksum = Checksum(image_.data(), image_.size());
      bases.push_back(s.advertised);
    }
    by_src.emplace_back(ctx_.plan.recvs[mi].src, std::move(bases));
  }
  st_.decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return EncodeBases(by_src);
}

Result<const unsigned char*> DeltaReceiver::Apply(int mi, int bi, const Control& c,
                                                  const unsigned char* slot) {
  const Bucket& b = ctx_.plan.recvs[mi].buckets[bi];
  const std::string where = Where(mi, bi);
  SS_RETURN_IF_ERROR(CheckDeltaControl(c, where, b.bytes));
  if (static_cast<DeltaKind>(c.form) == DeltaKind::kFull) return slot;
  const auto t0 = Clock::now();
  Slot& s = slots_[mi][bi];
  const std::span<const std::byte> enc(reinterpret_cast<const std::byte*>(slot), c.payload);
  SS_ASSIGN_OR_RETURN(const DeltaInfo info, InspectDelta(enc, where));
  // The base: the image this rank's live parameters landed as (the codec's inverse of Land).
  SS_RETURN_IF_ERROR(Rebuild(mi, bi));
  DeltaExpect expect;
  expect.bucket = where;
  expect.element_size = DeltaElementSize(ctx_.in);
  expect.base_version = s.advertised.version;
  Status applied = DecodeDeltaInPlace(enc, image_, expect);
  if (!applied.ok()) {
    return applied.Annotate(Who() + ": the delta of version " + std::to_string(guard_.version()) +
                            " was refused, nothing of it landed");
  }
  st_.changed += static_cast<int64_t>(info.changed);
  st_.elements += static_cast<int64_t>(info.elements);
  st_.decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return reinterpret_cast<const unsigned char*>(image_.data());
}

Status DeltaReceiver::Land(int mi, int bi, const Control& c, const unsigned char* img) {
  const auto t0 = Clock::now();
  Slot& s = slots_[mi][bi];
  if (codec_.in_place()) {
    for (const WireRun& r : s.runs) std::memcpy(Landing(r), img + r.wire_offset, r.len);
  } else {
    SS_RETURN_IF_ERROR(codec_.Land(ctx_.plan.recvs[mi], bi, img));
  }
  if (!staged_.on()) s.verified = guard_.version();  // the image was verified before it landed
  CountBucket(st_, static_cast<DeltaReason>(c.reason), static_cast<int64_t>(c.payload),
              ctx_.plan.recvs[mi].buckets[bi].bytes);
  st_.decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return OkStatus();
}

DeltaSyncStats DeltaReceiver::Finish() {
  DeltaSyncStats out = std::move(st_);
  st_ = DeltaSyncStats{};
  return out;
}

}  // namespace shardsync::sync_internal
