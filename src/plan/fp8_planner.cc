// Block FP8's codec (fp8_plan.h, docs/fp8.md; codec.h): the units of the plan's one walk
// (PlanContext::ForEachUnit) cut on the 128 x 128 grid into encoded units, and their ops.
//
// FSDP-like trainers. The walk's unit is an engine piece's rows in one dim-0 chunk (R groups x S
// shards of torch.chunk size); HF tensors are chunked along dim 0, which for every quantized
// tensor is the weight's output rows, i.e. the block rows. A quantized piece is cut into bands of
// 128 source rows (block rows of the HF tensor: the shard map guarantees the piece starts on the
// grid). The bands inside the unit's chunk merge into one kQuantize unit, quantized by that
// chunk's holder. A band whose rows cross a chunk boundary is met in each chunk it touches: a
// kAmax part per chunk (the holders exchange its amax), or, under --fp8-split stage, a staged
// band of the receiver fed by one kStage part per chunk. Unquantized units are kCopy units.
//
// Sources. With R > 1 replica groups every unit of (replica d, engine rank e) is served by group
// (index + e + d) % R, `index` being the unit's position among e's units of its chunk: a
// round-robin any rank recomputes from its own walk (the copy codec's byte-balanced cuts are not
// used here; units are at most a few MiB, so the imbalance is one unit per chunk and pair).
//
// Megatron trainers. The walk's unit is an engine piece x one trainer source (megatron.h
// BuildMegatronSources: one HF box held the same way by a set of ranks, with where each holder
// keeps it in its local parameters), which for quantized weights must sit on the 128 grid
// (CheckMegatronGrid refuses otherwise), so it becomes kQuantize / kCopy units read from the
// holder's local parameter (Message::local); a box with several holders (DP / CP replicas) is
// cut along dim 0 into up to `holders` units spread round-robin, as for HSDP groups. Nothing is
// staged (fp8_megatron.cc).
//
// Ops. A unit becomes ops under the bucket cap: kCopy and kStage split like the copy codec's
// boxes; kQuantize splits on band boundaries, then, when one band is over the cap, on 128-column
// boundaries (a strided destination; only with caps below 128 rows of a weight).
#include "plan/fp8_planner.h"

#include <fmt/format.h>

#include <algorithm>

#include "plan/megatron.h"
#include "plan/planner.h"
#include "shardsync/fp8.h"

namespace shardsync {

namespace plan_internal {

Region BlockRegion(const Region& r) {
  Region b = r;
  for (int i = r.ndim - 2; i < r.ndim; ++i) {
    b.offset[i] = r.offset[i] / B;
    b.extent[i] = CeilDiv(r.offset[i] + r.extent[i], B) - b.offset[i];
  }
  return b;
}

namespace {

// Rows [r0, r0 + n) x cols [c0, c0 + m) of a unit's matrix (relative to its src / dst origin).
void SubMatrix(const Fp8Unit& u, int64_t r0, int64_t n, int64_t c0, int64_t m, Region* src,
               Region* dst) {
  *src = u.src;
  *dst = u.dst;
  const int sr = u.src.ndim - 2, dr = u.dst.ndim - 2;
  src->offset[sr] += r0;
  src->extent[sr] = n;
  src->offset[sr + 1] += c0;
  src->extent[sr + 1] = m;
  dst->offset[dr] += r0;
  dst->extent[dr] = n;
  dst->offset[dr + 1] += c0;
  dst->extent[dr + 1] = m;
}

}  // namespace

Result<Fp8Context> Fp8Context::Build(const PlanInputs& in) {
  if (!in.model.quant) {
    return FailedPreconditionError(fmt::format(
        "model '{}' has no quantization config: plan it with the bf16 planner", in.model.name));
  }
  SS_ASSIGN_OR_RETURN(PlanContext c, MakeContext(in));
  return Build(std::make_shared<const PlanContext>(std::move(c)));
}

Result<Fp8Context> Fp8Context::Build(const PlanContext& c) {
  // Not owned: the caller keeps `c` alive while the context is used.
  return Build(std::shared_ptr<const PlanContext>(std::shared_ptr<const PlanContext>(), &c));
}

Result<Fp8Context> Fp8Context::Build(std::shared_ptr<const PlanContext> pc) {
  Fp8Context c;
  c.c_ = std::move(pc);
  const PlanInputs& in = c.inputs();
  if (!in.model.quant) {
    return FailedPreconditionError(fmt::format(
        "model '{}' has no quantization config: plan it with the bf16 planner", in.model.name));
  }
  const int E = c.engine_per_replica();
  c.stage_ = DTypeSize(in.trainer_dtype);
  c.mg_ = c.c_->megatron_sources();
  c.scale_of_.resize(E);
  for (int e = 0; e < E; ++e) {
    const auto& params = c.map().ranks[e].params;
    std::unordered_map<std::string_view, int32_t> idx;
    for (size_t i = 0; i < params.size(); ++i) idx.emplace(params[i].name, static_cast<int32_t>(i));
    c.scale_of_[e].assign(params.size(), -1);
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].dtype != DType::kF8E4M3) continue;
      auto it = idx.find(WeightScaleName(params[i].name));
      if (it == idx.end()) {
        return InternalError(
            fmt::format("engine rank {}: '{}' has no weight_scale_inv", e, params[i].name));
      }
      c.scale_of_[e][i] = it->second;
    }
  }
  if (c.mg_) {
    SS_RETURN_IF_ERROR(c.CheckMegatronGrid());
  } else if (in.options.straddle == Fp8Split::kAmax) {
    // Every straddling band of the job (any engine rank's, any column range), once: the unit of
    // the amax exchange (AmaxLayout).
    std::vector<std::pair<int32_t, int64_t>> bands;
    for (int e = 0; e < E; ++e) {
      c.Walk(
          e,
          [&](const Fp8Unit& u) {
            if (u.encoding == Encoding::kAmax)
              bands.emplace_back(u.tensor, u.src.offset[0] / B * B);
          },
          nullptr);
    }
    std::sort(bands.begin(), bands.end());
    bands.erase(std::unique(bands.begin(), bands.end()), bands.end());
    c.amax_bands_ = std::move(bands);
  }
  return c;
}

void Fp8Context::Walk(int e, const std::function<void(const Fp8Unit&)>& fn,
                      std::vector<StagedBand>* staged) const {
  WalkState st;
  st.counter.assign(mg_ ? mg_->sources.size() : static_cast<size_t>(c_->shards()), 0);
  st.staged = staged;
  c_->ForEachUnit(e, [&](const PlanUnit& u) {
    if (mg_) {
      CutSourceUnit(e, u, &st, fn);
    } else {
      CutChunkUnit(e, u, &st, fn);
    }
  });
}

void Fp8Context::CutChunkUnit(int e, const PlanUnit& pu, WalkState* st,
                              const std::function<void(const Fp8Unit&)>& fn) const {
  // The walk visits a piece's chunks in order, so a band straddling chunks k0 < k1 is met first
  // in chunk k0 (where a staged band is created) and then in the chunks after it.
  const FlatPiece& pc = c_->pieces()[pu.piece];
  const int32_t pi = pc.param, tensor = pc.tensor;
  const bool quant = map().ranks[e].params[pi].dtype == DType::kF8E4M3;
  const int64_t ch = chunk_rows(tensor), k = pu.chunk;
  const int64_t a = pc.src.offset[0], b = a + pc.src.extent[0];
  const int64_t lo = pu.src.offset[0], hi = lo + pu.src.extent[0];
  const int dd = pc.dst.ndim - pc.src.ndim;  // dst dim of src dim 0
  auto rows = [&](int64_t r0, int64_t r1, Region* s, Region* d) {
    *s = pc.src;
    s->offset[0] = r0;
    s->extent[0] = r1 - r0;
    *d = pc.dst;
    d->offset[dd] += r0 - a;
    d->extent[dd] = r1 - r0;
  };
  auto unit = [&](Encoding kind, int64_t r0, int64_t r1) {
    Fp8Unit u;
    u.encoding = kind;
    u.tensor = tensor;
    u.param = pi;
    u.scale_param = quant ? scale_of_[e][pi] : -1;
    rows(r0, r1, &u.src, &u.dst);
    u.chunk = k;
    u.index = st->counter[k]++;
    return u;
  };
  if (!quant) return fn(unit(Encoding::kCopy, lo, hi));
  int64_t run0 = -1;
  auto flush = [&](int64_t end) {
    if (run0 < 0) return;
    Fp8Unit u = unit(Encoding::kQuantize, run0, end);
    u.scale_dst = BlockRegion(u.dst);
    fn(u);
    run0 = -1;
  };
  // Bands of 128 source rows from the piece's first row (on the grid: the shard map checks it),
  // from the band holding this chunk's first row.
  for (int64_t r = a + (lo - a) / B * B; r < hi; r += B) {
    const int64_t re = std::min(b, r + B);
    const int64_t k0 = r / ch, k1 = (re - 1) / ch;
    if (k0 == k1) {  // inside this chunk: joins its run of quantized bands
      if (run0 < 0) run0 = r;
      continue;
    }
    flush(r);
    const int64_t r0 = std::max(r, k * ch), r1 = std::min(re, (k + 1) * ch);
    if (inputs().options.straddle == Fp8Split::kAmax) {
      // A band straddling chunks [k0, k1], quantized by its holders with the block's amax
      // exchanged among them; the holder of its first row sends the scales.
      Fp8Unit u = unit(Encoding::kAmax, r0, r1);
      if (k != k0) u.scale_param = -1;
      if (k == k0) u.scale_dst = BlockRegion(u.dst);
      fn(u);
      continue;
    }
    // A band straddling chunks [k0, k1]: the receiver quantizes it from staged raw values.
    if (k == k0) {
      StagedBand band;
      band.tensor = tensor;
      band.param = pi;
      band.scale_param = scale_of_[e][pi];
      rows(r, re, &band.src, &band.dst);
      band.scale_dst = BlockRegion(band.dst);
      band.dtype = inputs().trainer_dtype;
      band.staging_offset = st->staging;
      band.bytes = band.src.numel() * stage_;
      st->staging += AlignUp8(band.bytes);
      st->band = st->bands++;
      st->band_offset = band.staging_offset;
      if (st->staged != nullptr) st->staged->push_back(band);
    }
    Fp8Unit u = unit(Encoding::kStage, r0, r1);
    u.stage = st->band;
    u.staging_offset = st->band_offset;
    u.dst = Region::Make({r0 - r, 0}, {r1 - r0, pc.src.extent[1]});
    fn(u);
  }
  flush(hi);
}

void Fp8Context::Split(const Fp8Unit& u, std::vector<TransferOp>* out) const {
  const int64_t cap = inputs().options.bucket_bytes;
  auto base = [&]() {
    TransferOp op;
    op.encoding = u.encoding;
    op.tensor = u.tensor;
    op.param = u.param;
    op.scale_param = u.encoding == Encoding::kCopy ? -1 : u.scale_param;
    op.stage = u.stage;
    op.staging_offset = u.staging_offset;
    return op;
  };
  if (u.encoding == Encoding::kAmax) {
    // Rows of one block row: split on 128-column boundaries only (caps below a 128-row band).
    const bool sc = u.scale_param >= 0;
    const int dr = u.dst.ndim - 2;
    const int64_t R = u.dst.extent[dr], C = u.dst.extent[dr + 1];
    int64_t step = C;
    if (Fp8PartWireBytes(R, C, sc) > cap) {
      step = B;
      while (step + B < C && Fp8PartWireBytes(R, step + B, sc) <= cap) step += B;
    }
    for (int64_t c = 0; c < C; c += step) {
      TransferOp op = base();
      const int64_t m = std::min(step, C - c);
      SubMatrix(u, 0, R, c, m, &op.src, &op.dst);
      if (sc) op.scale_dst = BlockRegion(op.dst);
      op.bytes = Fp8PartWireBytes(R, m, sc);
      out->push_back(op);
    }
    return;
  }
  if (u.encoding != Encoding::kQuantize) {
    const int64_t elem = u.encoding == Encoding::kCopy ? wire_size() : stage_;
    SplitBox(u.dst, elem, cap - 8, [&](const Region& sub) {
      TransferOp op = base();
      op.dst = sub;
      op.src = MapToSrc(u.src, u.dst, sub);
      op.bytes = AlignUp8(sub.numel() * elem);
      out->push_back(op);
    });
    return;
  }
  const int dr = u.dst.ndim - 2;
  const int64_t R = u.dst.extent[dr], C = u.dst.extent[dr + 1];
  auto add = [&](int64_t r0, int64_t n, int64_t c0, int64_t m) {
    TransferOp op = base();
    SubMatrix(u, r0, n, c0, m, &op.src, &op.dst);
    op.scale_dst = BlockRegion(op.dst);
    op.bytes = Fp8WireBytes(n, m);
    out->push_back(op);
  };
  if (Fp8WireBytes(R, C) <= cap) return add(0, R, 0, C);
  int64_t bands = 0;
  while (bands * B < R && Fp8WireBytes((bands + 1) * B, C) <= cap) ++bands;
  if (bands > 0) {
    for (int64_t r = 0; r < R; r += bands * B) add(r, std::min(bands * B, R - r), 0, C);
    return;
  }
  int64_t blocks = 1;
  while ((blocks + 1) * B < C && Fp8WireBytes(B, (blocks + 1) * B) <= cap) ++blocks;
  for (int64_t r = 0; r < R; r += B) {
    for (int64_t c = 0; c < C; c += blocks * B) {
      add(r, std::min(B, R - r), c, std::min(blocks * B, C - c));
    }
  }
}

void Fp8Context::AmaxLayout(int s, std::vector<AmaxBand>* mine, std::vector<int64_t>* blocks,
                            std::vector<std::vector<char>>* peers, int group) const {
  // Each chunk's value lists the partials of the bands it touches, in band order (tensor, row).
  const int S = c_->shards();
  std::vector<int64_t> next(S, 0);
  for (const auto& [tensor, row0] : amax_bands_) {
    const Shape& shape = inventory()[tensor].shape;
    const int64_t ch = chunk_rows(tensor);
    const int64_t rows = std::min(B, shape[0] - row0), nb = CeilDiv(shape[1], B);
    const int64_t k0 = row0 / ch, k1 = (row0 + rows - 1) / ch;
    if (mine != nullptr && s >= k0 && s <= k1) {
      AmaxBand ab;
      ab.tensor = tensor;
      ab.row0 = row0;
      ab.rows = rows;
      ab.own0 = std::max(row0, s * ch);
      ab.own_rows = std::min(row0 + rows, (s + 1) * ch) - ab.own0;
      ab.blocks = nb;
      ab.slot = next[s];
      for (int64_t k = k0; k <= k1; ++k) {
        if (k != s) ab.others.push_back({static_cast<int32_t>(group * S + k), next[k]});
      }
      mine->push_back(std::move(ab));
    }
    for (int64_t k = k0; k <= k1; ++k) {
      next[k] += nb;
      for (int64_t j = k0; peers != nullptr && j <= k1; ++j) {
        if (j != k) (*peers)[k][j] = 1;
      }
    }
  }
  if (blocks != nullptr) *blocks = std::move(next);
}

Result<RankPlan> Fp8Context::PlanForRank(int sync_rank) const {
  const PlanInputs& in = inputs();
  const int S_world = trainer_world(), E = engine_per_replica(), D = replicas(), S = c_->shards();
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(in, sync_rank));
  RankPlan rp;
  rp.rank = sync_rank;
  rp.plan_hash = hash();
  const int64_t cap = in.options.bucket_bytes;
  if (who.is_trainer && mg_) {
    const int t = who.trainer_rank;
    // The sources this rank holds (in any place).
    std::vector<char> holds(mg_->sources.size(), 0);
    for (size_t si = 0; si < mg_->sources.size(); ++si) {
      const MegatronSource& s = mg_->sources[si];
      for (int32_t j = s.place_begin; j < s.place_end && !holds[si]; ++j) {
        holds[si] = HolderIndex(in.trainer.megatron, mg_->places[j].holders, t) >= 0;
      }
    }
    for (int e = 0; e < E; ++e) {
      std::vector<Fp8Unit> mine;
      Walk(
          e,
          [&](const Fp8Unit& u) {
            if (holds[u.source]) mine.push_back(u);
          },
          nullptr);
      for (int d = 0; d < D; ++d) {
        Message m;
        m.src = sync_rank;
        m.dst = S_world + d * E + e;
        for (const Fp8Unit& u : mine) {
          const auto [rank, place] = SenderOf(u, e, d);
          if (rank != t) continue;
          const size_t first = m.ops.size();
          Split(u, &m.ops);
          for (size_t i = first; i < m.ops.size(); ++i) {
            m.local.push_back(
                LocalSourceOf(mg_->sources[u.source].hf, mg_->places[place], m.ops[i].src));
          }
        }
        if (m.ops.empty()) continue;
        FinishMessage(&m, cap);
        rp.sends.push_back(std::move(m));
      }
    }
    std::sort(rp.sends.begin(), rp.sends.end(),
              [](const Message& a, const Message& b) { return a.dst < b.dst; });
    return rp;
  }
  if (who.is_trainer) {
    const int t = who.trainer_rank, s = t % S;
    for (int e = 0; e < E; ++e) {
      std::vector<Fp8Unit> mine;
      Walk(
          e,
          [&](const Fp8Unit& u) {
            if (u.chunk == s) mine.push_back(u);
          },
          nullptr);
      for (int d = 0; d < D; ++d) {
        Message m;
        m.src = sync_rank;
        m.dst = S_world + d * E + e;
        for (const Fp8Unit& u : mine) {
          if (SourceOf(u, e, d) == t) Split(u, &m.ops);
        }
        if (m.ops.empty()) continue;
        FinishMessage(&m, cap);
        rp.sends.push_back(std::move(m));
      }
    }
    std::sort(rp.sends.begin(), rp.sends.end(),
              [](const Message& a, const Message& b) { return a.dst < b.dst; });
    if (!amax_bands_.empty()) {
      std::vector<int64_t> blocks;
      AmaxLayout(s, &rp.amax_bands, &blocks, nullptr, t / S);
      rp.amax_blocks = blocks[s];
      for (const AmaxBand& b : rp.amax_bands) {
        for (const AmaxHolder& h : b.others) rp.amax_peers.push_back(h.rank);
      }
      std::sort(rp.amax_peers.begin(), rp.amax_peers.end());
      rp.amax_peers.erase(std::unique(rp.amax_peers.begin(), rp.amax_peers.end()),
                          rp.amax_peers.end());
    }
    return rp;
  }
  const int d = who.replica, e = who.pp_rank * in.rollout.shard.tp + who.tp_rank;
  std::vector<std::vector<TransferOp>> by_src(S_world);
  std::vector<std::vector<LocalSource>> local(mg_ ? S_world : 0);
  Walk(
      e,
      [&](const Fp8Unit& u) {
        const auto [src, place] = SenderOf(u, e, d);
        std::vector<TransferOp>& ops = by_src[src];
        const size_t first = ops.size();
        Split(u, &ops);
        for (size_t i = first; mg_ && i < ops.size(); ++i) {
          local[src].push_back(
              LocalSourceOf(mg_->sources[u.source].hf, mg_->places[place], ops[i].src));
        }
      },
      &rp.staged);
  for (const StagedBand& b : rp.staged) rp.staging_bytes = b.staging_offset + AlignUp8(b.bytes);
  for (int src = 0; src < S_world; ++src) {
    if (by_src[src].empty()) continue;
    Message m;
    m.src = src;
    m.dst = sync_rank;
    m.ops = std::move(by_src[src]);
    if (mg_) m.local = std::move(local[src]);
    FinishMessage(&m, cap);
    rp.recvs.push_back(std::move(m));
  }
  return rp;
}

}  // namespace plan_internal

}  // namespace shardsync
