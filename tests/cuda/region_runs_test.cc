// AppendRegionRuns is host code (built with or without CUDA): its 2-d runs must expand to exactly
// the row-major runs of ForEachRun, packed contiguously in wire order. Runs everywhere (no GPU).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "shardsync/gpu.h"
#include "shardsync/region.h"

namespace shardsync::gpu {
namespace {

struct Elem {
  int64_t in, out, wire;
};

// Every element (tensor index, output index, wire byte offset) the runs describe, in order.
std::vector<Elem> Expand(const std::vector<CopyRun>& runs, const unsigned char* in_base,
                         int in_size, const unsigned char* out_base, int out_size, int wire_size) {
  std::vector<Elem> v;
  for (const CopyRun& r : runs) {
    const int64_t in0 = (static_cast<const unsigned char*>(r.in) - in_base) / in_size;
    const int64_t out0 = (static_cast<unsigned char*>(r.out) - out_base) / out_size;
    int64_t k = 0;
    for (int64_t row = 0; row < r.rows; ++row) {
      for (int64_t c = 0; c < r.row_elems; ++c, ++k) {
        v.push_back({in0 + row * r.in_stride + c, out0 + row * r.out_stride + c,
                     r.wire_offset + k * wire_size});
      }
    }
  }
  return v;
}

void Check(const Region& reg, const Shape& shape, int in_size, int out_size, int wire_size,
           int64_t wire_offset) {
  std::vector<unsigned char> in(8), out(8);
  std::vector<CopyRun> runs;
  AppendRegionRuns(reg, shape, in.data(), in_size, out.data(), out_size, wire_size, 3, wire_offset,
                   &runs);
  std::vector<Elem> want;
  int64_t k = 0;
  ForEachRun(reg, shape, [&](int64_t off, int64_t len) {
    for (int64_t i = 0; i < len; ++i, ++k)
      want.push_back({off + i, k, wire_offset + k * wire_size});
  });
  const auto got = Expand(runs, in.data(), in_size, out.data(), out_size, wire_size);
  ASSERT_EQ(got.size(), want.size()) << reg.ToString();
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].in, want[i].in) << reg.ToString() << " element " << i;
    ASSERT_EQ(got[i].out, want[i].out) << reg.ToString() << " element " << i;
    ASSERT_EQ(got[i].wire, want[i].wire) << reg.ToString() << " element " << i;
  }
  for (const CopyRun& r : runs) EXPECT_EQ(r.bucket, 3);
}

TEST(RegionRuns, ExpandToTheRowMajorRunsOfTheRegion) {
  Check(Region::Make({0, 0}, {37, 53}), {37, 53}, 4, 2, 2, 0);       // whole tensor: one run
  Check(Region::Make({3, 0}, {5, 53}), {37, 53}, 4, 2, 2, 6);        // row slice: one run
  Check(Region::Make({2, 7}, {9, 13}), {37, 53}, 2, 2, 2, 10);       // column slice: one 2-d run
  Check(Region::Make({1, 2, 3}, {3, 4, 5}), {4, 6, 8}, 4, 4, 4, 0);  // 3-d box
  Check(Region::Make({0, 1, 0, 2}, {2, 2, 3, 1}), {2, 3, 3, 4}, 2, 2, 2, 2);
  Check(Region::Make({5}, {1}), {9}, 1, 1, 1, 7);
}

TEST(RegionRuns, MergesEqualStridesIntoOneRunAndEmptyAddsNothing) {
  std::vector<unsigned char> in(8), out(8);
  std::vector<CopyRun> runs;
  AppendRegionRuns(Region::Make({2, 7}, {9, 13}), {37, 53}, in.data(), 2, out.data(), 2, 2, 0, 0,
                   &runs);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].rows, 9);
  EXPECT_EQ(runs[0].row_elems, 13);
  EXPECT_EQ(runs[0].in_stride, 53);
  EXPECT_EQ(runs[0].out_stride, 13);
  runs.clear();
  AppendRegionRuns(Region::Make({2, 7}, {0, 13}), {37, 53}, in.data(), 2, out.data(), 2, 2, 0, 0,
                   &runs);
  EXPECT_TRUE(runs.empty());
}

}  // namespace
}  // namespace shardsync::gpu
