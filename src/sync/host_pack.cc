#include "sync/host_pack.h"

#include <algorithm>

#include "shardsync/checksum.h"

namespace shardsync::sync_internal {
namespace {

// Wire bytes cast and packed before their checksum is taken, so the checksum reads from L1/L2.
constexpr int64_t kPackChunkBytes = int64_t{32} << 10;

}  // namespace

SendBucket MakeSendBucket(const SessionContext& ctx, const Bindings& bindings, PeerShapes& shapes,
                          const Message& m, const Bucket& b) {
  const int ws = DTypeSize(ctx.in.options.wire_dtype);
  const int ts = DTypeSize(ctx.in.trainer_dtype);
  SendBucket sb;
  sb.xfers = BucketTransfers(
      ctx.in, ctx.inventory, ctx.who.trainer_rank, m, b,
      [&](int param) -> const Shape& { return shapes.Get(m.dst, param); },
      [&](int param) { return bindings.LocalShape(m, param); });
  for (int i = b.op_begin; i < b.op_end; ++i) {
    const TransferOp& op = m.ops[i];
    const Bindings::OpSource src = bindings.SourceOf(m, i);
    const auto* base = static_cast<const unsigned char*>(src.data);
    int64_t w = op.wire_offset - b.wire_offset;
    ForEachRun(src.region, src.shape, [&](int64_t off, int64_t len) {
      if (!sb.pieces.empty()) {
        SrcPiece& p = sb.pieces.back();
        if (p.src + p.elems * ts == base + off * ts && p.wire + p.elems * ws == w) {
          p.elems += len;
          w += len * ws;
          return;
        }
      }
      sb.pieces.push_back({w, base + off * ts, len});
      w += len * ws;
    });
  }
  return sb;
}

void PackRange(const SendBucket& sb, DType td, DType wd, int64_t from, int64_t len,
               unsigned char* out, LandedSum& sum) {
  const int ts = DTypeSize(td), ws = DTypeSize(wd);
  const int64_t end = from + len;
  // The piece holding `from`: the last one starting at or before it.
  auto it = std::upper_bound(sb.pieces.begin(), sb.pieces.end(), from,
                             [](int64_t w, const SrcPiece& p) { return w < p.wire; });
  size_t k = static_cast<size_t>(it - sb.pieces.begin()) - 1;
  const bool cast_sum = td == DType::kF32 && wd == DType::kBF16;
  int64_t at = from;      // next wire byte to write
  int64_t summed = from;  // wire bytes before this are in `sum`
  while (at < end) {
    const SrcPiece& p = sb.pieces[k];
    const int64_t e0 = (at - p.wire) / ws;
    const int64_t n = std::min(p.elems - e0, (end - at) / ws);
    // Cast in chunk-sized steps so each chunk is checksummed while still in L1/L2.
    for (int64_t done = 0; done < n;) {
      const int64_t step = std::min(n - done, std::max<int64_t>(1, kPackChunkBytes / ws));
      const unsigned char* in = p.src + (e0 + done) * ts;
      if (cast_sum && at % 8 == 0) {
        // fp32 -> bf16 with the checksum taken from the registers (whole words only): first
        // settle the bytes written before this word boundary the ordinary way.
        if (summed < at) {
          sum.Add(out + (summed - from), static_cast<size_t>(at - summed),
                  static_cast<uint64_t>(summed));
          summed = at;
        }
        uint64_t part = 0;
        const int64_t k =
            CastF32ToBF16WithSum(in, out + (at - from), step, static_cast<uint64_t>(at) / 8, &part);
        if (k > 0) {
          sum.AddWords(part, static_cast<size_t>(k * ws));
          at += k * ws;
          done += k;
          summed = at;
          continue;
        }
      }
      if (td == wd && at % 8 == 0 && step * ws >= 8) {
        // Same dtype: copy whole words with the checksum taken from the loaded registers.
        if (summed < at) {
          sum.Add(out + (summed - from), static_cast<size_t>(at - summed),
                  static_cast<uint64_t>(summed));
          summed = at;
        }
        const int64_t bytes = (step * ws) & ~int64_t{7};
        const uint64_t part = CopyWithChecksumPartial(
            out + (at - from), in, static_cast<size_t>(bytes), static_cast<uint64_t>(at));
        sum.AddWords(part, static_cast<size_t>(bytes));
        at += bytes;
        done += bytes / ws;
        summed = at;
        continue;
      }
      CastInto(in, td, out + (at - from), wd, step);
      at += step * ws;
      done += step;
      // Checksum up to a word boundary of the bucket's wire image, so chunks rarely split words.
      const int64_t cut = at == end ? end : (at & ~int64_t{7});
      if (cut - summed >= kPackChunkBytes || at == end) {
        sum.Add(out + (summed - from), static_cast<size_t>(cut - summed),
                static_cast<uint64_t>(summed));
        summed = cut;
      }
    }
    ++k;
  }
}

}  // namespace shardsync::sync_internal
