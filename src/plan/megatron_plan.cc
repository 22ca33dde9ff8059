// The planner for Megatron trainer layouts (megatron.h MegatronPlanner): trainer sources x engine
// pieces as box intersections, senders spread over a source's holders by bytes.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <unordered_map>

#include "plan/megatron.h"

namespace shardsync::plan_internal {
namespace {

// A trainer piece before equal HF boxes are merged into one source.
struct RawSource {
  int32_t tensor;
  Region hf;
  HolderSet holders;
  int32_t param;
  Region local;
};

bool Before(const RawSource& a, const RawSource& b) {
  if (a.tensor != b.tensor) return a.tensor < b.tensor;
  if (!(a.hf == b.hf)) return a.hf < b.hf;
  if (a.holders.pp != b.holders.pp) return a.holders.pp < b.holders.pp;
  return a.param < b.param;
}

}  // namespace

std::pair<int, int32_t> HolderAmong(const MegatronLayout& l,
                                    const std::vector<MegatronPlace>& places, int32_t begin,
                                    int32_t end, int64_t k) {
  for (int32_t j = begin; j < end; ++j) {
    const MegatronPlace& pl = places[j];
    if (k < pl.count) return {HolderRank(l, pl.holders, k), j};
    k -= pl.count;
  }
  return {-1, -1};
}

LocalSource LocalSourceOf(const Region& hf, const MegatronPlace& place, const Region& src) {
  LocalSource ls{place.param, src};
  for (int d = 0; d < src.ndim; ++d) {
    ls.region.offset[d] = src.offset[d] - hf.offset[d] + place.local.offset[d];
  }
  return ls;
}

std::pair<int, int32_t> MegatronSources::Holder(const MegatronLayout& l, const MegatronSource& s,
                                                int64_t k) const {
  return HolderAmong(l, places, s.place_begin, s.place_end, k);
}

Result<MegatronSources> BuildMegatronSources(const ModelSpec& m, const MegatronLayout& l,
                                             const MegatronDims& dims,
                                             const std::vector<HfTensor>& inv) {
  MegatronSources out;
  std::unordered_map<std::string, int32_t> by_name;
  for (size_t i = 0; i < inv.size(); ++i) by_name.emplace(inv[i].name, static_cast<int32_t>(i));

  // Every trainer piece once per holder set: tp-split and replicated pieces from each tp rank's
  // stage (replicated ones from tp 0 only), expert pieces from each (ep, etp).
  std::vector<RawSource> raw;
  auto collect = [&](int pp, const StageParams& sp, auto&& want) -> Status {
    for (size_t i = 0; i < sp.params.size(); ++i) {
      const TrainerParam& prm = sp.params[i];
      for (size_t j = 0; j < prm.pieces.size(); ++j) {
        HolderSet h;
        h.pp = pp;
        h.kind = sp.kinds[i][j];
        if (!want(&h)) continue;
        const TrainerPiece& pc = prm.pieces[j];
        auto it = by_name.find(pc.source);
        if (it == by_name.end()) {
          return InternalError(
              fmt::format("megatron: '{}' of '{}' is not an HF tensor", pc.source, prm.name));
        }
        raw.push_back(RawSource{it->second, pc.src, h, static_cast<int32_t>(i), pc.local});
      }
    }
    return OkStatus();
  };
  for (int pp = 0; pp < l.pp; ++pp) {
    for (int t = 0; t < l.tp; ++t) {
      SS_ASSIGN_OR_RETURN(StageParams sp, BuildStageParams(m, l, dims, pp, t, 0, 0, DType::kF32));
      SS_RETURN_IF_ERROR(collect(pp, sp, [&](HolderSet* h) {
        h->tp = t;
        return h->kind == HoldKind::kTpSplit || (h->kind == HoldKind::kReplicated && t == 0);
      }));
    }
    if (!m.is_moe()) continue;
    for (int e = 0; e < l.ep; ++e) {
      for (int x = 0; x < l.etp; ++x) {
        SS_ASSIGN_OR_RETURN(StageParams sp, BuildStageParams(m, l, dims, pp, 0, e, x, DType::kF32));
        SS_RETURN_IF_ERROR(collect(pp, sp, [&](HolderSet* h) {
          h->ep = e;
          h->etp = x;
          return h->kind == HoldKind::kExpert;
        }));
      }
    }
  }
  std::sort(raw.begin(), raw.end(), Before);
  std::vector<int64_t> covered(inv.size(), 0);
  for (size_t i = 0; i < raw.size(); ++i) {
    const RawSource& r = raw[i];
    if (i == 0 || raw[i - 1].tensor != r.tensor || !(raw[i - 1].hf == r.hf)) {
      MegatronSource s;
      s.tensor = r.tensor;
      s.hf = r.hf;
      s.place_begin = static_cast<int32_t>(out.places.size());
      out.sources.push_back(s);
      covered[r.tensor] += r.hf.numel();
    }
    MegatronPlace pl;
    pl.holders = r.holders;
    pl.count = HolderCount(l, r.holders);
    pl.param = r.param;
    pl.local = r.local;
    out.places.push_back(pl);
    MegatronSource& s = out.sources.back();
    s.place_end = static_cast<int32_t>(out.places.size());
    s.holders += pl.count;
  }
  // The sources must partition every HF tensor: each element held (in some place) exactly once.
  std::vector<int32_t>& tensor_src = out.tensor_begin;
  tensor_src.assign(inv.size() + 1, 0);
  for (const MegatronSource& s : out.sources) ++tensor_src[s.tensor + 1];
  std::partial_sum(tensor_src.begin(), tensor_src.end(), tensor_src.begin());
  for (size_t t = 0; t < inv.size(); ++t) {
    if (covered[t] != inv[t].numel()) {
      return InternalError(fmt::format("megatron trainer map: HF tensor '{}' has {} of {} elements",
                                       inv[t].name, covered[t], inv[t].numel()));
    }
    for (int32_t a = tensor_src[t]; a < tensor_src[t + 1]; ++a) {
      for (int32_t b = a + 1; b < tensor_src[t + 1]; ++b) {
        if (!Intersect(out.sources[a].hf, out.sources[b].hf).empty()) {
          return InternalError(
              fmt::format("megatron trainer map: HF tensor '{}' boxes {} and {} overlap",
                          inv[t].name, out.sources[a].hf.ToString(), out.sources[b].hf.ToString()));
        }
      }
    }
  }
  return out;
}

Result<std::shared_ptr<const MegatronPlanner>> MegatronPlanner::Build(const PlanContext& c) {
  auto mp = std::make_shared<MegatronPlanner>();
  MegatronPlanner& p = *mp;
  const PlanInputs& in = c.inputs();
  p.in_ = in;
  p.layout_ = in.trainer.megatron;
  p.S_ = c.trainer_world();
  p.E_ = c.engine_per_replica();
  p.D_ = c.replicas();
  p.wire_ = DTypeSize(in.options.wire_dtype);
  p.cap_ = in.options.bucket_bytes;
  const MegatronSources& ms = *c.megatron_sources();
  p.places_ = ms.places;
  p.sources_.reserve(ms.sources.size());
  for (const MegatronSource& ts : ms.sources) {
    Source s;
    s.tensor = ts.tensor;
    s.hf = ts.hf;
    s.place_begin = ts.place_begin;
    s.place_end = ts.place_end;
    s.holders = ts.holders;
    p.sources_.push_back(s);
  }

  // Items: the walk's units (every engine piece of one replica x the sources of its tensor), in
  // engine order.
  const auto& pieces = c.pieces();
  const auto& shapes = c.param_shapes();
  p.erank_begin_.assign(p.E_ + 1, 0);
  for (int e = 0; e < p.E_; ++e) {
    c.ForEachUnit(e, [&](const PlanUnit& u) {
      const FlatPiece& fp = pieces[u.piece];
      MItem it;
      it.erank = fp.erank;
      it.param = fp.param;
      it.tensor = fp.tensor;
      it.source = u.source;
      it.geo.src = u.src;
      it.geo.dst = u.dst;
      SetItemGeometry(&it.geo, shapes[fp.shape], p.wire_);
      p.items_.push_back(it);
      ++p.erank_begin_[fp.erank + 1];
    });
  }
  std::partial_sum(p.erank_begin_.begin(), p.erank_begin_.end(), p.erank_begin_.begin());
  // Group by source (stable: engine order within a source) and lay out each source's sequence.
  std::vector<int32_t> count(p.sources_.size() + 1, 0);
  for (const MItem& it : p.items_) ++count[it.source + 1];
  std::partial_sum(count.begin(), count.end(), count.begin());
  p.source_items_.resize(p.items_.size());
  for (size_t s = 0; s < p.sources_.size(); ++s) {
    p.sources_[s].item_begin = count[s];
    p.sources_[s].item_end = count[s + 1];
  }
  for (size_t i = 0; i < p.items_.size(); ++i) {
    MItem& it = p.items_[i];
    Source& s = p.sources_[it.source];
    it.src_off = s.total;
    s.total += it.geo.bytes();
    p.source_items_[count[it.source]++] = static_cast<int32_t>(i);
  }
  // Cuts: the D replicas' demand on a source, cut into `holders` equal segments, each boundary
  // rounded up to the next unit of the item it falls in.
  for (Source& s : p.sources_) {
    s.cut_begin = static_cast<int32_t>(p.cuts_.size());
    const int64_t T = s.total, N = s.holders;
    const __int128 all = static_cast<__int128>(T) * p.D_;
    for (int64_t g = 0; g <= N; ++g) {
      const auto b = static_cast<int64_t>(all * g / N);
      if (g == 0 || b >= all || T == 0) {
        p.cuts_.push_back(g == 0 ? 0 : static_cast<int64_t>(all));
        continue;
      }
      const int64_t d = b / T, x = b - d * T;
      auto first = p.source_items_.begin() + s.item_begin;
      auto last = p.source_items_.begin() + s.item_end;
      auto at = std::upper_bound(first, last, x,
                                 [&](int64_t v, int32_t i) { return v < p.items_[i].src_off; }) -
                1;
      const MItem& it = p.items_[*at];
      p.cuts_.push_back(d * T + it.src_off + RoundUpToUnit(it.geo, x - it.src_off));
    }
  }
  return std::shared_ptr<const MegatronPlanner>(std::move(mp));
}

std::pair<int, int32_t> MegatronPlanner::Holder(const Source& s, int64_t k) const {
  return HolderAmong(layout_, places_, s.place_begin, s.place_end, k);
}

void MegatronPlanner::EmitRange(int32_t i, int64_t y0, int64_t y1, const Placement& p,
                                Message* out) const {
  const MItem& it = items_[i];
  const Source& s = sources_[it.source];
  ForItemRangeOps(it.geo, y0, y1, wire_, cap_, [&](const Region& src, const Region& dst) {
    TransferOp op;
    op.tensor = it.tensor;
    op.param = it.param;
    op.src = src;
    op.dst = dst;
    op.bytes = dst.numel() * wire_;
    out->ops.push_back(op);
    out->local.push_back(LocalSourceOf(s.hf, p, src));
  });
}

Result<RankPlan> MegatronPlanner::PlanForRank(int sync_rank, const std::string& hash) const {
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(in_, sync_rank));
  RankPlan rp;
  rp.rank = sync_rank;
  rp.plan_hash = hash;
  if (who.is_trainer) {
    // Every segment this rank serves, as (dst, item) -> ops; ordered afterwards like the
    // receiver orders them (by item, i.e. engine order; one contiguous range per item).
    std::map<std::pair<int, int32_t>, Message> out;
    for (const Source& s : sources_) {
      const int64_t T = s.total;
      if (T == 0) continue;
      int64_t base = 0;
      for (int32_t j = s.place_begin; j < s.place_end; base += places_[j].count, ++j) {
        const int64_t k = HolderIndex(layout_, places_[j].holders, sync_rank);
        if (k < 0) continue;
        const int64_t lo = cuts_[s.cut_begin + base + k], hi = cuts_[s.cut_begin + base + k + 1];
        for (int64_t d = lo / T; d < D_ && d * T < hi; ++d) {
          const int64_t x0 = std::max(lo, d * T) - d * T, x1 = std::min(hi, (d + 1) * T) - d * T;
          for (int32_t a = s.item_begin; a < s.item_end; ++a) {
            const int32_t i = source_items_[a];
            const MItem& it = items_[i];
            const int64_t y0 = std::max<int64_t>(x0 - it.src_off, 0);
            const int64_t y1 = std::min(x1 - it.src_off, it.geo.bytes());
            if (y1 <= y0) continue;
            EmitRange(i, y0, y1, places_[j], &out[{S_ + static_cast<int>(d) * E_ + it.erank, i}]);
          }
        }
      }
    }
    for (auto& [key, part] : out) {
      if (rp.sends.empty() || rp.sends.back().dst != key.first) {
        rp.sends.emplace_back();
        rp.sends.back().src = sync_rank;
        rp.sends.back().dst = key.first;
      }
      Message& m = rp.sends.back();
      m.ops.insert(m.ops.end(), part.ops.begin(), part.ops.end());
      m.local.insert(m.local.end(), part.local.begin(), part.local.end());
    }
    for (Message& m : rp.sends) FinishMessage(&m, cap_);
    return rp;
  }
  const int d = who.replica, e = who.pp_rank * in_.rollout.shard.tp + who.tp_rank;
  std::map<int, Message> by_src;
  for (int32_t i = erank_begin_[e]; i < erank_begin_[e + 1]; ++i) {
    const MItem& it = items_[i];
    const Source& s = sources_[it.source];
    const int64_t o = d * s.total + it.src_off, len = it.geo.bytes();
    const int64_t* cuts = &cuts_[s.cut_begin];
    int64_t k = std::upper_bound(cuts, cuts + s.holders + 1, o) - cuts - 1;
    for (; k < s.holders && cuts[k] < o + len; ++k) {
      const int64_t a = std::max(o, cuts[k]), b = std::min(o + len, cuts[k + 1]);
      if (b <= a) continue;
      const auto [rank, j] = Holder(s, k);
      EmitRange(i, a - o, b - o, places_[j], &by_src[rank]);
    }
  }
  for (auto& [src, m] : by_src) {
    m.src = src;
    m.dst = sync_rank;
    FinishMessage(&m, cap_);
    rp.recvs.push_back(std::move(m));
  }
  return rp;
}

void MegatronPlanner::ForEachPair(const PairFn& fn) const {
  // (trainer, engine sync rank) -> (bytes, ops), summed over every source's segments.
  std::map<std::pair<int, int>, std::pair<int64_t, int64_t>> pairs;
  for (const Source& s : sources_) {
    if (s.total == 0) continue;
    const int64_t* cuts = &cuts_[s.cut_begin];
    for (int d = 0; d < D_; ++d) {
      for (int32_t a = s.item_begin; a < s.item_end; ++a) {
        const MItem& it = items_[source_items_[a]];
        const int64_t o = d * s.total + it.src_off, len = it.geo.bytes();
        int64_t k = std::upper_bound(cuts, cuts + s.holders + 1, o) - cuts - 1;
        for (; k < s.holders && cuts[k] < o + len; ++k) {
          const int64_t lo = std::max(o, cuts[k]), hi = std::min(o + len, cuts[k + 1]);
          if (hi <= lo) continue;
          auto& v = pairs[{Holder(s, k).first, S_ + d * E_ + it.erank}];
          v.first += hi - lo;
          v.second += ItemRangeOpCount(it.geo, lo - o, hi - o, wire_, cap_);
        }
      }
    }
  }
  for (const auto& [key, v] : pairs) fn(key.first, key.second, v.first, v.second);
}

}  // namespace shardsync::plan_internal
