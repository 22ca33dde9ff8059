// CPU packer: strided regions <-> contiguous wire images, dtype cast and checksum fused in one
// pass over each cache-sized chunk.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "common/cast.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"
#include "shardsync/session.h"

namespace shardsync {
namespace {

// Elements per chunk: the packed chunk is checksummed while still in L1/L2.
constexpr int64_t kChunkElems = 8192;

bool Castable(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// Checks that `regions` tile [0, bytes) of the wire image in order and are well formed.
Status CheckTiling(const std::vector<PackRegion>& regions, DType wire, int64_t bytes,
                   std::string_view what) {
  int64_t at = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    const PackRegion& r = regions[i];
    if (r.base == nullptr && r.region.numel() > 0) {
      return InvalidArgumentError(std::string(what) + ": region " + std::to_string(i) +
                                  " has a null base");
    }
    if (!RegionInside(r.region, r.shape)) {
      return OutOfRangeError(std::string(what) + ": region " + r.region.ToString() +
                             " is outside shape " + ShapeToString(r.shape));
    }
    if (r.dtype != wire && !(Castable(r.dtype) && Castable(wire))) {
      return UnimplementedError(std::string(what) + ": no cast from " +
                                std::string(DTypeName(r.dtype)) + " to " +
                                std::string(DTypeName(wire)));
    }
    if (r.wire_offset != at) {
      return InvalidArgumentError(std::string(what) + ": region " + std::to_string(i) +
                                  " starts at wire byte " + std::to_string(r.wire_offset) +
                                  ", expected " + std::to_string(at));
    }
    at += r.region.numel() * DTypeSize(wire);
  }
  if (at != bytes) {
    return InvalidArgumentError(std::string(what) + ": regions cover " + std::to_string(at) +
                                " wire bytes, expected " + std::to_string(bytes));
  }
  return OkStatus();
}

class CpuPacker final : public Packer {
 public:
  std::string_view name() const override { return "cpu"; }
  bool Supports(MemKind kind) const override { return kind == MemKind::kHost; }

  Result<uint64_t> Pack(const std::vector<PackRegion>& regions, DType wire, void* out,
                        int64_t bytes) override {
    SS_RETURN_IF_ERROR(CheckTiling(regions, wire, bytes, "pack"));
    ChecksumStream cs;
    auto* o = static_cast<unsigned char*>(out);
    const int ws = DTypeSize(wire);
    for (const PackRegion& r : regions) {
      const auto* base = static_cast<const unsigned char*>(r.base);
      const int es = DTypeSize(r.dtype);
      int64_t w = r.wire_offset;
      ForEachRun(r.region, r.shape, [&](int64_t off, int64_t len) {
        for (int64_t done = 0; done < len; done += kChunkElems) {
          const int64_t n = std::min(kChunkElems, len - done);
          CastInto(base + (off + done) * es, r.dtype, o + w, wire, n);
          cs.Update(o + w, static_cast<size_t>(n * ws));
          w += n * ws;
        }
      });
    }
    return cs.Finish();
  }

  Result<uint64_t> ChecksumLanded(const std::vector<PackRegion>& regions, int64_t bytes) override {
    if (!regions.empty())
      SS_RETURN_IF_ERROR(CheckTiling(regions, regions[0].dtype, bytes, "verify"));
    ChecksumStream cs;
    for (const PackRegion& r : regions) {
      const auto* base = static_cast<const unsigned char*>(r.base);
      const int es = DTypeSize(r.dtype);
      ForEachRun(r.region, r.shape, [&](int64_t off, int64_t len) {
        cs.Update(base + off * es, static_cast<size_t>(len * es));
      });
    }
    if (static_cast<int64_t>(cs.bytes()) != bytes) {
      return InternalError("verify: read " + std::to_string(cs.bytes()) + " bytes, expected " +
                           std::to_string(bytes));
    }
    return cs.Finish();
  }

  Status Unpack(const void* in, DType wire, int64_t bytes,
                const std::vector<PackRegion>& regions) override {
    SS_RETURN_IF_ERROR(CheckTiling(regions, wire, bytes, "unpack"));
    const auto* i = static_cast<const unsigned char*>(in);
    const int ws = DTypeSize(wire);
    for (const PackRegion& r : regions) {
      auto* base = static_cast<unsigned char*>(const_cast<void*>(r.base));
      const int es = DTypeSize(r.dtype);
      int64_t w = r.wire_offset;
      ForEachRun(r.region, r.shape, [&](int64_t off, int64_t len) {
        CastInto(i + w, wire, base + off * es, r.dtype, len);
        w += len * ws;
      });
    }
    return OkStatus();
  }

  Status ZeroFill(void* base, DType dtype, const Shape& shape, const Region& region) override {
    if (!RegionInside(region, shape)) {
      return OutOfRangeError("zero fill: region " + region.ToString() + " is outside shape " +
                             ShapeToString(shape));
    }
    auto* b = static_cast<unsigned char*>(base);
    const int es = DTypeSize(dtype);
    ForEachRun(region, shape,
               [&](int64_t off, int64_t len) { std::memset(b + off * es, 0, len * es); });
    return OkStatus();
  }

  // fp8.h's block quantizer, block by block (what the host receiver runs per band as it lands).
  Result<std::vector<int64_t>> QuantizeBands(const std::vector<Fp8BandTask>& bands) override {
    std::vector<int64_t> bad(bands.size(), 0);
    for (size_t i = 0; i < bands.size(); ++i) {
      const Fp8BandTask& t = bands[i];
      if (!t.src || !t.weight || !t.scales || t.rows < 1 || t.rows > kFp8Block || t.cols < 1 ||
          t.weight_stride < t.cols || t.scale_stride < Fp8Blocks(t.cols) ||
          (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16)) {
        return InvalidArgumentError("quantize bands: band " + std::to_string(i) +
                                    " is malformed (1..128 rows, f32 / bf16 / f16 values, "
                                    "non-null pointers, strides covering a row)");
      }
      const int es = DTypeSize(t.dtype);
      const auto* src = static_cast<const unsigned char*>(t.src);
      auto* q = static_cast<uint8_t*>(t.weight);
      for (int64_t c0 = 0; c0 < t.cols; c0 += kFp8Block) {
        t.scales[c0 / kFp8Block] = Fp8QuantizeBlock(src + c0 * es, t.dtype, t.cols, t.rows,
                                                    std::min<int64_t>(kFp8Block, t.cols - c0),
                                                    q + c0, t.weight_stride, &bad[i]);
      }
    }
    return bad;
  }

  // Host memory: the amax exchange's partials as the host path takes them, and a plain copy.
  Status PartialAmax(const std::vector<Fp8AmaxTask>& tasks, uint32_t* out,
                     int64_t out_len) override {
    std::fill(out, out + out_len, 0u);
    for (size_t i = 0; i < tasks.size(); ++i) {
      const Fp8AmaxTask& t = tasks[i];
      if (t.slot < 0 || t.src_stride < t.cols || t.slot + Fp8Blocks(t.cols) > out_len) {
        return InvalidArgumentError("partial amax: task " + std::to_string(i) +
                                    " is malformed (a stride covering a row, its blocks inside " +
                                    std::to_string(out_len) + " entries)");
      }
      SS_RETURN_IF_ERROR(Fp8PartialAmax(
          {t.src, t.dtype, {t.rows, t.src_stride}, Region::Make({0, 0}, {t.rows, t.cols}), 0},
          out + t.slot));
    }
    return OkStatus();
  }
  Status Upload(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return OkStatus();
  }

  // Available memory (MemAvailable: what can be allocated without swapping).
  Result<int64_t> FreeBytes() override {
    std::FILE* f = std::fopen("/proc/meminfo", "r");
    if (f != nullptr) {
      char line[256];
      long long kb = -1;
      while (std::fgets(line, sizeof(line), f) != nullptr) {
        if (std::sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
      }
      std::fclose(f);
      if (kb >= 0) return static_cast<int64_t>(kb) * 1024;
    }
    const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages < 0 || page < 0) return UnavailableError("cpu packer: available memory unknown");
    return static_cast<int64_t>(pages) * page;
  }

  // A swap goes through a cache-sized bounce buffer: each byte is read and written once per
  // side, twice a copy's traffic.
  Status CopyAreas(const std::vector<AreaCopy>& copies, bool swap) override {
    constexpr int64_t kBounce = 256 << 10;
    std::unique_ptr<unsigned char[]> tmp;
    if (swap) tmp.reset(new unsigned char[kBounce]);
    for (const AreaCopy& c : copies) {
      auto* d = static_cast<unsigned char*>(c.dst);
      auto* s = static_cast<unsigned char*>(c.src);
      if (!swap) {
        std::memcpy(d, s, static_cast<size_t>(c.bytes));
        continue;
      }
      for (int64_t at = 0; at < c.bytes; at += kBounce) {
        const size_t n = static_cast<size_t>(std::min(kBounce, c.bytes - at));
        std::memcpy(tmp.get(), d + at, n);
        std::memcpy(d + at, s + at, n);
        std::memcpy(s + at, tmp.get(), n);
      }
    }
    return OkStatus();
  }
};

}  // namespace

std::unique_ptr<Packer> MakeCpuPacker() { return std::make_unique<CpuPacker>(); }

}  // namespace shardsync
