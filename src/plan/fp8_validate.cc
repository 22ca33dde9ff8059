// ValidatePlan of a block-FP8 plan (plan_internal::ValidateFp8): enumerates every rank's FP8 plan
// of a small job and checks it element by element against the shard map (which bytes of which HF
// tensor, and which HF scale blocks, land where), independently of the planner's walk.
#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "plan/fp8_planner.h"
#include "plan/planner.h"
#include "shardsync/fp8.h"

namespace shardsync {
namespace {

using plan_internal::MapToDst;
using plan_internal::MapToSrc;

using plan_internal::Fp8Context;

constexpr int64_t kMaxValidateElements = int64_t{1} << 26;
constexpr int64_t B = kFp8Block;

Region BlockRegion(const Region& r) {
  Region b = r;
  for (int i = r.ndim - 2; i < r.ndim; ++i) {
    b.offset[i] = r.offset[i] / B;
    b.extent[i] = (r.offset[i] + r.extent[i] + B - 1) / B - b.offset[i];
  }
  return b;
}

bool SameOp(const TransferOp& a, const TransferOp& b) {
  return a.encoding == b.encoding && a.tensor == b.tensor && a.param == b.param &&
         a.scale_param == b.scale_param && a.stage == b.stage &&
         a.staging_offset == b.staging_offset && a.src == b.src && a.dst == b.dst &&
         a.scale_dst == b.scale_dst && a.wire_offset == b.wire_offset && a.bytes == b.bytes;
}

Status CheckMessageShape(const Message& m, int64_t cap) {
  int64_t off = 0;
  for (size_t i = 0; i < m.ops.size(); ++i) {
    const TransferOp& op = m.ops[i];
    if (op.wire_offset != off || op.bytes <= 0 || op.bytes % 8 != 0 || op.bytes > cap) {
      return InternalError(fmt::format(
          "message {}->{}: op {} has wire offset {} / bytes {} (expected offset {}, a positive "
          "multiple of 8 within the cap {})",
          m.src, m.dst, i, op.wire_offset, op.bytes, off, cap));
    }
    off += op.bytes;
  }
  if (off != m.bytes) {
    return InternalError(
        fmt::format("message {}->{}: bytes {} != sum of ops {}", m.src, m.dst, m.bytes, off));
  }
  return plan_internal::CheckBucketsCoverOps(m, cap);
}

// The shard map's piece of `p` holding `dst`, checked to come from `source` at `src`.
Status CheckAgainstPieces(const EngineParam& p, const std::string& source, const Region& src,
                          const Region& dst, std::string_view what) {
  for (const Piece& pc : p.pieces) {
    if (pc.dst.ndim != dst.ndim || !RegionContains(pc.dst, dst)) continue;
    if (pc.source != source || MapToSrc(pc.src, pc.dst, dst) != src) {
      return InternalError(
          fmt::format("{}: '{}' {} carries '{}' {}, the shard map puts '{}' {} there", what, p.name,
                      dst.ToString(), source, src.ToString(), pc.source,
                      MapToSrc(pc.src, pc.dst, dst).ToString()));
    }
    return OkStatus();
  }
  return InternalError(fmt::format("{}: '{}' {} is not inside one piece of the shard map", what,
                                   p.name, dst.ToString()));
}

// A quantized region (kQuantize op or staged band): on the HF grid, its scale blocks, and the
// shard map's weight and scale pieces.
Status CheckQuantized(const Fp8Context& ctx, const EngineRankShards& rank, int32_t tensor,
                      int32_t param, int32_t scale_param, const Region& src, const Region& dst,
                      const Region& scale_dst, std::string_view what) {
  const HfTensor& t = ctx.inventory()[tensor];
  const auto& params = rank.params;
  if (param < 0 || param >= static_cast<int32_t>(params.size()) || scale_param < 0 ||
      scale_param >= static_cast<int32_t>(params.size())) {
    return InternalError(fmt::format("{}: parameter index out of range", what));
  }
  const EngineParam& p = params[param];
  const EngineParam& sp = params[scale_param];
  if (p.dtype != DType::kF8E4M3 || sp.dtype != DType::kF32 || sp.name != WeightScaleName(p.name)) {
    return InternalError(fmt::format("{}: '{}' / '{}' are not an e4m3 weight and its scales", what,
                                     p.name, sp.name));
  }
  if (src.ndim != 2 || src.numel() != dst.numel()) {
    return InternalError(
        fmt::format("{}: {} -> {} is not a matrix box", what, src.ToString(), dst.ToString()));
  }
  for (int i = 0; i < 2; ++i) {
    const int64_t end = src.offset[i] + src.extent[i];
    if (src.offset[i] % B != 0 || (end % B != 0 && end != t.shape[i])) {
      return InternalError(
          fmt::format("{}: {} of '{}' is off the 128 grid", what, src.ToString(), t.name));
    }
  }
  if (scale_dst != BlockRegion(dst)) {
    return InternalError(fmt::format("{}: scales {} are not the blocks of {}", what,
                                     scale_dst.ToString(), dst.ToString()));
  }
  SS_RETURN_IF_ERROR(CheckAgainstPieces(p, t.name, src, dst, what));
  return CheckAgainstPieces(sp, WeightScaleName(t.name), BlockRegion(src), scale_dst, what);
}

// A kAmax op: rows of one band (all of them when it sends the band's scales: then from its
// first row) x columns on the grid, into the e4m3 weight (and its scales) the shard map names.
Status CheckAmaxOp(const Fp8Context& ctx, const EngineRankShards& rank, const TransferOp& op,
                   std::string_view what) {
  const HfTensor& t = ctx.inventory()[op.tensor];
  const auto& params = rank.params;
  const int32_t np = static_cast<int32_t>(params.size());
  if (op.param < 0 || op.param >= np || op.scale_param >= np || op.src.ndim != 2 ||
      op.src.numel() != op.dst.numel() || params[op.param].dtype != DType::kF8E4M3) {
    return InternalError(fmt::format("{}: not rows of an e4m3 weight", what));
  }
  const int64_t r0 = op.src.offset[0], r1 = r0 + op.src.extent[0];
  const int64_t c0 = op.src.offset[1], c1 = c0 + op.src.extent[1];
  const bool scales = op.scale_param >= 0;
  if (r0 / B != (r1 - 1) / B || c0 % B != 0 || (c1 % B != 0 && c1 != t.shape[1]) ||
      (scales && r0 % B != 0) ||
      op.bytes != Fp8PartWireBytes(op.src.extent[0], op.src.extent[1], scales)) {
    return InternalError(
        fmt::format("{}: {} of '{}' ({} bytes) is not rows of one band on the "
                    "column grid",
                    what, op.src.ToString(), t.name, op.bytes));
  }
  SS_RETURN_IF_ERROR(CheckAgainstPieces(params[op.param], t.name, op.src, op.dst, what));
  if (!scales) return OkStatus();
  const EngineParam& sp = params[op.scale_param];
  if (sp.dtype != DType::kF32 || sp.name != WeightScaleName(params[op.param].name) ||
      op.scale_dst != BlockRegion(op.dst)) {
    return InternalError(fmt::format("{}: scales {} are not the blocks of {}", what,
                                     op.scale_dst.ToString(), op.dst.ToString()));
  }
  return CheckAgainstPieces(sp, WeightScaleName(t.name), BlockRegion(op.src), op.scale_dst, what);
}

// A trainer rank's exchanged bands: each a straddling band of 128 HF rows (or the tensor's
// last), the rows it holds (TrainerHeldRegion) as its own, its value's slots consecutive.
Status CheckAmaxBands(const PlanInputs& in, const Fp8Context& ctx, int t, const RankPlan& rp,
                      std::map<std::pair<int32_t, int64_t>, AmaxBand>* out) {
  const auto& inv = ctx.inventory();
  int64_t slot = 0;
  for (const AmaxBand& b : rp.amax_bands) {
    if (b.tensor < 0 || b.tensor >= static_cast<int32_t>(inv.size())) {
      return InternalError(
          fmt::format("trainer rank {}: exchanged band of tensor {}", t, b.tensor));
    }
    const Shape& shape = inv[b.tensor].shape;
    const Region held = TrainerHeldRegion(in.trainer, t, shape);
    const int64_t h0 = std::max(b.row0, held.offset[0]);
    const int64_t h1 = std::min(b.row0 + b.rows, held.offset[0] + held.extent[0]);
    if (b.row0 % B != 0 || b.rows != std::min(B, shape[0] - b.row0) || b.own0 != h0 ||
        b.own_rows != h1 - h0 || b.own_rows <= 0 || b.own_rows == b.rows || b.slot != slot ||
        b.blocks != (shape[1] + B - 1) / B || b.others.empty() ||
        !out->emplace(std::make_pair(b.tensor, b.row0), b).second) {
      return InternalError(
          fmt::format("trainer rank {}: exchanged band {} of '{}' (own rows {} + "
                      "{}, slot {}) does not fit what it holds",
                      t, b.row0, inv[b.tensor].name, b.own0, b.own_rows, b.slot));
    }
    slot += b.blocks;
  }
  if (slot != rp.amax_blocks) {
    return InternalError(fmt::format("trainer rank {}: {} exchanged blocks, the plan says {}", t,
                                     slot, rp.amax_blocks));
  }
  return OkStatus();
}

// Megatron senders: every op read from a local parameter of the sending rank, at the region one
// of its trainer-map pieces (BuildTrainerParams, independent of the planner's sources) puts the
// op's HF bytes.
Status CheckLocalSources(const TrainerRankParams& held, const Message& m,
                         const std::vector<HfTensor>& inv) {
  if (m.local.size() != m.ops.size()) {
    return InternalError(fmt::format("message {}->{}: {} ops but {} local sources", m.src, m.dst,
                                     m.ops.size(), m.local.size()));
  }
  for (size_t i = 0; i < m.ops.size(); ++i) {
    const TransferOp& op = m.ops[i];
    const LocalSource& ls = m.local[i];
    if (ls.param < 0 || ls.param >= static_cast<int32_t>(held.params.size())) {
      return InternalError(fmt::format("message {}->{} op {}: local parameter {} of {}", m.src,
                                       m.dst, i, ls.param, held.params.size()));
    }
    const TrainerParam& p = held.params[ls.param];
    bool found = false;
    for (const TrainerPiece& pc : p.pieces) {
      if (pc.source != inv[op.tensor].name || !RegionContains(pc.src, op.src)) continue;
      found = MapToDst(pc.src, pc.local, op.src) == ls.region;
      break;
    }
    if (!found) {
      return InternalError(fmt::format(
          "message {}->{} op {}: trainer rank {} reads {} of local parameter '{}' (chunk {}) for "
          "{} of '{}', which its trainer map does not put there",
          m.src, m.dst, i, held.rank, ls.region.ToString(), p.name, p.chunk, op.src.ToString(),
          inv[op.tensor].name));
    }
  }
  return OkStatus();
}

class Coverage {
 public:
  explicit Coverage(const EngineRankShards& rank) {
    counts_.resize(rank.params.size());
    for (size_t i = 0; i < rank.params.size(); ++i) {
      counts_[i].assign(static_cast<size_t>(rank.params[i].numel()), 0);
    }
  }
  void Add(const EngineRankShards& rank, int32_t param, const Region& r) {
    auto& c = counts_[param];
    ForEachRun(r, rank.params[param].shape, [&](int64_t off, int64_t len) {
      for (int64_t i = 0; i < len; ++i) {
        if (c[off + i] < 255) ++c[off + i];
      }
    });
  }
  Status Check(const EngineRankShards& rank, std::string_view who) const {
    for (size_t i = 0; i < counts_.size(); ++i) {
      for (size_t k = 0; k < counts_[i].size(); ++k) {
        if (counts_[i][k] != 1) {
          return InternalError(fmt::format("{}: element {} of '{}' is written {} times", who, k,
                                           rank.params[i].name, int{counts_[i][k]}));
        }
      }
    }
    return OkStatus();
  }

 private:
  std::vector<std::vector<uint8_t>> counts_;
};

}  // namespace

Status plan_internal::ValidateFp8(const PlanContext& c) {
  SS_ASSIGN_OR_RETURN(auto ctx, Fp8Context::Build(c));
  const PlanInputs& in = c.inputs();
  const ShardMap& map = ctx.map();
  const auto& inv = ctx.inventory();
  const int S = ctx.trainer_world(), E = ctx.engine_per_replica(), D = ctx.replicas();
  const int64_t cap = in.options.bucket_bytes;
  int64_t elems = 0;
  for (const auto& rk : map.ranks) {
    for (const auto& p : rk.params) elems += p.numel();
  }
  if (elems * D > kMaxValidateElements) {
    return FailedPreconditionError(
        fmt::format("validate: {} engine elements is too many to check one by one (limit {})",
                    elems * D, kMaxValidateElements));
  }
  std::map<std::pair<int, int>, Message> sent;
  // The amax exchange: per trainer rank, its bands (tensor, first row) -> the band.
  std::vector<std::map<std::pair<int32_t, int64_t>, AmaxBand>> amax(S);
  for (int t = 0; t < S; ++t) {
    SS_ASSIGN_OR_RETURN(RankPlan rp, ctx.PlanForRank(t));
    SS_RETURN_IF_ERROR(CheckAmaxBands(in, ctx, t, rp, &amax[t]));
    TrainerRankParams held_params;
    if (ctx.megatron()) {
      SS_ASSIGN_OR_RETURN(held_params,
                          BuildTrainerParams(in.model, in.trainer, t, in.trainer_dtype));
    }
    if (!rp.recvs.empty() || !rp.staged.empty()) {
      return InternalError(fmt::format("trainer rank {} receives", t));
    }
    for (const Message& m : rp.sends) {
      if (m.src != t || m.dst < S || m.dst >= S + D * E) {
        return InternalError(fmt::format("trainer rank {}: message {}->{}", t, m.src, m.dst));
      }
      SS_RETURN_IF_ERROR(CheckMessageShape(m, cap));
      if (ctx.megatron()) {
        SS_RETURN_IF_ERROR(CheckLocalSources(held_params, m, inv));
      } else if (!m.local.empty()) {
        return InternalError(fmt::format("trainer rank {}: local sources in an FSDP-like plan", t));
      }
      for (const TransferOp& op : m.ops) {
        if (ctx.megatron()) break;  // checked against the rank's local parameters above
        if (op.encoding == Encoding::kAmax) {
          // Its band's amax is among the partials this rank exchanges, over rows it holds.
          auto it = amax[t].find({op.tensor, op.src.offset[0] / B * B});
          if (it == amax[t].end() || op.src.offset[0] < it->second.own0 ||
              op.src.offset[0] + op.src.extent[0] > it->second.own0 + it->second.own_rows) {
            return InternalError(fmt::format(
                "trainer rank {} quantizes {} of '{}' without its band among its exchanged "
                "partials",
                t, op.src.ToString(), inv[op.tensor].name));
          }
        }
        const Region held = TrainerHeldRegion(in.trainer, t, inv[op.tensor].shape);
        if (!RegionContains(held, op.src)) {
          return InternalError(fmt::format("trainer rank {} sends {} of '{}' but holds {}", t,
                                           op.src.ToString(), inv[op.tensor].name,
                                           held.ToString()));
        }
      }
      if (!sent.emplace(std::make_pair(m.src, m.dst), m).second) {
        return InternalError(fmt::format("two messages {}->{}", m.src, m.dst));
      }
    }
  }
  // Every holder's view of a band agrees: the others it reads hold the band at the slots named,
  // and the holders' rows cover the band exactly once.
  for (int t = 0; t < S; ++t) {
    for (const auto& [key, b] : amax[t]) {
      int64_t rows = b.own_rows;
      for (const AmaxHolder& h : b.others) {
        auto it = h.rank >= 0 && h.rank < S ? amax[h.rank].find(key) : amax[t].end();
        if (h.rank < 0 || h.rank >= S || it == amax[h.rank].end() || it->second.slot != h.slot ||
            it->second.blocks != b.blocks ||
            h.rank / in.trainer.shards_per_group() != t / in.trainer.shards_per_group()) {
          return InternalError(fmt::format(
              "trainer rank {}: band {} of '{}' names holder {} at slot {}, which does not hold it "
              "there",
              t, b.row0, inv[b.tensor].name, h.rank, h.slot));
        }
        rows += it->second.own_rows;
      }
      if (rows != b.rows) {
        return InternalError(
            fmt::format("trainer rank {}: band {} of '{}' has {} rows, its holders "
                        "{}",
                        t, b.row0, inv[b.tensor].name, b.rows, rows));
      }
    }
  }
  const int64_t wire = DTypeSize(in.options.wire_dtype), stage = DTypeSize(in.trainer_dtype);
  for (int j = 0; j < D * E; ++j) {
    const EngineRankShards& rank = map.ranks[j % E];
    const std::string who = fmt::format("sync rank {} (replica {}, tp {}, pp {})", S + j, j / E,
                                        rank.tp_rank, rank.pp_rank);
    SS_ASSIGN_OR_RETURN(RankPlan rp, ctx.PlanForRank(S + j));
    Coverage cover(rank);
    std::vector<std::vector<uint8_t>> tiles(rp.staged.size());
    for (size_t b = 0; b < rp.staged.size(); ++b) {
      tiles[b].assign(static_cast<size_t>(rp.staged[b].src.numel()), 0);
    }
    for (const Message& m : rp.recvs) {
      auto it = sent.find({m.src, m.dst});
      if (m.dst != S + j || it == sent.end()) {
        return InternalError(
            fmt::format("{}: receives {}->{} that no trainer sends", who, m.src, m.dst));
      }
      const Message& s = it->second;
      bool same = s.bytes == m.bytes && s.ops.size() == m.ops.size() &&
                  s.buckets.size() == m.buckets.size();
      for (size_t i = 0; same && i < m.ops.size(); ++i) same = SameOp(s.ops[i], m.ops[i]);
      same = same && s.local.size() == m.local.size();
      for (size_t i = 0; same && i < m.local.size(); ++i) {
        same = s.local[i].param == m.local[i].param && s.local[i].region == m.local[i].region;
      }
      for (size_t i = 0; same && i < m.buckets.size(); ++i) {
        same = s.buckets[i].op_begin == m.buckets[i].op_begin &&
               s.buckets[i].op_end == m.buckets[i].op_end &&
               s.buckets[i].bytes == m.buckets[i].bytes;
      }
      if (!same) {
        return InternalError(
            fmt::format("message {}->{} differs between sender and receiver", m.src, m.dst));
      }
      sent.erase(it);
      SS_RETURN_IF_ERROR(CheckMessageShape(m, cap));
      for (size_t i = 0; i < m.ops.size(); ++i) {
        const TransferOp& op = m.ops[i];
        const std::string what = fmt::format("{}: message {}->{} op {} ({})", who, m.src, m.dst, i,
                                             EncodingName(op.encoding));
        if (op.tensor < 0 || op.tensor >= static_cast<int32_t>(inv.size()) ||
            !RegionInside(op.src, inv[op.tensor].shape)) {
          return InternalError(fmt::format("{}: bad source", what));
        }
        const HfTensor& t = inv[op.tensor];
        switch (op.encoding) {
          case Encoding::kCopy: {
            if (op.param < 0 || op.param >= static_cast<int32_t>(rank.params.size())) {
              return InternalError(fmt::format("{}: bad parameter", what));
            }
            const EngineParam& p = rank.params[op.param];
            if (p.dtype == DType::kF8E4M3 || p.dtype != in.model.dtype ||
                op.bytes != AlignUp8(op.src.numel() * wire)) {
              return InternalError(
                  fmt::format("{}: copies into '{}' ({})", what, p.name, DTypeName(p.dtype)));
            }
            SS_RETURN_IF_ERROR(CheckAgainstPieces(p, t.name, op.src, op.dst, what));
            cover.Add(rank, op.param, op.dst);
            break;
          }
          case Encoding::kQuantize: {
            SS_RETURN_IF_ERROR(CheckQuantized(ctx, rank, op.tensor, op.param, op.scale_param,
                                              op.src, op.dst, op.scale_dst, what));
            const int dr = op.dst.ndim - 2;
            if (op.bytes != Fp8WireBytes(op.dst.extent[dr], op.dst.extent[dr + 1])) {
              return InternalError(fmt::format("{}: {} wire bytes", what, op.bytes));
            }
            cover.Add(rank, op.param, op.dst);
            cover.Add(rank, op.scale_param, op.scale_dst);
            break;
          }
          case Encoding::kAmax: {
            SS_RETURN_IF_ERROR(CheckAmaxOp(ctx, rank, op, what));
            cover.Add(rank, op.param, op.dst);
            if (op.scale_param >= 0) cover.Add(rank, op.scale_param, op.scale_dst);
            break;
          }
          case Encoding::kStage: {
            if (op.stage < 0 || op.stage >= static_cast<int32_t>(rp.staged.size())) {
              return InternalError(fmt::format("{}: bad staged band {}", what, op.stage));
            }
            const StagedBand& band = rp.staged[op.stage];
            const Region tile = Region::Make({0, 0}, {band.src.extent[0], band.src.extent[1]});
            const int64_t r0 = op.src.offset[0] - band.src.offset[0];
            if (band.tensor != op.tensor || op.src.ndim != 2 ||
                op.src.offset[1] != band.src.offset[1] || op.src.extent[1] != band.src.extent[1] ||
                op.dst != Region::Make({r0, 0}, {op.src.extent[0], op.src.extent[1]}) ||
                op.staging_offset != band.staging_offset || !RegionContains(tile, op.dst) ||
                op.bytes != AlignUp8(op.src.numel() * stage)) {
              return InternalError(fmt::format("{}: {} does not fit band {} ({})", what,
                                               op.src.ToString(), op.stage, band.src.ToString()));
            }
            ForEachRun(op.dst, {band.src.extent[0], band.src.extent[1]},
                       [&](int64_t off, int64_t len) {
                         for (int64_t k = 0; k < len; ++k) ++tiles[op.stage][off + k];
                       });
            break;
          }
        }
      }
    }
    int64_t staging_end = 0;
    for (size_t b = 0; b < rp.staged.size(); ++b) {
      const StagedBand& band = rp.staged[b];
      const std::string what = fmt::format("{}: staged band {}", who, b);
      for (uint8_t c : tiles[b]) {
        if (c != 1) {
          return InternalError(fmt::format("{}: an element of {} is staged {} times", what,
                                           band.src.ToString(), int{c}));
        }
      }
      if (band.src.extent[0] > B || band.dtype != in.trainer_dtype ||
          band.bytes != band.src.numel() * stage || band.staging_offset % 8 != 0 ||
          band.staging_offset < staging_end) {
        return InternalError(fmt::format("{}: bad geometry", what));
      }
      staging_end = band.staging_offset + band.bytes;
      SS_RETURN_IF_ERROR(CheckQuantized(ctx, rank, band.tensor, band.param, band.scale_param,
                                        band.src, band.dst, band.scale_dst, what));
      cover.Add(rank, band.param, band.dst);
      cover.Add(rank, band.scale_param, band.scale_dst);
    }
    if (staging_end > rp.staging_bytes) {
      return InternalError(fmt::format("{}: staging needs {} bytes, the plan gives {}", who,
                                       staging_end, rp.staging_bytes));
    }
    for (size_t pi = 0; pi < rank.params.size(); ++pi) {
      for (const ZeroFill& z : rank.params[pi].zero_fills) {
        cover.Add(rank, static_cast<int32_t>(pi), z.dst);
      }
    }
    SS_RETURN_IF_ERROR(cover.Check(rank, who));
  }
  if (!sent.empty()) {
    return InternalError(fmt::format("message {}->{} is sent but never received",
                                     sent.begin()->first.first, sent.begin()->first.second));
  }
  return OkStatus();
}

}  // namespace shardsync
