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

}  // namespace shardsync::gpu
