#include "sync/fp8_codec.h"

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

}  // namespace

Status Fp8Codec::PrepareRecv(const Bindings& bindings, const std::vector<int>& msgs) {
  bindings_ = &bindings;
  const RankPlan& plan = ctx_.plan;
  for (int mi : msgs) {
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
  }
  recv_msgs_ = msgs;
  // Host staging only when host-path messages land here: bands staged over prepared pairs use
  // the device staging (PreparedPairs::AllocStaging).
  if (plan.staging_bytes > 0 && !msgs.empty()) {
    host_staging_ = std::make_unique<unsigned char[]>(static_cast<size_t>(plan.staging_bytes));
  }
  return OkStatus();
}

void Fp8Codec::BeginRecv() {
  const RankPlan& plan = ctx_.plan;
  band_left_.assign(plan.staged.size(), 0);
  for (int mi : recv_msgs_) {
    for (const TransferOp& op : plan.recvs[mi].ops) {
      if (op.encoding == Encoding::kStage) band_left_[op.stage] += op.dst.numel();
    }
  }
}

Status Fp8Codec::FinishRecv() {
  const RankPlan& plan = ctx_.plan;
  for (size_t i = 0; i < band_left_.size(); ++i) {
    if (band_left_[i] != 0) {
      return InternalError(RankName(ctx_.rank) + ": staged band " + std::to_string(i) + " of '" +
                           bindings_->dest(plan.staged[i].param).name + "' is missing " +
                           std::to_string(band_left_[i]) + " elements after every bucket landed");
    }
  }
  return OkStatus();
}

Status Fp8Codec::Land(const Message& m, int bucket, const unsigned char* img) {
  const RankPlan& plan = ctx_.plan;
  const Bucket& b = m.buckets[bucket];
  std::vector<int64_t>& band_left = band_left_;
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
        n = Place(w, host_staging_.get() + band.staging_offset,
                  {band.src.extent[0], band.src.extent[1]}, op.dst, ts);
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
    const int64_t bad = QuantizeBand(band, host_staging_.get(), *bindings_);
    if (bad > 0) {
      return DataLossError(RankName(ctx_.rank) + ": " + std::to_string(bad) +
                           " non-finite values (NaN or Inf) in the staged rows " +
                           band.src.ToString() + " of '" + bindings_->dest(band.param).name +
                           "': block FP8 cannot represent them; the rank stays poisoned");
    }
  }
  return OkStatus();
}

Status Fp8Codec::RebuildImage(const Bindings& bindings, const Message& m, const Bucket& b,
                              const std::function<void*(int param)>& live,
                              unsigned char* out) const {
  for (int32_t i = b.op_begin; i < b.op_end; ++i) {
    const TransferOp& op = m.ops[i];
    unsigned char* w = out + (op.wire_offset - b.wire_offset);
    int64_t n = 0;  // as Land places them: the rest of op.bytes is the zero pad
    switch (op.encoding) {
      case Encoding::kCopy: {
        const DestBinding& d = bindings.dest(op.param);
        n = GatherRegion(live(op.param), d.shape, op.dst, DTypeSize(d.dtype), w);
        break;
      }
      case Encoding::kQuantize:
      case Encoding::kAmax: {  // the scales travel only from a kAmax band's first holder
        n = GatherRegion(live(op.param), bindings.dest(op.param).shape, op.dst, 1, w);
        if (op.scale_param < 0) break;
        const int64_t at = (n + 7) & ~int64_t{7};
        std::memset(w + n, 0, static_cast<size_t>(at - n));
        n = at + GatherRegion(live(op.scale_param), bindings.dest(op.scale_param).shape,
                              op.scale_dst, 4, w + at);
        break;
      }
      case Encoding::kStage:
        // The engine quantized these rows itself: what it holds is not what was sent.
        return FailedPreconditionError(RankName(ctx_.rank) + ": bucket of message from sync rank " +
                                       std::to_string(m.src) + " carries staged rows of '" +
                                       bindings.dest(op.param).name +
                                       "', which have no landed image to delta against");
    }
    std::memset(w + n, 0, static_cast<size_t>(op.bytes - n));
  }
  return OkStatus();
}

int64_t Fp8Codec::QuantizeBand(const StagedBand& band, const unsigned char* staging,
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
