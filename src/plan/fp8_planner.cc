// The block-FP8 planner (fp8_plan.h, docs/fp8.md).
//
// Geometry. As in the bf16 planner, every trainer layout is R groups x S dim-0 shards of
// torch.chunk size; HF tensors are chunked along dim 0, which for every quantized tensor is the
// weight's output rows, i.e. the block rows. A quantized engine piece is cut into bands of 128
// source rows (block rows of the HF tensor: the shard map guarantees the piece starts on the
// grid). A band inside one chunk is quantized by that chunk's holder; consecutive such bands of
// one chunk merge into one kQuantize unit. A band whose rows cross a chunk boundary becomes a
// staged band of the receiver, fed by one kStage unit per chunk it touches. Unquantized pieces
// are cut per chunk into kCopy units.
//
// Sources. With R > 1 replica groups every unit of (replica d, engine rank e) is served by group
// (index + e + d) % R, `index` being the unit's position among e's units of its chunk: a
// round-robin any rank recomputes from its own walk (the bf16 planner's byte-balanced cuts are not
// reused here; units are at most a few MiB, so the imbalance is one unit per chunk and pair).
//
// Megatron trainers. The HF tensors are partitioned into the trainer's sources (megatron.h
// BuildMegatronSources: one HF box held the same way by a set of ranks, with where each holder
// keeps it in its local parameters). Each engine piece x each source of its tensor is one box,
// which for quantized weights must sit on the 128 grid (CheckMegatronGrid refuses otherwise), so
// it becomes kQuantize / kCopy units read from the holder's local parameter (Message::local);
// a box with several holders (DP / CP replicas) is cut along dim 0 into up to `holders` units
// spread round-robin, as for HSDP groups. Nothing is staged.
//
// Ops. A unit becomes ops under the bucket cap: kCopy and kStage split like the bf16 planner's
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
namespace {

// One 128 x 128 block with its scale must fit a bucket.
constexpr int64_t kMinFp8Bucket = int64_t{64} << 10;

int64_t AlignUp8(int64_t n) { return (n + 7) & ~int64_t{7}; }

}  // namespace

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
  Fp8Context c;
  c.in_ = in;
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
  if (in.options.bucket_bytes < kMinFp8Bucket) {
    return InvalidArgumentError(fmt::format(
        "--bucket-mb: block-FP8 plans need a bucket of at least 64 KiB (one 128 x 128 block with "
        "its scale), got {} bytes",
        in.options.bucket_bytes));
  }
  SS_ASSIGN_OR_RETURN(c.map_, BuildShardMap(in.model, sh));
  c.inv_ = HfTensorInventory(in.model);
  c.S_world_ = in.trainer.world();
  c.R_ = in.trainer.groups();
  c.S_ = in.trainer.shards_per_group();
  c.D_ = in.rollout.dp;
  c.E_ = sh.tp * sh.pp;
  c.wire_ = DTypeSize(in.options.wire_dtype);
  c.stage_ = DTypeSize(in.trainer_dtype);
  c.hash_ = PlanHash(in);
  c.by_name_.reserve(c.inv_.size() * 2);
  c.chunk_.resize(c.inv_.size());
  for (size_t i = 0; i < c.inv_.size(); ++i) {
    c.by_name_.emplace(c.inv_[i].name, static_cast<int32_t>(i));
    c.chunk_[i] = std::max<int64_t>(1, CeilDiv(c.inv_[i].shape[0], c.S_));
  }
  c.scale_of_.resize(c.E_);
  for (int e = 0; e < c.E_; ++e) {
    const auto& params = c.map_.ranks[e].params;
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
  if (in.trainer.kind != TrainerSpec::Kind::kMegatron && in.options.fp8_split == Fp8Split::kAmax) {
    // Every straddling band of the job (any engine rank's, any column range), once: the unit of
    // the amax exchange (AmaxLayout).
    std::vector<std::pair<int32_t, int64_t>> bands;
    for (int e = 0; e < c.E_; ++e) {
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
  if (in.trainer.kind == TrainerSpec::Kind::kMegatron) {
    const MegatronLayout& l = in.trainer.megatron;
    SS_ASSIGN_OR_RETURN(MegatronDims dims, ComputeMegatronDims(in.model, l));
    SS_ASSIGN_OR_RETURN(MegatronSources ms, BuildMegatronSources(in.model, l, dims, c.inv_));
    c.mg_ = std::make_shared<const MegatronSources>(std::move(ms));
    SS_RETURN_IF_ERROR(c.CheckMegatronGrid());
  }
  return c;
}

void Fp8Context::Walk(int e, const std::function<void(const Fp8Unit&)>& fn,
                      std::vector<StagedBand>* staged) const {
  if (mg_) return WalkMegatron(e, fn);
  const EngineRankShards& rk = map_.ranks[e];
  std::vector<char> is_scale(rk.params.size(), 0);
  for (int32_t s : scale_of_[e]) {
    if (s >= 0) is_scale[s] = 1;
  }
  std::vector<int64_t> counter(S_, 0);
  int32_t bands = 0;
  int64_t staging = 0;
  for (size_t pi = 0; pi < rk.params.size(); ++pi) {
    if (is_scale[pi]) continue;
    const EngineParam& p = rk.params[pi];
    const bool quant = p.dtype == DType::kF8E4M3;
    for (const Piece& pc : p.pieces) {
      if (pc.src.empty()) continue;
      const int32_t tensor = by_name_.at(pc.source);
      const int64_t ch = chunk_[tensor];
      const int64_t a = pc.src.offset[0], b = a + pc.src.extent[0];
      const int dd = pc.dst.ndim - pc.src.ndim;  // dst dim of src dim 0
      auto rows = [&](int64_t r0, int64_t r1, Region* s, Region* d) {
        *s = pc.src;
        s->offset[0] = r0;
        s->extent[0] = r1 - r0;
        *d = pc.dst;
        d->offset[dd] += r0 - a;
        d->extent[dd] = r1 - r0;
      };
      auto emit = [&](Encoding kind, int64_t r0, int64_t r1, int64_t chunk) {
        Fp8Unit u;
        u.encoding = kind;
        u.tensor = tensor;
        u.param = static_cast<int32_t>(pi);
        u.scale_param = quant ? scale_of_[e][pi] : -1;
        rows(r0, r1, &u.src, &u.dst);
        if (kind == Encoding::kQuantize) u.scale_dst = BlockRegion(u.dst);
        u.chunk = chunk;
        u.index = counter[chunk]++;
        fn(u);
      };
      if (!quant) {
        for (int64_t k = a / ch; k <= (b - 1) / ch; ++k) {
          emit(Encoding::kCopy, std::max(a, k * ch), std::min(b, (k + 1) * ch), k);
        }
        continue;
      }
      int64_t run0 = -1, run_chunk = -1;
      auto flush = [&](int64_t end) {
        if (run0 >= 0) emit(Encoding::kQuantize, run0, end, run_chunk);
        run0 = -1;
      };
      for (int64_t r = a; r < b; r += B) {
        const int64_t re = std::min(b, r + B);
        const int64_t k0 = r / ch, k1 = (re - 1) / ch;
        if (k0 == k1) {
          if (run0 >= 0 && run_chunk != k0) flush(r);
          if (run0 < 0) {
            run0 = r;
            run_chunk = k0;
          }
          continue;
        }
        flush(r);
        if (in_.options.fp8_split == Fp8Split::kAmax) {
          // A band straddling chunks [k0, k1], quantized by its holders with the block's amax
          // exchanged among them; the holder of its first row sends the scales.
          for (int64_t k = k0; k <= k1; ++k) {
            Fp8Unit u;
            u.encoding = Encoding::kAmax;
            u.tensor = tensor;
            u.param = static_cast<int32_t>(pi);
            u.scale_param = k == k0 ? scale_of_[e][pi] : -1;
            rows(std::max(r, k * ch), std::min(re, (k + 1) * ch), &u.src, &u.dst);
            if (k == k0) u.scale_dst = BlockRegion(u.dst);
            u.chunk = k;
            u.index = counter[k]++;
            fn(u);
          }
          continue;
        }
        // A band straddling chunks [k0, k1]: the receiver quantizes it from staged raw values.
        StagedBand band;
        band.tensor = tensor;
        band.param = static_cast<int32_t>(pi);
        band.scale_param = scale_of_[e][pi];
        rows(r, re, &band.src, &band.dst);
        band.scale_dst = BlockRegion(band.dst);
        band.dtype = in_.trainer_dtype;
        band.staging_offset = staging;
        band.bytes = band.src.numel() * stage_;
        staging += AlignUp8(band.bytes);
        const int32_t id = bands++;
        if (staged != nullptr) staged->push_back(band);
        const int64_t cols = pc.src.extent[1];
        for (int64_t k = k0; k <= k1; ++k) {
          const int64_t r0 = std::max(r, k * ch), r1 = std::min(re, (k + 1) * ch);
          Fp8Unit u;
          u.encoding = Encoding::kStage;
          u.tensor = tensor;
          u.param = static_cast<int32_t>(pi);
          u.scale_param = scale_of_[e][pi];
          u.stage = id;
          u.staging_offset = band.staging_offset;
          u.src = band.src;
          u.src.offset[0] = r0;
          u.src.extent[0] = r1 - r0;
          u.dst = Region::Make({r0 - r, 0}, {r1 - r0, cols});
          u.chunk = k;
          u.index = counter[k]++;
          fn(u);
        }
      }
      flush(b);
    }
  }
}

void Fp8Context::Split(const Fp8Unit& u, std::vector<TransferOp>* out) const {
  const int64_t cap = in_.options.bucket_bytes;
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
    const int64_t elem = u.encoding == Encoding::kCopy ? wire_ : stage_;
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
  std::vector<int64_t> next(S_, 0);
  for (const auto& [tensor, row0] : amax_bands_) {
    const Shape& shape = inv_[tensor].shape;
    const int64_t ch = chunk_[tensor];
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
        if (k != s) ab.others.push_back({static_cast<int32_t>(group * S_ + k), next[k]});
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
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(in_, sync_rank));
  RankPlan rp;
  rp.rank = sync_rank;
  rp.plan_hash = hash_;
  const int64_t cap = in_.options.bucket_bytes;
  if (who.is_trainer && mg_) {
    const int t = who.trainer_rank;
    // The sources this rank holds (in any place).
    std::vector<char> holds(mg_->sources.size(), 0);
    for (size_t si = 0; si < mg_->sources.size(); ++si) {
      const MegatronSource& s = mg_->sources[si];
      for (int32_t j = s.place_begin; j < s.place_end && !holds[si]; ++j) {
        holds[si] = HolderIndex(in_.trainer.megatron, mg_->places[j].holders, t) >= 0;
      }
    }
    for (int e = 0; e < E_; ++e) {
      std::vector<Fp8Unit> mine;
      Walk(
          e,
          [&](const Fp8Unit& u) {
            if (holds[u.source]) mine.push_back(u);
          },
          nullptr);
      for (int d = 0; d < D_; ++d) {
        Message m;
        m.src = sync_rank;
        m.dst = S_world_ + d * E_ + e;
        for (const Fp8Unit& u : mine) {
          const auto [rank, place] = SenderOf(u, e, d);
          if (rank != t) continue;
          const size_t first = m.ops.size();
          Split(u, &m.ops);
          for (size_t i = first; i < m.ops.size(); ++i) {
            m.local.push_back(LocalOf(m.ops[i], u.source, place));
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
    const int t = who.trainer_rank, s = t % S_;
    for (int e = 0; e < E_; ++e) {
      std::vector<Fp8Unit> mine;
      Walk(
          e,
          [&](const Fp8Unit& u) {
            if (u.chunk == s) mine.push_back(u);
          },
          nullptr);
      for (int d = 0; d < D_; ++d) {
        Message m;
        m.src = sync_rank;
        m.dst = S_world_ + d * E_ + e;
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
      AmaxLayout(s, &rp.amax_bands, &blocks, nullptr, t / S_);
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
  const int d = who.replica, e = who.pp_rank * in_.rollout.shard.tp + who.tp_rank;
  std::vector<std::vector<TransferOp>> by_src(S_world_);
  std::vector<std::vector<LocalSource>> local(mg_ ? S_world_ : 0);
  Walk(
      e,
      [&](const Fp8Unit& u) {
        const auto [src, place] = SenderOf(u, e, d);
        std::vector<TransferOp>& ops = by_src[src];
        const size_t first = ops.size();
        Split(u, &ops);
        for (size_t i = first; mg_ && i < ops.size(); ++i) {
          local[src].push_back(LocalOf(ops[i], u.source, place));
        }
      },
      &rp.staged);
  for (const StagedBand& b : rp.staged) rp.staging_bytes = b.staging_offset + AlignUp8(b.bytes);
  for (int src = 0; src < S_world_; ++src) {
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
