// Issue 35: the delta encoding on the host path. Each delta job runs beside a twin job under
// encoding full with the same trainer values (loopback, one thread per rank); after every sync
// every byte of every engine parameter must equal the twin's (whose first sync is checked element
// by element against the synthetic weights). Fallbacks: a corrupted base byte, an engine whose
// bytes were restored to an older version's, a staged rollback; a refused delta fails the sync.
// Block FP8: the engine rebuilds each base from its e4m3 codes, scales and copies; fp8-split stage
// plans refuse the delta encoding.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>

#include "job/internal.h"
#include "job/launcher.h"
#include "job/test_util.h"
#include "session_harness.h"
#include "shardsync/delta.h"
#include "shardsync/session.h"
#include "shardsync/transport.h"
#include "sync_expect.h"

namespace shardsync {
namespace {

using testing::ExpectAllOk;
using ::testing::HasSubstr;

JobSpec Spec(WireEncoding enc) {
  // 2 trainer ranks, 4 engine ranks (tp 2 x pp 2), 16 KiB buckets: many messages and buckets.
  JobSpec s =
      testing::Job(testing::TinyQwen2(4, true), "fsdp=2", "dp=1,tp=2,pp=2", "sglang", 16 << 10);
  s.inputs.options.encoding = enc;
  return s;
}

// The harness's job, bound at construction, whose trainer values can be updated.
class Job : public testing::SessionJob {
 public:
  explicit Job(JobSpec spec, const Tune& tune = nullptr, const Inputs& inputs = nullptr)
      : SessionJob(std::move(spec), Millis(5000), tune, inputs) {
    BindAll();
  }
  // A small random update of every trainer rank's fp32 values (seed `seed`): `fraction` of the
  // elements move by 2^-6 of their value (a bf16 step or more: their wire value changes), a
  // tenth of the rest by 2^-20 (below the bf16 step: the wire value stays).
  void Update(uint64_t seed, double fraction) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0, 1);
    for (int r = 0; r < trainers(); ++r) {
      for (const SourceBinding& b : shards(r).bindings) {
        float* x = static_cast<float*>(const_cast<void*>(b.data));
        for (int64_t i = 0; i < b.region.numel(); ++i) {
          const double p = u(rng);
          if (p < fraction)
            x[i] = x[i] * (1.0f + 1.0f / 64) + 1e-3f;
          else if (p < fraction + 0.1)
            x[i] = x[i] * (1.0f + 1.0f / (1 << 20));
        }
      }
    }
  }
};

// A delta job and its twin under encoding full, synced and updated in step.
struct Twins {
  explicit Twins(WireEncoding enc = WireEncoding::kDelta,
                 const std::function<void(int, SessionOptions&)>& tune = nullptr,
                 const std::function<JobSpec(WireEncoding)>& spec = Spec)
      : delta(spec(enc), tune), full(spec(WireEncoding::kFull)) {
    ExpectAllOk(delta.Connect());
    ExpectAllOk(full.Connect());
  }
  // Syncs both; the delta job's rank-0 report.
  SyncReport Sync(uint64_t v) {
    std::vector<SyncReport>& reps = last;
    ExpectAllOk(delta.Sync(v, &reps));
    ExpectAllOk(full.Sync(v));
    for (const SyncReport& r : reps) {
      // Every rank reports the same job-wide delta figures.
      EXPECT_EQ(r.delta.wire_bytes, reps[0].delta.wire_bytes);
      EXPECT_EQ(r.delta.buckets_delta, reps[0].delta.buckets_delta);
      EXPECT_EQ(r.delta.fallbacks(), reps[0].delta.fallbacks());
    }
    return reps[0];
  }
  void Update(uint64_t seed, double fraction) {
    delta.Update(seed, fraction);
    full.Update(seed, fraction);
  }
  // Every byte of every engine parameter equals the full sync's.
  void ExpectSame() { EXPECT_TRUE(delta.EngineBytes() == full.EngineBytes()); }
  Job delta, full;
  std::vector<SyncReport> last;  // the delta job's reports of the last Sync, by rank
};

TEST(DeltaSession, TenSyncsOfSmallUpdatesLandEveryElement) {
  Twins t;
  // Version 1: nothing kept yet, every bucket whole, checked element by element.
  SyncReport r1 = t.Sync(1);
  EXPECT_EQ(t.delta.Mismatches(), 0);
  t.ExpectSame();
  EXPECT_EQ(r1.delta.buckets_delta, 0);
  EXPECT_GT(r1.delta.fallback_no_image, 0);
  EXPECT_EQ(r1.delta.fallback_no_image, r1.delta.buckets_full);
  EXPECT_EQ(r1.delta.wire_bytes, r1.delta.full_bytes);
  EXPECT_EQ(r1.delta.full_bytes, r1.bytes);
  for (uint64_t v = 2; v <= 11; ++v) {
    t.Update(v, 0.01);
    SyncReport r = t.Sync(v);
    t.ExpectSame();
    EXPECT_EQ(r.delta.fallbacks(), 0) << "version " << v;
    EXPECT_GT(r.delta.buckets_delta, 0) << "version " << v;
    EXPECT_LT(r.delta.wire_bytes, r.delta.full_bytes / 5) << "version " << v;
    EXPECT_EQ(r.delta.full_bytes, r.bytes);
    // About 1% of the elements changed (the update's fraction), as the senders counted them.
    EXPECT_GT(r.delta.changed, 0);
    EXPECT_LT(r.delta.changed, r.delta.elements / 20);
    EXPECT_GT(r.delta.encode_seconds, 0);
    EXPECT_GT(r.delta.decode_seconds, 0);
    EXPECT_EQ(r.checksums_ok, r.checksums_total);
  }
  // A version with no update: every delta is a header and, its bucket being one tile
  // (kDeltaTileBytes = the 16 KiB buckets), one running count of 0.
  SyncReport r = t.Sync(12);
  t.ExpectSame();
  EXPECT_EQ(r.delta.changed, 0);
  EXPECT_EQ(r.delta.buckets_full, 0);
  EXPECT_EQ(r.delta.wire_bytes,
            r.delta.buckets_delta * static_cast<int64_t>(kDeltaHeaderBytes + 4));
}

TEST(DeltaSession, ALargeUpdateGoesWholeByTheSizeRule) {
  Twins t;
  t.Sync(1);
  t.Update(2, 0.97);  // nearly every element changes: no delta form is smaller than the bucket
  SyncReport r = t.Sync(2);
  t.ExpectSame();
  EXPECT_GT(r.delta.full_by_size, 0);
  EXPECT_EQ(r.delta.fallbacks(), 0);
}

// What the delta steps hold (DeltaSyncStats::held_bytes, local): a trainer rank its kept images
// and one staging slot; an engine rank the resident pages of its receive slots (mincore), which
// only deltas fill: whole buckets land in place, so after a sync of whole buckets it holds
// nothing, and after deltas at most their payloads rounded up to pages. One bucket per message
// (a 4 MiB cap), so a whole bucket in a slot would be many pages.
TEST(DeltaSession, WholeBucketsLandInPlaceAndOnlyDeltasFillReceiveSlots) {
  Twins t(WireEncoding::kDelta, nullptr, [](WireEncoding enc) {
    JobSpec s = Spec(enc);
    s.inputs.options.bucket_bytes = 4 << 20;
    return s;
  });
  const auto page = static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  SyncReport r1 = t.Sync(1);
  ASSERT_EQ(r1.delta.buckets_delta, 0);
  for (int k = 0; k < t.delta.world(); ++k) {
    const DeltaSyncStats& d = t.last[k].local.delta;
    if (k < t.delta.trainers()) {
      // Its kept images (every byte it sent) plus one staging slot of at most that much.
      EXPECT_GT(d.held_bytes, d.full_bytes) << "rank " << k;
      EXPECT_LE(d.held_bytes, 2 * d.full_bytes) << "rank " << k;
    } else {
      EXPECT_GT(d.full_bytes, 4 * page) << "rank " << k;  // its buckets span many pages
      EXPECT_EQ(d.held_bytes, 0) << "rank " << k;
    }
  }
  t.Update(2, 0.01);
  SyncReport r2 = t.Sync(2);
  t.ExpectSame();
  ASSERT_GT(r2.delta.buckets_delta, 0);
  ASSERT_EQ(r2.delta.buckets_full, 0);
  for (int k = t.delta.trainers(); k < t.delta.world(); ++k) {
    const DeltaSyncStats& d = t.last[k].local.delta;
    EXPECT_GT(d.held_bytes, 0) << "rank " << k;
    EXPECT_LE(d.held_bytes, d.wire_bytes + d.buckets_delta * page) << "rank " << k;
    EXPECT_LT(d.held_bytes, d.full_bytes / 2) << "rank " << k;
  }
}

TEST(DeltaSession, ACorruptedBaseByteSendsThatBucketWholeInTheSameSync) {
  Twins t;
  t.Sync(1);
  t.Update(2, 0.01);
  t.Sync(2);
  // One byte of the last engine rank's last parameter changes behind the session's back.
  auto& b = t.delta.params(t.delta.world() - 1).bindings.back();
  static_cast<unsigned char*>(b.data)[1] ^= 0x10;
  t.Update(3, 0.01);
  SyncReport r = t.Sync(3);
  t.ExpectSame();  // the bucket went whole: the corrupted byte is gone
  EXPECT_EQ(r.delta.fallback_checksum, 1);
  EXPECT_EQ(r.delta.fallbacks(), 1);
  EXPECT_GT(r.delta.buckets_delta, 0);
  // The sender that saw it counts it, and its own report says which bucket and why.
  int senders = 0;
  for (int k = 0; k < t.delta.trainers(); ++k) senders += r.ranks[k].delta.fallback_checksum == 1;
  EXPECT_EQ(senders, 1);
  // The sender's own report says which bucket and why.
  int said = 0;
  for (int k = 0; k < t.delta.trainers(); ++k) {
    const std::string& why = t.last[k].local.delta.first_fallback;
    if (why.empty()) continue;
    ++said;
    EXPECT_THAT(why, HasSubstr("to sync rank " + std::to_string(t.delta.world() - 1)));
    EXPECT_THAT(why, HasSubstr("base checksum differs (it holds v2 "));
  }
  EXPECT_EQ(said, 1);
  // The receiver counts what it landed, by the reason the sender gave.
  EXPECT_EQ(r.ranks.back().delta.fallback_checksum, 1);
}

TEST(DeltaSession, EnginesRestoredToAnOlderVersionFallBackForEveryChangedBucket) {
  Twins t;
  t.Sync(1);
  t.Update(2, 0.01);
  t.Sync(2);
  const auto v2 = t.delta.EngineBytes();
  t.Update(3, 0.01);
  SyncReport r3 = t.Sync(3);
  // The engine is rolled back by hand to version 2's bytes (its bytes say 3 was never there).
  t.delta.SetEngineBytes(v2);
  t.Update(4, 0.01);
  SyncReport r4 = t.Sync(4);
  t.ExpectSame();
  // Every bucket version 3 changed falls back (checksum); the others still go as deltas.
  EXPECT_GT(r4.delta.fallback_checksum, 0);
  EXPECT_LE(r4.delta.fallback_checksum, r3.delta.buckets_delta);
  EXPECT_EQ(r4.delta.fallback_version, 0);
  // An engine whose bytes are gone (zeroed: a re-created engine's fresh memory) falls back
  // everywhere, in the same sync.
  auto zero = t.delta.EngineBytes();
  for (auto& e : zero) std::fill(e.begin(), e.end(), 0);
  t.delta.SetEngineBytes(zero);
  t.Update(5, 0.01);
  SyncReport r5 = t.Sync(5);
  t.ExpectSame();
  EXPECT_EQ(r5.delta.buckets_delta, 0);
  EXPECT_EQ(r5.delta.fallback_checksum, r5.delta.buckets_full);
}

TEST(DeltaSession, ARefusedDeltaFailsTheSyncAndPoisonsNothingElseLands) {
  Twins t;
  t.Sync(1);
  t.Update(2, 0.01);
  t.Sync(2);
  t.Update(3, 0.01);
  // Trainer rank 1's first message of version 3 (its first bucket's delta; the control message
  // follows) has one byte of its index form flipped (byte 50: its first tile's running count).
  t.delta.CorruptDataPost(1, 1, 50);
  auto st = t.delta.Sync(3);
  ExpectAllOk(t.full.Sync(3));
  EXPECT_EQ(t.delta.fault(1).counters().corrupted, 1);
  int refused = 0;
  for (int r = 0; r < t.delta.world(); ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    refused += st[r].message().find("was refused") != std::string::npos;
    if (r >= t.delta.trainers()) {
      EXPECT_TRUE(t.delta.session(r).IsPoisoned());
    }
  }
  EXPECT_GE(refused, 1);
  // The next sync starts that bucket over (its base is version 2, the sender kept 3) and
  // everything verifies.
  t.delta.fault(1).set_config({});
  t.Update(4, 0.01);
  SyncReport r = t.Sync(4);
  t.ExpectSame();
  EXPECT_GT(r.delta.fallback_version, 0);
  for (int e = t.delta.trainers(); e < t.delta.world(); ++e)
    EXPECT_FALSE(t.delta.session(e).IsPoisoned());
}

// A byte of an engine's weights changes after the engine advertised its bases and before any
// delta landed (its first post of the sync comes right after the advertisement): the delta was
// computed against the advertised base, which the engine no longer holds. The decode reads the
// base again as it applies (in place: the landed runs; staged: the live weights copied into
// staging), so the delta is refused, nothing of it lands, and the next sync sends the bucket
// whole: the final checksum covers the weights as they are, never a base that was.
TEST(DeltaSession, ABaseByteChangedAfterTheAdvertisementIsCaughtAsTheDeltaApplies) {
  for (const bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged" : "in place");
    Twins t(WireEncoding::kDelta, [&](int, SessionOptions& o) {
      if (!staged) return;
      o.commit = SessionOptions::Commit::kStaged;
      o.keep_previous = SessionOptions::Keep::kArea;
    });
    for (uint64_t v = 1; v <= 2; ++v) {
      t.Update(v, 0.01);
      t.Sync(v);
      if (staged) ExpectAllOk(t.delta.Commit(v));
    }
    t.ExpectSame();
    const int e = t.delta.world() - 1;
    auto* byte = static_cast<unsigned char*>(t.delta.params(e).bindings.back().data) + 1;
    unsigned char changed = 0;
    t.delta.fault(e).set_config({.call_before_post = t.delta.fault(e).counters().posts + 1,
                                 .before_post = [&] { changed = *byte ^= 0x10; }});
    t.Update(3, 0.01);
    auto st = t.delta.Sync(3);
    ExpectAllOk(t.full.Sync(3));
    ASSERT_NE(changed, 0) << "the hook did not run";
    EXPECT_FALSE(st[e].ok());
    EXPECT_THAT(st[e].message(), HasSubstr("was refused, nothing of it landed"));
    EXPECT_THAT(st[e].message(), HasSubstr("base_checksum"));
    EXPECT_EQ(*byte, changed);  // the refused delta wrote nothing there
    // A failed sync poisons an engine in place; staged, its live weights were not written.
    EXPECT_EQ(t.delta.session(e).IsPoisoned(), !staged);

    t.delta.fault(e).set_config({});
    t.Update(4, 0.01);
    SyncReport r = t.Sync(4);
    if (staged) ExpectAllOk(t.delta.Commit(4));
    t.ExpectSame();
    EXPECT_GT(r.delta.fallbacks(), 0);
    EXPECT_FALSE(t.delta.session(e).IsPoisoned());
  }
}

TEST(DeltaSession, StagedCommitAppliesDeltasOverTheLiveVersionAndRollbackFallsBack) {
  auto staged = [](int, SessionOptions& o) {
    o.commit = SessionOptions::Commit::kStaged;
    o.keep_previous = SessionOptions::Keep::kArea;
  };
  Twins t(WireEncoding::kDelta, staged);
  t.Sync(1);
  ExpectAllOk(t.delta.Commit(1));
  t.ExpectSame();
  t.Update(2, 0.01);
  SyncReport r2 = t.Sync(2);
  EXPECT_GT(r2.delta.buckets_delta, 0);  // against committed version 1
  EXPECT_EQ(r2.delta.fallbacks(), 0);
  ExpectAllOk(t.delta.Commit(2));
  t.ExpectSame();
  // Synced, not committed: the live bytes are still version 2, the senders kept 3.
  t.Update(3, 0.01);
  t.Sync(3);
  t.Update(4, 0.01);
  SyncReport r4 = t.Sync(4);
  EXPECT_EQ(r4.delta.buckets_delta, 0);
  EXPECT_EQ(r4.delta.fallback_version, r4.delta.buckets_full);
  ExpectAllOk(t.delta.Commit(4));
  t.ExpectSame();
  // Rolled back to version 2 (bit for bit): the next sync falls back on version, everywhere.
  t.Update(5, 0.01);
  t.Sync(5);
  ExpectAllOk(t.delta.Commit(5));
  ExpectAllOk(t.delta.All([&](int r) { return t.delta.session(r).Rollback(); }));
  t.Update(6, 0.01);
  SyncReport r6 = t.Sync(6);
  EXPECT_EQ(r6.delta.buckets_delta, 0);
  EXPECT_EQ(r6.delta.fallback_version, r6.delta.buckets_full);
  ExpectAllOk(t.delta.Commit(6));
  t.ExpectSame();
  t.Update(7, 0.01);
  SyncReport r7 = t.Sync(7);
  EXPECT_GT(r7.delta.buckets_delta, 0);
  ExpectAllOk(t.delta.Commit(7));
  t.ExpectSame();
}

// Sets an environment knob for one scope and unsets it however the scope ends (a failed ASSERT
// returns early), so later tests in this binary see the default.
struct ScopedKnob {
  explicit ScopedKnob(const char* name) : name(name) {}
  bool Set(const char* value) const { return setenv(name, value, 1) == 0; }
  ~ScopedKnob() { unsetenv(name); }
  const char* name;
};

TEST(DeltaSession, AutoSendsDeltasOnlyWhereTheyPayAtTheLinkSpeed) {
  const ScopedKnob link("SHARDSYNC_DELTA_LINK_MBPS");
  // At the default 25 GB/s no delta can pay, even a header alone (the path's passes cost more
  // than the whole bucket on the wire: docs/delta.md): the host path runs as encoding full, no
  // bucket takes the delta steps.
  {
    Twins t(WireEncoding::kAuto);
    t.Sync(1);
    t.Update(2, 0.01);
    SyncReport r = t.Sync(2);
    t.ExpectSame();
    // Every bucket went whole, counted as auto's choice (full_by_auto), on every rank.
    EXPECT_EQ(r.delta.buckets_delta, 0);
    EXPECT_GT(r.delta.full_by_auto, 0);
    EXPECT_EQ(r.delta.full_by_auto, r.delta.buckets_full);
    EXPECT_EQ(r.delta.fallbacks(), 0);
    EXPECT_EQ(r.delta.wire_bytes, r.delta.full_bytes);
    EXPECT_EQ(r.delta.full_bytes, r.bytes);
    for (const RankSyncStats& k : r.ranks) EXPECT_GT(k.delta.full_by_auto, 0) << k.rank;
    EXPECT_EQ(r.checksums_ok, r.checksums_total);
  }
  // At 2 GB/s a delta pays at 1% (about 3% of the bytes on the wire) but not at 30% (the bitmap
  // form, 36%): those buckets go whole, counted as the cost model's decision.
  ASSERT_TRUE(link.Set("2000"));
  {
    Twins t(WireEncoding::kAuto);
    t.Sync(1);
    t.Update(2, 0.01);
    SyncReport r = t.Sync(2);
    t.ExpectSame();
    EXPECT_GT(r.delta.buckets_delta, 0);
    EXPECT_EQ(r.delta.full_by_cost, 0);
    t.Update(3, 0.3);
    r = t.Sync(3);
    t.ExpectSame();
    EXPECT_GT(r.delta.full_by_cost, 0);
    EXPECT_EQ(r.delta.full_by_cost, r.delta.buckets_full);
  }
  // At 100 MB/s it pays at 1%.
  ASSERT_TRUE(link.Set("100"));
  {
    Twins t(WireEncoding::kAuto);
    t.Sync(1);
    t.Update(2, 0.01);
    SyncReport r = t.Sync(2);
    t.ExpectSame();
    EXPECT_GT(r.delta.buckets_delta, 0);
    EXPECT_EQ(r.delta.full_by_cost, 0);
  }
}

TEST(DeltaSession, RanksDisagreeingOnTheEncodingFailAtConnectNamingIt) {
  Job job(Spec(WireEncoding::kDelta), nullptr, [](int r, PlanInputs& in) {
    if (r == 3) in.options.encoding = WireEncoding::kFull;
  });
  auto st = job.Connect();
  int named = 0;
  for (const Status& s : st) {
    EXPECT_FALSE(s.ok());
    named += s.message().find("encoding is") != std::string::npos;
  }
  EXPECT_GT(named, 0);
}

// Qwen3 at toy size, block FP8 (128 x 128), fsdp=4 -> SGLang tp2: 192 gate/up rows per trainer
// rank, so some bands straddle trainer ranks (kAmax ops: e4m3 rows with or without the band's
// scales), others are whole (kQuantize); embeddings and norms are kCopy.
JobSpec Fp8Spec(WireEncoding enc, Encoding split = Encoding::kAmax) {
  JobSpec s = testing::Job(testing::WriteConfig("qwen3-fp8-delta", R"({
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 512, "intermediate_size": 768,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
  "vocab_size": 500, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "dynamic",
  "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})"),
                           "fsdp=4", "dp=1,tp=2", "sglang", 64 << 10);
  s.inputs.options.encoding = enc;
  s.inputs.options.straddle = split;
  return s;
}

// The engine binding of `r` whose name ends in `suffix` and has dtype `dt`.
DestBinding& Binding(Job& j, int r, DType dt, const std::string& suffix) {
  for (DestBinding& d : j.params(r).bindings) {
    if (d.dtype == dt && d.name.size() >= suffix.size() &&
        d.name.compare(d.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return d;
  }
  ADD_FAILURE() << "no binding " << suffix;
  return j.params(r).bindings.front();
}

TEST(DeltaSession, BlockFp8SyncsOfSmallUpdatesLandEveryE4m3ByteAndScale) {
  Twins t(WireEncoding::kDelta, nullptr, [](WireEncoding e) { return Fp8Spec(e); });
  SyncReport r = t.Sync(1);
  t.ExpectSame();
  EXPECT_EQ(t.delta.Mismatches(), 0);  // against the synthetic weights, quantized
  EXPECT_EQ(r.delta.buckets_delta, 0);
  for (uint64_t v = 2; v <= 6; ++v) {
    t.Update(v, 0.01);
    r = t.Sync(v);
    t.ExpectSame();  // every e4m3 code, scale and copy equal to the full sync's
    EXPECT_EQ(r.delta.fallbacks(), 0) << "v" << v;
    EXPECT_GT(r.delta.buckets_delta, 0) << "v" << v;
    EXPECT_LT(r.delta.wire_bytes, r.delta.full_bytes) << "v" << v;
    // Elements are bytes of the image: e4m3 codes, scale bytes, copies' bytes and pads.
    EXPECT_GT(r.delta.changed, 0);
  }
}

TEST(DeltaSession, BlockFp8CorruptedE4m3OrScaleByteSendsThatBucketWhole) {
  Twins t(WireEncoding::kDelta, nullptr, [](WireEncoding e) { return Fp8Spec(e); });
  t.Sync(1);
  t.Update(2, 0.01);
  t.Sync(2);
  const int last = t.delta.world() - 1;
  // An e4m3 code of a quantized weight, then a byte of a block scale, behind the session's back.
  const std::pair<DType, std::string> hits[] = {{DType::kF8E4M3, "down_proj.weight"},
                                                {DType::kF32, "down_proj.weight_scale_inv"}};
  uint64_t v = 3;
  for (const auto& [dt, name] : hits) {
    DestBinding& d = Binding(t.delta, last, dt, name);
    static_cast<unsigned char*>(d.data)[1] ^= 0x10;
    t.Update(v, 0.01);
    SyncReport r = t.Sync(v);
    t.ExpectSame();  // the bucket went whole: the corrupted byte is gone
    EXPECT_EQ(r.delta.fallback_checksum, 1) << name;
    EXPECT_EQ(r.delta.fallbacks(), 1) << name;
    EXPECT_GT(r.delta.buckets_delta, 0) << name;
    ++v;
  }
}

TEST(DeltaSession, BlockFp8StagedCommitRebuildsTheBaseFromTheCommittedWeights) {
  auto staged = [](int, SessionOptions& o) {
    o.commit = SessionOptions::Commit::kStaged;
    o.keep_previous = SessionOptions::Keep::kArea;
  };
  Twins t(WireEncoding::kDelta, staged, [](WireEncoding e) { return Fp8Spec(e); });
  t.Sync(1);
  ExpectAllOk(t.delta.Commit(1));
  t.ExpectSame();
  for (uint64_t v = 2; v <= 3; ++v) {
    t.Update(v, 0.01);
    SyncReport r = t.Sync(v);
    EXPECT_GT(r.delta.buckets_delta, 0) << "v" << v;  // against committed version v - 1
    EXPECT_EQ(r.delta.fallbacks(), 0) << "v" << v;
    ExpectAllOk(t.delta.Commit(v));
    t.ExpectSame();
  }
}

TEST(DeltaSession, BlockFp8StagePlansRefuseTheDeltaEncodingAtCreateNamingTheSplit) {
  JobSpec s = Fp8Spec(WireEncoding::kDelta, Encoding::kStage);
  auto server = std::move(StoreServer::Start("127.0.0.1", 0, "test-token-0123456789")).value();
  auto store =
      std::move(StoreClient::Connect(server->address(), "test-token-0123456789", Millis(5000)))
          .value();
  auto tx = NewLoopbackTransport(NewLoopbackHub());
  auto sess = SyncSession::Create(s.inputs, 0, *store, *tx, {});
  ASSERT_FALSE(sess.ok());
  // The plan's options refuse it (plan/fp8_codec.cc CheckOptions), so the CLI exits 2 up front.
  EXPECT_EQ(sess.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(sess.status().message(), HasSubstr("--fp8-split stage"));
  EXPECT_THAT(sess.status().message(), HasSubstr("--encoding delta"));
}

}  // namespace
}  // namespace shardsync
