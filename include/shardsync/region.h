// Region: an N-d box (offset, extent) inside a row-major tensor. Everything the planner does is
// region algebra; nothing iterates over elements or rows.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace shardsync {

// ceil(a / b) for a >= 0, b > 0: block and chunk counts.
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline constexpr int kMaxDims = 4;

using Shape = std::vector<int64_t>;

struct Region {
  int ndim = 0;
  std::array<int64_t, kMaxDims> offset{};
  std::array<int64_t, kMaxDims> extent{};

  // The whole of a tensor of this shape.
  static Region Full(const Shape& shape);
  // A region from explicit offset and extent vectors (same length, <= kMaxDims).
  static Region Make(const std::vector<int64_t>& offset, const std::vector<int64_t>& extent);

  int64_t numel() const;
  bool empty() const { return numel() == 0; }
  std::vector<int64_t> offsets() const { return {offset.begin(), offset.begin() + ndim}; }
  std::vector<int64_t> extents() const { return {extent.begin(), extent.begin() + ndim}; }
  // "[0:128, 256:512]"
  std::string ToString() const;

  friend bool operator==(const Region& a, const Region& b) {
    if (a.ndim != b.ndim) return false;
    for (int i = 0; i < a.ndim; ++i) {
      if (a.offset[i] != b.offset[i] || a.extent[i] != b.extent[i]) return false;
    }
    return true;
  }
  friend bool operator<(const Region& a, const Region& b);
};

int64_t NumElements(const Shape& shape);
std::string ShapeToString(const Shape& shape);

// Intersection of two regions of the same rank (empty region when disjoint; ndim kept).
Region Intersect(const Region& a, const Region& b);
// True if `r` lies inside a tensor of `shape` (same rank, non-negative, in bounds).
bool RegionInside(const Region& r, const Shape& shape);
// True if `inner` lies inside `outer` (same rank).
bool RegionContains(const Region& outer, const Region& inner);

// A region is one contiguous byte run of a row-major tensor of `shape` iff, after the first
// dimension whose extent exceeds 1, every dimension spans the full shape.
bool RegionIsContiguous(const Region& r, const Shape& shape);
// Element offset of the region's first element in a row-major tensor of `shape`.
int64_t RegionStartElement(const Region& r, const Shape& shape);

// Calls fn(element_offset_in_tensor, run_length_in_elements) for each maximal contiguous run of
// `r` inside a row-major tensor of `shape`, in row-major order of the region.
template <typename Fn>
void ForEachRun(const Region& r, const Shape& shape, Fn&& fn);

// ---- implementation of the template ----
template <typename Fn>
void ForEachRun(const Region& r, const Shape& shape, Fn&& fn) {
  const int n = r.ndim;
  if (n == 0) {
    fn(int64_t{0}, int64_t{1});
    return;
  }
  if (r.numel() == 0) return;
  std::array<int64_t, kMaxDims> stride{};
  stride[n - 1] = 1;
  for (int i = n - 2; i >= 0; --i) stride[i] = stride[i + 1] * shape[i + 1];
  // Merge trailing dimensions that are taken whole into one run.
  int inner = n - 1;
  int64_t run = r.extent[n - 1];
  while (inner > 0 && r.extent[inner] == shape[inner] && r.offset[inner] == 0) {
    --inner;
    run *= r.extent[inner];
  }
  // Dimensions [0, inner) are iterated; dimension `inner` and below form one run.
  std::array<int64_t, kMaxDims> idx{};
  while (true) {
    int64_t off = 0;
    for (int i = 0; i < inner; ++i) off += (r.offset[i] + idx[i]) * stride[i];
    off += r.offset[inner] * stride[inner];
    fn(off, run);
    int d = inner - 1;
    while (d >= 0) {
      if (++idx[d] < r.extent[d]) break;
      idx[d] = 0;
      --d;
    }
    if (d < 0) return;
  }
}

}  // namespace shardsync
