#include <gtest/gtest.h>

#include "shardsync/dtype.h"
#include "shardsync/region.h"
#include "shardsync/status.h"

namespace shardsync {
namespace {

Result<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("x: must be even, got " + std::to_string(x));
  return x / 2;
}
Result<int> Quarter(int x) {
  SS_ASSIGN_OR_RETURN(int h, Half(x));
  SS_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(Status, ResultAndMacros) {
  EXPECT_EQ(*Quarter(8), 2);
  auto r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().ToString(), "invalid_argument: x: must be even, got 3");
}

TEST(DType, ParseAndBf16RoundTrip) {
  EXPECT_EQ(*ParseDType("torch.bfloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("F32"), DType::kF32);
  auto bad = ParseDType("float13", "torch_dtype");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("torch_dtype"), std::string::npos);
  EXPECT_EQ(BF16ToF32(F32ToBF16(1.5f)), 1.5f);
  EXPECT_EQ(F32ToBF16(1.0f + 1.0f / 256), F32ToBF16(1.0f));  // ties to even
  EXPECT_EQ(F16ToF32(F32ToF16(-2.25f)), -2.25f);
}

TEST(Region, RunsIntersectContiguity) {
  Shape shape{4, 6};
  Region r = Region::Make({1, 2}, {2, 3});
  std::vector<std::pair<int64_t, int64_t>> runs;
  ForEachRun(r, shape, [&](int64_t off, int64_t len) { runs.emplace_back(off, len); });
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0], std::make_pair(int64_t{8}, int64_t{3}));
  EXPECT_EQ(runs[1], std::make_pair(int64_t{14}, int64_t{3}));
  Region rows = Region::Make({1, 0}, {2, 6});
  runs.clear();
  ForEachRun(rows, shape, [&](int64_t off, int64_t len) { runs.emplace_back(off, len); });
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0], std::make_pair(int64_t{6}, int64_t{12}));
  EXPECT_TRUE(RegionIsContiguous(rows, shape));
  EXPECT_FALSE(RegionIsContiguous(r, shape));
  EXPECT_EQ(Intersect(r, rows), Region::Make({1, 2}, {2, 3}));
  EXPECT_TRUE(Intersect(Region::Make({0, 0}, {1, 6}), rows).empty());
  EXPECT_TRUE(RegionInside(r, shape));
  EXPECT_FALSE(RegionInside(Region::Make({3, 0}, {2, 1}), shape));
}

}  // namespace
}  // namespace shardsync

#include "shardsync/synthetic.h"

namespace shardsync {
namespace {
TEST(Synthetic, RegionFillMatchesElementwiseAndIsStable) {
  Shape shape{5, 7};
  std::vector<float> full(35), part(6);
  FillSyntheticRegion(7, "model.layers.0.mlp.down_proj.weight", shape, Region::Full(shape),
                      full.data());
  Region r = Region::Make({2, 3}, {2, 3});
  FillSyntheticRegion(7, "model.layers.0.mlp.down_proj.weight", shape, r, part.data());
  EXPECT_EQ(part[0], full[2 * 7 + 3]);
  EXPECT_EQ(part[5], full[3 * 7 + 5]);
  std::vector<float> other(35);
  FillSyntheticRegion(8, "model.layers.0.mlp.down_proj.weight", shape, Region::Full(shape),
                      other.data());
  EXPECT_NE(other[0], full[0]);
  std::vector<float> norm(7);
  FillSyntheticRegion(7, "model.norm.weight", {7}, Region::Full({7}), norm.data());
  for (float v : norm) EXPECT_NEAR(v, 1.0f, 0.1001f);
}
}  // namespace
}  // namespace shardsync
