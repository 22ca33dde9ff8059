// ValidateShardMap (exact cover by region algebra) and ExplainParam.
#include <fmt/format.h>

#include <algorithm>
#include <unordered_map>

#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

// Extents with leading 1s dropped: a [1, r, c] box and an [r, c] box describe the same bytes.
std::vector<int64_t> Squeezed(const Region& r) {
  std::vector<int64_t> e = r.extents();
  size_t i = 0;
  while (i + 1 < e.size() && e[i] == 1) ++i;
  return {e.begin() + static_cast<std::ptrdiff_t>(i), e.end()};
}

bool ShapeOk(const Shape& s) {
  if (s.empty() || s.size() > static_cast<size_t>(kMaxDims)) return false;
  int64_t n = 1;
  for (int64_t d : s) {
    if (d <= 0 || __builtin_mul_overflow(n, d, &n)) return false;
  }
  return true;
}

// Pieces and zero-fills of one parameter must tile it: every box inside, pairwise disjoint, and
// volumes summing to the parameter's element count. Sorting by the first offset lets each box be
// compared only with the boxes that start before it ends along dimension 0.
Status CheckCover(const EngineParam& p, std::vector<Region> boxes) {
  const Shape& shape = p.shape;
  int64_t volume = 0;
  for (const Region& b : boxes) {
    if (!RegionInside(b, shape)) {
      return OutOfRangeError(fmt::format("region {} lies outside the parameter's shape {}",
                                         b.ToString(), ShapeToString(shape)));
    }
    if (b.empty()) return InvalidArgumentError(fmt::format("empty region {}", b.ToString()));
    if (__builtin_add_overflow(volume, b.numel(), &volume)) {
      return InvalidArgumentError("covered volume overflows int64");
    }
  }
  std::sort(boxes.begin(), boxes.end(),
            [](const Region& a, const Region& b) { return a.offset[0] < b.offset[0]; });
  for (size_t i = 0; i < boxes.size(); ++i) {
    const int64_t end0 = boxes[i].offset[0] + boxes[i].extent[0];
    for (size_t j = i + 1; j < boxes.size() && boxes[j].offset[0] < end0; ++j) {
      if (!Intersect(boxes[i], boxes[j]).empty()) {
        return InvalidArgumentError(
            fmt::format("regions {} and {} overlap", boxes[i].ToString(), boxes[j].ToString()));
      }
    }
  }
  if (volume != NumElements(shape)) {
    return InvalidArgumentError(fmt::format("pieces and zero-fills cover {} of {} elements (a gap)",
                                            volume, NumElements(shape)));
  }
  return OkStatus();
}

std::string RankName(const EngineRankShards& r) {
  return fmt::format("rank (tp {}, pp {})", r.tp_rank, r.pp_rank);
}

}  // namespace

Status ValidateShardMap(const ShardMap& map) {
  // Pieces name the checkpoint the engine loads: FP8 weights and their scales when quantized.
  const auto inventory = HfCheckpointInventory(map.model);
  std::unordered_map<std::string_view, const HfTensor*> by_name;
  by_name.reserve(inventory.size());
  for (const auto& t : inventory) by_name.emplace(t.name, &t);
  const size_t expected = static_cast<size_t>(map.spec.tp) * static_cast<size_t>(map.spec.pp);
  if (map.spec.tp <= 0 || map.spec.pp <= 0 || map.ranks.size() != expected) {
    return InvalidArgumentError(fmt::format("shard map has {} ranks, tp {} x pp {} expected",
                                            map.ranks.size(), map.spec.tp, map.spec.pp));
  }
  for (size_t i = 0; i < map.ranks.size(); ++i) {
    const EngineRankShards& rank = map.ranks[i];
    if (static_cast<size_t>(rank.pp_rank) * map.spec.tp + rank.tp_rank != i || rank.tp_rank < 0 ||
        rank.tp_rank >= map.spec.tp) {
      return InvalidArgumentError(
          fmt::format("{} is stored at index {}, expected pp * tp + tp_rank", RankName(rank), i));
    }
    // Stages tile [0, num_hidden_layers) in order; every TP rank of a stage agrees.
    const int64_t want_start = rank.tp_rank > 0   ? map.ranks[i - 1].layer_start
                               : rank.pp_rank > 0 ? map.ranks[i - 1].layer_end
                                                  : 0;
    const int64_t want_end = rank.tp_rank > 0 ? map.ranks[i - 1].layer_end : rank.layer_end;
    if (rank.layer_start != want_start || rank.layer_end != want_end ||
        rank.layer_end < rank.layer_start || rank.layer_end > map.model.num_hidden_layers ||
        (rank.pp_rank == map.spec.pp - 1 && rank.layer_end != map.model.num_hidden_layers)) {
      return InvalidArgumentError(fmt::format(
          "{}: layers [{}, {}) do not continue the stages before it (expected start {}) or leave "
          "layers of [0, {}) unowned",
          RankName(rank), rank.layer_start, rank.layer_end, want_start,
          map.model.num_hidden_layers));
    }
    std::unordered_map<std::string_view, int> seen;
    for (const EngineParam& p : rank.params) {
      if (!seen.emplace(p.name, 0).second) {
        return InvalidArgumentError(
            fmt::format("{}: param {} appears twice", RankName(rank), p.name));
      }
      if (auto l = LayerIndexOf(p.name); l && (*l < rank.layer_start || *l >= rank.layer_end)) {
        return InvalidArgumentError(
            fmt::format("{}: param {} belongs to layer {}, outside the "
                        "stage's layers [{}, {})",
                        RankName(rank), p.name, *l, rank.layer_start, rank.layer_end));
      }
    }
    for (const EngineParam& p : rank.params) {
      auto fail = [&](const Status& st) {
        return Status(st.code(),
                      fmt::format("{}: param {}: {}", RankName(rank), p.name, st.message()));
      };
      if (!ShapeOk(p.shape)) {
        return fail(InvalidArgumentError(fmt::format("bad shape {}", ShapeToString(p.shape))));
      }
      std::vector<Region> boxes;
      boxes.reserve(p.pieces.size() + p.zero_fills.size());
      for (const Piece& pc : p.pieces) {
        auto it = by_name.find(pc.source);
        if (it == by_name.end()) {
          return fail(NotFoundError(
              fmt::format("source '{}' is not an HF tensor of the model", pc.source)));
        }
        const HfTensor& src = *it->second;
        if (!RegionInside(pc.src, src.shape)) {
          return fail(
              OutOfRangeError(fmt::format("source region {} of {} lies outside its shape {}",
                                          pc.src.ToString(), pc.source, ShapeToString(src.shape))));
        }
        if (pc.dst.ndim != static_cast<int>(p.shape.size())) {
          return fail(InvalidArgumentError(
              fmt::format("piece from {}: dst region {} has rank {}, the parameter {}", pc.source,
                          pc.dst.ToString(), pc.dst.ndim, p.shape.size())));
        }
        if (pc.src.numel() != pc.dst.numel() || Squeezed(pc.src) != Squeezed(pc.dst)) {
          return fail(InvalidArgumentError(
              fmt::format("piece from {}: source region {} and dst region {} differ in extent",
                          pc.source, pc.src.ToString(), pc.dst.ToString())));
        }
        boxes.push_back(pc.dst);
      }
      for (const ZeroFill& z : p.zero_fills) {
        if (z.dst.ndim != static_cast<int>(p.shape.size())) {
          return fail(InvalidArgumentError(
              fmt::format("zero-fill region {} has the wrong rank", z.dst.ToString())));
        }
        boxes.push_back(z.dst);
      }
      Status st = CheckCover(p, std::move(boxes));
      if (!st.ok()) return fail(st);
    }
  }
  return OkStatus();
}

Result<std::string> ExplainParam(const ShardMap& map, const EngineRankShards& rank,
                                 std::string_view name) {
  const EngineParam* p = FindParam(rank, name);
  if (p == nullptr) {
    return NotFoundError(fmt::format("{} (layers [{}, {})) has no parameter '{}'", RankName(rank),
                                     rank.layer_start, rank.layer_end, name));
  }
  const int64_t esize = DTypeSize(p->dtype);
  std::string out = fmt::format(
      "{} {}: {} {} {}, {} elements, {} bytes", EngineKindName(map.spec.engine), RankName(rank),
      p->name, ShapeToString(p->shape), DTypeTorchName(p->dtype), p->numel(), p->bytes());
  if (map.model.is_moe()) {
    out += fmt::format(" (moe_ep_rank {}, moe_tp_rank {})", rank.moe_ep_rank, rank.moe_tp_rank);
  }
  out += "\n";
  for (const Piece& pc : p->pieces) {
    out += fmt::format("  {} <- {}{} ({} elements, {} bytes)\n", pc.dst.ToString(), pc.source,
                       pc.src.ToString(), pc.dst.numel(), pc.dst.numel() * esize);
  }
  for (const ZeroFill& z : p->zero_fills) {
    out += fmt::format("  {} <- zeros (vocab padding rows, {} elements, {} bytes)\n",
                       z.dst.ToString(), z.dst.numel(), z.dst.numel() * esize);
  }
  return out;
}

}  // namespace shardsync
