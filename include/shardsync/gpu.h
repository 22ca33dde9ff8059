// GPU data path: device query, device memory, streams, and the batched pack / unpack / verify
// kernels that copy (and cast) many strided regions in ONE launch while computing the shardsync
// checksum (checksum.h) of the wire image, bit for bit equal to the CPU ChecksumPartial.
//
// Built with CUDA when SHARDSYNC_HAVE_CUDA; otherwise every call returns Unimplemented
// ("built without CUDA") and Available() is false, so the rest of shardsync links and runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardsync/checksum.h"
#include "shardsync/dtype.h"
#include "shardsync/pack.h"
#include "shardsync/plan.h"
#include "shardsync/region.h"
#include "shardsync/status.h"
#include "shardsync/synthetic.h"
#include "shardsync/transport.h"

namespace shardsync::gpu {

// True if this build has CUDA and at least one device answers; otherwise false with the reason
// ("built without CUDA", "no CUDA device: <driver error>").
bool Available(std::string* reason = nullptr);
Result<int> DeviceCount();

struct DeviceInfo {
  int index = 0;
  std::string name;
  std::string pci_bus_id;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int64_t total_bytes = 0;
  int64_t l2_bytes = 0;
  double hbm_peak_gbps = 0;  // memory clock * bus width * 2 (DDR); H200: ~4800
};
Result<DeviceInfo> QueryDevice(int device);
// Makes `device` current for the calling thread.
Status SetDevice(int device);
// This rank's identity for transport routing (transport.h): host, kCuda, `device` and its
// physical GPU (PCI bus id), so pairs on one GPU are recognised whatever each process's
// CUDA_VISIBLE_DEVICES.
Result<PeerInfo> DevicePeerInfo(int rank, int device);

// An owned cudaStream_t (non-blocking w.r.t. the legacy stream).
class Stream {
 public:
  static Result<std::unique_ptr<Stream>> Create(int device);
  ~Stream();
  void* handle() const { return handle_; }  // cudaStream_t
  int device() const { return device_; }
  Status Synchronize(Millis timeout, std::string_view what) const;

 private:
  Stream(void* h, int d) : handle_(h), device_(d) {}
  void* handle_;
  int device_;
};

// An owned device allocation (cudaMalloc, so it can be exported through CUDA IPC).
class DeviceBuffer {
 public:
  static Result<std::unique_ptr<DeviceBuffer>> Allocate(size_t bytes, int device);
  ~DeviceBuffer();
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }
  MemRegion region() const { return {data_, bytes_, MemKind::kCuda, device_}; }

 private:
  DeviceBuffer(void* p, size_t n, int d) : data_(p), bytes_(n), device_(d) {}
  void* data_;
  size_t bytes_;
  int device_;
};

// Synchronous copies and fills (tests, setup; not on the sync path).
Status CopyToDevice(void* dst, const void* src, size_t bytes);
Status CopyToHost(void* dst, const void* src, size_t bytes);
Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, void* stream = nullptr);
Status Memset(void* dst, int value, size_t bytes);
// Strided forms (synchronous; bench set-up): `height` rows of `width` bytes, rows `pitch` bytes
// apart (cudaMemset2D, cudaMemcpy2D).
Status Memset2D(void* dst, size_t pitch, int value, size_t width, size_t height);
Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
              size_t height);
// `rows` elements of `dtype` (kF32 or kBF16), `pitch` bytes apart from `dst`, become the packed
// elements at `saved` times `factor` (fp32 arithmetic, rounded to nearest even for kBF16):
// `bench --update-fraction`'s small step. Synchronous (bench set-up).
Status ScaleStrided(void* dst, size_t pitch, const void* saved, size_t rows, DType dtype,
                    float factor);
// Queues one memory-bound pass reading `bytes` of device memory at `p` on `stream`, as a decode
// step reads every weight: `bench --commit staged`'s stand-in for an engine serving beside a sync.
Status LaunchReadPass(const void* p, size_t bytes, void* stream);

// One strided piece of a batch: `rows` runs of `row_elems` elements. The input run r starts at
// in + r*in_stride elements, the output run at out + r*out_stride (strides in elements of each
// side's dtype). Its elements occupy wire bytes [wire_offset, wire_offset + numel*wire_size) of
// bucket `bucket`, in row-major order. All pointers are device pointers (or IPC-mapped ones).
struct CopyRun {
  const void* in = nullptr;
  void* out = nullptr;  // ignored by kVerify
  int64_t in_stride = 0;
  int64_t out_stride = 0;
  int64_t row_elems = 0;
  int64_t rows = 1;
  int32_t bucket = 0;
  int64_t wire_offset = 0;
  int64_t numel() const { return row_elems * rows; }
};

// One encoded op of a prepared pack, run by the kernels of its `encoding`'s codec (plan.h; one
// codec per batch). Block FP8 (fp8_kernels.h, fp8_batch.cu), kQuantize: `rows` x `cols` trainer
// values at `src` (row stride in elements; origin on the HF tensor's 128 grid; cols a multiple of
// 8) quantized per 128 x 128 block (fp8.h) into e4m3 bytes at `weight` and fp32 block scales at
// `scales` (row strides in elements of each), which may be a peer's memory. The checksum covers
// the op's virtual wire image (e4m3 rows, then the scales, zero pads: fp8.h's wire bytes) at byte
// `wire_offset` (a multiple of 8) of bucket `bucket`, as packed and as read back through the
// receiver's own map of the same bytes (`landed_*`, this process's mapping of them).
struct EncodedTask {
  Encoding encoding = Encoding::kQuantize;
  const void* src = nullptr;
  DType dtype = DType::kF32;  // f32, bf16 or f16
  int64_t src_stride = 0;
  int64_t rows = 0, cols = 0;
  void* weight = nullptr;
  int64_t weight_stride = 0;
  void* scales = nullptr;
  int64_t scale_stride = 0;
  const void* landed_weight = nullptr;
  int64_t landed_weight_stride = 0;
  const void* landed_scales = nullptr;
  int64_t landed_scale_stride = 0;
  int32_t bucket = 0;
  int64_t wire_offset = 0;
  // A kAmax op (fp8_plan.h; the amax exchange): rows <= 128 of one block row quantized with the
  // scales at `given_scales` (device memory, one per column block, read by the launch) instead
  // of their own amax; `scales` / `landed_scales` null for a holder that sends no scale section
  // (its wire image is then the e4m3 rows alone: fp8.h's part wire bytes).
  const float* given_scales = nullptr;
};

// kPack: the wire image is the output (in_dtype -> wire_dtype, cast f32 -> bf16 allowed).
// kUnpack: the wire image is the input (wire_dtype -> out_dtype, cast bf16 -> f32 allowed).
// kVerify: no output; checksums the input as wire bytes (zero-copy receivers).
enum class BatchMode { kPack, kUnpack, kVerify };

struct BatchSpec {
  BatchMode mode = BatchMode::kPack;
  DType in_dtype = DType::kBF16;
  DType out_dtype = DType::kBF16;  // ignored by kVerify
  std::vector<CopyRun> runs;
  // Wire bytes of each bucket; the runs of a bucket must tile [0, bytes) exactly.
  std::vector<int64_t> bucket_bytes;
  // kPack, optional ("landed readback"): the RECEIVER's own map of each bucket, runs whose `in`
  // is where wire bytes [wire_offset, +numel*wire size) must land (this process's mapping of the
  // receiver's memory; `out` ignored), tiling every bucket like `runs`; and per bucket a device
  // address (e.g. in the receiver's memory, through CUDA IPC) to which the kernel atomically adds
  // ChecksumPartial of the bucket's wire image as read back through those runs (the caller zeroes
  // it; finish it with ChecksumFinish(sum, bucket bytes)). Each thread reads back the words it has
  // just written, from L2, so checking where every byte landed costs no second pass over HBM; a
  // byte written where the receiver does not expect it changes the landed sum.
  std::vector<CopyRun> landed_runs;
  std::vector<void*> landed_sums;
  // kPack of an image codec's plan (block FP8, cuda_ipc pairs): its encoded ops, run by the
  // codec's kernels beside the copies (CopyBatch::Prepare dispatches by encoding). With them (or
  // a non-empty copy_bytes) `runs` and `landed_runs` tile a compact image of each bucket's copies,
  // copy_bytes[b] long, and bucket_bytes[b] is the whole wire image the finished checksums cover;
  // every launch must be signaled (LaunchSignaled).
  std::vector<EncodedTask> encoded;
  std::vector<int64_t> copy_bytes;
  // An image pack's stage ops (block FP8 kStage) (raw trainer values into the receiver's staging),
  // optional: copies of `stage_dtype` with no cast (the copies above cast to the wire dtype), whose
  // runs and landed runs tile a compact image of each bucket's stage ops, stage_bytes[b] long
  // (empty, or one entry per bucket). Their sums join the bucket's packed and landed sums.
  DType stage_dtype = DType::kF32;
  std::vector<CopyRun> stage_runs;
  std::vector<CopyRun> stage_landed_runs;
  std::vector<int64_t> stage_bytes;
};

// A prepared batch: descriptors validated and uploaded once, replayed every sync. One launch in
// flight at a time per batch.
class CopyBatch {
 public:
  static Result<std::unique_ptr<CopyBatch>> Prepare(const BatchSpec& spec, int device);
  virtual ~CopyBatch() = default;
  // Enqueues the copy and the per-bucket checksum on `stream` (a cudaStream_t, or the Stream's
  // handle()). Never blocks.
  virtual Status Launch(void* stream) = 0;
  // Like Launch, but the kernel finishes the batch itself: its last block moves the sums (and a
  // landed pack's landed sums) to host memory, re-zeroes them on the device, and then stores `seq`
  // (> 0) where Signaled() reads it. Nothing is enqueued around the kernel, so the host learns of
  // completion as soon as the last block is done, not after trailing copies and an event. A
  // landed pack's landed sums must be zero before its first signaled launch (the kernel leaves
  // them so). A kernel that faults never signals: watch the stream too.
  virtual Status LaunchSignaled(void* stream, uint64_t seq) = 0;
  // The `seq` of the last signaled launch that finished (0 before any).
  virtual uint64_t Signaled() const = 0;
  // After Signaled() returned a launch's seq: that launch's raw landed sums per bucket.
  virtual Result<std::vector<uint64_t>> LandedSums() const = 0;
  // After the stream passed the launch (or Signaled() returned its seq): the finished checksum
  // (ChecksumFinish(sum, bucket bytes)) of each bucket, and the raw sums (ChecksumPartial of the
  // bucket's wire image).
  virtual Result<std::vector<uint64_t>> Checksums() const = 0;
  virtual Result<std::vector<uint64_t>> Sums() const = 0;
  // Block-FP8 batches: per bucket, the non-finite trainer values the last launch met (their
  // blocks were written as NaN); empty for other batches. Read like Checksums().
  virtual std::vector<int64_t> NonFinite() const { return {}; }
  virtual int64_t wire_bytes() const = 0;
  virtual int64_t in_bytes() const = 0;
  virtual int64_t out_bytes() const = 0;
  virtual size_t num_chunks() const = 0;
};

// Appends the runs of region `r` of a row-major tensor of `shape` held at device pointer `in`
// (elements of `in_size` bytes), packed contiguously at `out` (elements of `out_size` bytes)
// whose first element sits at wire_offset (wire elements of `wire_size` bytes). Runs of equal
// length at a constant stride merge into one 2-d CopyRun.
void AppendRegionRuns(const Region& r, const Shape& shape, const void* in, int in_size, void* out,
                      int out_size, int wire_size, int32_t bucket, int64_t wire_offset,
                      std::vector<CopyRun>* runs);

// Runs that copy region `src` of a row-major tensor (shape src_shape at `in`) element for element,
// in row-major order, onto region `dst` (same element count) of another tensor (dst_shape at
// `out`): pieces contiguous on both sides, equal ones at constant strides merged into 2-d runs.
// Wire positions (as AppendRegionRuns) start at wire_offset.
void AppendCoRuns(const Region& src, const Shape& src_shape, const void* in, int in_size,
                  const Region& dst, const Shape& dst_shape, void* out, int out_size, int wire_size,
                  int32_t bucket, int64_t wire_offset, std::vector<CopyRun>* runs);

// GPU checksum of device bytes (any size, any alignment): ChecksumPartial(d, nbytes, byte_offset)
// computed on the GPU. Synchronous.
Result<uint64_t> DeviceChecksumPartial(const void* d, size_t nbytes, uint64_t byte_offset);
inline Result<uint64_t> DeviceChecksum(const void* d, size_t nbytes);

// Fills `out` (device, row-major, r.numel() elements of `dtype` kF32 or kBF16) with the synthetic
// values (synthetic.h) of region `r` of a tensor of `shape`, bit-equal to FillSyntheticRegion
// (rounded to bf16 for kBF16). Asynchronous on `stream`.
Status FillSyntheticDevice(uint64_t seed, const SyntheticTensor& t, const Shape& shape,
                           const Region& r, DType dtype, void* out, void* stream);
// Counts elements of the device bf16 region `dst` of a tensor of `dst_shape` that differ from
// bf16(synthetic value of region `src` of the HF tensor of `src_shape`) (same element count,
// row-major correspondence). Adds to *d_mismatches (device int64). Asynchronous on `stream`.
Status CountSyntheticMismatches(uint64_t seed, const SyntheticTensor& t, const Shape& src_shape,
                                const Region& src, const Shape& dst_shape, const Region& dst,
                                const void* param, unsigned long long* d_mismatches, void* stream);

// Transports implemented by this layer. cuda_ipc: same node, one-sided Put into peers' exported
// device memory (cached mappings), control messages through a shared-memory mailbox. nccl:
// two-sided, one non-blocking 2-rank communicator per peer pair (NCCL refuses two ranks of one
// communicator on one GPU, which colocated layouts need; a rank listing itself gets a 1-rank
// communicator for send-to-self), grouped send/recv, abort on failure. Both factories return
// nullptr in builds without CUDA.
struct NcclOptions {
  int device = 0;  // CUDA device of this rank
  // Prepared pairs: plan buckets (rounds) in flight per pair, each in its own staging slot on
  // both sides (pack of round r+1 overlaps the send of round r). Registry param "nccl_depth".
  int depth = 2;
};
std::unique_ptr<Transport> MakeCudaIpcTransport(int device);
std::unique_ptr<Transport> MakeNcclTransport(const NcclOptions& options);
// Device pointer a CUDA IPC transport mapped for peer's region at offset (for kernels that write
// straight into the peer's memory); OutOfRange if [offset, offset+bytes) leaves the region.
Result<void*> CudaIpcRemotePointer(Transport& ipc, int peer, uint32_t region, uint64_t offset,
                                   uint64_t bytes);
// Runs a GPU transport's copies / NCCL calls on `stream` (cudaStream_t; nullptr: its own), so they
// are ordered after kernels the caller enqueued there (pack, or writes straight into a peer's
// memory through CudaIpcRemotePointer) and a Flush covers them. Call it before posting.
// InvalidArgument for other transports.
Status SetTransportStream(Transport& t, void* stream);
// Registers "cuda_ipc" (priority 100) and "nccl" (priority 200) in the transport registry
// (idempotent). Factory params (TransportOptions.params): "device" (CUDA index, default 0).
Status RegisterGpuTransports();
// The session's Packer (pack.h) for device regions: Pack (cast + checksum, one launch),
// ChecksumLanded (verify, one launch), Unpack, ZeroFill, on `device`, each waiting at most
// `timeout`. Prepared batches are cached by their inputs (a replayed plan uploads descriptors
// once). One dtype per call (Unimplemented otherwise). nullptr in builds without CUDA.
std::unique_ptr<Packer> MakeCudaPacker(int device, Millis timeout = Millis(60000));
// Whether libnccl can be loaded (SHARDSYNC_NCCL_LIB or libnccl.so.2), with its version.
Result<int> NcclVersion();

// ---- inline ----
inline Result<uint64_t> DeviceChecksum(const void* d, size_t nbytes) {
  SS_ASSIGN_OR_RETURN(uint64_t s, DeviceChecksumPartial(d, nbytes, 0));
  return ChecksumFinish(s, nbytes);
}

}  // namespace shardsync::gpu
