// Region geometry shared by every trainer layout's planner: box translation between source and
// destination, contiguous destination runs of an item, cuts at unit boundaries, op splitting under
// the bucket cap, message finishing.
#include <algorithm>

#include "plan/planner.h"

namespace shardsync::plan_internal {
namespace {

// The r-th contiguous run box of an item (row-major over dims [0, run_dim)).
Region RunBox(const Item& it, int64_t r) {
  Region x = it.dst;
  for (int i = it.run_dim - 1; i >= 0; --i) {
    x.offset[i] = it.dst.offset[i] + r % it.dst.extent[i];
    x.extent[i] = 1;
    r /= it.dst.extent[i];
  }
  return x;
}

// Run box restricted to the byte range [z0, z1) of the run (unit aligned).
Region PartialRun(const Item& it, Region x, int64_t z0, int64_t z1) {
  if (z0 == 0 && z1 == it.run_bytes) return x;
  const int u = it.unit_dim;  // >= 0: a partial run exists only when units are finer than a run
  x.offset[u] += z0 / it.unit_bytes;
  x.extent[u] = (z1 - z0) / it.unit_bytes;
  return x;
}

}  // namespace

Region MapToSrc(const Region& src, const Region& dst, const Region& x) {
  Region y = src;
  const int off = dst.ndim - src.ndim;
  for (int i = 0; i < src.ndim; ++i) {
    const int j = i + off;
    if (j < 0) continue;
    y.offset[i] = src.offset[i] + (x.offset[j] - dst.offset[j]);
    y.extent[i] = x.extent[j];
  }
  return y;
}

Region MapToDst(const Region& src, const Region& dst, const Region& x) {
  Region y = dst;
  const int off = dst.ndim - src.ndim;
  for (int i = 0; i < src.ndim; ++i) {
    const int j = i + off;
    if (j < 0) continue;
    y.offset[j] = dst.offset[j] + (x.offset[i] - src.offset[i]);
    y.extent[j] = x.extent[i];
  }
  return y;
}

bool Aligned(const Region& src, const Region& dst) {
  const int off = dst.ndim - src.ndim;
  for (int i = 0; i < src.ndim; ++i) {
    const int j = i + off;
    if (j < 0) {
      if (src.extent[i] != 1) return false;
    } else if (src.extent[i] != dst.extent[j]) {
      return false;
    }
  }
  for (int j = 0; j < off; ++j) {
    if (dst.extent[j] != 1) return false;
  }
  return true;
}

void SetItemGeometry(Item* it, const Shape& shape, int64_t wire) {
  const int n = it->dst.ndim;
  if (n == 0) {
    it->run_dim = 0;
    it->runs = 1;
    it->run_bytes = wire;
    it->unit_dim = -1;
    it->unit_bytes = wire;
    return;
  }
  int inner = n - 1;
  while (inner > 0 && it->dst.extent[inner] == shape[inner] && it->dst.offset[inner] == 0) --inner;
  it->run_dim = inner;
  it->runs = 1;
  for (int i = 0; i < inner; ++i) it->runs *= it->dst.extent[i];
  it->run_bytes = it->dst.numel() / it->runs * wire;
  it->unit_dim = -1;
  for (int i = inner; i < n; ++i) {
    if (it->dst.extent[i] > 1) {
      it->unit_dim = i;
      break;
    }
  }
  it->unit_bytes = wire;
  if (it->unit_dim >= 0) {
    for (int i = it->unit_dim + 1; i < n; ++i) it->unit_bytes *= it->dst.extent[i];
  }
}

int64_t ItemOpCount(const Item& it, int64_t wire, int64_t cap) {
  return it.runs * SplitCount(RunBox(it, 0), wire, cap);
}

int64_t ItemRangeOpCount(const Item& it, int64_t y0, int64_t y1, int64_t wire, int64_t cap) {
  if (y1 <= y0) return 0;
  const int64_t rb = it.run_bytes;
  const Region run0 = RunBox(it, 0);
  const int64_t r0 = y0 / rb, r1 = CeilDiv(y1, rb);  // runs [r0, r1) touched
  if (r1 - r0 == 1) {
    return SplitCount(PartialRun(it, run0, y0 - r0 * rb, y1 - r0 * rb), wire, cap);
  }
  const int64_t full = SplitCount(run0, wire, cap);
  const int64_t head = SplitCount(PartialRun(it, run0, y0 - r0 * rb, rb), wire, cap);
  const int64_t tail = SplitCount(PartialRun(it, run0, 0, y1 - (r1 - 1) * rb), wire, cap);
  return head + tail + (r1 - r0 - 2) * full;
}

void ForItemRangeOps(const Item& it, int64_t y0, int64_t y1, int64_t wire, int64_t cap,
                     const std::function<void(const Region& src, const Region& dst)>& fn) {
  if (y1 <= y0) return;
  const int64_t rb = it.run_bytes;
  const int64_t r0 = y0 / rb, r1 = CeilDiv(y1, rb);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t z0 = std::max<int64_t>(y0 - r * rb, 0), z1 = std::min(y1 - r * rb, rb);
    const Region x = PartialRun(it, RunBox(it, r), z0, z1);
    SplitBox(x, wire, cap, [&](const Region& sub) { fn(MapToSrc(it.src, it.dst, sub), sub); });
  }
}

int64_t RoundUpToUnit(const Item& it, int64_t y) {
  const int64_t r = y / it.run_bytes, z = y - r * it.run_bytes;
  return r * it.run_bytes + std::min(it.run_bytes, CeilDiv(z, it.unit_bytes) * it.unit_bytes);
}

int64_t SplitCount(const Region& box, int64_t elem_bytes, int64_t cap) {
  if (box.numel() * elem_bytes <= cap) return 1;
  int j = 0;
  while (j < box.ndim && box.extent[j] <= 1) ++j;
  if (j >= box.ndim) return 1;
  int64_t q = elem_bytes;
  for (int i = j + 1; i < box.ndim; ++i) q *= box.extent[i];
  if (q <= cap) return CeilDiv(box.extent[j], cap / q);
  Region sub = box;
  sub.extent[j] = 1;
  return box.extent[j] * SplitCount(sub, elem_bytes, cap);
}

void SplitBox(const Region& box, int64_t elem_bytes, int64_t cap,
              const std::function<void(const Region&)>& fn) {
  if (box.numel() * elem_bytes <= cap) return fn(box);
  int j = 0;
  while (j < box.ndim && box.extent[j] <= 1) ++j;
  if (j >= box.ndim) return fn(box);
  int64_t q = elem_bytes;
  for (int i = j + 1; i < box.ndim; ++i) q *= box.extent[i];
  const int64_t k = q <= cap ? cap / q : 1;
  for (int64_t t = 0; t < box.extent[j]; t += k) {
    Region sub = box;
    sub.offset[j] = box.offset[j] + t;
    sub.extent[j] = std::min(k, box.extent[j] - t);
    if (q <= cap) {
      fn(sub);
    } else {
      SplitBox(sub, elem_bytes, cap, fn);
    }
  }
}

}  // namespace shardsync::plan_internal
