// The verdict line every rank posts after a sync: exact round trip, and DataLoss naming the rank
// for anything malformed (a peer's store value is input like any other).
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "sync/verdict_codec.h"

namespace shardsync {
namespace {

using sync_internal::DecodeVerdict;
using sync_internal::EncodeVerdict;

RankSyncStats Sample() {
  RankSyncStats s;
  s.rank = 3;
  s.ok = true;
  s.send_bytes = 0;
  s.recv_bytes = 4095352832;
  s.seconds = 0.009512345678901234;
  s.checksums_ok = 9;
  s.checksums_total = 9;
  return s;
}

// Encodes s, decodes it as rank s.rank's verdict and expects every field back unchanged.
void ExpectRoundTrip(const RankSyncStats& s) {
  auto d = DecodeVerdict(EncodeVerdict(s), s.rank);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->rank, s.rank);
  EXPECT_EQ(d->ok, s.ok);
  EXPECT_EQ(d->error, s.error);
  EXPECT_EQ(d->send_bytes, s.send_bytes);
  EXPECT_EQ(d->recv_bytes, s.recv_bytes);
  EXPECT_EQ(d->seconds, s.seconds);  // bit-exact: shortest round-trip text
  EXPECT_EQ(d->checksums_ok, s.checksums_ok);
  EXPECT_EQ(d->checksums_total, s.checksums_total);
}

TEST(Verdict, RoundTripsExactly) { ExpectRoundTrip(Sample()); }

TEST(Verdict, ErrorTextMayHoldAnything) {
  RankSyncStats s = Sample();
  s.ok = false;
  s.checksums_ok = 8;
  s.error = "cuda_ipc: bucket 4 | landed 0x1 != packed 0x2\nsecond line \t tab, 'quotes' \"x\"";
  s.error.push_back('\0');
  s.error += "after a NUL";
  ExpectRoundTrip(s);
}

TEST(Verdict, ExtremeNumbersRoundTrip) {
  RankSyncStats s = Sample();
  s.send_bytes = INT64_MAX;
  s.recv_bytes = 0;
  s.seconds = 5e-324;  // smallest subnormal
  s.checksums_ok = 0;
  s.checksums_total = INT64_MAX;
  ExpectRoundTrip(s);
}

TEST(Verdict, AnotherRanksVerdictIsDataLoss) {
  auto d = DecodeVerdict(EncodeVerdict(Sample()), 2);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(d.status().message().find("sync report of rank 2 names rank 3"), std::string::npos)
      << d.status().ToString();
}

TEST(Verdict, MalformedLinesNameTheRankAndTheField) {
  const std::string good = EncodeVerdict(Sample());
  ASSERT_EQ(good.rfind("SSV1 3 1 0 4095352832 ", 0), 0u) << good;
  const struct {
    std::string text, says;
  } cases[] = {
      {"", "no '|'"},
      {"{\"rank\":3,\"ok\":true}", "no '|'"},
      {"SSV1 3 1 0 4095352832 0.0095 9|", "8 space-separated fields"},  // a field missing
      {"SSV1 3 1 0 4095352832 0.0095 9 9 9|", "8 space-separated fields"},
      {"SSV1 3 1 0 4095352832 0.0095  9 9|", "8 space-separated fields"},  // double space
      {"SSV2 3 1 0 4095352832 0.0095 9 9|", "does not start with SSV1"},
      {"SSV1 x 1 0 4095352832 0.0095 9 9|", "rank is not an integer"},
      {"SSV1 3 2 0 4095352832 0.0095 9 9|", "ok is not 0 or 1"},
      {"SSV1 3 1 -5 4095352832 0.0095 9 9|", "byte counts"},
      {"SSV1 3 1 0 99999999999999999999 0.0095 9 9|", "byte counts"},  // overflows int64
      {"SSV1 3 1 0 4095352832 nan 9 9|", "seconds"},
      {"SSV1 3 1 0 4095352832 -1 9 9|", "seconds"},
      {"SSV1 3 1 0 4095352832 0.0095x 9 9|", "seconds"},
      {"SSV1 3 1 0 4095352832 0.0095 10 9|", "checksum counts"},
      {"SSV1 3 1 0 4095352832 0.0095 -1 9|", "checksum counts"},
  };
  for (const auto& c : cases) {
    auto d = DecodeVerdict(c.text, 3);
    ASSERT_FALSE(d.ok()) << "accepted: " << c.text;
    EXPECT_EQ(d.status().code(), StatusCode::kDataLoss) << c.text;
    EXPECT_NE(d.status().message().find("sync report of rank 3 is malformed"), std::string::npos)
        << d.status().ToString();
    EXPECT_NE(d.status().message().find(c.says), std::string::npos)
        << c.text << " -> " << d.status().ToString();
  }
}

// Random truncations and byte flips of a valid line: never a crash, and whatever decodes is a
// verdict of rank 3 with consistent counts.
TEST(Verdict, MutatedLinesDecodeOrFailCleanly) {
  RankSyncStats s = Sample();
  s.error = "some error text";
  const std::string good = EncodeVerdict(s);
  std::mt19937 rng(7);
  int decoded = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string t = good;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits && !t.empty(); ++e) {
      const size_t at = rng() % t.size();
      switch (rng() % 3) {
        case 0:
          t[at] = static_cast<char>(rng() % 256);
          break;
        case 1:
          t.erase(at, 1);
          break;
        default:
          t.resize(at);
      }
    }
    auto d = DecodeVerdict(t, 3);
    if (!d.ok()) {
      EXPECT_EQ(d.status().code(), StatusCode::kDataLoss);
      continue;
    }
    ++decoded;
    EXPECT_EQ(d->rank, 3);
    EXPECT_GE(d->checksums_ok, 0);
    EXPECT_LE(d->checksums_ok, d->checksums_total);
    EXPECT_GE(d->seconds, 0);
  }
  EXPECT_GT(decoded, 0);  // edits inside the error text still decode
}

}  // namespace
}  // namespace shardsync
