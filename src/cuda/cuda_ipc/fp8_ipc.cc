// The block-FP8 codec's cuda_ipc pairs (PairSpec::image, kQuantize / kAmax encoded regions; stage
// ops are cuda_ipc_pairs.cc's raw copies): the receiver publishes its own map of every quantize
// op (where its e4m3 rows and its scales are, in its registered regions), the sender maps it and
// hands the quantize ops to a prepared Fp8 batch (fp8_batch.cu) that writes the e4m3 bytes and the
// scales straight into the receiver's parameters and reads them back through that map. Amax ops
// (rows of blocks shared by trainer ranks) are quantize ops with the sender's agreed scales given;
// the holders that send no scales have no scale entry (sregion -1).
#include <cstring>

#include "cuda/cuda_ipc/cuda_ipc.h"
#include "shardsync/fp8.h"

namespace shardsync::gpu::ipc {
namespace {

constexpr uint64_t kFp8MapMagic = 0x53534638;  // "SSF8"

// One quantize op as the receiver holds it: e4m3 rows at byte `woffset` of region `wregion`
// (`wstride` bytes apart), scales at byte `soffset` of region `sregion` (`sstride` floats apart;
// sregion -1: the op sends no scales).
struct Fp8MapEntry {
  int64_t bucket, wire, rows, cols;
  int64_t wregion, woffset, wstride;
  int64_t sregion, soffset, sstride;
};

// Rows, columns, first element and row stride of a 2-d region (or 3-d with leading extent 1).
struct Matrix {
  int64_t rows = 0, cols = 0, start = 0, stride = 0;
};
Result<Matrix> MatrixOf(const Region& r, const Shape& shape, const std::string& who) {
  const int nd = r.ndim;
  if (nd < 2 || static_cast<int>(shape.size()) != nd || !RegionInside(r, shape)) {
    return InvalidArgumentError(who + ": region " + r.ToString() + " of a tensor of shape " +
                                ShapeToString(shape) + " is not a matrix inside it");
  }
  for (int d = 0; d < nd - 2; ++d) {
    if (r.extent[d] != 1) {
      return InvalidArgumentError(who + ": region " + r.ToString() + " spans several matrices");
    }
  }
  return Matrix{r.extent[nd - 2], r.extent[nd - 1], RegionStartElement(r, shape), shape.back()};
}

// The encoded regions a quantize batch runs (kQuantize, kAmax); kStage is a plain copy; any other
// encoding has no codec kernels here.
Result<bool> Quantizes(const EncodedRegion& r, const std::string& who) {
  switch (static_cast<Encoding>(r.encoding)) {
    case Encoding::kQuantize:
    case Encoding::kAmax:
      return true;
    case Encoding::kStage:
      return false;
    default:
      return UnimplementedError(who + ": no kernels for encoding '" +
                                std::string(EncodingName(static_cast<Encoding>(r.encoding))) + "'");
  }
}

}  // namespace

Result<std::string> EncodedLandedMap(const CudaIpcTransport& t, const PairSpec& spec) {
  const std::string who = "cuda_ipc: block-FP8 pair with rank " + std::to_string(spec.peer);
  std::vector<Fp8MapEntry> map;
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    for (const EncodedRegion& q : spec.buckets[b].encoded) {
      SS_ASSIGN_OR_RETURN(bool quantizes, Quantizes(q, who));
      if (!quantizes) continue;
      const PackRegion& w = q.landed;
      const PackRegion& s = q.landed_aux;
      if (w.dtype != DType::kF8E4M3 || (q.with_aux && s.dtype != DType::kF32)) {
        return InvalidArgumentError(who + ": landed weight / scales must be F8_E4M3 / F32");
      }
      SS_ASSIGN_OR_RETURN(Matrix mw, MatrixOf(w.region, w.shape, who));
      if (!q.with_aux) {
        if (mw.rows > kFp8Block) {
          return InvalidArgumentError(who + ": e4m3 rows " + w.region.ToString() +
                                      " without scales span more than one block row");
        }
        SS_ASSIGN_OR_RETURN(auto wl, t.FindLocal(w.base, NumElements(w.shape)));
        map.push_back({static_cast<int64_t>(b), w.wire_offset, mw.rows, mw.cols, wl.first,
                       static_cast<int64_t>(wl.second) + mw.start, mw.stride, -1, 0, 0});
        continue;
      }
      SS_ASSIGN_OR_RETURN(Matrix ms, MatrixOf(s.region, s.shape, who));
      if (ms.rows != Fp8Blocks(mw.rows) || ms.cols != Fp8Blocks(mw.cols)) {
        return InvalidArgumentError(who + ": scales " + s.region.ToString() +
                                    " are not the blocks of " + w.region.ToString());
      }
      SS_ASSIGN_OR_RETURN(auto wl, t.FindLocal(w.base, NumElements(w.shape)));
      SS_ASSIGN_OR_RETURN(auto sl, t.FindLocal(s.base, NumElements(s.shape) * 4));
      map.push_back({static_cast<int64_t>(b), w.wire_offset, mw.rows, mw.cols, wl.first,
                     static_cast<int64_t>(wl.second) + mw.start, mw.stride, sl.first,
                     static_cast<int64_t>(sl.second) + ms.start * 4, ms.stride});
    }
  }
  std::string blob(16 + map.size() * sizeof(Fp8MapEntry), '\0');
  const uint64_t head[2] = {kFp8MapMagic, map.size()};
  std::memcpy(blob.data(), head, 16);
  if (!map.empty()) std::memcpy(blob.data() + 16, map.data(), map.size() * sizeof(Fp8MapEntry));
  return blob;
}

Status AddEncodedTasks(CudaIpcTransport& t, const PairSpec& spec, const std::string& blob,
                       BatchSpec* bs) {
  const std::string who = "cuda_ipc: block-FP8 pair with rank " + std::to_string(spec.peer);
  uint64_t head[2] = {0, 0};
  if (blob.size() >= 16) std::memcpy(head, blob.data(), 16);
  if (blob.size() < 16 || head[0] != kFp8MapMagic ||
      (blob.size() - 16) != head[1] * sizeof(Fp8MapEntry)) {
    return DataLossError(who + ": the receiver's quantize map is malformed (" +
                         std::to_string(blob.size()) + " bytes)");
  }
  std::vector<Fp8MapEntry> map(head[1]);
  if (!map.empty()) std::memcpy(map.data(), blob.data() + 16, map.size() * sizeof(Fp8MapEntry));
  size_t k = 0;
  for (size_t b = 0; b < spec.buckets.size(); ++b) {
    int64_t copies = 0;
    for (const PackRegion& l : spec.buckets[b].local) {
      copies += l.region.numel() * DTypeSize(spec.wire);
    }
    bs->copy_bytes.push_back(copies);
    for (const EncodedRegion& q : spec.buckets[b].encoded) {
      SS_ASSIGN_OR_RETURN(bool quantizes, Quantizes(q, who));
      if (!quantizes) continue;
      const std::string op = who + ": bucket " + std::to_string(b) + " quantize op at byte " +
                             std::to_string(q.src.wire_offset);
      SS_ASSIGN_OR_RETURN(Matrix src, MatrixOf(q.src.region, q.src.shape, op));
      SS_ASSIGN_OR_RETURN(Matrix w, MatrixOf(q.dst.dst, q.dst.shape, op));
      Matrix s{Fp8Blocks(src.rows), Fp8Blocks(src.cols), 0, 0};
      if (q.with_aux) {
        SS_ASSIGN_OR_RETURN(s, MatrixOf(q.aux.dst, q.aux.shape, op));
      }
      if (!q.with_aux && !q.given) {
        return InvalidArgumentError(op + ": sends no scales and is given none");
      }
      if (k >= map.size()) return DataLossError(op + ": missing from the receiver's map");
      const Fp8MapEntry& e = map[k++];
      if (e.bucket != static_cast<int64_t>(b) || e.wire != q.src.wire_offset ||
          e.rows != src.rows || e.cols != src.cols || w.rows != src.rows || w.cols != src.cols ||
          s.rows != Fp8Blocks(src.rows) || s.cols != Fp8Blocks(src.cols) || e.wregion < 0 ||
          (e.sregion >= 0) != q.with_aux || e.woffset < 0 || e.soffset < 0) {
        return DataLossError(op + ": the receiver's map says bucket " + std::to_string(e.bucket) +
                             " byte " + std::to_string(e.wire) + ", " + std::to_string(e.rows) +
                             " x " + std::to_string(e.cols));
      }
      EncodedTask task;
      task.encoding = static_cast<Encoding>(q.encoding);
      const int es = DTypeSize(q.src.dtype);
      task.src = static_cast<const unsigned char*>(q.src.base) + src.start * es;
      task.dtype = q.src.dtype;
      task.src_stride = src.stride;
      task.rows = src.rows;
      task.cols = src.cols;
      SS_ASSIGN_OR_RETURN(void* wb, t.RemotePointer(spec.peer, q.dst.region, q.dst.offset,
                                                    NumElements(q.dst.shape)));
      task.weight = static_cast<unsigned char*>(wb) + w.start;
      task.weight_stride = w.stride;
      SS_ASSIGN_OR_RETURN(
          void* lw, t.RemotePointer(spec.peer, static_cast<uint32_t>(e.wregion),
                                    static_cast<uint64_t>(e.woffset),
                                    static_cast<uint64_t>((e.rows - 1) * e.wstride + e.cols)));
      task.landed_weight = lw;
      task.landed_weight_stride = e.wstride;
      task.given_scales = q.given;
      if (q.with_aux) {
        SS_ASSIGN_OR_RETURN(void* sb, t.RemotePointer(spec.peer, q.aux.region, q.aux.offset,
                                                      NumElements(q.aux.shape) * 4));
        task.scales = static_cast<float*>(sb) + s.start;
        task.scale_stride = s.stride;
        SS_ASSIGN_OR_RETURN(
            void* ls,
            t.RemotePointer(spec.peer, static_cast<uint32_t>(e.sregion),
                            static_cast<uint64_t>(e.soffset),
                            static_cast<uint64_t>(((s.rows - 1) * e.sstride + s.cols) * 4)));
        task.landed_scales = ls;
        task.landed_scale_stride = e.sstride;
      }
      task.bucket = static_cast<int32_t>(b);
      task.wire_offset = q.src.wire_offset;
      bs->encoded.push_back(task);
    }
  }
  if (k != map.size()) {
    return DataLossError(who + ": the receiver's map has " + std::to_string(map.size()) +
                         " quantize ops, this side " + std::to_string(k));
  }
  return OkStatus();
}

}  // namespace shardsync::gpu::ipc
