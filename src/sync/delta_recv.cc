// The delta encoding's receive steps (delta_recv.h).
#include "sync/delta_recv.h"

#include <algorithm>
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
      if (codec_.in_place()) {
        s.runs = BucketTransfers(
            ctx_.in, ctx_.inventory, src.trainer_rank, m, b,
            [&](int param) -> const Shape& { return bindings.dest(param).shape; },
            [&](int param) { return bindings.LocalShape(m, param); });
        // Wire order: the pieces of a bucket (DeltaPiece) tile it in offset order.
        std::sort(s.runs.begin(), s.runs.end(),
                  [](const WireRun& a, const WireRun& b) { return a.wire_offset < b.wire_offset; });
      }
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
  std::vector<std::byte>& image = slots_[mi][bi].image;
  image.resize(static_cast<size_t>(b.bytes));
  return codec_.RebuildImage(
      *bindings_, m, b, [this](int param) { return Live(param); },
      reinterpret_cast<unsigned char*>(image.data()));
}

unsigned char* DeltaReceiver::Landing(const WireRun& r) const {
  return static_cast<unsigned char*>(bindings_->dest(r.param).data) + r.param_offset;
}

const std::vector<DeltaPiece>& DeltaReceiver::Pieces(int mi, int bi, const unsigned char* from) {
  pieces_.clear();
  for (const WireRun& r : slots_[mi][bi].runs) {
    const auto* base = from != nullptr
                           ? from + r.wire_offset
                           : static_cast<const unsigned char*>(Live(r.param)) + r.param_offset;
    pieces_.push_back(DeltaPiece{static_cast<uint64_t>(r.wire_offset), r.len,
                                 reinterpret_cast<const std::byte*>(base),
                                 reinterpret_cast<std::byte*>(Landing(r))});
  }
  return pieces_;
}

Result<std::string> DeltaReceiver::Advertise() {
  const auto t0 = Clock::now();
  std::vector<std::pair<int, std::vector<BucketBase>>> by_src;
  for (size_t mi = 0; mi < slots_.size(); ++mi) {
    if (slots_[mi].empty()) continue;
    const Message& m = ctx_.plan.recvs[mi];
    std::vector<BucketBase> bases;
    for (size_t bi = 0; bi < slots_[mi].size(); ++bi) {
      Slot& s = slots_[mi][bi];
      const auto bytes = static_cast<uint64_t>(m.buckets[bi].bytes);
      // Recomputed every sync from the live bytes: a corrupted byte or restored older bytes
      // show here, whatever the version says. In place the runs are the image: read, not copied.
      s.advertised.version = staged_.on() ? staged_.committed() : s.verified;
      if (codec_.in_place()) {
        SS_ASSIGN_OR_RETURN(
            s.advertised.checksum,
            DeltaPiecesChecksum(Pieces(static_cast<int>(mi), static_cast<int>(bi), nullptr),
                                bytes));
      } else {
        SS_RETURN_IF_ERROR(Rebuild(static_cast<int>(mi), static_cast<int>(bi)));
        s.advertised.checksum = Checksum(s.image.data(), s.image.size());
      }
      bases.push_back(s.advertised);
    }
    by_src.emplace_back(m.src, std::move(bases));
  }
  st_.decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return EncodeBases(by_src);
}

Status DeltaReceiver::Receive(int mi, int bi, const Control& c, const unsigned char* slot) {
  const Bucket& b = ctx_.plan.recvs[mi].buckets[bi];
  SS_RETURN_IF_ERROR(CheckDeltaControl(c, Where(mi, bi), b.bytes));
  const auto t0 = Clock::now();
  Slot& s = slots_[mi][bi];
  if (static_cast<DeltaKind>(c.form) == DeltaKind::kFull) {
    SS_RETURN_IF_ERROR(ReceiveWhole(mi, bi, c, slot));
  } else {
    SS_RETURN_IF_ERROR(ReceiveDelta(mi, bi, c, slot));
  }
  if (!staged_.on()) s.verified = guard_.version();
  CountBucket(st_, static_cast<DeltaReason>(c.reason), static_cast<int64_t>(c.payload), b.bytes);
  st_.decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return OkStatus();
}

unsigned char* DeltaReceiver::WholeTarget(int mi, int bi, const WireRun& r) {
  if (!codec_.in_place())
    return reinterpret_cast<unsigned char*>(slots_[mi][bi].image.data()) + r.wire_offset;
  return Landing(r);
}

Status DeltaReceiver::ReceiveWhole(int mi, int bi, const Control& c, const unsigned char* slot) {
  (void)slot;  // a delta's; the whole bucket landed where WholeTarget said
  const Message& m = ctx_.plan.recvs[mi];
  const auto bytes = static_cast<uint64_t>(m.buckets[bi].bytes);
  Slot& s = slots_[mi][bi];
  if (codec_.in_place()) {
    // Landed in the runs (staging, under a staged commit) before the checksum is known, as a
    // whole bucket received in place is: their version is unknown until it verified.
    if (!staged_.on()) s.verified = 0;
    pieces_.clear();
    for (const WireRun& r : s.runs) {
      pieces_.push_back(DeltaPiece{static_cast<uint64_t>(r.wire_offset), r.len,
                                   reinterpret_cast<const std::byte*>(Landing(r)),
                                   reinterpret_cast<std::byte*>(Landing(r))});
    }
    SS_ASSIGN_OR_RETURN(const uint64_t got, DeltaPiecesChecksum(pieces_, bytes));
    if (got != c.checksum)
      return bindings_->MismatchError(m, bi, guard_.version(), c.checksum, got);
    return OkStatus();
  }
  const auto* image = reinterpret_cast<const unsigned char*>(s.image.data());
  const uint64_t got = Checksum(image, static_cast<size_t>(bytes));
  if (got != c.checksum) return bindings_->MismatchError(m, bi, guard_.version(), c.checksum, got);
  return codec_.Land(m, bi, image);
}

Status DeltaReceiver::ReceiveDelta(int mi, int bi, const Control& c, const unsigned char* slot) {
  const Message& m = ctx_.plan.recvs[mi];
  const auto bytes = static_cast<uint64_t>(m.buckets[bi].bytes);
  const std::string where = Where(mi, bi);
  const std::span<const std::byte> enc(reinterpret_cast<const std::byte*>(slot), c.payload);
  SS_ASSIGN_OR_RETURN(const DeltaInfo info, InspectDelta(enc, where));
  // The decode proves the result's checksum equals the one the delta names; that one must be the
  // checksum the sender sent for the bucket.
  if (info.new_checksum != c.checksum) {
    return DataLossError(where + ": the delta names the result checksum " + Hex(info.new_checksum) +
                         ", the control message " + Hex(c.checksum));
  }
  DeltaExpect expect;
  expect.bucket = where;
  expect.element_size = DeltaElementSize(ctx_.in);
  expect.base_version = slots_[mi][bi].advertised.version;
  Status applied;
  if (codec_.in_place()) {
    // The base is what the runs hold now (read again: bytes written since the advertisement
    // are caught), in place or copied from the live parameters into staging.
    applied = DecodeDeltaPieces(enc, Pieces(mi, bi, nullptr), bytes, expect);
  } else {
    // Over the image rebuilt for the advertisement (not rebuilt again): the codec's Land then
    // rewrites every byte of the bucket from the verified result, so a parameter byte changed
    // since is overwritten, not covered.
    applied = DecodeDeltaInPlace(enc, slots_[mi][bi].image, expect);
  }
  if (!applied.ok()) {
    return applied.Annotate(Who() + ": the delta of version " + std::to_string(guard_.version()) +
                            " was refused, nothing of it landed");
  }
  st_.changed += static_cast<int64_t>(info.changed);
  st_.elements += static_cast<int64_t>(info.elements);
  if (codec_.in_place()) return OkStatus();
  return codec_.Land(m, bi, reinterpret_cast<const unsigned char*>(slots_[mi][bi].image.data()));
}

DeltaSyncStats DeltaReceiver::Finish() {
  DeltaSyncStats out = std::move(st_);
  st_ = DeltaSyncStats{};
  return out;
}

}  // namespace shardsync::sync_internal
