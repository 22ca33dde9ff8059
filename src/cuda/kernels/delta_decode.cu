// The delta decoder on the device (delta_gpu.h): DecodeDeltaInPlace's checks and result.
//
// Every kernel checks the header first (delta_kernels.h ParseHeader, the host's order) and does
// nothing when it is refused.
// Records (DecodeRecordsKernel, index form only): every record checked (in range, strictly
// increasing), and for every tile of the bucket the first record at or past it (a 32-way search
// per warp), so the check pass finds a tile's records without searching.
// Check (DecodeCheckKernel, one tile of the bucket per block): reads the tile once, adds its base
// checksum terms, finds its changed elements (bitmap form: the encoding's bitmap bits; index form:
// its records, marked in a shared-memory bitmap) and their values (bitmap form: offsets from a
// single-pass scan with decoupled look-back; index form: the record number), and adds the new
// minus the old term of every changed word: the result's checksum is predicted from the words in
// registers, never read twice. Writes nothing the caller sees.
// Apply (DecodeApplyKernel): every block takes the same decision from the sums (header, base
// checksum, records, bitmap tail and count, predicted result checksum) and writes the changed
// elements only when it is "apply"; the last block to finish reports to the host and puts the
// control block back at rest.
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/kernels/delta_device.cuh"

namespace shardsync::gpu::delta {
namespace {

struct DecArgs {
  const unsigned char* enc;
  uint64_t enc_bytes;
  unsigned char* bucket;
  uint64_t n;
  uint64_t base_version;
  uint32_t tiles;  // check tiles of the bucket
  ScratchPtrs s;
};

template <int E>
__device__ __forceinline__ uint64_t RecIndex(const unsigned char* payload, uint64_t k) {
  return LoadLE(payload + k * (kDeltaIndexBytes + E), 4);
}
template <int E>
__device__ __forceinline__ uint64_t RecValue(const unsigned char* payload, uint64_t k) {
  return LoadLE(payload + k * (kDeltaIndexBytes + E) + kDeltaIndexBytes, E);
}

template <int E>
__device__ __forceinline__ HeaderView Parse(const DecArgs& a) {
  return ParseHeader(a.enc, a.enc_bytes, E, a.n, a.base_version);
}

// Bits of the bitmap for the 16 / E elements from elem0 (a multiple of 16 / E), zero past the
// last element.
template <int E>
__device__ __forceinline__ unsigned VectorBits(const unsigned char* bitmap, uint64_t elem0,
                                               uint64_t elements) {
  constexpr int kBits = 16 / E;
  const uint64_t j = elem0 / 8;
  unsigned bits;
  if constexpr (E == 1) {
    bits = bitmap[j] | (elem0 + 8 < elements ? unsigned{bitmap[j + 1]} << 8 : 0u);
  } else if constexpr (E == 2) {
    bits = bitmap[j];
  } else {
    bits = (bitmap[j] >> (elem0 % 8)) & 0xfu;
  }
  if (elem0 + kBits > elements) bits &= (1u << (elements - elem0)) - 1;
  return bits;
}

template <int E>
__global__ void __launch_bounds__(kThreads) DecodeRecordsKernel(DecArgs a) {
  __shared__ HeaderView h;
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kIndex)) return;
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  const uint64_t c = h.changed;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k < c;
       k += stride) {
    const uint64_t i = RecIndex<E>(payload, k);
    if (i >= h.elements || (k > 0 && i <= RecIndex<E>(payload, k - 1)))
      atomicMin(&a.s.ctl->bad_record, static_cast<unsigned long long>(k));
  }
  // tile_prefix[t] = first record whose element is in tile t or later (t in [0, tiles]). The
  // records are sorted when they are valid; when not, the answer is still in [0, c] and the
  // decode is refused anyway.
  constexpr uint64_t kTileElems = kTileBytes / E;
  const int lane = threadIdx.x & 31;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * (kThreads / 32);
  for (uint64_t t = (static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; t <= a.tiles;
       t += warps) {
    const uint64_t target = t * kTileElems;
    uint64_t lo = 0, hi = c;  // the answer is in [lo, hi]
    while (hi - lo > 32) {
      const uint64_t step = (hi - lo + 31) / 32;
      const uint64_t p = lo + lane * step;
      const bool ge = p < hi ? RecIndex<E>(payload, p) >= target : true;
      const unsigned m = __ballot_sync(0xffffffffu, ge);
      if (m == 0) {
        lo = lo + 31 * step + 1;
      } else {
        const int f = __ffs(m) - 1;
        const uint64_t new_hi = lo + f * step < hi ? lo + f * step : hi;
        lo = f > 0 ? lo + (f - 1) * step + 1 : lo;
        hi = new_hi;
      }
    }
    const uint64_t p = lo + lane;
    const unsigned m =
        __ballot_sync(0xffffffffu, p < hi ? RecIndex<E>(payload, p) >= target : true);
    if (lane == 0) a.s.tile_prefix[t] = static_cast<uint32_t>(m != 0 ? lo + __ffs(m) - 1 : hi);
  }
}

template <int E>
__global__ void __launch_bounds__(kThreads) DecodeCheckKernel(DecArgs a) {
  constexpr uint64_t kTileElems = kTileBytes / E;
  __shared__ HeaderView h;
  __shared__ uint64_t s_scan[3][kWarps];
  __shared__ uint32_t s_prefix;
  __shared__ uint32_t s_bits[kTileElems / 32];  // index form: the tile's changed elements
  Ctl* c = a.s.ctl;
  // Tile ids in launch order (as the encoder's scan pass: delta_encode.cu).
  const uint32_t t = blockIdx.x;
  const uint64_t n = a.n;
  const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
  uint4 w[kTileVecs];
  if ((static_cast<uint64_t>(t) + 1) * kTileBytes <= n) {  // every load in flight at once
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k)
      w[k] = *reinterpret_cast<const uint4*>(a.bucket + (v0 + uint64_t{kThreads} * k) * 16);
  } else {
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      w[k] = o < n ? LoadVec(a.bucket, o, n) : make_uint4(0, 0, 0, 0);
    }
  }
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk) return;
  const bool index = h.kind == static_cast<int>(DeltaKind::kIndex);
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  const uint64_t elements = h.elements;
  const uint64_t e_lo = static_cast<uint64_t>(t) * kTileElems;
  uint32_t r0 = 0;
  if (index) {
    for (uint32_t i = threadIdx.x; i < kTileElems / 32; i += kThreads) s_bits[i] = 0;
    __syncthreads();
    r0 = a.s.tile_prefix[t];
    const uint32_t r1 = a.s.tile_prefix[t + 1];
    for (uint64_t k = r0 + threadIdx.x; k < r1; k += kThreads) {
      const uint64_t i = RecIndex<E>(payload, k);
      if (i >= e_lo && i < e_lo + kTileElems && i < elements)
        atomicOr(&s_bits[(i - e_lo) / 32], 1u << ((i - e_lo) % 32));
    }
    __syncthreads();
  }
  uint64_t sum = 0, lo = 0, hi = 0;
  unsigned m[kTileVecs];
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    m[k] = 0;
    if (o < n) {
      sum += Mix(Lo64(w[k]), o / 8);
      if (o + 8 < n) sum += Mix(Hi64(w[k]), o / 8 + 1);
      const uint64_t elem0 = o / E;
      if (index) {
        const uint64_t le = elem0 - e_lo;
        m[k] = (s_bits[le / 32] >> (le % 32)) & ((1u << (16 / E)) - 1);
      } else {
        m[k] = VectorBits<E>(payload, elem0, elements);
      }
    }
    const uint64_t cnt = static_cast<uint64_t>(__popc(m[k])) << (16 * (k % 4));
    if (k < 4) {
      lo |= cnt;
    } else {
      hi |= cnt;
    }
  }
  uint64_t v[3] = {lo, hi, sum}, tot[3];
  BlockScanN<3>(v, tot, s_scan);
  const uint64_t ex_lo = v[0], ex_hi = v[1], tot_lo = tot[0], tot_hi = tot[1];
  if (threadIdx.x == 0) atomicAdd(&c->sum_a, static_cast<unsigned long long>(tot[2]));
  uint64_t prefix = r0;
  if (!index) {
    uint32_t aggregate = 0;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k)
      aggregate += static_cast<uint32_t>(((k < 4 ? tot_lo : tot_hi) >> (16 * (k % 4))) & 0xffff);
    if (threadIdx.x < 32) {
      const uint64_t epoch = *reinterpret_cast<volatile unsigned long long*>(&c->epoch);
      const uint32_t p = LookBack(a.s.states, t, aggregate, epoch);
      if (threadIdx.x == 0) {
        s_prefix = p;
        // The apply pass's tiles (kApplyTileElems = 2E segments of this tile's vectors each).
        uint64_t q = p;
#pragma unroll
        for (int k = 0; k < kTileVecs; ++k) {
          if (k % (2 * E) == 0) {
            const uint64_t sub =
                (static_cast<uint64_t>(t) * kTileElems) / kApplyTileElems + k / (2 * E);
            if (sub * kApplyTileElems < elements) a.s.fine_prefix[sub] = static_cast<uint32_t>(q);
          }
          q += ((k < 4 ? tot_lo : tot_hi) >> (16 * (k % 4))) & 0xffff;
        }
        if (t == a.tiles - 1) c->popcount = uint64_t{p} + aggregate;
        const uint64_t tail = elements % 8;
        if (t == 0 && tail != 0 && (payload[DeltaBitmapBytes(elements) - 1] >> tail) != 0)
          c->tail_bad = 1;
      }
    }
    __syncthreads();
    prefix = s_prefix;
  }
  const unsigned char* vals = payload + DeltaBitmapBytes(elements);
  const uint64_t vals_bytes =
      index ? 0 : a.enc_bytes - kDeltaHeaderBytes - DeltaBitmapBytes(elements);
  uint64_t delta = 0;
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t seg = ((k < 4 ? tot_lo : tot_hi) >> (16 * (k % 4))) & 0xffff;
    uint64_t at = prefix + (((k < 4 ? ex_lo : ex_hi) >> (16 * (k % 4))) & 0xffff);
    prefix += seg;
    if (m[k] == 0) continue;
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    const uint64_t old_lo = Lo64(w[k]), old_hi = Hi64(w[k]);
    uint64_t new_lo = old_lo, new_hi = old_hi;
    for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++at) {
      const int byte = (__ffs(mm) - 1) * E;
      uint64_t v = 0;
      if (index) {
        if (at < h.changed) v = RecValue<E>(payload, at);
      } else if ((at + 1) * E <= vals_bytes) {
        v = LoadLE(vals + at * E, E);
      }
      if (byte < 8) {
        new_lo = Patch<E>(new_lo, byte, v);
      } else {
        new_hi = Patch<E>(new_hi, byte - 8, v);
      }
    }
    delta += Mix(new_lo, o / 8) - Mix(old_lo, o / 8);
    delta += Mix(new_hi, o / 8 + 1) - Mix(old_hi, o / 8 + 1);
  }
  delta = BlockSum(delta, s_scan[0]);
  if (threadIdx.x == 0 && delta != 0) atomicAdd(&c->sum_b, static_cast<unsigned long long>(delta));
}

template <int E>
__global__ void __launch_bounds__(kThreads) DecodeApplyKernel(DecArgs a) {
  __shared__ HeaderView h;
  __shared__ uint64_t s_scan[1][kWarps];
  __shared__ uint32_t s_code;
  __shared__ uint64_t s_have, s_detail;
  Ctl* c = a.s.ctl;
  if (threadIdx.x == 0) {
    h = Parse<E>(a);
    uint32_t code = h.code;
    uint64_t have = 0, detail = 0;
    const bool bitmap = h.kind == static_cast<int>(DeltaKind::kBitmap);
    if (code == kOk) {
      have = ChecksumFinish(c->sum_a, a.n);
      if (have != h.base_checksum) {
        code = kBaseChecksum;
      } else if (!bitmap && c->bad_record != ~0ull) {
        code = kBadRecord;
        detail = c->bad_record;
      } else if (bitmap && c->tail_bad != 0) {
        code = kBitmapTail;
      } else if (bitmap && c->popcount != h.changed) {
        code = kPopcount;
        detail = c->popcount;
      } else {
        have = ChecksumFinish(c->sum_a + c->sum_b, a.n);
        if (have != h.new_checksum) code = kResultChecksum;
      }
    }
    s_code = code;
    s_have = have;
    s_detail = detail;
  }
  __syncthreads();
  if (s_code == kOk) {
    using T = std::conditional_t<E == 1, unsigned char,
                                 std::conditional_t<E == 2, unsigned short, uint32_t>>;
    T* out = reinterpret_cast<T*>(a.bucket);
    const unsigned char* payload = a.enc + kDeltaHeaderBytes;
    if (h.kind == static_cast<int>(DeltaKind::kIndex)) {
      const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
      for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k < h.changed;
           k += stride)
        out[RecIndex<E>(payload, k)] = static_cast<T>(RecValue<E>(payload, k));
    } else {
      // A tile: 4 bitmap bytes (32 elements) per thread; its first change's number is in
      // fine_prefix (the check pass). The 32 bits are unrolled and predicated, so a thread's
      // value loads are all in flight before its stores.
      const uint64_t bitmap_bytes = DeltaBitmapBytes(h.elements);
      const unsigned char* __restrict__ vals = payload + bitmap_bytes;
      const uint64_t tiles = (h.elements + kApplyTileElems - 1) / kApplyTileElems;
      for (uint64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const uint64_t j0 = t * (kApplyTileElems / 8) + threadIdx.x * 4;
        uint32_t bits = 0;
        if (j0 + 4 <= bitmap_bytes) {
          bits = *reinterpret_cast<const uint32_t*>(payload + j0);
        } else {
          for (uint64_t j = j0; j < bitmap_bytes; ++j)
            bits |= uint32_t{payload[j]} << (8 * (j - j0));
        }
        uint64_t total = 0;
        const uint64_t at =
            a.s.fine_prefix[t] + BlockExclusiveScan(__popc(bits), &total, s_scan[0]);
        T vbuf[32];
#pragma unroll
        for (int r = 0; r < 32; ++r)
          if ((bits >> r) & 1)
            vbuf[r] = static_cast<T>(LoadLE(vals + (at + __popc(bits & ((1u << r) - 1))) * E, E));
#pragma unroll
        for (int r = 0; r < 32; ++r)
          if ((bits >> r) & 1) out[j0 * 8 + r] = vbuf[r];
      }
    }
  }
  // The last block reports and puts the control block back at rest for the next call.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&c->ticket, 1u) == gridDim.x - 1) {
      HostResult* r = a.s.result;
      r->code = s_code;
      r->have = s_have;
      r->detail = s_detail;
      for (uint64_t i = 0; i < kDeltaHeaderBytes; ++i) r->header[i] = a.enc[i];
      c->sum_a = 0;
      c->sum_b = 0;
      c->bad_record = ~0ull;
      c->popcount = 0;
      c->tile_counter = 0;
      c->ticket = 0;
      c->tail_bad = 0;
      const uint64_t next_epoch = (c->epoch + 1) & kEpochMask;
      c->epoch = next_epoch == 0 ? 1 : next_epoch;
      __threadfence_system();
    }
  }
}

template <int E>
int Launch(const DecArgs& a, int sms, cudaStream_t s) {
  DecodeRecordsKernel<E><<<sms * 4, kThreads, 0, s>>>(a);
  DecodeCheckKernel<E><<<a.tiles, kThreads, 0, s>>>(a);
  DecodeApplyKernel<E><<<sms * 8, kThreads, 0, s>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LaunchDecode(const void* encoded, uint64_t encoded_bytes, void* bucket, uint64_t bytes,
                 int element_size, uint64_t base_version, const ScratchPtrs& s, int sm_count,
                 void* stream) {
  DecArgs a{};
  a.enc = static_cast<const unsigned char*>(encoded);
  a.enc_bytes = encoded_bytes;
  a.bucket = static_cast<unsigned char*>(bucket);
  a.n = bytes;
  a.base_version = base_version;
  // At least one tile, so the apply pass always sees a check pass (and an empty bucket works).
  a.tiles = static_cast<uint32_t>(bytes == 0 ? 1 : (bytes + kTileBytes - 1) / kTileBytes);
  a.s = s;
  const int sms = sm_count > 0 ? sm_count : 132;
  auto st = static_cast<cudaStream_t>(stream);
  switch (element_size) {
    case 1:
      return Launch<1>(a, sms, st);
    case 2:
      return Launch<2>(a, sms, st);
    default:
      return Launch<4>(a, sms, st);
  }
}

}  // namespace shardsync::gpu::delta
