// Planner internals: a PlanContext built once from the inputs (shard map of one replica flattened
// into pieces, trainer geometry), and the per-rank / job-wide computations over it. Split from the
// public API so tests can plan over hand-built shard maps.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "plan/codec.h"
#include "shardsync/plan.h"

namespace shardsync::plan_internal {

// Bound on any rank count, so a typo cannot make the planner allocate gigabytes.
inline constexpr int64_t kMaxRanks = int64_t{1} << 20;

// One engine piece of one replica, with what the planner needs precomputed.
struct FlatPiece {
  int32_t erank = 0;      // engine rank inside the replica: pp*T + tp
  int32_t param = 0;      // index into that rank's params
  int32_t tensor = 0;     // index into the HF inventory
  int32_t shape = 0;      // index into PlanContext::param_shapes
  int32_t dst_dim0 = -1;  // dst dim aligned with src dim 0 (-1: src dim 0 is a leading unit dim)
  Region src, dst;
  int64_t row_elems = 0;   // src elements per src dim-0 index
  int64_t c0 = 0, c1 = 0;  // first and last trainer chunk (dim-0 shard) the piece overlaps
};

// One unit of the walk (PlanContext::ForEachUnit): engine piece `piece` (PlanContext::pieces) x
// one trainer source box of its tensor. Its codec turns it into ops.
struct PlanUnit {
  int32_t piece = 0;
  int64_t chunk = -1;   // FSDP-like: the dim-0 chunk (trainer shard position) holding src
  int32_t source = -1;  // Megatron: index into PlanContext::megatron_sources()->sources
  Region src, dst;      // the piece's part inside that box
};

// A piece restricted to one trainer chunk, with its dst split geometry.
struct Item {
  Region src, dst;
  int run_dim = 0;         // dims [0, run_dim) of dst are iterated to form contiguous runs
  int64_t runs = 1;        // number of contiguous dst runs
  int64_t run_bytes = 0;   // wire bytes per run
  int unit_dim = 0;        // first dim of a run box with extent > 1 (cuts happen along it)
  int64_t unit_bytes = 0;  // wire bytes of one index of unit_dim
  int64_t bytes() const { return runs * run_bytes; }
};

// Holder sequence of one dim-0 position s when R > 1 does not divide D: every (replica, item)
// needing chunk s, replica-major then (erank, param, piece) order, is one byte sequence cut into
// R byte-balanced segments at unit boundaries; segment g is served by trainer rank g*S + s. Only
// per-erank prefix sums and the cuts are stored (computed by difference arrays over chunks), never
// the items: an item's offset inside its erank is found by scanning that erank's pieces.
struct Sequence {
  std::vector<int64_t> erank_offset;  // size E + 1: replica-local byte offset of each erank
  std::vector<int64_t> erank_ops;     // size E + 1: prefix of uncut op counts
  std::vector<int64_t> cuts;          // size R + 1, global (replica-major) byte coordinates
  int64_t total() const { return erank_offset.back(); }
};

// Bytes and uncut ops of a piece's items: [0] its first chunk, [1] any interior chunk, [2] its
// last chunk (interior chunks are all full, so all alike).
struct PieceStats {
  int64_t bytes[3] = {0, 0, 0};
  int64_t ops[3] = {0, 0, 0};
};

// Called for each (trainer rank, engine sync rank) pair with traffic.
using PairFn = std::function<void(int trainer, int engine_sync_rank, int64_t bytes, int64_t ops)>;

class MegatronPlanner;   // megatron_plan.cc: the copy codec's planner for Megatron trainer layouts
struct MegatronSources;  // megatron.h: a Megatron trainer's HF boxes and their holders

// The checks of the inputs themselves (layouts, dtypes, the codec's bucket cap) that Build runs
// before planning; ValidatePlanInputs adds the shard map's.
Status CheckPlanOptions(const PlanInputs& in);

// What every codec plans over: the inputs, one replica's shard map flattened into pieces (the
// codec's parameters, coalesced when it says so), the trainer geometry and the walk. The copy
// codec's own tables (byte-balanced cuts, the Megatron planner) are built by its Prepare.
class PlanContext {
 public:
  // `map` is one replica's shard map for in.rollout.shard; `inventory` the model's HF tensors.
  static Result<PlanContext> Build(const PlanInputs& in, ShardMap map,
                                   std::vector<HfTensor> inventory);

  // The walk: every unit of engine rank `e` of a replica (its pieces in order, each x the
  // trainer source boxes of its tensor in order: FSDP-like dim-0 chunks ascending, Megatron
  // sources by HF box).
  void ForEachUnit(int e, const std::function<void(const PlanUnit&)>& fn) const;
  const PlanCodec& codec() const { return *codec_; }

  // The copy codec's plan, summary and pairs (planner.cc, summary.cc); Unimplemented for a
  // context of another codec.
  Result<RankPlan> PlanForRank(int sync_rank) const;
  Result<DetailedSummary> Summarize(const SummaryOptions& opts) const;
  // Every (trainer, engine) pair with its bytes and ops, analytically.
  void ForEachPair(const PairFn& fn) const;
  // The copy codec's tables (CopyCodec().Prepare).
  Status PrepareCopy();

  const PlanInputs& inputs() const { return in_; }
  const ShardMap& map() const { return map_; }
  const std::vector<HfTensor>& inventory() const { return inv_; }
  const std::string& hash() const { return hash_; }
  int trainer_world() const { return S_world_; }
  int engine_per_replica() const { return E_; }
  int replicas() const { return D_; }
  const std::vector<FlatPiece>& pieces() const { return pieces_; }
  const std::vector<Shape>& param_shapes() const { return param_shapes_; }
  int groups() const { return R_; }            // R: trainer replica groups (FSDP-like)
  int shards() const { return S_; }            // S: dim-0 chunks per group
  int64_t wire_size() const { return wire_; }  // bytes of the wire dtype
  // Dim-0 rows per trainer chunk of HF tensor `tensor` (torch.chunk sizes).
  int64_t chunk_rows(int32_t tensor) const { return tensor_chunk_[tensor]; }
  // Megatron trainer layouts: the HF boxes each rank holds and where (null otherwise).
  const MegatronSources* megatron_sources() const { return sources_.get(); }
  // Set for Megatron trainer layouts once the copy codec prepared: it plans every rank; the
  // dim-0 chunk machinery is unused.
  const MegatronPlanner* megatron() const { return megatron_.get(); }

 private:
  // Unimplemented: this context's codec is not the copy codec.
  Status NotCopyPlan() const;
  // The rows of piece `p` inside dim-0 chunk `chunk` (src, and dst along src dim 0).
  void ChunkPart(const FlatPiece& p, int64_t chunk, Region* src, Region* dst) const;
  Item MakeItem(const FlatPiece& p, int64_t chunk) const;
  int64_t ItemOps(const Item& it) const;
  int64_t ItemRangeOps(const Item& it, int64_t y0, int64_t y1) const;
  void EmitItemRange(const FlatPiece& p, const Item& it, int64_t y0, int64_t y1,
                     std::vector<TransferOp>* out) const;
  void BuildSequences();
  // Difference arrays of bytes and ops per (engine rank of a replica, trainer chunk), row stride
  // S + 1, not yet prefix-summed.
  void ChunkDifferences(std::vector<int64_t>* db, std::vector<int64_t>* dops) const;
  int Which(const FlatPiece& p, int64_t chunk) const {
    return chunk == p.c0 ? 0 : chunk == p.c1 ? 2 : 1;
  }
  int64_t BytesAt(int32_t pi, int64_t chunk) const {
    const FlatPiece& p = pieces_[pi];
    return chunk < p.c0 || chunk > p.c1 ? 0 : stats_[pi].bytes[Which(p, chunk)];
  }
  // Calls fn(piece, erank-local offset) for the items of erank e at chunk s overlapping the
  // erank-local byte range [y0, y1), in order.
  void ForItemsInRange(int e, int s, int64_t y0, int64_t y1,
                       const std::function<void(int32_t, int64_t)>& fn) const;
  // Ops of the erank-local byte range [y0, y1) of erank e at chunk s.
  int64_t CountRangeOps(int e, int s, int64_t y0, int64_t y1) const;

  PlanInputs in_;
  const PlanCodec* codec_ = nullptr;
  bool copy_ = false;  // the copy codec prepared its tables
  ShardMap map_;
  std::vector<HfTensor> inv_;
  std::string hash_;
  int S_world_ = 1, R_ = 1, S_ = 1, D_ = 1, E_ = 1;
  int64_t wire_ = 2;
  std::vector<FlatPiece> pieces_;
  std::vector<int32_t> erank_begin_;  // size E + 1
  std::vector<Shape> param_shapes_;
  std::vector<int64_t> tensor_chunk_;  // per tensor: dim-0 rows per trainer shard
  // D % R == 0: group g serves whole replicas [g*D/R, (g+1)*D/R) (what the byte-balanced cut
  // gives in that case), computed without sequences.
  bool whole_replicas_ = true;
  std::vector<Sequence> seqs_;     // per position s, only when R does not divide D
  std::vector<PieceStats> stats_;  // per flat piece
  std::shared_ptr<const MegatronSources> sources_;
  std::shared_ptr<const MegatronPlanner> megatron_;
};

// Builds the context for `in` (shard map and inventory from the model).
Result<PlanContext> MakeContext(const PlanInputs& in);
// Enumerates every rank's plan and checks it element by element (small jobs only).
Status ValidateContext(const PlanContext& ctx);
// A message's buckets cut its ops in order, each at its wire offset with the ops' bytes, none
// over `cap` unless it holds a single op (validate.cc; the copy and block FP8 validators).
Status CheckBucketsCoverOps(const Message& m, int64_t cap);

// ---- geometry.cc: shared by every trainer layout ----

// Maps a sub-box `x` of `dst` to the matching sub-box of `src` (dims aligned from the right; extra
// leading dims have extent 1), and back.
Region MapToSrc(const Region& src, const Region& dst, const Region& x);
Region MapToDst(const Region& src, const Region& dst, const Region& x);
// True when src and dst are the same box up to leading unit dims (right-aligned).
bool Aligned(const Region& src, const Region& dst);
// Fills an item's split geometry (runs, units) from its dst box in a parameter of `shape`.
void SetItemGeometry(Item* it, const Shape& shape, int64_t wire);
// Ops of a whole item / of the item's byte range [y0, y1) (unit aligned).
int64_t ItemOpCount(const Item& it, int64_t wire, int64_t cap);
int64_t ItemRangeOpCount(const Item& it, int64_t y0, int64_t y1, int64_t wire, int64_t cap);
// Calls fn(src box, dst box) for each op of the item's byte range [y0, y1), in order.
void ForItemRangeOps(const Item& it, int64_t y0, int64_t y1, int64_t wire, int64_t cap,
                     const std::function<void(const Region& src, const Region& dst)>& fn);
// The item-local byte offset y rounded up to the next unit boundary (the cut points).
int64_t RoundUpToUnit(const Item& it, int64_t y);
// Wire offsets and buckets of a message whose ops are in order.
template <typename M>  // Message, Message: ops with `bytes` and `wire_offset`, buckets
void FinishMessage(M* m, int64_t cap) {
  int64_t off = 0;
  Bucket cur;
  for (size_t i = 0; i < m->ops.size(); ++i) {
    auto& op = m->ops[i];
    if (cur.op_end > cur.op_begin && cur.bytes + op.bytes > cap) {
      m->buckets.push_back(cur);
      cur = Bucket{};
      cur.op_begin = static_cast<int32_t>(i);
      cur.wire_offset = off;
    }
    op.wire_offset = off;
    off += op.bytes;
    cur.bytes += op.bytes;
    cur.op_end = static_cast<int32_t>(i + 1);
  }
  if (cur.op_end > cur.op_begin) m->buckets.push_back(cur);
  m->bytes = off;
}

// Split of a contiguous dst box into parts of at most `cap` bytes (along its first dim with
// extent > 1, recursing into the next dim when one index is already over the cap).
int64_t SplitCount(const Region& box, int64_t elem_bytes, int64_t cap);
void SplitBox(const Region& box, int64_t elem_bytes, int64_t cap,
              const std::function<void(const Region&)>& fn);

// Min, mean and max of f(x) over v (per-rank bytes, ops, messages): the plan reports' statistics.
struct MinMeanMax {
  int64_t min = 0, max = 0;
  double mean = 0;
};
template <typename V, typename F>
MinMeanMax Stats(const V& v, F f) {
  MinMeanMax s;
  if (v.empty()) return s;
  s.min = s.max = f(v[0]);
  double sum = 0;
  for (const auto& x : v) {
    const int64_t b = f(x);
    s.min = std::min(s.min, b);
    s.max = std::max(s.max, b);
    sum += static_cast<double>(b);
  }
  s.mean = sum / static_cast<double>(v.size());
  return s;
}

}  // namespace shardsync::plan_internal
