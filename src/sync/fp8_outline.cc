#include "sync/fp8_outline.h"

#include "sync/bindings.h"

namespace shardsync::sync_internal {

DType BlockQuantizeBoundDType(const EngineParam& p, DType wire) { return Fp8DestDType(p, wire); }

Status CheckBlockQuantizeBindings(const SessionContext& ctx, const Bindings& bindings) {
  const RankPlan& plan = ctx.plan;
  const std::string me = RankName(ctx.rank);
  if (bindings.megatron_sender()) {
    for (const Message& m : plan.sends) {
      if (m.local.size() != m.ops.size()) {
        return InternalError("plan message to sync rank " + std::to_string(m.dst) + ": " +
                             std::to_string(m.ops.size()) + " ops but " +
                             std::to_string(m.local.size()) + " local sources");
      }
      for (size_t i = 0; i < m.ops.size(); ++i) {
        SS_RETURN_IF_ERROR(bindings.CheckLocalSource(m.local[i], m.ops[i].src, m.dst));
      }
    }
    return OkStatus();
  }
  if (ctx.who.is_trainer) {
    for (const Message& m : plan.sends) {
      for (const TransferOp& op : m.ops) {
        const std::string& name = ctx.inventory.at(op.tensor).name;
        if (!bindings.has_source(op.tensor)) {
          return NotFoundError(me + ": source tensor '" + name +
                               "' is sent by the plan but was not bound");
        }
        const SourceBinding& b = bindings.source(op.tensor);
        if (!RegionContains(b.region, op.src)) {
          return InvalidArgumentError("source binding '" + name + "': plan reads " +
                                      op.src.ToString() + " outside the bound region " +
                                      b.region.ToString());
        }
      }
    }
    return OkStatus();
  }
  const std::vector<DestBinding>& dests = bindings.dests();
  for (size_t i = 0; i < dests.size(); ++i) {
    if (dests[i].data == nullptr) {
      return NotFoundError(me + ": engine parameter '" + bindings.expected()[i].name +
                           "' (tp=" + std::to_string(ctx.who.tp_rank) +
                           " pp=" + std::to_string(ctx.who.pp_rank) + ") was not bound");
    }
  }
  auto inside = [&](int32_t param, const Region& r) {
    return param >= 0 && static_cast<size_t>(param) < dests.size() &&
           RegionInside(r, dests[param].shape);
  };
  for (const Message& m : plan.recvs) {
    for (const TransferOp& op : m.ops) {
      bool ok = false;
      switch (op.encoding) {
        case Encoding::kCopy:
          ok = inside(op.param, op.dst);
          break;
        case Encoding::kQuantize:
          ok = inside(op.param, op.dst) && inside(op.scale_param, op.scale_dst) &&
               dests[op.param].dtype == DType::kF8E4M3 &&
               dests[op.scale_param].dtype == DType::kF32;
          break;
        case Encoding::kAmax:
          ok = inside(op.param, op.dst) && dests[op.param].dtype == DType::kF8E4M3 &&
               (op.scale_param < 0 || (inside(op.scale_param, op.scale_dst) &&
                                       dests[op.scale_param].dtype == DType::kF32));
          break;
        case Encoding::kStage:
          if (op.stage >= 0 && static_cast<size_t>(op.stage) < plan.staged.size()) {
            const StagedBand& b = plan.staged[op.stage];
            ok = RegionInside(op.dst, {b.src.extent[0], b.src.extent[1]}) &&
                 inside(b.param, b.dst) && inside(b.scale_param, b.scale_dst);
          }
          break;
      }
      if (!ok) {
        return InternalError("plan op (" + std::string(EncodingName(op.encoding)) +
                             ") from sync rank " + std::to_string(m.src) +
                             " lands outside parameter index " + std::to_string(op.param));
      }
    }
  }
  return OkStatus();
}

Fp8StageTarget Fp8StageTargetOf(const TransferOp& op) {
  // A stage op covers whole rows of its band (ValidatePlan): dst = [r0, r1) x [0, cols).
  Fp8StageTarget t;
  t.offset = op.staging_offset;
  t.shape = {op.dst.offset[0] + op.dst.extent[0], op.dst.extent[1]};
  t.dst = op.dst;
  return t;
}

std::vector<Fp8BandTask> Fp8BandTasks(const RankPlan& plan, const std::vector<DestBinding>& dests,
                                      const unsigned char* staging) {
  std::vector<Fp8BandTask> tasks;
  tasks.reserve(plan.staged.size());
  for (const StagedBand& b : plan.staged) {
    const DestBinding& w = dests[b.param];
    const DestBinding& s = dests[b.scale_param];
    Fp8BandTask t;
    t.src = staging + b.staging_offset;
    t.dtype = b.dtype;
    t.rows = b.src.extent[0];
    t.cols = b.src.extent[1];
    t.weight = static_cast<uint8_t*>(w.data) + RegionStartElement(b.dst, w.shape);
    t.weight_stride = w.shape.back();
    t.scales = static_cast<float*>(s.data) + RegionStartElement(b.scale_dst, s.shape);
    t.scale_stride = s.shape.back();
    tasks.push_back(t);
  }
  return tasks;
}

Status Fp8BandsStatus(int rank, const RankPlan& plan, const std::vector<DestBinding>& dests,
                      const std::vector<int64_t>& bad) {
  int64_t total = 0, bands = 0;
  size_t first = bad.size();
  for (size_t i = 0; i < bad.size(); ++i) {
    if (bad[i] <= 0) continue;
    total += bad[i];
    ++bands;
    if (first == bad.size()) first = i;
  }
  if (total == 0) return OkStatus();
  const StagedBand& b = plan.staged.at(first);
  return DataLossError(
      RankName(rank) + ": " + std::to_string(total) + " non-finite values (NaN or Inf) in " +
      std::to_string(bands) + " staged bands, first in rows " + b.src.ToString() + " of '" +
      dests.at(b.param).name + "': block FP8 cannot represent them; the rank stays poisoned");
}

}  // namespace shardsync::sync_internal
