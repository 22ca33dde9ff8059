// Shared by the batch kernels' files (batch_kernel.cu, lean_kernel.cu, copy_batch.cu,
// synthetic_kernels.cu): launch shape, the device-side descriptors a CopyBatch uploads, and the
// device helpers of the copy loops (element access, casts, the checksum mix, the landed
// readback).
//
// Checksum decomposition (bit-exact with ChecksumPartial): the wire image of a bucket is cut into
// 8-byte words. A word lying entirely inside one run is produced by exactly one thread, which
// mixes it with its word index as it copies. A word that straddles two runs (their boundary is
// not 8-aligned) or the ragged end of a bucket is a "boundary word": after every block finished
// (the last block to finish is elected with a fenced atomic ticket) that block re-reads the few
// boundary words from the wire side of the runs that overlap them. Sums of all words add up mod
// 2^64, so the result does not depend on the split.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "shardsync/checksum.h"
#include "shardsync/gpu.h"

namespace shardsync::gpu::kernels {

// Launch shape. Measured on an H200 (docs/benchmarks.md "GPU data path"): 256 threads; landed
// kernels' registers capped so 3 blocks fit on an SM; 256 KiB of wire bytes per block iteration;
// the last 6 grid-sized rounds of chunks handed out dynamically.
inline constexpr int kThreads = 256;
// Rounds of chunks (grid-sized) at the end of a launch handed out dynamically.
inline constexpr int kDynTail = 6;
inline constexpr int kLandedMinBlocks = 3;
// Work unit of one block iteration.
inline constexpr int64_t kChunkWireBytes = int64_t{256} << 10;

// The hot copy loops' loads and stores are plain: measured ~1% faster than __ldcs / __ldg, and
// .cg stores no better (docs/benchmarks.md "GPU data path").
__device__ __forceinline__ uint4 Load(const uint4* p) { return *p; }
__device__ __forceinline__ void Store(uint4* p, uint4 v) { *p = v; }
// Landed readback loads go through L2 (.cg): .ca (an L1 hit: 33% of L1 sectors hit, L2 reads
// -40% in Nsight Compute) and .lu measured 2-3% slower syncs on an H200 (docs/benchmarks.md).
template <typename T>
__device__ __forceinline__ T Readback(const T* p) {
  return __ldcg(p);
}

// Device-side run descriptor (CopyRun normalized).
struct Desc {
  const unsigned char* in;
  unsigned char* out;
  int64_t in_stride;  // elements; == row_elems when the side is contiguous
  int64_t out_stride;
  int64_t row_elems;
  int64_t numel;
  int64_t wire_offset;  // bytes in the bucket
  int32_t bucket;
  int32_t flags;  // bit0: input contiguous, bit1: output contiguous
};

struct Chunk {
  int32_t desc;
  int32_t pad;         // 1: whole rows of a strided run with 16-byte rows (row-wise vector path)
  int64_t e0, e1;      // element range of the desc
  int32_t seg0, seg1;  // landed segments overlapping the chunk's wire bytes (landed batches)
};

struct Boundary {
  int64_t word;  // word index in the bucket
  int64_t bucket_bytes;
  int32_t bucket;
  int32_t first_desc;  // first desc (in wire order of its bucket) overlapping the word
  int32_t first_seg;   // landed segment holding the word's first byte (landed batches)
  int32_t pad;
};

// A contiguous piece of the receiver's own map of a bucket (landed batches): wire bytes
// [lo, hi) of its bucket live at p (as this process maps the receiver's memory).
struct Seg {
  const unsigned char* p;
  int64_t lo, hi;
};

// ---- element access ----

template <int kSize>
struct Elem;
template <>
struct Elem<1> {
  using T = unsigned char;
};
template <>
struct Elem<2> {
  using T = unsigned short;
};
template <>
struct Elem<4> {
  using T = unsigned int;
};
template <>
struct Elem<8> {
  using T = unsigned long long;
};

__device__ __forceinline__ uint16_t F32BitsToBF16(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Address of element e of a side (base, stride) of desc d.
__device__ __forceinline__ int64_t ElemIndex(int64_t e, int64_t row_elems, int64_t stride,
                                             bool contig) {
  if (contig) return e;
  const int64_t row = e / row_elems;
  return row * stride + (e - row * row_elems);
}

// Loads n consecutive (in row-major order of the run) elements starting at e into a
// little-endian register image. Vector load when they are in one row and aligned.
template <int kSize, int kN>
__device__ __forceinline__ void LoadElems(const unsigned char* base, int64_t e, int64_t row_elems,
                                          int64_t stride, bool contig, uint64_t (&img)[2]) {
  using T = typename Elem<kSize>::T;
  constexpr int kBytes = kSize * kN;  // 8 or 16
  img[0] = 0;
  img[1] = 0;
  int64_t row = 0, col = e;
  if (!contig) {
    row = e / row_elems;
    col = e - row * row_elems;
  }
  if (col + kN <= row_elems) {
    const unsigned char* p = base + (row * stride + col) * kSize;
    if ((reinterpret_cast<uintptr_t>(p) % kBytes) == 0) {
      if constexpr (kBytes == 16) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        img[0] = (static_cast<uint64_t>(v.y) << 32) | v.x;
        img[1] = (static_cast<uint64_t>(v.w) << 32) | v.z;
      } else if constexpr (kBytes == 8) {
        img[0] = __ldg(reinterpret_cast<const unsigned long long*>(p));
      } else {
        static_assert(kBytes == 8 || kBytes == 16);
      }
      return;
    }
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const uint64_t v = static_cast<uint64_t>(reinterpret_cast<const T*>(p)[k]);
      const int bit = k * kSize * 8;
      img[bit / 64] |= v << (bit % 64);
    }
    return;
  }
  // Crosses a row end: element by element.
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const unsigned char* p = base + (row * stride + col) * kSize;
    const uint64_t v = static_cast<uint64_t>(*reinterpret_cast<const T*>(p));
    const int bit = k * kSize * 8;
    img[bit / 64] |= v << (bit % 64);
    if (++col == row_elems) {
      col = 0;
      ++row;
    }
  }
}

template <int kSize, int kN>
__device__ __forceinline__ void StoreElems(unsigned char* base, int64_t e, int64_t row_elems,
                                           int64_t stride, bool contig, const uint64_t (&img)[2]) {
  using T = typename Elem<kSize>::T;
  constexpr int kBytes = kSize * kN;
  int64_t row = 0, col = e;
  if (!contig) {
    row = e / row_elems;
    col = e - row * row_elems;
  }
  if (col + kN <= row_elems) {
    unsigned char* p = base + (row * stride + col) * kSize;
    if ((reinterpret_cast<uintptr_t>(p) % kBytes) == 0) {
      if constexpr (kBytes == 16) {
        uint4 v;
        v.x = static_cast<uint32_t>(img[0]);
        v.y = static_cast<uint32_t>(img[0] >> 32);
        v.z = static_cast<uint32_t>(img[1]);
        v.w = static_cast<uint32_t>(img[1] >> 32);
        *reinterpret_cast<uint4*>(p) = v;
      } else {
        *reinterpret_cast<unsigned long long*>(p) = img[0];
      }
      return;
    }
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const int bit = k * kSize * 8;
      reinterpret_cast<T*>(p)[k] = static_cast<T>(img[bit / 64] >> (bit % 64));
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    unsigned char* p = base + (row * stride + col) * kSize;
    const int bit = k * kSize * 8;
    *reinterpret_cast<T*>(p) = static_cast<T>(img[bit / 64] >> (bit % 64));
    if (++col == row_elems) {
      col = 0;
      ++row;
    }
  }
}

// kCast: 0 copy, 1 f32 -> bf16, 2 bf16 -> f32.
template <int kInSize, int kOutSize, int kCast>
__device__ __forceinline__ void Convert(const uint64_t (&in)[2], uint64_t (&out)[2]) {
  if constexpr (kCast == 0) {
    out[0] = in[0];
    out[1] = in[1];
  } else if constexpr (kCast == 1) {  // 4 floats (16 bytes) -> 4 bf16 (8 bytes)
    const uint64_t a = F32BitsToBF16(static_cast<uint32_t>(in[0]));
    const uint64_t b = F32BitsToBF16(static_cast<uint32_t>(in[0] >> 32));
    const uint64_t c = F32BitsToBF16(static_cast<uint32_t>(in[1]));
    const uint64_t d = F32BitsToBF16(static_cast<uint32_t>(in[1] >> 32));
    out[0] = a | (b << 16) | (c << 32) | (d << 48);
    out[1] = 0;
  } else {  // 4 bf16 -> 4 floats
    out[0] = ((in[0] & 0xffffull) << 16) | ((in[0] >> 16 & 0xffffull) << 48);
    out[1] = ((in[0] >> 32 & 0xffffull) << 16) | ((in[0] >> 48 & 0xffffull) << 48);
  }
}

// Wire element bytes of the desc for element e (boundary-word path; reads what landed).
template <int kInSize, int kOutSize, bool kWireIsOut>
__device__ __forceinline__ uint64_t WireElem(const Desc& d, int64_t e) {
  if constexpr (kWireIsOut) {
    using T = typename Elem<kOutSize>::T;
    const int64_t i = ElemIndex(e, d.row_elems, d.out_stride, d.flags & 2);
    return static_cast<uint64_t>(reinterpret_cast<const volatile T*>(d.out)[i]);
  } else {
    using T = typename Elem<kInSize>::T;
    const int64_t i = ElemIndex(e, d.row_elems, d.in_stride, d.flags & 1);
    return static_cast<uint64_t>(reinterpret_cast<const volatile T*>(d.in)[i]);
  }
}

// ChecksumMixWord with the key (index * kChecksumStep + kChecksumSeed) precomputed.
__device__ __forceinline__ uint64_t MixKeyed(uint64_t word, uint64_t key) {
  const uint64_t t = (word ^ key) * kChecksumMul;
  return t ^ (t >> 32);
}

__device__ __forceinline__ uint64_t Lo(const uint4& v) {
  return (static_cast<uint64_t>(v.y) << 32) | v.x;
}
__device__ __forceinline__ uint64_t Hi(const uint4& v) {
  return (static_cast<uint64_t>(v.w) << 32) | v.z;
}
__device__ __forceinline__ uint4 Make4(uint64_t lo, uint64_t hi) {
  return make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                    static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
}
__device__ __forceinline__ uint64_t Bf16x4(const uint4& f) {  // 4 floats -> 4 bf16
  return static_cast<uint64_t>(F32BitsToBF16(f.x)) |
         static_cast<uint64_t>(F32BitsToBF16(f.y)) << 16 |
         static_cast<uint64_t>(F32BitsToBF16(f.z)) << 32 |
         static_cast<uint64_t>(F32BitsToBF16(f.w)) << 48;
}
__device__ __forceinline__ uint4 F32x4(uint64_t h) {  // 4 bf16 -> 4 floats
  return make_uint4(
      static_cast<uint32_t>(h & 0xffff) << 16, static_cast<uint32_t>(h >> 16 & 0xffff) << 16,
      static_cast<uint32_t>(h >> 32 & 0xffff) << 16, static_cast<uint32_t>(h >> 48 & 0xffff) << 16);
}

// Two wire words: input vectors -> output vectors and the two wire words.
template <int kCast, int kInV, int kOutV>
__device__ __forceinline__ void PairConvert(const uint4 (&a)[kInV], uint4 (&o)[kOutV], uint64_t* w0,
                                            uint64_t* w1) {
  if constexpr (kCast == 0) {
    o[0] = a[0];
    *w0 = Lo(a[0]);
    *w1 = Hi(a[0]);
  } else if constexpr (kCast == 1) {  // 8 floats in, 8 bf16 out (the wire)
    *w0 = Bf16x4(a[0]);
    *w1 = Bf16x4(a[1]);
    o[0] = Make4(*w0, *w1);
  } else {  // 8 bf16 in (the wire), 8 floats out
    *w0 = Lo(a[0]);
    *w1 = Hi(a[0]);
    o[0] = F32x4(*w0);
    o[1] = F32x4(*w1);
  }
}

// ---- landed readback (pack with BatchSpec::landed_runs) ----
// A thread reads back the wire words it has just written, through the RECEIVER's segments (not
// its own destinations), so a word placed anywhere but where the receiver expects it changes the
// landed sum. The bytes were written by this thread microseconds earlier, so the loads hit L2.

// First index in [lo, hi) whose segment ends after wire byte pos (segments tile the bucket).
__device__ __forceinline__ int FindSeg(const Seg* segs, int lo, int hi, int64_t pos) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (segs[mid].hi > pos) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// Landed bytes [pos, end) (end - pos <= 8) assembled byte by byte from segment t on.
__device__ __forceinline__ uint64_t LandedBytes(const Seg* segs, int t, int64_t pos, int64_t end) {
  uint64_t word = 0;
  for (int64_t x = pos; x < end; ++x) {
    while (segs[t].hi <= x) ++t;
    const uint64_t b = Readback(segs[t].p + (x - segs[t].lo));
    word |= b << (8 * (x - pos));
  }
  return word;
}

// The landed word at wire byte pos (a multiple of 8; a full word of the bucket) from the chunk's
// segments [first, end).
__device__ __forceinline__ uint64_t LandedWordAt(const Seg* segs, int first, int end, int64_t pos) {
  const int t = FindSeg(segs, first, end, pos);
  const Seg g = segs[t];
  const unsigned char* p = g.p + (pos - g.lo);
  if (pos + 8 <= g.hi && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
    return Readback(reinterpret_cast<const unsigned long long*>(p));
  }
  return LandedBytes(segs, t, pos, pos + 8);
}

// Adds v of every lane of the warp to *dst (one atomic per warp; no block barrier, so blocks
// never drain their loads in flight between chunks).
__device__ __forceinline__ void WarpAdd(uint64_t v, unsigned long long* dst) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0 && v != 0) atomicAdd(dst, static_cast<unsigned long long>(v));
}

// How a signaled launch (CopyBatch::LaunchSignaled) ends: the last block moves the sums to host
// memory, re-zeroes them for the next launch and then stores `seq` at `flag` (null: a plain
// launch; the host copies the sums after the kernel).
struct Finish {
  unsigned long long* host_sums = nullptr;    // nb (mapped host memory)
  unsigned long long* host_landed = nullptr;  // nb, landed kernels
  unsigned long long* flag = nullptr;
  unsigned long long seq = 0;
  int nb = 0;
};

// One kernel for every mode: kStore false is kVerify.
// kLanded (pack only): also sum every landed wire word read back through `segs` into

// BatchKernel (batch_kernel.cu): one kernel for every mode, chosen per batch.
using KernelFn = void (*)(const Desc*, const Chunk*, int, const Boundary*, int, int,
                          unsigned long long*, unsigned int*, const Seg*,
                          unsigned long long* const*, Finish);
// The BatchKernel variant for a batch (cast: 0 copy, 1 f32 -> bf16 pack, 2 bf16 -> f32 unpack).
Result<KernelFn> PickKernel(BatchMode mode, int in_size, int cast, bool landed);

// ---- lean landed pack (the common chunks of a landed pack, in a kernel of their own) ----
//
// BatchKernel carries every path (strided words, edge elements, boundary words, segment search)
// and so the registers of all of them. Nearly every chunk of a real plan is one of two simple
// shapes: contiguous, or whole 16-byte-multiple rows at a stride (row-parallel shards), with
// 16-byte aligned sides and the receiver's map one contiguous segment. Those can run here first;
// BatchKernel, launched right after on the same stream, does the rest (and the boundary words).
// Sums are added to the same places. Measured on an H200 (docs/benchmarks.md, sixth session):
// f32 -> bf16 packs gain 7% (its BatchKernel variant spills), bf16 copies gain nothing (no
// variant of streams x blocks beat BatchKernel), so only the cast uses it by default.
struct LeanChunk {
  const unsigned char* in;
  unsigned char* out;
  const unsigned char* landed;    // the receiver's map of the chunk's wire bytes (contiguous)
  int64_t in_stride, out_stride;  // bytes between row starts
  uint64_t word0;                 // wire word index (in its bucket) of the chunk's first word
  uint32_t pairs, ppr;            // 16-byte wire pairs in the chunk, and per row
  int32_t bucket, pad;
};

// kU streams per thread; kBlocks resident blocks per SM the registers are capped for.
using LeanFn = void (*)(const LeanChunk*, int, unsigned long long*, unsigned long long* const*,
                        unsigned int*);
// The lean kernel for a landed pack with this cast, or null (BatchKernel alone): on for the
// f32 -> bf16 cast only (bf16 copies gained nothing from it, measured on an H200).
LeanFn PickLean(int cast);
// Lean chunk for `c` (pad: whole-row chunk) or nullopt when it does not have the lean shape.
std::optional<LeanChunk> ToLean(const Chunk& c, const Desc& d, const Seg& seg, int in_size,
                                int wire_size);

}  // namespace shardsync::gpu::kernels
