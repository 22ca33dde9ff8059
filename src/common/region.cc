#include "shardsync/region.h"

#include <algorithm>
#include <cassert>

namespace shardsync {

Region Region::Full(const Shape& shape) {
  assert(shape.size() <= kMaxDims);
  Region r;
  r.ndim = static_cast<int>(shape.size());
  for (int i = 0; i < r.ndim; ++i) r.extent[i] = shape[i];
  return r;
}

Region Region::Make(const std::vector<int64_t>& offset, const std::vector<int64_t>& extent) {
  assert(offset.size() == extent.size() && offset.size() <= kMaxDims);
  Region r;
  r.ndim = static_cast<int>(offset.size());
  for (int i = 0; i < r.ndim; ++i) {
    r.offset[i] = offset[i];
    r.extent[i] = extent[i];
  }
  return r;
}

int64_t Region::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= extent[i];
  return n;
}

std::string Region::ToString() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(offset[i]) + ":" + std::to_string(offset[i] + extent[i]);
  }
  return s + "]";
}

bool operator<(const Region& a, const Region& b) {
  if (a.ndim != b.ndim) return a.ndim < b.ndim;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.offset[i] != b.offset[i]) return a.offset[i] < b.offset[i];
  }
  for (int i = 0; i < a.ndim; ++i) {
    if (a.extent[i] != b.extent[i]) return a.extent[i] < b.extent[i];
  }
  return false;
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string ShapeToString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Region Intersect(const Region& a, const Region& b) {
  assert(a.ndim == b.ndim);
  Region r;
  r.ndim = a.ndim;
  for (int i = 0; i < a.ndim; ++i) {
    const int64_t lo = std::max(a.offset[i], b.offset[i]);
    const int64_t hi = std::min(a.offset[i] + a.extent[i], b.offset[i] + b.extent[i]);
    r.offset[i] = lo;
    r.extent[i] = hi > lo ? hi - lo : 0;
  }
  return r;
}

bool RegionInside(const Region& r, const Shape& shape) {
  if (r.ndim != static_cast<int>(shape.size())) return false;
  for (int i = 0; i < r.ndim; ++i) {
    if (r.offset[i] < 0 || r.extent[i] < 0 || r.offset[i] + r.extent[i] > shape[i]) return false;
  }
  return true;
}

bool RegionContains(const Region& outer, const Region& inner) {
  if (outer.ndim != inner.ndim) return false;
  for (int i = 0; i < outer.ndim; ++i) {
    if (inner.offset[i] < outer.offset[i] ||
        inner.offset[i] + inner.extent[i] > outer.offset[i] + outer.extent[i])
      return false;
  }
  return true;
}

bool RegionIsContiguous(const Region& r, const Shape& shape) {
  int i = 0;
  while (i < r.ndim && r.extent[i] == 1) ++i;
  for (int j = i + 1; j < r.ndim; ++j) {
    if (r.offset[j] != 0 || r.extent[j] != shape[j]) return false;
  }
  return true;
}

int64_t RegionStartElement(const Region& r, const Shape& shape) {
  int64_t off = 0;
  for (int i = 0; i < r.ndim; ++i) off = off * shape[i] + r.offset[i];
  return off;
}

}  // namespace shardsync
