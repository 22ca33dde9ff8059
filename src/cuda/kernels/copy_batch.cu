// CopyBatch (gpu.h): a batch's descriptors validated, cut into chunks and uploaded once, then
// launched every sync (BatchKernel, and the lean kernel first for landed casts; kernels.cuh).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/kernels/fp8_kernels.h"
#include "cuda/kernels/kernels.cuh"

#include "shardsync/settings.h"  // SHARDSYNC_CHUNK_KIB

namespace shardsync::gpu {

using internal::CudaStatus;

namespace kernels {
namespace {

// The cast a batch runs (0 copy, 1 f32 -> bf16 pack, 2 bf16 -> f32 unpack), or why none fits.
Result<int> CastOf(const BatchSpec& spec, int in_size, int out_size) {
  int cast = 0;
  if (spec.mode != BatchMode::kVerify && spec.in_dtype != spec.out_dtype) {
    if (spec.mode == BatchMode::kPack && spec.in_dtype == DType::kF32 &&
        spec.out_dtype == DType::kBF16) {
      cast = 1;
    } else if (spec.mode == BatchMode::kUnpack && spec.in_dtype == DType::kBF16 &&
               spec.out_dtype == DType::kF32) {
      cast = 2;
    } else {
      return InvalidArgumentError(std::string("batch: unsupported cast ") +
                                  std::string(DTypeName(spec.in_dtype)) + " -> " +
                                  std::string(DTypeName(spec.out_dtype)) +
                                  " (pack f32->bf16, unpack bf16->f32, or equal dtypes)");
    }
  } else if (spec.mode != BatchMode::kVerify && in_size != out_size) {
    return InvalidArgumentError("batch: element sizes differ");
  }
  return cast;
}

// The runs as device descriptors: normalized, sorted by (bucket, wire offset), each bucket
// validated to be tiled exactly.
Status BuildDescs(const BatchSpec& spec, int wire_size, std::vector<Desc>* out) {
  const int nb = static_cast<int>(spec.bucket_bytes.size());
  std::vector<Desc>& descs = *out;
  std::vector<int> order(spec.runs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  for (size_t i = 0; i < spec.runs.size(); ++i) {
    const CopyRun& r = spec.runs[i];
    const std::string who = "batch run " + std::to_string(i);
    if (r.bucket < 0 || r.bucket >= nb) {
      return OutOfRangeError(who + ": bucket " + std::to_string(r.bucket) + " not in [0, " +
                             std::to_string(nb) + ")");
    }
    if (r.row_elems < 0 || r.rows < 0 ||
        (r.rows > 1 && (r.in_stride < r.row_elems ||
                        (spec.mode != BatchMode::kVerify && r.out_stride < r.row_elems)))) {
      return InvalidArgumentError(who + ": row_elems/rows/strides inconsistent");
    }
    if (r.wire_offset < 0 || r.wire_offset % wire_size != 0) {
      return InvalidArgumentError(who + ": wire_offset " + std::to_string(r.wire_offset) +
                                  " not a multiple of the wire element size");
    }
    if (r.numel() > 0 && (r.in == nullptr || (spec.mode != BatchMode::kVerify && !r.out))) {
      return InvalidArgumentError(who + ": null device pointer");
    }
  }
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    const CopyRun& a = spec.runs[x];
    const CopyRun& b = spec.runs[y];
    return a.bucket != b.bucket ? a.bucket < b.bucket : a.wire_offset < b.wire_offset;
  });
  std::vector<int64_t> cursor(nb, 0);
  for (int idx : order) {
    const CopyRun& r = spec.runs[idx];
    if (r.numel() == 0) continue;
    if (r.wire_offset != cursor[r.bucket]) {
      return InvalidArgumentError(
          "batch run " + std::to_string(idx) + ": bucket " + std::to_string(r.bucket) +
          " wire image not tiled: run starts at byte " + std::to_string(r.wire_offset) +
          ", expected " + std::to_string(cursor[r.bucket]));
    }
    cursor[r.bucket] += r.numel() * wire_size;
    Desc d{};
    d.in = static_cast<const unsigned char*>(r.in);
    d.out = static_cast<unsigned char*>(r.out);
    d.row_elems = r.row_elems;
    d.numel = r.numel();
    d.in_stride = r.rows > 1 ? r.in_stride : r.row_elems;
    d.out_stride = r.rows > 1 ? r.out_stride : r.row_elems;
    const bool in_c = d.in_stride == d.row_elems;
    const bool out_c = spec.mode == BatchMode::kVerify || d.out_stride == d.row_elems;
    if (in_c && out_c) {  // one long row
      d.row_elems = d.numel;
      d.in_stride = d.out_stride = d.numel;
    }
    d.flags = (d.in_stride == d.row_elems ? 1 : 0) | (d.out_stride == d.row_elems ? 2 : 0);
    d.wire_offset = r.wire_offset;
    d.bucket = r.bucket;
    descs.push_back(d);
  }
  for (int b = 0; b < nb; ++b) {
    if (cursor[b] != spec.bucket_bytes[b]) {
      return InvalidArgumentError("batch: bucket " + std::to_string(b) + " runs cover " +
                                  std::to_string(cursor[b]) + " wire bytes, bucket has " +
                                  std::to_string(spec.bucket_bytes[b]));
    }
  }
  return OkStatus();
}

// Wire bytes per chunk: kChunkWireBytes, or SHARDSYNC_CHUNK_KIB (an experiment knob: how many
// pages a launch's blocks touch at once, docs/benchmarks.md), read once.
int64_t ChunkWireBytes() {
  static const int64_t bytes = [] {
    auto kib = ReadIntKnob("SHARDSYNC_CHUNK_KIB");  // 4..1048576 (settings.cc)
    if (!kib.ok()) ReportKnobError(kib.status());
    return kib.ok() && *kib ? **kib << 10 : kChunkWireBytes;
  }();
  return bytes;
}

// Chunks split runs at 8-aligned wire positions, so only run edges make boundary words.
void BuildChunks(const BatchSpec& spec, const std::vector<Desc>& descs, int in_size, int out_size,
                 int wire_size, std::vector<Chunk>* out_chunks, std::vector<Boundary>* out_bounds) {
  std::vector<Chunk>& chunks = *out_chunks;
  std::vector<Boundary>& bounds = *out_bounds;
  const int64_t step = ChunkWireBytes() / wire_size;
  for (size_t k = 0; k < descs.size(); ++k) {
    const Desc& d = descs[k];
    int64_t e = 0;
    const int64_t first_aligned = ((d.wire_offset + 7) / 8 * 8 - d.wire_offset) / wire_size;
    int64_t next = std::min(d.numel, first_aligned + step);
    // Strided runs whose rows are whole 16-byte multiples on every side and start on a wire
    // word: chunks of whole rows, so the kernel's row-wise vector path applies.
    const int64_t row_wire = d.row_elems * wire_size;
    if (d.flags != 3 && d.wire_offset % 8 == 0 && row_wire % 16 == 0 &&
        (d.row_elems * in_size) % 16 == 0 &&
        (spec.mode == BatchMode::kVerify || (d.row_elems * out_size) % 16 == 0) &&
        row_wire <= step * wire_size) {
      const int64_t rows_per = std::max<int64_t>(1, step * wire_size / row_wire);
      next = std::min(d.numel, rows_per * d.row_elems);
      while (e < d.numel) {
        chunks.push_back({static_cast<int32_t>(k), 1, e, next});
        e = next;
        next = std::min(d.numel, next + rows_per * d.row_elems);
      }
    }
    while (e < d.numel) {
      chunks.push_back({static_cast<int32_t>(k), 0, e, next});
      e = next;
      next = std::min(d.numel, next + step);
    }
    const int64_t end = d.wire_offset + d.numel * wire_size;
    for (int64_t edge : {d.wire_offset, end}) {
      if (edge % 8 == 0) continue;
      const int64_t w = edge / 8;
      if (!bounds.empty() && bounds.back().bucket == d.bucket && bounds.back().word == w) continue;
      // first desc overlapping word w: walk back from k while the previous desc reaches it
      int32_t first = static_cast<int32_t>(k);
      while (first > 0 && descs[first - 1].bucket == d.bucket &&
             descs[first - 1].wire_offset + descs[first - 1].numel * wire_size > w * 8) {
        --first;
      }
      bounds.push_back({w, spec.bucket_bytes[d.bucket], d.bucket, first});
    }
  }
}

template <typename T>
struct DevArray {
  T* p = nullptr;
  size_t n = 0;
  ~DevArray() {
    if (p) cudaFree(p);
  }
  Status Upload(const std::vector<T>& v, std::string_view what) {
    n = v.size();
    if (n == 0) return OkStatus();
    SS_CUDA(cudaMalloc(&p, n * sizeof(T)), what);
    SS_RETURN_IF_ERROR(internal::UploadBlocking(p, v.data(), n * sizeof(T), what));
    return OkStatus();
  }
};

// A landed batch's sums and runs (BatchSpec::landed_runs), each run checked on its own.
Status CheckLanded(const BatchSpec& spec, int wire_size) {
  const size_t nb = spec.bucket_bytes.size();
  if (spec.mode != BatchMode::kPack) {
    return InvalidArgumentError("batch: landed_runs are only for kPack batches");
  }
  if (spec.landed_sums.size() != nb) {
    return InvalidArgumentError("batch: landed_sums has " +
                                std::to_string(spec.landed_sums.size()) + " entries for " +
                                std::to_string(nb) + " buckets");
  }
  for (size_t b = 0; b < nb; ++b) {
    if (spec.landed_sums[b] == nullptr) {
      return InvalidArgumentError("batch: landed_sums[" + std::to_string(b) + "] is null");
    }
  }
  for (size_t i = 0; i < spec.landed_runs.size(); ++i) {
    const CopyRun& r = spec.landed_runs[i];
    const std::string who = "batch landed run " + std::to_string(i);
    if (r.bucket < 0 || static_cast<size_t>(r.bucket) >= nb) {
      return OutOfRangeError(who + ": bucket " + std::to_string(r.bucket) + " not in [0, " +
                             std::to_string(nb) + ")");
    }
    if (r.row_elems < 0 || r.rows < 0 || (r.rows > 1 && r.in_stride < r.row_elems)) {
      return InvalidArgumentError(who + ": row_elems/rows/in_stride inconsistent");
    }
    if (r.wire_offset < 0 || r.wire_offset % wire_size != 0) {
      return InvalidArgumentError(who + ": wire_offset " + std::to_string(r.wire_offset) +
                                  " not a multiple of the wire element size");
    }
    if (r.numel() > 0 && r.in == nullptr) return InvalidArgumentError(who + ": null pointer");
  }
  return OkStatus();
}

// Landed batches: the receiver's runs become contiguous segments (validated to tile every bucket
// exactly, like the pack runs), and every chunk / boundary word learns where its bytes start.
Status BuildLanded(const BatchSpec& spec, int wire_size, std::vector<Chunk>* chunks,
                   std::vector<Boundary>* bounds, const std::vector<Desc>& descs,
                   std::vector<Seg>* segs) {
  SS_RETURN_IF_ERROR(CheckLanded(spec, wire_size));
  const size_t nb = spec.bucket_bytes.size();
  const auto& runs = spec.landed_runs;
  std::vector<int> order(runs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return runs[x].bucket != runs[y].bucket ? runs[x].bucket < runs[y].bucket
                                            : runs[x].wire_offset < runs[y].wire_offset;
  });
  std::vector<int64_t> cursor(nb, 0);
  std::vector<int32_t> first(nb + 1, 0);
  std::vector<int32_t> bucket_of;
  for (int idx : order) {
    const CopyRun& r = runs[idx];
    if (r.numel() == 0) continue;
    if (r.wire_offset != cursor[r.bucket]) {
      return InvalidArgumentError("batch landed run " + std::to_string(idx) + ": bucket " +
                                  std::to_string(r.bucket) + " not tiled: run starts at byte " +
                                  std::to_string(r.wire_offset) + ", expected " +
                                  std::to_string(cursor[r.bucket]));
    }
    const auto* base = static_cast<const unsigned char*>(r.in);
    const bool contig = r.rows <= 1 || r.in_stride == r.row_elems;
    const int64_t rows = contig ? 1 : r.rows;
    const int64_t row_bytes = (contig ? r.numel() : r.row_elems) * wire_size;
    for (int64_t k = 0; k < rows; ++k) {
      const int64_t lo = r.wire_offset + k * row_bytes;
      segs->push_back({base + k * r.in_stride * wire_size, lo, lo + row_bytes});
      bucket_of.push_back(r.bucket);
    }
    cursor[r.bucket] += r.numel() * wire_size;
  }
  for (size_t b = 0; b < nb; ++b) {
    if (cursor[b] != spec.bucket_bytes[b]) {
      return InvalidArgumentError("batch: bucket " + std::to_string(b) + " landed runs cover " +
                                  std::to_string(cursor[b]) + " wire bytes, bucket has " +
                                  std::to_string(spec.bucket_bytes[b]));
    }
  }
  // first[b] .. first[b+1]: segments of bucket b.
  for (size_t i = 0, b = 0; b <= nb; ++b) {
    while (i < bucket_of.size() && static_cast<size_t>(bucket_of[i]) < b) ++i;
    first[b] = static_cast<int32_t>(i);
  }
  const auto& sg = *segs;
  auto holding = [&](int bucket, int64_t pos) {  // segment of `bucket` holding wire byte pos
    int lo = first[bucket], hi = first[bucket + 1];
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (sg[mid].hi > pos) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  };
  for (Chunk& c : *chunks) {
    const Desc& d = descs[c.desc];
    const int64_t a = d.wire_offset + c.e0 * wire_size, e = d.wire_offset + c.e1 * wire_size;
    c.seg0 = holding(d.bucket, a);
    c.seg1 = holding(d.bucket, e - 1) + 1;
  }
  for (Boundary& bw : *bounds) bw.first_seg = holding(bw.bucket, bw.word * 8);
  return OkStatus();
}

class CopyBatchImpl final : public CopyBatch {
 public:
  ~CopyBatchImpl() override {
    if (sums_) cudaFree(sums_);
    if (ticket_) cudaFree(ticket_);
    if (host_sums_) cudaFreeHost(host_sums_);
  }

  Status Init(const BatchSpec& spec, int device) {
    device_ = device;
    SS_CUDA(cudaSetDevice(device), "batch: cudaSetDevice " + std::to_string(device));
    const int in_size = DTypeSize(spec.in_dtype);
    const int out_size = spec.mode == BatchMode::kVerify ? in_size : DTypeSize(spec.out_dtype);
    SS_ASSIGN_OR_RETURN(const int cast, CastOf(spec, in_size, out_size));
    const int wire_size = spec.mode == BatchMode::kPack ? out_size : in_size;
    const bool landed = !spec.landed_runs.empty();
    SS_ASSIGN_OR_RETURN(kernel_, PickKernel(spec.mode, in_size, cast, landed));
    bucket_bytes_ = spec.bucket_bytes;
    const int nb = static_cast<int>(spec.bucket_bytes.size());
    std::vector<Desc> descs;
    SS_RETURN_IF_ERROR(BuildDescs(spec, wire_size, &descs));
    std::vector<Chunk> chunks;
    std::vector<Boundary> bounds;
    BuildChunks(spec, descs, in_size, out_size, wire_size, &chunks, &bounds);
    if (landed) {
      std::vector<Seg> segs;
      SS_RETURN_IF_ERROR(BuildLanded(spec, wire_size, &chunks, &bounds, descs, &segs));
      lean_kernel_ = PickLean(cast);
      if (lean_kernel_) SS_RETURN_IF_ERROR(SplitLean(descs, segs, in_size, wire_size, &chunks));
      SS_RETURN_IF_ERROR(segs_.Upload(segs, "batch: upload landed segments"));
      std::vector<unsigned long long*> ptrs;
      for (void* q : spec.landed_sums) ptrs.push_back(static_cast<unsigned long long*>(q));
      SS_RETURN_IF_ERROR(landed_.Upload(ptrs, "batch: upload landed sums"));
    }
    num_descs_ = static_cast<int>(descs.size());
    num_chunks_ = chunks.size() + lean_chunks_.n;
    for (const Desc& d : descs) {
      in_bytes_ += d.numel * in_size;
      out_bytes_ += spec.mode == BatchMode::kVerify ? 0 : d.numel * out_size;
      wire_bytes_ += d.numel * wire_size;
    }
    SS_RETURN_IF_ERROR(descs_.Upload(descs, "batch: upload descriptors"));
    SS_RETURN_IF_ERROR(chunks_.Upload(chunks, "batch: upload chunks"));
    SS_RETURN_IF_ERROR(bounds_.Upload(bounds, "batch: upload boundary words"));
    SS_RETURN_IF_ERROR(AllocLaunchState(nb, landed));
    SS_RETURN_IF_ERROR(SizeGrids(device, chunks.size()));
    // BatchKernel runs when it has chunks or boundary words, or alone (a batch of nothing).
    run_main_ = !chunks.empty() || !bounds.empty() || lean_chunks_.n == 0;
    return OkStatus();
  }

  // Device sums and tickets, and the host memory a signaled launch's kernel writes.
  Status AllocLaunchState(int nb, bool landed) {
    // sums, then the lean kernel's chunk ticket: zeroed by a memset before a plain launch and by
    // the kernel itself at the end of a signaled one.
    const size_t words = static_cast<size_t>(std::max(1, nb));
    SS_CUDA(cudaMalloc(&sums_, (words + 1) * sizeof(unsigned long long)), "batch: sums");
    SS_CUDA(cudaMemset(sums_, 0, (words + 1) * sizeof(unsigned long long)), "batch: sums");
    SS_CUDA(cudaMalloc(&ticket_, 2 * sizeof(unsigned int)), "batch: ticket");
    SS_CUDA(cudaMemset(ticket_, 0, 2 * sizeof(unsigned int)), "batch: ticket");
    // [sums | landed sums | flag], mapped.
    SS_CUDA(cudaHostAlloc(&host_sums_, (2 * words + 1) * sizeof(unsigned long long),
                          cudaHostAllocMapped),
            "batch: pinned sums");
    std::memset(host_sums_, 0, (2 * words + 1) * sizeof(unsigned long long));
    unsigned long long* dev_host = nullptr;
    SS_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_host), host_sums_, 0),
            "batch: pinned sums");
    fin_.host_sums = dev_host;
    fin_.host_landed = dev_host + words;
    fin_.flag = dev_host + 2 * words;
    fin_.nb = nb;
    landed_batch_ = landed;
    return OkStatus();
  }

  // Exactly the resident blocks: a second wave would leave the tail of the first idle.
  Status SizeGrids(int device, size_t main_chunks) {
    int sms = 0;
    SS_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "batch: sms");
    int occ = 0;
    SS_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel_, kThreads, 0),
            "batch: occupancy");
    grid_ = static_cast<int>(std::min<size_t>(std::max<size_t>(1, main_chunks),
                                              static_cast<size_t>(sms) * std::max(1, occ)));
    if (lean_chunks_.n > 0) {
      SS_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, lean_kernel_, kThreads, 0),
              "batch: occupancy");
      lean_grid_ = static_cast<int>(
          std::min<size_t>(lean_chunks_.n, static_cast<size_t>(sms) * std::max(1, occ)));
    }
    return OkStatus();
  }

  // The lean kernel takes the chunks of its shape (uploaded here); BatchKernel keeps the rest.
  Status SplitLean(const std::vector<Desc>& descs, const std::vector<Seg>& segs, int in_size,
                   int wire_size, std::vector<Chunk>* chunks) {
    std::vector<LeanChunk> lean;
    std::vector<Chunk> rest;
    for (const Chunk& c : *chunks) {
      auto l = ToLean(c, descs[c.desc], segs[c.seg0], in_size, wire_size);
      if (l) {
        lean.push_back(*l);
      } else {
        rest.push_back(c);
      }
    }
    *chunks = std::move(rest);
    return lean_chunks_.Upload(lean, "batch: upload lean chunks");
  }

  Status Launch(void* stream) override {
    auto s = static_cast<cudaStream_t>(stream);
    const size_t nb = bucket_bytes_.size();
    if (nb == 0) return OkStatus();
    SS_CUDA(cudaSetDevice(device_), "batch launch: cudaSetDevice");
    SS_CUDA(cudaMemsetAsync(sums_, 0, (nb + 1) * sizeof(unsigned long long), s),
            "batch launch: memset");
    sums_dirty_ = true;  // until a signaled launch re-zeroes them
    SS_RETURN_IF_ERROR(LaunchKernels(s, Finish{}));
    SS_CUDA(cudaMemcpyAsync(host_sums_, sums_, nb * sizeof(unsigned long long),
                            cudaMemcpyDeviceToHost, s),
            "batch launch: copy sums");
    return OkStatus();
  }

  Status LaunchSignaled(void* stream, uint64_t seq) override {
    if (seq == 0) return InvalidArgumentError("batch: signaled launch with sequence number 0");
    if (bucket_bytes_.empty()) {  // nothing to launch: signaled at once
      __atomic_store_n(HostFlag(), seq, __ATOMIC_RELEASE);
      return OkStatus();
    }
    SS_CUDA(cudaSetDevice(device_), "batch launch: cudaSetDevice");
    auto s = static_cast<cudaStream_t>(stream);
    if (sums_dirty_) {  // a plain launch ran last
      SS_CUDA(cudaMemsetAsync(sums_, 0, (bucket_bytes_.size() + 1) * sizeof(unsigned long long), s),
              "batch launch: memset");
      sums_dirty_ = false;
    }
    Finish f = fin_;
    f.seq = seq;
    return LaunchKernels(s, f);
  }

  uint64_t Signaled() const override { return __atomic_load_n(HostFlag(), __ATOMIC_ACQUIRE); }

  Result<std::vector<uint64_t>> LandedSums() const override {
    if (!landed_batch_) return FailedPreconditionError("batch: not a landed pack");
    const unsigned long long* l = host_sums_ + std::max<size_t>(1, bucket_bytes_.size());
    return std::vector<uint64_t>(l, l + bucket_bytes_.size());
  }

 private:
  unsigned long long* HostFlag() const {
    return host_sums_ + 2 * std::max<size_t>(1, bucket_bytes_.size());
  }

  // The lean kernel (if any), then BatchKernel: it runs whenever it has work or `f` signals
  // (its last block finishes a signaled launch).
  Status LaunchKernels(cudaStream_t s, const Finish& f) {
    const size_t nb = bucket_bytes_.size();
    if (lean_chunks_.n > 0) {
      lean_kernel_<<<lean_grid_, kThreads, 0, s>>>(lean_chunks_.p, static_cast<int>(lean_chunks_.n),
                                                   sums_, landed_.p,
                                                   reinterpret_cast<unsigned int*>(sums_ + nb));
      SS_CUDA(cudaGetLastError(), "batch launch: lean kernel");
    }
    if (run_main_ || f.flag) {
      kernel_<<<grid_, kThreads, 0, s>>>(descs_.p, chunks_.p, static_cast<int>(chunks_.n),
                                         bounds_.p, static_cast<int>(bounds_.n), num_descs_, sums_,
                                         ticket_, segs_.p, landed_.p, f);
      SS_CUDA(cudaGetLastError(), "batch launch: kernel");
    }
    return OkStatus();
  }

 public:
  Result<std::vector<uint64_t>> Sums() const override {
    return std::vector<uint64_t>(host_sums_, host_sums_ + bucket_bytes_.size());
  }
  Result<std::vector<uint64_t>> Checksums() const override {
    std::vector<uint64_t> v(bucket_bytes_.size());
    for (size_t b = 0; b < v.size(); ++b) {
      v[b] = ChecksumFinish(host_sums_[b], static_cast<uint64_t>(bucket_bytes_[b]));
    }
    return v;
  }
  int64_t wire_bytes() const override { return wire_bytes_; }
  int64_t in_bytes() const override { return in_bytes_; }
  int64_t out_bytes() const override { return out_bytes_; }
  size_t num_chunks() const override { return num_chunks_; }

 private:
  int device_ = 0;
  KernelFn kernel_ = nullptr;
  std::vector<int64_t> bucket_bytes_;
  DevArray<Desc> descs_;
  DevArray<Chunk> chunks_;
  DevArray<Boundary> bounds_;
  DevArray<Seg> segs_;
  DevArray<unsigned long long*> landed_;
  DevArray<LeanChunk> lean_chunks_;
  LeanFn lean_kernel_ = nullptr;
  int lean_grid_ = 1;
  bool run_main_ = true;
  int num_descs_ = 0;
  size_t num_chunks_ = 0;
  unsigned long long* sums_ = nullptr;
  unsigned long long* host_sums_ = nullptr;  // [sums | landed sums | flag], mapped
  Finish fin_;
  bool landed_batch_ = false;
  bool sums_dirty_ = false;
  unsigned int* ticket_ = nullptr;
  int grid_ = 1;
  int64_t in_bytes_ = 0, out_bytes_ = 0, wire_bytes_ = 0;
};

}  // namespace
}  // namespace kernels

namespace {

// An image batch (encoded ops, or a compact image of copies) is its codec's: the encoding of its
// ops picks the kernels, one codec per batch. Block FP8 (kQuantize, kAmax; fp8_batch.cu) also
// runs an image's copies and stage copies alone.
Result<std::unique_ptr<CopyBatch>> PrepareEncoded(const BatchSpec& spec, int device) {
  for (size_t i = 0; i < spec.encoded.size(); ++i) {
    const Encoding e = spec.encoded[i].encoding;
    if (e != Encoding::kQuantize && e != Encoding::kAmax) {
      return InvalidArgumentError("copy batch: encoded op " + std::to_string(i) + " of encoding '" +
                                  std::string(EncodingName(e)) + "', which no GPU codec runs");
    }
  }
  return PrepareBlockQuantizeBatch(spec, device);
}

}  // namespace

Result<std::unique_ptr<CopyBatch>> CopyBatch::Prepare(const BatchSpec& spec, int device) {
  if (!spec.encoded.empty() || !spec.copy_bytes.empty()) return PrepareEncoded(spec, device);
  auto b = std::make_unique<kernels::CopyBatchImpl>();
  SS_RETURN_IF_ERROR(b->Init(spec, device));
  return std::unique_ptr<CopyBatch>(std::move(b));
}

Result<uint64_t> DeviceChecksumPartial(const void* d, size_t nbytes, uint64_t byte_offset) {
  if (byte_offset % 8 != 0) {
    return InvalidArgumentError("DeviceChecksumPartial: byte_offset " +
                                std::to_string(byte_offset) + " not a multiple of 8");
  }
  cudaPointerAttributes attr{};
  SS_CUDA(cudaPointerGetAttributes(&attr, d), "DeviceChecksumPartial: pointer attributes");
  const int device = attr.type == cudaMemoryTypeDevice ? attr.device : 0;
  // The bytes are one run of 1-byte elements in one bucket.
  BatchSpec spec;
  spec.mode = BatchMode::kVerify;
  spec.in_dtype = DType::kU8;
  CopyRun r;
  r.in = d;
  r.row_elems = static_cast<int64_t>(nbytes);
  r.rows = 1;
  r.wire_offset = 0;
  spec.runs.push_back(r);
  spec.bucket_bytes.push_back(static_cast<int64_t>(nbytes));
  if (nbytes == 0) return uint64_t{0};
  if (byte_offset != 0) {
    // Word keys start at byte_offset / 8: the kernel keys by position in the bucket, so use a
    // bucket that begins byte_offset bytes earlier, the leading bytes read from a zero buffer and
    // their (known) contribution subtracted.
    SS_ASSIGN_OR_RETURN(auto zeros, DeviceBuffer::Allocate(byte_offset, device));
    SS_RETURN_IF_ERROR(Memset(zeros->data(), 0, byte_offset));
    CopyRun z;
    z.in = zeros->data();
    z.row_elems = static_cast<int64_t>(byte_offset);
    spec.runs[0].wire_offset = static_cast<int64_t>(byte_offset);
    spec.runs.insert(spec.runs.begin(), z);
    spec.bucket_bytes[0] += static_cast<int64_t>(byte_offset);
    SS_ASSIGN_OR_RETURN(auto batch, CopyBatch::Prepare(spec, device));
    SS_RETURN_IF_ERROR(batch->Launch(nullptr));
    SS_CUDA(cudaDeviceSynchronize(), "DeviceChecksumPartial");
    SS_ASSIGN_OR_RETURN(auto sums, batch->Sums());
    uint64_t zero_part = 0;
    for (uint64_t j = 0; j < byte_offset / 8; ++j) zero_part += ChecksumMixWord(0, j);
    return sums[0] - zero_part;
  }
  SS_ASSIGN_OR_RETURN(auto batch, CopyBatch::Prepare(spec, device));
  SS_RETURN_IF_ERROR(batch->Launch(nullptr));
  SS_CUDA(cudaDeviceSynchronize(), "DeviceChecksumPartial");
  SS_ASSIGN_OR_RETURN(auto sums, batch->Sums());
  return sums[0];
}

}  // namespace shardsync::gpu
