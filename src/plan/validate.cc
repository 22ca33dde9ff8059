// ValidatePlan: enumerates every rank's plan of a small job and checks it element by element
// against the shard map (a brute-force oracle independent of the planner's arithmetic).
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <unordered_map>

#include "plan/planner.h"

namespace shardsync::plan_internal {
namespace {

// Upper bound on engine elements checked one by one.
constexpr int64_t kMaxValidateElements = int64_t{1} << 26;

std::vector<int64_t> LinearIndices(const Region& r, const Shape& shape) {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(r.numel()));
  ForEachRun(r, shape, [&](int64_t off, int64_t len) {
    for (int64_t i = 0; i < len; ++i) out.push_back(off + i);
  });
  return out;
}

bool SameOp(const TransferOp& a, const TransferOp& b) {
  return a.tensor == b.tensor && a.param == b.param && a.src == b.src && a.dst == b.dst &&
         a.wire_offset == b.wire_offset && a.bytes == b.bytes;
}

// The sender holds op i's bytes where the message says: FSDP-like layouts in their dim-0 shard of
// the tensor (no local sources); Megatron in local parameter local[i].param at local[i].region,
// by a piece of that parameter that carries the tensor (trainer map of the sender, cached).
class HeldCheck {
 public:
  HeldCheck(const PlanInputs& in, const std::vector<HfTensor>& inv) : in_(in), inv_(inv) {}
  Status Check(const Message& m, size_t i) {
    const TransferOp& op = m.ops[i];
    const HfTensor& t = inv_[op.tensor];
    if (in_.trainer.kind != TrainerSpec::Kind::kMegatron) {
      if (m.local.empty() &&
          RegionContains(TrainerHeldRegion(in_.trainer, m.src, t.shape), op.src)) {
        return OkStatus();
      }
      return InternalError(fmt::format("message {}->{}: trainer rank {} does not hold {} of '{}'",
                                       m.src, m.dst, m.src, op.src.ToString(), t.name));
    }
    auto it = maps_.find(m.src);
    if (it == maps_.end()) {
      SS_ASSIGN_OR_RETURN(TrainerRankParams p,
                          BuildTrainerParams(in_.model, in_.trainer, m.src, in_.trainer_dtype));
      it = maps_.emplace(m.src, std::move(p)).first;
    }
    const auto& params = it->second.params;
    const LocalSource ls = m.local.size() == m.ops.size() ? m.local[i] : LocalSource{-1, {}};
    if (ls.param >= 0 && ls.param < static_cast<int32_t>(params.size())) {
      const TrainerParam& p = params[ls.param];
      for (const TrainerPiece& pc : p.pieces) {
        if (pc.source != t.name || !RegionContains(pc.src, op.src)) continue;
        Region want = op.src;
        for (int i = 0; i < want.ndim; ++i) {
          want.offset[i] += pc.local.offset[i] - pc.src.offset[i];
        }
        if (want == ls.region && RegionInside(want, p.shape)) return OkStatus();
      }
    }
    return InternalError(fmt::format(
        "message {}->{}: trainer rank {} does not hold {} of '{}' at {} of its parameter {}", m.src,
        m.dst, m.src, op.src.ToString(), t.name, ls.region.ToString(), ls.param));
  }

 private:
  const PlanInputs& in_;
  const std::vector<HfTensor>& inv_;
  std::map<int, TrainerRankParams> maps_;
};

Status CheckMessageShape(const Message& m, int64_t cap, int64_t wire) {
  int64_t off = 0;
  for (size_t i = 0; i < m.ops.size(); ++i) {
    const TransferOp& op = m.ops[i];
    if (op.wire_offset != off || op.bytes != op.src.numel() * wire || op.bytes <= 0) {
      return InternalError(
          fmt::format("message {}->{}: op {} has wire offset {} / bytes {}, "
                      "expected offset {} and {} bytes",
                      m.src, m.dst, i, op.wire_offset, op.bytes, off, op.src.numel() * wire));
    }
    if (op.bytes > cap) {
      return InternalError(fmt::format("message {}->{}: op {} is {} bytes, over the bucket cap {}",
                                       m.src, m.dst, i, op.bytes, cap));
    }
    off += op.bytes;
  }
  if (off != m.bytes) {
    return InternalError(
        fmt::format("message {}->{}: bytes {} != sum of ops {}", m.src, m.dst, m.bytes, off));
  }
  return CheckBucketsCoverOps(m, cap);
}

}  // namespace

Status CheckBucketsCoverOps(const Message& m, int64_t cap) {
  int32_t next = 0;
  int64_t boff = 0;
  const auto nops = static_cast<int32_t>(m.ops.size());
  for (const Bucket& b : m.buckets) {
    int64_t sum = 0;
    // Bounded by the ops: a malformed plan's bucket may name ops past the end.
    for (int32_t i = std::max(b.op_begin, 0); i < b.op_end && i < nops; ++i) sum += m.ops[i].bytes;
    if (b.op_begin != next || b.op_end <= b.op_begin || b.op_end > nops || b.wire_offset != boff ||
        b.bytes != sum || (b.bytes > cap && b.op_end - b.op_begin > 1)) {
      return InternalError(fmt::format("message {}->{}: bucket [{}, {}) is inconsistent", m.src,
                                       m.dst, b.op_begin, b.op_end));
    }
    next = b.op_end;
    boff += b.bytes;
  }
  if (next != nops) {
    return InternalError(fmt::format("message {}->{}: buckets do not cover the ops", m.src, m.dst));
  }
  return OkStatus();
}

Status ValidateContext(const PlanContext& ctx) {
  const PlanInputs& in = ctx.inputs();
  const ShardMap& map = ctx.map();
  const auto& inv = ctx.inventory();
  const int S = ctx.trainer_world(), E = ctx.engine_per_replica(), D = ctx.replicas();
  const int64_t wire = DTypeSize(in.options.wire_dtype);
  const int64_t cap = in.options.bucket_bytes;
  int64_t elems = 0;
  for (const auto& rk : map.ranks) {
    for (const auto& p : rk.params) elems += p.numel();
  }
  if (elems * D > kMaxValidateElements) {
    return FailedPreconditionError(
        fmt::format("ValidatePlan: {} engine elements exceed the brute-force limit {}", elems * D,
                    kMaxValidateElements));
  }
  std::unordered_map<std::string, int32_t> by_name;
  for (size_t i = 0; i < inv.size(); ++i) by_name[inv[i].name] = static_cast<int32_t>(i);

  // Oracle: for every engine element of one replica, the (tensor, element) it must hold, from the
  // unmerged pieces; -2 marks zero-fill.
  struct Expect {
    std::vector<int32_t> tensor;
    std::vector<int64_t> elem;
  };
  std::vector<std::vector<Expect>> expect(E);
  for (int e = 0; e < E; ++e) {
    const auto& rk = map.ranks[e];
    expect[e].resize(rk.params.size());
    for (size_t pi = 0; pi < rk.params.size(); ++pi) {
      const EngineParam& prm = rk.params[pi];
      Expect& x = expect[e][pi];
      x.tensor.assign(static_cast<size_t>(prm.numel()), -1);
      x.elem.assign(static_cast<size_t>(prm.numel()), -1);
      for (const ZeroFill& z : prm.zero_fills) {
        for (int64_t i : LinearIndices(z.dst, prm.shape)) x.tensor[i] = -2;
      }
      for (const Piece& pc : prm.pieces) {
        const int32_t t = by_name.at(pc.source);
        const auto s = LinearIndices(pc.src, inv[t].shape);
        const auto d = LinearIndices(pc.dst, prm.shape);
        for (size_t i = 0; i < d.size(); ++i) {
          if (x.tensor[d[i]] != -1) {
            return InternalError(fmt::format(
                "shard map rank {} param '{}': element {} covered twice", e, prm.name, d[i]));
          }
          x.tensor[d[i]] = t;
          x.elem[d[i]] = s[i];
        }
      }
    }
  }

  // Sender view.
  std::map<std::pair<int, int>, Message> sent;
  std::vector<int64_t> send_bytes(S, 0), send_ops(S, 0);
  for (int r = 0; r < S; ++r) {
    SS_ASSIGN_OR_RETURN(RankPlan rp, ctx.PlanForRank(r));
    int last = -1;
    for (Message& m : rp.sends) {
      if (m.src != r || m.dst < S || m.dst <= last) {
        return InternalError(
            fmt::format("trainer rank {}: sends not ordered by dst at {}", r, m.dst));
      }
      last = m.dst;
      SS_RETURN_IF_ERROR(CheckMessageShape(m, cap, wire));
      send_bytes[r] += m.bytes;
      send_ops[r] += static_cast<int64_t>(m.ops.size());
      sent.emplace(std::make_pair(m.src, m.dst), std::move(m));
    }
    if (!rp.recvs.empty()) return InternalError(fmt::format("trainer rank {} receives", r));
  }

  SS_ASSIGN_OR_RETURN(DetailedSummary ds, ctx.Summarize(SummaryOptions{}));
  const PlanSummary& sum = ds.summary;
  HeldCheck held(in, inv);
  size_t matched = 0;
  int64_t total_ops = 0, total_msgs = 0;
  for (int j = 0; j < D * E; ++j) {
    const int rank = S + j, e = j % E;
    SS_ASSIGN_OR_RETURN(RankPlan rp, ctx.PlanForRank(rank));
    const auto& rk = map.ranks[e];
    std::vector<std::vector<uint8_t>> covered(rk.params.size());
    for (size_t pi = 0; pi < rk.params.size(); ++pi) covered[pi].assign(rk.params[pi].numel(), 0);
    int last = -1;
    int64_t recv = 0, ops = 0;
    for (const Message& m : rp.recvs) {
      if (m.dst != rank || m.src >= S || m.src <= last) {
        return InternalError(
            fmt::format("engine rank {}: recvs not ordered by src at {}", rank, m.src));
      }
      last = m.src;
      SS_RETURN_IF_ERROR(CheckMessageShape(m, cap, wire));
      auto it = sent.find({m.src, m.dst});
      if (it == sent.end()) {
        return InternalError(
            fmt::format("message {}->{}: receiver expects it, sender has none", m.src, m.dst));
      }
      const Message& s = it->second;
      bool same = s.ops.size() == m.ops.size() && s.buckets.size() == m.buckets.size();
      for (size_t i = 0; same && i < m.ops.size(); ++i) same = SameOp(s.ops[i], m.ops[i]);
      same = same && s.local.size() == m.local.size();
      for (size_t i = 0; same && i < m.local.size(); ++i) {
        same = s.local[i].param == m.local[i].param && s.local[i].region == m.local[i].region;
      }
      if (!same) {
        return InternalError(
            fmt::format("message {}->{}: sender and receiver disagree", m.src, m.dst));
      }
      ++matched;
      recv += m.bytes;
      ops += static_cast<int64_t>(m.ops.size());
      const Region none;
      for (size_t oi = 0; oi < m.ops.size(); ++oi) {
        const TransferOp& op = m.ops[oi];
        if (op.tensor < 0 || op.tensor >= static_cast<int32_t>(inv.size()) || op.param < 0 ||
            op.param >= static_cast<int32_t>(rk.params.size())) {
          return OutOfRangeError(fmt::format("message {}->{}: op names tensor {} / param {}", m.src,
                                             m.dst, op.tensor, op.param));
        }
        const HfTensor& t = inv[op.tensor];
        const EngineParam& prm = rk.params[op.param];
        if (!RegionInside(op.src, t.shape) || !RegionInside(op.dst, prm.shape)) {
          return OutOfRangeError(
              fmt::format("message {}->{}: op {} of '{}' -> {} of '{}' out of bounds", m.src, m.dst,
                          op.src.ToString(), t.name, op.dst.ToString(), prm.name));
        }
        SS_RETURN_IF_ERROR(held.Check(m, oi));
        if (!RegionIsContiguous(op.dst, prm.shape)) {
          return InternalError(fmt::format("message {}->{}: dst {} of '{}' is not contiguous",
                                           m.src, m.dst, op.dst.ToString(), prm.name));
        }
        const auto si = LinearIndices(op.src, t.shape);
        const auto di = LinearIndices(op.dst, prm.shape);
        if (si.size() != di.size()) {
          return InternalError(fmt::format("message {}->{}: src {} and dst {} sizes differ", m.src,
                                           m.dst, op.src.ToString(), op.dst.ToString()));
        }
        const Expect& x = expect[e][op.param];
        for (size_t i = 0; i < di.size(); ++i) {
          if (covered[op.param][di[i]]) {
            return InternalError(fmt::format("engine rank {} param '{}': element {} written twice",
                                             rank, prm.name, di[i]));
          }
          covered[op.param][di[i]] = 1;
          if (x.tensor[di[i]] != op.tensor || x.elem[di[i]] != si[i]) {
            return InternalError(fmt::format(
                "engine rank {} param '{}': element {} gets '{}'[{}], the shard map says tensor {} "
                "element {}",
                rank, prm.name, di[i], t.name, si[i], x.tensor[di[i]], x.elem[di[i]]));
          }
        }
      }
    }
    for (size_t pi = 0; pi < rk.params.size(); ++pi) {
      for (size_t i = 0; i < covered[pi].size(); ++i) {
        if (!covered[pi][i] && expect[e][pi].tensor[i] != -2) {
          return InternalError(fmt::format("engine rank {} param '{}': element {} never written",
                                           rank, rk.params[pi].name, i));
        }
      }
    }
    const EngineRankSummary& es = sum.engine_ranks[j];
    if (recv != es.owned_bytes || recv != es.recv_bytes || ops != ds.engine_traffic[j].ops ||
        static_cast<int64_t>(rp.recvs.size()) != ds.engine_traffic[j].messages) {
      return InternalError(fmt::format(
          "engine rank {}: plan receives {} bytes in {} ops / {} messages; summary says {} bytes "
          "({} owned) in {} ops / {} messages",
          rank, recv, ops, rp.recvs.size(), es.recv_bytes, es.owned_bytes, ds.engine_traffic[j].ops,
          ds.engine_traffic[j].messages));
    }
    total_ops += ops;
    total_msgs += static_cast<int64_t>(rp.recvs.size());
  }
  if (matched != sent.size()) {
    return InternalError(fmt::format("{} sent messages have no receiver", sent.size() - matched));
  }
  for (int r = 0; r < S; ++r) {
    if (send_bytes[r] != sum.trainer_ranks[r].send_bytes ||
        send_ops[r] != ds.trainer_traffic[r].ops) {
      return InternalError(fmt::format(
          "trainer rank {}: plan sends {} bytes in {} ops, summary says {} bytes in {} ops", r,
          send_bytes[r], send_ops[r], sum.trainer_ranks[r].send_bytes, ds.trainer_traffic[r].ops));
    }
  }
  if (total_ops != sum.ops || total_msgs != sum.messages) {
    return InternalError(fmt::format("plan has {} ops / {} messages, summary says {} / {}",
                                     total_ops, total_msgs, sum.ops, sum.messages));
  }
  return OkStatus();
}

}  // namespace shardsync::plan_internal
