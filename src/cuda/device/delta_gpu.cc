// Host side of delta_gpu.h: argument checks, the scratch, bounded waits, and the refusal
// messages (the kernels are in kernels/delta_encode.cu and kernels/delta_decode.cu).
#include "shardsync/delta_gpu.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstring>
#include <thread>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/kernels/delta_kernels.h"

namespace shardsync::gpu {
namespace {

using internal::CudaStatus;
namespace dk = delta;

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

class Scratch final : public DeltaGpuScratch {
 public:
  ~Scratch() override {
    if (done_) cudaEventDestroy(done_);
    if (host_) cudaFreeHost(host_);
    if (dev_) cudaFree(dev_);
  }
  uint64_t max_bucket_bytes() const override { return max_bytes_; }
  int min_element_size() const override { return min_e_; }
  int device() const override { return device_; }

  enum class Op { kNone, kEncode, kDecode };

  uint64_t max_bytes_ = 0;
  int min_e_ = 1, device_ = 0, sm_count_ = 0;
  int enc_blocks_[5] = {};  // the encoder's tile pass: blocks that fit at once, per element size
  void* dev_ = nullptr;
  dk::HostResult* host_ = nullptr;
  dk::ScratchPtrs ptrs_;
  cudaEvent_t done_ = nullptr;
  Op op_ = Op::kNone;
  // The call in flight, for Finish's messages.
  std::string bucket_;
  bool empty_ = false;  // a 0-byte encode: nothing launched
  const void* encoded_ = nullptr;
  uint64_t encoded_bytes_ = 0, bucket_bytes_ = 0, version_ = 0;
  int element_size_ = 0;

  // Waits for the call's event, at most `timeout`.
  Status Wait(std::chrono::milliseconds timeout, std::string_view what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const cudaError_t e = cudaEventQuery(done_);
      if (e == cudaSuccess) return OkStatus();
      if (e != cudaErrorNotReady) {
        op_ = Op::kNone;
        return CudaStatus(e, std::string(what));
      }
      if (std::chrono::steady_clock::now() > deadline)
        return DeadlineExceededError(
            fmt::format("{} of bucket {}: not done after {} ms (call Finish again to keep waiting)",
                        what, bucket_, timeout.count()));
      std::this_thread::yield();
    }
  }
  dk::HostResult Result() const {
    dk::HostResult r;
    std::memcpy(&r, const_cast<const dk::HostResult*>(host_), sizeof(r));
    return r;
  }
};

Scratch* Check(DeltaGpuScratch* s) { return static_cast<Scratch*>(s); }

// Runs `op` on a stream of its own (non-blocking: it waits for no other stream of the process,
// torch's included) and waits for it, at most `timeout`.
template <typename Op>
Status OnPrivateStream(Op&& op, std::chrono::milliseconds timeout, std::string_view what) {
  cudaStream_t st = nullptr;
  SS_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), std::string(what));
  Status s = CudaStatus(op(st), std::string(what));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (s.ok()) {
    const cudaError_t e = cudaStreamQuery(st);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      s = CudaStatus(e, std::string(what));
    } else if (std::chrono::steady_clock::now() > deadline) {
      s = DeadlineExceededError(fmt::format("{}: not done after {} ms", what, timeout.count()));
    } else {
      std::this_thread::yield();
    }
  }
  cudaStreamDestroy(st);
  return s;
}

Status Begin(Scratch* s, std::string_view what, std::string_view bucket) {
  if (s == nullptr)
    return InvalidArgumentError(fmt::format("{} of bucket {}: no scratch", what, bucket));
  if (s->op_ != Scratch::Op::kNone)
    return FailedPreconditionError(fmt::format(
        "{} of bucket {}: the scratch has a call in flight (bucket {}): Finish it first", what,
        bucket, s->bucket_));
  return OkStatus();
}

}  // namespace

size_t DeltaGpuScratch::Bytes(uint64_t max_bucket_bytes, int /*min_element_size*/) {
  return dk::LayoutScratch(max_bucket_bytes).total;
}

Result<std::unique_ptr<DeltaGpuScratch>> DeltaGpuScratch::Allocate(uint64_t max_bucket_bytes,
                                                                   int min_element_size,
                                                                   int device) {
  if (min_element_size != 1 && min_element_size != 2 && min_element_size != 4)
    return InvalidArgumentError(
        fmt::format("delta scratch: min_element_size must be 1, 2 or 4, got {}", min_element_size));
  SS_CUDA(cudaSetDevice(device), fmt::format("delta scratch: cudaSetDevice {}", device));
  auto s = std::make_unique<Scratch>();
  s->max_bytes_ = max_bucket_bytes;
  s->min_e_ = min_element_size;
  s->device_ = device;
  SS_CUDA(cudaDeviceGetAttribute(&s->sm_count_, cudaDevAttrMultiProcessorCount, device),
          "delta scratch: SM count");
  for (int e : {1, 2, 4}) {
    const int per_sm = dk::EncodeBlocksPerSm(e);
    if (per_sm <= 0) return InternalError("delta scratch: occupancy of the encoder's tile pass");
    s->enc_blocks_[e] = per_sm * s->sm_count_;
  }
  const dk::ScratchLayout l = dk::LayoutScratch(max_bucket_bytes);
  SS_CUDA(cudaMalloc(&s->dev_, l.total),
          fmt::format("delta scratch: cudaMalloc {} bytes on device {}", l.total, device));
  SS_RETURN_IF_ERROR(
      OnPrivateStream([&](cudaStream_t st) { return cudaMemsetAsync(s->dev_, 0, l.total, st); },
                      std::chrono::seconds(60), "delta scratch: zero"));
  dk::Ctl ctl{};
  ctl.bad_record = ~0ull;
  SS_RETURN_IF_ERROR(
      internal::UploadBlocking(s->dev_, &ctl, sizeof(ctl), "delta scratch: control"));
  SS_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&s->host_), sizeof(dk::HostResult),
                        cudaHostAllocMapped),
          "delta scratch: pinned result");
  std::memset(s->host_, 0, sizeof(dk::HostResult));
  void* host_dev = nullptr;
  SS_CUDA(cudaHostGetDevicePointer(&host_dev, s->host_, 0), "delta scratch: mapped result");
  SS_CUDA(cudaEventCreateWithFlags(&s->done_, cudaEventDisableTiming), "delta scratch: event");
  auto* base = static_cast<unsigned char*>(s->dev_);
  s->ptrs_.ctl = reinterpret_cast<dk::Ctl*>(base);
  s->ptrs_.tile = reinterpret_cast<uint32_t*>(base + l.tile);
  s->ptrs_.voff = reinterpret_cast<uint32_t*>(base + l.voff);
  s->ptrs_.ioff = reinterpret_cast<uint32_t*>(base + l.ioff);
  s->ptrs_.rtot = reinterpret_cast<uint32_t*>(base + l.rtot);
  s->ptrs_.etile = reinterpret_cast<uint32_t*>(base + l.etile);
  s->ptrs_.etot = reinterpret_cast<uint32_t*>(base + l.etot);
  s->ptrs_.subc = base + l.subc;
  s->ptrs_.pv = base + l.pv;
  s->ptrs_.vals = base + l.vals;
  s->ptrs_.idx = reinterpret_cast<uint16_t*>(base + l.idx);
  s->ptrs_.stage_bytes = l.total - l.vals;
  s->ptrs_.result = static_cast<dk::HostResult*>(host_dev);
  return std::unique_ptr<DeltaGpuScratch>(std::move(s));
}

Status EnqueueDeltaEncode(const DeltaGpuEncodeArgs& a, DeltaGpuScratch* scratch, void* stream) {
  Scratch* s = Check(scratch);
  SS_RETURN_IF_ERROR(Begin(s, "device delta encode", a.bucket));
  auto bad = [&](std::string what) {
    return InvalidArgumentError(fmt::format("delta of bucket {}: {}", a.bucket, what));
  };
  const int e = a.element_size;
  if (e != 1 && e != 2 && e != 4)
    return bad(fmt::format("element_size must be 1, 2 or 4, got {}", e));
  if (a.bytes % e != 0)
    return bad(fmt::format("{} bytes is not a multiple of element_size {}", a.bytes, e));
  if (a.bytes / e > kDeltaMaxElements)
    return bad(fmt::format("{} elements, the codec's indices hold at most {}", a.bytes / e,
                           kDeltaMaxElements));
  if (a.bytes > s->max_bytes_)
    return bad(fmt::format("{} bytes: the scratch holds up to {} bytes", a.bytes, s->max_bytes_));
  if (a.bytes > 0 && (a.base == nullptr || a.next == nullptr || a.out == nullptr))
    return bad("base, next and out must be device pointers");
  if (!Aligned16(a.base) || !Aligned16(a.next) || !Aligned16(a.out))
    return bad("base, next and out must be 16-byte aligned");
  if (a.advance != nullptr && a.advance != a.base)
    return bad("advance must be null or base itself");
  SS_CUDA(cudaSetDevice(s->device_), "device delta encode: cudaSetDevice");
  auto st = static_cast<cudaStream_t>(stream);
  s->bucket_ = std::string(a.bucket);
  s->empty_ = a.bytes == 0;
  if (!s->empty_) {
    SS_CUDA(
        static_cast<cudaError_t>(dk::LaunchEncode(a.base, a.next, a.bytes, e, a.base_version, a.out,
                                                  s->ptrs_, s->enc_blocks_[e], st, a.advance)),
        fmt::format("device delta encode of bucket {}: launch", a.bucket));
  }
  SS_CUDA(cudaEventRecord(s->done_, st), "device delta encode: event");
  s->op_ = Scratch::Op::kEncode;
  return OkStatus();
}

Result<DeltaGpuEncoded> FinishDeltaEncode(DeltaGpuScratch* scratch,
                                          std::chrono::milliseconds timeout) {
  Scratch* s = Check(scratch);
  if (s == nullptr || s->op_ != Scratch::Op::kEncode)
    return FailedPreconditionError("device delta encode: no encode in flight on this scratch");
  SS_RETURN_IF_ERROR(s->Wait(timeout, "device delta encode"));
  s->op_ = Scratch::Op::kNone;
  DeltaGpuEncoded out;
  if (s->empty_) return out;  // kFull, nothing changed, no elements
  const dk::HostResult r = s->Result();
  out.result.kind = static_cast<DeltaKind>(r.kind);
  out.result.changed = r.changed;
  out.result.escapes = r.escapes;
  out.result.elements = r.elements;
  out.result.base_checksum = r.base_checksum;
  out.result.new_checksum = r.new_checksum;
  out.bytes = r.bytes;
  return out;
}

Status EnqueueDeltaDecode(const DeltaGpuDecodeArgs& a, DeltaGpuScratch* scratch, void* stream) {
  Scratch* s = Check(scratch);
  const std::string_view name = a.expect.bucket;
  SS_RETURN_IF_ERROR(Begin(s, "device delta decode", name));
  auto bad = [&](std::string what) {
    return InvalidArgumentError(fmt::format("delta of bucket {}: {}", name, what));
  };
  const int e = a.expect.element_size;
  if (e != 1 && e != 2 && e != 4)
    return bad(fmt::format("the receiver's element_size must be 1, 2 or 4, got {}", e));
  if (a.encoded_bytes < kDeltaHeaderBytes)
    return DataLossError(fmt::format(
        "delta of bucket {}: malformed encoding: {} bytes, shorter than the {}-byte header", name,
        a.encoded_bytes, kDeltaHeaderBytes));
  if (a.bucket_bytes > s->max_bytes_)
    return bad(fmt::format("a bucket of {} bytes: the scratch holds up to {}", a.bucket_bytes,
                           s->max_bytes_));
  if (a.encoded == nullptr || (a.bucket == nullptr && a.bucket_bytes > 0))
    return bad("encoded and bucket must be device pointers");
  if (!Aligned16(a.encoded) || !Aligned16(a.bucket))
    return bad("encoded and bucket must be 16-byte aligned");
  SS_CUDA(cudaSetDevice(s->device_), "device delta decode: cudaSetDevice");
  auto st = static_cast<cudaStream_t>(stream);
  s->bucket_ = std::string(name);
  s->empty_ = false;
  s->encoded_ = a.encoded;
  s->encoded_bytes_ = a.encoded_bytes;
  s->bucket_bytes_ = a.bucket_bytes;
  s->version_ = a.expect.base_version;
  s->element_size_ = e;
  SS_CUDA(static_cast<cudaError_t>(dk::LaunchDecode(a.encoded, a.encoded_bytes, a.bucket,
                                                    a.bucket_bytes, e, a.expect.base_version,
                                                    s->ptrs_, s->sm_count_, st)),
          fmt::format("device delta decode of bucket {}: launch", name));
  SS_CUDA(cudaEventRecord(s->done_, st), "device delta decode: event");
  s->op_ = Scratch::Op::kDecode;
  return OkStatus();
}

namespace {

// The packed form's fault (dk::PackedFault*) as the host decoder words it (delta.cc), its bytes
// read back from the encoding.
Status PackedFault(const dk::HeaderView& h, uint64_t key, const unsigned char* payload,
                   const std::string& name) {
  auto malformed = [&](std::string what) {
    return DataLossError(fmt::format("delta of bucket {}: malformed encoding: {}", name, what));
  };
  std::vector<unsigned char> buf;
  auto read = [&](uint64_t at, uint64_t bytes) -> Status {
    buf.assign(bytes, 0);
    if (bytes == 0) return OkStatus();
    return OnPrivateStream(
        [&](cudaStream_t st) {
          return cudaMemcpyAsync(buf.data(), payload + at, bytes, cudaMemcpyDeviceToHost, st);
        },
        std::chrono::seconds(10), "device delta decode: read back a packed-form fault");
  };
  auto u32 = [&](uint64_t at) -> Result<uint64_t> {
    SS_RETURN_IF_ERROR(read(at, 4));
    return dk::LoadLE(buf.data(), 4);
  };
  const uint64_t e = h.element_size;
  const DeltaPackedLayout l = DeltaPackedPayload(h.elements, e, h.changed, h.escapes);
  const uint64_t spt = l.tile_elems / kDeltaSubtileElems;
  auto sub_elems = [&](uint64_t sub) {
    return std::min(kDeltaSubtileElems, h.elements - sub * kDeltaSubtileElems);
  };
  const uint64_t cat = key >> 60;
  if (cat == 0 || cat == 2) {
    const uint64_t t = key & ((1ull << 60) - 1), at = cat == 0 ? 0 : l.escape_ends;
    SS_ASSIGN_OR_RETURN(const uint64_t prev, u32(at + 4 * (t - 1)));
    SS_ASSIGN_OR_RETURN(const uint64_t end, u32(at + 4 * t));
    return malformed(fmt::format("tile {}: running {}count {} below the previous tile's {}", t,
                                 cat == 0 ? "" : "escape ", end, prev));
  }
  if (cat == 1) {
    SS_ASSIGN_OR_RETURN(const uint64_t end, u32(4 * (l.tiles - 1)));
    return malformed(
        fmt::format("tile {}: running count {}, the count says {}", l.tiles - 1, end, h.changed));
  }
  if (cat == 3) {
    SS_ASSIGN_OR_RETURN(const uint64_t end, u32(l.escape_ends + 4 * (l.tiles - 1)));
    return malformed(fmt::format("tile {}: running escape count {}, the length says {}",
                                 l.tiles - 1, end, h.escapes));
  }
  if (cat == 5)
    return malformed(fmt::format("packed padding byte {} not zero", key & ((1ull << 60) - 1)));
  const uint64_t t = (key >> 34) & ((1ull << 26) - 1), what = (key >> 32) & 3,
                 detail = key & 0xFFFFFFFFull;
  uint64_t first = 0;
  if (t > 0) {
    SS_ASSIGN_OR_RETURN(first, u32(4 * (t - 1)));
  }
  SS_ASSIGN_OR_RETURN(const uint64_t end, u32(4 * t));
  const uint64_t s0 = t * spt, s1 = std::min(s0 + spt, l.subtiles);
  if (what == dk::kPackedSub) {
    const uint64_t sub = s0 + detail;
    SS_RETURN_IF_ERROR(read(l.subs + sub, 1));
    return malformed(
        fmt::format("subtile {}: count {} over its {} elements", sub, buf[0], sub_elems(sub)));
  }
  if (what == dk::kPackedSum) {
    SS_RETURN_IF_ERROR(read(l.subs + s0, s1 - s0));
    uint64_t sum = 0;
    for (unsigned char c : buf) sum += c;
    return malformed(fmt::format("tile {}: subtile counts sum to {}, the running counts say {}", t,
                                 sum, end - first));
  }
  if (what == dk::kPackedRecord) {
    const uint64_t k = first + (detail >> 8), sub = s0 + (detail & 0xFF);
    SS_RETURN_IF_ERROR(read(l.offsets + k - (k > 0 ? 1 : 0), k > 0 ? 2 : 1));
    const uint64_t off = buf.back(), prev = buf.front(), m = sub_elems(sub);
    if (off >= m)
      return malformed(
          fmt::format("record {}: element {} of subtile {} out of range [0, {})", k, off, sub, m));
    return malformed(fmt::format("record {}: element {} of subtile {} not above the previous {}", k,
                                 off, sub, prev));
  }
  uint64_t efirst = 0;
  if (t > 0) {
    SS_ASSIGN_OR_RETURN(efirst, u32(l.escape_ends + 4 * (t - 1)));
  }
  SS_ASSIGN_OR_RETURN(const uint64_t eend, u32(l.escape_ends + 4 * t));
  SS_RETURN_IF_ERROR(read(l.values + first, end - first));
  uint64_t n = 0;
  for (unsigned char v : buf) n += v == kDeltaEscape;
  return malformed(fmt::format("tile {}: {} escaped values, the running escape counts say {}", t, n,
                               eend - efirst));
}

}  // namespace

Status FinishDeltaDecode(DeltaGpuScratch* scratch, std::chrono::milliseconds timeout) {
  Scratch* s = Check(scratch);
  if (s == nullptr || s->op_ != Scratch::Op::kDecode)
    return FailedPreconditionError("device delta decode: no decode in flight on this scratch");
  SS_RETURN_IF_ERROR(s->Wait(timeout, "device delta decode"));
  s->op_ = Scratch::Op::kNone;
  const dk::HostResult r = s->Result();
  if (r.code == dk::kOk) return OkStatus();
  const dk::HeaderView h =
      dk::ParseHeader(r.header, s->encoded_bytes_, s->element_size_, s->bucket_bytes_, s->version_);
  const std::string& name = s->bucket_;
  auto malformed = [&](std::string what) {
    return DataLossError(fmt::format("delta of bucket {}: malformed encoding: {}", name, what));
  };
  switch (r.code) {
    case dk::kBadMagic:
      return malformed(fmt::format("magic {:#x}", h.magic));
    case dk::kBadFormat:
      return malformed(fmt::format("format {}", h.format));
    case dk::kBadKind:
      return malformed(fmt::format("kind {}", h.kind));
    case dk::kBadElementSize:
      return malformed(fmt::format("element_size {}", h.element_size));
    case dk::kBadReserved:
      return malformed("reserved byte 7 not zero");
    case dk::kBadElements:
      return malformed(fmt::format("elements {} over the limit {}", h.elements, kDeltaMaxElements));
    case dk::kBadCount:
      return malformed(fmt::format("count {} over elements {}", h.changed, h.elements));
    case dk::kBadPacked:
      return malformed(
          fmt::format("packed form of {} changes of {}-byte elements: over the form's limit",
                      h.changed, h.element_size));
    case dk::kBadLength:
      if (h.kind == static_cast<int>(DeltaKind::kPacked) && h.element_size == 2)
        return malformed(fmt::format(
            "{} payload bytes, the header's packed form of {} changes needs {} plus 2 per escape "
            "(at most {})",
            s->encoded_bytes_ - kDeltaHeaderBytes, h.changed, h.payload, h.changed));
      return malformed(fmt::format("{} payload bytes, the header's {} form of {} changes needs {}",
                                   s->encoded_bytes_ - kDeltaHeaderBytes,
                                   DeltaKindName(static_cast<DeltaKind>(h.kind)), h.changed,
                                   h.payload));
    case dk::kExpectElementSize:
      return InvalidArgumentError(
          fmt::format("delta of bucket {}: element_size {} in the encoding, the receiver's is {}",
                      name, h.element_size, s->element_size_));
    case dk::kExpectBucket:
      return InvalidArgumentError(fmt::format(
          "delta of bucket {}: the encoding covers {} elements of {} bytes, the receiver's bucket "
          "is {} bytes",
          name, h.elements, h.element_size, s->bucket_bytes_));
    case dk::kVersion:
      return FailedPreconditionError(fmt::format(
          "delta of bucket {}: computed against base version {}, the receiver holds version {}: "
          "not applied",
          name, h.base_version, s->version_));
    case dk::kBaseChecksum:
      return FailedPreconditionError(fmt::format(
          "delta of bucket {}: base_checksum {:#018x} (version {}), the receiver's bytes have "
          "{:#018x}: not applied",
          name, h.base_checksum, h.base_version, r.have));
    case dk::kBadRecord: {
      // The fault's bytes read back for the host decoder's message (delta.cc, same words).
      const DeltaIndexLayout l = DeltaIndexPayload(h.elements, h.element_size, h.changed);
      const auto* payload = static_cast<const unsigned char*>(s->encoded_) + kDeltaHeaderBytes;
      auto read = [&](uint64_t at, int bytes) -> Result<uint64_t> {
        unsigned char buf[4] = {};
        SS_RETURN_IF_ERROR(OnPrivateStream(
            [&](cudaStream_t st) {
              return cudaMemcpyAsync(buf, payload + at, bytes, cudaMemcpyDeviceToHost, st);
            },
            std::chrono::seconds(10), "device delta decode: read back an index fault"));
        return dk::LoadLE(buf, bytes);
      };
      const uint64_t key = r.detail;
      if (h.kind == static_cast<int>(DeltaKind::kPacked)) return PackedFault(h, key, payload, name);
      switch (key >> 62) {
        case 0: {
          const uint64_t t = key;
          SS_ASSIGN_OR_RETURN(const uint64_t prev, read(4 * (t - 1), 4));
          SS_ASSIGN_OR_RETURN(const uint64_t end, read(4 * t, 4));
          return malformed(
              fmt::format("tile {}: running count {} below the previous tile's {}", t, end, prev));
        }
        case 1: {
          SS_ASSIGN_OR_RETURN(const uint64_t end, read(4 * (l.tiles - 1), 4));
          return malformed(fmt::format("tile {}: running count {}, the count says {}", l.tiles - 1,
                                       end, h.changed));
        }
        case 2: {
          const uint64_t k = (key >> 20) & 0xFFFFFFFFull, t = key & 0xFFFFFull;
          const uint64_t nt = std::min(l.tile_elems, h.elements - t * l.tile_elems);
          SS_ASSIGN_OR_RETURN(const uint64_t off, read(l.offsets + 2 * k, 2));
          if (off >= nt)
            return malformed(fmt::format("record {}: element {} of tile {} out of range [0, {})", k,
                                         off, t, nt));
          SS_ASSIGN_OR_RETURN(const uint64_t prev, read(l.offsets + 2 * (k - 1), 2));
          return malformed(fmt::format("record {}: element {} of tile {} not above the previous {}",
                                       k, off, t, prev));
        }
        default:
          return malformed(fmt::format("index padding byte {} not zero", key & ((1ull << 62) - 1)));
      }
    }
    case dk::kBitmapTail:
      return malformed(fmt::format("bitmap bits set past element {}", h.elements));
    case dk::kPopcount:
      return malformed(
          fmt::format("bitmap has {} bits set, the count says {}", r.detail, h.changed));
    case dk::kResultChecksum:
      return DataLossError(fmt::format(
          "delta of bucket {}: the result's checksum {:#018x} is not the sender's new_checksum "
          "{:#018x} (corrupt values): not applied",
          name, r.have, h.new_checksum));
    default:
      return InternalError(
          fmt::format("delta of bucket {}: device decode reported code {}", name, r.code));
  }
}

Result<DeltaGpuEncoded> EncodeDeltaDevice(const DeltaGpuEncodeArgs& args, DeltaGpuScratch* scratch,
                                          void* stream, std::chrono::milliseconds timeout) {
  SS_RETURN_IF_ERROR(EnqueueDeltaEncode(args, scratch, stream));
  return FinishDeltaEncode(scratch, timeout);
}

Status DecodeDeltaDevice(const DeltaGpuDecodeArgs& args, DeltaGpuScratch* scratch, void* stream,
                         std::chrono::milliseconds timeout) {
  SS_RETURN_IF_ERROR(EnqueueDeltaDecode(args, scratch, stream));
  return FinishDeltaDecode(scratch, timeout);
}

}  // namespace shardsync::gpu
