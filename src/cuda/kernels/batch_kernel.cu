// BatchKernel: the batched pack / unpack / verify kernel with the fused checksum (kernels.cuh),
// and the variant each batch runs.
#include <string>

#include "cuda/kernels/kernels.cuh"

namespace shardsync::gpu::kernels {
namespace {

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
          const uint4 v = Readback(reinterpret_cast<const uint4*>(a));
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
          PairConvert<kCast>(av, o, &w0, &w1);
          if constexpr (kStore) {
            uint4* out_v = reinterpret_cast<uint4*>(
                const_cast<unsigned char*>(row_ptr(p, d.out, d.out_stride, kOutSize)));
#pragma unroll
            for (int k = 0; k < kOutV; ++k) Store(out_v + k, o[k]);
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
            for (int k = 0; k < kInV; ++k) av[u][k] = Load(in_v + k);
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
          for (int k = 0; k < kInV; ++k) av[k] = Load(in_v + k);
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
        PairConvert<kCast>(av, o, &w0, &w1);
        if constexpr (kStore) {
#pragma unroll
          for (int k = 0; k < kOutV; ++k) Store(out_v + p * kOutV + k, o[k]);
        }
        acc += MixKeyed(w0, key) + MixKeyed(w1, key + kChecksumStep);
        if constexpr (kLanded) check(vp + 2 * p, w0, w1);
      };
      for (int64_t q = threadIdx.x; q < quarter; q += kThreads) {
        uint4 a[kU][kInV];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
          for (int k = 0; k < kInV; ++k) a[u][k] = Load(in_v + (q + u * quarter) * kInV + k);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) one(q + u * quarter, a[u], key0 + u * kKeyQ);
        key0 += kKeyStep;
      }
      for (int64_t q = kU * quarter + threadIdx.x; q < pairs; q += kThreads) {
        uint4 a[kInV];
#pragma unroll
        for (int k = 0; k < kInV; ++k) a[k] = Load(in_v + q * kInV + k);
        one(q, a, (static_cast<uint64_t>(vp) + 2 * q) * kChecksumStep + kChecksumSeed);
      }
    }
    // Full words outside the vector range: copy, cast, checksum, word by word.
    const int64_t general = (wb - wa) - (vend - vp);
    for (int64_t k = threadIdx.x; k < general; k += kThreads) {
      const int64_t w = wa + k < vp ? wa + k : vend + (k - (vp - wa));
      const int64_t e = ef0 + (w - wa) * kN;
      uint64_t in[2], out[2];
      LoadElems<kInSize, kN>(d.in, e, d.row_elems, d.in_stride, in_contig, in);
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

// Pairs of wire words in flight per thread (streams over quarters / halves of a chunk): 4 for
// plain packs, 2 with the landed readback (its registers; measured on an H200, see
// docs/benchmarks.md).
template <bool kL>
Result<KernelFn> PickPack(int in_size, int cast) {
  return PickPackU < kL, kL ? 2 : 4 > (in_size, cast);
}

}  // namespace

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

}  // namespace shardsync::gpu::kernels
