// The planner: per-rank op lists and job-wide statistics from region arithmetic.
//
// Geometry. Every trainer layout is R groups x S dim-0 shards (torch.chunk sizes). A piece (HF
// source box -> engine dst box) overlaps a contiguous range [c0, c1] of dim-0 chunks, found by
// division. Piece x chunk is an "item"; its dst box is split into contiguous runs (receivers land
// bytes in place) and runs over the bucket cap are split along their first dim with extent > 1.
//
// Sources. With R == 1 every byte has one holder. With R > 1 the demand on chunk s (every replica's
// items for s, replica-major) is one byte sequence cut into R equal segments at unit boundaries;
// trainer rank g*S + s serves segment g. Any rank recomputes the cuts locally from prefix sums.
// Replica-major order keeps a trainer group's segment on few replicas, which colocated jobs place
// on nearby GPUs.
#include "plan/planner.h"

#include <fmt/format.h>
#include <algorithm>
#include <unordered_map>

#include "plan/megatron.h"

namespace shardsync::plan_internal {
namespace {

// Merges `q` into `p` when they are adjacent along one src dim and the matching dst dim (the
// coalescing step: adjacent pieces become one before intersection, so every piece x chunk
// intersection is already maximal).
bool TryMerge(FlatPiece* p, const FlatPiece& q) {
  if (p->erank != q.erank || p->param != q.param || p->tensor != q.tensor) return false;
  const Region &a = p->src, &b = q.src;
  if (a.ndim != b.ndim || p->dst.ndim != q.dst.ndim) return false;
  const int off = p->dst.ndim - a.ndim;
  int dim = -1;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.offset[i] == b.offset[i] && a.extent[i] == b.extent[i]) continue;
    if (dim >= 0 || a.offset[i] + a.extent[i] != b.offset[i] || i + off < 0) return false;
    dim = i;
  }
  if (dim < 0) return false;
  const int dd = dim + off;
  for (int j = 0; j < p->dst.ndim; ++j) {
    if (j == dd) {
      if (p->dst.offset[j] + p->dst.extent[j] != q.dst.offset[j]) return false;
    } else if (p->dst.offset[j] != q.dst.offset[j] || p->dst.extent[j] != q.dst.extent[j]) {
      return false;
    }
  }
  p->src.extent[dim] += b.extent[dim];
  p->dst.extent[dd] += q.dst.extent[dd];
  return true;
}

void AppendOp(std::vector<TransferOp>* out, int32_t tensor, int32_t param, const Region& src,
              const Region& dst, int64_t bytes) {
  TransferOp op;
  op.tensor = tensor;
  op.param = param;
  op.src = src;
  op.dst = dst;
  op.bytes = bytes;
  out->push_back(op);
}

}  // namespace

Status CheckPlanOptions(const PlanInputs& in) {
  const auto& sh = in.rollout.shard;
  if (in.rollout.dp < 1) return InvalidArgumentError("--rollout dp: must be positive");
  if (sh.tp < 1 || sh.pp < 1) return InvalidArgumentError("--rollout tp/pp: must be positive");
  if (in.trainer.world() < 1 || in.trainer.groups() < 1 || in.trainer.shards_per_group() < 1) {
    return InvalidArgumentError(
        fmt::format("--trainer {}: world must be positive", in.trainer.ToString()));
  }
  for (DType t : {in.options.wire_dtype, in.trainer_dtype}) {
    if (t != DType::kBF16 && t != DType::kF16 && t != DType::kF32) {
      return InvalidArgumentError(fmt::format(
          "{}: {} is not a supported floating type (bf16, f16, f32)",
          t == in.options.wire_dtype ? "--wire-dtype" : "--trainer-dtype", DTypeName(t)));
    }
  }
  return CodecFor(in).CheckOptions(in);
}

Result<PlanContext> PlanContext::Build(const PlanInputs& in, ShardMap map,
                                       std::vector<HfTensor> inventory) {
  PlanContext c;
  c.in_ = in;
  c.codec_ = &CodecFor(in);
  const auto& sh = in.rollout.shard;
  SS_RETURN_IF_ERROR(CheckPlanOptions(in));
  c.wire_ = DTypeSize(in.options.wire_dtype);
  if (map.spec.tp != sh.tp || map.spec.pp != sh.pp ||
      map.ranks.size() != static_cast<size_t>(sh.tp) * sh.pp) {
    return InvalidArgumentError(
        fmt::format("shard map: built for tp={} pp={} with {} ranks, rollout wants tp={} pp={}",
                    map.spec.tp, map.spec.pp, map.ranks.size(), sh.tp, sh.pp));
  }
  c.S_world_ = in.trainer.world();
  c.R_ = in.trainer.groups();
  c.S_ = in.trainer.shards_per_group();
  c.D_ = in.rollout.dp;
  c.E_ = sh.tp * sh.pp;
  c.hash_ = PlanHash(in);

  std::unordered_map<std::string, int32_t> by_name;
  by_name.reserve(inventory.size() * 2);
  for (size_t i = 0; i < inventory.size(); ++i) {
    if (!by_name.emplace(inventory[i].name, static_cast<int32_t>(i)).second) {
      return InvalidArgumentError(
          fmt::format("inventory: tensor '{}' listed twice", inventory[i].name));
    }
  }
  c.tensor_chunk_.resize(inventory.size());
  for (size_t i = 0; i < inventory.size(); ++i) {
    const Shape& s = inventory[i].shape;
    if (s.empty() || s.size() > kMaxDims) {
      return UnimplementedError(fmt::format("tensor '{}': rank {} not supported (1..{} dims)",
                                            inventory[i].name, s.size(), kMaxDims));
    }
    c.tensor_chunk_[i] = std::max<int64_t>(1, CeilDiv(s[0], c.S_));
  }

  c.erank_begin_.assign(c.E_ + 1, 0);
  size_t npieces = 0, nparams = 0;
  for (const auto& rk : map.ranks) {
    nparams += rk.params.size();
    for (const auto& prm : rk.params) npieces += prm.pieces.size();
  }
  c.pieces_.reserve(npieces);
  c.param_shapes_.reserve(nparams);
  for (int e = 0; e < c.E_; ++e) {
    c.erank_begin_[e] = static_cast<int32_t>(c.pieces_.size());
    const EngineRankShards& rk = map.ranks[e];
    for (size_t pi = 0; pi < rk.params.size(); ++pi) {
      const EngineParam& prm = rk.params[pi];
      const auto shape_idx = static_cast<int32_t>(c.param_shapes_.size());
      c.param_shapes_.push_back(prm.shape);
      if (prm.shape.size() > kMaxDims) {
        return UnimplementedError(
            fmt::format("rank {} param '{}': more than {} dims", e, prm.name, kMaxDims));
      }
      if (!c.codec_->Walks(prm)) continue;  // a companion: another parameter's ops carry it
      const size_t first = c.pieces_.size();
      for (const Piece& pc : prm.pieces) {
        auto it = by_name.find(pc.source);
        auto where = [&] {
          return fmt::format("engine rank (pp {}, tp {}) param '{}'", e / sh.tp, e % sh.tp,
                             prm.name);
        };
        if (it == by_name.end()) {
          return NotFoundError(
              fmt::format("{}: piece source '{}' is not in the HF inventory", where(), pc.source));
        }
        const HfTensor& t = inventory[it->second];
        if (!RegionInside(pc.src, t.shape)) {
          return OutOfRangeError(fmt::format("{}: source region {} outside '{}' {}", where(),
                                             pc.src.ToString(), t.name, ShapeToString(t.shape)));
        }
        if (!RegionInside(pc.dst, prm.shape)) {
          return OutOfRangeError(fmt::format("{}: dst region {} outside {}", where(),
                                             pc.dst.ToString(), ShapeToString(prm.shape)));
        }
        if (!Aligned(pc.src, pc.dst)) {
          return InvalidArgumentError(
              fmt::format("{}: piece {} of '{}' -> {} is not a box translation", where(),
                          pc.src.ToString(), t.name, pc.dst.ToString()));
        }
        if (pc.src.empty()) continue;
        FlatPiece fp;
        fp.erank = e;
        fp.param = static_cast<int32_t>(pi);
        fp.tensor = it->second;
        fp.shape = shape_idx;
        fp.src = pc.src;
        fp.dst = pc.dst;
        if (c.codec_->Coalesces() && c.pieces_.size() > first && TryMerge(&c.pieces_.back(), fp)) {
          continue;
        }
        c.pieces_.push_back(fp);
      }
    }
  }
  c.erank_begin_[c.E_] = static_cast<int32_t>(c.pieces_.size());
  for (FlatPiece& p : c.pieces_) {
    const int off = p.dst.ndim - p.src.ndim;
    p.dst_dim0 = off >= 0 ? off : -1;
    p.row_elems = p.src.numel() / p.src.extent[0];
    const int64_t ch = c.tensor_chunk_[p.tensor];
    p.c0 = p.src.offset[0] / ch;
    p.c1 = (p.src.offset[0] + p.src.extent[0] - 1) / ch;
  }
  c.map_ = std::move(map);
  c.inv_ = std::move(inventory);
  if (in.trainer.kind == TrainerSpec::Kind::kMegatron) {
    // The trainer's sources: the boxes the walk intersects every engine piece with.
    SS_ASSIGN_OR_RETURN(MegatronDims dims, ComputeMegatronDims(in.model, in.trainer.megatron));
    SS_ASSIGN_OR_RETURN(MegatronSources ms,
                        BuildMegatronSources(in.model, in.trainer.megatron, dims, c.inv_));
    c.sources_ = std::make_shared<const MegatronSources>(std::move(ms));
  }
  SS_RETURN_IF_ERROR(c.codec_->Prepare(&c));
  return c;
}

Status PlanContext::PrepareCopy() {
  copy_ = true;
  if (sources_) {
    // Megatron layouts: megatron_plan.cc plans every rank; nothing below applies.
    SS_ASSIGN_OR_RETURN(megatron_, MegatronPlanner::Build(*this));
    return OkStatus();
  }
  stats_.resize(pieces_.size());
  for (size_t pi = 0; pi < pieces_.size(); ++pi) {
    const FlatPiece& p = pieces_[pi];
    PieceStats& st = stats_[pi];
    const int64_t at[3] = {p.c0, std::min(p.c0 + 1, p.c1), p.c1};
    for (int w = 0; w < 3; ++w) {
      const Item it = MakeItem(p, at[w]);
      st.bytes[w] = it.bytes();
      st.ops[w] = ItemOps(it);
    }
  }
  whole_replicas_ = D_ % R_ == 0;
  if (!whole_replicas_) BuildSequences();
  return OkStatus();
}

void PlanContext::ChunkPart(const FlatPiece& p, int64_t chunk, Region* src, Region* dst) const {
  const int64_t ch = tensor_chunk_[p.tensor];
  const int64_t a = p.src.offset[0], b = a + p.src.extent[0];
  const int64_t lo = std::max(a, chunk * ch), hi = std::min(b, (chunk + 1) * ch);
  *src = p.src;
  src->offset[0] = lo;
  src->extent[0] = hi - lo;
  *dst = p.dst;
  if (p.dst_dim0 >= 0) {
    dst->offset[p.dst_dim0] += lo - a;
    dst->extent[p.dst_dim0] = hi - lo;
  }
}

Item PlanContext::MakeItem(const FlatPiece& p, int64_t chunk) const {
  Item it;
  ChunkPart(p, chunk, &it.src, &it.dst);
  SetItemGeometry(&it, param_shapes_[p.shape], wire_);
  return it;
}

void PlanContext::ForEachUnit(int e, const std::function<void(const PlanUnit&)>& fn) const {
  PlanUnit u;
  for (int32_t pi = erank_begin_[e]; pi < erank_begin_[e + 1]; ++pi) {
    const FlatPiece& p = pieces_[pi];
    u.piece = pi;
    if (sources_) {
      // Megatron: the piece x every trainer source of its tensor it intersects.
      const MegatronSources& ms = *sources_;
      for (int32_t si = ms.tensor_begin[p.tensor]; si < ms.tensor_begin[p.tensor + 1]; ++si) {
        u.src = Intersect(p.src, ms.sources[si].hf);
        if (u.src.empty()) continue;
        u.source = si;
        u.dst = MapToDst(p.src, p.dst, u.src);
        fn(u);
      }
      continue;
    }
    for (int64_t k = p.c0; k <= p.c1; ++k) {  // FSDP-like: the piece's rows in each dim-0 chunk
      u.chunk = k;
      ChunkPart(p, k, &u.src, &u.dst);
      fn(u);
    }
  }
}

int64_t PlanContext::ItemOps(const Item& it) const {
  return ItemOpCount(it, wire_, in_.options.bucket_bytes);
}

int64_t PlanContext::ItemRangeOps(const Item& it, int64_t y0, int64_t y1) const {
  return ItemRangeOpCount(it, y0, y1, wire_, in_.options.bucket_bytes);
}

void PlanContext::EmitItemRange(const FlatPiece& p, const Item& it, int64_t y0, int64_t y1,
                                std::vector<TransferOp>* out) const {
  ForItemRangeOps(it, y0, y1, wire_, in_.options.bucket_bytes,
                  [&](const Region& src, const Region& dst) {
                    AppendOp(out, p.tensor, p.param, src, dst, dst.numel() * wire_);
                  });
}

void PlanContext::ChunkDifferences(std::vector<int64_t>* db, std::vector<int64_t>* dops) const {
  // Each piece adds its first chunk, its last chunk and the run of equal interior chunks in O(1);
  // a prefix sum over chunks k of row e * (S + 1) gives the per (erank, chunk) totals.
  const size_t W = static_cast<size_t>(S_) + 1;
  db->assign(static_cast<size_t>(E_) * W, 0);
  dops->assign(db->size(), 0);
  auto add = [&](int e, int64_t k0, int64_t k1, int64_t bytes, int64_t ops) {
    (*db)[e * W + k0] += bytes;
    (*db)[e * W + k1] -= bytes;
    (*dops)[e * W + k0] += ops;
    (*dops)[e * W + k1] -= ops;
  };
  for (size_t pi = 0; pi < pieces_.size(); ++pi) {
    const FlatPiece& p = pieces_[pi];
    const PieceStats& st = stats_[pi];
    add(p.erank, p.c0, p.c0 + 1, st.bytes[0], st.ops[0]);
    if (p.c1 > p.c0) add(p.erank, p.c1, p.c1 + 1, st.bytes[2], st.ops[2]);
    if (p.c1 > p.c0 + 1) add(p.erank, p.c0 + 1, p.c1, st.bytes[1], st.ops[1]);
  }
}

void PlanContext::BuildSequences() {
  // Bytes and ops per (erank, chunk) by difference arrays: O(pieces + E*S).
  const size_t W = static_cast<size_t>(S_) + 1;
  std::vector<int64_t> db, dops;
  ChunkDifferences(&db, &dops);
  for (int e = 0; e < E_; ++e) {
    for (int k = 1; k < S_; ++k) {
      db[e * W + k] += db[e * W + k - 1];
      dops[e * W + k] += dops[e * W + k - 1];
    }
  }
  seqs_.assign(S_, Sequence{});
  for (int s = 0; s < S_; ++s) {
    Sequence& q = seqs_[s];
    q.erank_offset.assign(E_ + 1, 0);
    q.erank_ops.assign(E_ + 1, 0);
    for (int e = 0; e < E_; ++e) {
      q.erank_offset[e + 1] = q.erank_offset[e] + db[e * W + s];
      q.erank_ops[e + 1] = q.erank_ops[e] + dops[e * W + s];
    }
    const int64_t T = q.total();
    const __int128 all = static_cast<__int128>(T) * D_;
    q.cuts.resize(R_ + 1);
    for (int g = 0; g <= R_; ++g) {
      const auto b = static_cast<int64_t>(all * g / R_);
      if (b >= all || T == 0) {
        q.cuts[g] = static_cast<int64_t>(all);
        continue;
      }
      // Round the ideal boundary up to the next unit boundary inside its item.
      const int64_t d = b / T, x = b - d * T;
      const int e =
          static_cast<int>(std::upper_bound(q.erank_offset.begin(), q.erank_offset.end(), x) -
                           q.erank_offset.begin() - 1);
      const int64_t y = x - q.erank_offset[e];
      int32_t piece = -1;
      int64_t item_off = 0;
      ForItemsInRange(e, s, y, y + 1, [&](int32_t pi, int64_t off) {
        piece = pi;
        item_off = off;
      });
      const Item it = MakeItem(pieces_[piece], s);
      q.cuts[g] = d * T + q.erank_offset[e] + item_off + RoundUpToUnit(it, y - item_off);
    }
    q.cuts[0] = 0;
  }
}

void PlanContext::ForItemsInRange(int e, int s, int64_t y0, int64_t y1,
                                  const std::function<void(int32_t, int64_t)>& fn) const {
  int64_t acc = 0;
  for (int32_t pi = erank_begin_[e]; pi < erank_begin_[e + 1] && acc < y1; ++pi) {
    const int64_t b = BytesAt(pi, s);
    if (b == 0) continue;
    if (acc + b > y0) fn(pi, acc);
    acc += b;
  }
}

int64_t PlanContext::CountRangeOps(int e, int s, int64_t y0, int64_t y1) const {
  int64_t ops = 0;
  ForItemsInRange(e, s, y0, y1, [&](int32_t pi, int64_t off) {
    const FlatPiece& p = pieces_[pi];
    const int64_t b = BytesAt(pi, s);
    if (off >= y0 && off + b <= y1) {
      ops += stats_[pi].ops[Which(p, s)];
    } else {
      ops += ItemRangeOps(MakeItem(p, s), std::max<int64_t>(y0 - off, 0), std::min(y1 - off, b));
    }
  });
  return ops;
}

Status PlanContext::NotCopyPlan() const {
  const PlanInputs& in = in_;
  const PlanContext& c = *this;
  // A codec's units are not plain copies: these ops would land the wrong bytes.
  return UnimplementedError(fmt::format(
      "model '{}' has {} engine weights ({} from {}): its plan is a {} plan (PlanForRank / "
      "SummarizePlan), not a bf16 copy plan",
      in.model.name, c.codec().name(), in.model.quant ? QuantConfigToString(*in.model.quant) : "",
      in.model.quant ? in.model.quant->origin : "", c.codec().name()));
}

Result<RankPlan> PlanContext::PlanForRank(int sync_rank) const {
  if (!copy_) return NotCopyPlan();
  if (megatron_) return megatron_->PlanForRank(sync_rank, hash_);
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(in_, sync_rank));
  RankPlan rp;
  rp.rank = sync_rank;
  rp.plan_hash = hash_;
  if (who.is_trainer) {
    const int t = who.trainer_rank, g = t / S_, s = t % S_;
    if (whole_replicas_) {
      // Group g serves whole replicas [g*D/R, (g+1)*D/R) (with R == 1: every replica); the
      // items of chunk s are identical for each of them.
      const int per = D_ / R_;
      std::vector<std::vector<TransferOp>> local(E_);
      for (const FlatPiece& p : pieces_) {
        if (p.c0 <= s && s <= p.c1) {
          const Item it = MakeItem(p, s);
          EmitItemRange(p, it, 0, it.bytes(), &local[p.erank]);
        }
      }
      for (int d = g * per; d < (g + 1) * per; ++d) {
        for (int e = 0; e < E_; ++e) {
          if (local[e].empty()) continue;
          Message m;
          m.src = sync_rank;
          m.dst = S_world_ + d * E_ + e;
          if (d + 1 == (g + 1) * per) {
            m.ops = std::move(local[e]);
          } else {
            m.ops = local[e];
          }
          FinishMessage(&m, in_.options.bucket_bytes);
          rp.sends.push_back(std::move(m));
        }
      }
      return rp;
    }
    const Sequence& q = seqs_[s];
    const int64_t T = q.total();
    if (T == 0) return rp;
    const int64_t lo = q.cuts[g], hi = q.cuts[g + 1];
    for (int64_t d = lo / T; d < D_ && d * T < hi; ++d) {
      const int64_t x0 = std::max(lo, d * T) - d * T, x1 = std::min(hi, (d + 1) * T) - d * T;
      if (x1 <= x0) continue;
      int e = static_cast<int>(std::upper_bound(q.erank_offset.begin(), q.erank_offset.end(), x0) -
                               q.erank_offset.begin() - 1);
      for (; e < E_ && q.erank_offset[e] < x1; ++e) {
        const int64_t eo = q.erank_offset[e], eb = q.erank_offset[e + 1] - eo;
        if (eb == 0) continue;
        rp.sends.emplace_back();
        Message& m = rp.sends.back();
        m.src = sync_rank;
        m.dst = S_world_ + static_cast<int>(d) * E_ + e;
        ForItemsInRange(e, s, std::max<int64_t>(x0 - eo, 0), std::min(x1 - eo, eb),
                        [&](int32_t pi, int64_t off) {
                          const FlatPiece& p = pieces_[pi];
                          const Item it = MakeItem(p, s);
                          EmitItemRange(p, it, std::max<int64_t>(x0 - eo - off, 0),
                                        std::min(x1 - eo - off, it.bytes()), &m.ops);
                        });
      }
    }
    for (Message& m : rp.sends) FinishMessage(&m, in_.options.bucket_bytes);
    return rp;
  }

  const int d = who.replica, e = who.pp_rank * in_.rollout.shard.tp + who.tp_rank;
  std::vector<std::vector<TransferOp>> by_src(S_world_);
  std::vector<int64_t> acc(whole_replicas_ ? 0 : S_, 0);  // erank-local offset per chunk
  ForEachUnit(e, [&](const PlanUnit& u) {
    const FlatPiece& p = pieces_[u.piece];
    const int64_t k = u.chunk;
    Item it;
    it.src = u.src;
    it.dst = u.dst;
    SetItemGeometry(&it, param_shapes_[p.shape], wire_);
    if (whole_replicas_) {
      EmitItemRange(p, it, 0, it.bytes(), &by_src[(d / (D_ / R_)) * S_ + k]);
      return;
    }
    // The unit's bytes in chunk k's sequence, cut among the R groups serving it.
    const Sequence& q = seqs_[k];
    const int64_t o = d * q.total() + q.erank_offset[e] + acc[k], len = it.bytes();
    acc[k] += len;
    size_t g = std::upper_bound(q.cuts.begin(), q.cuts.end(), o) - q.cuts.begin() - 1;
    for (; g < static_cast<size_t>(R_) && q.cuts[g] < o + len; ++g) {
      const int64_t a = std::max(o, q.cuts[g]), b = std::min(o + len, q.cuts[g + 1]);
      if (b > a) EmitItemRange(p, it, a - o, b - o, &by_src[g * S_ + k]);
    }
  });
  for (int src = 0; src < S_world_; ++src) {
    if (by_src[src].empty()) continue;
    Message m;
    m.src = src;
    m.dst = sync_rank;
    m.ops = std::move(by_src[src]);
    FinishMessage(&m, in_.options.bucket_bytes);
    rp.recvs.push_back(std::move(m));
  }
  return rp;
}

void PlanContext::ForEachPair(const PairFn& fn) const {
  if (megatron_) return megatron_->ForEachPair(fn);
  if (whole_replicas_) {
    // Per (engine rank of a replica, chunk): bytes and ops via difference arrays; each piece adds
    // its first chunk, its last chunk and the run of equal interior chunks in O(1).
    const size_t W = static_cast<size_t>(S_) + 1;
    std::vector<int64_t> db, dops;
    ChunkDifferences(&db, &dops);
    for (int e = 0; e < E_; ++e) {
      int64_t b = 0, o = 0;
      for (int k = 0; k < S_; ++k) {
        b += db[e * W + k];
        o += dops[e * W + k];
        db[e * W + k] = b;
        dops[e * W + k] = o;
      }
    }
    for (int d = 0; d < D_; ++d) {
      for (int e = 0; e < E_; ++e) {
        for (int k = 0; k < S_; ++k) {
          if (db[e * W + k] > 0) {
            fn((d / (D_ / R_)) * S_ + k, S_world_ + d * E_ + e, db[e * W + k], dops[e * W + k]);
          }
        }
      }
    }
    return;
  }
  // R does not divide D: merge each chunk's R cuts with the (replica, engine rank) intervals of its
  // sequence.
  for (int s = 0; s < S_; ++s) {
    const Sequence& q = seqs_[s];
    const int64_t T = q.total();
    if (T == 0) continue;
    int g = 0;
    for (int d = 0; d < D_; ++d) {
      for (int e = 0; e < E_; ++e) {
        const int64_t st = d * T + q.erank_offset[e], en = d * T + q.erank_offset[e + 1];
        if (en <= st) continue;
        while (q.cuts[g + 1] <= st) ++g;
        for (int gg = g; gg < R_ && q.cuts[gg] < en; ++gg) {
          const int64_t a = std::max(st, q.cuts[gg]), b = std::min(en, q.cuts[gg + 1]);
          if (b > a) {
            const int64_t ops = a == st && b == en ? q.erank_ops[e + 1] - q.erank_ops[e]
                                                   : CountRangeOps(e, s, a - st, b - st);
            fn(gg * S_ + s, S_world_ + d * E_ + e, b - a, ops);
          }
        }
      }
    }
  }
}

}  // namespace shardsync::plan_internal
