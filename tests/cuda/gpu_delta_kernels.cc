// The device delta codec (delta_gpu.h) against the host codec (delta.h): device encode gives
// EncodeDelta's bytes, device decode restores `next` from host encodings and refuses what
// DecodeDeltaInPlace refuses, with the same message, leaving the bucket as it was.
// Its own binary (test_gpu_delta, label gpu): skipped where no GPU is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common/delta_mutate.h"
#include "cuda/gpu_test_util.h"
#include "shardsync/checksum.h"
#include "shardsync/delta.h"
#include "shardsync/delta_gpu.h"
#include "shardsync/delta_rule.h"
#include "shardsync/gpu.h"

namespace shardsync::gpu {
namespace {

using Bytes = std::vector<std::byte>;
constexpr std::chrono::milliseconds kTimeout{60000};
constexpr uint64_t kMaxBytes = uint64_t{48} << 20;

Bytes RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// `base` with `changed` distinct elements changed (the top byte of each flipped).
Bytes Mutate(const Bytes& base, int e, uint64_t changed, uint32_t seed) {
  Bytes next = base;
  const uint64_t elements = base.size() / e;
  std::vector<uint32_t> order(elements);
  for (uint64_t i = 0; i < elements; ++i) order[i] = static_cast<uint32_t>(i);
  std::mt19937 rng(seed);
  for (uint64_t k = 0; k < changed; ++k) {  // partial Fisher-Yates: the first `changed`
    std::swap(order[k], order[k + rng() % (elements - k)]);
    std::byte* p = next.data() + uint64_t{order[k]} * e;
    p[e - 1] ^= static_cast<std::byte>(1 + rng() % 255);
    if (e > 1) p[0] = static_cast<std::byte>(rng());
  }
  return next;
}

using testing_delta::MutateSmall;

class GpuDelta : public ::testing::Test {
 protected:
  void SetUp() override {
    SS_REQUIRE_GPU();
    SS_ASSERT_OK(SetDevice(0));
    SS_ASSERT_OK_AND_ASSIGN(stream_, Stream::Create(0));
    SS_ASSERT_OK_AND_ASSIGN(scratch_, DeltaGpuScratch::Allocate(kMaxBytes, 1, 0));
    SS_ASSERT_OK_AND_ASSIGN(base_, DeviceBuffer::Allocate(kMaxBytes, 0));
    SS_ASSERT_OK_AND_ASSIGN(next_, DeviceBuffer::Allocate(kMaxBytes, 0));
    SS_ASSERT_OK_AND_ASSIGN(out_, DeviceBuffer::Allocate(kMaxBytes, 0));
  }

  Bytes Download(const DeviceBuffer& b, size_t n) {
    Bytes h(n);
    EXPECT_TRUE(CopyToHost(h.data(), b.data(), n).ok());
    return h;
  }

  // Device encode of (base, next) == host EncodeDelta, byte for byte (with `advance`, the encode
  // also leaves next in the base); then device decode of the host encoding over the base restores
  // next.
  void Check(const Bytes& base, const Bytes& next, int e, DeltaGpuScratch* scratch = nullptr,
             bool advance = false) {
    if (scratch == nullptr) scratch = scratch_.get();
    Bytes want;
    auto host = EncodeDelta(base, next, e, 41, "b", &want);
    ASSERT_TRUE(host.ok()) << host.status().ToString();
    SS_ASSERT_OK(CopyToDevice(base_->data(), base.data(), base.size()));
    SS_ASSERT_OK(CopyToDevice(next_->data(), next.data(), next.size()));
    DeltaGpuEncodeArgs a;
    a.base = base_->data();
    a.next = next_->data();
    a.bytes = base.size();
    a.element_size = e;
    a.base_version = 41;
    a.out = out_->data();
    a.bucket = "b";
    a.advance = advance ? base_->data() : nullptr;
    SS_ASSERT_OK_AND_ASSIGN(const DeltaGpuEncoded got,
                            EncodeDeltaDevice(a, scratch, stream_->handle(), kTimeout));
    EXPECT_EQ(got.result.kind, host->kind);
    EXPECT_EQ(got.result.changed, host->changed);
    EXPECT_EQ(got.result.elements, host->elements);
    EXPECT_EQ(got.result.base_checksum, host->base_checksum);
    EXPECT_EQ(got.result.new_checksum, host->new_checksum);
    ASSERT_EQ(got.bytes, want.size());
    if (advance) {
      const Bytes after = Download(*base_, base.size());
      ASSERT_TRUE(after == next) << "base not advanced, first difference at byte "
                                 << (std::mismatch(after.begin(), after.end(), next.begin()).first -
                                     after.begin());
      SS_ASSERT_OK(CopyToDevice(base_->data(), base.data(), base.size()));
    }
    if (want.empty()) return;
    const Bytes enc = Download(*out_, got.bytes);
    ASSERT_TRUE(enc == want) << "first difference at byte "
                             << (std::mismatch(enc.begin(), enc.end(), want.begin()).first -
                                 enc.begin());
    // Decode the host's encoding over the base on the device.
    SS_ASSERT_OK(CopyToDevice(out_->data(), want.data(), want.size()));
    DeltaGpuDecodeArgs d;
    d.encoded = out_->data();
    d.encoded_bytes = want.size();
    d.bucket = base_->data();
    d.bucket_bytes = base.size();
    d.expect = {"b", e, 41};
    SS_ASSERT_OK(DecodeDeltaDevice(d, scratch, stream_->handle(), kTimeout));
    EXPECT_TRUE(Download(*base_, base.size()) == next);
  }

  std::unique_ptr<Stream> stream_;
  std::unique_ptr<DeltaGpuScratch> scratch_;
  std::unique_ptr<DeviceBuffer> base_, next_, out_;
};

TEST_F(GpuDelta, EncodeEqualsHostAndDecodeRestoresNext) {
  // Element counts: tiny, odd, one tile +- a little (a tile is 32 KiB of each side), and many
  // tiles (the look-back walks more than 32 predecessors).
  for (int e : {1, 2, 4}) {
    const uint64_t ue = static_cast<uint64_t>(e);
    for (uint64_t elements : {uint64_t{1}, uint64_t{13}, uint64_t{1001}, 32768 / ue + 3,
                              65536 / ue - 5, (uint64_t{5} << 20) / ue + 7}) {
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements + e));
      for (double density : {0.0, 1e-4, 0.01, 0.03, 0.032, 0.5, 1.0}) {
        const uint64_t changed = static_cast<uint64_t>(density * static_cast<double>(elements));
        SCOPED_TRACE(::testing::Message()
                     << "e=" << e << " elements=" << elements << " changed=" << changed);
        Check(base, Mutate(base, e, changed, static_cast<uint32_t>(changed * 3 + e)), e);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// With `advance` the encoder leaves next's bytes in the base and writes the same encoding: the
// tiles that staged their changes are advanced by the tile pass, the others (values over a
// quarter of the tile, or offsets over 1/16 of a range) after the write pass re-read them; every
// form, ragged ends, every element size.
TEST_F(GpuDelta, EncodeWithAdvanceLeavesNextInTheBase) {
  for (int e : {1, 2, 4}) {
    const uint64_t ue = static_cast<uint64_t>(e);
    for (uint64_t elements :
         {uint64_t{13}, 16384 / ue + 3, (uint64_t{5} << 20) / ue + 7, (uint64_t{40} << 20) / ue}) {
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements * 7 + e));
      for (double density : {0.0, 0.01, 0.1, 0.5, 1.0}) {
        const uint64_t changed = static_cast<uint64_t>(density * static_cast<double>(elements));
        SCOPED_TRACE(::testing::Message()
                     << "e=" << e << " elements=" << elements << " changed=" << changed);
        Check(base, Mutate(base, e, changed, static_cast<uint32_t>(changed + 5)), e, nullptr,
              /*advance=*/true);
        if (HasFatalFailure()) return;
      }
    }
  }
  // Only the base itself may be advanced.
  DeltaGpuEncodeArgs a;
  a.base = base_->data();
  a.next = next_->data();
  a.advance = next_->data();
  a.bytes = 64;
  a.out = out_->data();
  a.bucket = "b";
  const Status bad = EnqueueDeltaEncode(a, scratch_.get(), stream_->handle());
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  EXPECT_NE(bad.ToString().find("advance must be null or base itself"), std::string::npos)
      << bad.ToString();
}

TEST_F(GpuDelta, EveryFormIsExercised) {
  // 1 MiB of bf16: 1% of large changes (every one escaped) is the index form, 1% of small ones
  // packed, 10% the bitmap form, 100% full.
  const Bytes base = RandomBytes(1 << 20, 5);
  for (auto [density, kind] :
       {std::pair{0.01, DeltaKind::kIndex}, std::pair{0.011, DeltaKind::kPacked},
        std::pair{0.10, DeltaKind::kBitmap}, std::pair{1.0, DeltaKind::kFull}}) {
    const uint64_t changed = static_cast<uint64_t>(density * (1 << 19));
    const Bytes next =
        kind == DeltaKind::kPacked ? MutateSmall(base, 2, changed, 9) : Mutate(base, 2, changed, 9);
    Bytes enc;
    auto host = EncodeDelta(base, next, 2, 41, "b", &enc);
    ASSERT_TRUE(host.ok());
    EXPECT_EQ(host->kind, kind);
    Check(base, next, 2);
  }
}

// The decoder's count pass takes a range of tiles per block (4 per SM, 528 on an H200): 40 MiB
// (2560 tiles of 16 KiB, a ragged end) gives every range several tiles, so a tile's first value
// is its range's plus the tiles' before it; the index form's record and sum passes stride over
// many records and vectors per thread.
TEST_F(GpuDelta, RangesOfManyTiles) {
  for (int e : {1, 2, 4}) {
    const uint64_t elements = (uint64_t{40} << 20) / static_cast<uint64_t>(e) + 3;
    const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(e + 77));
    for (double density : {0.001, 0.01, 0.1, 0.3}) {
      const uint64_t changed = static_cast<uint64_t>(density * static_cast<double>(elements));
      SCOPED_TRACE(::testing::Message() << "e=" << e << " changed=" << changed);
      Check(base, Mutate(base, e, changed, static_cast<uint32_t>(changed + e)), e);
      if (HasFatalFailure()) return;
    }
  }
}

// A scratch sized for the bucket stages values up to a quarter of it: denser buckets re-read the
// tiles that found no room (bitmap form at 30% and 50%), and a decode tile whose values exceed
// its shared-memory room reads them one by one. Changes packed into a few tiles stage their
// indices whatever each tile's own density (index form). The scratch is allocated for 2-byte
// elements and serves every element size.
TEST_F(GpuDelta, DenseTilesAndClusteredChanges) {
  constexpr uint64_t kBytes = uint64_t{1} << 20;
  SS_ASSERT_OK_AND_ASSIGN(auto small, DeltaGpuScratch::Allocate(kBytes, 2, 0));
  const Bytes base = RandomBytes(kBytes, 123);
  for (int e : {1, 2, 4}) {
    const uint64_t elements = kBytes / e;
    for (double density : {0.3, 0.5}) {
      SCOPED_TRACE(::testing::Message() << "e=" << e << " density=" << density);
      const Bytes next =
          Mutate(base, e, static_cast<uint64_t>(density * static_cast<double>(elements)), 17);
      Bytes enc;
      auto host = EncodeDelta(base, next, e, 41, "b", &enc);
      ASSERT_TRUE(host.ok());
      EXPECT_EQ(host->kind, DeltaKind::kBitmap);
      Check(base, next, e, small.get());
      if (HasFatalFailure()) return;
    }
    // 2% of the elements, all in the first eighth of the bucket (16% there): the index form (the
    // packed form for a byte image).
    Bytes next = base;
    const Bytes head(base.begin(), base.begin() + kBytes / 8);
    const Bytes head_next = Mutate(head, e, elements / 50, 5);
    std::copy(head_next.begin(), head_next.end(), next.begin());
    Bytes enc;
    auto host = EncodeDelta(base, next, e, 41, "b", &enc);
    ASSERT_TRUE(host.ok());
    EXPECT_EQ(host->kind, e == 1 ? DeltaKind::kPacked : DeltaKind::kIndex);
    SCOPED_TRACE(::testing::Message() << "e=" << e << " clustered");
    Check(base, next, e, small.get());
    if (HasFatalFailure()) return;
  }
}

// Refusals: the device says what the host says (code and message) and leaves the bucket as it
// was. Each case edits a host encoding (or the receiver's bucket, or what it expects).
struct Case {
  const char* name;
  std::function<void(Bytes* enc, Bytes* bucket, DeltaExpect* expect, size_t* len)> edit;
};

void Put64(Bytes* b, size_t at, uint64_t v) { std::memcpy(b->data() + at, &v, 8); }
template <typename T>
void PutLE(Bytes* b, size_t at, T v) {
  std::memcpy(b->data() + at, &v, sizeof(T));
}
template <typename T>
T GetLE(const Bytes& b, size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof(T));
  return v;
}
uint64_t Get64(const Bytes& b, size_t at) {
  uint64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

TEST_F(GpuDelta, RefusalsMatchTheHostAndLeaveTheBucketUntouched) {
  constexpr size_t kElems = 40003;  // odd: the bitmap's last byte has bits past the end
  const Bytes base = RandomBytes(kElems * 2, 77);
  for (uint64_t changes : {401, 8000}) {  // index form (2 padding bytes), bitmap form
    const Bytes next = Mutate(base, 2, changes, 3);
    Bytes enc0;
    ASSERT_TRUE(EncodeDelta(base, next, 2, 41, "b", &enc0).ok());
    const bool index = static_cast<DeltaKind>(enc0[5]) == DeltaKind::kIndex;
    const size_t payload = kDeltaHeaderBytes;
    std::vector<Case> cases = {
        {"base version", [](Bytes*, Bytes*, DeltaExpect* x, size_t*) { x->base_version = 40; }},
        {"corrupt base byte",
         [](Bytes*, Bytes* b, DeltaExpect*, size_t*) { (*b)[12345] ^= std::byte{4}; }},
        {"truncated", [](Bytes*, Bytes*, DeltaExpect*, size_t* n) { *n -= 1; }},
        {"short", [](Bytes*, Bytes*, DeltaExpect*, size_t* n) { *n = 20; }},
        {"magic", [](Bytes* e, Bytes*, DeltaExpect*, size_t*) { (*e)[0] = std::byte{'X'}; }},
        {"format 2", [](Bytes* e, Bytes*, DeltaExpect*, size_t*) { (*e)[4] = std::byte{2}; }},
        {"kind", [](Bytes* e, Bytes*, DeltaExpect*, size_t*) { (*e)[5] = std::byte{4}; }},
        {"reserved", [](Bytes* e, Bytes*, DeltaExpect*, size_t*) { (*e)[7] = std::byte{1}; }},
        {"count over elements",
         [](Bytes* e, Bytes*, DeltaExpect*, size_t*) { Put64(e, 40, kElems + 1); }},
        {"count vs length",
         [](Bytes* e, Bytes*, DeltaExpect*, size_t*) { Put64(e, 40, Get64(*e, 40) - 1); }},
        {"element size", [](Bytes*, Bytes*, DeltaExpect* x, size_t*) { x->element_size = 4; }},
        {"result checksum",
         [](Bytes* e, Bytes*, DeltaExpect*, size_t* n) { (*e)[*n - 1] ^= std::byte{1}; }},
    };
    if (index) {
      // Format 2's faults (delta.h): a running count, the last count, an offset, the padding.
      const uint64_t count = Get64(enc0, 40);
      const DeltaIndexLayout l = DeltaIndexPayload(kElems, 2, count);
      ASSERT_EQ(l.tiles, 5u);
      ASSERT_GT(l.values, l.offsets + 2 * count);  // an odd count: 2 bytes of padding
      uint32_t end[5];
      for (int t = 0; t < 5; ++t) end[t] = GetLE<uint32_t>(enc0, payload + 4 * t);
      ASSERT_GE(end[0], 2u);
      ASSERT_GE(end[4] - end[3], 2u);
      const size_t offs = payload + l.offsets;
      const uint32_t e1 = end[1], e3 = end[3], e4 = end[4], k0 = end[0] - 1;
      cases.push_back({"running count falls", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         PutLE<uint32_t>(e, payload + 4 * 2, e1 - 1);
                       }});
      cases.push_back({"last running count", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         PutLE<uint32_t>(e, payload + 4 * 4, e4 + 1);
                       }});
      cases.push_back({"offset out of its tile", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         PutLE<uint16_t>(e, offs + 2 * (e3 + 1), 7235);  // tile 4's elements
                       }});
      cases.push_back({"offset not increasing", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         PutLE<uint16_t>(e, offs + 2 * k0,
                                         GetLE<uint16_t>(*e, offs + 2 * (k0 - 1)));
                       }});
      const size_t pad = payload + l.values - 1;
      cases.push_back(
          {"padding", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) { (*e)[pad] = std::byte{1}; }});
    } else {
      const size_t bitmap = (kElems + 7) / 8;
      cases.push_back({"bitmap tail", [payload, bitmap](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         (*e)[payload + bitmap - 1] |= std::byte{0x80};
                       }});
      cases.push_back({"bitmap popcount", [payload](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         for (size_t j = payload; j < e->size(); ++j) {
                           if ((*e)[j] != std::byte{0xff}) {
                             for (int b = 0; b < 8; ++b) {
                               if (((static_cast<unsigned>((*e)[j]) >> b) & 1) == 0) {
                                 (*e)[j] |= std::byte(1u << b);
                                 return;
                               }
                             }
                           }
                         }
                       }});
    }
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << c.name << (index ? " (index)" : " (bitmap)"));
      Bytes enc = enc0, bucket = base;
      DeltaExpect expect{"b", 2, 41};
      size_t len = enc.size();
      c.edit(&enc, &bucket, &expect, &len);
      // Host answer on its own copies.
      Bytes host_bucket = bucket;
      const Status want = DecodeDeltaInPlace(std::span(enc.data(), len), host_bucket, expect);
      ASSERT_FALSE(want.ok());
      ASSERT_TRUE(host_bucket == bucket);
      SS_ASSERT_OK(CopyToDevice(base_->data(), bucket.data(), bucket.size()));
      SS_ASSERT_OK(CopyToDevice(out_->data(), enc.data(), enc.size()));
      DeltaGpuDecodeArgs d;
      d.encoded = out_->data();
      d.encoded_bytes = len;
      d.bucket = base_->data();
      d.bucket_bytes = bucket.size();
      d.expect = expect;
      const Status got = DecodeDeltaDevice(d, scratch_.get(), stream_->handle(), kTimeout);
      EXPECT_EQ(got.ToString(), want.ToString());
      EXPECT_TRUE(Download(*base_, bucket.size()) == bucket) << "bucket changed";
    }
    // The same scratch still decodes a good delta after every refusal.
    Check(base, next, 2);
  }
}

// Small changes (an optimizer's steps) in the packed form, both element sizes, with and without
// `advance`: tiny buckets, a ragged last subtile and tile, many tiles; densities up to the form's
// limit (1/16), over which the bitmap form takes over.
TEST_F(GpuDelta, PackedFormEncodesAsTheHostAndDecodes) {
  int packed = 0;
  for (int e : {1, 2}) {
    const uint64_t ue = static_cast<uint64_t>(e);
    for (uint64_t elements : {uint64_t{100}, uint64_t{1001}, 16384 / ue + 67,
                              (uint64_t{5} << 20) / ue + 7, (uint64_t{40} << 20) / ue + 3}) {
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements * 5 + e));
      for (double density : {0.005, 0.02, 0.05, 0.0625}) {
        const uint64_t changed =
            std::max<uint64_t>(1, static_cast<uint64_t>(density * static_cast<double>(elements)));
        const Bytes next = MutateSmall(base, e, changed, static_cast<uint32_t>(changed + 11 * e));
        Bytes enc;
        auto host = EncodeDelta(base, next, e, 41, "b", &enc);
        ASSERT_TRUE(host.ok());
        packed += host->kind == DeltaKind::kPacked;
        for (bool advance : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << "e=" << e << " elements=" << elements << " changed=" << changed
                       << " advance=" << advance << " kind=" << DeltaKindName(host->kind));
          Check(base, next, e, nullptr, advance);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
  EXPECT_GE(packed, 12);  // the form is exercised, not only its neighbours
}

// The packed form's faults (delta.h "Encoded form"): the device's refusal is the host's, word for
// word, and the bucket is left as it was.
TEST_F(GpuDelta, PackedRefusalsMatchTheHost) {
  constexpr size_t kElems = 40003;  // 5 tiles of bf16, 313 subtiles, the last of 67 elements
  for (int e : {2, 1}) {
    const size_t ue = static_cast<size_t>(e);
    const Bytes base = RandomBytes(kElems * ue, 78);
    const Bytes next = MutateSmall(base, e, 1201, 4);
    Bytes enc0;
    ASSERT_TRUE(EncodeDelta(base, next, e, 41, "b", &enc0).ok());
    ASSERT_EQ(static_cast<DeltaKind>(enc0[5]), DeltaKind::kPacked);
    const uint64_t count = Get64(enc0, 40);
    const size_t p = kDeltaHeaderBytes;
    const uint64_t x0 =
        e == 2 ? (enc0.size() - p - DeltaPackedPayload(kElems, ue, count, 0).bytes) / 2 : 0;
    const DeltaPackedLayout l = DeltaPackedPayload(kElems, ue, count, x0);
    ASSERT_EQ(l.bytes, enc0.size() - p);
    std::vector<uint32_t> end(l.tiles), eend(l.tiles);
    for (size_t t = 0; t < l.tiles; ++t) {
      end[t] = GetLE<uint32_t>(enc0, p + 4 * t);
      if (e == 2) eend[t] = GetLE<uint32_t>(enc0, p + l.escape_ends + 4 * t);
    }
    // A subtile of tile 1 with two records or more, and its first record.
    const uint64_t spt = l.tile_elems / 128;
    uint64_t sub2 = 0, k2 = end[0];
    for (uint64_t sb = spt; sb < 2 * spt; ++sb) {
      const auto c = static_cast<uint8_t>(enc0[p + l.subs + sb]);
      if (c >= 2) {
        sub2 = sb;
        break;
      }
      k2 += c;
    }
    ASSERT_GT(sub2, 0u);
    std::vector<Case> cases = {
        {"over the limit",
         [](Bytes* e, Bytes*, DeltaExpect*, size_t*) { Put64(e, 40, kElems / 8); }},
        {"truncated", [](Bytes*, Bytes*, DeltaExpect*, size_t* n) { *n -= 1; }},
        {"running count falls", [=](Bytes* e, Bytes*, DeltaExpect*,
                                    size_t*) { PutLE<uint32_t>(e, p + 4 * 2, end[1] - 1); }},
        {"last running count",
         [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
           PutLE<uint32_t>(e, p + 4 * (l.tiles - 1), end[l.tiles - 1] + 1);
         }},
        {"subtile over its elements",
         [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
           (*e)[p + l.subs + spt + 3] = std::byte{129};
         }},
        {"subtile counts sum",
         [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
           (*e)[p + l.subs + sub2] =
               static_cast<std::byte>(static_cast<uint8_t>((*e)[p + l.subs + sub2]) + 1u);
         }},
        {"record out of its subtile",
         [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
           (*e)[p + l.offsets + k2 + 1] = std::byte{200};
         }},
        {"record not increasing",
         [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
           (*e)[p + l.offsets + k2 + 1] = (*e)[p + l.offsets + k2];
         }},
        {"corrupt value", [=](Bytes* e, Bytes*, DeltaExpect*,
                              size_t*) { (*e)[p + l.values + 7] ^= std::byte{0x21}; }},
    };
    if (e == 2) {
      ASSERT_GE(eend[1], 1u);
      ASSERT_GT(l.escapes, l.values + count);  // a padding byte
      cases.push_back({"escape count falls", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         PutLE<uint32_t>(e, p + l.escape_ends + 4 * 2, eend[1] - 1);
                       }});
      cases.push_back({"last escape count", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         PutLE<uint32_t>(e, p + l.escape_ends + 4 * (l.tiles - 1),
                                         eend[l.tiles - 1] - 1);
                       }});
      cases.push_back({"escaped values of a tile", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         for (uint64_t k = end[1]; k < end[2]; ++k)
                           if ((*e)[p + l.values + k] != std::byte{0x80}) {
                             (*e)[p + l.values + k] = std::byte{0x80};
                             return;
                           }
                       }});
      cases.push_back({"padding", [=](Bytes* e, Bytes*, DeltaExpect*, size_t*) {
                         (*e)[p + l.values + count] = std::byte{1};
                       }});
    }
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << c.name << " e=" << e);
      Bytes enc = enc0, bucket = base;
      DeltaExpect expect{"b", e, 41};
      size_t len = enc.size();
      c.edit(&enc, &bucket, &expect, &len);
      Bytes host_bucket = bucket;
      const Status want = DecodeDeltaInPlace(std::span(enc.data(), len), host_bucket, expect);
      ASSERT_FALSE(want.ok());
      ASSERT_TRUE(host_bucket == bucket);
      SS_ASSERT_OK(CopyToDevice(base_->data(), bucket.data(), bucket.size()));
      SS_ASSERT_OK(CopyToDevice(out_->data(), enc.data(), enc.size()));
      DeltaGpuDecodeArgs d;
      d.encoded = out_->data();
      d.encoded_bytes = len;
      d.bucket = base_->data();
      d.bucket_bytes = bucket.size();
      d.expect = expect;
      const Status got = DecodeDeltaDevice(d, scratch_.get(), stream_->handle(), kTimeout);
      EXPECT_EQ(got.ToString(), want.ToString());
      EXPECT_TRUE(Download(*base_, bucket.size()) == bucket) << "bucket changed";
    }
    Check(base, next, e);
  }
}

// The decoder writes the changes before it knows the verdict (base checksum, result checksum) and
// puts the old bytes back when it refuses: a refused decode leaves the bucket byte for byte as it
// was, and the encoding untouched, for both forms, every element size, a ragged end (the last
// element changed) and a scratch too small for the old values (50% on a scratch sized for the
// bucket: nothing written before the verdict). The refusals after the writes (base checksum,
// corrupt value) are the ones a decoder without the restore would fail here.
TEST_F(GpuDelta, RefusedDecodesLeaveTheBucketAsItWas) {
  constexpr uint64_t kBytes = (uint64_t{3} << 20) + 40;  // 192 tiles and a ragged one
  SS_ASSERT_OK_AND_ASSIGN(auto small, DeltaGpuScratch::Allocate(kBytes, 1, 0));
  for (int e : {1, 2, 4}) {
    const uint64_t elements = kBytes / e - 1;  // not a whole number of 8-byte words either
    const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(e * 11));
    for (double density : {0.01, 0.1, 0.5}) {
      Bytes next = Mutate(base, e, static_cast<uint64_t>(density * elements), 23);
      next[elements * e - 1] = ~base[elements * e - 1];  // the last element changes
      Bytes enc0;
      auto host = EncodeDelta(base, next, e, 41, "b", &enc0);
      ASSERT_TRUE(host.ok());
      const bool index = host->kind == DeltaKind::kIndex;
      const bool packed = host->kind == DeltaKind::kPacked;
      ASSERT_EQ(host->kind, density > 0.05 ? DeltaKind::kBitmap
                            : e == 1       ? DeltaKind::kPacked
                                           : DeltaKind::kIndex);
      const DeltaIndexLayout il = DeltaIndexPayload(elements, e, host->changed);
      const DeltaPackedLayout pl = DeltaPackedPayload(elements, e, host->changed, host->escapes);
      // Where the values start (index form: after the running counts and offsets).
      const size_t rec = kDeltaHeaderBytes + (index    ? il.values
                                              : packed ? pl.values
                                                       : (elements + 7) / 8);
      std::vector<Case> cases = {
          {"base version", [](Bytes*, Bytes*, DeltaExpect* x, size_t*) { x->base_version = 7; }},
          {"base checksum in the header",
           [](Bytes* c, Bytes*, DeltaExpect*, size_t*) { Put64(c, 24, Get64(*c, 24) + 1); }},
          {"corrupt base byte", [e](Bytes*, Bytes* b, DeltaExpect*,
                                    size_t*) { (*b)[b->size() / 2 + e] ^= std::byte{8}; }},
          {"corrupt value, first",
           [index, e, rec](Bytes* c, Bytes*, DeltaExpect*, size_t*) {
             (*c)[rec + e - 1] ^= std::byte{0x40};
           }},
          {"corrupt value, last",
           [](Bytes* c, Bytes*, DeltaExpect*, size_t* n) { (*c)[*n - 1] ^= std::byte{1}; }},
      };
      if (index) {
        cases.push_back({"offset not increasing", [il](Bytes* c, Bytes*, DeltaExpect*, size_t*) {
                           // Records 4 and 5 lie in tile 0 (1% of a tile of 4096 or more elements).
                           const size_t offs = kDeltaHeaderBytes + il.offsets;
                           std::memcpy(c->data() + offs + 2 * 5, c->data() + offs + 2 * 4, 2);
                         }});
      } else if (packed) {
        cases.push_back(
            {"offset out of its subtile", [pl](Bytes* c, Bytes*, DeltaExpect*, size_t*) {
               (*c)[kDeltaHeaderBytes + pl.offsets] = std::byte{200};
             }});
      } else {
        cases.push_back({"bitmap bit", [rec](Bytes* c, Bytes*, DeltaExpect*, size_t*) {
                           (*c)[rec - 1] ^= std::byte{1};
                         }});
      }
      for (DeltaGpuScratch* scratch : {scratch_.get(), small.get()}) {
        for (const Case& c : cases) {
          SCOPED_TRACE(::testing::Message()
                       << "e=" << e << " density=" << density << " " << c.name
                       << (scratch == small.get() ? " (scratch of the bucket's size)" : ""));
          Bytes enc = enc0, bucket = base;
          DeltaExpect expect{"b", e, 41};
          size_t len = enc.size();
          c.edit(&enc, &bucket, &expect, &len);
          Bytes host_bucket = bucket;
          const Status want = DecodeDeltaInPlace(std::span(enc.data(), len), host_bucket, expect);
          ASSERT_FALSE(want.ok());
          SS_ASSERT_OK(CopyToDevice(base_->data(), bucket.data(), bucket.size()));
          SS_ASSERT_OK(CopyToDevice(out_->data(), enc.data(), enc.size()));
          DeltaGpuDecodeArgs d;
          d.encoded = out_->data();
          d.encoded_bytes = len;
          d.bucket = base_->data();
          d.bucket_bytes = bucket.size();
          d.expect = expect;
          const Status got = DecodeDeltaDevice(d, scratch, stream_->handle(), kTimeout);
          EXPECT_EQ(got.ToString(), want.ToString());
          const Bytes after = Download(*base_, bucket.size());
          EXPECT_TRUE(after == bucket)
              << "bucket changed, first at byte "
              << (std::mismatch(after.begin(), after.end(), bucket.begin()).first - after.begin());
          EXPECT_TRUE(Download(*out_, enc.size()) == enc) << "encoding changed";
        }
        // Every refusal left the scratch ready: the delta decodes.
        Check(base, next, e, scratch);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(GpuDelta, ArgumentsAndCallsInFlight) {
  DeltaGpuEncodeArgs a;
  a.base = base_->data();
  a.next = next_->data();
  a.out = out_->data();
  a.bytes = 1000;
  a.element_size = 3;
  a.bucket = "b";
  EXPECT_EQ(EnqueueDeltaEncode(a, scratch_.get(), stream_->handle()).code(),
            StatusCode::kInvalidArgument);
  a.element_size = 2;
  a.bytes = kMaxBytes + 16;
  EXPECT_EQ(EnqueueDeltaEncode(a, scratch_.get(), stream_->handle()).code(),
            StatusCode::kInvalidArgument);
  a.bytes = 1000;
  a.base = static_cast<const std::byte*>(base_->data()) + 2;
  EXPECT_EQ(EnqueueDeltaEncode(a, scratch_.get(), stream_->handle()).code(),
            StatusCode::kInvalidArgument);
  a.base = base_->data();
  SS_ASSERT_OK(EnqueueDeltaEncode(a, scratch_.get(), stream_->handle()));
  EXPECT_EQ(EnqueueDeltaEncode(a, scratch_.get(), stream_->handle()).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(FinishDeltaDecode(scratch_.get(), kTimeout).code(), StatusCode::kFailedPrecondition);
  SS_ASSERT_OK_AND_ASSIGN(const DeltaGpuEncoded r, FinishDeltaEncode(scratch_.get(), kTimeout));
  EXPECT_EQ(r.result.elements, 500u);
}

// The shape of the block-FP8 image on which the device encoder was nondeterministic on one H200
// (docs/delta.md "Device pairs", block FP8): 535,681,536 bytes of element size 1, about 1% of
// the bytes changed in the first half, about all of them in the second. Without the proxy fence
// between the threads' reads of a stage and its refill (delta_device.cuh FenceProxyAsync) each
// of the four encodes here gave another change count and base sum, none the host's; then the
// device decodes its own encoding (the bitmap form, whose tile pass has the same refill) back to
// the new bytes. ~2 GiB of HBM, ~11 s on an H200 (most of it the host's reference encode).
TEST(GpuDeltaLarge, ClusteredImageOfHalfAGibEncodesAsTheHostDoes) {
  SS_REQUIRE_GPU();
  SS_ASSERT_OK(SetDevice(0));
  constexpr uint64_t kBytes = 535681536;
  constexpr uint64_t kChunk = uint64_t{64} << 20;
  Bytes base = RandomBytes(kBytes, 5);
  Bytes next = base;
  std::mt19937 rng(6);
  for (uint64_t i = 0; i < kBytes; ++i) {
    const uint32_t x = rng();
    // First four chunks: 1% of the bytes; the fifth: its first 37%; then all but ~0.3%.
    const bool change = i < 4 * kChunk   ? x % 100 == 0
                        : i < 5 * kChunk ? i - 4 * kChunk < kChunk * 37 / 100
                                         : x % 300 != 0;
    if (change) next[i] ^= static_cast<std::byte>(1 + x % 255);
  }
  Bytes want;
  auto host = EncodeDelta(base, next, 1, 1, "b", &want);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  SS_ASSERT_OK_AND_ASSIGN(auto stream, Stream::Create(0));
  SS_ASSERT_OK_AND_ASSIGN(auto scratch, DeltaGpuScratch::Allocate(kBytes, 1, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto b, DeviceBuffer::Allocate(kBytes, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto n, DeviceBuffer::Allocate(kBytes, 0));
  SS_ASSERT_OK_AND_ASSIGN(auto out, DeviceBuffer::Allocate(kBytes, 0));
  SS_ASSERT_OK(CopyToDevice(b->data(), base.data(), kBytes));
  SS_ASSERT_OK(CopyToDevice(n->data(), next.data(), kBytes));
  DeltaGpuEncodeArgs a;
  a.base = b->data();
  a.next = n->data();
  a.bytes = kBytes;
  a.element_size = 1;
  a.base_version = 1;
  a.out = out->data();
  a.bucket = "b";
  for (int k = 0; k < 4; ++k) {
    SCOPED_TRACE(::testing::Message() << "encode " << k);
    SS_ASSERT_OK_AND_ASSIGN(const DeltaGpuEncoded got,
                            EncodeDeltaDevice(a, scratch.get(), stream->handle(), kTimeout));
    EXPECT_EQ(got.result.kind, host->kind);
    EXPECT_EQ(got.result.changed, host->changed);
    EXPECT_EQ(got.result.base_checksum, host->base_checksum);
    EXPECT_EQ(got.result.new_checksum, host->new_checksum);
    EXPECT_EQ(got.bytes, want.size());
  }
  Bytes enc(want.size());
  SS_ASSERT_OK(CopyToHost(enc.data(), out->data(), enc.size()));
  ASSERT_TRUE(enc == want) << "first difference at byte "
                           << (std::mismatch(enc.begin(), enc.end(), want.begin()).first -
                               enc.begin());
  DeltaGpuDecodeArgs d;
  d.encoded = out->data();
  d.encoded_bytes = want.size();
  d.bucket = b->data();
  d.bucket_bytes = kBytes;
  d.expect = {"b", 1, 1};
  SS_ASSERT_OK(DecodeDeltaDevice(d, scratch.get(), stream->handle(), kTimeout));
  Bytes landed(kBytes);
  SS_ASSERT_OK(CopyToHost(landed.data(), b->data(), kBytes));
  EXPECT_TRUE(landed == next);
}

}  // namespace
}  // namespace shardsync::gpu
