// The host block-FP8 quantize-pack (fp8.h Fp8QuantizePack: what a host-path sender runs per
// quantize op) against the checksummed copy of the same bf16 bytes (what a bf16 sync's sender
// runs), back to back in one process on one core. Counters: ns per element of each and
// ratio = quantize time / copy time. Region: 1024 x 2048 bf16 (16 block rows of a wide weight).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "shardsync/checksum.h"
#include "shardsync/fp8.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;

void BM_Fp8QuantizePackVsCopy(benchmark::State& state) {
  const int64_t rows = 1024, cols = 2048, n = rows * cols;
  std::vector<uint16_t> src(static_cast<size_t>(n));
  uint32_t x = 12345;
  for (auto& v : src) {  // normal bf16 values of mixed magnitude and sign
    x = x * 1664525u + 1013904223u;
    v = static_cast<uint16_t>(0x3800u + (x >> 20) % 0x1000u) | static_cast<uint16_t>(x & 0x8000u);
  }
  std::vector<uint8_t> wire(static_cast<size_t>(Fp8WireBytes(rows, cols)));
  std::vector<uint8_t> copy(static_cast<size_t>(n * 2));
  const PackRegion region{
      src.data(), DType::kBF16, {rows, cols}, Region::Make({0, 0}, {rows, cols}), 0};
  double q_s = 0, c_s = 0;
  uint64_t sink = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    auto r = Fp8QuantizePack(region, wire.data());
    auto t1 = Clock::now();
    sink += CopyWithChecksumPartial(copy.data(), src.data(), copy.size(), 0);
    auto t2 = Clock::now();
    if (!r.ok()) state.SkipWithError(r.status().ToString().c_str());
    sink += r.ok() ? r->sum : 0;
    q_s += std::chrono::duration<double>(t1 - t0).count();
    c_s += std::chrono::duration<double>(t2 - t1).count();
  }
  benchmark::DoNotOptimize(sink);
  const double it = static_cast<double>(state.iterations());
  state.counters["quantize_ns_per_elem"] = q_s / it / static_cast<double>(n) * 1e9;
  state.counters["copy_ns_per_elem"] = c_s / it / static_cast<double>(n) * 1e9;
  state.counters["ratio"] = q_s / c_s;
}
BENCHMARK(BM_Fp8QuantizePackVsCopy)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace shardsync

BENCHMARK_MAIN();
