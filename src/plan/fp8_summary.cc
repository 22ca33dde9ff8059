// The block-FP8 plan's summary (fp8_plan.h). The planning itself is fp8_planner.cc.
#include <fmt/format.h>

#include <algorithm>

#include "plan/fp8_planner.h"
#include "plan/planner.h"
#include "shardsync/fp8.h"

namespace shardsync {

namespace {}  // namespace

Result<PlanSummary> plan_internal::SummarizeFp8(const PlanContext& c) {
  SS_ASSIGN_OR_RETURN(auto ctx, plan_internal::Fp8Context::Build(c));
  const PlanInputs& in = c.inputs();
  PlanSummary sum;
  sum.plan_hash = ctx.hash();
  const int S = ctx.trainer_world(), E = ctx.engine_per_replica(), D = ctx.replicas();
  sum.trainer_ranks.resize(S);
  for (int t = 0; t < S; ++t) sum.trainer_ranks[t].rank = t;
  std::vector<char> read(ctx.inventory().size(), 0);
  for (int j = 0; j < D * E; ++j) {
    SS_ASSIGN_OR_RETURN(RankPlan rp, ctx.PlanForRank(S + j));
    EngineRankSummary er;
    er.replica = j / E;
    er.pp_rank = (j % E) / in.rollout.shard.tp;
    er.tp_rank = j % in.rollout.shard.tp;
    for (const EngineParam& p : ctx.map().ranks[j % E].params) {
      int64_t n = p.numel();
      for (const ZeroFill& z : p.zero_fills) n -= z.dst.numel();
      er.owned_bytes += n * DTypeSize(p.dtype);
    }
    for (const Message& m : rp.recvs) {
      ++sum.messages;
      sum.ops += static_cast<int64_t>(m.ops.size());
      er.recv_bytes += m.bytes;
      sum.trainer_ranks[m.src].send_bytes += m.bytes;
      for (const TransferOp& op : m.ops) {
        read[op.tensor] = 1;
        switch (op.encoding) {
          case Encoding::kCopy:
            sum.copy_bytes += op.bytes;
            break;
          case Encoding::kQuantize:
            sum.quantize_bytes += op.bytes;
            sum.sender_quantized_elements += op.dst.numel();
            break;
          case Encoding::kStage:
            sum.stage_bytes += op.bytes;
            break;
          case Encoding::kAmax:
            sum.amax_bytes += op.bytes;
            sum.amax_elements += op.dst.numel();
            break;
        }
      }
    }
    for (const StagedBand& b : rp.staged) sum.receiver_quantized_elements += b.dst.numel();
    sum.staged_bands += static_cast<int64_t>(rp.staged.size());
    sum.max_staging_bytes = std::max(sum.max_staging_bytes, rp.staging_bytes);
    sum.total_bytes += er.recv_bytes;
    sum.bound_write_bytes += er.owned_bytes;
    sum.engine_ranks.push_back(er);
  }
  // The exchange: every holder of a straddling band (in every replica group) writes its value
  // once and reads each of its peers' values once per sync.
  if (!ctx.amax_bands().empty()) {
    const int S1 = in.trainer.shards_per_group(), R = in.trainer.groups();
    std::vector<int64_t> blocks;
    std::vector<std::vector<char>> peers(S1, std::vector<char>(S1, 0));
    ctx.AmaxLayout(0, nullptr, &blocks, &peers, 0);
    sum.amax_bands = static_cast<int64_t>(ctx.amax_bands().size());
    for (const auto& [tensor, row0] : ctx.amax_bands()) {
      sum.amax_blocks += CeilDiv(ctx.inventory()[tensor].shape[1], kFp8Block);
    }
    for (int k = 0; k < S1; ++k) {
      sum.exchange_write_bytes += R * blocks[k] * 4;
      for (int j = 0; j < S1; ++j) {
        if (peers[k][j]) sum.exchange_read_bytes += R * blocks[j] * 4;
      }
    }
  }
  // Broadcast-all sends every full HF tensor in the wire dtype, as for a bf16 plan.
  for (const HfTensor& t : ctx.inventory()) {
    sum.broadcast_recv_bytes_per_rank += t.numel() * ctx.wire_size();
  }
  const int64_t tsize = DTypeSize(in.trainer_dtype);
  for (size_t i = 0; i < read.size(); ++i) {
    if (read[i]) sum.bound_read_bytes += ctx.inventory()[i].numel() * tsize;
  }
  return sum;
}

}  // namespace shardsync
