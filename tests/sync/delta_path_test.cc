// The delta encoding's bookkeeping (sync/delta_path.h): base advertisements round-trip and refuse
// malformed values naming the receiver; the decision names the fallback's reason; control
// messages are checked; the verdict line carries the delta figures.
#include <cstdlib>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "sync/delta_path.h"
#include "sync/verdict_codec.h"

namespace shardsync::sync_internal {
namespace {

using ::testing::HasSubstr;

TEST(DeltaBases, RoundTripPerSourceAndBucket) {
  const std::vector<BucketBase> a = {{7, 0x0123456789abcdefull}, {0, 0}, {7, 1}};
  const std::vector<BucketBase> b = {{6, 0xffffffffffffffffull}};
  const std::string v = EncodeBases({{0, a}, {12, b}});
  auto ga = ParseBases(v, 0, 3, 5);
  ASSERT_TRUE(ga.ok()) << ga.status().ToString();
  EXPECT_EQ(*ga, a);
  auto gb = ParseBases(v, 12, 1, 5);
  ASSERT_TRUE(gb.ok()) << gb.status().ToString();
  EXPECT_EQ(*gb, b);
  // " 1:" is not " 12:".
  EXPECT_FALSE(ParseBases(v, 1, 1, 5).ok());
}

TEST(DeltaBases, MalformedValuesAreDataLossNamingTheReceiver) {
  const std::string v = EncodeBases({{0, {{1, 2}, {1, 3}}}});
  for (const auto& [value, src, n, what] :
       std::vector<std::tuple<std::string, int, size_t, std::string>>{
           {"1", 0, 2, "do not start with D1"},
           {v, 0, 3, "list 2 buckets"},
           {v, 0, 1, "list 2 buckets"},
           {v, 4, 2, "name no buckets from sync rank 4"},
           {"D1 0:1.2,x.3", 0, 2, "malformed base for bucket 1"},
           {"D1 0:1.2,1.zz", 0, 2, "malformed base for bucket 1"},
           {"D1 0:", 0, 1, "list 0 buckets"},
           {"D1 0:1.2,", 0, 2, "list 1 buckets"},
       }) {
    auto r = ParseBases(value, src, n, 9);
    ASSERT_FALSE(r.ok()) << value;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_THAT(r.status().message(), HasSubstr("sync rank 9"));
    EXPECT_THAT(r.status().message(), HasSubstr(what)) << value;
  }
}

TEST(DeltaDecision, TheBaseMustBeTheKeptImage) {
  KeptImage k;
  EXPECT_EQ(CheckBase(k, {0, 0}), DeltaReason::kNoImage);
  k.bytes.assign(8, std::byte{1});
  k.version = 4;
  k.checksum = 99;
  EXPECT_EQ(CheckBase(k, {4, 99}), DeltaReason::kDelta);
  EXPECT_EQ(CheckBase(k, {3, 99}), DeltaReason::kVersion);
  EXPECT_EQ(CheckBase(k, {0, 99}), DeltaReason::kVersion);
  EXPECT_EQ(CheckBase(k, {4, 98}), DeltaReason::kChecksum);
  EXPECT_EQ(DescribeFallback(DeltaReason::kChecksum, 3, 1, k, {4, 98}),
            "to sync rank 3, bucket 1: base checksum differs (it holds v4 0000000000000062, kept "
            "v4 0000000000000063)");
}

TEST(DeltaDecision, CountsByReason) {
  DeltaSyncStats s;
  CountBucket(s, DeltaReason::kDelta, 100, 1000);
  CountBucket(s, DeltaReason::kNoImage, 1000, 1000);
  CountBucket(s, DeltaReason::kVersion, 1000, 1000);
  CountBucket(s, DeltaReason::kChecksum, 1000, 1000);
  CountBucket(s, DeltaReason::kSize, 1000, 1000);
  CountBucket(s, DeltaReason::kCost, 1000, 1000);
  EXPECT_EQ(s.wire_bytes, 5100);
  EXPECT_EQ(s.full_bytes, 6000);
  EXPECT_EQ(s.buckets_delta, 1);
  EXPECT_EQ(s.buckets_full, 5);
  EXPECT_EQ(s.fallbacks(), 3);
  EXPECT_EQ(s.full_by_size, 1);
  EXPECT_EQ(s.full_by_cost, 1);
}

TEST(DeltaDecision, AutoPaysOnlyOnSlowLinksAtLowDensity) {
  const DeltaLink fast{25, 3.5, 5}, slow{0.1, 3.5, 5};
  const uint64_t n = 1 << 20;
  EXPECT_FALSE(DeltaPays(fast, n, 2, n / 100).value());
  EXPECT_TRUE(DeltaPays(slow, n, 2, n / 100).value());
  EXPECT_TRUE(DeltaPays(slow, n, 2, n / 2).value());          // bitmap: 56% of the bytes
  EXPECT_FALSE(DeltaPays(slow, n, 2, n * 95 / 100).value());  // no form is smaller
}

TEST(DeltaDecision, AutoRunsTheDeltaStepsOnlyWhereSomeDeltaCanPay) {
  // The defaults: the path's passes (7 GB/s encode, 4.5 GB/s advertisement + decode) break even
  // with a header-only delta near 2.7 GB/s.
  const DeltaLink defaults;
  EXPECT_FALSE(DeltaCanPay(defaults).value());
  EXPECT_FALSE(DeltaCanPay(DeltaLink{2.8, 7, 4.5}).value());
  EXPECT_TRUE(DeltaCanPay(DeltaLink{2.6, 7, 4.5}).value());
  EXPECT_TRUE(DeltaCanPay(DeltaLink{25, 100, 100}).value());  // a path of 50 GB/s
  EXPECT_FALSE(DeltaCanPay(DeltaLink{0, 7, 4.5}).ok());       // a bad knob is an error
  // Both ends must have resolved alike: the ready value says which way the receiver ran.
  EXPECT_TRUE(DeltaAgreement(true, "D1 0:3.00000000000000ab", 0, 2).ok());
  EXPECT_TRUE(DeltaAgreement(false, "1", 0, 2).ok());
  Status s = DeltaAgreement(false, "D1 0:3.00000000000000ab", 0, 2);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("sync rank 2 with its delta steps"));
  EXPECT_THAT(s.message(), HasSubstr("SHARDSYNC_DELTA_LINK_MBPS"));
  EXPECT_THAT(DeltaAgreement(true, "1", 1, 3).message(), HasSubstr("sync rank 3 as encoding full"));
}

// Device pairs price deltas at the device steps' speeds over their own link: at the defaults a
// delta can pay across nodes (nccl, 25 GB/s) and not over cuda_ipc (NVLink, 450 GB/s, faster than
// the device steps' 200 GB/s together), as measured (docs/delta.md "Device pairs").
TEST(DeltaDecision, DevicePairsPriceAtTheDeviceSpeedsOverTheirOwnLink) {
  for (const char* knob :
       {"SHARDSYNC_DELTA_LINK_MBPS", "SHARDSYNC_DELTA_IPC_LINK_MBPS",
        "SHARDSYNC_DELTA_DEVICE_ENCODE_MBPS", "SHARDSYNC_DELTA_DEVICE_DECODE_MBPS"}) {
    if (std::getenv(knob) != nullptr) GTEST_SKIP() << knob << " is set";
  }
  const DeltaLink nccl = DevicePairDeltaLink("nccl").value();
  const DeltaLink ipc = DevicePairDeltaLink("cuda_ipc").value();
  EXPECT_DOUBLE_EQ(nccl.link_gbps, 25);
  EXPECT_DOUBLE_EQ(ipc.link_gbps, 450);
  EXPECT_DOUBLE_EQ(nccl.encode_gbps, ipc.encode_gbps);
  EXPECT_GT(nccl.encode_gbps, DeltaLinkFromKnobs().value().encode_gbps * 10);
  EXPECT_TRUE(DeltaCanPay(nccl).value());
  EXPECT_FALSE(DeltaCanPay(ipc).value());
  const uint64_t n = uint64_t{256} << 20;  // a 512 MiB bf16 bucket
  EXPECT_TRUE(DeltaPays(nccl, n, 2, n / 100).value());
  EXPECT_TRUE(DeltaPays(nccl, n, 2, n / 10).value());
  EXPECT_FALSE(DeltaPays(nccl, n, 2, n * 95 / 100).value());  // no form is smaller
  EXPECT_FALSE(DeltaPays(ipc, n, 2, n / 100).value());
  // The knobs move each link alone.
  ASSERT_EQ(setenv("SHARDSYNC_DELTA_IPC_LINK_MBPS", "50000", 1), 0);
  const DeltaLink slow_ipc = DevicePairDeltaLink("cuda_ipc").value();
  const DeltaLink same_nccl = DevicePairDeltaLink("nccl").value();
  unsetenv("SHARDSYNC_DELTA_IPC_LINK_MBPS");
  EXPECT_DOUBLE_EQ(slow_ipc.link_gbps, 50);
  EXPECT_TRUE(DeltaCanPay(slow_ipc).value());
  EXPECT_DOUBLE_EQ(same_nccl.link_gbps, 25);
  ASSERT_EQ(setenv("SHARDSYNC_DELTA_DEVICE_DECODE_MBPS", "0", 1), 0);
  const Result<DeltaLink> bad = DevicePairDeltaLink("nccl");
  unsetenv("SHARDSYNC_DELTA_DEVICE_DECODE_MBPS");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("SHARDSYNC_DELTA_DEVICE_DECODE_MBPS"));
}

TEST(DeltaControlCheck, RefusesUnknownFormsAndPayloadsThatDoNotFit) {
  Control d;
  d.form = static_cast<uint32_t>(DeltaKind::kIndex);
  d.reason = static_cast<uint32_t>(DeltaReason::kDelta);
  d.payload = 100;
  EXPECT_TRUE(CheckDeltaControl(d, "b", 1000).ok());
  d.payload = 1000;  // a delta as long as the bucket is never sent
  EXPECT_FALSE(CheckDeltaControl(d, "b", 1000).ok());
  d.payload = 10;  // shorter than its header
  EXPECT_FALSE(CheckDeltaControl(d, "b", 1000).ok());
  d.form = static_cast<uint32_t>(DeltaKind::kFull);
  d.reason = static_cast<uint32_t>(DeltaReason::kChecksum);
  d.payload = 1000;
  EXPECT_TRUE(CheckDeltaControl(d, "b", 1000).ok());
  d.payload = 999;
  EXPECT_THAT(CheckDeltaControl(d, "b", 1000).message(), HasSubstr("announces 999 full bytes"));
  d.payload = 1000;
  d.reason = static_cast<uint32_t>(DeltaReason::kDelta);  // whole, yet "delta"
  EXPECT_THAT(CheckDeltaControl(d, "b", 1000).message(), HasSubstr("malformed"));
  d.form = 7;
  EXPECT_THAT(CheckDeltaControl(d, "b", 1000).message(), HasSubstr("malformed"));
}

TEST(DeltaVerdict, TheDeltaFiguresRoundTripAndFullVerdictsStayAsTheyWere) {
  RankSyncStats s;
  s.rank = 2;
  s.ok = true;
  s.send_bytes = 4096;
  const std::string plain = EncodeVerdict(s);
  EXPECT_EQ(plain.find(" D:"), std::string::npos);
  s.delta.wire_bytes = 1234;
  s.delta.full_bytes = 40960;
  s.delta.changed = 17;
  s.delta.elements = 20480;
  s.delta.buckets_delta = 3;
  s.delta.buckets_full = 2;
  s.delta.fallback_no_image = 1;
  s.delta.fallback_version = 0;
  s.delta.fallback_checksum = 1;
  s.delta.full_by_size = 0;
  s.delta.full_by_cost = 0;
  s.delta.full_by_auto = 7;
  s.delta.encode_seconds = 0.00123456789;
  s.delta.decode_seconds = 2.5e-7;
  s.error = "x|y";
  auto d = DecodeVerdict(EncodeVerdict(s), 2);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->error, "x|y");
  EXPECT_EQ(d->delta.wire_bytes, 1234);
  EXPECT_EQ(d->delta.full_bytes, 40960);
  EXPECT_EQ(d->delta.changed, 17);
  EXPECT_EQ(d->delta.elements, 20480);
  EXPECT_EQ(d->delta.buckets_delta, 3);
  EXPECT_EQ(d->delta.buckets_full, 2);
  EXPECT_EQ(d->delta.fallback_no_image, 1);
  EXPECT_EQ(d->delta.fallback_checksum, 1);
  EXPECT_EQ(d->delta.full_by_auto, 7);
  EXPECT_EQ(d->delta.encode_seconds, 0.00123456789);
  EXPECT_EQ(d->delta.decode_seconds, 2.5e-7);
  std::string bad = EncodeVerdict(s);
  bad.replace(bad.find(" D:") + 3, 4, "abcd");
  EXPECT_FALSE(DecodeVerdict(bad, 2).ok());
  std::string short_field = EncodeVerdict(s);
  short_field.erase(short_field.find(" D:") + 3,
                    short_field.find(',') - short_field.find(" D:") - 2);
  EXPECT_FALSE(DecodeVerdict(short_field, 2).ok());
}

}  // namespace
}  // namespace shardsync::sync_internal
