// The device delta decoder's index form (delta_decode.cu has the overview): the records pass
// and the tile pass.
#include "cuda/kernels/delta_decode.cuh"

namespace shardsync::gpu::delta {
namespace {

// Index form, first pass (a warp per tile of the encoding): the running counts checked (none
// below the tile before; the last one the header's count), every record checked (inside its
// tile, above the one before in it), the padding checked: the first fault in the host's order
// in ctl->bad_record (IndexFault). Each tile's first record goes to tile[t] (tile[tiles] and on:
// the count), trusted only once nothing was found.
template <int E>
__global__ void __launch_bounds__(kThreads) DecodeRecordsKernel(DecArgs a) {
  GridDepWait();
  GridDepTrigger();
  __shared__ HeaderView h;
  if (threadIdx.x == 0) h = Parse<E>(a);
  __syncthreads();
  if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kIndex)) return;
  const DeltaIndexLayout l = DeltaIndexPayload(h.elements, E, h.changed);
  const IndexView v = IndexOf<E>(a.enc + kDeltaHeaderBytes, h.elements, h.changed);
  const uint64_t c = h.changed;
  const int lane = threadIdx.x & 31;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarps;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  unsigned long long fault = ~0ull;
  for (uint64_t t = first; t < l.tiles; t += warps) {
    const uint64_t s = t > 0 ? v.ends[t - 1] : 0, e = v.ends[t];
    if (lane == 0) {
      a.s.tile[t] = static_cast<uint32_t>(s);
      if (e < s) fault = min(fault, IndexFaultTile(t));
      if (t == l.tiles - 1 && e != c) fault = min(fault, IndexFaultLast());
    }
    // Bounded by the count whatever the running counts say (a fault among them is reported
    // first; the records then only need to be read safely).
    const uint64_t lo = min(s, c), hi = min(max(e, lo), c);
    const uint64_t nt = min(l.tile_elems, h.elements - t * l.tile_elems);
    for (uint64_t k = lo + lane; k < hi; k += 32) {
      const uint64_t off = v.offs[k];
      if (off >= nt || (k > lo && off <= v.offs[k - 1])) {
        fault = min(fault, IndexFaultRecord(k, t));
        break;
      }
    }
  }
  if (first == 0 && lane == 0) {
    for (uint64_t t = l.tiles; t <= a.tiles; ++t) a.s.tile[t] = static_cast<uint32_t>(c);
    for (uint64_t b = l.offsets + 2 * c; b < l.values; ++b)
      if (a.enc[kDeltaHeaderBytes + b] != 0) fault = min(fault, IndexFaultPadding(b));
  }
  if (fault != ~0ull) atomicMin(&a.s.ctl->bad_record, fault);
}

// Packed form, first pass (a warp per tile; element size 1 or 2): the running counts and the
// escapes' checked, then each subtile's count, the tile's sum, each record (inside its subtile,
// above the one before in it) and the tile's escaped value bytes: the first fault in the host's
// order in ctl->bad_record (PackedFault). Each record is expanded into the scratch
// (PackedScratch: its element within the tile and its value), each tile's first record goes to
// tile[t]; both trusted only once nothing was found. The subtiles' first records (a scan of the
// counts) go to shared memory; then a lane per record, 32 at a time, finds its subtile there.
template <int E>
__global__ void __launch_bounds__(kThreads) DecodePackedRecordsKernel(DecArgs a) {
  GridDepWait();
  GridDepTrigger();
  if constexpr (E == 4) {
    return;  // no packed form (the header check refuses it)
  } else {
    constexpr uint32_t kSpt = kTileBytes / E / kDeltaSubtileElems;  // 64 or 128
    constexpr uint32_t kPerLane = kSpt / 32;
    __shared__ HeaderView h;
    __shared__ uint16_t s_first[kWarps][kSpt + 1];  // each subtile's first record in the tile
    // Each record's subtile, for tiles of up to kSubOf records (a binary search over s_first
    // for denser ones).
    constexpr uint32_t kSubOf = 1024;
    __shared__ unsigned char s_subof[kWarps][kSubOf];
    if (threadIdx.x == 0) h = Parse<E>(a);
    __syncthreads();
    if (h.code != kOk || h.kind != static_cast<int>(DeltaKind::kPacked)) return;
    const uint64_t c = h.changed, x = h.escapes;
    const DeltaPackedLayout l = DeltaPackedPayload(h.elements, E, c, x);
    const unsigned char* pay = a.enc + kDeltaHeaderBytes;
    const auto* ends = reinterpret_cast<const uint32_t*>(pay);
    const auto* eends = reinterpret_cast<const uint32_t*>(pay + l.escape_ends);
    const unsigned char* subs = pay + l.subs;
    const unsigned char* offs = pay + l.offsets;
    const unsigned char* vals = pay + l.values;
    const auto* escs = reinterpret_cast<const uint16_t*>(pay + l.escapes);
    const IndexView xv = PackedScratch<E>(a.s, c);
    auto* xoff = const_cast<uint16_t*>(xv.offs);
    auto* xval = reinterpret_cast<Elem<E>*>(const_cast<unsigned char*>(xv.vals));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned below = (1u << lane) - 1;
    uint16_t* first_rec = s_first[warp];
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarps;
    const uint64_t first = static_cast<uint64_t>(blockIdx.x) * kWarps + warp;
    unsigned long long fault = ~0ull;
    for (uint64_t t = first; t < l.tiles; t += warps) {
      const uint64_t s = t > 0 ? ends[t - 1] : 0, e = ends[t];
      uint64_t es = 0, ee = 0;
      if constexpr (E == 2) {
        es = t > 0 ? eends[t - 1] : 0;
        ee = eends[t];
      }
      if (lane == 0) {
        a.s.tile[t] = static_cast<uint32_t>(s);
        if (e < s) fault = min(fault, PackedFaultTile(t));
        if (t == l.tiles - 1 && e != c) fault = min(fault, PackedFaultLast());
        if (E == 2 && ee < es) fault = min(fault, PackedFaultEscTile(t));
        if (E == 2 && t == l.tiles - 1 && ee != x) fault = min(fault, PackedFaultEscLast());
      }
      // The subtiles: counts within their elements, summing to the tile's changes.
      const uint64_t s0 = t * kSpt;
      uint32_t cs[kPerLane];
      uint32_t sum = 0, over = ~0u;
#pragma unroll
      for (uint32_t j = 0; j < kPerLane; ++j) {
        const uint64_t sb = s0 + lane + 32 * j;
        const uint32_t m = sb < l.subtiles
                               ? static_cast<uint32_t>(
                                     min(kDeltaSubtileElems, h.elements - sb * kDeltaSubtileElems))
                               : 0;
        cs[j] = sb < l.subtiles ? subs[sb] : 0;
        if (cs[j] > m) over = min(over, lane + 32 * j);
        sum += cs[j];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
        over = min(over, __shfl_xor_sync(0xffffffffu, over, o));
      }
      if (over != ~0u) {
        fault = min(fault, PackedFaultIn(t, kPackedSub, over));
        continue;  // the records cannot be placed
      }
      if (e < s || sum != e - s) {
        if (e >= s) fault = min(fault, PackedFaultIn(t, kPackedSum, 0));
        continue;
      }
      if (e > c) continue;  // the last tile's fault above; nothing to read safely
      uint32_t run = 0, run0[kPerLane];
#pragma unroll
      for (uint32_t j = 0; j < kPerLane; ++j) {
        uint32_t inc = cs[j];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const uint32_t y = __shfl_up_sync(0xffffffffu, inc, o);
          if (lane >= o) inc += y;
        }
        run0[j] = run + inc - cs[j];
        first_rec[lane + 32 * j] = static_cast<uint16_t>(run0[j]);
        run += __shfl_sync(0xffffffffu, inc, 31);
      }
      if (lane == 0) first_rec[kSpt] = static_cast<uint16_t>(sum);
      const bool direct = sum <= kSubOf;
      if (direct) {
        unsigned char* subof = s_subof[warp];
#pragma unroll
        for (uint32_t j = 0; j < kPerLane; ++j) {
          const uint32_t f = run0[j];
          for (uint32_t q = 0; q < cs[j]; ++q)
            subof[f + q] = static_cast<unsigned char>(lane + 32 * j);
        }
      }
      __syncwarp();
      // The records, a lane each: its subtile (the last whose first record is not after it),
      // checked against its subtile's elements and the record before it; escapes ranked.
      const uint32_t cnt = sum;
      uint64_t erun = es;
      uint32_t bad = ~0u;  // (record within the tile) << 8 | subtile within the tile
      // kChunks x 32 records a round, their loads first (the stores below could alias them).
      constexpr int kChunks = 4;
      for (uint32_t r0 = 0; r0 < cnt && bad == ~0u; r0 += 32 * kChunks) {
        uint32_t off[kChunks];
        unsigned char vb[kChunks];
#pragma unroll
        for (int q = 0; q < kChunks; ++q) {
          const uint32_t r = r0 + 32 * q + lane;
          off[q] = r < cnt ? offs[s + r] : 0;
          vb[q] = r < cnt ? vals[s + r] : 0;
        }
        uint32_t before = r0 > 0 ? offs[s + r0 - 1] : 0;  // the record before the round
#pragma unroll
        for (int q = 0; q < kChunks; ++q) {
          const uint32_t r = r0 + 32 * q + lane;
          const bool in = r < cnt;
          uint32_t prev = __shfl_up_sync(0xffffffffu, off[q], 1);
          if (lane == 0) prev = before;
          before = __shfl_sync(0xffffffffu, off[q], 31);
          uint32_t sub = 0;
          bool wrong = false;
          if (in) {
            if (direct) {
              sub = s_subof[warp][r];
            } else {
              uint32_t lo = 0, hi = kSpt;  // first_rec[lo] <= r < first_rec[hi]
              while (hi - lo > 1) {
                const uint32_t mid = (lo + hi) / 2;
                if (first_rec[mid] <= r) {
                  lo = mid;
                } else {
                  hi = mid;
                }
              }
              sub = lo;
            }
            const uint64_t sb = s0 + sub;
            const uint32_t m = static_cast<uint32_t>(
                min(kDeltaSubtileElems, h.elements - sb * kDeltaSubtileElems));
            wrong = off[q] >= m || (r > first_rec[sub] && off[q] <= prev);
          }
          const unsigned wb = __ballot_sync(0xffffffffu, wrong);
          if (wb != 0) {
            const int fl = __ffs(wb) - 1;
            bad = (r0 + 32 * q + fl) << 8 | __shfl_sync(0xffffffffu, sub, fl);
            break;
          }
          const bool esc = E == 2 && in && vb[q] == kDeltaEscape;
          const unsigned eb = __ballot_sync(0xffffffffu, esc);
          if (in) {
            const uint32_t local = sub * static_cast<uint32_t>(kDeltaSubtileElems) + off[q];
            if constexpr (E == 1) {
              xoff[s + r] = static_cast<uint16_t>(local);
              xval[s + r] = vb[q];
            } else if (esc) {
              const uint64_t at = erun + __popc(eb & below);
              xoff[s + r] = static_cast<uint16_t>(local);
              xval[s + r] = at < x ? escs[at] : 0;
            } else {
              xoff[s + r] = static_cast<uint16_t>(local | kPackedAdd);
              xval[s + r] = static_cast<uint16_t>(static_cast<int16_t>(static_cast<int8_t>(vb[q])));
            }
          }
          erun += __popc(eb);
        }
      }
      __syncwarp();  // first_rec is the next tile's
      if (bad != ~0u) {
        fault = min(fault, PackedFaultIn(t, kPackedRecord, bad));
        continue;
      }
      if (E == 2 && erun - es != ee - es) fault = min(fault, PackedFaultIn(t, kPackedEsc, 0));
    }
    if (first == 0 && lane == 0) {
      for (uint64_t t = l.tiles; t <= a.tiles; ++t) a.s.tile[t] = static_cast<uint32_t>(c);
      if (E == 2 && l.escapes > l.values + c && pay[l.values + c] != 0)
        fault = min(fault, PackedFaultPadding(l.values + c));
    }
    if (fault != ~0ull) atomicMin(&a.s.ctl->bad_record, fault);
  }
}

// The index form's tile pass: 2 tiles of the bucket in shared memory per block (the copy engine
// fills one while the block works on the other), a range of consecutive tiles per block, as many
// blocks as fit. 3 or 4 stages measured no faster (228 us against 225 at bf16 512 MiB 1%): the
// pass is held by each tile's records and barriers, not by the bytes in flight.
inline constexpr uint32_t kIdxStages = 2;
inline constexpr uint32_t kIdxSmem = kIdxStages * kTileBytes;  // dynamic shared memory
inline constexpr int kIdxMinBlocks = 4;

// Index form, second pass: each tile read once (the base checksum terms), then, when the records
// all passed (WillApply), the tile's records (tile[t] to tile[t + 1]) patch it in shared memory,
// each saving the value it replaces (record k's at k x E of the scratch), and every 16-byte vector
// that changed is written back with the new minus the old checksum terms of its words: the bucket
// is read at streaming speed and only the changed vectors are written.
template <int E>
__global__ void __launch_bounds__(kThreads, kIdxMinBlocks) DecodeIndexTileKernel(DecArgs a) {
  GridDepWait();
  extern __shared__ __align__(128) unsigned char s_dyn[];  // kIdxStages tiles
  __shared__ __align__(8) uint64_t s_bar[kIdxStages];
  auto stage = [&](uint32_t st) { return reinterpret_cast<uint4*>(s_dyn + st * kTileBytes); };
  __shared__ HeaderView h;
  __shared__ bool s_apply;
  __shared__ uint64_t s_red[kWarps];
  if (threadIdx.x == 0) {
    h = Parse<E>(a);
    s_apply = (h.kind == static_cast<int>(DeltaKind::kIndex) ||
               h.kind == static_cast<int>(DeltaKind::kPacked)) &&
              WillApply<E>(a, h);
    for (int i = 0; i < kIdxStages; ++i) MbarInit(&s_bar[i], 1);
    MbarInitFence();
  }
  __syncthreads();
  const bool packed = h.kind == static_cast<int>(DeltaKind::kPacked);
  if (h.code != kOk || (h.kind != static_cast<int>(DeltaKind::kIndex) && !packed)) return;
  const bool apply = s_apply;
  const uint64_t n = a.n;
  // The packed form's records come expanded from the scratch (PackedScratch).
  const IndexView iv = packed ? PackedScratch<E>(a.s, h.changed)
                              : IndexOf<E>(a.enc + kDeltaHeaderBytes, h.elements, h.changed);
  Elem<E>* saved = reinterpret_cast<Elem<E>*>(a.s.vals);
  const uint32_t lo = RangeFirst(a, blockIdx.x), hi = RangeFirst(a, blockIdx.x + 1);
  // Whole tiles come through the copy engine; the bucket's ragged last tile, if any, is loaded
  // by the threads.
  const uint32_t whole_hi = min(hi, static_cast<uint32_t>(n / kTileBytes));
  auto issue = [&](uint32_t t) {  // one thread
    const uint32_t st = (t - lo) % kIdxStages;
    MbarExpect(&s_bar[st], kTileBytes);
    BulkLoad(stage(st), a.bucket + uint64_t{t} * kTileBytes, kTileBytes, &s_bar[st]);
  };
  if (threadIdx.x == 0)
    for (uint32_t t = lo; t < whole_hi && t < lo + kIdxStages; ++t) issue(t);
  constexpr uint64_t kKeyVec = uint64_t{kThreads} * 2 * kChecksumStep;
  constexpr uint64_t kKeyTile = kTileBytes / 8 * kChecksumStep;
  uint64_t key0 = MixKey((static_cast<uint64_t>(lo) * kThreads * kTileVecs + threadIdx.x) * 2);
  uint64_t sum = 0, delta = 0;
  uint32_t rs = apply && lo < hi ? a.s.tile[lo] : 0;
  for (uint32_t t = lo; t < hi; ++t, key0 += kKeyTile) {
    // The tile's records [rs, re), the first of them loaded while the tile lands.
    const uint32_t re = apply ? a.s.tile[t + 1] : 0;
    const uint64_t k0 = uint64_t{rs} + threadIdx.x;
    uint64_t off0 = 0, val0 = 0;
    if (k0 < re) {
      off0 = iv.offs[k0];
      val0 = RecValue<E>(iv, k0);
    }
    const uint32_t i = t - lo, st = i % kIdxStages;
    uint4* tile = stage(st);
    const uint64_t v0 = static_cast<uint64_t>(t) * kThreads * kTileVecs + threadIdx.x;
    if (t < whole_hi) {
      MbarWait(&s_bar[st], (i / kIdxStages) & 1);
    } else {  // the ragged last tile, zero padded
#pragma unroll
      for (int k = 0; k < kTileVecs; ++k) {
        const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
        tile[k * kThreads + threadIdx.x] = o < n ? LoadVec(a.bucket, o, n) : make_uint4(0, 0, 0, 0);
      }
      __syncthreads();
    }
    uint4 w[kTileVecs];
#pragma unroll
    for (int k = 0; k < kTileVecs; ++k) {
      const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
      w[k] = tile[k * kThreads + threadIdx.x];
      const uint64_t key = key0 + static_cast<uint64_t>(k) * kKeyVec;
      if (o < n) {
        sum += MixWithKey(Lo64(w[k]), key);
        if (o + 8 < n) sum += MixWithKey(Hi64(w[k]), key + kChecksumStep);
      }
    }
    if (re > rs) {      // uniform across the block
      __syncthreads();  // every base vector read before the patches
      Elem<E>* te = reinterpret_cast<Elem<E>*>(tile);
      for (uint64_t k = k0; k < re; k += kThreads) {
        const uint64_t raw = k == k0 ? off0 : iv.offs[k];
        const uint64_t val = k == k0 ? val0 : RecValue<E>(iv, k);
        // Element size 2, packed: kPackedAdd marks a difference (an index offset is < 8192).
        const bool add = E == 2 && (raw & kPackedAdd) != 0;
        const uint64_t off = E == 2 ? raw & ~uint64_t{kPackedAdd} : raw;
        const Elem<E> old = te[off];
        saved[k] = old;
        te[off] = static_cast<Elem<E>>(add ? old + val : val);
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kTileVecs; ++k) {
        const uint4 x = tile[k * kThreads + threadIdx.x];
        if (x.x == w[k].x && x.y == w[k].y && x.z == w[k].z && x.w == w[k].w) continue;
        const uint64_t o = (v0 + uint64_t{kThreads} * k) * 16;
        const uint64_t key = key0 + static_cast<uint64_t>(k) * kKeyVec;
        delta += MixWithKey(Lo64(x), key) - MixWithKey(Lo64(w[k]), key);
        delta +=
            MixWithKey(Hi64(x), key + kChecksumStep) - MixWithKey(Hi64(w[k]), key + kChecksumStep);
        if (o + 16 <= n) {
          *reinterpret_cast<uint4*>(a.bucket + o) = x;
        } else {  // the ragged end: the bytes inside the bucket
          for (uint64_t b = o; b < n; ++b)
            a.bucket[b] = static_cast<unsigned char>(VecElem<1>(Lo64(x), Hi64(x), int(b - o)));
        }
      }
    }
    rs = re;
    FenceProxyAsync();  // the stage's reads and patches, before the copy engine refills it
    __syncthreads();    // the stage is read: refill it
    if (threadIdx.x == 0 && t + kIdxStages < whole_hi) issue(t + kIdxStages);
  }
  GridDepTrigger();
  sum = BlockSum(sum, s_red);
  delta = BlockSum(delta, s_red);
  if (threadIdx.x == 0) {
    atomicAdd(&a.s.ctl->sum_a, static_cast<unsigned long long>(sum));
    if (delta != 0) atomicAdd(&a.s.ctl->sum_b, static_cast<unsigned long long>(delta));
  }
}

}  // namespace

template <int E>
cudaError_t LaunchIndexPasses(const DecArgs& a, int sms, cudaStream_t s) {
  static const int fit = FitPerSm(DecodeIndexTileKernel<E>, kIdxSmem);
  // The attribute is the current device's: set on every call (cheap), the fit computed once.
  cudaError_t e = cudaFuncSetAttribute(DecodeIndexTileKernel<E>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int{kIdxSmem});
  if (e != cudaSuccess) return e;
  DecArgs ai = a;
  ai.ranges = static_cast<uint32_t>(std::min<uint64_t>(a.tiles, uint64_t(sms) * fit));
  DecodeRecordsKernel<E><<<static_cast<uint32_t>(sms) * 8, kThreads, 0, s>>>(a);
  e = cudaGetLastError();
  if (e == cudaSuccess)
    e = LaunchDependent(DecodePackedRecordsKernel<E>, static_cast<uint32_t>(sms) * 8, 0, s, a);
  if (e == cudaSuccess) e = LaunchDependent(DecodeIndexTileKernel<E>, ai.ranges, kIdxSmem, s, ai);
  return e;
}
template cudaError_t LaunchIndexPasses<1>(const DecArgs&, int, cudaStream_t);
template cudaError_t LaunchIndexPasses<2>(const DecArgs&, int, cudaStream_t);
template cudaError_t LaunchIndexPasses<4>(const DecArgs&, int, cudaStream_t);

}  // namespace shardsync::gpu::delta
