// Block-FP8 rounds of nccl pairs (cuda/nccl/fp8_rounds.h) on ONE GPU without NCCL: the sender's
// batches build a round's wire image in a slot, the slot's bytes are copied to the receiver's slot
// (what ncclSend / ncclRecv do, already proven by the bf16 path), and the receiver's batch
// scatters them. Every byte of the image is held to the host path's (the CPU quantize-pack,
// Fp8QuantizePack, for quantize ops; cast copies; zero pads), every landed e4m3 byte and scale to
// the same, and the packed checksum to the landed one, which a corrupted byte breaks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "shardsync/checksum.h"
#include "shardsync/fp8.h"
#include "shardsync/gpu.h"
#include "shardsync/transport.h"

#if defined(SHARDSYNC_HAVE_CUDA)
#include "cuda/nccl/fp8_rounds.h"
#endif

namespace shardsync::gpu {
namespace {

#if defined(SHARDSYNC_HAVE_CUDA)

int64_t Up8(int64_t n) { return (n + 7) & ~int64_t{7}; }

// A host tensor of trainer values (f32 or bf16) and its device copy.
struct Tensor {
  Shape shape;
  std::vector<uint8_t> host;
  std::unique_ptr<DeviceBuffer> dev;
};

// Values whose 128 x 128 blocks differ in scale (zero blocks, tiny, large, normal); `nan_at`
// (element index, or -1) gets a NaN.
Tensor MakeTensor(DType dtype, Shape shape, uint64_t seed, int64_t nan_at = -1) {
  Tensor t{shape, {}, nullptr};
  const int64_t rows = shape[0], cols = shape[1];
  std::mt19937_64 rng(seed);
  t.host.resize(rows * cols * DTypeSize(dtype));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t block = (r / 128) * 7 + c / 128 + static_cast<int64_t>(seed);
      float v = 0.f;
      if (block % 4 == 1) {
        v = std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng),
                       std::uniform_int_distribution<int>(-30, 10)(rng));
      } else if (block % 4 != 0) {
        v = std::normal_distribution<float>(0.f, 0.03f)(rng);
      }
      if (r * cols + c == nan_at) v = std::numeric_limits<float>::quiet_NaN();
      if (dtype == DType::kF32) {
        std::memcpy(t.host.data() + 4 * (r * cols + c), &v, 4);
      } else {
        const uint16_t h = F32ToBF16(v);
        std::memcpy(t.host.data() + 2 * (r * cols + c), &h, 2);
      }
    }
  }
  return t;
}

Status Upload(Tensor& t) {
  SS_ASSIGN_OR_RETURN(t.dev, DeviceBuffer::Allocate(t.host.size(), 0));
  return CopyToDevice(t.dev->data(), t.host.data(), t.host.size());
}

// A receiver's parameter: device memory filled with 0xa5, and what it must hold after the round.
struct Param {
  DType dtype;
  Shape shape;
  std::vector<uint8_t> want;
  std::unique_ptr<DeviceBuffer> dev;
};
Status MakeParam(Param& p) {
  const size_t n = NumElements(p.shape) * DTypeSize(p.dtype);
  p.want.assign(n, 0xa5);
  SS_ASSIGN_OR_RETURN(p.dev, DeviceBuffer::Allocate(n, 0));
  return Memset(p.dev->data(), 0xa5, n);
}
// Scatters `n` bytes of `wire` (row-major over region r, elements of es bytes) into p.want.
void Scatter(Param& p, const Region& r, const uint8_t* wire) {
  const int es = DTypeSize(p.dtype);
  int64_t at = 0;
  ForEachRun(r, p.shape, [&](int64_t off, int64_t len) {
    std::memcpy(p.want.data() + off * es, wire + at, len * es);
    at += len * es;
  });
}

// One round: quantize ops with partial blocks at both edges, an odd scale count (a scale pad), a
// NaN block and a 3-d expert destination; copy ops whose sizes leave 2- and 6-byte pads; ops in
// mixed order.
TEST(GpuFp8Rounds, SenderSlotReceiverEqualTheHostPathByteForByte) {
  SS_REQUIRE_GPU();
  const DType wire = DType::kBF16;
  for (DType td : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(std::string(DTypeName(td)));
    // Sources: a [300, 520] weight (44-row and 8-column partial blocks), a [256, 384] weight with
    // a NaN at (130, 200) (block (1, 1)), a [10, 37] unquantized tensor.
    Tensor a = MakeTensor(td, {300, 520}, 1), b = MakeTensor(td, {256, 384}, 2, 130 * 384 + 200),
           c = MakeTensor(td, {10, 37}, 3);
    for (Tensor* t : {&a, &b, &c}) SS_ASSERT_OK(Upload(*t));
    // Receiver parameters: e4m3 weights wider than the ops (strided), one of them 3-d (experts),
    // scales with spare rows and columns, a bf16 copy target.
    Param wa{DType::kF8E4M3, {320, 536}, {}, nullptr}, sa{DType::kF32, {4, 7}, {}, nullptr};
    Param wb{DType::kF8E4M3, {2, 256, 400}, {}, nullptr}, sb{DType::kF32, {2, 2, 4}, {}, nullptr};
    Param pc{DType::kBF16, {12, 40}, {}, nullptr};
    for (Param* p : {&wa, &sa, &wb, &sb, &pc}) SS_ASSERT_OK(MakeParam(*p));

    struct Quant {
      Tensor* src;
      Region region;  // of the source
      Param *w, *s;
      Region wdst, sdst;
    };
    struct Copy {
      Tensor* src;
      Region region;
      Region dst;  // of pc
    };
    // Wire order: copy 0, quantize 0, quantize 1, copy 1, quantize 2.
    const std::vector<Quant> quants = {
        {&a, Region::Make({0, 0}, {256, 520}), &wa, &sa, Region::Make({10, 8}, {256, 520}),
         Region::Make({1, 1}, {2, 5})},
        {&a, Region::Make({256, 0}, {44, 520}), &wa, &sa, Region::Make({266, 8}, {44, 520}),
         Region::Make({3, 1}, {1, 5})},  // 5 scales: a 4-byte pad
        {&b, Region::Make({0, 0}, {256, 384}), &wb, &sb, Region::Make({1, 0, 0}, {1, 256, 384}),
         Region::Make({1, 0, 0}, {1, 2, 3})},  // NaN block, 3-d destination
    };
    const std::vector<Copy> copies = {
        {&c, Region::Make({2, 3}, {5, 27}), Region::Make({1, 2}, {5, 27})},   // 270 bytes: pad 2
        {&c, Region::Make({9, 36}, {1, 1}), Region::Make({11, 39}, {1, 1})},  // 2 bytes: pad 6
    };
    std::vector<int64_t> qoff(3), coff(2);
    int64_t at = 0;
    auto place = [&](int64_t bytes) {
      const int64_t o = at;
      at += Up8(bytes);
      return o;
    };
    coff[0] = place(copies[0].region.numel() * 2);
    for (int q = 0; q < 2; ++q) {
      qoff[q] = place(Fp8WireBytes(quants[q].region.extent[0], quants[q].region.extent[1]));
    }
    coff[1] = place(copies[1].region.numel() * 2);
    qoff[2] = place(Fp8WireBytes(256, 384));
    const int64_t bytes = at;

    // The host path's image of the round (fp8_host_pack.cc: Fp8QuantizePack, cast copies, zero pads).
    std::vector<uint8_t> want(bytes, 0);
    int64_t want_bad = 0;
    for (int q = 0; q < 3; ++q) {
      const Quant& op = quants[q];
      PackRegion pr{op.src->host.data(), td, op.src->shape, op.region, qoff[q]};
      auto cpu = Fp8QuantizePack(pr, want.data() + qoff[q]);
      ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
      want_bad += cpu->nonfinite;
      const int64_t e4m3 = op.region.numel();
      Scatter(*op.w, op.wdst, want.data() + qoff[q]);
      Scatter(*op.s, op.sdst, want.data() + qoff[q] + Up8(e4m3));
    }
    for (int i = 0; i < 2; ++i) {
      const Copy& op = copies[i];
      int64_t k = 0;
      ForEachRun(op.region, op.src->shape, [&](int64_t off, int64_t len) {
        for (int64_t e = 0; e < len; ++e, ++k) {
          float v;
          if (td == DType::kF32) {
            std::memcpy(&v, op.src->host.data() + 4 * (off + e), 4);
          } else {
            uint16_t h;
            std::memcpy(&h, op.src->host.data() + 2 * (off + e), 2);
            v = BF16ToF32(h);
          }
          const uint16_t w = F32ToBF16(v);
          std::memcpy(want.data() + coff[i] + 2 * k, &w, 2);
        }
      });
      Scatter(pc, op.dst, want.data() + coff[i]);
    }
    ASSERT_EQ(want_bad, 1);
    const uint64_t want_sum = ChecksumFinish(ChecksumPartial(want.data(), bytes, 0), bytes);

    // The two sides' PairBuckets, as sync/fp8_pairs.cc builds them.
    PairBucket send, recv;
    send.bytes = recv.bytes = bytes;
    int64_t compact = 0;
    for (int i = 0; i < 2; ++i) {
      const Copy& op = copies[i];
      send.local.push_back({op.src->dev->data(), td, op.src->shape, op.region, compact});
      recv.local.push_back({pc.dev->data(), wire, pc.shape, op.dst, compact});
      send.wire_offsets.push_back(coff[i]);
      recv.wire_offsets.push_back(coff[i]);
      compact += op.region.numel() * 2;
    }
    for (int q = 0; q < 3; ++q) {
      const Quant& op = quants[q];
      QuantizeRegion s;
      s.src = {op.src->dev->data(), td, op.src->shape, op.region, qoff[q]};
      send.quantize.push_back(s);
      QuantizeRegion r;
      r.landed_weight = {op.w->dev->data(), DType::kF8E4M3, op.w->shape, op.wdst, qoff[q]};
      r.landed_scales = {op.s->dev->data(), DType::kF32, op.s->shape, op.sdst, 0};
      recv.quantize.push_back(r);
    }
    SS_ASSERT_OK_AND_ASSIGN(auto slot, DeviceBuffer::Allocate(bytes, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto rslot, DeviceBuffer::Allocate(bytes, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto zeros, DeviceBuffer::Allocate(kFp8RoundScratchBytes, 0));
    SS_ASSERT_OK_AND_ASSIGN(auto sink, DeviceBuffer::Allocate(kFp8RoundScratchBytes, 0));
    SS_ASSERT_OK(Memset(zeros->data(), 0, kFp8RoundScratchBytes));
    // A slot another round used: every byte of this round must be written.
    SS_ASSERT_OK(Memset(slot->data(), 0xcd, bytes));
    SS_ASSERT_OK(Memset(rslot->data(), 0x5a, bytes));
    SS_ASSERT_OK_AND_ASSIGN(
        Fp8SendRound sender,
        PrepareFp8SendRound(send, wire, slot->data(), zeros->data(), 0, "test sender"));
    SS_ASSERT_OK_AND_ASSIGN(
        auto receiver, PrepareFp8RecvRound(recv, wire, rslot->data(), sink->data(), 0, "test"));
    SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
    auto round = [&]() -> Status {
      SS_RETURN_IF_ERROR(sender.pack->Launch(stream->handle()));
      SS_RETURN_IF_ERROR(sender.verify->Launch(stream->handle()));
      SS_RETURN_IF_ERROR(
          CopyDeviceToDevice(rslot->data(), slot->data(), bytes, stream->handle()));  // "NCCL"
      SS_RETURN_IF_ERROR(receiver->Launch(stream->handle()));
      return stream->Synchronize(Millis(20000), "fp8 round");
    };
    SS_ASSERT_OK(round());

    std::vector<uint8_t> got(bytes);
    SS_ASSERT_OK(CopyToHost(got.data(), slot->data(), bytes));
    int64_t mismatches = 0;
    for (int64_t i = 0; i < bytes; ++i) {
      if (got[i] != want[i] && mismatches++ < 5) {
        ADD_FAILURE() << "slot byte " << i << " of " << bytes << ": gpu " << int(got[i])
                      << ", host path " << int(want[i]);
      }
    }
    EXPECT_EQ(mismatches, 0);
    SS_ASSERT_OK_AND_ASSIGN(auto packed, sender.verify->Checksums());
    SS_ASSERT_OK_AND_ASSIGN(auto landed, receiver->Checksums());
    EXPECT_EQ(packed[0], want_sum);  // the host path's checksum of the same bucket
    EXPECT_EQ(landed[0], packed[0]);
    EXPECT_EQ(sender.pack->NonFinite(), std::vector<int64_t>{1});
    for (Param* p : {&wa, &sa, &wb, &sb, &pc}) {
      std::vector<uint8_t> h(p->want.size());
      SS_ASSERT_OK(CopyToHost(h.data(), p->dev->data(), h.size()));
      int64_t bad = 0;
      for (size_t i = 0; i < h.size(); ++i) bad += h[i] != p->want[i];
      EXPECT_EQ(bad, 0) << "parameter of shape " << ShapeToString(p->shape) << ", "
                        << DTypeName(p->dtype);
    }

    // A replay on a dirtied slot gives the same sums; one corrupted byte the receiver reads (a
    // scale, an e4m3 byte, a pad) makes the landed checksum differ from the packed one.
    SS_ASSERT_OK(Memset(slot->data(), 0x11, bytes));
    SS_ASSERT_OK(round());
    SS_ASSERT_OK_AND_ASSIGN(auto again, sender.verify->Checksums());
    EXPECT_EQ(again[0], want_sum);
    const int64_t scale0 = qoff[1] + Up8(44 * 520);
    for (int64_t byte : {scale0 + 1, qoff[2] + 77, coff[0] + 270, qoff[1] + Up8(44 * 520) + 20}) {
      SCOPED_TRACE("corrupted byte " + std::to_string(byte));
      SS_ASSERT_OK(sender.pack->Launch(stream->handle()));
      SS_ASSERT_OK(sender.verify->Launch(stream->handle()));
      SS_ASSERT_OK(CopyDeviceToDevice(rslot->data(), slot->data(), bytes, stream->handle()));
      SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 round"));
      uint8_t v = 0;
      SS_ASSERT_OK(CopyToHost(&v, static_cast<uint8_t*>(rslot->data()) + byte, 1));
      v ^= 0x40;
      SS_ASSERT_OK(CopyToDevice(static_cast<uint8_t*>(rslot->data()) + byte, &v, 1));
      SS_ASSERT_OK(receiver->Launch(stream->handle()));
      SS_ASSERT_OK(stream->Synchronize(Millis(20000), "fp8 round"));
      SS_ASSERT_OK_AND_ASSIGN(auto p2, sender.verify->Checksums());
      SS_ASSERT_OK_AND_ASSIGN(auto l2, receiver->Checksums());
      EXPECT_EQ(p2[0], want_sum);
      EXPECT_NE(l2[0], p2[0]);
    }
  }
}

// Malformed rounds are refused at prepare time, naming the round: ops that overlap, copies
// without their wire offsets, stage ops (one-sided pairs only), a copy target not in the wire
// dtype.
TEST(GpuFp8Rounds, MalformedRoundsAreRefused) {
  SS_REQUIRE_GPU();
  Tensor a = MakeTensor(DType::kF32, {128, 128}, 4);
  SS_ASSERT_OK(Upload(a));
  SS_ASSERT_OK_AND_ASSIGN(auto slot, DeviceBuffer::Allocate(1 << 16, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto zeros, DeviceBuffer::Allocate(kFp8RoundScratchBytes, 0));
  SS_ASSERT_OK(Memset(zeros->data(), 0, kFp8RoundScratchBytes));
  PairBucket b;
  b.bytes = Fp8WireBytes(128, 128) + 256;
  QuantizeRegion q;
  q.src = {a.dev->data(), DType::kF32, a.shape, Region::Make({0, 0}, {128, 128}), 0};
  b.quantize.push_back(q);
  b.local.push_back({a.dev->data(), DType::kF32, a.shape, Region::Make({0, 0}, {1, 64}), 0});
  b.wire_offsets.push_back(8);  // inside the quantize op's bytes
  auto r = PrepareFp8SendRound(b, DType::kBF16, slot->data(), zeros->data(), 0, "round 7");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("round 7"), std::string::npos) << r.status().ToString();
  b.wire_offsets.clear();
  EXPECT_EQ(
      PrepareFp8SendRound(b, DType::kBF16, slot->data(), zeros->data(), 0, "r").status().code(),
      StatusCode::kInvalidArgument);
  b.wire_offsets.push_back(Fp8WireBytes(128, 128));  // fits: accepted
  EXPECT_TRUE(PrepareFp8SendRound(b, DType::kBF16, slot->data(), zeros->data(), 0, "r").ok());
  b.stage.push_back({});
  EXPECT_EQ(
      PrepareFp8SendRound(b, DType::kBF16, slot->data(), zeros->data(), 0, "r").status().code(),
      StatusCode::kUnimplemented);
  // A receiver's copy target in f32 while the wire is bf16.
  PairBucket rb;
  rb.bytes = 256;
  rb.local.push_back({a.dev->data(), DType::kF32, a.shape, Region::Make({0, 0}, {1, 64}), 0});
  rb.wire_offsets.push_back(0);
  auto rr = PrepareFp8RecvRound(rb, DType::kBF16, slot->data(), zeros->data(), 0, "round 3");
  ASSERT_FALSE(rr.ok());
  EXPECT_NE(rr.status().message().find("wire dtype"), std::string::npos) << rr.status().ToString();
}

#else
TEST(GpuFp8Rounds, SkippedWithoutCuda) { GTEST_SKIP() << "GPU test skipped: built without CUDA"; }
#endif

}  // namespace
}  // namespace shardsync::gpu
