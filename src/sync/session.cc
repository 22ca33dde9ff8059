// Sync session: replays one rank's plan per version with checksums on both sides, collects one
// job-wide report through the store (or a shared-memory board when every rank is on one host),
// and fails every rank fast when one fails.
#include "shardsync/session.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "common/trace.h"
#include "shardsync/checksum.h"
#include "shardsync/shard_map.h"
#include "sync/internal.h"
#include "sync/verdict_board.h"

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kControlMagic = 0x53534331;  // "SSC1"
// How often a waiting rank polls the abort key and its peers' versions.
constexpr std::chrono::milliseconds kAbortPollInterval{50};

// Sent after a bucket's puts were flushed: the receiver checksums what landed and compares.
struct Control {
  uint32_t magic = kControlMagic;
  uint32_t bucket = 0;
  uint64_t version = 0;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};
static_assert(sizeof(Control) == 32);

// Tags (48 bits: UCX keeps 16 for the source rank): [control 1][version mod 2^11][sequence 36].
// The version keeps messages of an aborted sync from being taken for a later sync's.
using sync_internal::MakeTag;
uint64_t ControlTag(uint64_t version, uint32_t bucket) { return MakeTag(true, version, bucket); }
uint64_t DataTag(uint64_t version, uint64_t seq) { return MakeTag(false, version, seq); }

using sync_internal::WireRun;

// How many wire bytes a sender keeps posted but not yet completed (the CPU packer's path): the
// receivers' CMA copies then read bytes the sender packed or checksummed moments before, from
// cache, and a fast sender does not pack far ahead of what its receivers take.
constexpr size_t kSendWindowBytes = size_t{2} << 20;
// The CPU packer's staging ring. Transfers complete (as the sender sees them) in posting order
// and at most kSendWindowBytes - len are outstanding when a transfer of len bytes is packed, so
// the outstanding ones occupy at most that much of the ring plus one skipped tail (< one
// transfer) at the wrap: the next len bytes are always free.
constexpr size_t kRingBytes = kSendWindowBytes + sync_internal::kMaxTransferBytes;
// Wire bytes cast and packed before their checksum is taken, so the checksum reads from L1/L2.
constexpr int64_t kPackChunkBytes = int64_t{32} << 10;

// A contiguous run of the sender's source memory (trainer dtype) feeding wire bytes
// [wire, wire + elems * wire size) of one bucket.
struct SrcPiece {
  int64_t wire = 0;
  const unsigned char* src = nullptr;
  int64_t elems = 0;
};

// A sender's precomputed view of one bucket: its transfers and, for packed ones, its sources.
struct SendBucket {
  std::vector<WireRun> xfers;
  std::vector<SrcPiece> pieces;  // in wire order, tiling the bucket
};

// The checksum of one bucket's wire image (checksum.h) accumulated from runs that complete
// in any order at any byte offset: whole words are summed at once; words split between runs
// (or the zero-padded last word) are collected as byte pieces and mixed once complete.
class LandedSum {
 public:
  void Add(const unsigned char* p, size_t len, uint64_t off) {
    bytes_ += len;
    const size_t lead = off % 8;
    if (lead != 0 && len > 0) {
      const size_t n = std::min(len, 8 - lead);
      uint64_t w = 0;
      std::memcpy(&w, p, n);
      pieces_.emplace_back(off / 8, w << (8 * lead));
      p += n;
      off += n;
      len -= n;
    }
    const size_t whole = len & ~size_t{7};
    if (whole) sum_ += ChecksumPartial(p, whole, off);
    p += whole;
    off += whole;
    len -= whole;
    if (len > 0) {
      uint64_t w = 0;
      std::memcpy(&w, p, len);  // little-endian host, as in checksum.cc
      pieces_.emplace_back(off / 8, w);
    }
  }
  // A partial sum (checksum.h) of `len` bytes of whole words, computed elsewhere.
  void AddWords(uint64_t partial, size_t len) {
    sum_ += partial;
    bytes_ += len;
  }
  uint64_t bytes() const { return bytes_; }
  // Pieces of one word cover disjoint bytes, so OR assembles the word (missing bytes: zero).
  uint64_t Finish() {
    std::sort(pieces_.begin(), pieces_.end());
    uint64_t sum = sum_;
    for (size_t i = 0; i < pieces_.size();) {
      uint64_t w = 0;
      size_t j = i;
      for (; j < pieces_.size() && pieces_[j].first == pieces_[i].first; ++j)
        w |= pieces_[j].second;
      sum += ChecksumMixWord(w, pieces_[i].first);
      i = j;
    }
    return ChecksumFinish(sum, bytes_);
  }

 private:
  uint64_t sum_ = 0;
  uint64_t bytes_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> pieces_;  // (word index, bytes in place)
};

// SHARDSYNC_TRACE=1 (common/trace.h): the session's steps on stderr. The text is built only when
// tracing is on: these calls sit on every sync's path.
template <typename Text>
void Trace(int rank, uint64_t version, const Text& text) {
  if (!trace::On()) return;
  trace::Line("sync rank %d v%llu: %s", rank, static_cast<unsigned long long>(version),
              std::string(text()).c_str());
}

std::string Hex(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Sender-side state of one bucket in flight.
struct InFlight {
  int msg = 0;
  int bucket = 0;
  int slot = 0;
  std::vector<XferId> xfers;  // puts + flush (put mode) or data + control sends (tag mode)
  std::vector<size_t> lens;   // wire bytes of each of xfers (0: flush / control)
  uint64_t checksum = 0;
  std::unique_ptr<Control> control;
  // Summed sends (transport caps().summed_copy): the bucket's checksum is complete only once
  // the transport reported the words it summed while copying; the control message waits.
  std::shared_ptr<LandedSum> sum;       // shared with the fill functions of filled sends
  size_t sums_begin = 0, sums_end = 0;  // this bucket's entries of the sync's CopySum array
};

class SessionImpl final : public SyncSession {
 public:
  SessionImpl(PlanInputs in, int rank, SyncRank who, RankPlan plan, StoreClient& store,
              Transport& tx, SessionOptions opt, sync_internal::HarnessHooks hooks)
      : in_(std::move(in)),
        rank_(rank),
        who_(who),
        plan_(std::move(plan)),
        store_(store),
        tx_(tx),
        opt_(std::move(opt)),
        hooks_(std::move(hooks)),
        inventory_(HfTensorInventory(in_.model)),
        world_(SyncWorldSize(in_)) {
    if (opt_.packer == nullptr) {
      own_packer_ = MakeCpuPacker();
      packer_ = own_packer_.get();
    } else {
      packer_ = opt_.packer;
    }
    for (size_t i = 0; i < inventory_.size(); ++i) tensor_index_[inventory_[i].name] = i;
  }

  Status Init() {
    if (!who_.is_trainer) {
      SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(in_.model, in_.rollout.shard));
      shards_ = map.rank(who_.tp_rank, who_.pp_rank);
      for (size_t i = 0; i < shards_.params.size(); ++i) param_index_[shards_.params[i].name] = i;
      dests_.resize(shards_.params.size());
    }
    return OkStatus();
  }

  int rank() const override { return rank_; }
  bool is_trainer() const override { return who_.is_trainer; }
  const RankPlan& plan() const override { return plan_; }
  const std::vector<EngineParam>& ExpectedParams() const override { return shards_.params; }
  bool IsPoisoned() const override { return poisoned_; }
  uint64_t last_good_version() const override { return last_good_; }

  Status BindSource(const SourceBinding& b) override {
    if (connected_)
      return FailedPreconditionError("BindSource(" + b.hf_name + "): already connected");
    if (!who_.is_trainer) {
      return FailedPreconditionError("BindSource(" + b.hf_name + "): sync rank " +
                                     std::to_string(rank_) + " is an engine rank");
    }
    auto it = tensor_index_.find(b.hf_name);
    if (it == tensor_index_.end()) {
      return InvalidArgumentError("source binding '" + b.hf_name + "': not a tensor of model " +
                                  in_.model.name);
    }
    const HfTensor& t = inventory_[it->second];
    const Region held = TrainerHeldRegion(in_.trainer, who_.trainer_rank, t.shape);
    if (!(b.region == held)) {
      return InvalidArgumentError("source binding '" + b.hf_name + "': trainer rank " +
                                  std::to_string(who_.trainer_rank) + " of " +
                                  in_.trainer.ToString() + " holds " + held.ToString() +
                                  ", binding covers " + b.region.ToString());
    }
    if (b.dtype != in_.trainer_dtype) {
      return InvalidArgumentError("source binding '" + b.hf_name + "': dtype " +
                                  std::string(DTypeName(b.dtype)) + ", plan's trainer dtype is " +
                                  std::string(DTypeName(in_.trainer_dtype)));
    }
    if (b.data == nullptr && !held.empty()) {
      return InvalidArgumentError("source binding '" + b.hf_name + "': null data");
    }
    if (!packer_->Supports(b.mem)) {
      return InvalidArgumentError("source binding '" + b.hf_name +
                                  "': " + (b.mem == MemKind::kCuda ? "device" : "host") +
                                  " memory needs a packer that handles it (SessionOptions::packer;"
                                  " the " +
                                  std::string(packer_->name()) + " packer does not)");
    }
    if (!sources_.emplace(it->second, b).second) {
      return InvalidArgumentError("source binding '" + b.hf_name + "': bound twice");
    }
    return OkStatus();
  }

  Status BindDest(const DestBinding& b) override {
    if (connected_) return FailedPreconditionError("BindDest(" + b.name + "): already connected");
    if (who_.is_trainer) {
      return FailedPreconditionError("BindDest(" + b.name + "): sync rank " +
                                     std::to_string(rank_) + " is a trainer rank");
    }
    auto it = param_index_.find(b.name);
    if (it == param_index_.end()) {
      return InvalidArgumentError(
          "destination binding '" + b.name + "': not a parameter of engine rank tp=" +
          std::to_string(who_.tp_rank) + " pp=" + std::to_string(who_.pp_rank));
    }
    const EngineParam& p = shards_.params[it->second];
    if (b.shape != p.shape) {
      return InvalidArgumentError("destination binding '" + b.name + "': shape " +
                                  ShapeToString(b.shape) + ", the shard map says " +
                                  ShapeToString(p.shape));
    }
    if (b.dtype != in_.options.wire_dtype) {
      return InvalidArgumentError(
          "destination binding '" + b.name + "': dtype " + std::string(DTypeName(b.dtype)) +
          " differs from the wire dtype " + std::string(DTypeName(in_.options.wire_dtype)) +
          " (bytes land in place, so parameters must use the wire dtype)");
    }
    if (b.data == nullptr) {
      return InvalidArgumentError("destination binding '" + b.name + "': null data");
    }
    if (!packer_->Supports(b.mem)) {
      return InvalidArgumentError("destination binding '" + b.name +
                                  "': " + (b.mem == MemKind::kCuda ? "device" : "host") +
                                  " memory needs a packer that handles it (SessionOptions::packer;"
                                  " the " +
                                  std::string(packer_->name()) + " packer does not)");
    }
    if (dests_[it->second].data != nullptr) {
      return InvalidArgumentError("destination binding '" + b.name + "': bound twice");
    }
    dests_[it->second] = b;
    return OkStatus();
  }

  Status Connect() override {
    if (connected_)
      return FailedPreconditionError("sync rank " + std::to_string(rank_) + ": already connected");
    SS_RETURN_IF_ERROR(packer_->Quiesce());  // registered memory is final before peers see it
    const auto deadline = Clock::now() + opt_.connect_timeout;
    // 1. Plan hashes: every rank must hold the same plan before any byte moves.
    SS_RETURN_IF_ERROR(store_.Set(Key("hash/" + std::to_string(rank_)), plan_.plan_hash));
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      SS_ASSIGN_OR_RETURN(std::string h, GetUntil(Key("hash/" + std::to_string(r)), deadline,
                                                  "plan hash of sync rank " + std::to_string(r)));
      if (h != plan_.plan_hash) {
        return FailedPreconditionError(
            "plan hash mismatch: sync rank " + std::to_string(r) + " has " + h + ", sync rank " +
            std::to_string(rank_) + " (this rank) has " + plan_.plan_hash +
            ": ranks were started with different model, layouts or plan options");
      }
    }
    // 2. Bindings against the plan.
    SS_RETURN_IF_ERROR(CheckBindings());
    // 3. Receive memory, registered once: senders put straight into the parameters.
    if (!who_.is_trainer) {
      uint32_t base = 0;
      for (size_t i = 0; i < dests_.size(); ++i) {
        const DestBinding& d = dests_[i];
        const size_t bytes = static_cast<size_t>(NumElements(d.shape)) * DTypeSize(d.dtype);
        SS_ASSIGN_OR_RETURN(uint32_t id, tx_.RegisterMemory({d.data, bytes, d.mem, d.device}));
        if (i == 0) base = id;
        if (id != base + i) {
          return InternalError("transport " + std::string(tx_.name()) +
                               ": region ids are not dense (parameter " + d.name + " got " +
                               std::to_string(id) + ")");
        }
      }
      SS_RETURN_IF_ERROR(store_.Set(Key("regbase/" + std::to_string(rank_)), std::to_string(base)));
    }
    if (hooks_.before_transport_connect) SS_RETURN_IF_ERROR(hooks_.before_transport_connect(tx_));
    // 4. Transport.
    std::vector<int> peers;
    for (const Message& m : plan_.sends) peers.push_back(m.dst);
    for (const Message& m : plan_.recvs) peers.push_back(m.src);
    peers.insert(peers.end(), hooks_.extra_peers.begin(), hooks_.extra_peers.end());
    std::sort(peers.begin(), peers.end());
    peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
    peers_ = peers;
    auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    SS_RETURN_IF_ERROR(tx_.Connect(store_, Key("tx/"), rank_, peers, std::max(left, Millis(1))));
    for (const Message& m : plan_.sends) {
      SS_ASSIGN_OR_RETURN(std::string b, GetUntil(Key("regbase/" + std::to_string(m.dst)), deadline,
                                                  "memory registration of engine sync rank " +
                                                      std::to_string(m.dst)));
      char* end = nullptr;
      const unsigned long v = std::strtoul(b.c_str(), &end, 10);
      if (b.empty() || *end != '\0' || v > UINT32_MAX) {
        return DataLossError("memory registration of engine sync rank " + std::to_string(m.dst) +
                             " is malformed: '" + b + "'");
      }
      regbase_[m.dst] = static_cast<uint32_t>(v);
    }
    SS_RETURN_IF_ERROR(PreparePairs(deadline));
    SS_RETURN_IF_ERROR(OpenVerdictBoard(deadline));
    if (packer_ == own_packer_.get()) {
      // The CPU packer packs transfer by transfer into a small ring (RunSender says why it is
      // never overwritten while in flight): it stays in cache, so packing writes cost no DRAM
      // traffic, and staging memory no longer grows with the bucket cap.
      if (!plan_.sends.empty()) {
        SS_ASSIGN_OR_RETURN(staging_[0], packer_->AllocStaging(kRingBytes));
      }
    } else {
      // Staging: two buckets (double buffering), bounded by the plan's bucket cap.
      int64_t max_bucket = 0;
      for (size_t mi = 0; mi < plan_.sends.size(); ++mi) {
        if (send_pairs_[mi]) continue;  // prepared pairs stage (or not) on their own
        for (const Bucket& b : plan_.sends[mi].buckets) max_bucket = std::max(max_bucket, b.bytes);
      }
      for (auto& s : staging_) {
        if (max_bucket == 0) break;
        SS_ASSIGN_OR_RETURN(s, packer_->AllocStaging(static_cast<size_t>(max_bucket)));
      }
    }
    SS_RETURN_IF_ERROR(PrecomputeTransfers());
    connected_ = true;
    return OkStatus();
  }

  Result<SyncReport> Sync(uint64_t version) override {
    if (!connected_) {
      return FailedPreconditionError("sync rank " + std::to_string(rank_) +
                                     ": Sync before Connect");
    }
    const auto t0 = Clock::now();
    Trace(rank_, version, [] { return "called"; });
    deadline_ = t0 + opt_.sync_timeout;
    version_ = version;
    // The first abort poll (a store round trip per peer) waits: a sync that completes within
    // the poll interval pays none on its critical path, and peers' failures reach it anyway
    // through its pairs, the abort key and the gathered verdicts.
    next_abort_check_ = t0 + kAbortPollInterval;
    RankSyncStats st;
    st.rank = rank_;
    Status s;
    if (version <= last_good_ || version <= last_attempted_) {
      // Nothing is touched: a refused version leaves the parameters (and poison state) as is.
      s = FailedPreconditionError("sync rank " + std::to_string(rank_) + ": version " +
                                  std::to_string(version) + " is stale (last successful version " +
                                  std::to_string(last_good_) + ", last attempted " +
                                  std::to_string(last_attempted_) + "; use a newer version)");
      // Tell peers that may be waiting on this version; its store keys belong to an earlier
      // attempt, so no verdict is posted.
      if (version > last_good_) PostAbort(s);
      return s;
    }
    last_attempted_ = version;
    if (!who_.is_trainer) poisoned_ = true;  // bytes are about to be overwritten
    s = packer_->Quiesce();  // the caller's pending writes to bound memory land first
    // (Each rank says it entered, its `cur` key, off its critical path: a receiver once its
    // prepared pairs are posted (RunReceiver), a sender while they run (RunSender).)
    Trace(rank_, version, [] { return "entered"; });
    if (s.ok()) s = who_.is_trainer ? RunSender(st) : RunReceiver(st);
    st.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    st.ok = s.ok();
    Trace(rank_, version, [&] { return s.ok() ? "synced" : "failed: " + s.ToString(); });
    if (!s.ok()) {
      st.error = s.message();
      PostAbort(s);
      for (auto* pairs : {&send_pairs_, &recv_pairs_}) {
        for (auto& p : *pairs) {
          if (p) p->Cancel();
        }
      }
    }
    // Everyone posts a verdict, failed or not, so peers learn the cause rather than time out: on
    // the board when the job has one, and a failed one on the store too (its whole text); a good
    // one otherwise in the same store round trip as the wait for everyone else's.
    const std::string verdict_key = Key(VKey("done/") + std::to_string(rank_));
    const std::string verdict = sync_internal::EncodeVerdict(st);
    if (board_) board_->Post(rank_, version, verdict);
    if (!s.ok()) {
      store_.Set(verdict_key, verdict).IgnoreError();  // the whole text, and for store readers
      return s;
    }
    auto report = Gather(st, {verdict_key, verdict});
    if (!report.ok()) return Fail(report.status());
    Trace(rank_, version, [] { return "gathered every verdict"; });
    last_good_ = version;
    poisoned_ = false;
    return report;
  }

 private:
  std::string Key(const std::string& k) const { return opt_.prefix + k; }
  std::string VKey(const std::string& k) const { return "v" + std::to_string(version_) + "/" + k; }

  Status Fail(const Status& s) {
    PostAbort(s);
    if (!who_.is_trainer) poisoned_ = true;
    return s;
  }

  void PostAbort(const Status& s) {
    // Aborted is usually someone else's failure, already posted (keep its cause); but a pair
    // cancelled by an earlier failure also fails with Aborted, and peers must hear of it.
    if (s.code() == StatusCode::kAborted && store_.Get(Key(VKey("abort")), Millis(0)).ok()) return;
    store_
        .Set(Key(VKey("abort")), "sync rank " + std::to_string(rank_) + " failed: " + s.ToString())
        .IgnoreError();
  }

  // Blocks for a key until `deadline`, in short slices so the abort key is seen meanwhile.
  Result<std::string> GetUntil(const std::string& key, Clock::time_point deadline,
                               const std::string& what, bool watch_abort = false) {
    SS_ASSIGN_OR_RETURN(std::vector<std::string> v,
                        GetManyUntil(
                            {key}, deadline, [&](size_t) { return what; }, watch_abort));
    return std::move(v[0]);
  }

  // Several keys in one store round trip, in short slices when `watch_abort`; on timeout the
  // error names the first key still missing (`what(i)` describes key i). `set_first` is set in
  // the first round trip.
  Result<std::vector<std::string>> GetManyUntil(
      const std::vector<std::string>& keys, Clock::time_point deadline,
      const std::function<std::string(size_t)>& what, bool watch_abort = false,
      const std::pair<std::string, std::string>* set_first = nullptr) {
    if (set_first && keys.empty()) {
      SS_RETURN_IF_ERROR(store_.Set(set_first->first, set_first->second));
      return std::vector<std::string>{};
    }
    while (true) {
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      if (left <= Millis(0)) {
        if (set_first) SS_RETURN_IF_ERROR(store_.Set(set_first->first, set_first->second));
        set_first = nullptr;
        for (size_t i = 0; i < keys.size(); ++i) {
          if (!store_.Get(keys[i], Millis(0)).ok()) {
            return DeadlineExceededError("sync rank " + std::to_string(rank_) +
                                         ": timed out waiting for " + what(i));
          }
        }
        left = Millis(0);  // every key arrived at the last moment: take them
      }
      const Millis slice = std::min(left, Millis(watch_abort ? 5 : 1000));
      auto r = set_first ? store_.SetThenGetMany(set_first->first, set_first->second, keys, slice)
                         : store_.GetMany(keys, slice);
      set_first = nullptr;
      if (r.ok()) return r;
      if (r.status().code() != StatusCode::kDeadlineExceeded) return r.status();
      if (left <= Millis(0)) continue;
      if (watch_abort) {
        Progress();
        SS_RETURN_IF_ERROR(CheckAbort());
      }
    }
  }

  // Polls the job's abort key and the peers' current versions (at most every 50 ms).
  Status CheckAbort(bool force = false) {
    const auto now = Clock::now();
    if (!force && now < next_abort_check_) return OkStatus();
    next_abort_check_ = now + kAbortPollInterval;
    auto a = store_.Get(Key(VKey("abort")), Millis(0));
    if (a.ok())
      return AbortedError("sync rank " + std::to_string(rank_) + ": version " +
                          std::to_string(version_) + " aborted: " + *a);
    for (int p : peers_) {
      auto v = store_.Get(Key("cur/" + std::to_string(p)), Millis(0));
      if (!v.ok()) continue;
      const uint64_t pv = std::strtoull(v->c_str(), nullptr, 10);
      // A peer that already posted its verdict for this version may legitimately have moved on
      // (it gathered every verdict, ours included, while we still wait for a slower rank's).
      if (pv > version_ && !PostedVerdict(p)) {
        Status s = FailedPreconditionError(
            "sync rank " + std::to_string(rank_) + ": version " + std::to_string(version_) +
            " differs from peer sync rank " + std::to_string(p) + "'s version " + v.value());
        // The peer is waiting on its own version: tell it too.
        store_
            .Set(Key("v" + v.value() + "/abort"),
                 "sync rank " + std::to_string(rank_) + " failed: " + s.ToString())
            .IgnoreError();
        return s;
      }
    }
    return OkStatus();
  }

  Status CheckDeadline(const std::string& what) {
    if (Clock::now() > deadline_) {
      return DeadlineExceededError("sync rank " + std::to_string(rank_) + ": version " +
                                   std::to_string(version_) + " timed out after " +
                                   std::to_string(opt_.sync_timeout.count()) + " ms " + what);
    }
    return CheckAbort();
  }
  // The same, naming who(i) only when it fails (not built on every poll).
  Status CheckDeadline(size_t i, const std::function<std::string(size_t)>& who) {
    if (Clock::now() > deadline_) return CheckDeadline(who(i));
    return CheckAbort();
  }

  // Drives the transport until every id completed, the deadline passed or the job aborted.
  Status WaitAll(std::vector<XferId>& ids, const std::string& what) {
    int idle = 0;
    while (!ids.empty()) {
      // In posting order, stopping at the first transfer still in flight.
      size_t done = 0;
      for (; done < ids.size(); ++done) {
        auto st = tx_.Poll(ids[done]);
        if (!st.ok()) {
          Status e = st.status();
          return e.Annotate("sync rank " + std::to_string(rank_) + ": " + what);
        }
        if (*st == XferState::kInProgress) break;
      }
      const bool progressed = done > 0;
      ids.erase(ids.begin(), ids.begin() + done);
      if (ids.empty()) break;
      SS_RETURN_IF_ERROR(CheckDeadline(what));
      Backoff(progressed, idle);
    }
    return OkStatus();
  }

  // Busy-polls briefly, then sleeps: ranks share few cores with the peers they wait for.
  static void Backoff(bool progressed, int& idle) {
    if (progressed) {
      idle = 0;
      return;
    }
    if (++idle < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(idle < 1024 ? 20 : 200));
    }
  }

  Status CheckBindings() {
    if (who_.is_trainer) {
      for (const Message& m : plan_.sends) {
        for (const TransferOp& op : m.ops) {
          auto it = sources_.find(op.tensor);
          const std::string& name = inventory_.at(op.tensor).name;
          if (it == sources_.end()) {
            return NotFoundError("sync rank " + std::to_string(rank_) + ": source tensor '" + name +
                                 "' is sent by the plan but was not bound");
          }
          if (!RegionContains(it->second.region, op.src)) {
            return InvalidArgumentError("source binding '" + name + "': plan reads " +
                                        op.src.ToString() + " outside the bound region " +
                                        it->second.region.ToString());
          }
        }
      }
      return OkStatus();
    }
    for (size_t i = 0; i < dests_.size(); ++i) {
      if (dests_[i].data == nullptr) {
        return NotFoundError("sync rank " + std::to_string(rank_) + ": engine parameter '" +
                             shards_.params[i].name + "' (tp=" + std::to_string(who_.tp_rank) +
                             " pp=" + std::to_string(who_.pp_rank) + ") was not bound");
      }
    }
    for (const Message& m : plan_.recvs) {
      for (const TransferOp& op : m.ops) {
        if (op.param < 0 || static_cast<size_t>(op.param) >= dests_.size() ||
            !RegionInside(op.dst, dests_[op.param].shape)) {
          return InternalError("plan op from sync rank " + std::to_string(m.src) +
                               " lands outside parameter index " + std::to_string(op.param));
        }
      }
    }
    return OkStatus();
  }

  // PackRegions of one bucket on the sending side.
  std::vector<PackRegion> SourceRegions(const Message& m, const Bucket& b) const {
    std::vector<PackRegion> out;
    for (int i = b.op_begin; i < b.op_end; ++i) {
      const TransferOp& op = m.ops[i];
      const SourceBinding& sb = sources_.at(op.tensor);
      PackRegion r;
      r.base = sb.data;
      r.dtype = sb.dtype;
      r.shape = sb.region.extents();
      r.region = op.src;
      for (int d = 0; d < op.src.ndim; ++d) r.region.offset[d] -= sb.region.offset[d];
      r.wire_offset = op.wire_offset - b.wire_offset;
      out.push_back(std::move(r));
    }
    return out;
  }

  std::vector<PackRegion> LandedRegions(const Message& m, const Bucket& b) const {
    std::vector<PackRegion> out;
    for (int i = b.op_begin; i < b.op_end; ++i) {
      const TransferOp& op = m.ops[i];
      const DestBinding& d = dests_[op.param];
      out.push_back({d.data, d.dtype, d.shape, op.dst, op.wire_offset - b.wire_offset});
    }
    return out;
  }

  // A sender's host-path state for one sync (the transfers that are not prepared pairs).
  struct HostSend {
    std::vector<std::pair<int, int>> order;  // (message, bucket) in posting order
    bool put = false, fused = false, summed = false, filled = false;
    // One CopySum per direct transfer of this sync, at fixed addresses the transport writes
    // into; kept past a failure (graveyard_) since the transport may still complete them.
    std::shared_ptr<std::vector<CopySum>> send_sums = std::make_shared<std::vector<CopySum>>();
    std::vector<size_t> sum_words;  // bytes of whole words each CopySum covers
    std::deque<InFlight> flying;
    size_t outstanding = 0;  // wire bytes posted and not yet seen complete (fused path)
    size_t ring_at = 0;      // next free byte of the staging ring (fused path)
    std::vector<std::unique_ptr<Control>> sent_controls;  // alive until their sends complete
    std::vector<XferId> ctrl_ids;
    std::vector<uint64_t> next_seq;
    int next_slot = 0;
  };

  Status RunSender(RankSyncStats& st) {
    // Pairs that hold their writes until their receiver is in this sync go first (cuda_ipc:
    // they launch the moment the last receiver's pair is posted); every other receiver is waited
    // for through its ready key.
    auto signals = [&](size_t mi) { return send_pairs_[mi] && send_pairs_[mi]->SignalsReady(); };
    SS_RETURN_IF_ERROR(PostPairs(send_pairs_, signals));
    // This rank's `cur` key costs a store round trip: set while the prepared pairs run when
    // they are all there is to wait for, else before the first wait on the store.
    bool entered = false;
    auto enter = [&]() -> Status {
      if (entered) return OkStatus();
      entered = true;
      return store_.Set(Key("cur/" + std::to_string(rank_)), std::to_string(version_));
    };
    std::vector<std::string> ready;
    std::vector<int> waited;
    for (size_t mi = 0; mi < plan_.sends.size(); ++mi) {
      if (signals(mi)) continue;
      ready.push_back(Key(VKey("ready/") + std::to_string(plan_.sends[mi].dst)));
      waited.push_back(plan_.sends[mi].dst);
    }
    if (!ready.empty()) SS_RETURN_IF_ERROR(enter());
    SS_RETURN_IF_ERROR(GetManyUntil(
                           ready, deadline_,
                           [&](size_t i) {
                             return "sync rank " + std::to_string(waited[i]) +
                                    " to enter version " + std::to_string(version_);
                           },
                           /*watch_abort=*/true)
                           .status());
    Trace(rank_, version_, [&] { return std::to_string(ready.size()) + " ready keys in"; });
    // Prepared pairs (device memory) go first: their device work overlaps the host path below.
    SS_RETURN_IF_ERROR(PostPairs(send_pairs_, [&](size_t mi) { return !signals(mi); }));
    HostSend hs = PlanHostSend();
    if (!hs.order.empty()) SS_RETURN_IF_ERROR(enter());
    struct KeepOnFailure {
      std::vector<std::shared_ptr<void>>& yard;
      std::shared_ptr<void> sums;
      bool done = false;
      ~KeepOnFailure() {
        if (!done && sums) yard.push_back(std::move(sums));
      }
    } keep{graveyard_, hs.summed ? hs.send_sums : nullptr};
    for (auto [mi, bi] : hs.order) {
      if (hs.flying.size() == 2) SS_RETURN_IF_ERROR(FinishOldest(hs, st));
      SS_RETURN_IF_ERROR(CheckDeadline("while sending"));
      SS_RETURN_IF_ERROR(PostHostBucket(hs, mi, bi));
    }
    while (!hs.flying.empty()) SS_RETURN_IF_ERROR(FinishOldest(hs, st));
    SS_RETURN_IF_ERROR(WaitAll(hs.ctrl_ids, "sending control messages"));
    SS_RETURN_IF_ERROR(FinishPreparedSends(st, enter));
    SS_RETURN_IF_ERROR(enter());
    // A send can complete here while its protocol tail (e.g. a rendezvous put's completion
    // message) is still queued on this side: flush before this rank stops driving progress.
    std::vector<XferId> flushes;
    for (size_t mi = 0; mi < plan_.sends.size(); ++mi) {
      if (send_pairs_[mi]) continue;
      SS_ASSIGN_OR_RETURN(XferId id, tx_.PostFlush(plan_.sends[mi].dst));
      flushes.push_back(id);
    }
    SS_RETURN_IF_ERROR(WaitAll(flushes, "flushing to the receivers"));
    keep.done = true;
    return OkStatus();
  }

  HostSend PlanHostSend() const {
    HostSend hs;
    // Buckets round-robin over receivers, so every receiver verifies while others still land.
    // Each sender starts the round at a different receiver (rotated by its trainer rank): if
    // every sender began with the same receiver, that one would be flooded while the last one
    // idles until every sender had packed all earlier buckets.
    size_t max_buckets = 0;
    for (const Message& m : plan_.sends) max_buckets = std::max(max_buckets, m.buckets.size());
    const size_t nmsg = plan_.sends.size();
    const size_t first = nmsg ? static_cast<size_t>(who_.trainer_rank) % nmsg : 0;
    for (size_t b = 0; b < max_buckets; ++b) {
      for (size_t k = 0; k < nmsg; ++k) {
        const size_t m = (first + k) % nmsg;
        if (!send_pairs_[m] && b < plan_.sends[m].buckets.size()) hs.order.emplace_back(m, b);
      }
    }
    hs.put = tx_.caps().one_sided_put;
    // The built-in CPU packer (host memory): pack or checksum each transfer just before posting
    // it, and post direct transfers from the source memory itself. A packer passed in (device
    // memory) packs whole buckets into its staging; the same transfers then leave from there.
    hs.fused = packer_ == own_packer_.get();
    // Direct transfers checksummed by the transport's own copy (shm): no separate read.
    hs.summed = hs.fused && !hs.put && tx_.caps().summed_copy;
    // Packed transfers cast / gathered straight into the transport's staging (shm ring slots)
    // instead of into ours and then copied.
    hs.filled = hs.summed && tx_.caps().filled_send;
    if (hs.summed) {
      size_t n = 0;
      for (auto [mi, bi] : hs.order) {
        for (const WireRun& r : send_buckets_[mi][bi].xfers) n += r.direct;
      }
      hs.send_sums->reserve(n);
      hs.sum_words.reserve(n);
    }
    hs.next_seq.assign(plan_.sends.size(), 0);
    return hs;
  }

  std::unique_ptr<Control> MakeControl(const InFlight& f) const {
    auto c = std::make_unique<Control>();
    c->bucket = static_cast<uint32_t>(f.bucket);
    c->version = version_;
    c->bytes = static_cast<uint64_t>(plan_.sends[f.msg].buckets[f.bucket].bytes);
    c->checksum = f.checksum;
    return c;
  }

  // Completes the oldest transfers (in posting order) until at most `limit` wire bytes are
  // outstanding, driving progress meanwhile.
  Status Drain(HostSend& hs, size_t limit) {
    int idle = 0;
    while (hs.outstanding > limit) {
      bool progressed = false;
      for (InFlight& f : hs.flying) {
        size_t done = 0;
        for (; done < f.xfers.size() && hs.outstanding > limit; ++done) {
          auto state = tx_.Poll(f.xfers[done]);
          if (!state.ok()) {
            Status e = state.status();
            return e.Annotate("sync rank " + std::to_string(rank_) + ": sending to sync rank " +
                              std::to_string(plan_.sends[f.msg].dst));
          }
          if (*state == XferState::kInProgress) break;
          hs.outstanding -= f.lens[done];
        }
        progressed |= done > 0;
        f.xfers.erase(f.xfers.begin(), f.xfers.begin() + done);
        f.lens.erase(f.lens.begin(), f.lens.begin() + done);
        if (!f.xfers.empty()) break;  // completions arrive roughly in posting order
      }
      if (hs.outstanding <= limit) break;
      SS_RETURN_IF_ERROR(CheckDeadline("while sending"));
      Backoff(progressed, idle);
    }
    return OkStatus();
  }

  Status FinishOldest(HostSend& hs, RankSyncStats& st) {
    InFlight& f = hs.flying.front();
    const Message& m = plan_.sends[f.msg];
    SS_RETURN_IF_ERROR(WaitAll(f.xfers, "sending to sync rank " + std::to_string(m.dst)));
    for (size_t n : f.lens) hs.outstanding -= n;
    if (f.sum) {
      for (size_t i = f.sums_begin; i < f.sums_end; ++i) {
        f.sum->AddWords((*hs.send_sums)[i].sum, hs.sum_words[i]);
      }
      SS_RETURN_IF_ERROR(CheckPacked(m, f.bucket, f.sum->bytes()));
      f.checksum = f.sum->Finish();
    }
    if (hs.put || hs.summed) {
      // The flush completed: the bytes are visible at the receiver before it hears of them.
      auto c = MakeControl(f);
      SS_ASSIGN_OR_RETURN(
          XferId id, tx_.PostSend(m.dst, ControlTag(version_, f.bucket), c.get(), sizeof(Control)));
      hs.ctrl_ids.push_back(id);
      hs.sent_controls.push_back(std::move(c));
    }
    st.send_bytes += m.buckets[f.bucket].bytes;
    hs.flying.pop_front();
    return OkStatus();
  }

  Status CheckPacked(const Message& m, int bucket, uint64_t bytes) const {
    const auto want = static_cast<uint64_t>(m.buckets[bucket].bytes);
    if (bytes == want) return OkStatus();
    return InternalError("sync rank " + std::to_string(rank_) + ": packed " +
                         std::to_string(bytes) + " bytes of a " + std::to_string(want) +
                         "-byte bucket to sync rank " + std::to_string(m.dst));
  }

  // Packs (or checksums) and posts every transfer of bucket `bi` of send message `mi`.
  Status PostHostBucket(HostSend& hs, int mi, int bi) {
    const Message& m = plan_.sends[mi];
    const Bucket& b = m.buckets[bi];
    hs.flying.emplace_back();
    InFlight& f = hs.flying.back();
    f.msg = mi;
    f.bucket = bi;
    f.slot = hs.next_slot;
    hs.next_slot ^= 1;
    unsigned char* stage = hs.fused ? nullptr : staging_[f.slot].get();
    if (!hs.fused) {
      SS_ASSIGN_OR_RETURN(
          f.checksum, packer_->Pack(SourceRegions(m, b), in_.options.wire_dtype, stage, b.bytes));
    }
    f.sum = std::make_shared<LandedSum>();
    f.sums_begin = hs.send_sums->size();
    for (const WireRun& r : send_buckets_[mi][bi].xfers) {
      SS_ASSIGN_OR_RETURN(XferId id, PostHostTransfer(hs, f, r, stage));
      ++hs.next_seq[mi];
      f.xfers.push_back(id);
      f.lens.push_back(r.len);
      hs.outstanding += r.len;
    }
    if (hs.fused) {
      f.sums_end = hs.send_sums->size();
      // Summed: the checksum (and this check) completes in FinishOldest.
      if (!hs.summed) {
        SS_RETURN_IF_ERROR(CheckPacked(m, bi, f.sum->bytes()));
        f.checksum = f.sum->Finish();
        f.sum.reset();
      }
    } else {
      f.sum.reset();
    }
    if (hs.put) {
      SS_ASSIGN_OR_RETURN(XferId fl, tx_.PostFlush(m.dst));
      f.xfers.push_back(fl);
      f.lens.push_back(0);
    } else if (!hs.summed) {
      // Two-sided: the receiver waits for the data receives and the control message alike.
      f.control = MakeControl(f);
      SS_ASSIGN_OR_RETURN(XferId id, tx_.PostSend(m.dst, ControlTag(version_, f.bucket),
                                                  f.control.get(), sizeof(Control)));
      f.xfers.push_back(id);
      f.lens.push_back(0);
    }
    return OkStatus();
  }

  // One transfer `r` of the bucket in flight `f`: from staging (a packer passed in), or, with the
  // built-in packer, straight from the source (direct) or packed just before it is posted.
  Result<XferId> PostHostTransfer(HostSend& hs, InFlight& f, const WireRun& r,
                                  unsigned char* stage) {
    const Message& m = plan_.sends[f.msg];
    const SendBucket& sb = send_buckets_[f.msg][f.bucket];
    LandedSum& sum = *f.sum;
    const unsigned char* src = hs.fused ? nullptr : stage + r.wire_offset;
    CopySum* copy_sum = nullptr;
    Transport::SendFill fill;
    if (hs.fused) {
      SS_RETURN_IF_ERROR(Drain(hs, kSendWindowBytes > r.len ? kSendWindowBytes - r.len : 0));
      if (r.direct) {
        const auto* data = static_cast<const unsigned char*>(sources_.at(r.tensor).data);
        src = data + r.src_offset;
        const auto key = static_cast<uint64_t>(r.wire_offset);
        if (hs.summed) {
          // The transport sums the whole words as it copies them out; the edges are ours.
          const uint64_t h = SummedHead(key, r.len), t = SummedTail(key, r.len);
          sum.Add(src, h, key);
          sum.Add(src + t, r.len - t, key + t);
          hs.send_sums->push_back(CopySum{key, 0});
          hs.sum_words.push_back(static_cast<size_t>(t - h));
          copy_sum = &hs.send_sums->back();
        } else {
          // Straight from the trainer's memory: checksummed right before it is posted, so
          // the receiver's copy finds it in cache.
          sum.Add(src, r.len, key);
        }
      } else if (hs.filled) {
        // PackRange, from the transport's progress, into each slot as it frees up.
        fill = [this, bucket = &sb, sum = f.sum, at = r.wire_offset](void* dst, uint64_t off,
                                                                     uint64_t len) {
          PackRange(*bucket, at + static_cast<int64_t>(off), static_cast<int64_t>(len),
                    static_cast<unsigned char*>(dst), *sum);
        };
      } else {
        if (hs.ring_at + r.len > kRingBytes) hs.ring_at = 0;
        unsigned char* out = staging_[0].get() + hs.ring_at;
        hs.ring_at += r.len;
        PackRange(sb, r.wire_offset, static_cast<int64_t>(r.len), out, sum);
        src = out;
      }
    }
    const uint64_t tag = DataTag(version_, hs.next_seq[f.msg]);
    if (hs.put) {
      return tx_.PostPut(m.dst, src, r.len, regbase_.at(m.dst) + static_cast<uint32_t>(r.param),
                         r.param_offset);
    }
    if (fill) return tx_.PostSendFilled(m.dst, tag, r.len, std::move(fill));
    if (copy_sum) return tx_.PostSendSummed(m.dst, tag, src, r.len, copy_sum);
    return tx_.PostSend(m.dst, tag, src, r.len);
  }

  // ---- prepared pairs (device memory: the transport compiles each pair's slice once) ----

  // The memory every binding of this rank lives in (-1: none bound, or a mix).
  int BoundMem() const {
    int kind = -1;
    auto see = [&](MemKind k) {
      const int v = static_cast<int>(k);
      kind = kind == -1 || kind == v ? v : -2;
    };
    for (const auto& [t, b] : sources_) see(b.mem);
    for (const DestBinding& d : dests_) see(d.mem);
    return kind < 0 ? -1 : kind;
  }

  // Whether the pair with `peer` runs as a prepared pair: its transport prepares transfers over
  // the memory every binding of this rank lives in (device memory: cuda_ipc, nccl).
  bool Prepared(int peer) const {
    const TransportCaps c = tx_.PeerCaps(peer);
    const int mem = BoundMem();
    return c.prepared && mem >= 0 &&
           (static_cast<MemKind>(mem) == MemKind::kCuda ? c.device_memory : c.host_memory);
  }

  std::string PairKey(int src, int dst) const {
    return Key("pair/" + std::to_string(src) + "_" + std::to_string(dst) + "/");
  }

  // Every pair whose transport prepares transfers gets its slice compiled now. Receivers first:
  // they publish what their senders read (cuda_ipc: the landed map) and never wait.
  Status PreparePairs(Clock::time_point deadline) {
    send_pairs_.resize(plan_.sends.size());
    recv_pairs_.resize(plan_.recvs.size());
    auto left = [&] {
      return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now()));
    };
    for (size_t mi = 0; mi < plan_.recvs.size(); ++mi) {
      const Message& m = plan_.recvs[mi];
      if (!Prepared(m.src)) continue;
      PairSpec spec{m.src, /*send=*/false, in_.options.wire_dtype, {}, PairKey(m.src, rank_)};
      for (const Bucket& b : m.buckets) spec.buckets.push_back({b.bytes, LandedRegions(m, b), {}});
      SS_ASSIGN_OR_RETURN(recv_pairs_[mi], tx_.Prepare(store_, spec, left()));
    }
    for (size_t mi = 0; mi < plan_.sends.size(); ++mi) {
      const Message& m = plan_.sends[mi];
      if (!Prepared(m.dst)) continue;
      PairSpec spec{m.dst, /*send=*/true, in_.options.wire_dtype, {}, PairKey(rank_, m.dst)};
      for (const Bucket& b : m.buckets) {
        PairBucket pb{b.bytes, SourceRegions(m, b), {}};
        for (int i = b.op_begin; i < b.op_end; ++i) {
          const TransferOp& op = m.ops[i];
          pb.remote.push_back({regbase_.at(m.dst) + static_cast<uint32_t>(op.param), 0,
                               DestShape(m.dst, op.param), op.dst});
        }
        spec.buckets.push_back(std::move(pb));
      }
      SS_ASSIGN_OR_RETURN(send_pairs_[mi], tx_.Prepare(store_, spec, left()));
    }
    return OkStatus();
  }

  // Polls `pairs` (null entries skipped) until every one is done, the deadline passes or the job
  // aborts; `who` names the peer of entry i for errors. `while_waiting` (optional) runs once,
  // 1 ms into the wait.
  Status WaitPairs(std::vector<std::unique_ptr<PreparedPair>>& pairs,
                   const std::function<std::string(size_t)>& who,
                   const std::function<Status()>& while_waiting = nullptr) {
    std::vector<size_t> left;
    for (size_t i = 0; i < pairs.size(); ++i) {
      if (pairs[i]) left.push_back(i);
    }
    const auto start = Clock::now();
    auto idle_since = start;
    bool waited = false;
    while (!left.empty()) {
      bool progressed = false;
      for (size_t k = 0; k < left.size();) {
        auto st = pairs[left[k]]->Poll();
        if (!st.ok()) {
          Status e = st.status();
          return e.Annotate("sync rank " + std::to_string(rank_) + ": " + who(left[k]));
        }
        if (*st == XferState::kDone) {
          Trace(rank_, version_, [&] { return "done: " + who(left[k]); });
          left.erase(left.begin() + k);
          progressed = true;
        } else {
          ++k;
        }
      }
      if (left.empty()) break;
      // After 1 ms the pairs are running (a launch waits only for its receivers' mailbox
      // messages, microseconds apart): a store round trip then delays no launch.
      if (while_waiting && !waited && Clock::now() - start >= Millis(1)) {
        waited = true;
        SS_RETURN_IF_ERROR(while_waiting());
        progressed = true;  // time passed in it: poll again at once
      }
      SS_RETURN_IF_ERROR(CheckDeadline(left[0], who));
      PairBackoff(progressed, idle_since);
    }
    return OkStatus();
  }

  // Device pairs finish within milliseconds and every rank waits on the last one: yield-spin
  // (a sleep costs 60-80 us of wake-up latency on Linux, measured in the traced syncs of
  // docs/benchmarks.md) for 50 ms of idling, then sleep in short steps.
  static void PairBackoff(bool progressed, Clock::time_point& idle_since) {
    const auto now = Clock::now();
    if (progressed) idle_since = now;
    if (now - idle_since < Millis(50)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // Posts pairs[i] for every i with `which(i)` (null entries skipped).
  Status PostPairs(std::vector<std::unique_ptr<PreparedPair>>& pairs,
                   const std::function<bool(size_t)>& which = nullptr) {
    for (size_t i = 0; i < pairs.size(); ++i) {
      auto& p = pairs[i];
      if (!p || (which && !which(i))) continue;
      SS_RETURN_IF_ERROR(p->Post(version_));
      Trace(rank_, version_, [&] { return "posted: " + p->Describe(); });
    }
    return OkStatus();
  }

  // Sender: every prepared pair done, then its packed checksums go to the store for the receiver.
  // `while_waiting` runs once while the pairs run (see WaitPairs).
  Status FinishPreparedSends(RankSyncStats& st, const std::function<Status()>& while_waiting) {
    SS_RETURN_IF_ERROR(WaitPairs(
        send_pairs_,
        [&](size_t i) {
          return "sending to sync rank " + std::to_string(plan_.sends[i].dst) + " (" +
                 send_pairs_[i]->Describe() + ")";
        },
        while_waiting));
    for (size_t mi = 0; mi < send_pairs_.size(); ++mi) {
      if (!send_pairs_[mi]) continue;
      const Message& m = plan_.sends[mi];
      for (const Bucket& b : m.buckets) st.send_bytes += b.bytes;
      if (send_pairs_[mi]->DeliversSums()) continue;
      SS_ASSIGN_OR_RETURN(PairSums sums, send_pairs_[mi]->Sums());
      if (sums.packed.size() != m.buckets.size()) {
        return InternalError("sync rank " + std::to_string(rank_) + ": pair to sync rank " +
                             std::to_string(m.dst) + " reported " +
                             std::to_string(sums.packed.size()) + " checksums for " +
                             std::to_string(m.buckets.size()) + " buckets");
      }
      std::string text;
      for (uint64_t v : sums.packed) {
        if (!text.empty()) text += ',';
        text += Hex(v);
      }
      SS_RETURN_IF_ERROR(store_.Set(
          Key(VKey("sums/") + std::to_string(rank_) + "_" + std::to_string(m.dst)), text));
    }
    Trace(rank_, version_, [] { return "checksums published"; });
    return OkStatus();
  }

  // Receiver: every prepared pair landed; each bucket's landed checksum against what its sender
  // packed (published in the store once the sender's pair completed).
  Status FinishPreparedRecvs(RankSyncStats& st) {
    SS_RETURN_IF_ERROR(WaitPairs(recv_pairs_, [&](size_t i) {
      return "receiving from sync rank " + std::to_string(plan_.recvs[i].src) + " (" +
             recv_pairs_[i]->Describe() + ")";
    }));
    for (size_t mi = 0; mi < recv_pairs_.size(); ++mi) {
      if (!recv_pairs_[mi]) continue;
      const Message& m = plan_.recvs[mi];
      const std::string from = "sync rank " + std::to_string(m.src);
      SS_ASSIGN_OR_RETURN(PairSums mine, recv_pairs_[mi]->Sums());
      // The sender's packed sums: with the data where the transport delivers them, else the
      // store.
      std::vector<uint64_t> sent = std::move(mine.packed);
      std::string text;
      if (sent.empty()) {
        Trace(rank_, version_, [&] { return "waiting for the checksums of " + from; });
        SS_ASSIGN_OR_RETURN(
            text, GetUntil(Key(VKey("sums/") + std::to_string(m.src) + "_" + std::to_string(rank_)),
                           deadline_, "the checksums of " + from, /*watch_abort=*/true));
      }
      for (size_t at = 0; at <= text.size() && !text.empty();) {
        const size_t c = std::min(text.find(',', at), text.size());
        const std::string item = text.substr(at, c - at);
        char* end = nullptr;
        sent.push_back(std::strtoull(item.c_str(), &end, 16));
        if (item.size() != 16 || *end != '\0') {
          return DataLossError("sync rank " + std::to_string(rank_) + ": checksums of " + from +
                               " are malformed: '" + text.substr(0, 80) + "'");
        }
        at = c + 1;
      }
      if (sent.size() != m.buckets.size() || mine.landed.size() != m.buckets.size()) {
        return DataLossError("sync rank " + std::to_string(rank_) + ": " + from + " sent " +
                             std::to_string(sent.size()) + " checksums, " +
                             std::to_string(mine.landed.size()) + " landed, for " +
                             std::to_string(m.buckets.size()) + " buckets");
      }
      st.checksums_total += static_cast<int64_t>(m.buckets.size());
      for (size_t b = 0; b < sent.size(); ++b) {
        if (sent[b] != mine.landed[b]) {
          return MismatchError(m, static_cast<int>(b), sent[b], mine.landed[b]);
        }
        ++st.checksums_ok;
        st.recv_bytes += m.buckets[b].bytes;
      }
    }
    return OkStatus();
  }

  // Every bucket's transfers (BucketTransfers), computed once: both ends replay them each sync.
  Status PrecomputeTransfers() {
    const int ws = DTypeSize(in_.options.wire_dtype);
    const int ts = DTypeSize(in_.trainer_dtype);
    send_buckets_.assign(plan_.sends.size(), {});
    for (size_t mi = 0; mi < plan_.sends.size(); ++mi) {
      const Message& m = plan_.sends[mi];
      for (const Bucket& b : m.buckets) {
        SendBucket sb;
        sb.xfers = sync_internal::BucketTransfers(
            in_, inventory_, who_.trainer_rank, m, b,
            [&](int param) -> const Shape& { return DestShape(m.dst, param); });
        for (int i = b.op_begin; i < b.op_end; ++i) {
          const TransferOp& op = m.ops[i];
          const SourceBinding& src = sources_.at(op.tensor);
          Region rel = op.src;
          for (int d = 0; d < rel.ndim; ++d) rel.offset[d] -= src.region.offset[d];
          const auto* base = static_cast<const unsigned char*>(src.data);
          int64_t w = op.wire_offset - b.wire_offset;
          ForEachRun(rel, src.region.extents(), [&](int64_t off, int64_t len) {
            if (!sb.pieces.empty()) {
              SrcPiece& p = sb.pieces.back();
              if (p.src + p.elems * ts == base + off * ts && p.wire + p.elems * ws == w) {
                p.elems += len;
                w += len * ws;
                return;
              }
            }
            sb.pieces.push_back({w, base + off * ts, len});
            w += len * ws;
          });
        }
        send_buckets_[mi].push_back(std::move(sb));
      }
    }
    recv_runs_.assign(plan_.recvs.size(), {});
    for (size_t mi = 0; mi < plan_.recvs.size(); ++mi) {
      const Message& m = plan_.recvs[mi];
      SS_ASSIGN_OR_RETURN(SyncRank src, DescribeSyncRank(in_, m.src));
      for (const Bucket& b : m.buckets) {
        recv_runs_[mi].push_back(sync_internal::BucketTransfers(
            in_, inventory_, src.trainer_rank, m, b,
            [&](int param) -> const Shape& { return dests_[param].shape; }));
      }
    }
    return OkStatus();
  }

  // Packs wire bytes [from, from + len) of bucket `sb` into `out` (the bucket's staging at
  // `from`), cast to the wire dtype, adding the checksum of each chunk right after it is written.
  void PackRange(const SendBucket& sb, int64_t from, int64_t len, unsigned char* out,
                 LandedSum& sum) const {
    const DType td = in_.trainer_dtype, wd = in_.options.wire_dtype;
    const int ts = DTypeSize(td), ws = DTypeSize(wd);
    const int64_t end = from + len;
    // The piece holding `from`: the last one starting at or before it.
    auto it = std::upper_bound(sb.pieces.begin(), sb.pieces.end(), from,
                               [](int64_t w, const SrcPiece& p) { return w < p.wire; });
    size_t k = static_cast<size_t>(it - sb.pieces.begin()) - 1;
    const bool cast_sum = td == DType::kF32 && wd == DType::kBF16;
    int64_t at = from;      // next wire byte to write
    int64_t summed = from;  // wire bytes before this are in `sum`
    while (at < end) {
      const SrcPiece& p = sb.pieces[k];
      const int64_t e0 = (at - p.wire) / ws;
      const int64_t n = std::min(p.elems - e0, (end - at) / ws);
      // Cast in chunk-sized steps so each chunk is checksummed while still in L1/L2.
      for (int64_t done = 0; done < n;) {
        const int64_t step = std::min(n - done, std::max<int64_t>(1, kPackChunkBytes / ws));
        const unsigned char* in = p.src + (e0 + done) * ts;
        if (cast_sum && at % 8 == 0) {
          // fp32 -> bf16 with the checksum taken from the registers (whole words only): first
          // settle the bytes written before this word boundary the ordinary way.
          if (summed < at) {
            sum.Add(out + (summed - from), static_cast<size_t>(at - summed),
                    static_cast<uint64_t>(summed));
            summed = at;
          }
          uint64_t part = 0;
          const int64_t k = sync_internal::CastF32ToBF16WithSum(
              in, out + (at - from), step, static_cast<uint64_t>(at) / 8, &part);
          if (k > 0) {
            sum.AddWords(part, static_cast<size_t>(k * ws));
            at += k * ws;
            done += k;
            summed = at;
            continue;
          }
        }
        if (td == wd && at % 8 == 0 && step * ws >= 8) {
          // Same dtype: copy whole words with the checksum taken from the loaded registers.
          if (summed < at) {
            sum.Add(out + (summed - from), static_cast<size_t>(at - summed),
                    static_cast<uint64_t>(summed));
            summed = at;
          }
          const int64_t bytes = (step * ws) & ~int64_t{7};
          const uint64_t part = CopyWithChecksumPartial(
              out + (at - from), in, static_cast<size_t>(bytes), static_cast<uint64_t>(at));
          sum.AddWords(part, static_cast<size_t>(bytes));
          at += bytes;
          done += bytes / ws;
          summed = at;
          continue;
        }
        sync_internal::CastInto(in, td, out + (at - from), wd, step);
        at += step * ws;
        done += step;
        // Checksum up to a word boundary of the bucket's wire image, so chunks rarely split words.
        const int64_t cut = at == end ? end : (at & ~int64_t{7});
        if (cut - summed >= kPackChunkBytes || at == end) {
          sum.Add(out + (summed - from), static_cast<size_t>(cut - summed),
                  static_cast<uint64_t>(summed));
          summed = cut;
        }
      }
      ++k;
    }
  }

  // Shape of parameter `param` of engine sync rank `dst` (cached per destination).
  const Shape& DestShape(int dst, int param) {
    auto it = dst_shapes_.find(dst);
    if (it == dst_shapes_.end()) {
      std::vector<Shape> shapes;
      auto who = DescribeSyncRank(in_, dst);
      if (who.ok()) {
        if (!replica_map_) {
          auto map = BuildShardMap(in_.model, in_.rollout.shard);
          if (map.ok()) replica_map_ = std::make_unique<ShardMap>(std::move(map).value());
        }
        if (replica_map_) {
          for (const EngineParam& p : replica_map_->rank(who->tp_rank, who->pp_rank).params) {
            shapes.push_back(p.shape);
          }
        }
      }
      it = dst_shapes_.emplace(dst, std::move(shapes)).first;
    }
    static const Shape kEmpty;
    if (param < 0 || static_cast<size_t>(param) >= it->second.size()) return kEmpty;
    return it->second[param];
  }

  // One bucket a receiver expects on the host path.
  struct Expect {
    int msg = 0;
    int bucket = 0;
    size_t slot = 0;          // index into HostRecv::ctrl
    std::vector<XferId> ids;  // data receives (tag mode), then the control receive
    const std::vector<WireRun>* runs = nullptr;  // tag mode: the data receives, in order
    size_t runs_done = 0;
    LandedSum landed;    // incremental checksum of the runs that completed
    size_t sums_at = 0;  // summed receives: this bucket's first entry of `sums`
  };
  struct HostRecv {
    bool put = false, incremental = false, summed = false;
    // Posted receive buffers must outlive a failed sync: a late control message may still land.
    std::shared_ptr<std::vector<Control>> ctrl;
    // So must the CopySums of summed receives (one per run, at fixed addresses).
    std::shared_ptr<std::vector<CopySum>> sums = std::make_shared<std::vector<CopySum>>();
    std::vector<Expect> pending;
  };

  Status RunReceiver(RankSyncStats& st) {
    // Padding rows are the engine's zeros, not the trainer's bytes.
    for (size_t i = 0; i < dests_.size(); ++i) {
      for (const ZeroFill& z : shards_.params[i].zero_fills) {
        SS_RETURN_IF_ERROR(
            packer_->ZeroFill(dests_[i].data, dests_[i].dtype, dests_[i].shape, z.dst));
      }
    }
    SS_RETURN_IF_ERROR(PostPairs(recv_pairs_));
    // A receiver inside Sync(v) is paused for v: only then may senders write into its memory
    // (one-sided puts would otherwise land while it still reads the previous version). Its
    // prepared pairs were posted first: those that signal readiness themselves are faster.
    SS_RETURN_IF_ERROR(
        store_.SetMany({{Key("cur/" + std::to_string(rank_)), std::to_string(version_)},
                        {Key(VKey("ready/") + std::to_string(rank_)), "1"}}));
    HostRecv hr;
    hr.put = tx_.caps().one_sided_put;
    // Host parameters with the built-in packer in tag mode: checksum each run right after it
    // lands, while its bytes are still in cache, instead of re-reading the whole bucket from
    // memory once its control message arrives.
    hr.incremental = !hr.put && packer_ == own_packer_.get();
    // ... or let the transport sum the words as it copies them in (shm): no read at all.
    hr.summed = hr.incremental && tx_.caps().summed_copy;
    Status s = PostHostReceives(hr, st);
    if (s.ok()) s = PollHostReceives(hr, st);
    if (!s.ok()) {
      graveyard_.push_back(hr.ctrl);
      if (hr.summed) graveyard_.push_back(hr.sums);
      return s;
    }
    SS_RETURN_IF_ERROR(FinishPreparedRecvs(st));
    // Completing a receive can leave protocol messages to the sender (e.g. a rendezvous ack)
    // queued on this side; flush them out before this rank stops driving the transport.
    std::vector<XferId> flushes;
    for (size_t mi = 0; mi < plan_.recvs.size(); ++mi) {
      if (recv_pairs_[mi]) continue;
      SS_ASSIGN_OR_RETURN(XferId id, tx_.PostFlush(plan_.recvs[mi].src));
      flushes.push_back(id);
    }
    return WaitAll(flushes, "flushing to the senders");
  }

  // Posts every host-path receive: per bucket its data runs (tag mode) and its control message.
  Status PostHostReceives(HostRecv& hr, RankSyncStats& st) {
    size_t total = 0;  // buckets of the host path (prepared pairs count their own)
    for (size_t mi = 0; mi < plan_.recvs.size(); ++mi) {
      if (!recv_pairs_[mi]) total += plan_.recvs[mi].buckets.size();
    }
    st.checksums_total = static_cast<int64_t>(total);
    hr.ctrl = std::make_shared<std::vector<Control>>(total);
    if (hr.summed) {
      size_t runs = 0;
      for (const auto& m : recv_runs_) {
        for (const auto& b : m) runs += b.size();
      }
      hr.sums->reserve(runs);
    }
    size_t k = 0;
    for (size_t mi = 0; mi < plan_.recvs.size(); ++mi) {
      if (recv_pairs_[mi]) continue;
      const Message& m = plan_.recvs[mi];
      uint64_t seq = 0;
      for (size_t bi = 0; bi < m.buckets.size(); ++bi, ++k) {
        Expect e;
        e.msg = static_cast<int>(mi);
        e.bucket = static_cast<int>(bi);
        e.slot = k;
        if (!hr.put) {
          // Two-sided: receive each run straight into its parameter (no staging copy).
          e.runs = &recv_runs_[mi][bi];
          e.sums_at = hr.sums->size();
          for (const WireRun& r : *e.runs) {
            auto* dst = static_cast<unsigned char*>(dests_[r.param].data) + r.param_offset;
            Result<XferId> id = XferId{0};
            if (hr.summed) {
              hr.sums->push_back(CopySum{static_cast<uint64_t>(r.wire_offset), 0});
              id =
                  tx_.PostRecvSummed(m.src, DataTag(version_, seq++), dst, r.len, &hr.sums->back());
            } else {
              id = tx_.PostRecv(m.src, DataTag(version_, seq++), dst, r.len);
            }
            SS_RETURN_IF_ERROR(id.status());
            e.ids.push_back(*id);
          }
        }
        SS_ASSIGN_OR_RETURN(XferId id, tx_.PostRecv(m.src, ControlTag(version_, bi), &(*hr.ctrl)[k],
                                                    sizeof(Control)));
        e.ids.push_back(id);
        hr.pending.push_back(std::move(e));
      }
    }
    return OkStatus();
  }

  // Completes the posted receives, verifying each bucket once its control message arrived.
  Status PollHostReceives(HostRecv& hr, RankSyncStats& st) {
    int idle = 0;
    while (!hr.pending.empty()) {
      size_t keep = 0;
      bool progressed = false;
      for (size_t i = 0; i < hr.pending.size(); ++i) {
        Expect& e = hr.pending[i];
        const Message& m = plan_.recvs[e.msg];
        // In posting order, stopping at the first one still in flight: completions arrive
        // roughly in order, and every Poll drives the transport's progress engine.
        size_t done = 0;
        for (; done < e.ids.size(); ++done) {
          auto state = tx_.Poll(e.ids[done]);
          if (!state.ok()) {
            Status s = state.status();
            return s.Annotate("sync rank " + std::to_string(rank_) + ": receiving from sync rank " +
                              std::to_string(m.src));
          }
          if (*state == XferState::kInProgress) break;
        }
        progressed |= done > 0;
        if (hr.incremental) AddLanded(hr, e, done);
        e.ids.erase(e.ids.begin(), e.ids.begin() + done);
        if (!e.ids.empty()) {
          if (keep != i) hr.pending[keep] = std::move(e);
          ++keep;
          continue;
        }
        SS_RETURN_IF_ERROR(
            VerifyBucket(m, e.bucket, (*hr.ctrl)[e.slot], hr.incremental ? &e.landed : nullptr));
        ++st.checksums_ok;
        st.recv_bytes += m.buckets[e.bucket].bytes;
      }
      hr.pending.resize(keep);
      if (hr.pending.empty()) break;
      SS_RETURN_IF_ERROR(CheckDeadline("waiting for " + std::to_string(hr.pending.size()) +
                                       " buckets (first from sync rank " +
                                       std::to_string(plan_.recvs[hr.pending[0].msg].src) + ")"));
      Backoff(progressed, idle);
    }
    return OkStatus();
  }

  // Adds the `done` data runs of `e` that just completed to its landed checksum.
  void AddLanded(HostRecv& hr, Expect& e, size_t done) {
    for (size_t d = 0; d < done && e.runs && e.runs_done < e.runs->size(); ++d, ++e.runs_done) {
      const WireRun& r = (*e.runs)[e.runs_done];
      const auto* at = static_cast<const unsigned char*>(dests_[r.param].data) + r.param_offset;
      const auto key = static_cast<uint64_t>(r.wire_offset);
      if (hr.summed) {
        const uint64_t h = SummedHead(key, r.len), t = SummedTail(key, r.len);
        e.landed.Add(at, h, key);
        e.landed.AddWords((*hr.sums)[e.sums_at + e.runs_done].sum, t - h);
        e.landed.Add(at + t, r.len - t, key + t);
      } else {
        e.landed.Add(at, r.len, key);
      }
    }
  }

  // Drives the transport's progress engine while waiting on the store (peers may still need
  // this rank's side of a protocol exchange). Errors are left to the transfers that own them.
  void Progress() {
    if (peers_.empty()) return;
    if (progress_id_ == 0) {
      auto id = tx_.PostFlush(peers_[progress_peer_++ % peers_.size()]);
      if (id.ok()) progress_id_ = *id;
      return;
    }
    auto st = tx_.Poll(progress_id_);
    if (!st.ok() || *st == XferState::kDone) progress_id_ = 0;
  }

  // `landed`: the bucket's checksum accumulated run by run as the runs completed (null: read
  // the landed bytes now through the packer).
  Status VerifyBucket(const Message& m, int bucket, const Control& c, LandedSum* landed) {
    const Bucket& b = m.buckets[bucket];
    const std::string where = "message from sync rank " + std::to_string(m.src) + " to sync rank " +
                              std::to_string(rank_) + ", bucket " + std::to_string(bucket);
    if (c.magic != kControlMagic || c.bucket != static_cast<uint32_t>(bucket)) {
      return DataLossError(where + ": malformed control message");
    }
    if (c.version != version_) {
      return FailedPreconditionError(where + ": sender syncs version " + std::to_string(c.version) +
                                     ", this rank " + std::to_string(version_));
    }
    if (c.bytes != static_cast<uint64_t>(b.bytes)) {
      return DataLossError(where + ": sender reports " + std::to_string(c.bytes) +
                           " bytes, the plan " + std::to_string(b.bytes));
    }
    uint64_t got = 0;
    if (landed != nullptr) {
      if (landed->bytes() != static_cast<uint64_t>(b.bytes)) {
        return InternalError(where + ": checksummed " + std::to_string(landed->bytes()) +
                             " landed bytes, expected " + std::to_string(b.bytes));
      }
      got = landed->Finish();
    } else {
      SS_ASSIGN_OR_RETURN(got, packer_->ChecksumLanded(LandedRegions(m, b), b.bytes));
    }
    if (got != c.checksum) return MismatchError(m, bucket, c.checksum, got);
    return OkStatus();
  }

  // DataLoss naming the message, the bucket and (up to 8 of) the parameters it lands in.
  Status MismatchError(const Message& m, int bucket, uint64_t sent, uint64_t got) const {
    const Bucket& b = m.buckets[bucket];
    const std::string where = "message from sync rank " + std::to_string(m.src) + " to sync rank " +
                              std::to_string(rank_) + ", bucket " + std::to_string(bucket);
    std::vector<std::string> names;
    for (int i = b.op_begin; i < b.op_end; ++i) {
      const std::string& n = dests_[m.ops[i].param].name;
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    }
    std::string list;
    for (size_t i = 0; i < names.size() && i < 8; ++i) list += (i ? ", " : "") + names[i];
    if (names.size() > 8) list += ", ... (" + std::to_string(names.size()) + " parameters)";
    return DataLossError("checksum mismatch, version " + std::to_string(version_) + ", " + where +
                         ": sent " + Hex(sent) + ", landed " + Hex(got) + "; parameters: " + list);
  }

  Result<SyncReport> Gather(const RankSyncStats& local,
                            const std::pair<std::string, std::string>& verdict) {
    SyncReport rep;
    rep.version = version_;
    rep.local = local;
    std::vector<std::string> keys;
    std::vector<int> others;
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      if (!board_) keys.push_back(Key(VKey("done/") + std::to_string(r)));
      others.push_back(r);
    }
    auto what = [&](size_t i) {
      return "the sync report of sync rank " + std::to_string(others[i]) + " (version " +
             std::to_string(version_) + ")";
    };
    // Every other rank's verdict from the board (ours is posted), else in one store round trip.
    SS_ASSIGN_OR_RETURN(std::vector<std::string> texts,
                        board_
                            ? BoardVerdicts(others, what)
                            : GetManyUntil(keys, deadline_, what, /*watch_abort=*/true, &verdict));
    for (int r = 0, next = 0; r < world_; ++r) {
      RankSyncStats s;
      if (r == rank_) {
        s = local;
      } else {
        SS_ASSIGN_OR_RETURN(s, sync_internal::DecodeVerdict(texts[next++], r));
      }
      if (!s.ok) {
        return AbortedError("sync rank " + std::to_string(rank_) + ": version " +
                            std::to_string(version_) + " failed on sync rank " + std::to_string(r) +
                            ": " + s.error);
      }
      rep.bytes += s.recv_bytes;
      rep.checksums_ok += s.checksums_ok;
      rep.checksums_total += s.checksums_total;
      if (s.seconds > rep.seconds) {
        rep.seconds = s.seconds;
        rep.slowest_rank = r;
      }
      rep.ranks.push_back(std::move(s));
    }
    if (rep.checksums_ok != rep.checksums_total) {
      return DataLossError("version " + std::to_string(version_) + ": only " +
                           std::to_string(rep.checksums_ok) + " of " +
                           std::to_string(rep.checksums_total) + " checksums verified");
    }
    rep.gbps = rep.seconds > 0 ? rep.bytes / rep.seconds / 1e9 : 0;
    return rep;
  }

  // Verdicts of `others` for this version from the board, polled like a pair wait (ranks finish
  // microseconds apart); `what(i)` names entry i for errors.
  Result<std::vector<std::string>> BoardVerdicts(const std::vector<int>& others,
                                                 const std::function<std::string(size_t)>& what) {
    std::vector<std::string> texts(others.size());
    std::vector<size_t> left(others.size());
    for (size_t i = 0; i < left.size(); ++i) left[i] = i;
    auto idle_since = Clock::now();
    auto next_progress = idle_since + Millis(5);
    while (true) {
      bool progressed = false;
      for (size_t k = 0; k < left.size();) {
        const size_t i = left[k];
        const auto got = board_->Get(others[i], version_, &texts[i]);
        if (got == sync_internal::VerdictBoard::Lookup::kOverwritten) {
          return AbortedError("sync rank " + std::to_string(rank_) + ": sync rank " +
                              std::to_string(others[i]) + " moved past version " +
                              std::to_string(version_) + " before its report was read");
        }
        if (got == sync_internal::VerdictBoard::Lookup::kFound) {
          left.erase(left.begin() + k);
          progressed = true;
        } else {
          ++k;
        }
      }
      if (left.empty()) return texts;
      const auto now = Clock::now();
      if (now > deadline_) {
        return DeadlineExceededError("sync rank " + std::to_string(rank_) +
                                     ": timed out waiting for " + what(left[0]));
      }
      if (now >= next_progress) {  // as often as the store path's slices
        next_progress = now + Millis(5);
        Progress();
      }
      SS_RETURN_IF_ERROR(CheckAbort());
      PairBackoff(progressed, idle_since);
    }
  }

  // Whether peer `p` posted its verdict for this version.
  bool PostedVerdict(int p) {
    if (board_) {
      std::string text;
      return board_->Get(p, version_, &text) != sync_internal::VerdictBoard::Lookup::kMissing;
    }
    return store_.Get(Key(VKey("done/") + std::to_string(p)), Millis(0)).ok();
  }

  // Verdicts through shared memory when every rank maps the same board (verdict_board.h), else
  // through the store. Rank 0 creates the board and publishes its nonce; every rank says whether
  // it mapped it, and only a unanimous job uses it (a rank on the store path would leave the
  // others waiting on the board). Rank 0 then removes the name: no segment outlives the job.
  Status OpenVerdictBoard(Clock::time_point deadline) {
    using sync_internal::VerdictBoard;
    if (world_ < 2) return OkStatus();
    const char* env = std::getenv("SHARDSYNC_VERDICT_BOARD");
    const bool want = opt_.shared_memory_verdicts && !(env && std::string(env) == "0");
    std::unique_ptr<VerdictBoard> board;
    std::string published = "none";
    if (rank_ == 0) {
      if (want) {
        std::random_device rd;
        const uint64_t nonce = (uint64_t{rd()} << 32 | rd()) ^ static_cast<uint64_t>(getpid()) ^
                               static_cast<uint64_t>(Clock::now().time_since_epoch().count());
        auto b = VerdictBoard::Create(sync_internal::VerdictBoardName(nonce), world_, nonce);
        if (b.ok()) {
          board = std::move(*b);
          published = std::to_string(nonce);
        } else {
          Trace(rank_, 0, [&] { return "verdict board: " + b.status().ToString(); });
        }
      }
      SS_RETURN_IF_ERROR(store_.Set(Key("vboard"), published));
    } else {
      SS_ASSIGN_OR_RETURN(published,
                          GetUntil(Key("vboard"), deadline, "the verdict board of sync rank 0"));
      uint64_t nonce = 0;
      const auto [end, ec] =
          std::from_chars(published.data(), published.data() + published.size(), nonce);
      if (published != "none" &&
          (ec != std::errc() || end != published.data() + published.size())) {
        return DataLossError("verdict board of sync rank 0 is malformed: '" + published + "'");
      }
      if (want && published != "none") {
        auto b = VerdictBoard::Open(sync_internal::VerdictBoardName(nonce), world_, nonce);
        if (b.ok()) {
          board = std::move(*b);
        } else {
          Trace(rank_, 0, [&] { return "verdict board: " + b.status().ToString(); });
        }
      }
    }
    if (published == "none") return OkStatus();  // no board for anyone
    // Keyed by the nonce: a rank that read a previous connect's key (a reused prefix) answers
    // under that one, and the others then fail this Connect by its deadline, naming it, instead
    // of waiting on a board it never posts to.
    const std::string base = "vboard/" + published + "/";
    std::vector<std::string> keys;
    std::vector<int> others;
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      keys.push_back(Key(base + std::to_string(r)));
      others.push_back(r);
    }
    const std::pair<std::string, std::string> mine{Key(base + std::to_string(rank_)),
                                                   board ? "1" : "0"};
    auto what = [&](size_t i) {
      return "whether sync rank " + std::to_string(others[i]) + " mapped the verdict board";
    };
    SS_ASSIGN_OR_RETURN(std::vector<std::string> mapped,
                        GetManyUntil(keys, deadline, what, /*watch_abort=*/false, &mine));
    const bool all = board && std::all_of(mapped.begin(), mapped.end(),
                                          [](const std::string& m) { return m == "1"; });
    if (all) {
      board->Unlink();  // every rank has it mapped (a no-op but on rank 0)
      board_ = std::move(board);
    }
    return OkStatus();
  }

  PlanInputs in_;
  int rank_;
  SyncRank who_;
  RankPlan plan_;
  StoreClient& store_;
  Transport& tx_;
  SessionOptions opt_;
  sync_internal::HarnessHooks hooks_;
  std::vector<HfTensor> inventory_;
  std::map<std::string, size_t> tensor_index_;
  int world_;
  std::unique_ptr<Packer> own_packer_;
  Packer* packer_ = nullptr;
  // Trainer side.
  std::map<int, SourceBinding> sources_;  // by HF tensor index
  std::map<int, uint32_t> regbase_;       // engine sync rank -> its first parameter region id
  std::map<int, std::vector<Shape>> dst_shapes_;
  std::unique_ptr<ShardMap> replica_map_;
  std::shared_ptr<unsigned char> staging_[2];          // from the packer: host or device memory
  std::vector<std::vector<SendBucket>> send_buckets_;  // [send message][bucket]
  // Prepared pairs by send / recv message index (null: the message goes the host path).
  std::vector<std::unique_ptr<PreparedPair>> send_pairs_, recv_pairs_;
  // Engine side: [recv message][bucket] -> the transfers, as the sender cuts them.
  std::vector<std::vector<std::vector<WireRun>>> recv_runs_;
  // Engine side.
  EngineRankShards shards_;
  std::map<std::string, size_t> param_index_;
  std::vector<DestBinding> dests_;
  // What a failed sync's transfers may still write into (late control messages, the sums of
  // summed copies): kept for the session's life.
  std::vector<std::shared_ptr<void>> graveyard_;
  std::unique_ptr<sync_internal::VerdictBoard> board_;  // null: verdicts through the store
  // State.
  std::vector<int> peers_;
  XferId progress_id_ = 0;  // a flush polled to drive progress while waiting on the store
  size_t progress_peer_ = 0;
  bool connected_ = false;
  bool poisoned_ = false;
  uint64_t last_good_ = 0;
  uint64_t last_attempted_ = 0;
  uint64_t version_ = 0;
  Clock::time_point deadline_;
  Clock::time_point next_abort_check_;
};

}  // namespace

Result<std::unique_ptr<SyncSession>> sync_internal::CreateHarnessSession(
    const PlanInputs& inputs, int rank, StoreClient& store, Transport& transport,
    SessionOptions options, HarnessHooks hooks) {
  SS_ASSIGN_OR_RETURN(SyncRank who, DescribeSyncRank(inputs, rank));
  SS_ASSIGN_OR_RETURN(RankPlan plan, PlanForRank(inputs, rank));
  auto s = std::make_unique<SessionImpl>(inputs, rank, who, std::move(plan), store, transport,
                                         std::move(options), std::move(hooks));
  SS_RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<SyncSession>(std::move(s));
}

Result<std::unique_ptr<SyncSession>> SyncSession::Create(const PlanInputs& inputs, int rank,
                                                         StoreClient& store, Transport& transport,
                                                         SessionOptions options) {
  return sync_internal::CreateHarnessSession(inputs, rank, store, transport, std::move(options),
                                             {});
}

}  // namespace shardsync
