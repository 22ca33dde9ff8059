#include "sync/fp8_codec.h"

#include <algorithm>
#include <cstring>

#include "common/cast.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"
#include "sync/fp8_outline.h"

namespace shardsync::sync_internal {

Result<Fp8Packed> PackFp8Bucket(const SessionContext& ctx, const Bindings& bindings,
                                const Message& m, const Bucket& b, unsigned char* out,
                                const Fp8AmaxScales* amax) {
  const DType td = ctx.in.trainer_dtype, wd = ctx.in.options.wire_dtype;
  const int ts = DTypeSize(td), ws = DTypeSize(wd);
  Fp8Packed res;
  uint64_t sum = 0;
  for (int32_t i = b.op_begin; i < b.op_end; ++i) {
    const TransferOp& op = m.ops[i];
    // The sender's HF shard, or for Megatron senders the op's region of a local parameter.
    const Bindings::OpSource sb = bindings.SourceOf(m, i);
    const Region& rel = sb.region;
    const Shape& shape = sb.shape;
    const int64_t at = op.wire_offset - b.wire_offset;
    unsigned char* o = out + at;
    if (op.encoding == Encoding::kQuantize) {
      SS_ASSIGN_OR_RETURN(Fp8PackResult r, Fp8QuantizePack({sb.data, td, shape, rel, at}, o));
      sum += r.sum;
      if (r.nonfinite > 0 && res.first_bad_op < 0) res.first_bad_op = i;
      res.nonfinite += r.nonfinite;
      continue;
    }
    if (op.encoding == Encoding::kAmax) {
      auto it = amax == nullptr
                    ? std::map<std::pair<int32_t, int64_t>, int64_t>::const_iterator()
                    : amax->slot.find({op.tensor, op.src.offset[0] / kFp8Block * kFp8Block});
      if (amax == nullptr || it == amax->slot.end()) {
        return InternalError(RankName(ctx.rank) + ": no exchanged scales for " + op.src.ToString() +
                             " of '" + ctx.inventory.at(op.tensor).name + "'");
      }
      const float* scales = amax->scales.data() + it->second + op.src.offset[1] / kFp8Block;
      SS_ASSIGN_OR_RETURN(Fp8PackResult r, Fp8QuantizePackScaled({sb.data, td, shape, rel, at},
                                                                 scales, op.scale_param >= 0, o));
      sum += r.sum;
      if (r.nonfinite > 0 && res.first_bad_op < 0) res.first_bad_op = i;
      res.nonfinite += r.nonfinite;
      continue;
    }
    // Copies cast to the wire dtype; staged rows travel as the trainer holds them (the receiver
    // quantizes them once their band is complete).
    const bool copy = op.encoding == Encoding::kCopy;
    int64_t w = 0;
    ForEachRun(rel, shape, [&](int64_t off, int64_t len) {
      const auto* src = static_cast<const unsigned char*>(sb.data) + off * ts;
      if (copy) {
        CastInto(src, td, o + w, wd, len);
        w += len * ws;
      } else {
        std::memcpy(o + w, src, static_cast<size_t>(len * ts));
        w += len * ts;
      }
    });
    std::memset(o + w, 0, static_cast<size_t>(op.bytes - w));
    sum += ChecksumPartial(o, static_cast<size_t>(op.bytes), static_cast<uint64_t>(at));
  }
  res.checksum = ChecksumFinish(sum, static_cast<uint64_t>(b.bytes));
  return res;
}

std::unique_ptr<Codec> MakeBlockQuantizeCodec(const SessionContext& ctx) {
  return std::make_unique<Fp8Codec>(ctx);
}

Status Fp8Codec::PrepareSend(const Bindings& bindings, const std::vector<int>& msgs) {
  bindings_ = &bindings;
  for (int mi : msgs) {
    const Message& m = ctx_.plan.sends[mi];
    for (size_t i = 0; i < m.ops.size(); ++i) {
      if (bindings.SourceOf(m, static_cast<int>(i)).mem != MemKind::kHost) {
        return UnimplementedError(
            RankName(ctx_.rank) + ": block-FP8 bytes to sync rank " + std::to_string(m.dst) +
            " would take the host path, which packs host memory; device shards need a prepared "
            "pair (cuda_ipc, the GPUs of one node)");
      }
    }
    if (!ctx_.tx.PeerCaps(m.dst).two_sided) {
      return UnimplementedError(RankName(ctx_.rank) + ": block-FP8 bytes to sync rank " +
                                std::to_string(m.dst) + " need two-sided messages, which " +
                                ctx_.tx.PeerTransport(m.dst) + " does not offer");
    }
  }
  // The amax exchange reads the rows this rank holds of every shared block: from host memory,
  // or from device memory with the packer's kernel.
  amax_ = {};
  device_amax_.clear();
  band_on_device_.clear();
  for (const AmaxBand& b : ctx_.plan.amax_bands) {
    const std::string& name = ctx_.inventory.at(b.tensor).name;
    if (!bindings.has_source(b.tensor)) {
      return NotFoundError(RankName(ctx_.rank) + ": source tensor '" + name +
                           "' shares block-FP8 blocks with other trainer ranks but was not bound");
    }
    const SourceBinding& sb = bindings.source(b.tensor);
    const int64_t cols = ctx_.inventory.at(b.tensor).shape[1];
    const Region own = Region::Make({b.own0, 0}, {b.own_rows, cols});
    const bool device = sb.mem != MemKind::kHost;
    if (!RegionContains(sb.region, own) || (device && !ctx_.packer->Supports(sb.mem))) {
      return UnimplementedError(
          RankName(ctx_.rank) + ": rows " + own.ToString() + " of '" + name +
          "' share 128-row blocks with other trainer ranks; their amax exchange reads memory "
          "holding those rows, host memory or device memory with a device packer (bound: " +
          sb.region.ToString() + " in " + (device ? "device" : "host") + " memory, packer " +
          std::string(ctx_.packer->name()) + ")");
    }
    if (device) {
      // The bound shard is row-major with its region's extents; `own` starts at its column 0.
      const int64_t stride = sb.region.extent[1];
      const int64_t at = (b.own0 - sb.region.offset[0]) * stride - sb.region.offset[1];
      device_amax_.push_back({static_cast<const unsigned char*>(sb.data) + at * DTypeSize(sb.dtype),
                              sb.dtype, stride, b.own_rows, cols, b.slot});
    }
    band_on_device_.push_back(device);
    amax_.slot.emplace(std::make_pair(b.tensor, b.row0), b.slot);
  }
  amax_.scales.assign(static_cast<size_t>(ctx_.plan.amax_blocks), 0.f);
  return OkStatus();
}

Status Fp8Codec::NonFinite(const AmaxBand& b, bool mine) const {
  const HfTensor& t = ctx_.inventory.at(b.tensor);
  return DataLossError(RankName(ctx_.rank) + ": non-finite values (NaN or Inf) in rows " +
                       Region::Make({b.row0, 0}, {b.rows, t.shape[1]}).ToString() + " of '" +
                       t.name + "'" +
                       (mine ? " (this rank's rows)" : " (another trainer rank's rows)") +
                       ", a block shared by trainer ranks: block FP8 cannot represent them, so "
                       "nothing of this sync is reported good and the engine ranks stay "
                       "poisoned");
}

Status Fp8Codec::Exchange(SyncGuard& guard) {
  const RankPlan& plan = ctx_.plan;
  if (plan.amax_bands.empty()) return OkStatus();
  // This rank's partials: per band, the max magnitude bits of its rows per 128-column block
  // (device rows by the packer's kernel, which zeroes the entries of host rows).
  std::vector<uint32_t> own(static_cast<size_t>(plan.amax_blocks), 0);
  if (!device_amax_.empty()) {
    Fp8Kernels* kernels = KernelsOf<Fp8Kernels>(*ctx_.packer);
    if (kernels == nullptr) {
      return UnimplementedError("packer " + std::string(ctx_.packer->name()) +
                                " does not take partial amaxes of device memory");
    }
    SS_RETURN_IF_ERROR(kernels->PartialAmax(device_amax_, own.data(), plan.amax_blocks));
  }
  for (size_t bi = 0; bi < plan.amax_bands.size(); ++bi) {
    if (band_on_device_[bi]) continue;
    const AmaxBand& b = plan.amax_bands[bi];
    const SourceBinding& sb = bindings_->source(b.tensor);
    const int64_t cols = ctx_.inventory.at(b.tensor).shape[1];
    const Region rel =
        Region::Make({b.own0 - sb.region.offset[0], -sb.region.offset[1]}, {b.own_rows, cols});
    SS_RETURN_IF_ERROR(
        Fp8PartialAmax({sb.data, sb.dtype, sb.region.extents(), rel, 0}, own.data() + b.slot));
  }
  auto key = [&](int rank) { return ctx_.Key(guard.VKey("amax/") + std::to_string(rank) + "#"); };
  // The previous version's value: every holder read it before posting its verdict of that
  // version, so only a failed sync's laggards (which fail anyway) could still want it. Dropped
  // here so the store holds one value per holder, not one per version until rank 0's sweep.
  if (amax_posted_ > 0) {
    std::string old = "v";  // piece by piece: GCC 12 -Wrestrict false positive on "v" + ...
    old += std::to_string(amax_posted_);
    old += "/amax/";
    old += std::to_string(ctx_.rank);
    old += '#';
    ctx_.store.DeletePrefix(ctx_.Key(old)).status().IgnoreError();
  }
  std::string value(own.size() * 4, '\0');
  std::memcpy(value.data(), own.data(), value.size());
  SS_RETURN_IF_ERROR(ctx_.store.Set(key(ctx_.rank), value));
  amax_posted_ = guard.version();
  for (const AmaxBand& b : plan.amax_bands) {
    for (int64_t i = 0; i < b.blocks; ++i) {
      if (!Fp8AmaxBitsFinite(own[b.slot + i])) return NonFinite(b, true);
    }
  }
  std::vector<std::string> keys;
  for (int32_t p : plan.amax_peers) keys.push_back(key(p));
  auto got = guard.GetManyUntil(
      keys, guard.deadline(),
      [&](size_t i) {
        return "sync rank " + std::to_string(plan.amax_peers[i]) +
               "'s partial amaxes of block-FP8 blocks it shares with this rank (version " +
               std::to_string(guard.version()) + ")";
      },
      /*watch_abort=*/true);
  if (!got.ok()) {
    // A holder that found a non-finite value posted its partials before failing the sync: every
    // holder names the tensor, not only the abort it caused.
    if (got.status().code() != StatusCode::kAborted) return got.status();
    auto late = ctx_.store.GetMany(keys, Millis(0));
    if (!late.ok()) return got.status();
    Status combined = Combine(own, *late);
    return combined.code() == StatusCode::kDataLoss ? combined : got.status();
  }
  SS_RETURN_IF_ERROR(Combine(own, *got));
  // Prepared pairs' amax ops read the scales from device memory at their launch.
  return UploadAmaxScales(amax_.scales);
}

Status Fp8Codec::Combine(const std::vector<uint32_t>& own, const std::vector<std::string>& got) {
  const RankPlan& plan = ctx_.plan;
  std::map<int32_t, const std::string*> by_rank;
  for (size_t i = 0; i < got.size() && i < plan.amax_peers.size(); ++i) {
    by_rank[plan.amax_peers[i]] = &got[i];
  }
  for (const AmaxBand& b : plan.amax_bands) {
    for (int64_t i = 0; i < b.blocks; ++i) {
      uint32_t m = own[b.slot + i];
      for (const AmaxHolder& h : b.others) {
        const std::string& v = *by_rank.at(h.rank);
        const auto at = static_cast<size_t>((h.slot + i) * 4);
        if (v.size() % 4 != 0 || at + 4 > v.size()) {
          return InternalError(RankName(ctx_.rank) + ": sync rank " + std::to_string(h.rank) +
                               " posted " + std::to_string(v.size()) +
                               " bytes of partial amaxes, fewer than its plan's");
        }
        uint32_t x;
        std::memcpy(&x, v.data() + at, 4);
        m = std::max(m, x);
      }
      if (!Fp8AmaxBitsFinite(m)) return NonFinite(b, false);
      amax_.scales[b.slot + i] = Fp8BlockScale(Fp8BitsFloat(m));
    }
  }
  return OkStatus();
}

Result<std::shared_ptr<unsigned char>> Fp8Codec::AllocSlot(size_t bytes) {
  // Packed on the CPU from host sources (PrepareSend): host memory.
  return std::shared_ptr<unsigned char>(new unsigned char[bytes],
                                        std::default_delete<unsigned char[]>());
}

Result<uint64_t> Fp8Codec::Pack(const Message& m, const Bucket& b, unsigned char* out) {
  SS_ASSIGN_OR_RETURN(Fp8Packed p, PackFp8Bucket(ctx_, *bindings_, m, b, out, &amax_));
  if (p.nonfinite > 0) {
    const TransferOp& op = m.ops[p.first_bad_op];
    return DataLossError(RankName(ctx_.rank) + ": " + std::to_string(p.nonfinite) +
                         " non-finite values (NaN or Inf) in '" +
                         ctx_.inventory.at(op.tensor).name + "' " + op.src.ToString() +
                         " (first op) for sync rank " + std::to_string(m.dst) +
                         ": block FP8 cannot represent them, so nothing of this sync is reported "
                         "good and the engine ranks stay poisoned");
  }
  return p.checksum;
}

}  // namespace shardsync::sync_internal
