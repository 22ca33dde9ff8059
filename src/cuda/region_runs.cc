// Region -> CopyRun decomposition (pure host code, built with or without CUDA).
#include <cstdint>
#include <vector>

#include "shardsync/gpu.h"

namespace shardsync::gpu {

void AppendRegionRuns(const Region& r, const Shape& shape, const void* in, int in_size, void* out,
                      int out_size, int wire_size, int32_t bucket, int64_t wire_offset,
                      std::vector<CopyRun>* runs) {
  if (r.numel() == 0) return;
  const auto* in_b = static_cast<const unsigned char*>(in);
  auto* out_b = static_cast<unsigned char*>(out);
  int64_t packed = 0;  // elements emitted so far (output and wire are contiguous)
  CopyRun cur;
  bool open = false;
  int64_t cur_first = 0;  // tensor element offset of cur's first run
  ForEachRun(r, shape, [&](int64_t off, int64_t len) {
    if (open && len == cur.row_elems &&
        (cur.rows == 1 ? off - cur_first >= len : off - cur_first == cur.rows * cur.in_stride)) {
      if (cur.rows == 1) cur.in_stride = off - cur_first;
      ++cur.rows;
      packed += len;
      return;
    }
    if (open) runs->push_back(cur);
    cur = CopyRun{};
    cur.in = in_b + off * in_size;
    cur.out = out_b ? out_b + packed * out_size : nullptr;
    cur.row_elems = len;
    cur.rows = 1;
    cur.in_stride = len;
    cur.out_stride = len;
    cur.bucket = bucket;
    cur.wire_offset = wire_offset + packed * wire_size;
    cur_first = off;
    open = true;
    packed += len;
  });
  if (open) runs->push_back(cur);
}

void AppendCoRuns(const Region& src, const Shape& src_shape, const void* in, int in_size,
                  const Region& dst, const Shape& dst_shape, void* out, int out_size, int wire_size,
                  int32_t bucket, int64_t wire_offset, std::vector<CopyRun>* runs) {
  std::vector<std::pair<int64_t, int64_t>> sr, dr;  // (element offset, length) runs
  ForEachRun(src, src_shape, [&](int64_t off, int64_t len) { sr.emplace_back(off, len); });
  ForEachRun(dst, dst_shape, [&](int64_t off, int64_t len) { dr.emplace_back(off, len); });
  const auto* in_b = static_cast<const unsigned char*>(in);
  auto* out_b = static_cast<unsigned char*>(out);
  size_t i = 0, j = 0;
  int64_t ip = 0, jp = 0;  // positions inside sr[i] / dr[j]
  int64_t done = 0;        // elements emitted (wire order)
  CopyRun cur;
  bool open = false;
  int64_t first_in = 0, first_out = 0;  // element offsets of cur's first row
  while (i < sr.size() && j < dr.size()) {
    const int64_t n = std::min(sr[i].second - ip, dr[j].second - jp);
    const int64_t so = sr[i].first + ip, doff = dr[j].first + jp;
    const bool extends = open && n == cur.row_elems &&
                         (cur.rows == 1 ? so - first_in >= n && doff - first_out >= n
                                        : so - first_in == cur.rows * cur.in_stride &&
                                              doff - first_out == cur.rows * cur.out_stride);
    if (extends) {
      if (cur.rows == 1) {
        cur.in_stride = so - first_in;
        cur.out_stride = doff - first_out;
      }
      ++cur.rows;
    } else {
      if (open) runs->push_back(cur);
      cur = CopyRun{};
      cur.in = in_b + so * in_size;
      cur.out = out_b + doff * out_size;
      cur.row_elems = n;
      cur.in_stride = n;
      cur.out_stride = n;
      cur.bucket = bucket;
      cur.wire_offset = wire_offset + done * wire_size;
      first_in = so;
      first_out = doff;
      open = true;
    }
    done += n;
    ip += n;
    jp += n;
    if (ip == sr[i].second) ++i, ip = 0;
    if (jp == dr[j].second) ++j, jp = 0;
  }
  if (open) runs->push_back(cur);
}

}  // namespace shardsync::gpu
