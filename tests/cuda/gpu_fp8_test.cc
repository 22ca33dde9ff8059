// The fused pack + quantize kernel of block-FP8 syncs against the CPU quantize-pack (fp8.h), bit
// for bit: e4m3 bytes, scales, zero pads and checksum sums, over f32 / bf16 / f16 sources,
// strided regions, partial blocks, ragged column counts, zero and non-finite blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"

#if defined(SHARDSYNC_HAVE_CUDA)
#include "cuda/impl/fp8_kernels.h"
#endif

namespace shardsync::gpu {
namespace {

#if defined(SHARDSYNC_HAVE_CUDA)

struct Source {
  DType dtype;
  int64_t rows, cols;         // the whole tensor
  std::vector<uint8_t> host;  // its values
};

Source MakeSource(DType dtype, int64_t rows, int64_t cols, uint64_t seed) {
  Source s{dtype, rows, cols, {}};
  std::mt19937_64 rng(seed);
  std::vector<float> f(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t block = (r / 128) * 1000 + c / 128;
      float v;
      switch ((block + seed) % 5) {
        case 0:
          v = 0.f;  // zero blocks: the 1e-4 floor
          break;
        case 1:
          v = std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng),
                         std::uniform_int_distribution<int>(-40, 12)(rng));
          break;
        default:
          v = std::normal_distribution<float>(0.f, 0.05f)(rng);
      }
      f[r * cols + c] = v;
    }
  }
  if (seed % 3 == 0) f[5 * cols + 7] = std::numeric_limits<float>::quiet_NaN();
  s.host.resize(f.size() * DTypeSize(dtype));
  for (size_t i = 0; i < f.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(s.host.data() + 4 * i, &f[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? F32ToBF16(f[i]) : F32ToF16(f[i]);
      std::memcpy(s.host.data() + 2 * i, &h, 2);
    }
  }
  return s;
}

TEST(GpuFp8, QuantizePackMatchesTheCpuBitForBit) {
  SS_REQUIRE_GPU();
  struct Op {
    int src;
    int64_t r0, c0, rows, cols;
    int sum;
  };
  const std::vector<Source> sources = {
      MakeSource(DType::kF32, 700, 900, 1), MakeSource(DType::kBF16, 384, 1030, 2),
      MakeSource(DType::kF16, 256, 260, 3), MakeSource(DType::kBF16, 300, 77, 6)};
  const std::vector<Op> ops = {
      {0, 0, 0, 700, 900, 0},      // whole tensor, partial last blocks both ways
      {0, 128, 256, 384, 512, 0},  // strided interior region
      {1, 256, 0, 128, 1030, 1},   // one band, ragged columns (1030 % 8 != 0)
      {1, 0, 896, 384, 134, 1},    // right edge
      {2, 0, 0, 256, 260, 2},      // f16
      {3, 128, 0, 172, 77, 2},     // tiny ragged tail
  };
  // Device copies of the sources; one output buffer holding every op's wire image.
  std::vector<std::unique_ptr<DeviceBuffer>> dsrc;
  for (const Source& s : sources) {
    SS_ASSERT_OK_AND_ASSIGN(auto b, DeviceBuffer::Allocate(s.host.size(), 0));
    SS_ASSERT_OK(CopyToDevice(b->data(), s.host.data(), s.host.size()));
    dsrc.push_back(std::move(b));
  }
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const Op& op : ops) {
    offsets.push_back(total);
    total += Fp8WireBytes(op.rows, op.cols) + 64;  // a gap: ops need not be adjacent
  }
  SS_ASSERT_OK_AND_ASSIGN(auto dout, DeviceBuffer::Allocate(total, 0));
  SS_ASSERT_OK(Memset(dout->data(), 0xcd, total));
  std::vector<uint8_t> want(total, 0xcd);
  std::vector<uint64_t> want_sums(3, 0);
  int64_t want_nonfinite = 0;
  std::vector<Fp8QuantizeTask> tasks;
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const Source& s = sources[op.src];
    const int es = DTypeSize(s.dtype);
    // The CPU quantize-pack of the same region, at a per-bucket wire offset.
    PackRegion pr;
    pr.base = s.host.data();
    pr.dtype = s.dtype;
    pr.shape = {s.rows, s.cols};
    pr.region = Region::Make({op.r0, op.c0}, {op.rows, op.cols});
    pr.wire_offset = 8 * static_cast<int64_t>(i) * 1000;
    auto cpu = Fp8QuantizePack(pr, want.data() + offsets[i]);
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    want_sums[op.sum] += cpu->sum;
    want_nonfinite += cpu->nonfinite;
    Fp8QuantizeTask t;
    t.src = static_cast<const uint8_t*>(dsrc[op.src]->data()) + (op.r0 * s.cols + op.c0) * es;
    t.dtype = s.dtype;
    t.src_row_stride = s.cols;
    t.rows = op.rows;
    t.cols = op.cols;
    t.out = static_cast<uint8_t*>(dout->data()) + offsets[i];
    t.wire_offset = static_cast<uint64_t>(pr.wire_offset);
    t.sum_index = op.sum;
    tasks.push_back(t);
  }
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  SS_ASSERT_OK_AND_ASSIGN(Fp8DeviceResult got, Fp8QuantizePackDevice(tasks, 3, stream->handle()));
  std::vector<uint8_t> host(total);
  SS_ASSERT_OK(CopyToHost(host.data(), dout->data(), total));
  int64_t mismatches = 0;
  for (int64_t i = 0; i < total; ++i) {
    if (host[i] != want[i] && mismatches++ < 5) {
      ADD_FAILURE() << "byte " << i << ": gpu " << int(host[i]) << ", cpu " << int(want[i]);
    }
  }
  EXPECT_EQ(mismatches, 0) << "over " << total << " bytes";
  EXPECT_EQ(got.sums, want_sums);
  EXPECT_EQ(got.nonfinite, want_nonfinite);
  EXPECT_GT(want_nonfinite, 0);  // the f16 source holds a NaN inside op 4
}

TEST(GpuFp8, RefusesMalformedTasks) {
  SS_REQUIRE_GPU();
  Fp8QuantizeTask t;
  t.rows = 4;
  t.cols = 4;
  t.src_row_stride = 4;
  EXPECT_EQ(Fp8QuantizePackDevice({t}, 1, nullptr).status().code(), StatusCode::kInvalidArgument);
}

#else

TEST(GpuFp8, QuantizePackMatchesTheCpuBitForBit) {
  GTEST_SKIP() << "GPU test skipped: built without CUDA";
}

#endif

}  // namespace
}  // namespace shardsync::gpu
