#include "sync/internal.h"
namespace shardsync {
Status RunBenchRank(const JobSpec&, int, const SyncRank&, StoreClient&, Transport&, RankResult&,
                    const ProgressFn&) {
  return UnimplementedError("bench mode");
}
}  // namespace shardsync
