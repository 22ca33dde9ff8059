// How a bucket's wire image is cut into transfers: one definition for both ends, so every send
// of a two-sided transport meets a receive of the same size posted straight into a parameter.
#include <algorithm>

#include "sync/transfers.h"

namespace shardsync::sync_internal {
namespace {

// A run of wire bytes [wire, wire + len) of the bucket that is contiguous at `at` in one
// address space (a destination parameter or a source shard).
struct Span {
  int64_t wire = 0;
  int64_t len = 0;
  int32_t id = 0;  // parameter (destination) or HF tensor (source)
  uint64_t at = 0;
};

void Append(std::vector<Span>& v, int64_t wire, int64_t len, int32_t id, uint64_t at) {
  if (!v.empty()) {
    Span& r = v.back();
    if (r.id == id && r.at + r.len == at && r.wire + r.len == wire) {
      r.len += len;
      return;
    }
  }
  v.push_back({wire, len, id, at});
}

void Emit(std::vector<WireRun>& out, const Span& d, int64_t from, int64_t len, bool direct,
          int32_t tensor, uint64_t src_offset) {
  // Bounded transfers (kMaxTransferBytes says why).
  for (int64_t off = 0; off < len; off += static_cast<int64_t>(kMaxTransferBytes)) {
    const int64_t n = std::min<int64_t>(kMaxTransferBytes, len - off);
    WireRun r;
    r.param = d.id;
    r.param_offset = d.at + static_cast<uint64_t>(from - d.wire + off);
    r.wire_offset = from + off;
    r.len = static_cast<size_t>(n);
    r.direct = direct;
    r.tensor = direct ? tensor : -1;
    r.src_offset = direct ? src_offset + static_cast<uint64_t>(off) : 0;
    out.push_back(r);
  }
}

}  // namespace

std::vector<WireRun> BucketTransfers(const PlanInputs& in, const std::vector<HfTensor>& inventory,
                                     int src_trainer_rank, const Message& m, const Bucket& b,
                                     const std::function<const Shape&(int)>& dest_shape,
                                     const std::function<const Shape*(int)>& local_shape) {
  const int ws = DTypeSize(in.options.wire_dtype);
  std::vector<Span> dst;
  for (int i = b.op_begin; i < b.op_end; ++i) {
    const TransferOp& op = m.ops[i];
    int64_t w = op.wire_offset - b.wire_offset;
    ForEachRun(op.dst, dest_shape(op.param), [&](int64_t off, int64_t len) {
      Append(dst, w, len * ws, op.param, static_cast<uint64_t>(off) * ws);
      w += len * ws;
    });
  }
  // Source runs only matter when bytes can go out as they are (no cast on the way).
  std::vector<Span> src;
  if (in.trainer_dtype == in.options.wire_dtype && !m.local.empty()) {
    // Megatron: the op's bytes sit at its local region of a local parameter (id: the parameter).
    for (int i = b.op_begin; i < b.op_end; ++i) {
      const LocalSource& ls = m.local.size() == m.ops.size() ? m.local[i] : LocalSource{-1, {}};
      const Shape* shape = local_shape && ls.param >= 0 ? local_shape(ls.param) : nullptr;
      if (shape == nullptr || !RegionInside(ls.region, *shape)) {
        src.clear();  // refused at Connect; here: no direct transfers
        break;
      }
      int64_t w = m.ops[i].wire_offset - b.wire_offset;
      ForEachRun(ls.region, *shape, [&](int64_t off, int64_t len) {
        Append(src, w, len * ws, ls.param, static_cast<uint64_t>(off) * ws);
        w += len * ws;
      });
    }
  } else if (in.trainer_dtype == in.options.wire_dtype) {
    for (int i = b.op_begin; i < b.op_end; ++i) {
      const TransferOp& op = m.ops[i];
      if (op.tensor < 0 || static_cast<size_t>(op.tensor) >= inventory.size()) {
        src.clear();  // a malformed plan is refused at Connect; here: no direct transfers
        break;
      }
      const Region held =
          TrainerHeldRegion(in.trainer, src_trainer_rank, inventory[op.tensor].shape);
      Region rel = op.src;
      for (int d = 0; d < rel.ndim; ++d) rel.offset[d] -= held.offset[d];
      int64_t w = op.wire_offset - b.wire_offset;
      ForEachRun(rel, held.extents(), [&](int64_t off, int64_t len) {
        Append(src, w, len * ws, op.tensor, static_cast<uint64_t>(off) * ws);
        w += len * ws;
      });
    }
  }
  std::vector<WireRun> out;
  size_t s = 0;  // first source span that may overlap the current destination span
  for (const Span& d : dst) {
    const int64_t end = d.wire + d.len;
    int64_t packed_from = d.wire;  // start of the pending packed stretch
    while (s < src.size() && src[s].wire + src[s].len <= d.wire) ++s;
    for (size_t k = s; k < src.size() && src[k].wire < end; ++k) {
      const int64_t lo = std::max(d.wire, src[k].wire);
      const int64_t hi = std::min(end, src[k].wire + src[k].len);
      if (hi - lo < static_cast<int64_t>(kMinDirectBytes)) continue;
      if (lo > packed_from) Emit(out, d, packed_from, lo - packed_from, false, -1, 0);
      Emit(out, d, lo, hi - lo, true, src[k].id,
           src[k].at + static_cast<uint64_t>(lo - src[k].wire));
      packed_from = hi;
    }
    if (end > packed_from) Emit(out, d, packed_from, end - packed_from, false, -1, 0);
  }
  return out;
}

}  // namespace shardsync::sync_internal
