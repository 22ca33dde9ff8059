// The least CPU work a checksummed host sync can do per engine rank, against the raw copy of
// the same bytes, on one core of this machine. `shardsync bench` on the 2-core dev VM is
// CPU-bound (8 processes, both cores busy), so sharded/raw there is bounded by the ratio of
// these per-byte costs; this bench measures that bound without any plan, transport or process
// overhead. Bytes per case: the demo workload's mean wire bytes per engine rank.
//
// Each iteration times the raw copy and the verified variant back to back (same buffers, same
// process); counters: raw_gbps, verified_gbps, ratio = verified / raw throughput.
//   cma:      raw = process_vm_readv (what UCX's cma rendezvous does for tagged sends here);
//             verified = sender checksums 1 MiB of its source (cold), the receiver reads it
//             with process_vm_readv (source now in cache) and checksums what landed (hot).
//   cma_fp32: as cma with an fp32 trainer: the sender casts 1 MiB of wire into staging with
//             the checksum fused (CastF32ToBF16WithSum), the receiver reads the staging.
//   shm:      raw = memcpy into the receiver's memory (a transport writing straight into
//             mapped receiver memory); verified = the sender copies with the checksum fused
//             (CopyWithChecksumPartial), then the receiver checksums what landed (hot).
//   ring_vs_cma / ring_vs_ring_raw: what the shm transport does (transport.h): the sender
//             copies 64 KiB into a ring slot, the receiver copies it out, each copy carrying
//             the checksum; raw = the CMA copy / the same two copies without checksums.
#include <benchmark/benchmark.h>
#include <sys/uio.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>

#include "common/cast.h"
#include "shardsync/checksum.h"
#include "shardsync/plan.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kTransfer = size_t{4} << 20;  // raw transfer size (as `shardsync bench`)
constexpr size_t kPiece = size_t{1} << 20;     // sync session transfer size (kMaxTransferBytes)

size_t DemoBytesPerEngineRank() {
  PlanInputs in;
  in.model = LoadModelSpec("qwen2.5-0.5b").value();
  in.trainer = ParseTrainerSpec("fsdp=4").value();
  in.rollout = ParseRolloutSpec("dp=1,tp=2,pp=2", EngineKind::kSglang).value();
  const PlanSummary s = SummarizePlan(in).value();
  return static_cast<size_t>(s.total_bytes) / s.engine_ranks.size() & ~(kTransfer - 1);
}

struct Buffers {
  explicit Buffers(size_t n, size_t src_scale = 1)
      : bytes(n), src(Alloc(n * src_scale)), dst(Alloc(n)), stage(Alloc(kPiece)) {
    for (size_t i = 0; i < n * src_scale; i += 4) {
      const float f = static_cast<float>(i % 4099) * 0.001f;
      std::memcpy(src.get() + i, &f, 4);
    }
    std::memset(dst.get(), 0, n);
  }
  static std::unique_ptr<unsigned char[]> Alloc(size_t n) {
    return std::unique_ptr<unsigned char[]>(new unsigned char[n]);
  }
  size_t bytes;
  std::unique_ptr<unsigned char[]> src, dst, stage;
};

// process_vm_readv of this process's own memory: the kernel's CMA copy, as between two ranks.
bool CmaRead(unsigned char* to, const unsigned char* from, size_t n) {
  iovec local{to, n};
  iovec remote{const_cast<unsigned char*>(from), n};
  return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == static_cast<ssize_t>(n);
}

template <typename Raw, typename Verified>
void RunCase(benchmark::State& st, const Buffers& b, Raw raw, Verified verified) {
  double raw_s = 0, ver_s = 0;
  uint64_t sink = 0;
  for (auto _ : st) {
    auto t0 = Clock::now();
    if (!raw()) {
      st.SkipWithError("process_vm_readv failed (CMA not permitted here)");
      return;
    }
    auto t1 = Clock::now();
    sink += verified();
    auto t2 = Clock::now();
    raw_s += std::chrono::duration<double>(t1 - t0).count();
    ver_s += std::chrono::duration<double>(t2 - t1).count();
    st.SetIterationTime(std::chrono::duration<double>(t2 - t1).count());
  }
  benchmark::DoNotOptimize(sink);
  const double n = static_cast<double>(st.iterations());
  st.counters["raw_gbps"] = b.bytes * n / raw_s / 1e9;
  st.counters["verified_gbps"] = b.bytes * n / ver_s / 1e9;
  st.counters["ratio"] = raw_s / ver_s;
  st.SetBytesProcessed(static_cast<int64_t>(b.bytes * n));
}

// The raw copies the cases compare against.
bool CmaRaw(const Buffers& b) {
  for (size_t o = 0; o < b.bytes; o += kTransfer) {
    if (!CmaRead(b.dst.get() + o, b.src.get() + o, kTransfer)) return false;
  }
  return true;
}
constexpr size_t kSlot = size_t{64} << 10;  // shm transport ring slot
bool RingRaw(const Buffers& b) {
  for (size_t o = 0; o < b.bytes; o += kSlot) {
    unsigned char* slot = b.stage.get() + (o / kSlot % 16) * kSlot;
    std::memcpy(slot, b.src.get() + o, kSlot);
    std::memcpy(b.dst.get() + o, slot, kSlot);
  }
  return true;
}

void BM_Cma(benchmark::State& st) {
  Buffers b(DemoBytesPerEngineRank());
  unsigned char *src = b.src.get(), *dst = b.dst.get();
  RunCase(
      st, b, [&] { return CmaRaw(b); },
      [&] {
        uint64_t s = 0;
        for (size_t o = 0; o < b.bytes; o += kPiece) {
          s += ChecksumPartial(src + o, kPiece, o);  // sender
          CmaRead(dst + o, src + o, kPiece);
          s -= ChecksumPartial(dst + o, kPiece, o);  // receiver
        }
        return s;
      });
}

void BM_CmaFp32(benchmark::State& st) {
  Buffers b(DemoBytesPerEngineRank(), 2);
  unsigned char *src = b.src.get(), *dst = b.dst.get(), *stage = b.stage.get();
  RunCase(
      st, b, [&] { return CmaRaw(b); },
      [&] {
        uint64_t s = 0;
        for (size_t o = 0; o < b.bytes; o += kPiece) {
          uint64_t part = 0;
          CastF32ToBF16WithSum(src + 2 * o, stage, kPiece / 2, o / 8, &part);
          s += part;
          CmaRead(dst + o, stage, kPiece);
          s -= ChecksumPartial(dst + o, kPiece, o);
        }
        return s;
      });
}

void BM_Shm(benchmark::State& st) {
  Buffers b(DemoBytesPerEngineRank());
  unsigned char *src = b.src.get(), *dst = b.dst.get();
  RunCase(
      st, b,
      [&] {
        for (size_t o = 0; o < b.bytes; o += kTransfer) std::memcpy(dst + o, src + o, kTransfer);
        return true;
      },
      [&] {
        uint64_t s = 0;
        for (size_t o = 0; o < b.bytes; o += kPiece) {
          s += CopyWithChecksumPartial(dst + o, src + o, kPiece, o);
          s -= ChecksumPartial(dst + o, kPiece, o);
        }
        return s;
      });
}

// The shm transport's data path: 64 KiB slots of a ring that stays in cache; the sender's copy
// into the slot and the receiver's copy out of it each carry the checksum.
uint64_t RingVerified(const unsigned char* src, unsigned char* dst, unsigned char* ring,
                      size_t bytes) {
  uint64_t s = 0;
  for (size_t o = 0; o < bytes; o += kSlot) {
    unsigned char* slot = ring + (o / kSlot % 16) * kSlot;
    s += CopyWithChecksumPartial(slot, src + o, kSlot, o);  // sender
    s -= CopyWithChecksumPartial(dst + o, slot, kSlot, o);  // receiver
  }
  return s;
}

void BM_RingVsCma(benchmark::State& st) {
  Buffers b(DemoBytesPerEngineRank());
  unsigned char *src = b.src.get(), *dst = b.dst.get(), *ring = b.stage.get();
  RunCase(
      st, b, [&] { return CmaRaw(b); }, [&] { return RingVerified(src, dst, ring, b.bytes); });
}

void BM_RingVsRingRaw(benchmark::State& st) {
  Buffers b(DemoBytesPerEngineRank());
  unsigned char *src = b.src.get(), *dst = b.dst.get(), *ring = b.stage.get();
  RunCase(
      st, b, [&] { return RingRaw(b); }, [&] { return RingVerified(src, dst, ring, b.bytes); });
}

// fp32 trainer through the ring: the sender casts straight into the slot (checksum fused), the
// receiver copies out; raw = the two copies of the bf16 bytes.
void BM_RingFp32VsRingRaw(benchmark::State& st) {
  Buffers b(DemoBytesPerEngineRank(), 2);
  unsigned char *src = b.src.get(), *dst = b.dst.get(), *ring = b.stage.get();
  RunCase(
      st, b, [&] { return RingRaw(b); },
      [&] {
        uint64_t s = 0;
        for (size_t o = 0; o < b.bytes; o += kSlot) {
          unsigned char* slot = ring + (o / kSlot % 16) * kSlot;
          uint64_t part = 0;
          CastF32ToBF16WithSum(src + 2 * o, slot, kSlot / 2, o / 8, &part);
          s += part;
          s -= CopyWithChecksumPartial(dst + o, slot, kSlot, o);
        }
        return s;
      });
}

const struct {
  const char* name;
  void (*fn)(benchmark::State&);
} kCases[] = {{"host_bound/cma", BM_Cma},
              {"host_bound/cma_fp32", BM_CmaFp32},
              {"host_bound/shm", BM_Shm},
              {"host_bound/ring_vs_cma", BM_RingVsCma},
              {"host_bound/ring_vs_ring_raw", BM_RingVsRingRaw},
              {"host_bound/ring_fp32_vs_ring_raw", BM_RingFp32VsRingRaw}};
[[maybe_unused]] const bool kRegistered = [] {
  for (const auto& c : kCases) {
    benchmark::RegisterBenchmark(c.name, c.fn)
        ->UseManualTime()
        ->Iterations(8)
        ->Unit(benchmark::kMillisecond);
  }
  return true;
}();

}  // namespace
}  // namespace shardsync

BENCHMARK_MAIN();
