// Block FP8's codec on Megatron trainers (fp8_planner.cc says how it cuts the walk's units): the
// check that every trainer source sits on the 128 grid of a quantized engine piece, the cut of a
// unit (engine piece x source) among the source's holders, and which holder serves a unit.
#include <fmt/format.h>

#include <algorithm>

#include "plan/fp8_planner.h"
#include "plan/megatron.h"
#include "plan/planner.h"
#include "shardsync/fp8.h"

namespace shardsync::plan_internal {

// Megatron's splits are whole 128 x 128 blocks per holder for the usual models (head_dim 128 makes
// each head a band of 128 rows of linear_qkv; per-rank fc1 / fc2 / proj widths are multiples of
// 128), so a holder quantizes its blocks on the fly. A source box that ends inside a block of a
// quantized engine piece (head_dim 64, ffn / tp off the grid) would need the block's amax from two
// Megatron ranks: refused here, naming the tensor, its rows and columns, and the rank.
Status Fp8Context::CheckMegatronGrid() const {
  const PlanInputs& in = inputs();
  const MegatronLayout& l = in.trainer.megatron;
  Status bad = OkStatus();
  for (int e = 0; e < engine_per_replica() && bad.ok(); ++e) {
    const EngineRankShards& rk = map().ranks[e];
    c_->ForEachUnit(e, [&](const PlanUnit& u) {
      const FlatPiece& pc = c_->pieces()[u.piece];
      const EngineParam& p = rk.params[pc.param];
      if (!bad.ok() || p.dtype != DType::kF8E4M3) return;
      const HfTensor& t = inventory()[pc.tensor];
      const Region& x = u.src;
      bool on_grid = x.ndim == 2;
      for (int i = 0; i < x.ndim && on_grid; ++i) {
        const int64_t end = x.offset[i] + x.extent[i];
        on_grid = x.offset[i] % B == 0 && (end % B == 0 || end == t.shape[i]);
      }
      if (on_grid) return;
      const MegatronSource& s = mg_->sources[u.source];
      const auto [rank, place] = mg_->Holder(l, s, 0);
      const MegatronPlace& pl = mg_->places[place];
      std::string local = "?";
      auto held = BuildTrainerParams(in.model, in.trainer, rank, in.trainer_dtype);
      if (held.ok() && pl.param < static_cast<int32_t>(held->params.size())) {
        const TrainerParam& tp = held->params[pl.param];
        local = fmt::format("'{}' (chunk {}) {}", tp.name, tp.chunk, pl.local.ToString());
      }
      bad = InvalidArgumentError(fmt::format(
          "--trainer {}: Megatron rank {}{} holds rows [{}, {}) x cols [{}, {}) of '{}' in "
          "local parameter {}, which cuts 128 x 128 blocks of engine "
          "parameter '{}' on {} rank (tp {}, pp {}): block-FP8 weights are quantized by the "
          "one Megatron rank holding a whole block, and blocks shared by Megatron ranks are "
          "not staged; choose a Megatron tp / etp whose shards fall on the 128 grid",
          in.trainer.ToString(), rank,
          s.holders > 1 ? fmt::format(" (one of {} ranks holding it)", s.holders) : "", x.offset[0],
          x.offset[0] + x.extent[0], x.ndim > 1 ? x.offset[1] : 0,
          x.ndim > 1 ? x.offset[1] + x.extent[1] : 1, t.name, local, p.name,
          EngineKindName(in.rollout.shard.engine), rk.tp_rank, rk.pp_rank));
    });
  }
  return bad;
}

std::pair<int, int32_t> Fp8Context::SenderOf(const Fp8Unit& u, int e, int d) const {
  if (mg_) {
    // Round-robin over the source's holders (DP / CP replicas of the rank), as for HSDP groups.
    const MegatronSource& s = mg_->sources[u.source];
    return mg_->Holder(inputs().trainer.megatron, s, (u.index + e + d) % s.holders);
  }
  const int R = c_->groups(), S = c_->shards();
  const int g = R == 1 ? 0 : static_cast<int>((u.index + e + d) % R);
  return {g * S + static_cast<int>(u.chunk), -1};
}

// A Megatron unit: an engine piece x one trainer source (on the block grid: CheckMegatronGrid).
// Where the source has several holders (DP / CP replicas; every tp rank for replicated norms) the
// box is cut along dim 0 (on band boundaries when quantized) into up to `holders` units, so the
// replicas share the work.
void Fp8Context::CutSourceUnit(int e, const PlanUnit& pu, WalkState* st,
                               const std::function<void(const Fp8Unit&)>& fn) const {
  const FlatPiece& pc = c_->pieces()[pu.piece];
  const int32_t pi = pc.param;
  const bool quant = map().ranks[e].params[pi].dtype == DType::kF8E4M3;
  const MegatronSource& s = mg_->sources[pu.source];
  const Region& x = pu.src;
  const int64_t unit = quant ? B : 1;
  const int64_t n = CeilDiv(x.extent[0], unit);
  const int64_t parts = std::min<int64_t>(std::max<int64_t>(s.holders, 1), n);
  const int64_t end = x.offset[0] + x.extent[0];
  for (int64_t k = 0; k < parts; ++k) {
    const int64_t r0 = x.offset[0] + n * k / parts * unit;
    const int64_t r1 = std::min(end, x.offset[0] + n * (k + 1) / parts * unit);
    Fp8Unit u;
    u.encoding = quant ? Encoding::kQuantize : Encoding::kCopy;
    u.tensor = pc.tensor;
    u.param = pi;
    u.scale_param = quant ? scale_of_[e][pi] : -1;
    u.src = x;
    u.src.offset[0] = r0;
    u.src.extent[0] = r1 - r0;
    u.dst = MapToDst(pc.src, pc.dst, u.src);
    if (quant) u.scale_dst = BlockRegion(u.dst);
    u.source = pu.source;
    u.index = st->counter[pu.source]++;
    fn(u);
  }
}

}  // namespace shardsync::plan_internal
