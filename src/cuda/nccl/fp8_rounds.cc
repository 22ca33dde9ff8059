// Block-FP8 rounds of two-sided device pairs (fp8_rounds.h): the sender builds a round's wire image
// in its slot with the prepared FP8 batch (fp8_batch.cu) and sums the slot's bytes; the receiver
// scatters the received image with one byte-copy batch that sums it the same way.
#include "cuda/nccl/fp8_rounds.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "shardsync/fp8.h"

namespace shardsync::gpu {
namespace {

int64_t AlignUp8(int64_t n) { return (n + 7) & ~int64_t{7}; }

// Bytes [at, at + len) of the round.
struct Piece {
  int64_t at = 0, len = 0;
};

// Rows, columns, first element and row stride of a 2-d region (or 3-d with leading extent 1).
struct Matrix {
  int64_t rows = 0, cols = 0, start = 0, stride = 0;
};
Result<Matrix> MatrixOf(const PackRegion& p, const std::string& who) {
  const Region& r = p.region;
  const int nd = r.ndim;
  if (nd < 2 || static_cast<int>(p.shape.size()) != nd || !RegionInside(r, p.shape) || !p.base) {
    return InvalidArgumentError(who + ": region " + r.ToString() + " of a tensor of shape " +
                                ShapeToString(p.shape) + " is not a matrix inside it");
  }
  for (int d = 0; d < nd - 2; ++d) {
    if (r.extent[d] != 1) {
      return InvalidArgumentError(who + ": region " + r.ToString() + " spans several matrices");
    }
  }
  return Matrix{r.extent[nd - 2], r.extent[nd - 1], RegionStartElement(r, p.shape), p.shape.back()};
}

// The bytes of [0, bytes) no piece covers, in order; InvalidArgument when pieces overlap or leave
// the round.
Result<std::vector<Piece>> GapsOf(std::vector<Piece> covered, int64_t bytes,
                                  const std::string& who) {
  std::sort(covered.begin(), covered.end(),
            [](const Piece& a, const Piece& b) { return a.at < b.at; });
  std::vector<Piece> gaps;
  int64_t cur = 0;
  for (const Piece& p : covered) {
    if (p.len == 0) continue;
    if (p.at < cur || p.len < 0 || p.at + p.len > bytes) {
      return InvalidArgumentError(who + ": wire bytes [" + std::to_string(p.at) + ", " +
                                  std::to_string(p.at + p.len) + ") overlap another op or leave " +
                                  "the round's " + std::to_string(bytes) + " bytes");
    }
    if (p.at > cur) gaps.push_back({cur, p.at - cur});
    cur = p.at + p.len;
  }
  if (cur < bytes) gaps.push_back({cur, bytes - cur});
  return gaps;
}

// Runs of region `r` (elements of `es` bytes) of a tensor at `base` against contiguous wire bytes
// at `wire` (wire offset `at`), counted in bytes; `unpack`: from the wire into the tensor.
void ByteRuns(const Region& r, const Shape& shape, const void* base, int es, unsigned char* wire,
              int64_t at, bool unpack, std::vector<CopyRun>* runs) {
  const size_t first = runs->size();
  AppendRegionRuns(r, shape, base, es, wire, es, es, 0, at, runs);
  for (size_t k = first; k < runs->size(); ++k) {
    CopyRun& c = (*runs)[k];
    c.row_elems *= es;
    c.in_stride *= es;
    c.out_stride *= es;
    if (unpack) {
      const void* tensor = c.in;
      c.in = c.out;
      c.out = const_cast<void*>(tensor);
      std::swap(c.in_stride, c.out_stride);
    }
  }
}

// Whether `r` is one of the block-FP8 codec's quantize ops (kQuantize, kAmax).
bool Quantizes(const EncodedRegion& r) {
  const auto e = static_cast<Encoding>(r.encoding);
  return e == Encoding::kQuantize || e == Encoding::kAmax;
}

Status CheckCopies(const PairBucket& b, const std::string& who) {
  for (const EncodedRegion& r : b.encoded) {
    if (static_cast<Encoding>(r.encoding) == Encoding::kStage) {
      return UnimplementedError(who +
                                ": stage ops (rows straddling trainer ranks) need a one-sided "
                                "pair into the receiver's staging");
    }
    if (!Quantizes(r)) {
      return UnimplementedError(who + ": an op of encoding '" +
                                std::string(EncodingName(static_cast<Encoding>(r.encoding))) +
                                "', which the block-FP8 rounds do not carry");
    }
  }
  if (b.wire_offsets.size() != b.local.size()) {
    return InvalidArgumentError(who + ": " + std::to_string(b.local.size()) + " copy ops and " +
                                std::to_string(b.wire_offsets.size()) + " wire offsets");
  }
  return OkStatus();
}

}  // namespace

Result<ImageSendRound> PrepareImageSendRound(const PairBucket& b, DType wire, void* slot,
                                             const void* zeros, int device,
                                             const std::string& who) {
  SS_RETURN_IF_ERROR(CheckCopies(b, who));
  auto* s = static_cast<unsigned char*>(slot);
  const int ws = DTypeSize(wire);
  const DType td = b.local.empty() ? wire : b.local[0].dtype;
  const int ts = DTypeSize(td);
  BatchSpec bs;
  bs.mode = BatchMode::kPack;
  bs.in_dtype = td;
  bs.out_dtype = wire;
  bs.bucket_bytes = {b.bytes};
  std::vector<Piece> covered;
  int64_t compact = 0;  // the inner copy batch's image: copies, then zero pads
  for (size_t i = 0; i < b.local.size(); ++i) {
    const PackRegion& r = b.local[i];
    const int64_t off = b.wire_offsets[i], n = r.region.numel() * ws;
    if (r.dtype != td || !RegionInside(r.region, r.shape) || off < 0 || off % ws != 0) {
      return InvalidArgumentError(who + ": copy op " + std::to_string(i) + " at byte " +
                                  std::to_string(off) +
                                  " mixes dtypes, leaves its tensor or is not on a wire element");
    }
    AppendRegionRuns(r.region, r.shape, r.base, ts, s + off, ws, ws, 0, compact, &bs.runs);
    covered.push_back({off, n});
    compact += n;
  }
  for (const EncodedRegion& q : b.encoded) {
    const int64_t off = q.src.wire_offset;
    const std::string op = who + ": quantize op at byte " + std::to_string(off);
    SS_ASSIGN_OR_RETURN(Matrix m, MatrixOf(q.src, op));
    if (off < 0 || off % 8 != 0) return InvalidArgumentError(op + ": not on 8 bytes");
    // The session refuses amax ops over nccl pairs before preparing them (sync/fp8_pairs.cc).
    if (q.given || !q.with_aux) {
      return UnimplementedError(op + ": amax-exchanged rows do not cross nccl pairs");
    }
    const int64_t e4m3 = m.rows * m.cols, nbc = Fp8Blocks(m.cols);
    EncodedTask t;
    t.encoding = Encoding::kQuantize;
    t.src = static_cast<const unsigned char*>(q.src.base) + m.start * DTypeSize(q.src.dtype);
    t.dtype = q.src.dtype;
    t.src_stride = m.stride;
    t.rows = m.rows;
    t.cols = m.cols;
    t.weight = s + off;  // the e4m3 rows back to back, as the wire image holds them
    t.weight_stride = m.cols;
    t.scales = s + off + AlignUp8(e4m3);
    t.scale_stride = nbc;
    t.landed_weight = t.weight;  // the kernel's read-back: the slot itself
    t.landed_weight_stride = t.weight_stride;
    t.landed_scales = t.scales;
    t.landed_scale_stride = t.scale_stride;
    t.bucket = 0;
    t.wire_offset = off;
    bs.encoded.push_back(t);
    covered.push_back({off, e4m3});
    covered.push_back({off + AlignUp8(e4m3), Fp8Blocks(m.rows) * nbc * 4});
  }
  // Every other byte (the pads) is written as a zero each round: the slot is shared with other
  // rounds whose ops sit elsewhere. Pads are wire elements (copy ops end on one, scale sections on
  // 4 bytes), cast from zeros of the trainer dtype like the copies.
  SS_ASSIGN_OR_RETURN(std::vector<Piece> gaps, GapsOf(covered, b.bytes, who));
  const int64_t per = kImageRoundScratchBytes / ts;
  for (const Piece& g : gaps) {
    if (g.at % ws != 0 || g.len % ws != 0) {
      return InvalidArgumentError(who + ": pad [" + std::to_string(g.at) + ", " +
                                  std::to_string(g.at + g.len) + ") is not in " +
                                  std::string(DTypeName(wire)) + " elements");
    }
    for (int64_t e = 0; e < g.len / ws; e += per) {
      CopyRun z;
      z.in = zeros;
      z.out = s + g.at + e * ws;
      z.row_elems = std::min(per, g.len / ws - e);
      z.wire_offset = compact;
      compact += z.row_elems * ws;
      bs.runs.push_back(z);
    }
  }
  bs.copy_bytes = {compact};
  ImageSendRound round;
  SS_ASSIGN_OR_RETURN(round.pack, CopyBatch::Prepare(bs, device));
  BatchSpec v;
  v.mode = BatchMode::kVerify;
  v.in_dtype = DType::kU8;
  v.bucket_bytes = {b.bytes};
  CopyRun all;
  all.in = s;
  all.row_elems = b.bytes;
  v.runs.push_back(all);
  SS_ASSIGN_OR_RETURN(round.verify, CopyBatch::Prepare(v, device));
  return round;
}

Result<BatchSpec> ImageRecvRoundSpec(const PairBucket& b, DType wire, const void* slot, void* sink,
                                     const std::string& who) {
  SS_RETURN_IF_ERROR(CheckCopies(b, who));
  auto* s = static_cast<unsigned char*>(const_cast<void*>(slot));
  const int ws = DTypeSize(wire);
  BatchSpec bs;
  bs.mode = BatchMode::kUnpack;
  bs.in_dtype = bs.out_dtype = DType::kU8;
  bs.bucket_bytes = {b.bytes};
  std::vector<Piece> covered;
  for (size_t i = 0; i < b.local.size(); ++i) {
    const PackRegion& r = b.local[i];
    const int64_t off = b.wire_offsets[i];
    if (r.dtype != wire || !RegionInside(r.region, r.shape) || off < 0) {
      return InvalidArgumentError(
          who + ": copy op " + std::to_string(i) + " at byte " + std::to_string(off) +
          " lands in a parameter of dtype " + std::string(DTypeName(r.dtype)) +
          " or outside it; block-FP8 plans bind unquantized parameters in the wire dtype " +
          std::string(DTypeName(wire)));
    }
    ByteRuns(r.region, r.shape, r.base, ws, s + off, off, /*unpack=*/true, &bs.runs);
    covered.push_back({off, r.region.numel() * ws});
  }
  for (const EncodedRegion& q : b.encoded) {
    const PackRegion& w = q.landed;
    const PackRegion& sc = q.landed_aux;
    const int64_t off = w.wire_offset;
    const std::string op = who + ": quantize op at byte " + std::to_string(off);
    if (!q.with_aux) {
      return UnimplementedError(op + ": amax-exchanged rows do not cross nccl pairs");
    }
    if (w.dtype != DType::kF8E4M3 || sc.dtype != DType::kF32 || off < 0 || off % 8 != 0) {
      return InvalidArgumentError(op + ": weight / scales must be F8_E4M3 / F32, on 8 bytes");
    }
    SS_ASSIGN_OR_RETURN(Matrix mw, MatrixOf(w, op));
    SS_ASSIGN_OR_RETURN(Matrix ms, MatrixOf(sc, op));
    if (ms.rows != Fp8Blocks(mw.rows) || ms.cols != Fp8Blocks(mw.cols)) {
      return InvalidArgumentError(op + ": scales " + sc.region.ToString() +
                                  " are not the blocks of " + w.region.ToString());
    }
    const int64_t e4m3 = mw.rows * mw.cols, at = off + AlignUp8(e4m3);
    ByteRuns(w.region, w.shape, w.base, 1, s + off, off, /*unpack=*/true, &bs.runs);
    ByteRuns(sc.region, sc.shape, sc.base, 4, s + at, at, /*unpack=*/true, &bs.runs);
    covered.push_back({off, e4m3});
    covered.push_back({at, ms.rows * ms.cols * 4});
  }
  SS_ASSIGN_OR_RETURN(std::vector<Piece> gaps, GapsOf(covered, b.bytes, who));
  for (const Piece& g : gaps) {  // pads: summed like every byte, landed nowhere
    for (int64_t e = 0; e < g.len; e += kImageRoundScratchBytes) {
      CopyRun p;
      p.in = s + g.at + e;
      p.out = sink;
      p.row_elems = std::min(kImageRoundScratchBytes, g.len - e);
      p.wire_offset = g.at + e;
      bs.runs.push_back(p);
    }
  }
  return bs;
}

Result<std::unique_ptr<CopyBatch>> PrepareImageRecvRound(const PairBucket& b, DType wire,
                                                         const void* slot, void* sink, int device,
                                                         const std::string& who) {
  SS_ASSIGN_OR_RETURN(BatchSpec bs, ImageRecvRoundSpec(b, wire, slot, sink, who));
  return CopyBatch::Prepare(bs, device);
}

}  // namespace shardsync::gpu
