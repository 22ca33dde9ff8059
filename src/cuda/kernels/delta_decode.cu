// The delta decoder on the device (delta_gpu.h): DecodeDeltaInPlace's checks and result.
//
// Every kernel checks the header first (delta_kernels.h ParseHeader, the host's order) and does
// nothing when it is refused.
// Records (DecodeRecordsKernel, index form only): every record checked (in range, strictly
// increasing); then (DecodeTileStartsKernel, valid records only) for every tile of the bucket the
// first record at or past it, so the check pass finds a tile's records without searching.
// Check (DecodeCheckKernel, one tile of the bucket per block): reads the tile once, adds its base
// checksum terms, finds its changed elements (bitmap form: the encoding's bitmap bits; index form:
// its records, marked in a shared-memory bitmap) and their values (bitmap form: offsets from a
// single-pass scan with decoupled look-back; index form: the record number), and adds the new
// minus the old term of every changed word: the result's checksum is predicted from the words in
// registers, never read twice. Writes nothing the caller sees.
// Decide (DecodeDecideKernel, one thread): the decision from the sums (header, base checksum,
// records, bitmap tail and count, predicted result checksum), reported to the host; the control
// block back at rest.
// Apply (DecodeApplyKernel, the check pass's tiles): writes the changed elements only when the
// decision is "apply" (bitmap form: each 16-byte vector holding a change read, patched and
// written whole; index form: one store per record).
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
}

// tile_prefix[t] = the first record whose element is in tile t or later (t in [0, tiles]):
// record k writes the tiles after its predecessor's up to its own, so valid records write each
// entry once. Runs only when every record is valid (the records kernel found none bad), which
// bounds the work by tiles + records; otherwise the decode is refused and the check pass clamps
// what it reads.
template <int E>
__global__ void __launch_bounds__(kThreads) DecodeTileStartsKernel(DecArgs a) {
  __shared__ HeaderView h;
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kIndex)) return;
  if (*reinterpret_cast<volatile unsigned long long*>(&a.s.ctl->bad_record) != ~0ull) return;
  constexpr uint64_t kTileElems = kTileBytes / E;
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  const uint64_t c = h.changed;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k <= c;
       k += stride) {
    const uint64_t lo = k > 0 ? RecIndex<E>(payload, k - 1) / kTileElems + 1 : 0;
    const uint64_t hi = k < c ? RecIndex<E>(payload, k) / kTileElems : a.tiles;
    for (uint64_t t = lo; t <= hi; ++t) a.s.tile_prefix[t] = static_cast<uint32_t>(k);
  }
}

// Element r of a 16-byte vector's little-endian bytes replaced by v.
template <int E>
__device__ __forceinline__ void PatchVec(uint64_t& lo, uint64_t& hi, int r, uint64_t v) {
  const int byte = r * E;
  if (byte < 8) {
    lo = Patch<E>(lo, byte, v);
  } else {
    hi = Patch<E>(hi, byte - 8, v);
  }
}

// The value of change number `at` of the encoding (index form: its record; bitmap form: the
// values after the bitmap), 0 past the encoding's end (the decode is refused then).
template <int E>
__device__ __forceinline__ uint64_t ChangeValue(bool index, const unsigned char* payload,
                                                uint64_t changed, const unsigned char* vals,
                                                uint64_t vals_bytes, uint64_t at) {
  if (index) return at < changed ? RecValue<E>(payload, at) : 0;
  if ((at + 1) * E > vals_bytes) return 0;
  const unsigned char* p = vals + at * E;
  if constexpr (E == 2) {
    if ((reinterpret_cast<uintptr_t>(p) & 1) == 0) return *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (E == 4) {
    if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  }
  return LoadLE(p, E);
}

// The check pass holds one side's vectors only: 48 registers, 5 blocks per SM (6 spills).
inline constexpr int kCheckMinBlocks = 5;

template <int E>
__global__ void __launch_bounds__(kThreads, kCheckMinBlocks) DecodeCheckKernel(DecArgs a) {
  static_assert(kTileVecs <= 4, "per-vector counts are packed 16 bits apart in one word");
  constexpr uint64_t kTileElems = kTileBytes / E;
  __shared__ HeaderView h;
  __shared__ uint64_t s_scan[2][kWarps];
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
  // The index form's record range, loaded with the tile (unused by the bitmap form).
  const uint32_t tp0 = a.s.tile_prefix[t], tp1 = a.s.tile_prefix[t + 1];
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
    // Clamped: with bad records the starts were not written (the decode is refused).
    const uint64_t r1 = min(static_cast<uint64_t>(tp1), h.changed);
    r0 = static_cast<uint32_t>(min(static_cast<uint64_t>(tp0), r1));
    for (uint64_t k = r0 + threadIdx.x; k < r1; k += kThreads) {
      const uint64_t i = RecIndex<E>(payload, k);
      if (i >= e_lo && i < e_lo + kTileElems && i < elements)
        atomicOr(&s_bits[(i - e_lo) / 32], 1u << ((i - e_lo) % 32));
    }
    __syncthreads();
  }
  uint64_t sum = 0, cnt = 0;
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
    cnt |= static_cast<uint64_t>(__popc(m[k])) << (16 * k);
  }
  uint64_t v[2] = {cnt, sum}, tot[2];
  BlockScanN<2>(v, tot, s_scan);
  const uint64_t ex = v[0], tot_c = tot[0];
  if (threadIdx.x == 0) atomicAdd(&c->sum_a, static_cast<unsigned long long>(tot[1]));
  uint64_t prefix = r0;
  if (!index) {
    uint32_t aggregate = 0;
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k)
      aggregate += static_cast<uint32_t>((tot_c >> (16 * k)) & 0xffff);
    if (threadIdx.x < 32) {
      const uint64_t epoch = *reinterpret_cast<volatile unsigned long long*>(&c->epoch);
      const uint32_t p = LookBack(a.s.states, t, aggregate, epoch);
      if (threadIdx.x == 0) {
        s_prefix = p;
        a.s.tile_prefix[t] = p;  // the apply pass's start in the values
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
    uint64_t at = prefix + ((ex >> (16 * k)) & 0xffff);
    prefix += (tot_c >> (16 * k)) & 0xffff;
    if (m[k] == 0) continue;
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    const uint64_t old_lo = Lo64(w[k]), old_hi = Hi64(w[k]);
    uint64_t new_lo = old_lo, new_hi = old_hi;
    for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++at)
      PatchVec<E>(new_lo, new_hi, __ffs(mm) - 1,
                  ChangeValue<E>(index, payload, h.changed, vals, vals_bytes, at));
    delta += Mix(new_lo, o / 8) - Mix(old_lo, o / 8);
    delta += Mix(new_hi, o / 8 + 1) - Mix(old_hi, o / 8 + 1);
  }
  delta = BlockSum(delta, s_scan[0]);
  if (threadIdx.x == 0 && delta != 0) atomicAdd(&c->sum_b, static_cast<unsigned long long>(delta));
}

// One thread: the decision from the sums (header, base checksum, records, bitmap tail and count,
// predicted result checksum), left in the control block for the apply pass and reported to the
// host (read only after the call's event, so after the apply pass too); the control block's sums
// go back to rest here, since the apply pass reads only the decision.
template <int E>
__global__ void DecodeDecideKernel(DecArgs a) {
  Ctl* c = a.s.ctl;
  const HeaderView h = Parse<E>(a);
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
  c->go = code | static_cast<unsigned long long>(h.kind) << 32;
  c->changed = h.changed;
  HostResult* r = a.s.result;
  r->code = code;
  r->have = have;
  r->detail = detail;
  for (uint64_t i = 0; i < kDeltaHeaderBytes; ++i) r->header[i] = i < a.enc_bytes ? a.enc[i] : 0;
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

// One tile of the bucket per block (the check pass's tiles), writing only on the decide kernel's
// "apply". The bitmap bits are loaded before the decision is read. Bitmap form: each 16-byte
// vector holding a change is read, patched and written whole (coalesced across the warp) instead
// of one store per element; index form: one store per record.
template <int E>
__global__ void __launch_bounds__(kThreads, kMinBlocks) DecodeApplyKernel(DecArgs a) {
  __shared__ uint64_t s_scan[1][kWarps];
  const Ctl* c = a.s.ctl;
  const uint64_t n = a.n;
  const uint64_t elements = n / E;
  const unsigned char* payload = a.enc + kDeltaHeaderBytes;
  // Bits as the bitmap form lays them out, read only inside the encoding (unused unless the
  // decision is "apply a bitmap form", which implies the layout).
  const uint64_t bitmap_bytes = DeltaBitmapBytes(elements);
  const uint32_t t = blockIdx.x;
  const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
  const bool bits_in = a.enc_bytes >= kDeltaHeaderBytes + bitmap_bytes;
  unsigned m[kTileVecs];
  uint64_t cnt = 0;
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    m[k] = bits_in && o < n ? VectorBits<E>(payload, o / E, elements) : 0;
    cnt |= static_cast<uint64_t>(__popc(m[k])) << (16 * k);
  }
  const uint64_t go = c->go;
  if (static_cast<uint32_t>(go) != kOk) return;
  using T = std::conditional_t<E == 1, unsigned char,
                               std::conditional_t<E == 2, unsigned short, uint32_t>>;
  if (static_cast<int>(go >> 32) == static_cast<int>(DeltaKind::kIndex)) {
    T* out = reinterpret_cast<T*>(a.bucket);
    const uint64_t changed = c->changed;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
    for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k < changed;
         k += stride)
      out[RecIndex<E>(payload, k)] = static_cast<T>(RecValue<E>(payload, k));
    return;
  }
  // The same scan as the check pass's, from the tile's start in the values it left.
  uint64_t tot_c = 0;
  const uint64_t ex = BlockExclusiveScan(cnt, &tot_c, s_scan[0]);
  uint64_t at = a.s.tile_prefix[t];
  const unsigned char* vals = payload + bitmap_bytes;
  const uint64_t vals_bytes = a.enc_bytes - kDeltaHeaderBytes - bitmap_bytes;
  uint4 w[kTileVecs];
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    w[k] = m[k] != 0 && o + 16 <= n ? *reinterpret_cast<const uint4*>(a.bucket + o)
                                    : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int k = 0; k < kTileVecs; ++k) {
    uint64_t i = at + ((ex >> (16 * k)) & 0xffff);
    at += (tot_c >> (16 * k)) & 0xffff;
    if (m[k] == 0) continue;
    const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
    if (o + 16 <= n) {
      uint64_t lo = Lo64(w[k]), hi = Hi64(w[k]);
      for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++i)
        PatchVec<E>(lo, hi, __ffs(mm) - 1, ChangeValue<E>(false, payload, 0, vals, vals_bytes, i));
      *reinterpret_cast<uint4*>(a.bucket + o) =
          make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                     static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
    } else {  // the ragged end: element stores inside the bucket
      T* out = reinterpret_cast<T*>(a.bucket);
      for (unsigned mm = m[k]; mm != 0; mm &= mm - 1, ++i)
        out[o / E + __ffs(mm) - 1] =
            static_cast<T>(ChangeValue<E>(false, payload, 0, vals, vals_bytes, i));
    }
  }
}

template <int E>
int Launch(const DecArgs& a, int sms, cudaStream_t s) {
  DecodeRecordsKernel<E><<<sms * 8, kThreads, 0, s>>>(a);
  DecodeTileStartsKernel<E><<<sms * 8, kThreads, 0, s>>>(a);
  DecodeCheckKernel<E><<<a.tiles, kThreads, 0, s>>>(a);
  DecodeDecideKernel<E><<<1, 1, 0, s>>>(a);
  DecodeApplyKernel<E><<<a.tiles, kThreads, 0, s>>>(a);
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
