#include "sync/fp8_recv.h"

#include <algorithm>
#include <cstring>

#include "shardsync/checksum.h"
#include "shardsync/fp8.h"
#include "sync/fp8_outline.h"

namespace shardsync::sync_internal {
namespace {

bool AllZero(const unsigned char* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

// Copies `es`-byte elements from the contiguous `src` onto region `r` of a row-major tensor.
int64_t Place(const unsigned char* src, void* base, const Shape& shape, const Region& r, int es) {
  int64_t n = 0;
  ForEachRun(r, shape, [&](int64_t off, int64_t len) {
    std::memcpy(static_cast<unsigned char*>(base) + off * es, src + n,
                static_cast<size_t>(len * es));
    n += len * es;
  });
  return n;
}

std::shared_ptr<unsigned char> Buffer(int64_t bytes) {
  return std::shared_ptr<unsigned char>(new unsigned char[std::max<int64_t>(bytes, 8)](),
                                        std::default_delete<unsigned char[]>());
}

}  // namespace

Status Fp8HostReceiver::Prepare(const Bindings& bindings, const PreparedPairs& pairs) {
  bindings_ = &bindings;
  const RankPlan& plan = ctx_.plan;
  msgs_.clear();
  slot_bytes_.assign(plan.recvs.size(), 0);
  for (size_t mi = 0; mi < plan.recvs.size(); ++mi) {
    if (pairs.recvs(mi)) continue;
    const Message& m = plan.recvs[mi];
    for (const DestBinding& d : bindings.dests()) {
      if (d.mem != MemKind::kHost) {
        return UnimplementedError(
            RankName(ctx_.rank) + ": block-FP8 bytes from sync rank " + std::to_string(m.src) +
            " would take the host path, which lands in host memory; device parameters need a "
            "prepared pair (cuda_ipc, the GPUs of one node)");
      }
    }
    if (!ctx_.tx.PeerCaps(m.src).two_sided) {
      return UnimplementedError(RankName(ctx_.rank) + ": block-FP8 bytes from sync rank " +
                                std::to_string(m.src) + " need two-sided messages, which " +
                                ctx_.tx.PeerTransport(m.src) + " does not offer");
    }
    for (const Bucket& b : m.buckets) slot_bytes_[mi] = std::max(slot_bytes_[mi], b.bytes);
    msgs_.push_back(static_cast<int>(mi));
  }
  // Host staging only when host-path messages land here: bands staged over prepared pairs use
  // the device staging (PreparedPairs::AllocStaging).
  if (plan.staging_bytes > 0 && !msgs_.empty()) {
    staging_ = std::make_unique<unsigned char[]>(static_cast<size_t>(plan.staging_bytes));
  }
  return OkStatus();
}

Status Fp8HostReceiver::Receive(RankSyncStats& st) {
  const RankPlan& plan = ctx_.plan;
  // The staged rows this path lands, per band (bands staged over prepared pairs are the device
  // staging's: PreparedPairs::QuantizeStaged).
  std::vector<int64_t> band_left(plan.staged.size(), 0);
  for (int mi : msgs_) {
    for (const TransferOp& op : plan.recvs[mi].ops) {
      if (op.encoding == Encoding::kStage) band_left[op.stage] += op.dst.numel();
    }
  }
  std::vector<Inbox> boxes;
  Status s;
  for (int mi : msgs_) {
    Inbox in;
    in.msg = mi;
    for (auto& sl : in.slots) sl = Buffer(slot_bytes_[mi]);
    in.ctrl = std::shared_ptr<Control>(new Control[2](), std::default_delete<Control[]>());
    st.checksums_total += static_cast<int64_t>(plan.recvs[mi].buckets.size());
    boxes.push_back(std::move(in));
  }
  for (Inbox& in : boxes) {
    for (int slot = 0; slot < 2 && s.ok(); ++slot) s = PostBucket(in, slot);
  }
  int idle = 0;
  while (s.ok()) {
    bool left = false, progressed = false;
    for (Inbox& in : boxes) {
      while (s.ok() && !in.posted.empty()) {
        Posted& p = in.posted.front();
        size_t done = 0;
        for (; done < p.ids.size(); ++done) {
          auto state = ctx_.tx.Poll(p.ids[done]);
          if (!state.ok()) {
            s = state.status();
            s = s.Annotate(RankName(ctx_.rank) + ": receiving from sync rank " +
                           std::to_string(plan.recvs[in.msg].src));
            break;
          }
          if (*state == XferState::kInProgress) break;
        }
        p.ids.erase(p.ids.begin(), p.ids.begin() + static_cast<std::ptrdiff_t>(done));
        progressed |= done > 0;
        if (!s.ok() || !p.ids.empty()) break;
        const Posted landed = std::move(p);
        in.posted.erase(in.posted.begin());
        s = Land(in, landed, band_left);
        if (s.ok()) {
          ++st.checksums_ok;
          st.recv_bytes += plan.recvs[in.msg].buckets[landed.bucket].bytes;
          s = PostBucket(in, landed.slot);
        }
      }
      left |= !in.posted.empty();
    }
    if (!s.ok() || !left) break;
    s = guard_.CheckDeadline("waiting for block-FP8 buckets");
    SyncGuard::Backoff(progressed, idle);
  }
  if (!s.ok()) {
    for (Inbox& in : boxes) {
      graveyard_.push_back(in.slots[0]);
      graveyard_.push_back(in.slots[1]);
      graveyard_.push_back(in.ctrl);
    }
    return s;
  }
  for (size_t i = 0; i < band_left.size(); ++i) {
    if (band_left[i] != 0) {
      return InternalError(RankName(ctx_.rank) + ": staged band " + std::to_string(i) + " of '" +
                           bindings_->dest(plan.staged[i].param).name + "' is missing " +
                           std::to_string(band_left[i]) + " elements after every bucket landed");
    }
  }
  return OkStatus();
}

Status Fp8HostReceiver::PostBucket(Inbox& in, int slot) {
  const Message& m = ctx_.plan.recvs[in.msg];
  if (in.next >= static_cast<int>(m.buckets.size())) return OkStatus();
  const int bi = in.next++;
  const Bucket& b = m.buckets[bi];
  const uint64_t version = guard_.version();
  Posted p;
  p.bucket = bi;
  p.slot = slot;
  unsigned char* buf = in.slots[slot].get();
  Status s;
  ForEachFp8Transfer(b.bytes, [&](int64_t off, int64_t len) {
    if (!s.ok()) return;
    auto id =
        ctx_.tx.PostRecv(m.src, DataTag(version, in.seq++), buf + off, static_cast<size_t>(len));
    if (id.ok()) {
      p.ids.push_back(*id);
    } else {
      s = id.status();
    }
  });
  SS_RETURN_IF_ERROR(s);
  SS_ASSIGN_OR_RETURN(XferId c, ctx_.tx.PostRecv(m.src, ControlTag(version, bi),
                                                 in.ctrl.get() + slot, sizeof(Control)));
  p.ids.push_back(c);
  in.posted.push_back(std::move(p));
  return OkStatus();
}

Status Fp8HostReceiver::Land(Inbox& in, const Posted& p, std::vector<int64_t>& band_left) {
  const Message& m = ctx_.plan.recvs[in.msg];
  const Bucket& b = m.buckets[p.bucket];
  const Control& c = in.ctrl.get()[p.slot];
  const std::string where = "message from sync rank " + std::to_string(m.src) + " to sync rank " +
                            std::to_string(ctx_.rank) + ", bucket " + std::to_string(p.bucket);
  SS_RETURN_IF_ERROR(CheckControl(c, where, p.bucket, ctx_.job_tag, guard_.version(), b.bytes));
  const unsigned char* img = in.slots[p.slot].get();
  const uint64_t got = Checksum(img, static_cast<size_t>(b.bytes));
  if (got != c.checksum) {
    return bindings_->MismatchError(ctx_.plan.recvs[in.msg], p.bucket, guard_.version(), c.checksum,
                                    got);
  }
  return Scatter(m, b, img, p.bucket, band_left);
}

Status Fp8HostReceiver::Scatter(const Message& m, const Bucket& b, const unsigned char* img,
                                int bucket, std::vector<int64_t>& band_left) {
  const RankPlan& plan = ctx_.plan;
  const int ts = DTypeSize(ctx_.in.trainer_dtype);
  for (int32_t i = b.op_begin; i < b.op_end; ++i) {
    const TransferOp& op = m.ops[i];
    const unsigned char* w = img + (op.wire_offset - b.wire_offset);
    int64_t n = 0;  // wire bytes placed; the rest of op.bytes must be the zero pad
    switch (op.encoding) {
      case Encoding::kCopy: {
        const DestBinding& d = bindings_->dest(op.param);
        n = Place(w, d.data, d.shape, op.dst, DTypeSize(d.dtype));
        break;
      }
      case Encoding::kQuantize:
      case Encoding::kAmax: {  // kAmax: the scales only from the band's first holder
        const DestBinding& d = bindings_->dest(op.param);
        n = Place(w, d.data, d.shape, op.dst, 1);
        if (op.scale_param < 0) break;
        const DestBinding& sd = bindings_->dest(op.scale_param);
        const int64_t at = (n + 7) & ~int64_t{7};
        if (!AllZero(w + n, at - n)) n = -1;
        if (n >= 0) n = at + Place(w + at, sd.data, sd.shape, op.scale_dst, 4);
        break;
      }
      case Encoding::kStage: {
        const StagedBand& band = plan.staged[op.stage];
        n = Place(w, staging_.get() + band.staging_offset, {band.src.extent[0], band.src.extent[1]},
                  op.dst, ts);
        break;
      }
    }
    if (n < 0 || !AllZero(w + n, op.bytes - n)) {
      return DataLossError("message from sync rank " + std::to_string(m.src) + " to sync rank " +
                           std::to_string(ctx_.rank) + ", bucket " + std::to_string(bucket) +
                           ": op " + std::to_string(i) + " (" +
                           std::string(EncodingName(op.encoding)) + " of '" +
                           bindings_->dest(op.param).name + "') has non-zero padding");
    }
    if (op.encoding != Encoding::kStage) continue;
    band_left[op.stage] -= op.dst.numel();
    if (band_left[op.stage] != 0) continue;
    const StagedBand& band = plan.staged[op.stage];
    const int64_t bad = QuantizeBand(band, staging_.get(), *bindings_);
    if (bad > 0) {
      return DataLossError(RankName(ctx_.rank) + ": " + std::to_string(bad) +
                           " non-finite values (NaN or Inf) in the staged rows " +
                           band.src.ToString() + " of '" + bindings_->dest(band.param).name +
                           "': block FP8 cannot represent them; the rank stays poisoned");
    }
  }
  return OkStatus();
}

int64_t Fp8HostReceiver::QuantizeBand(const StagedBand& band, const unsigned char* staging,
                                      const Bindings& bindings) {
  const DestBinding& w = bindings.dest(band.param);
  const DestBinding& sc = bindings.dest(band.scale_param);
  const int64_t rows = band.src.extent[0], cols = band.src.extent[1];
  const int es = DTypeSize(band.dtype);
  const int64_t start = RegionStartElement(band.dst, w.shape);
  const int64_t sstart = RegionStartElement(band.scale_dst, sc.shape);
  const unsigned char* src = staging + band.staging_offset;
  auto* q = static_cast<uint8_t*>(w.data) + start;
  auto* scales = static_cast<float*>(sc.data) + sstart;
  int64_t bad = 0;
  for (int64_t c0 = 0; c0 < cols; c0 += kFp8Block) {
    scales[c0 / kFp8Block] =
        Fp8QuantizeBlock(src + c0 * es, band.dtype, cols, rows,
                         std::min<int64_t>(kFp8Block, cols - c0), q + c0, w.shape.back(), &bad);
  }
  return bad;
}

}  // namespace shardsync::sync_internal
