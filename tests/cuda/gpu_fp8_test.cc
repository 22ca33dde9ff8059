// The fused pack + quantize kernel of block-FP8 syncs against the CPU quantize-pack (fp8.h), bit
// for bit: e4m3 bytes, scales, zero pads and checksum sums, over f32 / bf16 / f16 sources,
// strided regions, partial blocks, ragged column counts, zero and non-finite blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"
#include "shardsync/gpu.h"
#include "shardsync/session.h"

#if defined(SHARDSYNC_HAVE_CUDA)
#include "cuda/kernels/fp8_kernels.h"
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

// The prepared pack of cuda_ipc's block-FP8 pairs (BatchSpec::quantize): e4m3 rows and scales
// written into strided destinations (another tensor's rows, as in a peer's parameter), each word
// summed as packed and as read back through the "receiver's" map, beside a copy run in the compact
// copy image; a NaN is counted, a misplaced map changes the landed sum.
TEST(GpuFp8, PreparedBatchQuantizesIntoStridedDestinations) {
  SS_REQUIRE_GPU();
  const Source a = MakeSource(DType::kF32, 384, 512, 4), b = MakeSource(DType::kBF16, 256, 1024, 5);
  struct Op {
    const Source* s;
    int64_t r0, c0, rows, cols;  // of the source
    int64_t wr, wc, sr, sc;      // where the e4m3 rows / the scales start in the destinations
  } ops[] = {{&a, 0, 0, 384, 512, 10, 128, 1, 1}, {&b, 128, 256, 128, 768, 400, 0, 4, 0}};
  const int64_t W = 1024, WR = 600, SC = 8, SR = 6;  // destinations: e4m3 [600, 1024], f32 [6, 8]
  std::vector<std::unique_ptr<DeviceBuffer>> dsrc;
  for (const Source* s : {&a, &b}) {
    SS_ASSERT_OK_AND_ASSIGN(auto d, DeviceBuffer::Allocate(s->host.size(), 0));
    SS_ASSERT_OK(CopyToDevice(d->data(), s->host.data(), s->host.size()));
    dsrc.push_back(std::move(d));
  }
  SS_ASSERT_OK_AND_ASSIGN(auto dw, DeviceBuffer::Allocate(WR * W, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto ds, DeviceBuffer::Allocate(SR * SC * 4, 0));
  SS_ASSERT_OK(Memset(dw->data(), 0xcd, WR * W));
  SS_ASSERT_OK(Memset(ds->data(), 0xcd, SR * SC * 4));
  // A copy of 1000 bf16 values into a third buffer: the compact copy image.
  const int64_t n_copy = 1000;
  std::vector<uint16_t> copy_src(n_copy);
  for (int64_t i = 0; i < n_copy; ++i) copy_src[i] = static_cast<uint16_t>(i * 7919);
  SS_ASSERT_OK_AND_ASSIGN(auto dcs, DeviceBuffer::Allocate(n_copy * 2, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto dcd, DeviceBuffer::Allocate(n_copy * 2, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto lsum, DeviceBuffer::Allocate(8, 0));
  SS_ASSERT_OK(CopyToDevice(dcs->data(), copy_src.data(), n_copy * 2));
  SS_ASSERT_OK(Memset(lsum->data(), 0, 8));
  BatchSpec spec;
  spec.mode = BatchMode::kPack;
  spec.in_dtype = spec.out_dtype = DType::kBF16;
  CopyRun run;
  run.in = dcs->data();
  run.out = dcd->data();
  run.row_elems = n_copy;
  spec.runs.push_back(run);
  CopyRun landed = run;
  landed.in = dcd->data();
  spec.landed_runs.push_back(landed);
  spec.landed_sums.push_back(lsum->data());
  spec.copy_bytes.push_back(n_copy * 2);
  std::vector<uint8_t> wire;  // the CPU quantize-pack of both ops, in one wire image
  uint64_t want = ChecksumPartial(copy_src.data(), n_copy * 2, 0);
  int64_t at = 0;
  for (const Op& op : ops) {
    const int es = DTypeSize(op.s->dtype);
    PackRegion pr{op.s->host.data(),
                  op.s->dtype,
                  {op.s->rows, op.s->cols},
                  Region::Make({op.r0, op.c0}, {op.rows, op.cols}),
                  at};
    wire.resize(at + Fp8WireBytes(op.rows, op.cols));
    auto cpu = Fp8QuantizePack(pr, wire.data() + at);
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    want += cpu->sum;
    EncodedTask t;
    t.src = static_cast<const uint8_t*>(dsrc[op.s == &a ? 0 : 1]->data()) +
            (op.r0 * op.s->cols + op.c0) * es;
    t.dtype = op.s->dtype;
    t.src_stride = op.s->cols;
    t.rows = op.rows;
    t.cols = op.cols;
    t.weight = static_cast<uint8_t*>(dw->data()) + op.wr * W + op.wc;
    t.weight_stride = W;
    t.scales = static_cast<float*>(ds->data()) + op.sr * SC + op.sc;
    t.scale_stride = SC;
    t.landed_weight = t.weight;
    t.landed_weight_stride = W;
    t.landed_scales = t.scales;
    t.landed_scale_stride = SC;
    t.wire_offset = at;
    spec.encoded.push_back(t);
    at += Fp8WireBytes(op.rows, op.cols);
  }
  spec.bucket_bytes.push_back(at + 4096);  // the copies' bytes, pads: the plan's whole bucket
  SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(spec, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  SS_ASSERT_OK(batch->LaunchSignaled(stream->handle(), 1));
  SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 batch"));
  EXPECT_EQ(batch->Signaled(), 1u);
  // Bytes and scales where the destinations say, nothing else touched.
  std::vector<uint8_t> hw(WR * W), hs(SR * SC * 4);
  SS_ASSERT_OK(CopyToHost(hw.data(), dw->data(), hw.size()));
  SS_ASSERT_OK(CopyToHost(hs.data(), ds->data(), hs.size()));
  std::vector<uint8_t> ew(WR * W, 0xcd), es(SR * SC * 4, 0xcd);
  at = 0;
  for (const Op& op : ops) {
    for (int64_t r = 0; r < op.rows; ++r) {
      std::memcpy(&ew[(op.wr + r) * W + op.wc], &wire[at + r * op.cols], op.cols);
    }
    const int64_t nbr = Fp8Blocks(op.rows), nbc = Fp8Blocks(op.cols);
    for (int64_t r = 0; r < nbr; ++r) {
      std::memcpy(&es[((op.sr + r) * SC + op.sc) * 4], &wire[at + op.rows * op.cols + r * nbc * 4],
                  nbc * 4);
    }
    at += Fp8WireBytes(op.rows, op.cols);
  }
  EXPECT_TRUE(hw == ew);
  EXPECT_TRUE(hs == es);
  SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
  EXPECT_EQ(sums[0], want);
  SS_ASSERT_OK_AND_ASSIGN(auto landed_sums, batch->LandedSums());
  SS_ASSERT_OK_AND_ASSIGN(auto finished, batch->Checksums());
  EXPECT_EQ(ChecksumFinish(landed_sums[0], spec.bucket_bytes[0]), finished[0]);
  EXPECT_EQ(batch->NonFinite(), std::vector<int64_t>{0});
  // A replay with a NaN in op 0's values: counted, its block written as NaN.
  float nan = std::numeric_limits<float>::quiet_NaN();
  SS_ASSERT_OK(CopyToDevice(static_cast<uint8_t*>(dsrc[0]->data()) + 4 * (3 * 512 + 9), &nan, 4));
  SS_ASSERT_OK(batch->LaunchSignaled(stream->handle(), 2));
  SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 batch"));
  EXPECT_EQ(batch->Signaled(), 2u);
  EXPECT_EQ(batch->NonFinite(), std::vector<int64_t>{1});
  // A map that reads op 1's rows one row off: the landed sum no longer matches.
  spec.encoded[1].landed_weight = static_cast<const uint8_t*>(spec.encoded[1].weight) + W;
  SS_ASSERT_OK_AND_ASSIGN(auto off, CopyBatch::Prepare(spec, 0));
  SS_ASSERT_OK(off->LaunchSignaled(stream->handle(), 1));
  SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 batch"));
  SS_ASSERT_OK_AND_ASSIGN(auto off_landed, off->LandedSums());
  SS_ASSERT_OK_AND_ASSIGN(auto off_sums, off->Checksums());
  EXPECT_NE(ChecksumFinish(off_landed[0], spec.bucket_bytes[0]), off_sums[0]);
  // Malformed ops are refused.
  spec.encoded[1].cols = 764;  // not a multiple of 8
  EXPECT_EQ(CopyBatch::Prepare(spec, 0).status().code(), StatusCode::kInvalidArgument);
}

// The pipelined quantize kernel as the sessions run it (every op of a batch in one dtype), over
// more blocks than it has CTAs, so CTAs run several blocks and cross ops and buckets: partial
// blocks on both dims, a source whose rows are not on 16 bytes (plain loads), a NaN block, four
// ops in three buckets (bucket 0 twice, apart). Every e4m3 byte, scale, packed and landed sum and
// non-finite count against the CPU quantize-pack, for f32, bf16 and f16 and each stage count.
TEST(GpuFp8, PreparedBatchRunsManyBlocksPerCta) {
  SS_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kF32, DType::kF16}) {
    // seeds: 4 and 8 have no NaN, 6 puts one at (5, 7) of its tensor.
    const Source a = MakeSource(dtype, 1200, 1800, 4), b = MakeSource(dtype, 300, 1026, 6),
                 c = MakeSource(dtype, 2048, 2048, 8);
    struct Op {
      const Source* s;
      int64_t r0, c0, rows, cols;
      int32_t bucket;
    } ops[] = {{&a, 128, 128, 1000, 1544, 0},  // 8 x 13 blocks, the last row / column partial
               {&b, 0, 0, 300, 1024, 1},       // rows of 2052 / 4104 bytes: not on 16 bytes
               {&c, 0, 0, 2048, 2048, 2},      // 256 whole blocks
               {&c, 0, 0, 128, 256, 0}};
    const int nb = 3;
    const int es = DTypeSize(dtype);
    std::vector<std::unique_ptr<DeviceBuffer>> dsrc;
    for (const Source* s : {&a, &b, &c}) {
      SS_ASSERT_OK_AND_ASSIGN(auto d, DeviceBuffer::Allocate(s->host.size(), 0));
      SS_ASSERT_OK(CopyToDevice(d->data(), s->host.data(), s->host.size()));
      dsrc.push_back(std::move(d));
    }
    auto src_of = [&](const Source* s) { return dsrc[s == &a ? 0 : s == &b ? 1 : 2]->data(); };
    // Each op's destinations: e4m3 rows at column 8 of [rows, cols + 16], scales at column 1 of
    // [nbr, nbc + 1]; the rest stays 0xcd.
    std::vector<std::unique_ptr<DeviceBuffer>> dw, ds;
    std::vector<std::vector<uint8_t>> want_w, want_s;
    std::vector<uint64_t> want_sum(nb, 0);
    std::vector<int64_t> want_bad(nb, 0), at(nb, 0);
    BatchSpec spec;
    spec.mode = BatchMode::kPack;
    spec.in_dtype = spec.out_dtype = DType::kBF16;
    for (const Op& op : ops) {
      const int64_t W = op.cols + 16, nbr = Fp8Blocks(op.rows), nbc = Fp8Blocks(op.cols);
      SS_ASSERT_OK_AND_ASSIGN(auto w, DeviceBuffer::Allocate(op.rows * W, 0));
      SS_ASSERT_OK_AND_ASSIGN(auto sc, DeviceBuffer::Allocate(nbr * (nbc + 1) * 4, 0));
      SS_ASSERT_OK(Memset(w->data(), 0xcd, op.rows * W));
      SS_ASSERT_OK(Memset(sc->data(), 0xcd, nbr * (nbc + 1) * 4));
      std::vector<uint8_t> wire(Fp8WireBytes(op.rows, op.cols));
      PackRegion pr{op.s->host.data(),
                    dtype,
                    {op.s->rows, op.s->cols},
                    Region::Make({op.r0, op.c0}, {op.rows, op.cols}),
                    at[op.bucket]};
      auto cpu = Fp8QuantizePack(pr, wire.data());
      ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
      want_sum[op.bucket] += cpu->sum;
      want_bad[op.bucket] += cpu->nonfinite;
      std::vector<uint8_t> ew(op.rows * W, 0xcd), esc(nbr * (nbc + 1) * 4, 0xcd);
      for (int64_t r = 0; r < op.rows; ++r) {
        std::memcpy(&ew[r * W + 8], &wire[r * op.cols], op.cols);
      }
      for (int64_t r = 0; r < nbr; ++r) {
        std::memcpy(&esc[(r * (nbc + 1) + 1) * 4], &wire[op.rows * op.cols + r * nbc * 4], nbc * 4);
      }
      want_w.push_back(std::move(ew));
      want_s.push_back(std::move(esc));
      EncodedTask t;
      t.src = static_cast<const uint8_t*>(src_of(op.s)) + (op.r0 * op.s->cols + op.c0) * es;
      t.dtype = dtype;
      t.src_stride = op.s->cols;
      t.rows = op.rows;
      t.cols = op.cols;
      t.weight = static_cast<uint8_t*>(w->data()) + 8;
      t.weight_stride = W;
      t.scales = static_cast<float*>(sc->data()) + 1;
      t.scale_stride = nbc + 1;
      t.landed_weight = t.weight;
      t.landed_weight_stride = W;
      t.landed_scales = t.scales;
      t.landed_scale_stride = nbc + 1;
      t.bucket = op.bucket;
      t.wire_offset = at[op.bucket];
      at[op.bucket] += Fp8WireBytes(op.rows, op.cols);
      spec.encoded.push_back(t);
      dw.push_back(std::move(w));
      ds.push_back(std::move(sc));
    }
    for (int k = 0; k < nb; ++k) {
      spec.bucket_bytes.push_back(at[k]);
      spec.copy_bytes.push_back(0);
    }
    SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
    const char* before = std::getenv("SHARDSYNC_FP8_STAGES");
    const std::string saved = before ? before : "";
    for (const char* stages : {"", "3", "4", "0"}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + ", SHARDSYNC_FP8_STAGES=" + stages);
      setenv("SHARDSYNC_FP8_STAGES", stages, 1);
      auto prepared = CopyBatch::Prepare(spec, 0);
      ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
      auto batch = std::move(prepared).value();
      for (size_t i = 0; i < dw.size(); ++i) {
        SS_ASSERT_OK(Memset(dw[i]->data(), 0xcd, want_w[i].size()));
        SS_ASSERT_OK(Memset(ds[i]->data(), 0xcd, want_s[i].size()));
      }
      for (uint64_t seq = 1; seq <= 2; ++seq) {  // a replay gives the same sums
        SS_ASSERT_OK(batch->LaunchSignaled(stream->handle(), seq));
        SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 batch"));
        EXPECT_EQ(batch->Signaled(), seq);
        SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
        SS_ASSERT_OK_AND_ASSIGN(auto landed, batch->LandedSums());
        EXPECT_EQ(sums, want_sum);
        EXPECT_EQ(landed, want_sum);
        EXPECT_EQ(batch->NonFinite(), want_bad);
      }
      for (size_t i = 0; i < dw.size(); ++i) {
        std::vector<uint8_t> hw(want_w[i].size()), hs(want_s[i].size());
        SS_ASSERT_OK(CopyToHost(hw.data(), dw[i]->data(), hw.size()));
        SS_ASSERT_OK(CopyToHost(hs.data(), ds[i]->data(), hs.size()));
        EXPECT_TRUE(hw == want_w[i]) << "op " << i << ": e4m3 bytes differ";
        EXPECT_TRUE(hs == want_s[i]) << "op " << i << ": scales differ";
      }
    }
    if (before) {
      setenv("SHARDSYNC_FP8_STAGES", saved.c_str(), 1);
    } else {
      unsetenv("SHARDSYNC_FP8_STAGES");
    }
    EXPECT_EQ(want_bad, (std::vector<int64_t>{0, 1, 0}));  // the test's own premise
  }
}

// Stage ops of a block-FP8 pack (BatchSpec::stage_runs): raw f32 rows copied with no cast (the
// batch's copies cast to bf16) into a "staging" buffer, beside a quantize op and a bf16 copy, in
// one signaled launch. The staged bytes arrive bit for bit, the packed sum is the quantize op's +
// the copy's + the stage image's, the landed sums (read back through the stage landed runs) agree,
// and a landed run one element off breaks them.
TEST(GpuFp8, PreparedBatchStagesRawValuesUnderTheSameSums) {
  SS_REQUIRE_GPU();
  const Source q = MakeSource(DType::kBF16, 128, 256, 4);
  const Source raw = MakeSource(DType::kF32, 96, 256, 7);  // 96 rows of a band, raw
  const int64_t n_stage = 96 * 256, n_copy = 1000;
  std::vector<uint16_t> copy_src(n_copy);
  for (int64_t i = 0; i < n_copy; ++i) copy_src[i] = static_cast<uint16_t>(i * 7);
  SS_ASSERT_OK_AND_ASSIGN(auto dq, DeviceBuffer::Allocate(q.host.size(), 0));
  SS_ASSERT_OK(CopyToDevice(dq->data(), q.host.data(), q.host.size()));
  SS_ASSERT_OK_AND_ASSIGN(auto draw, DeviceBuffer::Allocate(raw.host.size(), 0));
  SS_ASSERT_OK(CopyToDevice(draw->data(), raw.host.data(), raw.host.size()));
  SS_ASSERT_OK_AND_ASSIGN(auto dstage, DeviceBuffer::Allocate(n_stage * 4 + 64, 0));
  SS_ASSERT_OK(Memset(dstage->data(), 0xcd, n_stage * 4 + 64));
  SS_ASSERT_OK_AND_ASSIGN(auto dw, DeviceBuffer::Allocate(128 * 256, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto ds, DeviceBuffer::Allocate(2 * 4, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto dcs, DeviceBuffer::Allocate(n_copy * 2, 0));
  SS_ASSERT_OK(CopyToDevice(dcs->data(), copy_src.data(), n_copy * 2));
  SS_ASSERT_OK_AND_ASSIGN(auto dcd, DeviceBuffer::Allocate(n_copy * 2, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto lsum, DeviceBuffer::Allocate(8, 0));
  SS_ASSERT_OK(Memset(lsum->data(), 0, 8));
  BatchSpec spec;
  spec.mode = BatchMode::kPack;
  spec.in_dtype = spec.out_dtype = DType::kBF16;
  CopyRun run;
  run.in = dcs->data();
  run.out = dcd->data();
  run.row_elems = n_copy;
  spec.runs.push_back(run);
  CopyRun landed = run;
  landed.in = dcd->data();
  spec.landed_runs.push_back(landed);
  spec.landed_sums.push_back(lsum->data());
  spec.copy_bytes.push_back(n_copy * 2);
  EncodedTask t;
  t.src = dq->data();
  t.dtype = DType::kBF16;
  t.src_stride = 256;
  t.rows = 128;
  t.cols = 256;
  t.weight = dw->data();
  t.weight_stride = 256;
  t.scales = static_cast<float*>(ds->data());
  t.scale_stride = 2;
  t.landed_weight = t.weight;
  t.landed_weight_stride = 256;
  t.landed_scales = t.scales;
  t.landed_scale_stride = 2;
  spec.encoded.push_back(t);
  // The stage op: 96 rows of 256 f32, as two strided runs (rows [0, 40) and [40, 96)).
  spec.stage_dtype = DType::kF32;
  for (int64_t r0 : {int64_t{0}, int64_t{40}}) {
    CopyRun s;
    s.in = static_cast<const float*>(draw->data()) + r0 * 256;
    s.out = static_cast<float*>(dstage->data()) + r0 * 256;
    s.in_stride = s.out_stride = 256;
    s.row_elems = 256;
    s.rows = r0 == 0 ? 40 : 56;
    s.wire_offset = r0 * 256 * 4;
    spec.stage_runs.push_back(s);
    CopyRun l;
    l.in = s.out;
    l.row_elems = s.rows * 256;
    l.wire_offset = s.wire_offset;
    spec.stage_landed_runs.push_back(l);
  }
  spec.stage_bytes.push_back(n_stage * 4);
  spec.bucket_bytes.push_back(Fp8WireBytes(128, 256) + n_copy * 2 + n_stage * 4);
  std::vector<uint8_t> wire(Fp8WireBytes(128, 256));
  auto cpu = Fp8QuantizePack(
      PackRegion{q.host.data(), DType::kBF16, {128, 256}, Region::Make({0, 0}, {128, 256}), 0},
      wire.data());
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  const uint64_t want = cpu->sum + ChecksumPartial(copy_src.data(), n_copy * 2, 0) +
                        ChecksumPartial(raw.host.data(), n_stage * 4, 0);
  SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(spec, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  for (uint64_t seq = 1; seq <= 2; ++seq) {  // a replay sums from zero again
    SS_ASSERT_OK(batch->LaunchSignaled(stream->handle(), seq));
    SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 batch"));
    EXPECT_EQ(batch->Signaled(), seq);
    std::vector<uint8_t> staged(n_stage * 4 + 64);
    SS_ASSERT_OK(CopyToHost(staged.data(), dstage->data(), staged.size()));
    EXPECT_EQ(std::memcmp(staged.data(), raw.host.data(), n_stage * 4), 0);  // raw, not cast
    EXPECT_EQ(staged[n_stage * 4], 0xcd);                                    // nothing past it
    SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
    EXPECT_EQ(sums[0], want);
    SS_ASSERT_OK_AND_ASSIGN(auto landed_sums, batch->LandedSums());
    SS_ASSERT_OK_AND_ASSIGN(auto finished, batch->Checksums());
    EXPECT_EQ(ChecksumFinish(landed_sums[0], spec.bucket_bytes[0]), finished[0]);
  }
  // A staging map one element off: the landed sum no longer matches.
  spec.stage_landed_runs[1].in = static_cast<const float*>(spec.stage_landed_runs[1].in) + 1;
  SS_ASSERT_OK_AND_ASSIGN(auto off, CopyBatch::Prepare(spec, 0));
  SS_ASSERT_OK(off->LaunchSignaled(stream->handle(), 1));
  SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 batch"));
  SS_ASSERT_OK_AND_ASSIGN(auto off_landed, off->LandedSums());
  SS_ASSERT_OK_AND_ASSIGN(auto off_sums, off->Checksums());
  EXPECT_NE(ChecksumFinish(off_landed[0], spec.bucket_bytes[0]), off_sums[0]);
  // Stage runs that do not tile their image are refused.
  spec.stage_bytes[0] += 8;
  EXPECT_FALSE(CopyBatch::Prepare(spec, 0).ok());
}

// A receiver's quantize pass over its staged bands (Fp8Kernels::QuantizeBands): the CUDA packer
// (the prepared FP8 batch over local memory) against the CPU packer (fp8.h), bit for bit, in e4m3
// bytes, scales and per-band non-finite counts; f32 and bf16 bands of 128 and 64 rows into strided
// weights, one band with a NaN; a replay gives the same.
TEST(GpuFp8, CudaPackerQuantizesStagedBandsLikeTheCpu) {
  SS_REQUIRE_GPU();
  const Source f = MakeSource(DType::kF32, 128, 512, 4), b = MakeSource(DType::kBF16, 64, 512, 6);
  const int64_t W = 640, SC = 5;  // weight rows of 640 bytes, 5 scales per row
  std::vector<uint8_t> hw(192 * W, 0xa5), hs(2 * SC * 4, 0xa5);
  SS_ASSERT_OK_AND_ASSIGN(auto dsrc, DeviceBuffer::Allocate(f.host.size() + b.host.size(), 0));
  SS_ASSERT_OK(CopyToDevice(dsrc->data(), f.host.data(), f.host.size()));
  SS_ASSERT_OK(CopyToDevice(static_cast<uint8_t*>(dsrc->data()) + f.host.size(), b.host.data(),
                            b.host.size()));
  SS_ASSERT_OK_AND_ASSIGN(auto dw, DeviceBuffer::Allocate(hw.size(), 0));
  SS_ASSERT_OK_AND_ASSIGN(auto ds, DeviceBuffer::Allocate(hs.size(), 0));
  SS_ASSERT_OK(CopyToDevice(dw->data(), hw.data(), hw.size()));
  SS_ASSERT_OK(CopyToDevice(ds->data(), hs.data(), hs.size()));
  auto bands = [&](uint8_t* src, uint8_t* w, float* s) {
    Fp8BandTask x{src, DType::kF32, 128, 512, w + 8, W, s + 1, SC};
    Fp8BandTask y{src + f.host.size(), DType::kBF16, 64, 512, w + 128 * W + 8, W, s + SC + 1, SC};
    return std::vector<Fp8BandTask>{x, y};
  };
  std::vector<uint8_t> host_src(f.host);
  host_src.insert(host_src.end(), b.host.begin(), b.host.end());
  auto cpu_packer = MakeCpuPacker();
  auto want_bad =
      KernelsOf<Fp8Kernels>(*cpu_packer)
          ->QuantizeBands(bands(host_src.data(), hw.data(), reinterpret_cast<float*>(hs.data())));
  ASSERT_TRUE(want_bad.ok()) << want_bad.status().ToString();
  EXPECT_EQ(*want_bad, (std::vector<int64_t>{0, 1}));  // the test's own premise: seed 6 has a NaN
  auto packer = MakeCudaPacker(0, Millis(20000));
  for (int rep = 0; rep < 2; ++rep) {
    auto bad = KernelsOf<Fp8Kernels>(*packer)->QuantizeBands(
        bands(static_cast<uint8_t*>(dsrc->data()), static_cast<uint8_t*>(dw->data()),
              static_cast<float*>(ds->data())));
    ASSERT_TRUE(bad.ok()) << bad.status().ToString();
    EXPECT_EQ(*bad, *want_bad);
    std::vector<uint8_t> gw(hw.size()), gs(hs.size());
    SS_ASSERT_OK(CopyToHost(gw.data(), dw->data(), gw.size()));
    SS_ASSERT_OK(CopyToHost(gs.data(), ds->data(), gs.size()));
    EXPECT_TRUE(gw == hw);
    EXPECT_TRUE(gs == hs);
  }
}

// The amax exchange over device pairs, kernel by kernel: one block row (rows [128, 256) of a
// 384 x 600 tensor: four whole column blocks and one of 88 columns) split 3 ways with uneven rows
// (22, 81, 25) among holders. Each holder's partial amax by the CUDA packer equals the CPU's
// (Fp8PartialAmax) bit for bit, at its slot of a longer value whose other entries stay zero; the
// prepared FP8 batch then quantizes each holder's rows with the agreed scales (given-scale
// tasks, only the first holder writing them) into the destinations, byte for byte the CPU's
// Fp8QuantizePackScaled, with equal packed and landed sums, and the three together equal the
// whole band quantized at once (Fp8QuantizePack). A NaN in one holder's rows makes its partial
// non-finite on the device as on the CPU. f32 and bf16 sources.
TEST(GpuFp8, AmaxExchangePartsMatchTheCpuAndTheWholeBlock) {
  SS_REQUIRE_GPU();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const int64_t R = 384, C = 600, nbc = Fp8Blocks(C), row0 = 128;
    const Source src = MakeSource(dtype, R, C, 7);  // seed 7: no NaN of its own
    const int es = DTypeSize(dtype);
    struct Holder {
      int64_t r0, rows;
    } holders[] = {{128, 22}, {150, 81}, {231, 25}};
    SS_ASSERT_OK_AND_ASSIGN(auto dsrc, DeviceBuffer::Allocate(src.host.size(), 0));
    SS_ASSERT_OK(CopyToDevice(dsrc->data(), src.host.data(), src.host.size()));
    auto packer = MakeCudaPacker(0, Millis(20000));
    auto cpu_partial = [&](const std::vector<uint8_t>& host, const Holder& h) {
      std::vector<uint32_t> p(nbc, 0);
      PackRegion pr{host.data(), dtype, {R, C}, Region::Make({h.r0, 0}, {h.rows, C}), 0};
      EXPECT_TRUE(Fp8PartialAmax(pr, p.data()).ok());
      return p;
    };
    auto gpu_partial = [&](const Holder& h) {
      const int64_t slot = 3, len = slot + nbc + 2;  // other entries: zero
      std::vector<uint32_t> out(len, 0xdeadbeef);
      Fp8AmaxTask t{
          static_cast<const uint8_t*>(dsrc->data()) + h.r0 * C * es, dtype, C, h.rows, C, slot};
      Status st = KernelsOf<Fp8Kernels>(*packer)->PartialAmax({t}, out.data(), len);
      EXPECT_TRUE(st.ok()) << st.ToString();
      for (int64_t i = 0; i < len; ++i) {
        if (i < slot || i >= slot + nbc) {
          EXPECT_EQ(out[i], 0u) << "entry " << i;
        }
      }
      return std::vector<uint32_t>(out.begin() + slot, out.begin() + slot + nbc);
    };
    std::vector<uint32_t> agreed(nbc, 0);
    for (const Holder& h : holders) {
      const std::vector<uint32_t> want = cpu_partial(src.host, h), got = gpu_partial(h);
      EXPECT_EQ(got, want) << "holder at row " << h.r0;
      for (int64_t i = 0; i < nbc; ++i) agreed[i] = std::max(agreed[i], want[i]);
    }
    std::vector<float> scales(nbc);
    for (int64_t i = 0; i < nbc; ++i) {
      ASSERT_TRUE(Fp8AmaxBitsFinite(agreed[i]));
      scales[i] = Fp8BlockScale(Fp8BitsFloat(agreed[i]));
    }
    SS_ASSERT_OK_AND_ASSIGN(auto dscales, DeviceBuffer::Allocate(nbc * 4, 0));
    SS_ASSERT_OK(packer->Upload(dscales->data(), scales.data(), nbc * 4));
    // Destinations: e4m3 rows of 640 bytes (the band at row 5, column 16), scales 8 per row.
    const int64_t W = 640, WR = 140, SC = 8;
    SS_ASSERT_OK_AND_ASSIGN(auto dw, DeviceBuffer::Allocate(WR * W, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto ds, DeviceBuffer::Allocate(SC * 4, 0));
    SS_ASSERT_OK(Memset(dw->data(), 0xcd, WR * W));
    SS_ASSERT_OK(Memset(ds->data(), 0xcd, SC * 4));
    BatchSpec spec;
    spec.mode = BatchMode::kPack;
    spec.in_dtype = spec.out_dtype = DType::kBF16;
    spec.copy_bytes.push_back(0);
    std::vector<uint8_t> wire;
    uint64_t want_sum = 0;
    int64_t at = 0;
    for (size_t i = 0; i < 3; ++i) {
      const Holder& h = holders[i];
      const bool with = i == 0;
      const int64_t bytes = Fp8PartWireBytes(h.rows, C, with);
      wire.resize(at + bytes);
      PackRegion pr{src.host.data(), dtype, {R, C}, Region::Make({h.r0, 0}, {h.rows, C}), at};
      auto cpu = Fp8QuantizePackScaled(pr, scales.data(), with, wire.data() + at);
      ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
      EXPECT_EQ(cpu->nonfinite, 0);
      want_sum += cpu->sum;
      EncodedTask t;
      t.src = static_cast<const uint8_t*>(dsrc->data()) + h.r0 * C * es;
      t.dtype = dtype;
      t.src_stride = C;
      t.rows = h.rows;
      t.cols = C;
      t.weight = static_cast<uint8_t*>(dw->data()) + (5 + h.r0 - row0) * W + 16;
      t.weight_stride = W;
      t.landed_weight = t.weight;
      t.landed_weight_stride = W;
      if (with) {
        t.scales = static_cast<float*>(ds->data()) + 1;
        t.scale_stride = SC;
        t.landed_scales = t.scales;
        t.landed_scale_stride = SC;
      }
      t.given_scales = static_cast<const float*>(dscales->data());
      t.wire_offset = at;
      spec.encoded.push_back(t);
      at += bytes;
    }
    spec.bucket_bytes.push_back(at);
    // The whole band quantized at once: what the three parts must add up to.
    std::vector<uint8_t> whole(Fp8WireBytes(128, C));
    PackRegion band{src.host.data(), dtype, {R, C}, Region::Make({row0, 0}, {128, C}), 0};
    ASSERT_TRUE(Fp8QuantizePack(band, whole.data()).ok());
    for (const char* stages : {"2", "0"}) {  // the pipelined kernel and the fallback
      SCOPED_TRACE(std::string("SHARDSYNC_FP8_STAGES=") + stages);
      setenv("SHARDSYNC_FP8_STAGES", stages, 1);
      SS_ASSERT_OK_AND_ASSIGN(auto batch, CopyBatch::Prepare(spec, 0));
      unsetenv("SHARDSYNC_FP8_STAGES");
      SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
      SS_ASSERT_OK(batch->LaunchSignaled(stream->handle(), 1));
      SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 batch"));
      std::vector<uint8_t> hw(WR * W), hs(SC * 4);
      SS_ASSERT_OK(CopyToHost(hw.data(), dw->data(), hw.size()));
      SS_ASSERT_OK(CopyToHost(hs.data(), ds->data(), hs.size()));
      std::vector<uint8_t> ew(WR * W, 0xcd), esc(SC * 4, 0xcd);
      int64_t off = 0;
      for (size_t i = 0; i < 3; ++i) {
        const Holder& h = holders[i];
        for (int64_t r = 0; r < h.rows; ++r) {
          std::memcpy(&ew[(5 + h.r0 - row0 + r) * W + 16], &wire[off + r * C], C);
        }
        if (i == 0) std::memcpy(&esc[4], &wire[off + ((h.rows * C + 7) & ~7)], nbc * 4);
        off += Fp8PartWireBytes(h.rows, C, i == 0);
      }
      EXPECT_TRUE(hw == ew);
      EXPECT_TRUE(hs == esc);
      for (int64_t r = 0; r < 128; ++r) {  // and the whole band's bytes and scales
        EXPECT_EQ(std::memcmp(&hw[(5 + r) * W + 16], &whole[r * C], C), 0) << "row " << r;
      }
      EXPECT_EQ(std::memcmp(&hs[4], &whole[128 * C], nbc * 4), 0);
      SS_ASSERT_OK_AND_ASSIGN(auto sums, batch->Sums());
      EXPECT_EQ(sums[0], want_sum);
      SS_ASSERT_OK_AND_ASSIGN(auto landed, batch->LandedSums());
      SS_ASSERT_OK_AND_ASSIGN(auto finished, batch->Checksums());
      EXPECT_EQ(ChecksumFinish(landed[0], spec.bucket_bytes[0]), finished[0]);
      EXPECT_EQ(finished[0],
                ChecksumFinish(ChecksumPartial(wire.data(), wire.size(), 0), spec.bucket_bytes[0]));
      EXPECT_EQ(batch->NonFinite(), std::vector<int64_t>{0});
    }
    // A NaN in the middle holder's rows: its partial is non-finite on the device as on the CPU,
    // the other holders' are not.
    std::vector<uint8_t> host = src.host;
    const int64_t at_nan = (150 + 40) * C + 300;
    if (dtype == DType::kF32) {
      const float nan = std::nanf("");
      std::memcpy(&host[at_nan * 4], &nan, 4);
    } else {
      const uint16_t nan = F32ToBF16(std::nanf(""));
      std::memcpy(&host[at_nan * 2], &nan, 2);
    }
    SS_ASSERT_OK(CopyToDevice(dsrc->data(), host.data(), host.size()));
    for (const Holder& h : holders) {
      const std::vector<uint32_t> want = cpu_partial(host, h), got = gpu_partial(h);
      for (int64_t i = 0; i < nbc; ++i) {
        EXPECT_EQ(Fp8AmaxBitsFinite(got[i]), Fp8AmaxBitsFinite(want[i])) << h.r0 << " " << i;
        EXPECT_EQ(Fp8AmaxBitsFinite(got[i]), !(h.r0 == 150 && i == 300 / 128));
        if (Fp8AmaxBitsFinite(want[i])) {
          EXPECT_EQ(got[i], want[i]);
        }
      }
    }
  }
}

// Given-scale tasks that break the rules are refused when the batch is prepared: more than one
// block row, or no scales written nor given.
TEST(GpuFp8, PreparedBatchRefusesMalformedAmaxTasks) {
  SS_REQUIRE_GPU();
  SS_ASSERT_OK_AND_ASSIGN(auto d, DeviceBuffer::Allocate(1 << 20, 0));
  auto* p = static_cast<uint8_t*>(d->data());
  BatchSpec spec;
  spec.mode = BatchMode::kPack;
  spec.copy_bytes.push_back(0);
  spec.bucket_bytes.push_back(1 << 18);
  EncodedTask t;
  t.src = p;
  t.dtype = DType::kF32;
  t.src_stride = 256;
  t.rows = 129;
  t.cols = 256;
  t.weight = p + (1 << 19);
  t.weight_stride = 256;
  t.landed_weight = t.weight;
  t.landed_weight_stride = 256;
  t.given_scales = reinterpret_cast<const float*>(p + (1 << 19) + (1 << 18));
  spec.encoded.push_back(t);
  EXPECT_EQ(CopyBatch::Prepare(spec, 0).status().code(), StatusCode::kInvalidArgument);
  spec.encoded[0].rows = 128;
  EXPECT_TRUE(CopyBatch::Prepare(spec, 0).ok());  // e4m3 rows alone, scales given
  spec.encoded[0].given_scales = nullptr;
  EXPECT_EQ(CopyBatch::Prepare(spec, 0).status().code(), StatusCode::kInvalidArgument);
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
