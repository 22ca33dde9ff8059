// GPU checksum and pack / unpack / verify kernels against the CPU definitions, bit for bit.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "shardsync/checksum.h"
#include "shardsync/dtype.h"
#include "shardsync/gpu.h"
#include "shardsync/region.h"
#include "shardsync/session.h"
#include "shardsync/synthetic.h"

namespace shardsync::gpu {
namespace {

std::vector<unsigned char> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(GpuChecksum, MatchesCpuOnOddSizesAndAlignments) {
  SS_REQUIRE_GPU();
  const size_t kMax = (1 << 20) + 64;
  const auto host = RandomBytes(kMax, 7);
  SS_ASSERT_OK_AND_ASSIGN(auto buf, DeviceBuffer::Allocate(kMax, 0));
  SS_ASSERT_OK(CopyToDevice(buf->data(), host.data(), kMax));
  for (size_t size : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{63},
                      size_t{1000}, size_t{4097}, size_t{65543}, size_t{1} << 20}) {
    for (size_t align : {0, 1, 3, 8, 13}) {
      for (uint64_t off : {uint64_t{0}, uint64_t{8}, uint64_t{4096}}) {
        const auto* d = static_cast<const unsigned char*>(buf->data()) + align;
        SS_ASSERT_OK_AND_ASSIGN(uint64_t gpu, DeviceChecksumPartial(d, size, off));
        EXPECT_EQ(gpu, ChecksumPartial(host.data() + align, size, off))
            << "size " << size << " align " << align << " offset " << off;
      }
    }
  }
  SS_ASSERT_OK_AND_ASSIGN(uint64_t whole, DeviceChecksum(buf->data(), 12345));
  EXPECT_EQ(whole, Checksum(host.data(), 12345));
  EXPECT_EQ(DeviceChecksumPartial(buf->data(), 10, 3).status().code(),
            StatusCode::kInvalidArgument);
}

// A tensor, a list of (region, bucket) packed in order, and the CPU image of the result.
struct Case {
  Shape shape;
  std::vector<std::pair<Region, int>> regions;  // in wire order per bucket
  int buckets = 0;
};

Case MakeCase(uint64_t seed) {
  Case c;
  c.shape = {37, 53};
  std::mt19937_64 rng(seed);
  // Column slices (strided), row slices (contiguous), and many tiny regions, over 3 buckets.
  c.regions.push_back({Region::Make({0, 0}, {37, 21}), 0});
  c.regions.push_back({Region::Make({3, 21}, {5, 32}), 0});
  for (int i = 0; i < 40; ++i) {  // tiny 1..3 element regions: several share one wire word
    const int64_t r = static_cast<int64_t>(rng() % 37), col = static_cast<int64_t>(rng() % 50);
    c.regions.push_back({Region::Make({r, col}, {1, 1 + static_cast<int64_t>(rng() % 3)}), 1});
  }
  c.regions.push_back({Region::Make({8, 0}, {29, 53}), 2});
  c.regions.push_back({Region::Make({1, 7}, {11, 13}), 2});
  c.buckets = 3;
  return c;
}

// CPU pack of `c` from a tensor of `in_size`-byte elements into a wire of `wire_size` bytes per
// element with `cast` (0 copy, 1 f32->bf16); returns per-bucket wire images.
std::vector<std::vector<unsigned char>> CpuPack(const Case& c, const unsigned char* t, int in_size,
                                                int wire_size, int cast) {
  std::vector<std::vector<unsigned char>> wire(c.buckets);
  for (const auto& [r, b] : c.regions) {
    ForEachRun(r, c.shape, [&](int64_t off, int64_t len) {
      for (int64_t i = 0; i < len; ++i) {
        const unsigned char* e = t + (off + i) * in_size;
        if (cast == 1) {
          float f;
          std::memcpy(&f, e, 4);
          const uint16_t h = F32ToBF16(f);
          wire[b].insert(wire[b].end(), reinterpret_cast<const unsigned char*>(&h),
                         reinterpret_cast<const unsigned char*>(&h) + 2);
        } else {
          wire[b].insert(wire[b].end(), e, e + wire_size);
        }
      }
    });
  }
  return wire;
}

struct Built {
  BatchSpec spec;
  std::vector<int64_t> bucket_start;  // in the device wire buffer
  int64_t total = 0;
};

// Pack-oriented runs: in = tensor, out = wire buffer.
Built BuildPack(const Case& c, const void* tensor, int in_size, void* wire, int wire_size,
                BatchMode mode, DType in_dtype, DType out_dtype) {
  Built b;
  b.spec.mode = mode;
  b.spec.in_dtype = in_dtype;
  b.spec.out_dtype = out_dtype;
  std::vector<int64_t> cursor(c.buckets, 0);
  for (const auto& [r, k] : c.regions) cursor[k] += r.numel() * wire_size;
  b.spec.bucket_bytes = cursor;
  int64_t start = 0;
  for (int k = 0; k < c.buckets; ++k) {
    b.bucket_start.push_back(start);
    start += (cursor[k] + 255) / 256 * 256;
  }
  b.total = start;
  std::fill(cursor.begin(), cursor.end(), 0);
  for (const auto& [r, k] : c.regions) {
    auto* out = wire ? static_cast<unsigned char*>(wire) + b.bucket_start[k] + cursor[k] : nullptr;
    AppendRegionRuns(r, c.shape, tensor, in_size, out, wire_size, wire_size, k, cursor[k],
                     &b.spec.runs);
    cursor[k] += r.numel() * wire_size;
  }
  return b;
}

CopyRun Swapped(const CopyRun& r) {
  CopyRun s = r;
  s.in = r.out;
  s.out = const_cast<void*>(r.in);
  s.in_stride = r.out_stride;
  s.out_stride = r.in_stride;
  return s;
}

TEST(GpuPack, F32ToBf16MatchesCpuBytesAndChecksums) {
  SS_REQUIRE_GPU();
  const Case c = MakeCase(1);
  const int64_t n = NumElements(c.shape);
  auto host = RandomBytes(n * 4, 11);
  // Sprinkle special values: NaN (quieted), inf, denormal, ties to even.
  const uint32_t specials[] = {0x7fc00001u, 0x7f800001u, 0xff800000u,
                               0x00000001u, 0x3f808000u, 0x3f818000u};
  for (size_t i = 0; i < std::size(specials); ++i) std::memcpy(&host[i * 4 * 7], &specials[i], 4);
  SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * 4, 0));
  SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * 4));
  SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(64 << 10, 0));
  Built b =
      BuildPack(c, t->data(), 4, wire->data(), 2, BatchMode::kPack, DType::kF32, DType::kBF16);
  SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(b.spec, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  for (int rep = 0; rep < 2; ++rep) {  // replay: the second launch must give the same result
    SS_ASSERT_OK(Memset(wire->data(), 0xAB, 64 << 10));
    SS_ASSERT_OK(batch->Launch(stream->handle()));
    SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
    const auto expect = CpuPack(c, host.data(), 4, 2, 1);
    SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
    SS_ASSERT_OK_AND_ASSIGN(auto finished, batch->Checksums());
    for (int k = 0; k < c.buckets; ++k) {
      std::vector<unsigned char> got(expect[k].size());
      SS_ASSERT_OK(CopyToHost(
          got.data(), static_cast<unsigned char*>(wire->data()) + b.bucket_start[k], got.size()));
      EXPECT_EQ(got, expect[k]) << "bucket " << k;
      EXPECT_EQ(sums[k], ChecksumPartial(expect[k].data(), expect[k].size(), 0)) << "bucket " << k;
      EXPECT_EQ(finished[k], Checksum(expect[k].data(), expect[k].size())) << "bucket " << k;
    }
  }
}

TEST(GpuPack, CopyUnpackVerifyRoundTripBf16) {
  SS_REQUIRE_GPU();
  const Case c = MakeCase(2);
  const int64_t n = NumElements(c.shape);
  const auto host = RandomBytes(n * 2, 12);
  SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * 2, 0));
  SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * 2));
  SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(64 << 10, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  const auto expect = CpuPack(c, host.data(), 2, 2, 0);

  // Pack (copy).
  Built p =
      BuildPack(c, t->data(), 2, wire->data(), 2, BatchMode::kPack, DType::kBF16, DType::kBF16);
  SS_ASSERT_OK_AND_ASSIGN(auto pack, CopyBatch::Prepare(p.spec, 0));
  SS_ASSERT_OK(pack->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
  SS_ASSERT_OK_AND_ASSIGN(auto pack_sums, pack->Checksums());

  // Unpack into a fresh tensor filled with a sentinel: covered elements must equal the source,
  // the rest keep the sentinel.
  SS_ASSERT_OK_AND_ASSIGN(auto dst, DeviceBuffer::Allocate(n * 2, 0));
  SS_ASSERT_OK(Memset(dst->data(), 0x5A, n * 2));
  Built u =
      BuildPack(c, dst->data(), 2, wire->data(), 2, BatchMode::kUnpack, DType::kBF16, DType::kBF16);
  for (auto& r : u.spec.runs) r = Swapped(r);
  SS_ASSERT_OK_AND_ASSIGN(auto unpack, CopyBatch::Prepare(u.spec, 0));
  SS_ASSERT_OK(unpack->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "unpack"));
  SS_ASSERT_OK_AND_ASSIGN(auto unpack_sums, unpack->Checksums());
  std::vector<unsigned char> got(n * 2);
  SS_ASSERT_OK(CopyToHost(got.data(), dst->data(), n * 2));
  std::vector<unsigned char> want(n * 2, 0x5A);
  for (const auto& [r, k] : c.regions) {
    ForEachRun(r, c.shape, [&](int64_t off, int64_t len) {
      std::memcpy(&want[off * 2], &host[off * 2], len * 2);
    });
  }
  EXPECT_EQ(got, want);

  // Verify (zero-copy receivers): checksum of the landed regions read in wire order.
  Built v =
      BuildPack(c, dst->data(), 2, nullptr, 2, BatchMode::kVerify, DType::kBF16, DType::kBF16);
  SS_ASSERT_OK_AND_ASSIGN(auto verify, CopyBatch::Prepare(v.spec, 0));
  SS_ASSERT_OK(verify->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "verify"));
  SS_ASSERT_OK_AND_ASSIGN(auto verify_sums, verify->Checksums());
  for (int k = 0; k < c.buckets; ++k) {
    const uint64_t cpu = Checksum(expect[k].data(), expect[k].size());
    EXPECT_EQ(pack_sums[k], cpu) << "bucket " << k;
    EXPECT_EQ(unpack_sums[k], cpu) << "bucket " << k;
    EXPECT_EQ(verify_sums[k], cpu) << "bucket " << k;
  }

  // One flipped bit in a landed element changes exactly that bucket's verify checksum.
  unsigned char byte = 0;
  const int64_t off = (36 * 53 + 52) * 2;  // only bucket 2's [8:37, 0:53] covers element (36, 52)
  SS_ASSERT_OK(CopyToHost(&byte, static_cast<unsigned char*>(dst->data()) + off, 1));
  byte ^= 0x10;
  SS_ASSERT_OK(CopyToDevice(static_cast<unsigned char*>(dst->data()) + off, &byte, 1));
  SS_ASSERT_OK(verify->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "verify"));
  SS_ASSERT_OK_AND_ASSIGN(auto bad, verify->Checksums());
  EXPECT_EQ(bad[0], verify_sums[0]);
  EXPECT_NE(bad[2], verify_sums[2]);
}

// Landed readback: the receiver's map of each bucket cut into pieces of random lengths (so words
// straddle pieces and sit at odd alignments), pointing at where the pack wrote.
std::vector<CopyRun> LandedMap(const Built& b, void* wire, uint64_t seed, int64_t shift_bucket,
                               int64_t shift_bytes) {
  std::mt19937_64 rng(seed);
  std::vector<CopyRun> runs;
  for (size_t k = 0; k < b.spec.bucket_bytes.size(); ++k) {
    for (int64_t at = 0; at < b.spec.bucket_bytes[k];) {
      const int64_t len = std::min<int64_t>(b.spec.bucket_bytes[k] - at, 2 * (1 + rng() % 40));
      CopyRun r;
      const int64_t shift = static_cast<int64_t>(k) == shift_bucket ? shift_bytes : 0;
      r.in = static_cast<unsigned char*>(wire) + b.bucket_start[k] + at + shift;
      r.row_elems = len / 2;
      r.bucket = static_cast<int32_t>(k);
      r.wire_offset = at;
      runs.push_back(r);
      at += len;
    }
  }
  return runs;
}

TEST(GpuPack, LandedReadbackEqualsPackSumAndCatchesMisplacedBytes) {
  SS_REQUIRE_GPU();
  for (int cast : {0, 1}) {
    const Case c = MakeCase(3 + cast);
    const int in_size = cast ? 4 : 2;
    const int64_t n = NumElements(c.shape);
    const auto host = RandomBytes(n * in_size, 21 + cast);
    SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * in_size, 0));
    SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * in_size));
    SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(64 << 10, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto acc, DeviceBuffer::Allocate(3 * 8, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
    const auto expect = CpuPack(c, host.data(), in_size, 2, cast);
    // shift -1: the receiver's map agrees; shift 2: bucket 1's map is one element off.
    for (int64_t shift : {int64_t{0}, int64_t{2}}) {
      Built b = BuildPack(c, t->data(), in_size, wire->data(), 2, BatchMode::kPack,
                          cast ? DType::kF32 : DType::kBF16, DType::kBF16);
      b.spec.landed_runs = LandedMap(b, wire->data(), 99, shift ? 1 : -1, shift);
      for (int k = 0; k < 3; ++k) {
        b.spec.landed_sums.push_back(static_cast<unsigned char*>(acc->data()) + 8 * k);
      }
      SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(b.spec, 0));
      for (int rep = 0; rep < 2; ++rep) {
        SS_ASSERT_OK(Memset(wire->data(), 0xAB, 64 << 10));
        SS_ASSERT_OK(Memset(acc->data(), 0, 3 * 8));
        SS_ASSERT_OK(batch->Launch(stream->handle()));
        SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
        SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
        uint64_t landed[3];
        SS_ASSERT_OK(CopyToHost(landed, acc->data(), sizeof(landed)));
        for (int k = 0; k < 3; ++k) {
          const uint64_t cpu = ChecksumPartial(expect[k].data(), expect[k].size(), 0);
          EXPECT_EQ(sums[k], cpu) << "cast " << cast << " bucket " << k;
          if (shift != 0 && k == 1) {
            EXPECT_NE(landed[k], cpu) << "cast " << cast << ": misplaced map not detected";
          } else {
            EXPECT_EQ(landed[k], cpu) << "cast " << cast << " bucket " << k << " shift " << shift;
          }
        }
      }
    }
  }
}

// Aligned whole rows of a row-parallel shard (bucket 0) and a long contiguous run (bucket 1).
Case LeanCase() {
  Case c;
  c.shape = {512, 1024};
  c.regions.push_back({Region::Make({0, 0}, {512, 512}), 0});
  c.regions.push_back({Region::Make({0, 0}, {256, 1024}), 1});
  c.buckets = 2;
  return c;
}

// The lean kernel's shapes (lean_kernel.cu): aligned whole rows of a row-parallel shard and a long
// contiguous run, each bucket's map one contiguous segment. Sums equal the CPU's, and a map moved
// by one 16-byte pair (still the lean shape) is caught.
TEST(GpuPack, LandedReadbackOnLeanShapes) {
  SS_REQUIRE_GPU();
  const Case c = LeanCase();
  const int64_t n = NumElements(c.shape);
  for (int cast : {0, 1}) {
    const int in_size = cast ? 4 : 2;
    const auto host = RandomBytes(n * in_size, 41 + cast);
    SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * in_size, 0));
    SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * in_size));
    SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(4 << 20, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto acc, DeviceBuffer::Allocate(2 * 8, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
    const auto expect = CpuPack(c, host.data(), in_size, 2, cast);
    for (int64_t shift : {int64_t{0}, int64_t{16}}) {
      Built b = BuildPack(c, t->data(), in_size, wire->data(), 2, BatchMode::kPack,
                          cast ? DType::kF32 : DType::kBF16, DType::kBF16);
      for (int k = 0; k < 2; ++k) {
        CopyRun r;
        r.in = static_cast<unsigned char*>(wire->data()) + b.bucket_start[k] + (k ? shift : 0);
        r.row_elems = b.spec.bucket_bytes[k] / 2;
        r.bucket = k;
        b.spec.landed_runs.push_back(r);
        b.spec.landed_sums.push_back(static_cast<unsigned char*>(acc->data()) + 8 * k);
      }
      SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(b.spec, 0));
      SS_ASSERT_OK(Memset(wire->data(), 0xCD, 4 << 20));
      SS_ASSERT_OK(Memset(acc->data(), 0, 2 * 8));
      SS_ASSERT_OK(batch->Launch(stream->handle()));
      SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
      SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
      uint64_t landed[2];
      SS_ASSERT_OK(CopyToHost(landed, acc->data(), sizeof(landed)));
      for (int k = 0; k < 2; ++k) {
        const uint64_t cpu = ChecksumPartial(expect[k].data(), expect[k].size(), 0);
        EXPECT_EQ(sums[k], cpu) << "cast " << cast << " bucket " << k;
        if (shift != 0 && k == 1) {
          EXPECT_NE(landed[k], cpu) << "cast " << cast << ": moved map not detected";
        } else {
          EXPECT_EQ(landed[k], cpu) << "cast " << cast << " bucket " << k;
        }
      }
      std::vector<unsigned char> got(expect[0].size());
      SS_ASSERT_OK(CopyToHost(got.data(), wire->data(), got.size()));
      EXPECT_EQ(got, expect[0]) << "cast " << cast;
    }
  }
}

// LaunchSignaled: the kernel's last block hands the sums and landed sums to host memory, re-zeroes
// them and signals; launches in a row (and plain launches in between) keep giving the CPU's sums.
TEST(GpuPack, SignaledLaunchHandsOverSumsAndRezeroesThem) {
  SS_REQUIRE_GPU();
  for (int cast : {0, 1}) {  // cast 1: the lean kernel runs first, BatchKernel only signals
    const Case c = cast ? LeanCase() : MakeCase(3 + cast);
    const int in_size = cast ? 4 : 2;
    const int64_t n = NumElements(c.shape);
    const auto host = RandomBytes(n * in_size, 61 + cast);
    SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * in_size, 0));
    SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * in_size));
    SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(4 << 20, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto acc, DeviceBuffer::Allocate(c.buckets * 8, 0));
    SS_ASSERT_OK(Memset(acc->data(), 0, c.buckets * 8));
    SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
    const auto expect = CpuPack(c, host.data(), in_size, 2, cast);
    Built b = BuildPack(c, t->data(), in_size, wire->data(), 2, BatchMode::kPack,
                        cast ? DType::kF32 : DType::kBF16, DType::kBF16);
    b.spec.landed_runs = LandedMap(b, wire->data(), 7, -1, 0);
    if (cast) {  // one contiguous segment per bucket: the lean shape
      b.spec.landed_runs.clear();
      for (int k = 0; k < c.buckets; ++k) {
        CopyRun r;
        r.in = static_cast<unsigned char*>(wire->data()) + b.bucket_start[k];
        r.row_elems = b.spec.bucket_bytes[k] / 2;
        r.bucket = k;
        b.spec.landed_runs.push_back(r);
      }
    }
    for (int k = 0; k < c.buckets; ++k) {
      b.spec.landed_sums.push_back(static_cast<unsigned char*>(acc->data()) + 8 * k);
    }
    SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(b.spec, 0));
    EXPECT_EQ(batch->Signaled(), 0u);
    EXPECT_FALSE(batch->LaunchSignaled(stream->handle(), 0).ok());
    auto check = [&](const std::vector<uint64_t>& sums, const std::vector<uint64_t>& landed,
                     const std::string& what) {
      ASSERT_EQ(sums.size(), static_cast<size_t>(c.buckets));
      ASSERT_EQ(landed.size(), static_cast<size_t>(c.buckets));
      for (int k = 0; k < c.buckets; ++k) {
        const uint64_t cpu = ChecksumPartial(expect[k].data(), expect[k].size(), 0);
        EXPECT_EQ(sums[k], cpu) << what << ", cast " << cast << " bucket " << k;
        EXPECT_EQ(landed[k], cpu) << what << ", cast " << cast << " bucket " << k;
      }
    };
    // signaled, signaled, plain (the caller reads and zeroes the landed sums), signaled again.
    uint64_t seq = 0;
    for (const char* mode : {"signaled", "signaled", "plain", "signaled"}) {
      SS_ASSERT_OK(Memset(wire->data(), 0xEE, 4 << 20));
      if (std::string(mode) == "plain") {
        SS_ASSERT_OK(batch->Launch(stream->handle()));
        SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
        std::vector<uint64_t> landed(c.buckets);
        SS_ASSERT_OK(CopyToHost(landed.data(), acc->data(), c.buckets * 8));
        SS_ASSERT_OK(Memset(acc->data(), 0, c.buckets * 8));
        SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
        check(sums, landed, mode);
        continue;
      }
      SS_ASSERT_OK(batch->LaunchSignaled(stream->handle(), ++seq));
      // The signal alone says the sums are in (the stream may not have passed the kernel yet).
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (batch->Signaled() != seq && std::chrono::steady_clock::now() < until) {
      }
      ASSERT_EQ(batch->Signaled(), seq);
      SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
      SS_ASSERT_OK_AND_ASSIGN(auto landed, batch->LandedSums());
      check(sums, landed, mode);
      SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
      std::vector<uint64_t> left(c.buckets, 1);
      SS_ASSERT_OK(CopyToHost(left.data(), acc->data(), c.buckets * 8));
      EXPECT_EQ(left, std::vector<uint64_t>(c.buckets, 0)) << "landed sums not re-zeroed";
      std::vector<unsigned char> got(expect[0].size());
      SS_ASSERT_OK(CopyToHost(got.data(), wire->data(), got.size()));
      EXPECT_EQ(got, expect[0]) << "cast " << cast;
    }
  }
}

TEST(GpuPack, SignaledLandedSumsNeedALandedBatch) {
  SS_REQUIRE_GPU();
  const Case c = MakeCase(3);
  const int64_t n = NumElements(c.shape);
  SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * 2, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(64 << 10, 0));
  Built b =
      BuildPack(c, t->data(), 2, wire->data(), 2, BatchMode::kPack, DType::kBF16, DType::kBF16);
  SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(b.spec, 0));
  EXPECT_EQ(batch->LandedSums().status().code(), StatusCode::kFailedPrecondition);
}

TEST(GpuPack, LandedReadbackOnLargeStridedDestinations) {
  SS_REQUIRE_GPU();
  // 3000 rows of 4099 bf16 elements packed into rows of stride 4103 (odd: words straddle rows),
  // plus a large contiguous run: the vector, row-wise and word paths all read back.
  const int64_t rows = 3000, row = 4099, stride = 4103, big = int64_t{3} << 20;
  const auto host = RandomBytes((rows * row + big) * 2, 5);
  SS_ASSERT_OK_AND_ASSIGN(auto src, DeviceBuffer::Allocate(host.size(), 0));
  SS_ASSERT_OK(CopyToDevice(src->data(), host.data(), host.size()));
  SS_ASSERT_OK_AND_ASSIGN(auto dst, DeviceBuffer::Allocate((rows * stride + big) * 2 + 64, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto acc, DeviceBuffer::Allocate(8, 0));
  auto* s = static_cast<unsigned char*>(src->data());
  auto* d = static_cast<unsigned char*>(dst->data());
  const auto host2 = RandomBytes(512 * 2048 * 2, 6);
  SS_ASSERT_OK_AND_ASSIGN(auto src2, DeviceBuffer::Allocate(host2.size(), 0));
  SS_ASSERT_OK(CopyToDevice(src2->data(), host2.data(), host2.size()));
  SS_ASSERT_OK_AND_ASSIGN(auto dst2, DeviceBuffer::Allocate(512 * 1024 * 2, 0));
  auto* s2 = static_cast<unsigned char*>(src2->data());
  auto* d2 = static_cast<unsigned char*>(dst2->data());
  // The wire image: the two first runs' source bytes, then the left half of every row of src2.
  std::vector<unsigned char> image = host;
  for (int64_t r = 0; r < 512; ++r) {
    image.insert(image.end(), host2.begin() + r * 4096, host2.begin() + r * 4096 + 2048);
  }
  for (int64_t misplace : {int64_t{0}, int64_t{1}}) {
    BatchSpec spec;
    spec.mode = BatchMode::kPack;
    CopyRun a;
    a.in = s;
    a.out = d;
    a.row_elems = row;
    a.rows = rows;
    a.in_stride = row;
    a.out_stride = stride;
    CopyRun bigrun;
    bigrun.in = s + rows * row * 2;
    bigrun.out = d + rows * stride * 2;
    bigrun.row_elems = big;
    bigrun.wire_offset = rows * row * 2;
    // Row-parallel style source (half of every row), contiguous destination: row-wise path.
    CopyRun half;
    half.in = s2;
    half.out = d2;
    half.row_elems = 1024;
    half.rows = 512;
    half.in_stride = 2048;
    half.out_stride = 1024;
    half.wire_offset = (rows * row + big) * 2;
    spec.runs = {a, bigrun, half};
    spec.bucket_bytes = {(rows * row + big + 512 * 1024) * 2};
    CopyRun la = a;
    la.in = d + 2 * misplace * 777;  // the receiver's own view (shifted when misplaced)
    la.in_stride = stride;
    CopyRun lb = bigrun;
    lb.in = bigrun.out;
    CopyRun lc;
    lc.in = d2;
    lc.row_elems = 512 * 1024;
    lc.wire_offset = half.wire_offset;
    spec.landed_runs = {la, lb, lc};
    spec.landed_sums = {acc->data()};
    SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(spec, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
    SS_ASSERT_OK(Memset(acc->data(), 0, 8));
    SS_ASSERT_OK(batch->Launch(stream->handle()));
    SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
    SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
    uint64_t landed = 0;
    SS_ASSERT_OK(CopyToHost(&landed, acc->data(), 8));
    EXPECT_EQ(sums[0], ChecksumPartial(image.data(), image.size(), 0));
    if (misplace) {
      EXPECT_NE(landed, sums[0]);
    } else {
      EXPECT_EQ(landed, sums[0]);
    }
  }
}

TEST(GpuPack, LandedReadbackRejectsBadMaps) {
  SS_REQUIRE_GPU();
  SS_ASSERT_OK_AND_ASSIGN(auto buf, DeviceBuffer::Allocate(4096, 0));
  auto* p = static_cast<unsigned char*>(buf->data());
  BatchSpec spec;
  spec.mode = BatchMode::kPack;
  CopyRun r;
  r.in = p;
  r.out = p + 1024;
  r.row_elems = 100;
  spec.runs = {r};
  spec.bucket_bytes = {200};
  CopyRun l;
  l.in = p + 1024;
  l.row_elems = 90;  // covers 180 of 200 bytes
  spec.landed_runs = {l};
  spec.landed_sums = {p + 2048};
  auto bad = CopyBatch::Prepare(spec, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("landed runs cover 180"), std::string::npos)
      << bad.status().ToString();
  spec.landed_runs[0].row_elems = 100;
  spec.landed_sums = {};
  bad = CopyBatch::Prepare(spec, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("landed_sums"), std::string::npos);
  spec.landed_sums = {p + 2048};
  spec.mode = BatchMode::kUnpack;
  EXPECT_FALSE(CopyBatch::Prepare(spec, 0).ok());
}

TEST(GpuPack, UnpackBf16ToF32MatchesCpu) {
  SS_REQUIRE_GPU();
  Case c;  // two disjoint regions, one strided, in two buckets
  c.shape = {37, 53};
  c.regions = {{Region::Make({0, 0}, {37, 21}), 0}, {Region::Make({3, 21}, {5, 31}), 1}};
  c.buckets = 2;
  const int64_t n = NumElements(c.shape);
  const auto wire_host = RandomBytes(64 << 10, 13);
  SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(64 << 10, 0));
  SS_ASSERT_OK(CopyToDevice(wire->data(), wire_host.data(), wire_host.size()));
  SS_ASSERT_OK_AND_ASSIGN(auto dst, DeviceBuffer::Allocate(n * 4, 0));
  SS_ASSERT_OK(Memset(dst->data(), 0, n * 4));
  Built u =
      BuildPack(c, dst->data(), 4, wire->data(), 2, BatchMode::kUnpack, DType::kBF16, DType::kF32);
  for (auto& r : u.spec.runs) r = Swapped(r);
  SS_ASSERT_OK_AND_ASSIGN(auto unpack, CopyBatch::Prepare(u.spec, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  SS_ASSERT_OK(unpack->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "unpack"));
  SS_ASSERT_OK_AND_ASSIGN(auto sums, unpack->Sums());
  std::vector<float> got(n);
  SS_ASSERT_OK(CopyToHost(got.data(), dst->data(), n * 4));
  for (int k = 0; k < c.buckets; ++k) {
    const unsigned char* w = wire_host.data() + u.bucket_start[k];
    EXPECT_EQ(sums[k], ChecksumPartial(w, u.spec.bucket_bytes[k], 0)) << "bucket " << k;
    int64_t e = 0;
    ForEachRun(c.regions[k].first, c.shape, [&](int64_t off, int64_t len) {
      for (int64_t i = 0; i < len; ++i, ++e) {
        uint16_t h;
        std::memcpy(&h, w + e * 2, 2);
        const float f = BF16ToF32(h);
        EXPECT_EQ(std::memcmp(&got[off + i], &f, 4), 0) << "element " << off + i;
      }
    });
  }
}

TEST(GpuPack, LargeRunsUseVectorPathBitExact) {
  SS_REQUIRE_GPU();
  // Long contiguous and strided runs (the vectorized path) at aligned and odd element offsets,
  // f32 -> bf16, in one bucket of 3 runs: bytes and checksum equal the CPU pack.
  const Shape shape = {1024, 1027};
  const int64_t n = NumElements(shape);
  const auto host = RandomBytes(n * 4, 21);
  SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * 4, 0));
  SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * 4));
  Case c;
  c.shape = shape;
  c.regions = {{Region::Make({0, 0}, {300, 1027}), 0},    // contiguous, aligned start
               {Region::Make({301, 3}, {1, 1000}), 0},    // contiguous, odd start
               {Region::Make({400, 5}, {600, 999}), 0}};  // strided
  c.buckets = 1;
  SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(n * 2, 0));
  Built b =
      BuildPack(c, t->data(), 4, wire->data(), 2, BatchMode::kPack, DType::kF32, DType::kBF16);
  SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(b.spec, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  SS_ASSERT_OK(batch->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
  const auto expect = CpuPack(c, host.data(), 4, 2, 1);
  std::vector<unsigned char> got(expect[0].size());
  SS_ASSERT_OK(CopyToHost(got.data(), wire->data(), got.size()));
  EXPECT_EQ(got, expect[0]);
  SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Checksums());
  EXPECT_EQ(sums[0], Checksum(expect[0].data(), expect[0].size()));
  // Verify the packed wire image itself (contiguous bf16, vector path) and unpack it to f32.
  BatchSpec v;
  v.mode = BatchMode::kVerify;
  v.in_dtype = DType::kBF16;
  CopyRun r;
  r.in = static_cast<unsigned char*>(wire->data()) + 2;  // odd start, 2 bytes in
  r.row_elems = static_cast<int64_t>(got.size() / 2) - 1;
  v.runs = {r};
  v.bucket_bytes = {r.row_elems * 2};
  SS_ASSERT_OK_AND_ASSIGN(auto vb, CopyBatch::Prepare(v, 0));
  SS_ASSERT_OK(vb->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "verify"));
  SS_ASSERT_OK_AND_ASSIGN(auto vs, vb->Checksums());
  EXPECT_EQ(vs[0], Checksum(expect[0].data() + 2, expect[0].size() - 2));
  BatchSpec u;
  u.mode = BatchMode::kUnpack;
  u.in_dtype = DType::kBF16;
  u.out_dtype = DType::kF32;
  SS_ASSERT_OK_AND_ASSIGN(auto f32, DeviceBuffer::Allocate(got.size() * 2, 0));
  CopyRun ur;
  ur.in = wire->data();
  ur.out = f32->data();
  ur.row_elems = static_cast<int64_t>(got.size() / 2);
  u.runs = {ur};
  u.bucket_bytes = {static_cast<int64_t>(got.size())};
  SS_ASSERT_OK_AND_ASSIGN(auto ub, CopyBatch::Prepare(u, 0));
  SS_ASSERT_OK(ub->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "unpack"));
  std::vector<uint32_t> back(got.size() / 2);
  SS_ASSERT_OK(CopyToHost(back.data(), f32->data(), back.size() * 4));
  for (size_t i = 0; i < back.size(); i += 997) {
    uint16_t h;
    std::memcpy(&h, &got[i * 2], 2);
    EXPECT_EQ(back[i], static_cast<uint32_t>(h) << 16) << "element " << i;
  }
  SS_ASSERT_OK_AND_ASSIGN(auto us, ub->Checksums());
  EXPECT_EQ(us[0], sums[0]);
}

TEST(GpuPack, StridedRowsVectorPathBitExact) {
  SS_REQUIRE_GPU();
  // Column slices whose rows are 16-byte multiples (the row-wise vector path), one misaligned
  // (falls back to the word path), and a contiguous run, f32 -> bf16 and bf16 verify.
  const Shape shape = {300, 1024};
  const int64_t n = NumElements(shape);
  const auto host = RandomBytes(n * 4, 23);
  SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * 4, 0));
  SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * 4));
  Case c;
  c.shape = shape;
  c.regions = {{Region::Make({0, 256}, {300, 512}), 0},
               {Region::Make({0, 3}, {100, 512}), 0},
               {Region::Make({5, 0}, {2, 1024}), 0},
               {Region::Make({7, 8}, {200, 16}), 0}};
  c.buckets = 1;
  SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(n * 2, 0));
  Built b =
      BuildPack(c, t->data(), 4, wire->data(), 2, BatchMode::kPack, DType::kF32, DType::kBF16);
  SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(b.spec, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  SS_ASSERT_OK(batch->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
  const auto expect = CpuPack(c, host.data(), 4, 2, 1);
  std::vector<unsigned char> got(expect[0].size());
  SS_ASSERT_OK(CopyToHost(got.data(), wire->data(), got.size()));
  EXPECT_EQ(got, expect[0]);
  SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Checksums());
  EXPECT_EQ(sums[0], Checksum(expect[0].data(), expect[0].size()));
  // bf16 copy of the same tensor layout, verified in place (strided verify).
  std::vector<unsigned char> h16(n * 2);
  for (int64_t i = 0; i < n; ++i) std::memcpy(&h16[i * 2], &host[i * 4 + 2], 2);
  SS_ASSERT_OK_AND_ASSIGN(auto t16, DeviceBuffer::Allocate(n * 2, 0));
  SS_ASSERT_OK(CopyToDevice(t16->data(), h16.data(), n * 2));
  Built v =
      BuildPack(c, t16->data(), 2, nullptr, 2, BatchMode::kVerify, DType::kBF16, DType::kBF16);
  SS_ASSERT_OK_AND_ASSIGN(auto vb, CopyBatch::Prepare(v.spec, 0));
  SS_ASSERT_OK(vb->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "verify"));
  const auto expect16 = CpuPack(c, h16.data(), 2, 2, 0);
  SS_ASSERT_OK_AND_ASSIGN(auto vs, vb->Checksums());
  EXPECT_EQ(vs[0], Checksum(expect16[0].data(), expect16[0].size()));
}

TEST(GpuPack, ManySmallRegionsInOneLaunch) {
  SS_REQUIRE_GPU();
  // 3000 runs of 1..17 bf16 elements from scattered offsets: one launch, exact bytes and sum.
  const int64_t n = 1 << 16;
  const auto host = RandomBytes(n * 2, 14);
  SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * 2, 0));
  SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * 2));
  SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(n * 2, 0));
  std::mt19937_64 rng(5);
  BatchSpec spec;
  spec.mode = BatchMode::kPack;
  spec.in_dtype = spec.out_dtype = DType::kBF16;
  std::vector<unsigned char> expect;
  int64_t w = 0;
  for (int i = 0; i < 3000; ++i) {
    const int64_t len = 1 + static_cast<int64_t>(rng() % 17);
    const int64_t at = static_cast<int64_t>(rng() % (n - len));
    CopyRun r;
    r.in = static_cast<unsigned char*>(t->data()) + at * 2;
    r.out = static_cast<unsigned char*>(wire->data()) + w;
    r.row_elems = len;
    r.wire_offset = w;
    spec.runs.push_back(r);
    expect.insert(expect.end(), host.begin() + at * 2, host.begin() + (at + len) * 2);
    w += len * 2;
  }
  spec.bucket_bytes = {w};
  SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(spec, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  SS_ASSERT_OK(batch->Launch(stream->handle()));
  SS_ASSERT_OK(stream->Synchronize(Millis(30000), "pack"));
  std::vector<unsigned char> got(w);
  SS_ASSERT_OK(CopyToHost(got.data(), wire->data(), w));
  EXPECT_EQ(got, expect);
  SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Checksums());
  EXPECT_EQ(sums[0], Checksum(expect.data(), expect.size()));
}

TEST(GpuPack, RejectsBadBatches) {
  SS_REQUIRE_GPU();
  SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(1024, 0));
  BatchSpec spec;
  spec.mode = BatchMode::kPack;
  spec.in_dtype = spec.out_dtype = DType::kBF16;
  CopyRun r;
  r.in = t->data();
  r.out = static_cast<unsigned char*>(t->data()) + 512;
  r.row_elems = 10;
  r.wire_offset = 2;  // gap at [0, 2)
  spec.runs = {r};
  spec.bucket_bytes = {22};
  auto gap = CopyBatch::Prepare(spec, 0);
  ASSERT_FALSE(gap.ok());
  EXPECT_EQ(gap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(gap.status().message().find("not tiled"), std::string::npos) << gap.status().ToString();
  spec.runs[0].wire_offset = 0;
  spec.runs[0].bucket = 3;
  EXPECT_EQ(CopyBatch::Prepare(spec, 0).status().code(), StatusCode::kOutOfRange);
  spec.runs[0].bucket = 0;
  spec.bucket_bytes = {40};  // runs cover 20 bytes only
  EXPECT_EQ(CopyBatch::Prepare(spec, 0).status().code(), StatusCode::kInvalidArgument);
  spec.bucket_bytes = {20};
  spec.in_dtype = DType::kF16;
  spec.out_dtype = DType::kF32;
  EXPECT_EQ(CopyBatch::Prepare(spec, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaPacker, PackVerifyUnpackMatchCpu) {
  SS_REQUIRE_GPU();
  const Case c = MakeCase(4);
  const int64_t n = NumElements(c.shape);
  const auto host = RandomBytes(n * 4, 15);
  SS_ASSERT_OK_AND_ASSIGN(auto t, DeviceBuffer::Allocate(n * 4, 0));
  SS_ASSERT_OK(CopyToDevice(t->data(), host.data(), n * 4));
  auto packer = MakeCudaPacker(0);
  ASSERT_NE(packer, nullptr);
  EXPECT_EQ(packer->name(), "cuda");
  const auto expect = CpuPack(c, host.data(), 4, 2, 1);
  // Bucket 0 of the case: regions in wire order.
  std::vector<PackRegion> regions;
  int64_t w = 0;
  for (const auto& [r, k] : c.regions) {
    if (k != 0) continue;
    regions.push_back({t->data(), DType::kF32, c.shape, r, w});
    w += r.numel() * 2;
  }
  ASSERT_EQ(w, static_cast<int64_t>(expect[0].size()));
  SS_ASSERT_OK_AND_ASSIGN(auto wire, DeviceBuffer::Allocate(w, 0));
  for (int rep = 0; rep < 2; ++rep) {  // the second call replays the cached batch
    SS_ASSERT_OK_AND_ASSIGN(uint64_t sum, packer->Pack(regions, DType::kBF16, wire->data(), w));
    EXPECT_EQ(sum, Checksum(expect[0].data(), w));
  }
  std::vector<unsigned char> got(w);
  SS_ASSERT_OK(CopyToHost(got.data(), wire->data(), w));
  EXPECT_EQ(got, expect[0]);
  // Unpack into a bf16 tensor, then checksum the landed regions: equal to the sender's.
  SS_ASSERT_OK_AND_ASSIGN(auto dst, DeviceBuffer::Allocate(n * 2, 0));
  SS_ASSERT_OK(Memset(dst->data(), 0, n * 2));
  std::vector<PackRegion> landed = regions;
  for (auto& r : landed) {
    r.base = dst->data();
    r.dtype = DType::kBF16;
  }
  SS_ASSERT_OK(packer->Unpack(wire->data(), DType::kBF16, w, landed));
  SS_ASSERT_OK_AND_ASSIGN(uint64_t lsum, packer->ChecksumLanded(landed, w));
  EXPECT_EQ(lsum, Checksum(expect[0].data(), w));
  SS_ASSERT_OK(packer->ZeroFill(dst->data(), DType::kBF16, c.shape, Region::Make({0, 0}, {2, 53})));
  SS_ASSERT_OK_AND_ASSIGN(uint64_t zsum, packer->ChecksumLanded(landed, w));
  EXPECT_NE(zsum, lsum);
  std::vector<PackRegion> mixed = regions;
  mixed[1].dtype = DType::kBF16;
  EXPECT_EQ(packer->Pack(mixed, DType::kBF16, wire->data(), w).status().code(),
            StatusCode::kUnimplemented);
}

TEST(GpuSynthetic, FillAndCheckMatchHost) {
  SS_REQUIRE_GPU();
  const Shape shape = {19, 33};
  const Region r = Region::Make({2, 5}, {11, 17});
  const std::string name = "model.layers.0.mlp.down_proj.weight";
  const SyntheticTensor st = SyntheticFor(name, shape);
  std::vector<float> want(r.numel());
  FillSyntheticRegion(99, name, shape, r, want.data());
  SS_ASSERT_OK_AND_ASSIGN(auto f32, DeviceBuffer::Allocate(r.numel() * 4, 0));
  SS_ASSERT_OK(FillSyntheticDevice(99, st, shape, r, DType::kF32, f32->data(), nullptr));
  std::vector<float> got(r.numel());
  SS_ASSERT_OK(CopyToHost(got.data(), f32->data(), got.size() * 4));
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0);

  // A bf16 parameter holding region r at rows [1, 12) of a [12, 17] tensor.
  const Shape pshape = {12, 17};
  const Region pr = Region::Make({1, 0}, {11, 17});
  std::vector<uint16_t> param(NumElements(pshape), 0);
  for (int64_t i = 0; i < r.numel(); ++i) param[17 + i] = F32ToBF16(want[i]);
  SS_ASSERT_OK_AND_ASSIGN(auto p, DeviceBuffer::Allocate(param.size() * 2, 0));
  SS_ASSERT_OK(CopyToDevice(p->data(), param.data(), param.size() * 2));
  SS_ASSERT_OK_AND_ASSIGN(auto bad, DeviceBuffer::Allocate(8, 0));
  SS_ASSERT_OK(Memset(bad->data(), 0, 8));
  auto* counter = static_cast<unsigned long long*>(bad->data());
  SS_ASSERT_OK(CountSyntheticMismatches(99, st, shape, r, pshape, pr, p->data(), counter, nullptr));
  unsigned long long n = 1;
  SS_ASSERT_OK(CopyToHost(&n, counter, 8));
  EXPECT_EQ(n, 0u);
  param[17 + 5] ^= 1;
  param[17 + 100] ^= 0x8000;
  SS_ASSERT_OK(CopyToDevice(p->data(), param.data(), param.size() * 2));
  SS_ASSERT_OK(CountSyntheticMismatches(99, st, shape, r, pshape, pr, p->data(), counter, nullptr));
  SS_ASSERT_OK(CopyToHost(&n, counter, 8));
  EXPECT_EQ(n, 2u);
}

// bench --update-fraction's device step: every `pitch`-th element becomes the saved one times the
// factor, rounded as the host's F32ToBF16 rounds; the elements between are untouched.
TEST(GpuKernels, ScaleStridedScalesTheSavedElementsAsTheHostDoes) {
  SS_REQUIRE_GPU();
  SS_ASSERT_OK(SetDevice(0));
  constexpr size_t kRows = 1000, kStride = 7;
  std::mt19937 rng(3);
  std::normal_distribution<float> w(0.0f, 0.02f);
  for (DType t : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(DTypeName(t));
    const size_t es = DTypeSize(t);
    std::vector<unsigned char> buf(kRows * kStride * es), saved(kRows * es);
    for (size_t i = 0; i < buf.size() / es; ++i) {
      const float v = w(rng);
      if (t == DType::kBF16) {
        const uint16_t h = F32ToBF16(v);
        std::memcpy(&buf[i * es], &h, 2);
      } else {
        std::memcpy(&buf[i * es], &v, 4);
      }
    }
    for (size_t r = 0; r < kRows; ++r) std::memcpy(&saved[r * es], &buf[r * kStride * es], es);
    SS_ASSERT_OK_AND_ASSIGN(auto d, DeviceBuffer::Allocate(buf.size(), 0));
    SS_ASSERT_OK_AND_ASSIGN(auto s, DeviceBuffer::Allocate(saved.size(), 0));
    SS_ASSERT_OK(CopyToDevice(d->data(), buf.data(), buf.size()));
    SS_ASSERT_OK(CopyToDevice(s->data(), saved.data(), saved.size()));
    const float f = 1.0f - 1.0f / 64;
    SS_ASSERT_OK(ScaleStrided(d->data(), kStride * es, s->data(), kRows, t, f));
    std::vector<unsigned char> got(buf.size());
    SS_ASSERT_OK(CopyToHost(got.data(), d->data(), got.size()));
    size_t changed = 0;
    for (size_t i = 0; i < buf.size() / es; ++i) {
      std::vector<unsigned char> want(buf.begin() + i * es, buf.begin() + (i + 1) * es);
      if (i % kStride == 0) {
        float v;
        if (t == DType::kBF16) {
          uint16_t h;
          std::memcpy(&h, want.data(), 2);
          h = F32ToBF16(BF16ToF32(h) * f);
          std::memcpy(want.data(), &h, 2);
        } else {
          std::memcpy(&v, want.data(), 4);
          v *= f;
          std::memcpy(want.data(), &v, 4);
        }
        changed += std::memcmp(want.data(), &buf[i * es], es) != 0;
      }
      ASSERT_EQ(std::memcmp(want.data(), &got[i * es], es), 0) << "element " << i;
    }
    EXPECT_GT(changed, kRows * 9 / 10);  // a 1.6% step changes (nearly) every value it scales
  }
  EXPECT_EQ(ScaleStrided(nullptr, 2, nullptr, 1, DType::kF16, 0.5f).code(),
            StatusCode::kInvalidArgument);
}

TEST(GpuDevice, QueryReportsTheDevice) {
  SS_REQUIRE_GPU();
  SS_ASSERT_OK_AND_ASSIGN(DeviceInfo info, QueryDevice(0));
  EXPECT_FALSE(info.name.empty());
  EXPECT_GT(info.sm_count, 0);
  EXPECT_GT(info.total_bytes, 0);
  EXPECT_GT(info.hbm_peak_gbps, 0);
  EXPECT_FALSE(QueryDevice(1000).ok());
}

}  // namespace
}  // namespace shardsync::gpu
