// Host throughput of the delta codec (include/shardsync/delta.h) against a memcpy of the same
// bucket in the same process: each iteration times the memcpy and the codec back to back on the
// same buffers, so the ratio holds on a loaded machine where absolute GB/s do not. Times are the
// thread's CPU time (both sides).
//
// Cases: Encode / Decode x element size (1 e4m3, 2 bf16, 4 fp32) x density (per mille: 1, 10,
// 100 = 0.1%, 1%, 10%) x change (step 0: the top byte flipped; step 1, bf16 only: the bit pattern
// moved by one, an optimizer's ulp, which the packed form carries in a byte). Bucket: 32 MiB
// (beyond L2, as a pair's bucket is). Counters:
//   memcpy_gbps  bucket bytes / memcpy seconds (the baseline: what sending the bucket whole
//                costs the host at least);
//   codec_gbps   bucket bytes / encode (or decode) seconds;
//   ratio        codec_gbps / memcpy_gbps;
//   wire_pct     encoded bytes as % of the bucket.
// Decode alternates the delta base->new and new->base over one bucket, so every decode applies a
// valid delta (base checksum checked, result checksum predicted) and no restore copy is timed.
// Encode runs once untimed first: a sender reuses its output buffer (no page faults in the loop).
#include <benchmark/benchmark.h>

#include <time.h>

#include <cstring>
#include <random>
#include <vector>

#include "shardsync/delta.h"

namespace shardsync {
namespace {

// Thread CPU time, not wall time: on a shared 2-core VM a 200 ms encode is preempted where a
// 3 ms memcpy is not, and wall time would charge the codec for other processes' work.
double Now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
using Bytes = std::vector<std::byte>;
constexpr size_t kBucket = size_t{32} << 20;

struct Pair {
  Bytes base, next;
};

// A random bucket and a copy with `per_mille` / 1000 of its elements changed, at random places
// (`step`: by one unit of the element's bit pattern, up or down).
Pair MakePair(int e, int per_mille, bool step) {
  Pair p;
  p.base.resize(kBucket);
  std::mt19937_64 rng(e * 1000 + per_mille);
  for (size_t o = 0; o < kBucket; o += 8) {
    const uint64_t w = rng();
    std::memcpy(p.base.data() + o, &w, 8);
  }
  p.next = p.base;
  const size_t elements = kBucket / e;
  std::bernoulli_distribution pick(per_mille / 1000.0);
  for (size_t i = 0; i < elements; ++i) {
    if (!pick(rng)) continue;
    if (!step) {
      p.next[i * e + e - 1] ^= std::byte{0x5a};
      continue;
    }
    uint16_t v;  // step is for bf16
    std::memcpy(&v, p.next.data() + i * e, 2);
    v = static_cast<uint16_t>(v + ((rng() & 1) ? 1 : 0xFFFF));
    std::memcpy(p.next.data() + i * e, &v, 2);
  }
  return p;
}

double Seconds(double a, double b) { return b - a; }

void Report(benchmark::State& st, double memcpy_s, double codec_s, size_t wire) {
  const double n = static_cast<double>(st.iterations()) * kBucket;
  st.counters["memcpy_gbps"] = n / memcpy_s / 1e9;
  st.counters["codec_gbps"] = n / codec_s / 1e9;
  st.counters["ratio"] = memcpy_s / codec_s;
  st.counters["wire_pct"] = 100.0 * static_cast<double>(wire) / kBucket;
  st.SetBytesProcessed(static_cast<int64_t>(n));
}

void BM_Encode(benchmark::State& st) {
  const int e = static_cast<int>(st.range(0));
  const Pair p = MakePair(e, static_cast<int>(st.range(1)), st.range(2) != 0);
  Bytes dst(kBucket), enc;
  // Steady state: the sender reuses its encode buffer, so its pages are faulted in once here.
  if (!EncodeDelta(p.base, p.next, e, 1, "bench", &enc).ok()) return st.SkipWithError("encode");
  double memcpy_s = 0, codec_s = 0;
  for (auto _ : st) {
    auto t0 = Now();
    std::memcpy(dst.data(), p.next.data(), kBucket);
    benchmark::ClobberMemory();
    auto t1 = Now();
    auto r = EncodeDelta(p.base, p.next, e, 1, "bench", &enc);
    auto t2 = Now();
    if (!r.ok() || r->kind == DeltaKind::kFull) {
      st.SkipWithError(r.ok() ? "encoded as full" : r.status().ToString().c_str());
      return;
    }
    memcpy_s += Seconds(t0, t1);
    codec_s += Seconds(t1, t2);
    st.SetIterationTime(Seconds(t1, t2));
  }
  Report(st, memcpy_s, codec_s, enc.size());
}

void BM_Decode(benchmark::State& st) {
  const int e = static_cast<int>(st.range(0));
  const Pair p = MakePair(e, static_cast<int>(st.range(1)), st.range(2) != 0);
  Bytes forward, back, dst(kBucket);
  if (!EncodeDelta(p.base, p.next, e, 1, "bench", &forward).ok() ||
      !EncodeDelta(p.next, p.base, e, 1, "bench", &back).ok() || forward.empty()) {
    st.SkipWithError("encode failed");
    return;
  }
  Bytes bucket = p.base;
  bool at_base = true;
  double memcpy_s = 0, codec_s = 0;
  for (auto _ : st) {
    auto t0 = Now();
    std::memcpy(dst.data(), p.next.data(), kBucket);
    benchmark::ClobberMemory();
    auto t1 = Now();
    Status s = DecodeDeltaInPlace(at_base ? forward : back, bucket, {"bench", e, 1});
    auto t2 = Now();
    if (!s.ok()) {
      st.SkipWithError(s.ToString().c_str());
      return;
    }
    at_base = !at_base;
    memcpy_s += Seconds(t0, t1);
    codec_s += Seconds(t1, t2);
    st.SetIterationTime(Seconds(t1, t2));
  }
  Report(st, memcpy_s, codec_s, forward.size());
}

void Args(benchmark::internal::Benchmark* b) {
  for (int e : {1, 2, 4})
    for (int per_mille : {1, 10, 100})
      for (int step : {0, 1})
        if (step == 0 || e == 2) b->Args({e, per_mille, step});
  b->ArgNames({"esize", "per_mille", "step"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Encode)->Apply(Args);
BENCHMARK(BM_Decode)->Apply(Args);

}  // namespace
}  // namespace shardsync

BENCHMARK_MAIN();
