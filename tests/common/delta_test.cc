#include "shardsync/delta.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common/delta_mutate.h"
#include "shardsync/checksum.h"
#include "shardsync/delta_rule.h"

namespace shardsync {
namespace {

using Bytes = std::vector<std::byte>;

Bytes RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// `base` with `changed` distinct elements replaced by a different value (each changed element
// differs from the base in its top byte, so it really changed).
Bytes Mutate(const Bytes& base, int e, uint64_t changed, uint32_t seed) {
  Bytes next = base;
  const uint64_t elements = base.size() / e;
  std::vector<uint64_t> order(elements);
  for (uint64_t i = 0; i < elements; ++i) order[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  for (uint64_t k = 0; k < changed; ++k) {
    std::byte* p = next.data() + order[k] * e;
    p[e - 1] ^= static_cast<std::byte>(1 + rng() % 255);
    if (e > 1) p[0] = static_cast<std::byte>(rng());
  }
  return next;
}

using testing_delta::MutateSmall;

DeltaExpect Expect(int e, uint64_t version = 7) { return {"b0", e, version}; }

// Encodes, decodes over a copy of the base, checks the result byte for byte and the kind the
// size rule names.
DeltaEncodeResult RoundTrip(const Bytes& base, const Bytes& next, int e) {
  Bytes enc;
  auto r = EncodeDelta(base, next, e, 7, "b0", &enc);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return {};
  const DeltaSize want = DeltaEncodedBytes(base.size() / e, e, r->changed, r->escapes);
  EXPECT_EQ(r->kind, want.kind);
  if (r->kind == DeltaKind::kFull) {
    EXPECT_TRUE(enc.empty());
    return *r;
  }
  EXPECT_EQ(enc.size(), want.bytes);
  EXPECT_EQ(r->base_checksum, Checksum(base.data(), base.size()));
  EXPECT_EQ(r->new_checksum, Checksum(next.data(), next.size()));
  Bytes bucket = base;
  Status s = DecodeDeltaInPlace(enc, bucket, Expect(e));
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(bucket == next) << "e=" << e << " n=" << base.size();
  return *r;
}

TEST(Delta, RoundTripsAtEveryDensityElementSizeAndOddLength) {
  for (int e : {1, 2, 4}) {
    for (uint64_t elements : {1ull, 7ull, 13ull, 1001ull, 40009ull}) {
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements * 10 + e));
      for (double density : {0.0, -1.0, 0.01, 0.5, 1.0}) {  // -1: exactly one element
        const uint64_t changed =
            density < 0 ? 1 : static_cast<uint64_t>(density * static_cast<double>(elements));
        const Bytes next = Mutate(base, e, changed, static_cast<uint32_t>(changed + e));
        SCOPED_TRACE(::testing::Message()
                     << "e=" << e << " elements=" << elements << " changed=" << changed);
        const DeltaEncodeResult r = RoundTrip(base, next, e);
        EXPECT_EQ(r.changed, changed);
        EXPECT_EQ(r.elements, elements);
      }
    }
  }
}

TEST(Delta, KindFollowsTheSizeRule) {
  // 64000 bf16 elements: 8 tiles of 8192 (32 bytes of running counts), bitmap 8000 bytes, so
  // index while round_up(32 + 2 * count, 4) <= 8000 (count <= 3984). With every change escaped
  // (4 bytes a change in the packed form too) the index form wins there.
  const uint64_t elements = 64000;
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 0).kind, DeltaKind::kIndex);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 0).bytes, kDeltaHeaderBytes + 32);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 2000, 2000).kind, DeltaKind::kIndex);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 2000, 2000).bytes, kDeltaHeaderBytes + 32 + 2000 * 4);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 2001, 2001).bytes,
            kDeltaHeaderBytes + 32 + 4004 + 2001 * 2);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 3984, 3984).kind, DeltaKind::kIndex);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 3984, 3984).bytes, kDeltaHeaderBytes + 8000 + 3984 * 2);
  // Packed (no escapes): 8 + 8 tiles x 4 bytes of running counts, 500 subtile counts, 2 bytes a
  // change, an even length before the escapes; it wins from a count of 500 / 2 / 2 on.
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 2000).kind, DeltaKind::kPacked);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 2000).bytes, kDeltaHeaderBytes + 64 + 500 + 4000);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 2001).bytes, kDeltaHeaderBytes + 64 + 500 + 4002);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 2001, 3).bytes,
            kDeltaHeaderBytes + 64 + 500 + 4002 + 3 * 2);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 3984).kind, DeltaKind::kPacked);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 200).kind, DeltaKind::kIndex);   // 832 against 964
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 300).kind, DeltaKind::kPacked);  // 1232 against 1164
  // Escapes count only for 2-byte elements; a byte image's value byte is the new byte.
  EXPECT_EQ(DeltaEncodedBytes(elements, 1, 2000, 2000).kind, DeltaKind::kPacked);
  EXPECT_EQ(DeltaEncodedBytes(elements, 4, 2000).kind, DeltaKind::kIndex);
  // Past the index form's limit (1/16) the packed form is not offered.
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 3985).kind, DeltaKind::kBitmap);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 3985).bytes, kDeltaHeaderBytes + 8000 + 3985 * 2);
  // Full once 48 + 8000 + 2c >= 128000: c >= 59976.
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 59975).kind, DeltaKind::kBitmap);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 59976).kind, DeltaKind::kFull);
  EXPECT_EQ(DeltaEncodedBytes(elements, 2, 59976).bytes, elements * 2);
  // A bucket smaller than the header is always sent full.
  EXPECT_EQ(DeltaEncodedBytes(4, 4, 0).kind, DeltaKind::kFull);
  // Element sizes the codec refuses elsewhere give an answer, not a division by zero.
  EXPECT_EQ(DeltaEncodedBytes(1000, 0, 0).kind, DeltaKind::kFull);
  EXPECT_EQ(DeltaIndexPayload(1000, 0, 0).tiles, 0u);
  EXPECT_EQ(DeltaIndexPayload(1000, 32768, 0).tiles, 0u);
  EXPECT_EQ(DeltaEncodedBytes(1000, -2, 5).kind, DeltaKind::kFull);
  EXPECT_EQ(DeltaEncodedBytes(1000, 3, 5).bytes, 0u);

  // The encoder follows it on real data: one case per kind, for every element size.
  for (int e : {1, 2, 4}) {
    const Bytes base = RandomBytes(64000 * e, 3);
    EXPECT_EQ(RoundTrip(base, Mutate(base, e, 100, 1), e).kind, DeltaKind::kIndex) << e;
    EXPECT_EQ(RoundTrip(base, Mutate(base, e, 20000, 2), e).kind, DeltaKind::kBitmap) << e;
    EXPECT_EQ(RoundTrip(base, Mutate(base, e, 63000, 3), e).kind, DeltaKind::kFull) << e;
  }
}

TEST(Delta, EncodingIsDeterministic) {
  const Bytes base = RandomBytes(30000, 11);
  for (uint64_t changed : {10ull, 5000ull}) {
    const Bytes next = Mutate(base, 2, changed, 5);
    Bytes a, b;
    ASSERT_TRUE(EncodeDelta(base, next, 2, 3, "b", &a).ok());
    ASSERT_TRUE(EncodeDelta(base, next, 2, 3, "b", &b).ok());
    EXPECT_EQ(a, b);
    EXPECT_FALSE(a.empty());
  }
}

TEST(Delta, RefusesAnotherBaseAndLeavesTheBucketAlone) {
  const Bytes base = RandomBytes(4000, 21);
  const Bytes next = Mutate(base, 2, 30, 4);
  Bytes enc;
  ASSERT_TRUE(EncodeDelta(base, next, 2, 7, "layers.3.mlp", &enc).ok());

  Bytes corrupted = base;  // one flipped bit in a byte the delta does not touch
  size_t k = 0;
  while (next[k] != base[k] || next[k ^ 1] != base[k ^ 1]) ++k;
  corrupted[k] ^= std::byte{0x10};
  Bytes bucket = corrupted;
  Status s = DecodeDeltaInPlace(enc, bucket, {"layers.3.mlp", 2, 7});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("layers.3.mlp"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("base_checksum"), std::string::npos) << s.message();
  EXPECT_EQ(bucket, corrupted);

  bucket = base;  // right bytes, another version (a rolled-back engine that says so)
  s = DecodeDeltaInPlace(enc, bucket, {"layers.3.mlp", 2, 6});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("version 7"), std::string::npos) << s.message();
  EXPECT_EQ(bucket, base);

  bucket = next;  // applied twice: the bucket already holds the new bytes
  EXPECT_EQ(DecodeDeltaInPlace(enc, bucket, {"layers.3.mlp", 2, 7}).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(bucket, next);

  Bytes shorter(base.begin(), base.end() - 2);
  EXPECT_EQ(DecodeDeltaInPlace(enc, shorter, {"layers.3.mlp", 2, 7}).code(),
            StatusCode::kInvalidArgument);
  bucket = base;
  EXPECT_EQ(DecodeDeltaInPlace(enc, bucket, {"layers.3.mlp", 4, 7}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(bucket, base);
}

TEST(Delta, EncoderRefusesBadInputsNamingTheBucket) {
  Bytes out;
  const Bytes a = RandomBytes(10, 1), b = RandomBytes(12, 2), c = RandomBytes(12, 3);
  auto r = EncodeDelta(a, b, 2, 0, "embed", &out);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("embed"), std::string::npos);
  EXPECT_EQ(EncodeDelta(b, c, 3, 0, "embed", &out).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeDelta(a, RandomBytes(10, 4), 4, 0, "embed", &out).status().code(),
            StatusCode::kInvalidArgument);
}

// Writes a header + payload by hand (for inputs the encoder never makes).
Bytes Handmade(uint8_t kind, uint8_t e, uint64_t elements, uint64_t changed, const Bytes& payload,
               uint64_t base_sum, uint64_t new_sum) {
  Bytes h(kDeltaHeaderBytes + payload.size());
  std::copy(payload.begin(), payload.end(), h.begin() + kDeltaHeaderBytes);
  const uint32_t magic = 0x4C445353;
  std::memcpy(h.data(), &magic, 4);
  h[4] = std::byte{3};  // format
  h[5] = std::byte{kind};
  h[6] = std::byte{e};
  std::memcpy(h.data() + 8, &elements, 8);
  const uint64_t version = 7;
  std::memcpy(h.data() + 16, &version, 8);
  std::memcpy(h.data() + 24, &base_sum, 8);
  std::memcpy(h.data() + 32, &new_sum, 8);
  std::memcpy(h.data() + 40, &changed, 8);
  return h;
}

// A format-2 index payload (delta.h "Encoded form") from its running counts and offsets: value k
// is k + 1 in its low byte, the padding zero.
Bytes IndexPayload(uint64_t elements, int e, const std::vector<uint32_t>& ends,
                   const std::vector<uint16_t>& offsets) {
  const DeltaIndexLayout l = DeltaIndexPayload(elements, e, offsets.size());
  Bytes p(l.bytes);
  for (size_t t = 0; t < ends.size() && 4 * t < l.offsets; ++t)
    std::memcpy(p.data() + 4 * t, &ends[t], 4);
  for (size_t k = 0; k < offsets.size(); ++k) {
    std::memcpy(p.data() + l.offsets + 2 * k, &offsets[k], 2);
    p[l.values + k * e] = static_cast<std::byte>(k + 1);
  }
  return p;
}

// The changed elements an index-form encoding names, read straight from its bytes.
std::vector<uint64_t> IndexChanges(const Bytes& enc, int e) {
  uint64_t elements = 0, count = 0;
  std::memcpy(&elements, enc.data() + 8, 8);
  std::memcpy(&count, enc.data() + 40, 8);
  const DeltaIndexLayout l = DeltaIndexPayload(elements, e, count);
  const std::byte* p = enc.data() + kDeltaHeaderBytes;
  std::vector<uint64_t> out;
  uint32_t from = 0;
  for (uint64_t t = 0; t < l.tiles; ++t) {
    uint32_t end = 0;
    std::memcpy(&end, p + 4 * t, 4);
    for (uint32_t k = from; k < end; ++k) {
      uint16_t off = 0;
      std::memcpy(&off, p + l.offsets + 2 * k, 2);
      out.push_back(t * l.tile_elems + off);
    }
    from = end;
  }
  return out;
}

TEST(Delta, RefusesMalformedEncodings) {
  const Bytes base = RandomBytes(400, 8);  // 200 bf16 elements
  const uint64_t sum = Checksum(base.data(), base.size());
  auto decode = [&](const Bytes& enc) {
    Bytes bucket = base;
    Status s = DecodeDeltaInPlace(enc, bucket, Expect(2));
    EXPECT_EQ(bucket, base) << s.ToString();
    return s;
  };
  // Out of range, repeated, decreasing elements (one tile: 200 of its 8192 elements exist).
  for (auto off : {std::vector<uint16_t>{200}, std::vector<uint16_t>{0xFFFF},
                   std::vector<uint16_t>{5, 5}, std::vector<uint16_t>{9, 3}}) {
    const auto count = static_cast<uint32_t>(off.size());
    Status s = decode(Handmade(1, 2, 200, count, IndexPayload(200, 2, {count}, off), sum, 0));
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
    EXPECT_NE(s.message().find("b0"), std::string::npos);
  }
  // A count that overflows the payload arithmetic, a count over elements, a huge element count.
  EXPECT_EQ(decode(Handmade(1, 2, 200, ~0ull / 6 + 2, {}, sum, 0)).code(), StatusCode::kDataLoss);
  const Bytes over = IndexPayload(200, 2, {201}, std::vector<uint16_t>(201));
  EXPECT_EQ(decode(Handmade(1, 2, 200, 201, over, sum, 0)).code(), StatusCode::kDataLoss);
  EXPECT_EQ(decode(Handmade(2, 2, ~0ull, 0, {}, sum, 0)).code(), StatusCode::kDataLoss);
  // Bitmap: a bit past the last element, a popcount that disagrees with the count.
  Bytes bits(25);  // 200 elements: exactly 25 bytes, so use 197 elements for the tail case
  EXPECT_EQ(decode(Handmade(2, 2, 200, 1, bits, sum, 0)).code(), StatusCode::kDataLoss);
  Bytes small = RandomBytes(197 * 2, 9);
  Bytes tail(25);
  tail[24] = std::byte{0x80};  // element 199 of 197
  Bytes vals(2);
  tail.insert(tail.end(), vals.begin(), vals.end());
  Bytes bucket = small;
  EXPECT_EQ(
      DecodeDeltaInPlace(Handmade(2, 2, 197, 1, tail, Checksum(small.data(), small.size()), 0),
                         bucket, Expect(2))
          .code(),
      StatusCode::kDataLoss);
  EXPECT_EQ(bucket, small);
  // Bad magic, format, kind, element size, reserved byte.
  Bytes good;
  ASSERT_TRUE(EncodeDelta(base, Mutate(base, 2, 3, 1), 2, 7, "b0", &good).ok());
  for (size_t at : {0, 4, 5, 6, 7}) {
    Bytes enc = good;
    enc[at] = static_cast<std::byte>(static_cast<uint8_t>(enc[at]) ^ 0x40);
    EXPECT_EQ(decode(enc).code(), StatusCode::kDataLoss) << "header byte " << at;
  }
  // Every truncation, and one trailing byte.
  for (size_t len = 0; len < good.size(); ++len)
    EXPECT_EQ(decode(Bytes(good.begin(), good.begin() + len)).code(), StatusCode::kDataLoss) << len;
  Bytes longer = good;
  longer.push_back(std::byte{0});
  EXPECT_EQ(decode(longer).code(), StatusCode::kDataLoss);
  // A corrupted value: well formed, right base, wrong result: refused by the result checksum.
  Bytes enc = good;
  enc.back() ^= std::byte{1};
  Status s = decode(enc);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("new_checksum"), std::string::npos) << s.message();
}

// Random bytes, random headers over random payloads, random bit flips of valid encodings: the
// decoder either applies exactly the sender's bytes or refuses leaving the bucket as it was.
TEST(Delta, FuzzNeverCrashesNorAppliesAWrongResult) {
  std::mt19937 rng(1234);
  for (int e : {1, 2, 4}) {
    const Bytes base = RandomBytes(3001 * e, e);
    for (int iter = 0; iter < 300; ++iter) {
      const uint64_t changed = rng() % 3001;
      // Every other one by small steps: the packed form with escapes for 2-byte elements.
      const Bytes next = iter % 8 < 4 ? Mutate(base, e, changed, rng())
                                      : MutateSmall(base, e, changed % 400, rng());
      Bytes enc;
      ASSERT_TRUE(EncodeDelta(base, next, e, 7, "b0", &enc).ok());
      if (enc.empty()) continue;
      Bytes fuzzed = enc;
      switch (iter % 4) {
        case 0:  // flip a few bits anywhere
          for (int k = 0; k < 1 + iter % 3; ++k)
            fuzzed[rng() % fuzzed.size()] ^= static_cast<std::byte>(1u << (rng() % 8));
          break;
        case 1:  // truncate
          fuzzed.resize(rng() % fuzzed.size());
          break;
        case 2:  // random payload after a valid header
          for (size_t k = kDeltaHeaderBytes; k < fuzzed.size(); ++k)
            fuzzed[k] = static_cast<std::byte>(rng());
          break;
        default:  // random bytes of a random length
          fuzzed = RandomBytes(rng() % 2000, rng());
      }
      Bytes bucket = base;
      Status s = DecodeDeltaInPlace(fuzzed, bucket, Expect(e));
      if (s.ok())
        EXPECT_EQ(bucket, next) << "accepted a fuzzed delta with a wrong result";
      else
        EXPECT_EQ(bucket, base) << s.ToString();
    }
  }
}

// Cuts [0, n) into pieces of random lengths (multiples of e, some empty) at scattered addresses:
// each piece's bytes live in a buffer of their own, as a receiver's landed runs do.
struct Scatter {
  std::vector<Bytes> bufs;
  std::vector<DeltaPiece> pieces;
  Scatter(const Bytes& whole, int e, uint32_t seed) {
    std::mt19937 rng(seed);
    for (uint64_t at = 0; at < whole.size();) {
      const uint64_t len = std::min<uint64_t>(whole.size() - at, e * (rng() % 9));
      bufs.emplace_back(whole.begin() + at, whole.begin() + at + len);
      at += len;
    }
    uint64_t at = 0;
    for (Bytes& b : bufs) {
      pieces.push_back({at, b.size(), b.data(), b.data()});
      at += b.size();
    }
  }
  Bytes Gather() const {
    Bytes out;
    for (const Bytes& b : bufs) out.insert(out.end(), b.begin(), b.end());
    return out;
  }
};

// EncodeDeltaAdvance and the piecewise DeltaAdvanceEncoder write `enc` (EncodeDelta's bytes) and
// leave the base holding `next`; a decode over scattered pieces gives `next`.
void ExpectEncodersAgreeAndPiecesDecode(const Bytes& base, const Bytes& next, int e,
                                        const Bytes& enc) {
  const uint64_t bs = Checksum(base.data(), base.size());
  const uint64_t ns = Checksum(next.data(), next.size());
  Bytes kept = base, advanced;
  ASSERT_TRUE(EncodeDeltaAdvance(kept, next, e, 7, bs, ns, "b0", &advanced).ok());
  EXPECT_EQ(advanced, enc);
  EXPECT_EQ(kept, next);
  kept = base;
  Bytes streamed;
  DeltaAdvanceEncoder stream;
  ASSERT_TRUE(stream.Begin(kept, e, "b0", &streamed).ok());
  for (size_t o = 0; o < next.size(); o += 4096)
    ASSERT_TRUE(stream
                    .Feed(o, std::span<const std::byte>(next).subspan(
                                 o, std::min<size_t>(4096, next.size() - o)))
                    .ok());
  ASSERT_TRUE(stream.Finish(7, bs, ns).ok());
  EXPECT_EQ(streamed, enc);
  EXPECT_EQ(kept, next);
  Scatter sc(base, e, static_cast<uint32_t>(base.size()));
  Status s = DecodeDeltaPieces(enc, sc.pieces, base.size(), Expect(e));
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(sc.Gather(), next);
}

// The index form at the tile edges: a bucket of exactly one tile, and one of two tiles
// and a ragged third, with changes in the first and last element of each tile. Every encoder
// writes the same bytes, which name exactly those elements; every decoder applies them.
TEST(Delta, IndexFormRoundTripsAcrossTileEdges) {
  for (int e : {1, 2, 4}) {
    const uint64_t tile = kDeltaTileBytes / e;
    for (uint64_t elements : {tile, 2 * tile + tile / 2 + 1}) {
      SCOPED_TRACE(::testing::Message() << "e=" << e << " elements=" << elements);
      std::vector<uint64_t> at = {0, 3, tile - 1};
      if (elements > tile) at.insert(at.end(), {tile, tile + 7, 2 * tile - 1, 2 * tile});
      at.push_back(elements - 1);
      std::sort(at.begin(), at.end());
      at.erase(std::unique(at.begin(), at.end()), at.end());
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements + e));
      Bytes next = base;
      for (uint64_t i : at) next[i * e + e - 1] ^= std::byte{0x5A};

      Bytes enc;
      auto r = EncodeDelta(base, next, e, 7, "b0", &enc);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_EQ(r->kind, DeltaKind::kIndex);
      EXPECT_EQ(enc[4], std::byte{3});  // format
      EXPECT_EQ(enc.size(), kDeltaHeaderBytes + DeltaIndexPayload(elements, e, at.size()).bytes);
      EXPECT_EQ(IndexChanges(enc, e), at);
      RoundTrip(base, next, e);

      ExpectEncodersAgreeAndPiecesDecode(base, next, e, enc);
    }
  }
}

// Each malformed index form is refused with its own message (the device decoder writes the same
// ones), the bucket untouched; the checks run in order: running counts, offsets, padding.
TEST(Delta, IndexFormRefusesMalformedTilesNamingTheFault) {
  const uint64_t elements = 2 * 8192 + 100;  // bf16: two whole tiles and one of 100 elements
  const Bytes base = RandomBytes(elements * 2, 41);
  const uint64_t sum = Checksum(base.data(), base.size());
  auto decode = [&](const std::vector<uint32_t>& ends, const std::vector<uint16_t>& off,
                    uint64_t base_sum = 0, int pad = -1) {
    Bytes p = IndexPayload(elements, 2, ends, off);
    if (pad >= 0) p[pad] = std::byte{1};
    Bytes bucket = base;
    Status s = DecodeDeltaInPlace(
        Handmade(1, 2, elements, off.size(), p, base_sum ? base_sum : sum, 0), bucket, Expect(2));
    EXPECT_EQ(bucket, base) << s.ToString();
    return s;
  };
  auto malformed = [&](Status s) {
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
    const std::string pre = "delta of bucket b0: malformed encoding: ";
    const std::string m(s.message());
    EXPECT_EQ(m.substr(0, pre.size()), pre) << m;
    return m.substr(std::min(pre.size(), m.size()));
  };
  EXPECT_EQ(malformed(decode({2, 1, 3}, {1, 2, 3})),
            "tile 1: running count 1 below the previous tile's 2");
  EXPECT_EQ(malformed(decode({1, 2, 2}, {1, 2, 3})), "tile 2: running count 2, the count says 3");
  EXPECT_EQ(malformed(decode({1, 2, 4}, {1, 2, 3})), "tile 2: running count 4, the count says 3");
  EXPECT_EQ(malformed(decode({1, 1, 2}, {5, 100})),
            "record 1: element 100 of tile 2 out of range [0, 100)");
  EXPECT_EQ(malformed(decode({1, 1, 1}, {8192})),
            "record 0: element 8192 of tile 0 out of range [0, 8192)");
  EXPECT_EQ(malformed(decode({2, 2, 2}, {7, 7})),
            "record 1: element 7 of tile 0 not above the previous 7");
  // A tile's first change may lie below the previous tile's last.
  EXPECT_EQ(malformed(decode({1, 3, 3}, {9, 8, 4})),
            "record 2: element 4 of tile 1 not above the previous 8");
  // One change: counts at 0-11, its offset at 12-13, padding 14-15, its value at 16.
  EXPECT_EQ(malformed(decode({0, 1, 1}, {3}, 0, 15)), "index padding byte 15 not zero");
  // In order: the counts before the offsets before the padding.
  EXPECT_EQ(malformed(decode({1, 0, 1}, {9000}, 0, 14)),
            "tile 1: running count 0 below the previous tile's 1");
  EXPECT_EQ(malformed(decode({1, 1, 1}, {9000}, 0, 14)),
            "record 0: element 9000 of tile 0 out of range [0, 8192)");
  // Another base is named first (the caller falls back to a full send).
  EXPECT_EQ(decode({2, 1, 3}, {1, 2, 3}, sum + 1).code(), StatusCode::kFailedPrecondition);
  // Well formed (empty tiles too), values that are not the sender's: the result checksum.
  Status s = decode({0, 0, 1}, {99});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("new_checksum"), std::string::npos) << s.message();
}

// Formats 1 (a u32 element index per change) and 2 (no packed form) are refused, not read,
// whatever the kind.
TEST(Delta, RefusesFormatsOneAndTwo) {
  const Bytes base = RandomBytes(20000, 12);
  for (uint64_t changed : {5ull, 3000ull}) {
    for (uint8_t format : {1, 2}) {
      Bytes enc;
      ASSERT_TRUE(EncodeDelta(base, Mutate(base, 2, changed, 2), 2, 7, "b0", &enc).ok());
      ASSERT_EQ(enc[4], std::byte{3});
      enc[4] = std::byte{format};
      Bytes bucket = base;
      Status s = DecodeDeltaInPlace(enc, bucket, Expect(2));
      EXPECT_EQ(s.code(), StatusCode::kDataLoss);
      EXPECT_EQ(s.message(),
                "delta of bucket b0: malformed encoding: format " + std::to_string(format));
      EXPECT_EQ(bucket, base);
      EXPECT_FALSE(InspectDelta(enc, "b0").ok());
    }
  }
}

// The packed form (format 3): small changes of bf16 and byte images at the subtile and tile edges,
// escapes at their bounds; every encoder writes the same bytes, every decoder applies them.
TEST(Delta, PackedFormRoundTripsAtEdgesAndEscapes) {
  for (int e : {1, 2}) {
    const uint64_t tile = kDeltaTileBytes / e;
    for (uint64_t elements : {uint64_t{1000}, uint64_t{3001}, tile, 2 * tile + 67}) {
      SCOPED_TRACE(::testing::Message() << "e=" << e << " elements=" << elements);
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements * 3 + e));
      // Dense enough for the packed form; the edges of subtiles and tiles changed.
      Bytes next = MutateSmall(base, e, elements / 25, static_cast<uint32_t>(elements));
      const int16_t steps[] = {1, -1, 127, -127, 128, -128, 0x4000};
      int q = 0;
      for (uint64_t i : {uint64_t{0}, uint64_t{127}, uint64_t{128}, tile - 1, tile, elements - 1}) {
        if (i >= elements) continue;
        std::byte* p = next.data() + i * e;
        if (e == 1) {
          p[0] = base[i] ^ std::byte{0x21};
          continue;
        }
        uint16_t v;
        std::memcpy(&v, base.data() + i * e, 2);
        v = static_cast<uint16_t>(v + steps[q++ % 7]);
        std::memcpy(p, &v, 2);
      }
      Bytes enc;
      auto r = EncodeDelta(base, next, e, 7, "b0", &enc);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_EQ(r->kind, DeltaKind::kPacked);
      EXPECT_EQ(enc[4], std::byte{3});
      auto info = InspectDelta(enc, "b0");
      ASSERT_TRUE(info.ok()) << info.status().ToString();
      EXPECT_EQ(info->kind, DeltaKind::kPacked);
      EXPECT_EQ(info->escapes, r->escapes);
      // The escapes: exactly the changes whose difference is out of [-127, 127].
      uint64_t escapes = 0;
      for (uint64_t i = 0; e == 2 && i < elements; ++i) {
        uint16_t o, n;
        std::memcpy(&o, base.data() + i * 2, 2);
        std::memcpy(&n, next.data() + i * 2, 2);
        escapes += o != n && DeltaEscaped(o, n);
      }
      EXPECT_EQ(r->escapes, escapes);
      if (e == 2) {
        EXPECT_GE(escapes, 3u);
      }
      EXPECT_EQ(enc.size(),
                kDeltaHeaderBytes + DeltaPackedPayload(elements, e, r->changed, escapes).bytes);
      RoundTrip(base, next, e);

      ExpectEncodersAgreeAndPiecesDecode(base, next, e, enc);
      Bytes kept = base, advanced;
      auto adv = EncodeDeltaAdvance(kept, next, e, 7, Checksum(base.data(), base.size()),
                                    Checksum(next.data(), next.size()), "b0", &advanced);
      ASSERT_TRUE(adv.ok());
      EXPECT_EQ(adv->escapes, escapes);
      Status st;
      // Into staging (out elsewhere): the base untouched, the result in `out`.
      Bytes staged(base.size());
      const DeltaPiece whole{0, base.size(), base.data(), staged.data()};
      st = DecodeDeltaPieces(enc, {&whole, 1}, base.size(), Expect(e));
      ASSERT_TRUE(st.ok()) << st.ToString();
      EXPECT_EQ(staged, next);
    }
  }
}

// Each malformed packed form is refused with its own message (the device decoder writes the
// same ones), the bucket untouched, in the order of delta.h: running counts, escape counts, then
// tile by tile subtile counts, their sum, records, escaped values; then the padding.
TEST(Delta, PackedFormRefusesMalformedEncodingsNamingTheFault) {
  constexpr uint64_t kElems = 40003;  // bf16: 5 tiles, 313 subtiles, the last of 67 elements
  const Bytes base = RandomBytes(kElems * 2, 78);
  const Bytes next = MutateSmall(base, 2, 1201, 4);
  Bytes enc0;
  auto r = EncodeDelta(base, next, 2, 7, "b0", &enc0);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->kind, DeltaKind::kPacked);
  const uint64_t c = r->changed, x = r->escapes;
  const DeltaPackedLayout l = DeltaPackedPayload(kElems, 2, c, x);
  const size_t p = kDeltaHeaderBytes;
  auto u32 = [&](const Bytes& b, size_t at) {
    uint32_t v;
    std::memcpy(&v, b.data() + at, 4);
    return v;
  };
  auto put32 = [](Bytes* b, size_t at, uint32_t v) { std::memcpy(b->data() + at, &v, 4); };
  const uint32_t end0 = u32(enc0, p), end1 = u32(enc0, p + 4);
  const uint32_t esc1 = u32(enc0, p + l.escape_ends + 4), esc4 = u32(enc0, p + l.escape_ends + 16);
  ASSERT_GE(esc1, 1u);
  ASSERT_GT(l.escapes, l.values + c);  // a padding byte
  // Subtile 64 (tile 1's first) and the first subtile of tile 1 with two records or more.
  uint64_t sub2 = 0, k2 = end0;
  for (uint64_t sb = 64; sb < 128; ++sb) {
    const auto n = static_cast<uint8_t>(enc0[p + l.subs + sb]);
    if (n >= 2) {
      sub2 = sb;
      break;
    }
    k2 += n;
  }
  ASSERT_GT(sub2, 0u);
  const auto o2 = static_cast<uint8_t>(enc0[p + l.offsets + k2]);
  auto decode = [&](const std::function<void(Bytes*)>& edit, size_t cut = 0) {
    Bytes enc = enc0;
    edit(&enc);
    enc.resize(enc.size() - cut);
    Bytes bucket = base;
    Status s = DecodeDeltaInPlace(enc, bucket, Expect(2));
    EXPECT_EQ(bucket, base) << s.ToString();
    const std::string pre = "delta of bucket b0: malformed encoding: ";
    const std::string m(s.message());
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << m;
    EXPECT_EQ(m.substr(0, pre.size()), pre) << m;
    return m.substr(std::min(pre.size(), m.size()));
  };
  auto nop = [](Bytes*) {};
  EXPECT_EQ(decode([&](Bytes* e) { put32(e, 40, static_cast<uint32_t>(kElems / 8)); }),
            fmt::format("packed form of {} changes of 2-byte elements: over the form's limit",
                        kElems / 8));
  EXPECT_EQ(decode(nop, 1),
            fmt::format("{} payload bytes, the header's packed form of {} changes needs {} plus 2 "
                        "per escape (at most {})",
                        l.bytes - 1, c, DeltaPackedPayload(kElems, 2, c, 0).bytes, c));
  EXPECT_EQ(decode([&](Bytes* e) { put32(e, p + 8, end1 - 1); }),
            fmt::format("tile 2: running count {} below the previous tile's {}", end1 - 1, end1));
  EXPECT_EQ(decode([&](Bytes* e) { put32(e, p + 16, static_cast<uint32_t>(c + 1)); }),
            fmt::format("tile 4: running count {}, the count says {}", c + 1, c));
  EXPECT_EQ(
      decode([&](Bytes* e) { put32(e, p + l.escape_ends + 8, esc1 - 1); }),
      fmt::format("tile 2: running escape count {} below the previous tile's {}", esc1 - 1, esc1));
  EXPECT_EQ(decode([&](Bytes* e) { put32(e, p + l.escape_ends + 16, esc4 - 1); }),
            fmt::format("tile 4: running escape count {}, the length says {}", esc4 - 1, x));
  EXPECT_EQ(decode([&](Bytes* e) { (*e)[p + l.subs + 67] = std::byte{129}; }),
            "subtile 67: count 129 over its 128 elements");
  EXPECT_EQ(decode([&](Bytes* e) { (*e)[p + l.subs + 312] = std::byte{68}; }),
            "subtile 312: count 68 over its 67 elements");
  EXPECT_EQ(decode([&](Bytes* e) {
              (*e)[p + l.subs + sub2] =
                  std::byte(static_cast<uint8_t>((*e)[p + l.subs + sub2]) + 1);
            }),
            fmt::format("tile 1: subtile counts sum to {}, the running counts say {}",
                        end1 - end0 + 1, end1 - end0));
  EXPECT_EQ(
      decode([&](Bytes* e) { (*e)[p + l.offsets + k2 + 1] = std::byte{200}; }),
      fmt::format("record {}: element 200 of subtile {} out of range [0, 128)", k2 + 1, sub2));
  EXPECT_EQ(decode([&](Bytes* e) { (*e)[p + l.offsets + k2 + 1] = std::byte{o2}; }),
            fmt::format("record {}: element {} of subtile {} not above the previous {}", k2 + 1, o2,
                        sub2, o2));
  uint64_t plain = end1;  // tile 2's first value byte that is not an escape
  while (enc0[p + l.values + plain] == std::byte{kDeltaEscape}) ++plain;
  const uint32_t esc2 = u32(enc0, p + l.escape_ends + 8);
  EXPECT_EQ(decode([&](Bytes* e) { (*e)[p + l.values + plain] = std::byte{kDeltaEscape}; }),
            fmt::format("tile 2: {} escaped values, the running escape counts say {}",
                        esc2 - esc1 + 1, esc2 - esc1));
  EXPECT_EQ(decode([&](Bytes* e) { (*e)[p + l.values + c] = std::byte{1}; }),
            fmt::format("packed padding byte {} not zero", l.values + c));
  // In order: a record of tile 1 before a subtile count of tile 2; the counts before both.
  EXPECT_EQ(
      decode([&](Bytes* e) {
        (*e)[p + l.offsets + k2 + 1] = std::byte{200};
        (*e)[p + l.subs + 130] = std::byte{200};
      }),
      fmt::format("record {}: element 200 of subtile {} out of range [0, 128)", k2 + 1, sub2));
  EXPECT_EQ(
      decode([&](Bytes* e) {
        (*e)[p + l.offsets + k2 + 1] = std::byte{200};
        put32(e, p + l.escape_ends + 8, esc1 - 1);
      }),
      fmt::format("tile 2: running escape count {} below the previous tile's {}", esc1 - 1, esc1));
  // Element size 4 has no packed form; a byte image's length has no escapes.
  Bytes enc4 = enc0;
  enc4[6] = std::byte{4};
  Bytes b4 = base;
  EXPECT_EQ(DecodeDeltaInPlace(enc4, b4, Expect(4)).message(),
            fmt::format("delta of bucket b0: malformed encoding: packed form of {} changes of "
                        "4-byte elements: over the form's limit",
                        c));
  const Bytes base1 = RandomBytes(5000, 3);
  Bytes enc1;
  ASSERT_TRUE(EncodeDelta(base1, MutateSmall(base1, 1, 200, 5), 1, 7, "b0", &enc1).ok());
  ASSERT_EQ(enc1[5], std::byte{3});
  enc1.push_back(std::byte{0});
  enc1.push_back(std::byte{0});
  Bytes bb = base1;
  EXPECT_EQ(DecodeDeltaInPlace(enc1, bb, Expect(1)).message(),
            fmt::format("delta of bucket b0: malformed encoding: {} payload bytes, the header's "
                        "packed form of 200 changes needs {}",
                        enc1.size() - p, DeltaPackedPayload(5000, 1, 200, 0).bytes));
  // A corrupted difference: well formed, the result checksum refuses it.
  Bytes enc = enc0;
  enc[p + l.values + plain] ^= std::byte{0x03};
  Bytes bucket = base;
  Status s = DecodeDeltaInPlace(enc, bucket, Expect(2));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("new_checksum"), std::string::npos) << s.message();
  EXPECT_EQ(bucket, base);
}

// The index form costs 2 + e bytes a change plus 4 bytes a tile, the bitmap 1/8 byte an element
// plus e a change: they break even near density 1/16, and every encoder follows the rule there.
TEST(Delta, SizeRuleBreaksEvenNearOneSixteenth) {
  const uint64_t elements = uint64_t{1} << 20;
  for (int e : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << "e=" << e);
    const uint64_t tiles = elements / (kDeltaTileBytes / e);
    const uint64_t last = (elements / 8 - 4 * tiles) / 2;  // the last count the index form wins
    EXPECT_GT(last, elements / 17);
    EXPECT_LT(last, elements / 16);
    // Every change escaped (Mutate flips the top byte): the packed form does not win for 2-byte
    // elements; a byte image's does (2 bytes a change and a byte a subtile against 3 a change).
    const DeltaSize at = DeltaEncodedBytes(elements, e, last, last);
    const DeltaKind at_kind = e == 1 ? DeltaKind::kPacked : DeltaKind::kIndex;
    EXPECT_EQ(at.kind, at_kind);
    EXPECT_EQ(at.bytes, e == 1 ? kDeltaHeaderBytes + 4 * tiles + elements / 128 + 2 * last
                               : kDeltaHeaderBytes + 4 * tiles + 2 * last + e * last);
    const DeltaSize past = DeltaEncodedBytes(elements, e, last + 1);
    EXPECT_EQ(past.kind, DeltaKind::kBitmap);
    EXPECT_EQ(past.bytes, kDeltaHeaderBytes + elements / 8 + e * (last + 1));

    const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(e));
    for (uint64_t changed : {last, last + 1}) {
      const Bytes next = Mutate(base, e, changed, static_cast<uint32_t>(changed));
      const DeltaEncodeResult r = RoundTrip(base, next, e);
      EXPECT_EQ(r.kind, changed == last ? at_kind : DeltaKind::kBitmap);
      Bytes want, got, kept = base;
      ASSERT_TRUE(EncodeDelta(base, next, e, 7, "b0", &want).ok());
      DeltaAdvanceEncoder stream;
      ASSERT_TRUE(stream.Begin(kept, e, "b0", &got).ok());
      const size_t piece = size_t{64} << 10;
      for (size_t o = 0; o < next.size(); o += piece)
        ASSERT_TRUE(stream.Feed(o, std::span<const std::byte>(next).subspan(o, piece)).ok());
      ASSERT_TRUE(
          stream.Finish(7, Checksum(base.data(), base.size()), Checksum(next.data(), next.size()))
              .ok());
      EXPECT_EQ(got, want);
      EXPECT_EQ(kept, next);
    }
  }
}

TEST(Delta, AdvanceEncodesLikeEncodeDeltaAndLeavesTheBaseHoldingNext) {
  for (int e : {1, 2, 4}) {
    for (uint64_t elements : {1ull, 13ull, 1001ull, 40009ull}) {
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements + e));
      for (double density : {0.0, 0.002, 0.05, 0.5, 1.0}) {
        const auto changed = static_cast<uint64_t>(density * static_cast<double>(elements));
        const Bytes next = Mutate(base, e, changed, static_cast<uint32_t>(changed * 3 + e));
        SCOPED_TRACE(::testing::Message()
                     << "e=" << e << " elements=" << elements << " changed=" << changed);
        Bytes want, got;
        auto r = EncodeDelta(base, next, e, 7, "b0", &want);
        ASSERT_TRUE(r.ok());
        Bytes kept = base;
        auto a = EncodeDeltaAdvance(kept, next, e, 7, Checksum(base.data(), base.size()),
                                    Checksum(next.data(), next.size()), "b0", &got);
        ASSERT_TRUE(a.ok()) << a.status().ToString();
        EXPECT_EQ(got, want);  // byte for byte: the checksums given are the computed ones
        EXPECT_EQ(a->kind, r->kind);
        EXPECT_EQ(a->changed, r->changed);
        EXPECT_EQ(kept, next);
      }
    }
  }
  // Checksums are taken as given (not recomputed): a wrong new checksum is what the receiver's
  // decode refuses, leaving its bucket alone.
  const Bytes base = RandomBytes(4000, 5);
  const Bytes next = Mutate(base, 2, 10, 6);
  Bytes kept = base, enc;
  ASSERT_TRUE(
      EncodeDeltaAdvance(kept, next, 2, 7, Checksum(base.data(), base.size()), 12345, "b", &enc)
          .ok());
  Bytes bucket = base;
  EXPECT_EQ(DecodeDeltaInPlace(enc, bucket, Expect(2)).code(), StatusCode::kDataLoss);
  EXPECT_EQ(bucket, base);
  // Bad inputs: refused, the base untouched.
  kept = base;
  Bytes odd(base.begin(), base.end() - 1);
  EXPECT_EQ(EncodeDeltaAdvance(kept, odd, 2, 7, 0, 0, "b", &enc).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(kept, base);
}

// The encoder fed piece by piece (the host sender packs chunk by chunk): the same bytes as the
// whole-image encode for every cut into 64-byte multiples, the base advanced to next; pieces out of
// order or not 64-byte multiples are refused.
TEST(Delta, AdvanceEncoderFedInPiecesEncodesLikeTheWholeImage) {
  for (int e : {1, 2, 4}) {
    for (uint64_t elements : {1ull, 13ull, 1001ull, 40009ull}) {
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements + e));
      for (double density : {0.0, 0.002, 0.05, 0.5, 1.0}) {
        const auto changed = static_cast<uint64_t>(density * static_cast<double>(elements));
        const Bytes next = Mutate(base, e, changed, static_cast<uint32_t>(changed * 3 + e));
        const uint64_t bs = Checksum(base.data(), base.size());
        const uint64_t ns = Checksum(next.data(), next.size());
        Bytes want;
        Bytes whole = base;
        auto w = EncodeDeltaAdvance(whole, next, e, 7, bs, ns, "b0", &want);
        ASSERT_TRUE(w.ok());
        for (size_t piece : {size_t{64}, size_t{192}, size_t{4096}, size_t{1} << 20}) {
          SCOPED_TRACE(::testing::Message() << "e=" << e << " elements=" << elements
                                            << " changed=" << changed << " piece=" << piece);
          Bytes kept = base, got;
          DeltaAdvanceEncoder enc;
          ASSERT_TRUE(enc.Begin(kept, e, "b0", &got).ok());
          for (size_t at = 0; at < next.size(); at += piece) {
            const size_t len = std::min(piece, next.size() - at);
            ASSERT_TRUE(enc.Feed(at, std::span<const std::byte>(next).subspan(at, len)).ok());
          }
          auto r = enc.Finish(7, bs, ns);
          ASSERT_TRUE(r.ok()) << r.status().ToString();
          EXPECT_EQ(got, want);
          EXPECT_EQ(r->kind, w->kind);
          EXPECT_EQ(r->changed, w->changed);
          EXPECT_EQ(kept, next);
        }
      }
    }
  }
  const Bytes base = RandomBytes(4000, 5);
  const Bytes next = Mutate(base, 2, 10, 6);
  const std::span<const std::byte> n(next);
  Bytes kept = base, out;
  DeltaAdvanceEncoder enc;
  ASSERT_TRUE(enc.Begin(kept, 2, "b", &out).ok());
  EXPECT_EQ(enc.Feed(64, n.subspan(64, 64)).code(), StatusCode::kInvalidArgument);  // a gap
  EXPECT_EQ(enc.Feed(0, n.subspan(0, 100)).code(), StatusCode::kInvalidArgument);   // not 64k
  ASSERT_TRUE(enc.Feed(0, n.subspan(0, 128)).ok());
  EXPECT_EQ(enc.Finish(7, 0, 0).status().code(), StatusCode::kInvalidArgument);  // not all fed
}

TEST(Delta, PiecesDecodeLikeOneBufferAndChecksumLikeOne) {
  for (int e : {1, 2, 4}) {
    for (uint64_t elements : {1ull, 13ull, 1001ull, 20011ull}) {
      const Bytes base = RandomBytes(elements * e, static_cast<uint32_t>(elements * 7 + e));
      for (double density : {0.0, 0.01, 0.3, 0.9}) {
        const auto changed = static_cast<uint64_t>(density * static_cast<double>(elements));
        const Bytes next = Mutate(base, e, changed, static_cast<uint32_t>(changed + 11 * e));
        SCOPED_TRACE(::testing::Message()
                     << "e=" << e << " elements=" << elements << " changed=" << changed);
        Scatter in_place(base, e, static_cast<uint32_t>(elements + changed));
        auto sum = DeltaPiecesChecksum(in_place.pieces, base.size());
        ASSERT_TRUE(sum.ok()) << sum.status().ToString();
        EXPECT_EQ(*sum, Checksum(base.data(), base.size()));
        Bytes enc;
        ASSERT_TRUE(EncodeDelta(base, next, e, 7, "b0", &enc).ok());
        if (enc.empty()) continue;  // kFull
        Status s = DecodeDeltaPieces(enc, in_place.pieces, base.size(), Expect(e));
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_EQ(in_place.Gather(), next);

        // Out of place (staging): the base pieces are read, the result lands elsewhere.
        Scatter from(base, e, static_cast<uint32_t>(elements + 3)), to(Bytes(base.size()), e, 0);
        std::vector<DeltaPiece> split;
        // One piece per overlap of the two cuttings, so base and out pieces line up.
        size_t i = 0, j = 0;
        for (uint64_t at = 0; at < base.size();) {
          while (from.pieces[i].offset + from.pieces[i].len <= at) ++i;
          while (to.pieces[j].offset + to.pieces[j].len <= at) ++j;
          const uint64_t end = std::min(from.pieces[i].offset + from.pieces[i].len,
                                        to.pieces[j].offset + to.pieces[j].len);
          split.push_back({at, end - at, from.pieces[i].base + (at - from.pieces[i].offset),
                           to.pieces[j].out + (at - to.pieces[j].offset)});
          at = end;
        }
        s = DecodeDeltaPieces(enc, split, base.size(), Expect(e));
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_EQ(to.Gather(), next);
        EXPECT_EQ(from.Gather(), base);  // the base is only read
      }
    }
  }
}

TEST(Delta, PiecesRefuseAnotherBaseAndBadTilings) {
  const Bytes base = RandomBytes(6002, 31);
  const Bytes next = Mutate(base, 2, 40, 8);
  Bytes enc;
  ASSERT_TRUE(EncodeDelta(base, next, 2, 7, "layers.0.attn", &enc).ok());
  // A flipped bit in an element the delta does not touch, in some piece: refused, untouched.
  Bytes corrupted = base;
  size_t k = 3001;
  while (next[k] != base[k] || next[k ^ 1] != base[k ^ 1]) ++k;
  corrupted[k] ^= std::byte{0x04};
  Scatter sc(corrupted, 2, 77);
  Status s = DecodeDeltaPieces(enc, sc.pieces, base.size(), {"layers.0.attn", 2, 7});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("base_checksum"), std::string::npos) << s.message();
  EXPECT_EQ(sc.Gather(), corrupted);
  // Another version: refused before anything is read or copied.
  Scatter ok(base, 2, 78);
  EXPECT_EQ(DecodeDeltaPieces(enc, ok.pieces, base.size(), {"layers.0.attn", 2, 6}).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(ok.Gather(), base);
  // Pieces that leave a gap, overlap, split an element or fall short of the bucket.
  for (int bad = 0; bad < 4; ++bad) {
    std::vector<DeltaPiece> p = ok.pieces;
    size_t m = 0;
    while (p[m].len < 4) ++m;
    if (bad == 0) p[m].offset += 2;
    if (bad == 1) p[m].len += 2;
    if (bad == 2) {  // a byte moves to the next piece: the tiling holds, an element is split
      p[m].len -= 1;
      p[m + 1].offset -= 1;
      p[m + 1].len += 1;
    }
    if (bad == 3) p.pop_back();
    s = DecodeDeltaPieces(enc, p, base.size(), {"layers.0.attn", 2, 7});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("layers.0.attn"), std::string::npos) << s.message();
    if (bad != 2) {  // the checksum reads bytes: any byte tiling will do
      EXPECT_EQ(DeltaPiecesChecksum(p, base.size()).status().code(), StatusCode::kInvalidArgument);
    }
  }
  EXPECT_EQ(ok.Gather(), base);
}

TEST(DeltaCost, PaysOnSlowLinksAtLowDensity) {
  DeltaCostInput in;
  in.bucket_bytes = 64 << 20;
  in.element_size = 2;
  in.density = 0.01;
  in.link_gbps = 25;
  in.encode_gbps = 10;
  in.decode_gbps = 20;
  auto c = EstimateDeltaCost(in);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->kind, DeltaKind::kPacked);
  const uint64_t elements = in.bucket_bytes / 2;
  const uint64_t changed = 335544;  // llround(0.01 * 33554432)
  // 4096 tiles of 8192 elements: 32 KiB of running counts (changes, escapes), 262144 subtile
  // counts, then 2 bytes a change (the model assumes no escapes).
  EXPECT_EQ(c->wire_bytes, kDeltaHeaderBytes + 8 * 4096 + 262144 + changed * 2);
  EXPECT_EQ(c->wire_bytes, DeltaEncodedBytes(elements, 2, changed).bytes);
  EXPECT_DOUBLE_EQ(c->full_seconds, (64 << 20) / 25e9);
  const double f = 64 << 20;
  EXPECT_DOUBLE_EQ(c->delta_seconds, f / 10e9 + c->wire_bytes / 25e9 + f / 20e9);
  // enc + dec = 0.15 ns/byte against 0.04 ns/byte of link: serial delta loses at 25 GB/s.
  EXPECT_FALSE(c->pays);
  const double saved = 1 - static_cast<double>(c->wire_bytes) / f;
  EXPECT_DOUBLE_EQ(c->break_even_link_gbps, saved / (1 / 10.0 + 1 / 20.0));
  in.link_gbps = c->break_even_link_gbps * 0.99;
  EXPECT_TRUE(EstimateDeltaCost(in)->pays);
  in.link_gbps = c->break_even_link_gbps * 1.01;
  EXPECT_FALSE(EstimateDeltaCost(in)->pays);

  // Pipelined with the transfer: pays while the link is slower than both codecs.
  in.overlap = true;
  in.link_gbps = 9;
  EXPECT_TRUE(EstimateDeltaCost(in)->pays);
  EXPECT_DOUBLE_EQ(EstimateDeltaCost(in)->break_even_link_gbps, 10);
  in.link_gbps = 11;
  EXPECT_FALSE(EstimateDeltaCost(in)->pays);

  // Dense buckets go full and never "pay".
  in.density = 1.0;
  c = EstimateDeltaCost(in);
  EXPECT_EQ(c->kind, DeltaKind::kFull);
  EXPECT_EQ(c->wire_bytes, c->full_bytes);
  EXPECT_FALSE(c->pays);
  EXPECT_EQ(c->break_even_link_gbps, 0);
  // Density 0: only the header and the running counts (all zero) travel.
  in.density = 0;
  in.link_gbps = 1;
  c = EstimateDeltaCost(in);
  EXPECT_EQ(c->wire_bytes, kDeltaHeaderBytes + 4 * 4096);
  EXPECT_TRUE(c->pays);
}

TEST(DeltaCost, RefusesBadInputsNamingTheField) {
  DeltaCostInput ok;
  ok.bucket_bytes = 1024;
  ok.encode_gbps = ok.decode_gbps = 10;
  ASSERT_TRUE(EstimateDeltaCost(ok).ok());
  auto field = [](DeltaCostInput in) { return EstimateDeltaCost(in).status().message(); };
  DeltaCostInput in = ok;
  in.density = 1.5;
  EXPECT_NE(field(in).find("density"), std::string::npos);
  in = ok;
  in.density = std::nan("");
  EXPECT_NE(field(in).find("density"), std::string::npos);
  in = ok;
  in.element_size = 3;
  EXPECT_NE(field(in).find("element_size"), std::string::npos);
  in = ok;
  in.bucket_bytes = 1023;
  EXPECT_NE(field(in).find("bucket_bytes"), std::string::npos);
  in = ok;
  in.link_gbps = 0;
  EXPECT_NE(field(in).find("link_gbps"), std::string::npos);
  in = ok;
  in.encode_gbps = -1;
  EXPECT_NE(field(in).find("encode_gbps"), std::string::npos);
  in = ok;
  in.decode_gbps = INFINITY;
  EXPECT_NE(field(in).find("decode_gbps"), std::string::npos);
}

}  // namespace
}  // namespace shardsync
