// Prepared pairs of block-FP8 plans (pairs.h PrepareFp8).
#include "sync/fp8_outline.h"
#include "sync/pairs.h"

namespace shardsync::sync_internal {

Status PreparedPairs::PrepareFp8(const Bindings& bindings, PeerShapes& shapes,
                                 const std::map<int, uint32_t>& regbase,
                                 Clock::time_point deadline) {
  (void)shapes;
  (void)regbase;
  (void)deadline;
  const Fp8RankPlan& plan = *ctx_.fp8;
  const int mem = bindings.BoundMem();
  send_.resize(plan.sends.size());
  recv_.resize(plan.recvs.size());
  for (const Fp8Message& m : plan.sends) {
    if (Prepared(m.dst, mem)) {
      return UnimplementedError(RankName(ctx_.rank) + ": block-FP8 pairs over " +
                                ctx_.tx.PeerTransport(m.dst) + " are not built yet");
    }
  }
  for (const Fp8Message& m : plan.recvs) {
    if (Prepared(m.src, mem)) {
      return UnimplementedError(RankName(ctx_.rank) + ": block-FP8 pairs over " +
                                ctx_.tx.PeerTransport(m.src) + " are not built yet");
    }
  }
  return OkStatus();
}

}  // namespace shardsync::sync_internal
