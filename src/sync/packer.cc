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

  // The codecs' steps over host memory (pack.h CodecKernels), one per codec that has any.
  std::vector<CodecKernels*> codec_kernels() override { return {block_quantize_.get()}; }
  // Host memory: a plain copy.
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

 private:
  std::unique_ptr<CodecKernels> block_quantize_ = MakeCpuBlockQuantizeKernels();  // fp8.h
};

}  // namespace

std::unique_ptr<Packer> MakeCpuPacker() { return std::make_unique<CpuPacker>(); }

}  // namespace shardsync
