// Prepared pairs of block-FP8 plans (pairs.h PrepareFp8): each bucket's copy ops as copy regions
// at offsets of a compact image of the copies (and their offsets in the whole image, for nccl,
// which sends the image: cuda/nccl/fp8_rounds.h), its quantize ops as PairBucket::quantize with
// separate e4m3 and scale destinations (the peer's parameters; no wire buffer), so a transport
// that quantizes (cuda_ipc) packs, quantizes and checksums straight into the receiver. Stage ops
// (bands whose rows straddle trainer ranks) as PairBucket::stage: raw trainer values, no cast, at
// offsets of a compact image of the stage ops, into the receiver's device staging (AllocStaging),
// which the receiver quantizes once every checksum of the sync verified (QuantizeStaged). Amax
// ops (rows of blocks shared with other trainer ranks) as PairBucket::quantize with the block
// row's agreed scales given: device memory of the sender (AllocAmaxScales) that the amax exchange
// (fp8_codec.h Exchange) fills before the pair launches.
#include <cstdlib>
#include <string_view>

#include "shardsync/fp8.h"
#include "sync/fp8_outline.h"
#include "sync/pairs.h"

namespace shardsync::sync_internal {
namespace {

// A receiver without device staging (its parameters are not in device memory) cannot take stage ops
// over a prepared pair, nor a sender send them; nor can a two-sided pair (nccl), whose sender has
// no access to the receiver's staging: refused naming the parameter (or tensor) and `why`, before
// any pair is prepared.
Status RefuseStaged(const SessionContext& ctx, const Bindings& bindings, const Message& m, int peer,
                    const std::string& why) {
  for (const TransferOp& op : m.ops) {
    if (op.encoding != Encoding::kStage) continue;
    const std::string name =
        ctx.who.is_trainer ? ctx.inventory.at(op.tensor).name : bindings.dest(op.param).name;
    return UnimplementedError(RankName(ctx.rank) + ": rows " + op.src.ToString() + " of '" + name +
                              "' share 128-row blocks with another trainer rank's rows (FSDP "
                              "chunks off the 128 grid), over a device pair with sync rank " +
                              std::to_string(peer) + "; " + why);
  }
  return OkStatus();
}
constexpr char kStagedNoStaging[] = "prepared pairs stage such rows only into device memory";
// Stage ops are written straight into the receiver's staging (one-sided, cuda_ipc); a two-sided
// pair (nccl) has no receiver-side scatter for them.
std::string StagedTwoSided(const SessionContext& ctx, int peer) {
  return "staged rows cross only one-sided pairs (cuda_ipc: the GPUs of one node, its default "
         "route), not this pair's " +
         ctx.tx.PeerTransport(peer) +
         ": use an FSDP size whose chunks fall on the 128 grid (`shardsync plan` shows the staged "
         "bands), cuda_ipc for this pair, or host memory";
}

// Blocks whose amax the trainer ranks exchange (kAmax) are quantized by the host path and by
// one-sided pairs (cuda_ipc), whose sender writes the receiver's parameters: a two-sided pair
// (nccl) carrying one is refused at Connect on both ends, naming the tensor and the ways out.
Status RefuseAmax(const SessionContext& ctx, const Bindings& bindings, const Message& m, int peer) {
  for (const TransferOp& op : m.ops) {
    if (op.encoding != Encoding::kAmax) continue;
    const std::string name =
        ctx.who.is_trainer ? ctx.inventory.at(op.tensor).name : bindings.dest(op.param).name;
    return UnimplementedError(RankName(ctx.rank) + ": rows " + op.src.ToString() + " of '" + name +
                              "' share 128-row blocks with another trainer rank's rows (FSDP "
                              "chunks off the 128 grid), over a device pair with sync rank " +
                              std::to_string(peer) + "; " + kFp8AmaxOnDevice);
  }
  return OkStatus();
}

}  // namespace

Result<const MemRegion*> PreparedPairs::AllocStaging(const Bindings& bindings) {
  bindings_ = &bindings;
  if (!ctx_.quantized() || ctx_.who.is_trainer || ctx_.plan.staging_bytes <= 0 ||
      bindings.BoundMem() != static_cast<int>(MemKind::kCuda) || bindings.dests().empty()) {
    return static_cast<const MemRegion*>(nullptr);
  }
  const RankPlan& plan = ctx_.plan;
  const auto bytes = static_cast<size_t>(plan.staging_bytes);
  auto buf = ctx_.packer->AllocStaging(bytes);
  if (!buf.ok()) {
    Status e = buf.status();
    return e.Annotate(RankName(ctx_.rank) + ": block-FP8 staging of " + std::to_string(bytes) +
                      " bytes for " + std::to_string(plan.staged.size()) +
                      " bands straddling trainer ranks");
  }
  staging_ = std::move(buf).value();
  staging_region_ = {staging_.get(), bytes, MemKind::kCuda, bindings.dests()[0].device};
  bands_ = Fp8BandTasks(plan, bindings.dests(), staging_.get());
  return &staging_region_;
}

Status PreparedPairs::QuantizeStaged() {
  if (bands_.empty()) return OkStatus();
  SS_ASSIGN_OR_RETURN(std::vector<int64_t> bad, ctx_.packer->QuantizeBands(bands_));
  if (bad.size() != bands_.size()) {
    return InternalError(RankName(ctx_.rank) + ": packer " + std::string(ctx_.packer->name()) +
                         " quantized " + std::to_string(bad.size()) + " of " +
                         std::to_string(bands_.size()) + " staged bands");
  }
  return Fp8BandsStatus(ctx_.rank, ctx_.plan, bindings_->dests(), bad);
}

Status PreparedPairs::AllocAmaxScales(const Bindings& bindings) {
  const RankPlan& plan = ctx_.plan;
  amax_slot_.clear();
  amax_scales_ = nullptr;
  if (!ctx_.who.is_trainer || plan.amax_blocks <= 0) return OkStatus();
  const int mem = bindings.BoundMem();
  bool any = false;
  for (const Message& m : plan.sends) {
    if (!Prepared(m.dst, mem)) continue;
    for (const TransferOp& op : m.ops) any = any || op.encoding == Encoding::kAmax;
  }
  if (!any) return OkStatus();
  const auto bytes = static_cast<size_t>(plan.amax_blocks) * sizeof(float);
  auto buf = ctx_.packer->AllocStaging(bytes);
  if (!buf.ok()) {
    Status e = buf.status();
    return e.Annotate(RankName(ctx_.rank) + ": the agreed scales of " +
                      std::to_string(plan.amax_blocks) +
                      " block-FP8 blocks shared with other trainer ranks, in device memory");
  }
  amax_buf_ = std::move(buf).value();
  amax_scales_ = reinterpret_cast<float*>(amax_buf_.get());
  for (const AmaxBand& b : plan.amax_bands)
    amax_slot_.emplace(std::make_pair(b.tensor, b.row0), b.slot);
  return OkStatus();
}

Status PreparedPairs::UploadAmaxScales(const std::vector<float>& scales) {
  if (!amax_scales_) return OkStatus();
  if (static_cast<int64_t>(scales.size()) != ctx_.plan.amax_blocks) {
    return InternalError(RankName(ctx_.rank) + ": " + std::to_string(scales.size()) +
                         " agreed block scales for " + std::to_string(ctx_.plan.amax_blocks) +
                         " shared blocks");
  }
  Status s = ctx_.packer->Upload(amax_scales_, scales.data(), scales.size() * sizeof(float));
  if (!s.ok()) {
    s.Annotate(RankName(ctx_.rank) +
               ": the agreed scales of block-FP8 blocks shared with other trainer ranks, to the "
               "device");
  }
  return s;
}

Status PreparedPairs::RefuseUnbuiltFp8(const Bindings& bindings) const {
  const RankPlan& plan = ctx_.plan;
  const int mem = bindings.BoundMem();
  for (const Message& m : plan.recvs) {
    if (Prepared(m.src, mem) && !ctx_.tx.PeerCaps(m.src).one_sided_put) {
      SS_RETURN_IF_ERROR(RefuseAmax(ctx_, bindings, m, m.src));
    }
  }
  for (const Message& m : plan.sends) {
    if (Prepared(m.dst, mem) && !ctx_.tx.PeerCaps(m.dst).one_sided_put) {
      SS_RETURN_IF_ERROR(RefuseAmax(ctx_, bindings, m, m.dst));
    }
  }
  for (const Message& m : plan.recvs) {
    if (!Prepared(m.src, mem)) continue;
    if (!ctx_.tx.PeerCaps(m.src).one_sided_put) {
      SS_RETURN_IF_ERROR(RefuseStaged(ctx_, bindings, m, m.src, StagedTwoSided(ctx_, m.src)));
    }
    if (!staging_) SS_RETURN_IF_ERROR(RefuseStaged(ctx_, bindings, m, m.src, kStagedNoStaging));
  }
  for (const Message& m : plan.sends) {
    if (Prepared(m.dst, mem) && !ctx_.tx.PeerCaps(m.dst).one_sided_put) {
      SS_RETURN_IF_ERROR(RefuseStaged(ctx_, bindings, m, m.dst, StagedTwoSided(ctx_, m.dst)));
    }
  }
  return OkStatus();
}

PairBucket PreparedPairs::Fp8RecvBucket(const Bindings& bindings, const Message& m,
                                        const Bucket& b) const {
  const DType td = ctx_.in.trainer_dtype;
  const int ws = DTypeSize(ctx_.in.options.wire_dtype);
  PairBucket pb;
  pb.bytes = b.bytes;
  int64_t at = 0, staged = 0;  // compact copy image, compact stage image
  for (int32_t i = b.op_begin; i < b.op_end; ++i) {
    const TransferOp& op = m.ops[i];
    if (op.encoding == Encoding::kStage) {
      const StagedBand& band = ctx_.plan.staged.at(op.stage);
      const Shape shape{band.src.extent[0], band.src.extent[1]};
      pb.stage.push_back({{staging_.get() + band.staging_offset, td, shape, op.dst, staged}, {}});
      staged += op.dst.numel() * DTypeSize(td);
      continue;
    }
    const DestBinding& d = bindings.dest(op.param);
    if (op.encoding == Encoding::kCopy) {
      pb.local.push_back({d.data, d.dtype, d.shape, op.dst, at});
      pb.wire_offsets.push_back(op.wire_offset - b.wire_offset);
      at += op.dst.numel() * ws;
      continue;
    }
    QuantizeRegion q;
    q.landed_weight = {d.data, d.dtype, d.shape, op.dst, op.wire_offset - b.wire_offset};
    // An amax op of a holder that is not the band's first sends e4m3 rows only.
    q.with_scales = op.scale_param >= 0;
    if (q.with_scales) {
      const DestBinding& s = bindings.dest(op.scale_param);
      q.landed_scales = {s.data, s.dtype, s.shape, op.scale_dst, 0};
    }
    pb.quantize.push_back(std::move(q));
  }
  return pb;
}

PairBucket PreparedPairs::Fp8SendBucket(const Bindings& bindings, PeerShapes& shapes,
                                        const Message& m, const Bucket& b, uint32_t base) const {
  const DType td = ctx_.in.trainer_dtype;
  const int ws = DTypeSize(ctx_.in.options.wire_dtype);
  PairBucket pb;
  pb.bytes = b.bytes;
  int64_t at = 0, staged = 0;
  for (int32_t i = b.op_begin; i < b.op_end; ++i) {
    const TransferOp& op = m.ops[i];
    // The HF shard, or a Megatron sender's local parameter (Message::local).
    const Bindings::OpSource os = bindings.SourceOf(m, i);
    const PackRegion src{os.data, td, os.shape, os.region, 0};
    if (op.encoding == Encoding::kStage) {
      // The receiver's staging is its region after its parameters (RegisterParams).
      const Fp8StageTarget t = Fp8StageTargetOf(op);
      StageRegion sr{src,
                     {base + static_cast<uint32_t>(shapes.Count(m.dst)),
                      static_cast<uint64_t>(t.offset), t.shape, t.dst}};
      sr.local.wire_offset = staged;
      pb.stage.push_back(std::move(sr));
      staged += op.src.numel() * DTypeSize(td);
      continue;
    }
    const RemoteRegion dst{base + static_cast<uint32_t>(op.param), 0, shapes.Get(m.dst, op.param),
                           op.dst};
    if (op.encoding == Encoding::kCopy) {
      pb.local.push_back(src);
      pb.local.back().wire_offset = at;
      pb.wire_offsets.push_back(op.wire_offset - b.wire_offset);
      pb.remote.push_back(dst);
      at += op.dst.numel() * ws;
      continue;
    }
    QuantizeRegion q;
    q.src = src;
    q.src.wire_offset = op.wire_offset - b.wire_offset;
    q.weight = dst;
    if (op.encoding == Encoding::kAmax) {
      // The agreed scales of the op's column blocks: its band's slot in this rank's value (the
      // band is rows [src row / 128 * 128, + 128)), as the host path reads them (fp8_host_pack.cc).
      const auto slot = amax_slot_.at({op.tensor, op.src.offset[0] / kFp8Block * kFp8Block});
      q.given_scales = amax_scales_ + slot + op.src.offset[1] / kFp8Block;
      q.with_scales = op.scale_param >= 0;
    }
    if (q.with_scales) {
      q.scales = {base + static_cast<uint32_t>(op.scale_param), 0,
                  shapes.Get(m.dst, op.scale_param), op.scale_dst};
    }
    pb.quantize.push_back(std::move(q));
  }
  return pb;
}

Status PreparedPairs::PrepareFp8(const Bindings& bindings, PeerShapes& shapes,
                                 const std::map<int, uint32_t>& regbase,
                                 Clock::time_point deadline) {
  const RankPlan& plan = ctx_.plan;
  const DType wire = ctx_.in.options.wire_dtype;
  const int mem = bindings.BoundMem();
  send_.resize(plan.sends.size());
  recv_.resize(plan.recvs.size());
  auto left = [&] {
    return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now()));
  };
  // Refused before any pair is prepared, so no peer waits for this rank's maps.
  SS_RETURN_IF_ERROR(RefuseUnbuiltFp8(bindings));
  SS_RETURN_IF_ERROR(AllocAmaxScales(bindings));
  for (size_t mi = 0; mi < plan.recvs.size(); ++mi) {
    const Message& m = plan.recvs[mi];
    if (!Prepared(m.src, mem)) continue;
    PairSpec spec{m.src, /*send=*/false, wire, {}, PairKey(m.src, ctx_.rank)};
    spec.fp8 = true;
    for (const Bucket& b : m.buckets) spec.buckets.push_back(Fp8RecvBucket(bindings, m, b));
    SS_ASSIGN_OR_RETURN(recv_[mi], ctx_.tx.Prepare(ctx_.store, spec, left()));
  }
  for (size_t mi = 0; mi < plan.sends.size(); ++mi) {
    const Message& m = plan.sends[mi];
    if (!Prepared(m.dst, mem)) continue;
    PairSpec spec{m.dst, /*send=*/true, wire, {}, PairKey(ctx_.rank, m.dst)};
    spec.fp8 = true;
    const uint32_t base = regbase.at(m.dst);
    for (const Bucket& b : m.buckets) {
      spec.buckets.push_back(Fp8SendBucket(bindings, shapes, m, b, base));
    }
    SS_ASSIGN_OR_RETURN(send_[mi], ctx_.tx.Prepare(ctx_.store, spec, left()));
  }
  return OkStatus();
}

}  // namespace shardsync::sync_internal
