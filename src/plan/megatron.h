// Megatron-Core trainer internals: layout parsing, the sizes Megatron derives from a model, the
// per-stage parameter generator the trainer map and the planner share, and who holds each piece.
// Every rule cites the Megatron-Core file and function it comes from (docs/megatron.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "plan/planner.h"

namespace shardsync::plan_internal {

// The value after "megatron=": comma-separated key=value fields; errors name the field.
Result<MegatronLayout> ParseMegatronLayout(std::string_view s);

// Sizes Megatron derives from the model and layout, after every divisibility it asserts.
struct MegatronDims {
  int64_t padded_vocab = 0, vocab_per_rank = 0;
  int64_t heads_per_group = 0;   // np / ng
  int64_t group_rows = 0;        // (np/ng + 2) * hn: one query group of linear_qkv
  int64_t qkv_rows = 0;          // ng * group_rows: the whole (unsplit) linear_qkv
  int64_t qkv_per_rank = 0;      // qkv_rows / tp
  int64_t proj_cols = 0;         // np * hn / tp: linear_proj input columns per rank
  int64_t ffn_per_rank = 0;      // intermediate_size / tp
  int64_t experts_per_rank = 0;  // num_experts / ep
  int64_t moe_ffn_per_rank = 0;  // moe_intermediate_size / etp
};
Result<MegatronDims> ComputeMegatronDims(const ModelSpec& m, const MegatronLayout& l);

// Who holds the bytes of a piece, as a function of the rank's coordinates.
enum class HoldKind : uint8_t {
  kTpSplit,     // dense grid, one tp rank: holders are its cp x dp ranks of the stage
  kReplicated,  // dense, same on every tp rank: every rank of the stage
  kExpert,      // expert grid, one (ep, etp): holders are its edp ranks of the stage
};

// The local parameters of one pipeline stage (every chunk) for the given tp / ep / etp ranks;
// kinds[i][j] says who holds params[i].pieces[j]. The parameter list (names, shapes, order) is
// the same for every rank of the stage: only the pieces depend on the coordinates.
struct StageParams {
  std::vector<TrainerParam> params;
  std::vector<std::vector<HoldKind>> kinds;
};
Result<StageParams> BuildStageParams(const ModelSpec& m, const MegatronLayout& l,
                                     const MegatronDims& d, int pp, int tp, int ep, int etp,
                                     DType dtype);

// Holders of one piece: pipeline stage, kind and the coordinates the kind fixes.
struct HolderSet {
  int pp = 0;
  HoldKind kind = HoldKind::kReplicated;
  int tp = 0;           // kTpSplit
  int ep = 0, etp = 0;  // kExpert
};
int64_t HolderCount(const MegatronLayout& l, const HolderSet& h);
// The k-th holder (ascending global rank), k in [0, HolderCount).
int HolderRank(const MegatronLayout& l, const HolderSet& h, int64_t k);
// Index of `rank` among the holders, or -1 when it does not hold the piece.
int64_t HolderIndex(const MegatronLayout& l, const HolderSet& h, int rank);

// The trainer side of a Megatron layout as HF boxes: every HF tensor partitioned into sources
// (one HF box held the same way by a set of ranks, possibly in several places: the tied
// embedding's two copies). Shared by the bf16 planner and the block-FP8 planner.
struct MegatronPlace {
  HolderSet holders;
  int64_t count = 0;  // HolderCount
  int32_t param = 0;  // index into the stage's parameters (BuildTrainerParams order)
  Region local;       // the source's box inside that parameter
};
// Holder k of the places [begin, end) (their holder sets in order): (trainer rank, place index),
// or (-1, -1) past the last.
std::pair<int, int32_t> HolderAmong(const MegatronLayout& l,
                                    const std::vector<MegatronPlace>& places, int32_t begin,
                                    int32_t end, int64_t k);
// Where a holder keeps `src` (a box inside the source box `hf`) in its local parameters: `place`'s
// parameter, at `src` moved from `hf` to the place's box.
LocalSource LocalSourceOf(const Region& hf, const MegatronPlace& place, const Region& src);
struct MegatronSource {
  int32_t tensor = 0;
  Region hf;
  int32_t place_begin = 0, place_end = 0;  // into MegatronSources::places
  int64_t holders = 0;                     // sum of its places' counts
};
struct MegatronSources {
  std::vector<MegatronPlace> places;
  std::vector<MegatronSource> sources;  // by tensor, then HF box
  std::vector<int32_t> tensor_begin;    // inventory size + 1: the sources of tensor t
  // Holder k of source s (k in [0, s.holders)): its trainer rank and place index, places in
  // order, each place's holders by ascending rank.
  std::pair<int, int32_t> Holder(const MegatronLayout& l, const MegatronSource& s, int64_t k) const;
};
// Checked to partition every HF tensor of `inv` exactly (InternalError otherwise).
Result<MegatronSources> BuildMegatronSources(const ModelSpec& m, const MegatronLayout& l,
                                             const MegatronDims& d,
                                             const std::vector<HfTensor>& inv);

// The copy codec's planner of a Megatron trainer layout over a PlanContext: the walk's units
// (engine pieces x the context's trainer sources) are its items, and the demand on a source
// (every replica's items, replica-major, in engine order) is cut into equal byte segments at unit
// boundaries, one per holder, as the HSDP planner does per dim-0 chunk.
class MegatronPlanner {
 public:
  static Result<std::shared_ptr<const MegatronPlanner>> Build(const PlanContext& c);
  Result<RankPlan> PlanForRank(int sync_rank, const std::string& hash) const;
  void ForEachPair(const PairFn& fn) const;

 private:
  using Placement = MegatronPlace;
  struct Source {
    int32_t tensor = 0;
    Region hf;
    int32_t place_begin = 0, place_end = 0;  // into places_
    int32_t item_begin = 0, item_end = 0;    // into source_items_
    int32_t cut_begin = 0;                   // into cuts_: holders + 1 values
    int64_t holders = 0;
    int64_t total = 0;  // bytes of its items in one replica
  };
  struct MItem {
    Item geo;
    int32_t erank = 0, param = 0, tensor = 0, source = 0;
    int64_t src_off = 0;  // offset inside its source's per-replica byte sequence
  };

  // The holder of segment k of source s: (trainer rank, placement index).
  std::pair<int, int32_t> Holder(const Source& s, int64_t k) const;
  // Ops of item `i` for the byte range [y0, y1) served from placement `p`, appended to out->ops
  // with where the sender holds each (out->local).
  void EmitRange(int32_t i, int64_t y0, int64_t y1, const Placement& p, Message* out) const;

  PlanInputs in_;
  MegatronLayout layout_;
  int S_ = 1, E_ = 1, D_ = 1;
  int64_t wire_ = 2, cap_ = 0;
  std::vector<Placement> places_;
  std::vector<Source> sources_;
  std::vector<MItem> items_;           // engine order: erank, piece, source
  std::vector<int32_t> erank_begin_;   // size E + 1, into items_
  std::vector<int32_t> source_items_;  // item indices grouped by source, engine order within
  std::vector<int64_t> cuts_;          // per source: holders + 1 global byte positions
};

}  // namespace shardsync::plan_internal
