// Batched pack / unpack / verify kernels with the fused shardsync checksum, the synthetic-weight
// fill and check kernels, and the device plumbing of gpu.h.
//
// Checksum decomposition (bit-exact with ChecksumPartial): the wire image of a bucket is cut into
// 8-byte words. A word lying entirely inside one run is produced by exactly one thread, which
// mixes it with its word index as it copies. A word that straddles two runs (their boundary is
// not 8-aligned) or the ragged end of a bucket is a "boundary word": after every block finished
// (the last block to finish is elected with a fenced atomic ticket) that block re-reads the few
// boundary words from the wire side of the runs that overlap them. Sums of all words add up mod
// 2^64, so the result does not depend on the split.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_util.h"
#include "shardsync/checksum.h"
#include "shardsync/gpu.h"

namespace shardsync::gpu {

using internal::CudaStatus;

namespace {

// Launch shape; build-time knobs only so variants can be measured against each other.
#ifndef SHARDSYNC_GPU_THREADS
#define SHARDSYNC_GPU_THREADS 256
#endif
#ifndef SHARDSYNC_GPU_LANDED_MIN_BLOCKS
#define SHARDSYNC_GPU_LANDED_MIN_BLOCKS 3
#endif
#ifndef SHARDSYNC_GPU_CHUNK_KIB
#define SHARDSYNC_GPU_CHUNK_KIB 256
#endif
#ifndef SHARDSYNC_GPU_DYN_TAIL
#define SHARDSYNC_GPU_DYN_TAIL 6
#endif
constexpr int kThreads = SHARDSYNC_GPU_THREADS;
// Rounds of chunks (grid-sized) at the end of a launch handed out dynamically.
constexpr int kDynTail = SHARDSYNC_GPU_DYN_TAIL;
// Landed kernels: registers capped so 3 blocks fit on an SM (measured best on an H200, see
// docs/benchmarks.md "GPU data path").
constexpr int kLandedMinBlocks = SHARDSYNC_GPU_LANDED_MIN_BLOCKS;
// Work unit of one block iteration.
constexpr int64_t kChunkWireBytes = int64_t{SHARDSYNC_GPU_CHUNK_KIB} << 10;

// Cache hints of the hot copy loops (source loads, destination stores). Build-time knobs so the
// variants can be measured against each other (docs/benchmarks.md "GPU data path": plain loads
// measured ~1% faster than __ldcs / __ldg, .cg stores no better).
#ifndef SHARDSYNC_GPU_LOAD
#define SHARDSYNC_GPU_LOAD LoadPlain
#endif
#ifndef SHARDSYNC_GPU_STORE
#define SHARDSYNC_GPU_STORE StorePlain
#endif
// Landed readback loads: through L2 (.cg). .ca (an L1 hit: 33% of L1 sectors hit, L2 reads -40%
// in Nsight Compute) and .lu measured 2-3% slower syncs on an H200 (docs/benchmarks.md).
#ifndef SHARDSYNC_GPU_READBACK
#define SHARDSYNC_GPU_READBACK __ldcg
#endif
[[maybe_unused]] __device__ __forceinline__ uint4 LoadPlain(const uint4* p) { return *p; }
[[maybe_unused]] __device__ __forceinline__ void StorePlain(uint4* p, uint4 v) { *p = v; }

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
                                          int64_t stride, bool contig, uint64_t (&img)[2],
                                          bool is_volatile) {
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
    if (!is_volatile && (reinterpret_cast<uintptr_t>(p) % kBytes) == 0) {
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
      const uint64_t v = is_volatile
                             ? static_cast<uint64_t>(reinterpret_cast<const volatile T*>(p)[k])
                             : static_cast<uint64_t>(reinterpret_cast<const T*>(p)[k]);
      const int bit = k * kSize * 8;
      img[bit / 64] |= v << (bit % 64);
    }
    return;
  }
  // Crosses a row end: element by element.
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const unsigned char* p = base + (row * stride + col) * kSize;
    const uint64_t v = is_volatile ? static_cast<uint64_t>(*reinterpret_cast<const volatile T*>(p))
                                   : static_cast<uint64_t>(*reinterpret_cast<const T*>(p));
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
__device__ __forceinline__ void PairConvertImpl(const uint4 (&a)[kInV], uint4 (&o)[kOutV],
                                                uint64_t* w0, uint64_t* w1, bool wire_is_out) {
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
  (void)wire_is_out;
}
template <int kCast, int kInV, int kOutV>
__device__ __forceinline__ void PairConvert(const uint4 (&a)[kInV], uint4 (&o)[kOutV], uint64_t* w0,
                                            uint64_t* w1, bool wire_is_out) {
  PairConvertImpl<kCast, kInV, kOutV>(a, o, w0, w1, wire_is_out);
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
    const uint64_t b = SHARDSYNC_GPU_READBACK(segs[t].p + (x - segs[t].lo));
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
    return SHARDSYNC_GPU_READBACK(reinterpret_cast<const unsigned long long*>(p));
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
// *landed[bucket] (see landed_pair).
template <int kInSize, int kOutSize, int kCast, bool kWireIsOut, bool kStore, bool kLanded,
          int kU = 4>
__global__ void __launch_bounds__(kThreads, kLanded ? kLandedMinBlocks : 1)
    BatchKernel(const Desc* __restrict__ descs, const Chunk* __restrict__ chunks, int num_chunks,
                const Boundary* __restrict__ bounds, int num_bounds, int num_descs,
                unsigned long long* sums, unsigned int* ticket, const Seg* __restrict__ segs,
                unsigned long long* const* __restrict__ landed, Finish fin) {
  constexpr int kWireSize = kWireIsOut ? kOutSize : kInSize;
  constexpr int kN = 8 / kWireSize;  // elements per wire word
  __shared__ bool is_last;

  // Chunks: all but the last kDynTail rounds statically (block b takes b, b + grid, ...; no
  // barrier), the tail through an atomic counter, so blocks that ran fast take more of it and the
  // kernel does not wait for the slowest block's last static chunk.
  __shared__ int dyn_next;
  const int static_end = max(0, num_chunks - kDynTail * static_cast<int>(gridDim.x));
  for (int c = blockIdx.x;; c += gridDim.x) {
    if (c >= static_end) {
      if (kDynTail == 0) break;
      __syncthreads();  // every thread has read dyn_next of the previous round
      if (threadIdx.x == 0) dyn_next = static_end + static_cast<int>(atomicAdd(ticket + 1, 1u));
      __syncthreads();
      c = dyn_next;
      if (c >= num_chunks) break;
    }
    const Chunk ch = chunks[c];
    const Desc d = descs[ch.desc];
    const bool in_contig = d.flags & 1, out_contig = d.flags & 2;
    const int64_t a = d.wire_offset + ch.e0 * kWireSize;  // wire byte range of the chunk
    const int64_t b = d.wire_offset + ch.e1 * kWireSize;
    const int64_t wa = (a + 7) / 8, wb = b / 8;  // full words [wa, wb)
    const int64_t ef0 = wa * 8 >= b ? ch.e1 : (wa * 8 - d.wire_offset) / kWireSize;
    const int64_t ef1 = wb <= wa ? ef0 : (wb * 8 - d.wire_offset) / kWireSize;
    // This chunk's source sum, and (kLanded) how the landed words' sum differs from it: a landed
    // word equal to the word written mixes to the same term, so only differing words are mixed
    // (twice): the landed sum acc + ldelta is exactly the checksum of the words read back.
    uint64_t acc = 0, ldelta = 0;
    // The receiver's map of the chunk: usually one segment (then no search per word).
    const bool one_seg = kLanded && ch.seg1 - ch.seg0 == 1;
    uintptr_t lbase = 0;
    if constexpr (kLanded) {
      const Seg g = segs[ch.seg0];
      lbase = reinterpret_cast<uintptr_t>(g.p) - static_cast<uintptr_t>(g.lo);
    }
    // Landed words at wire bytes [pos, pos + 16) (two words) or [pos, pos + 8).
    auto landed_pair = [&](int64_t pos, uint64_t* l0, uint64_t* l1) {
      if (one_seg) {
        const uintptr_t a = lbase + static_cast<uintptr_t>(pos);
        if ((a & 15) == 0) {
          const uint4 v = SHARDSYNC_GPU_READBACK(reinterpret_cast<const uint4*>(a));
          *l0 = (static_cast<uint64_t>(v.y) << 32) | v.x;
          *l1 = (static_cast<uint64_t>(v.w) << 32) | v.z;
          return;
        }
      }
      *l0 = LandedWordAt(segs, ch.seg0, ch.seg1, pos);
      *l1 = LandedWordAt(segs, ch.seg0, ch.seg1, pos + 8);
    };
    // Reads back wire words (word, word + 1), written as (w0, w1); only differing words are mixed.
    auto check = [&](int64_t word, uint64_t w0, uint64_t w1) {
      uint64_t l0, l1;
      landed_pair(word * 8, &l0, &l1);
      if (l0 != w0 || l1 != w1) {
        const uint64_t key = static_cast<uint64_t>(word) * kChecksumStep + kChecksumSeed;
        ldelta += MixKeyed(l0, key) - MixKeyed(w0, key) + MixKeyed(l1, key + kChecksumStep) -
                  MixKeyed(w1, key + kChecksumStep);
      }
    };
    // Fast path: both sides contiguous and 16-byte aligned at an even word: two wire words per
    // 16/32-byte vector access, two pairs in flight per thread, keys advanced by addition.
    int64_t vp = wb, vend = wb;  // vector words [vp, vend)
    if (d.flags == 3 && wb - wa >= 4) {
      for (int64_t cand = wa; cand < wa + 2; ++cand) {
        const int64_t e = ef0 + (cand - wa) * kN;
        const uintptr_t ip = reinterpret_cast<uintptr_t>(d.in + e * kInSize);
        const uintptr_t op = kStore ? reinterpret_cast<uintptr_t>(d.out + e * kOutSize) : 0;
        if (ip % 16 == 0 && op % 16 == 0) {
          vp = cand;
          vend = cand + (wb - cand) / 2 * 2;
          break;
        }
      }
    }
    bool rows_done = false;
    if (ch.pad == 1 && wb - wa == (b - a) / 8) {
      // Row-wise vector path (strided run, whole rows, see Init): pair q of the chunk lies in
      // row q / ppr at pair q % ppr; both sides are 16-byte aligned at every row start iff the
      // row bases are, checked per row (uniform in practice).
      constexpr int kInV = 2 * kN * kInSize / 16;
      constexpr int kOutV = 2 * kN * kOutSize / 16;
      const int64_t ppr = d.row_elems / (2 * kN);  // pairs per row
      const int64_t r0 = ch.e0 / d.row_elems;
      const int64_t total = (ch.e1 - ch.e0) / d.row_elems * ppr;
      const uint64_t w_first = static_cast<uint64_t>(wa);
      bool aligned = true;
      {
        const uintptr_t ip = reinterpret_cast<uintptr_t>(d.in + r0 * d.in_stride * kInSize);
        const uintptr_t op =
            kStore ? reinterpret_cast<uintptr_t>(d.out + r0 * d.out_stride * kOutSize) : 0;
        aligned = ip % 16 == 0 && op % 16 == 0 && (d.in_stride * kInSize) % 16 == 0 &&
                  (!kStore || (d.out_stride * kOutSize) % 16 == 0);
      }
      if (aligned) {
        // kU streams per thread, each over its own quarter of the chunk's pairs: loads far apart
        // keep more DRAM banks busy than neighbouring ones (+7% on an H200). (row, col) of a pair
        // by 32-bit division: a chunk holds < 2^32 pairs.
        const uint32_t ppr32 = static_cast<uint32_t>(ppr);
        const int64_t quarter = total / kU;
        const uint64_t kKeyQ = 2ull * static_cast<uint64_t>(quarter) * kChecksumStep;
        uint64_t key0 =
            (w_first + 2 * static_cast<uint64_t>(threadIdx.x)) * kChecksumStep + kChecksumSeed;
        auto row_ptr = [&](int64_t p, const unsigned char* base, int64_t stride, int size) {
          const uint32_t rr = static_cast<uint32_t>(p) / ppr32;
          const int64_t c = p - static_cast<int64_t>(rr) * ppr;
          return base + ((r0 + rr) * stride + c * 2 * kN) * size;
        };
        auto one = [&](int64_t p, const uint4(&av)[kInV], uint64_t key) {
          uint4 o[kOutV];
          uint64_t w0, w1;
          PairConvert<kCast>(av, o, &w0, &w1, kWireIsOut);
          if constexpr (kStore) {
            uint4* out_v = reinterpret_cast<uint4*>(
                const_cast<unsigned char*>(row_ptr(p, d.out, d.out_stride, kOutSize)));
#pragma unroll
            for (int k = 0; k < kOutV; ++k) SHARDSYNC_GPU_STORE(out_v + k, o[k]);
          }
          acc += MixKeyed(w0, key) + MixKeyed(w1, key + kChecksumStep);
          if constexpr (kLanded) check(static_cast<int64_t>(w_first) + 2 * p, w0, w1);
        };
        for (int64_t q = threadIdx.x; q < quarter; q += kThreads) {
          uint4 av[kU][kInV];
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const uint4* in_v = reinterpret_cast<const uint4*>(
                row_ptr(q + u * quarter, d.in, d.in_stride, kInSize));
#pragma unroll
            for (int k = 0; k < kInV; ++k) av[u][k] = SHARDSYNC_GPU_LOAD(in_v + k);
          }
#pragma unroll
          for (int u = 0; u < kU; ++u) one(q + u * quarter, av[u], key0 + u * kKeyQ);
          key0 += 2ull * kThreads * kChecksumStep;
        }
        for (int64_t q = kU * quarter + threadIdx.x; q < total; q += kThreads) {
          uint4 av[kInV];
          const uint4* in_v =
              reinterpret_cast<const uint4*>(row_ptr(q, d.in, d.in_stride, kInSize));
#pragma unroll
          for (int k = 0; k < kInV; ++k) av[k] = SHARDSYNC_GPU_LOAD(in_v + k);
          one(q, av, (w_first + 2 * static_cast<uint64_t>(q)) * kChecksumStep + kChecksumSeed);
        }
        vp = wa;
        vend = wb;  // every full word done
        rows_done = true;
      }
    }
    if (!rows_done && vp < vend) {
      constexpr int kInV = 2 * kN * kInSize / 16;    // uint4 per pair on the input side
      constexpr int kOutV = 2 * kN * kOutSize / 16;  // and on the output side
      const int64_t e_v = ef0 + (vp - wa) * kN;
      const uint4* in_v = reinterpret_cast<const uint4*>(d.in + e_v * kInSize);
      uint4* out_v = kStore ? reinterpret_cast<uint4*>(d.out + e_v * kOutSize) : nullptr;
      const int64_t pairs = (vend - vp) / 2;
      // kU streams per thread over quarters of the range (see the row-wise path).
      const int64_t quarter = pairs / kU;
      const uint64_t kKeyQ = 2ull * static_cast<uint64_t>(quarter) * kChecksumStep;
      constexpr uint64_t kKeyStep = 2ull * kThreads * kChecksumStep;
      uint64_t key0 = (static_cast<uint64_t>(vp) + 2 * threadIdx.x) * kChecksumStep + kChecksumSeed;
      auto one = [&](int64_t p, const uint4(&av)[kInV], uint64_t key) {
        uint4 o[kOutV];
        uint64_t w0, w1;
        PairConvert<kCast>(av, o, &w0, &w1, kWireIsOut);
        if constexpr (kStore) {
#pragma unroll
          for (int k = 0; k < kOutV; ++k) SHARDSYNC_GPU_STORE(out_v + p * kOutV + k, o[k]);
        }
        acc += MixKeyed(w0, key) + MixKeyed(w1, key + kChecksumStep);
        if constexpr (kLanded) check(vp + 2 * p, w0, w1);
      };
      for (int64_t q = threadIdx.x; q < quarter; q += kThreads) {
        uint4 a[kU][kInV];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
          for (int k = 0; k < kInV; ++k)
            a[u][k] = SHARDSYNC_GPU_LOAD(in_v + (q + u * quarter) * kInV + k);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) one(q + u * quarter, a[u], key0 + u * kKeyQ);
        key0 += kKeyStep;
      }
      for (int64_t q = kU * quarter + threadIdx.x; q < pairs; q += kThreads) {
        uint4 a[kInV];
#pragma unroll
        for (int k = 0; k < kInV; ++k) a[k] = SHARDSYNC_GPU_LOAD(in_v + q * kInV + k);
        one(q, a, (static_cast<uint64_t>(vp) + 2 * q) * kChecksumStep + kChecksumSeed);
      }
    }
    // Full words outside the vector range: copy, cast, checksum, word by word.
    const int64_t general = (wb - wa) - (vend - vp);
    for (int64_t k = threadIdx.x; k < general; k += kThreads) {
      const int64_t w = wa + k < vp ? wa + k : vend + (k - (vp - wa));
      const int64_t e = ef0 + (w - wa) * kN;
      uint64_t in[2], out[2];
      LoadElems<kInSize, kN>(d.in, e, d.row_elems, d.in_stride, in_contig, in, false);
      Convert<kInSize, kOutSize, kCast>(in, out);
      if constexpr (kStore) {
        StoreElems<kOutSize, kN>(d.out, e, d.row_elems, d.out_stride, out_contig, out);
      }
      acc += ChecksumMixWord(kWireIsOut ? out[0] : in[0], static_cast<uint64_t>(w));
      if constexpr (kLanded) {
        const uint64_t written = kWireIsOut ? out[0] : in[0];
        const uint64_t l = LandedWordAt(segs, ch.seg0, ch.seg1, w * 8);
        if (l != written) {
          ldelta += ChecksumMixWord(l, static_cast<uint64_t>(w)) -
                    ChecksumMixWord(written, static_cast<uint64_t>(w));
        }
      }
    }
    // Edge elements that share a boundary word with a neighbouring run: copy only.
    if constexpr (kStore) {
      const int64_t head = ef0 - ch.e0, tail = ch.e1 - ef1;
      for (int64_t k = threadIdx.x; k < head + tail; k += kThreads) {
        const int64_t e = k < head ? ch.e0 + k : ef1 + (k - head);
        using TI = typename Elem<kInSize>::T;
        using TO = typename Elem<kOutSize>::T;
        const TI v =
            reinterpret_cast<const TI*>(d.in)[ElemIndex(e, d.row_elems, d.in_stride, in_contig)];
        TO o;
        if constexpr (kCast == 1) {
          o = F32BitsToBF16(static_cast<uint32_t>(v));
        } else if constexpr (kCast == 2) {
          o = static_cast<uint32_t>(v) << 16;
        } else {
          o = static_cast<TO>(v);
        }
        reinterpret_cast<TO*>(d.out)[ElemIndex(e, d.row_elems, d.out_stride, out_contig)] = o;
      }
    }
    WarpAdd(acc, &sums[d.bucket]);
    if constexpr (kLanded) WarpAdd(acc + ldelta, landed[d.bucket]);
  }

  // Elect the last block; it adds the boundary words once every other block's stores are visible.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < num_bounds; i += kThreads) {
    const Boundary bw = bounds[i];
    const int64_t lo = bw.word * 8;
    const int64_t hi = min(lo + 8, bw.bucket_bytes);
    uint64_t word = 0;
    for (int k = bw.first_desc; k < num_descs; ++k) {
      const Desc d = descs[k];
      if (d.bucket != bw.bucket || d.wire_offset >= hi) break;
      const int64_t dend = d.wire_offset + d.numel * kWireSize;
      if (dend <= lo) continue;
      const int64_t from = max(lo, d.wire_offset), to = min(hi, dend);
      for (int64_t pos = from; pos < to; pos += kWireSize) {
        const uint64_t v =
            WireElem<kInSize, kOutSize, kWireIsOut>(d, (pos - d.wire_offset) / kWireSize);
        word |= v << (8 * (pos - lo));
      }
    }
    atomicAdd(&sums[bw.bucket], static_cast<unsigned long long>(
                                    ChecksumMixWord(word, static_cast<uint64_t>(bw.word))));
    if constexpr (kLanded) {  // the edge elements of neighbouring runs, all stored by now
      const uint64_t lw = LandedBytes(segs, bw.first_seg, lo, hi);
      atomicAdd(landed[bw.bucket], static_cast<unsigned long long>(
                                       ChecksumMixWord(lw, static_cast<uint64_t>(bw.word))));
    }
  }
  if (threadIdx.x == 0) {  // reusable by the next launch (stream-ordered)
    ticket[0] = 0;
    ticket[1] = 0;
  }
  if (fin.flag == nullptr) return;
  // Signaled: every sum is final (the other blocks' were fenced before their tickets, this
  // block's boundary words are in after the barrier). Each thread fences its own host stores
  // system-wide before the barrier, so the flag is seen after every sum.
  __syncthreads();
  for (int b = threadIdx.x; b < fin.nb; b += kThreads) {
    fin.host_sums[b] = atomicExch(&sums[b], 0ull);
    if constexpr (kLanded) fin.host_landed[b] = atomicExch(landed[b], 0ull);
  }
  if (threadIdx.x == 0) sums[fin.nb] = 0;  // the lean kernel's ticket
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(fin.flag) = fin.seq;
}

using KernelFn = void (*)(const Desc*, const Chunk*, int, const Boundary*, int, int,
                          unsigned long long*, unsigned int*, const Seg*,
                          unsigned long long* const*, Finish);

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
template <int kCast, int kU, int kBlocks>
__global__ void __launch_bounds__(kThreads, kBlocks)
    LeanPackKernel(const LeanChunk* __restrict__ chunks, int num_chunks, unsigned long long* sums,
                   unsigned long long* const* __restrict__ landed, unsigned int* ticket) {
  constexpr int kInV = kCast == 1 ? 2 : 1;  // input uint4 per wire pair
  constexpr int kInPair = 16 * kInV;
  __shared__ int dyn_next;
  const int static_end = max(0, num_chunks - kDynTail * static_cast<int>(gridDim.x));
  for (int c = blockIdx.x;; c += gridDim.x) {
    if (c >= static_end) {
      if (kDynTail == 0) break;
      __syncthreads();
      if (threadIdx.x == 0) dyn_next = static_end + static_cast<int>(atomicAdd(ticket, 1u));
      __syncthreads();
      c = dyn_next;
      if (c >= num_chunks) break;
    }
    const LeanChunk ch = chunks[c];
    const uint32_t ppr = ch.ppr;
    // kU streams per thread over far-apart parts of the chunk (see BatchKernel); each keeps its
    // (row, col) and steps it by kThreads pairs without dividing again.
    const uint32_t part = ch.pairs / kU;
    const uint32_t step_row = kThreads / ppr, step_col = kThreads % ppr;
    uint32_t row[kU], col[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t p = threadIdx.x + u * part;
      row[u] = p / ppr;
      col[u] = p - row[u] * ppr;
    }
    uint64_t acc = 0, ldelta = 0;
    auto one = [&](uint32_t p, uint32_t r, uint32_t cl, const uint4(&a)[kInV]) {
      uint4 o[1];
      uint64_t w0, w1;
      PairConvert<kCast>(a, o, &w0, &w1, true);
      uint4* dst = reinterpret_cast<uint4*>(ch.out + r * ch.out_stride + cl * 16ull);
      SHARDSYNC_GPU_STORE(dst, o[0]);
      const uint64_t key = (ch.word0 + 2ull * p) * kChecksumStep + kChecksumSeed;
      acc += MixKeyed(w0, key) + MixKeyed(w1, key + kChecksumStep);
      const uint4 l = SHARDSYNC_GPU_READBACK(reinterpret_cast<const uint4*>(ch.landed + 16ull * p));
      const uint64_t l0 = Lo(l), l1 = Hi(l);
      if (l0 != w0 || l1 != w1) {
        ldelta += MixKeyed(l0, key) - MixKeyed(w0, key) + MixKeyed(l1, key + kChecksumStep) -
                  MixKeyed(w1, key + kChecksumStep);
      }
    };
    for (uint32_t q = threadIdx.x; q < part; q += kThreads) {
      uint4 a[kU][kInV];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const uint4* src =
            reinterpret_cast<const uint4*>(ch.in + row[u] * ch.in_stride + col[u] * 1ull * kInPair);
#pragma unroll
        for (int k = 0; k < kInV; ++k) a[u][k] = SHARDSYNC_GPU_LOAD(src + k);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        one(q + u * part, row[u], col[u], a[u]);
        col[u] += step_col;
        row[u] += step_row;
        if (col[u] >= ppr) {
          col[u] -= ppr;
          ++row[u];
        }
      }
    }
    for (uint32_t p = kU * part + threadIdx.x; p < ch.pairs; p += kThreads) {
      const uint32_t r = p / ppr, cl = p - r * ppr;
      uint4 a[kInV];
      const uint4* src =
          reinterpret_cast<const uint4*>(ch.in + r * ch.in_stride + cl * 1ull * kInPair);
#pragma unroll
      for (int k = 0; k < kInV; ++k) a[k] = SHARDSYNC_GPU_LOAD(src + k);
      one(p, r, cl, a);
    }
    WarpAdd(acc, &sums[ch.bucket]);
    WarpAdd(acc + ldelta, landed[ch.bucket]);
  }
}

using LeanFn = void (*)(const LeanChunk*, int, unsigned long long*, unsigned long long* const*,
                        unsigned int*);

// The lean kernel for a landed pack of these element sizes, or null (BatchKernel alone): on for
// the f32 -> bf16 cast. SHARDSYNC_GPU_LEAN=0 turns it off, =1 also on for plain copies (to
// measure).
LeanFn PickLean(int in_size, int out_size, int cast) {
  static const std::string pick = [] {
    const char* e = std::getenv("SHARDSYNC_GPU_LEAN");
    return std::string(e ? e : "");
  }();
  if (pick == "0") return nullptr;
  if (cast == 1) return &LeanPackKernel<1, 2, 4>;
  if (cast == 0 && in_size == out_size && pick == "1") return &LeanPackKernel<0, 2, 4>;
  return nullptr;
}

// Lean chunk for `c` (pad: whole-row chunk) or nullopt when it does not have the lean shape.
std::optional<LeanChunk> ToLean(const Chunk& c, const Desc& d, const Seg& seg, int in_size,
                                int wire_size) {
  if (c.seg1 - c.seg0 != 1) return std::nullopt;
  const int64_t a = d.wire_offset + c.e0 * wire_size, b = d.wire_offset + c.e1 * wire_size;
  if (a % 16 != 0 || (b - a) % 16 != 0 || b <= a || (b - a) / 16 > INT32_MAX) return std::nullopt;
  LeanChunk l{};
  l.landed = seg.p + (a - seg.lo);
  if (reinterpret_cast<uintptr_t>(l.landed) % 16 != 0 || b > seg.hi) return std::nullopt;
  l.pairs = static_cast<uint32_t>((b - a) / 16);
  l.word0 = static_cast<uint64_t>(a / 8);
  l.bucket = d.bucket;
  const int in_pair = 16 / wire_size * in_size;
  if (d.flags == 3) {
    l.in = d.in + c.e0 * in_size;
    l.out = d.out + c.e0 * wire_size;
    l.ppr = l.pairs;
    l.in_stride = static_cast<int64_t>(l.pairs) * in_pair;
    l.out_stride = static_cast<int64_t>(l.pairs) * 16;
  } else if (c.pad == 1) {
    const int64_t row_wire = d.row_elems * wire_size;
    if (row_wire % 16 != 0 || c.e0 % d.row_elems != 0 || (c.e1 - c.e0) % d.row_elems != 0)
      return std::nullopt;
    const int64_t r0 = c.e0 / d.row_elems;
    l.in = d.in + r0 * d.in_stride * in_size;
    l.out = d.out + r0 * d.out_stride * wire_size;
    l.ppr = static_cast<uint32_t>(row_wire / 16);
    l.in_stride = d.in_stride * in_size;
    l.out_stride = d.out_stride * wire_size;
  } else {
    return std::nullopt;
  }
  if (reinterpret_cast<uintptr_t>(l.in) % 16 != 0 || reinterpret_cast<uintptr_t>(l.out) % 16 != 0 ||
      l.in_stride % 16 != 0 || l.out_stride % 16 != 0 || l.ppr == 0) {
    return std::nullopt;
  }
  return l;
}

// Pairs of wire words in flight per thread (streams over quarters / halves of a chunk): 4 for
// plain packs, 2 with the landed readback (its registers; measured on an H200, see
// docs/benchmarks.md). SHARDSYNC_GPU_UNROLL=2|4 overrides both (to measure).
int PackUnroll(bool landed) {
  static const int forced = [] {
    const char* e = std::getenv("SHARDSYNC_GPU_UNROLL");
    return e ? std::atoi(e) : 0;
  }();
  if (forced == 2 || forced == 4) return forced;
  return landed ? 2 : 4;
}

template <bool kL, int kU>
Result<KernelFn> PickPackU(int in_size, int cast) {
  if (cast == 1) return &BatchKernel<4, 2, 1, true, true, kL, kU>;
  switch (in_size) {
    case 1:
      return &BatchKernel<1, 1, 0, false, true, kL, kU>;
    case 2:
      return &BatchKernel<2, 2, 0, false, true, kL, kU>;
    case 4:
      return &BatchKernel<4, 4, 0, false, true, kL, kU>;
    case 8:
      return &BatchKernel<8, 8, 0, false, true, kL, kU>;
  }
  return InvalidArgumentError("batch: unsupported element size " + std::to_string(in_size));
}

template <bool kL>
Result<KernelFn> PickPack(int in_size, int cast) {
  if (PackUnroll(kL) == 2) return PickPackU<kL, 2>(in_size, cast);
  return PickPackU<kL, 4>(in_size, cast);
}

Result<KernelFn> PickKernel(BatchMode mode, int in_size, int cast, bool landed) {
  if (mode == BatchMode::kVerify) {
    switch (in_size) {
      case 1:
        return &BatchKernel<1, 1, 0, false, false, false>;
      case 2:
        return &BatchKernel<2, 2, 0, false, false, false>;
      case 4:
        return &BatchKernel<4, 4, 0, false, false, false>;
      case 8:
        return &BatchKernel<8, 8, 0, false, false, false>;
    }
  } else if (cast == 2) {
    return &BatchKernel<2, 4, 2, false, true, false>;
  } else if (mode == BatchMode::kPack) {
    return landed ? PickPack<true>(in_size, cast) : PickPack<false>(in_size, cast);
  } else {
    return PickPack<false>(in_size, cast);  // same-dtype unpack: a plain copy
  }
  return InvalidArgumentError("batch: unsupported element size " + std::to_string(in_size));
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
    SS_CUDA(cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice), what);
    return OkStatus();
  }
};

// Landed batches: the receiver's runs become contiguous segments (validated to tile every bucket
// exactly, like the pack runs), and every chunk / boundary word learns where its bytes start.
Status BuildLanded(const BatchSpec& spec, int wire_size, std::vector<Chunk>* chunks,
                   std::vector<Boundary>* bounds, const std::vector<Desc>& descs,
                   std::vector<Seg>* segs) {
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
  const auto& runs = spec.landed_runs;
  std::vector<int> order(runs.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const CopyRun& r = runs[i];
    const std::string who = "batch landed run " + std::to_string(i);
    order[i] = static_cast<int>(i);
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
    const int wire_size = spec.mode == BatchMode::kPack ? out_size : in_size;
    const bool landed = !spec.landed_runs.empty();
    SS_ASSIGN_OR_RETURN(kernel_, PickKernel(spec.mode, in_size, cast, landed));
    bucket_bytes_ = spec.bucket_bytes;
    const int nb = static_cast<int>(spec.bucket_bytes.size());

    // Normalize, sort by (bucket, wire offset), validate that each bucket is tiled exactly.
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
    std::vector<Desc> descs;
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
    // Chunks split runs at 8-aligned wire positions, so only run edges make boundary words.
    std::vector<Chunk> chunks;
    std::vector<Boundary> bounds;
    const int64_t step = kChunkWireBytes / wire_size;
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
        if (!bounds.empty() && bounds.back().bucket == d.bucket && bounds.back().word == w)
          continue;
        // first desc overlapping word w: walk back from k while the previous desc reaches it
        int32_t first = static_cast<int32_t>(k);
        while (first > 0 && descs[first - 1].bucket == d.bucket &&
               descs[first - 1].wire_offset + descs[first - 1].numel * wire_size > w * 8) {
          --first;
        }
        bounds.push_back({w, spec.bucket_bytes[d.bucket], d.bucket, first});
      }
    }
    if (landed) {
      std::vector<Seg> segs;
      SS_RETURN_IF_ERROR(BuildLanded(spec, wire_size, &chunks, &bounds, descs, &segs));
      lean_kernel_ = PickLean(in_size, out_size, cast);
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

// ---- synthetic weights on the device (same arithmetic as synthetic.h, no FMA contraction) ----

__device__ __forceinline__ float SyntheticValueDev(uint64_t seed, uint64_t key, float scale,
                                                   float center, int64_t element) {
  uint64_t z =
      seed * 0x9E3779B97F4A7C15ull ^ key ^ (static_cast<uint64_t>(element) * 0xBF58476D1CE4E5B9ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u =
      __fmul_rn(static_cast<float>(static_cast<int64_t>(z >> 40) - (1 << 23)), 1.0f / (1 << 23));
  return __fadd_rn(center, __fmul_rn(scale, u));
}

struct RegionDev {
  int ndim;
  int64_t offset[kMaxDims];
  int64_t extent[kMaxDims];
  int64_t stride[kMaxDims];  // of the tensor
};

RegionDev MakeRegionDev(const Region& r, const Shape& shape) {
  RegionDev d{};
  d.ndim = r.ndim;
  int64_t s = 1;
  for (int i = r.ndim - 1; i >= 0; --i) {
    d.offset[i] = r.offset[i];
    d.extent[i] = r.extent[i];
    d.stride[i] = s;
    s *= shape[i];
  }
  return d;
}

// Tensor element index of the k-th element (row-major) of the region.
__device__ __forceinline__ int64_t RegionElement(const RegionDev& r, int64_t k) {
  int64_t off = 0;
  for (int i = r.ndim - 1; i >= 0; --i) {
    const int64_t q = k / r.extent[i];
    off += (r.offset[i] + (k - q * r.extent[i])) * r.stride[i];
    k = q;
  }
  return off;
}

__global__ void FillSyntheticKernel(uint64_t seed, uint64_t key, float scale, float center,
                                    RegionDev r, int64_t n, bool bf16, void* out) {
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < n;
       k += int64_t{gridDim.x} * blockDim.x) {
    const float v = SyntheticValueDev(seed, key, scale, center, RegionElement(r, k));
    if (bf16) {
      static_cast<uint16_t*>(out)[k] = F32BitsToBF16(__float_as_uint(v));
    } else {
      static_cast<float*>(out)[k] = v;
    }
  }
}

__global__ void CountMismatchKernel(uint64_t seed, uint64_t key, float scale, float center,
                                    RegionDev src, RegionDev dst, int64_t n, const uint16_t* param,
                                    unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < n;
       k += int64_t{gridDim.x} * blockDim.x) {
    const float v = SyntheticValueDev(seed, key, scale, center, RegionElement(src, k));
    bad += param[RegionElement(dst, k)] != F32BitsToBF16(__float_as_uint(v));
  }
  for (int o = 16; o > 0; o >>= 1) bad += __shfl_down_sync(0xffffffffu, bad, o);
  if ((threadIdx.x & 31) == 0 && bad) atomicAdd(mismatches, bad);
}

int GridFor(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 132 * 16));
}

}  // namespace

// ---- device plumbing ----

bool Available(std::string* reason) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (reason) {
      *reason = e != cudaSuccess ? std::string("no CUDA device: ") + cudaGetErrorString(e)
                                 : "no CUDA device";
    }
    cudaGetLastError();
    return false;
  }
  return true;
}

Result<int> DeviceCount() {
  int n = 0;
  SS_CUDA(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  return n;
}

Result<DeviceInfo> QueryDevice(int device) {
  cudaDeviceProp p{};
  SS_CUDA(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties " + std::to_string(device));
  DeviceInfo info;
  info.index = device;
  info.name = p.name;
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) == cudaSuccess) info.pci_bus_id = bus;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.sm_count = p.multiProcessorCount;
  info.total_bytes = static_cast<int64_t>(p.totalGlobalMem);
  info.l2_bytes = p.l2CacheSize;
  int clock_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device);
  info.hbm_peak_gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
  return info;
}

Status SetDevice(int device) {
  SS_CUDA(cudaSetDevice(device), "cudaSetDevice " + std::to_string(device));
  return OkStatus();
}

Result<PeerInfo> DevicePeerInfo(int rank, int device) {
  PeerInfo p = LocalPeerInfo(rank, MemKind::kCuda, device);
  char bus[32] = {};
  SS_CUDA(cudaDeviceGetPCIBusId(bus, sizeof(bus), device),
          "cudaDeviceGetPCIBusId of device " + std::to_string(device));
  p.gpu_id = bus;
  return p;
}

Result<std::unique_ptr<Stream>> Stream::Create(int device) {
  SS_CUDA(cudaSetDevice(device), "stream: cudaSetDevice " + std::to_string(device));
  cudaStream_t s = nullptr;
  SS_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return std::unique_ptr<Stream>(new Stream(s, device));
}

Stream::~Stream() {
  if (handle_) cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
}

Status Stream::Synchronize(Millis timeout, std::string_view what) const {
  // Poll instead of cudaStreamSynchronize so a stuck stream becomes DeadlineExceeded.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(handle_));
    if (e == cudaSuccess) return OkStatus();
    if (e != cudaErrorNotReady) return CudaStatus(e, what);
    if (std::chrono::steady_clock::now() > deadline) {
      return DeadlineExceededError(std::string(what) + ": stream not done after " +
                                   std::to_string(timeout.count()) + " ms");
    }
  }
}

Result<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(size_t bytes, int device) {
  SS_CUDA(cudaSetDevice(device), "alloc: cudaSetDevice " + std::to_string(device));
  void* p = nullptr;
  SS_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 1)),
          "cudaMalloc " + std::to_string(bytes) + " bytes on device " + std::to_string(device));
  return std::unique_ptr<DeviceBuffer>(new DeviceBuffer(p, bytes, device));
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}

Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  SS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "copy to device");
  return OkStatus();
}
Status CopyToHost(void* dst, const void* src, size_t bytes) {
  SS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to host");
  return OkStatus();
}
Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, void* stream) {
  if (stream) {
    SS_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
            "copy device to device");
  } else {
    SS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "copy device to device");
  }
  return OkStatus();
}
Status Memset(void* dst, int value, size_t bytes) {
  SS_CUDA(cudaMemset(dst, value, bytes), "memset");
  return OkStatus();
}

Result<std::unique_ptr<CopyBatch>> CopyBatch::Prepare(const BatchSpec& spec, int device) {
  auto b = std::make_unique<CopyBatchImpl>();
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

Status FillSyntheticDevice(uint64_t seed, const SyntheticTensor& t, const Shape& shape,
                           const Region& r, DType dtype, void* out, void* stream) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return InvalidArgumentError("FillSyntheticDevice: dtype must be F32 or BF16");
  }
  const int64_t n = r.numel();
  if (n == 0) return OkStatus();
  FillSyntheticKernel<<<GridFor(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      seed, t.key, t.scale, t.center, MakeRegionDev(r, shape), n, dtype == DType::kBF16, out);
  SS_CUDA(cudaGetLastError(), "FillSyntheticDevice");
  return OkStatus();
}

Status CountSyntheticMismatches(uint64_t seed, const SyntheticTensor& t, const Shape& src_shape,
                                const Region& src, const Shape& dst_shape, const Region& dst,
                                const void* param, unsigned long long* d_mismatches, void* stream) {
  const int64_t n = src.numel();
  if (n != dst.numel()) {
    return InvalidArgumentError("CountSyntheticMismatches: src " + src.ToString() + " and dst " +
                                dst.ToString() + " differ in element count");
  }
  if (n == 0) return OkStatus();
  CountMismatchKernel<<<GridFor(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      seed, t.key, t.scale, t.center, MakeRegionDev(src, src_shape), MakeRegionDev(dst, dst_shape),
      n, static_cast<const uint16_t*>(param), d_mismatches);
  SS_CUDA(cudaGetLastError(), "CountSyntheticMismatches");
  return OkStatus();
}

}  // namespace shardsync::gpu
