// Trainer layouts, rollout spec parsing and the sync world.
#include <fmt/format.h>
#include <charconv>

#include "plan/megatron.h"
#include "shardsync/plan.h"

namespace shardsync {
namespace {

using plan_internal::kMaxRanks;

// Layout specs hold no spaces; "dp=1, tp=2, pp=1" is how people type them in Python.
std::string WithoutSpaces(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c != ' ' && c != '\t') out += c;
  }
  return out;
}

Result<int> ParsePositive(std::string_view text, std::string_view field) {
  int64_t v = 0;
  const char* b = text.data();
  const char* e = text.data() + text.size();
  auto [p, ec] = std::from_chars(b, e, v);
  if (text.empty() || ec != std::errc() || p != e) {
    return InvalidArgumentError(
        fmt::format("{}: expected a positive integer, got '{}'", field, text));
  }
  if (v <= 0 || v > kMaxRanks) {
    return InvalidArgumentError(fmt::format("{}: must be in [1, {}], got {}", field, kMaxRanks, v));
  }
  return static_cast<int>(v);
}

}  // namespace

int TrainerSpec::groups() const {
  switch (kind) {
    case Kind::kFsdp:
      return 1;
    case Kind::kHsdp:
      return replicas;
    case Kind::kReplicate:
      return replicas;
    case Kind::kSingle:
      return 1;
    case Kind::kMegatron:
      return megatron.cp * megatron.dp;
  }
  return 1;
}

int TrainerSpec::shards_per_group() const {
  switch (kind) {
    case Kind::kFsdp:
    case Kind::kHsdp:
      return shards;
    case Kind::kReplicate:
    case Kind::kSingle:
      return 1;
    case Kind::kMegatron:
      return megatron.tp * megatron.pp;
  }
  return 1;
}

int TrainerSpec::world() const { return groups() * shards_per_group(); }

std::string TrainerSpec::ToString() const {
  switch (kind) {
    case Kind::kFsdp:
      return fmt::format("fsdp={}", shards);
    case Kind::kHsdp:
      return fmt::format("hsdp={}x{}", replicas, shards);
    case Kind::kReplicate:
      return fmt::format("replicate={}", replicas);
    case Kind::kSingle:
      return "single";
    case Kind::kMegatron:
      return megatron.ToString();
  }
  return "?";
}

Result<TrainerSpec> ParseTrainerSpec(std::string_view raw) {
  const std::string owned = WithoutSpaces(raw);
  const std::string_view s = owned;
  TrainerSpec t;
  if (s == "single") {
    t.kind = TrainerSpec::Kind::kSingle;
    return t;
  }
  const size_t eq = s.find('=');
  if (eq == std::string_view::npos) {
    return InvalidArgumentError(
        fmt::format("--trainer: expected fsdp=S, hsdp=RxS, replicate=S, single or "
                    "megatron=tp=T,pp=P[,...], got '{}'",
                    s));
  }
  const std::string_view kind = s.substr(0, eq);
  const std::string_view val = s.substr(eq + 1);
  if (kind == "fsdp") {
    t.kind = TrainerSpec::Kind::kFsdp;
    SS_ASSIGN_OR_RETURN(t.shards, ParsePositive(val, "--trainer fsdp"));
  } else if (kind == "replicate") {
    t.kind = TrainerSpec::Kind::kReplicate;
    SS_ASSIGN_OR_RETURN(t.replicas, ParsePositive(val, "--trainer replicate"));
  } else if (kind == "hsdp") {
    t.kind = TrainerSpec::Kind::kHsdp;
    const size_t x = val.find('x');
    if (x == std::string_view::npos) {
      return InvalidArgumentError(
          fmt::format("--trainer hsdp: expected RxS (e.g. hsdp=2x4), got '{}'", val));
    }
    SS_ASSIGN_OR_RETURN(t.replicas, ParsePositive(val.substr(0, x), "--trainer hsdp R"));
    SS_ASSIGN_OR_RETURN(t.shards, ParsePositive(val.substr(x + 1), "--trainer hsdp S"));
  } else if (kind == "megatron") {
    t.kind = TrainerSpec::Kind::kMegatron;
    SS_ASSIGN_OR_RETURN(t.megatron, plan_internal::ParseMegatronLayout(val));
    return t;
  } else {
    return InvalidArgumentError(fmt::format(
        "--trainer: unknown layout '{}' (expected fsdp, hsdp, replicate, single or megatron)",
        kind));
  }
  if (static_cast<int64_t>(t.replicas) * t.shards > kMaxRanks) {
    return InvalidArgumentError(
        fmt::format("--trainer: world {}x{} exceeds {} ranks", t.replicas, t.shards, kMaxRanks));
  }
  return t;
}

Region TrainerHeldRegion(const TrainerSpec& t, int rank, const Shape& shape) {
  Region r = Region::Full(shape);
  const int S = t.shards_per_group();
  if (rank < 0 || rank >= t.world() || t.kind == TrainerSpec::Kind::kMegatron) {
    for (int i = 0; i < r.ndim; ++i) r.extent[i] = 0;
    return r;
  }
  if (r.ndim == 0) return r;  // scalars: every holder keeps the whole value
  const int s = rank % S;
  // torch.chunk: ceil(n / S) rows per rank, trailing ranks short or empty.
  const int64_t n = shape[0];
  const int64_t chunk = (n + S - 1) / S;
  const int64_t lo = std::min(n, s * chunk);
  const int64_t hi = std::min(n, lo + chunk);
  r.offset[0] = lo;
  r.extent[0] = hi - lo;
  if (hi == lo) {
    r.offset[0] = 0;
    for (int i = 0; i < r.ndim; ++i) r.extent[i] = 0;
  }
  return r;
}

Result<RolloutSpec> ParseRolloutSpec(std::string_view raw, EngineKind engine) {
  const std::string owned = WithoutSpaces(raw);
  const std::string_view s = owned;
  RolloutSpec r;
  r.shard.engine = engine;
  bool seen[4] = {false, false, false, false};
  size_t pos = 0;
  if (s.empty()) return InvalidArgumentError("--rollout: expected dp=D,tp=T,pp=P[,ep=E], got ''");
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string_view::npos) comma = s.size();
    const std::string_view kv = s.substr(pos, comma - pos);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgumentError(
          fmt::format("--rollout: expected key=value (dp, tp, pp, ep), got '{}'", kv));
    }
    const std::string_view key = kv.substr(0, eq);
    int idx = key == "dp" ? 0 : key == "tp" ? 1 : key == "pp" ? 2 : key == "ep" ? 3 : -1;
    if (idx < 0) {
      return InvalidArgumentError(
          fmt::format("--rollout: unknown field '{}' (expected dp, tp, pp, ep)", key));
    }
    if (seen[idx]) return InvalidArgumentError(fmt::format("--rollout: {} given twice", key));
    seen[idx] = true;
    SS_ASSIGN_OR_RETURN(int v, ParsePositive(kv.substr(eq + 1), fmt::format("--rollout {}", key)));
    (idx == 0 ? r.dp : idx == 1 ? r.shard.tp : idx == 2 ? r.shard.pp : r.shard.ep) = v;
    pos = comma + 1;
  }
  if (r.shard.ep > r.shard.tp || r.shard.tp % r.shard.ep != 0) {
    return InvalidArgumentError(
        fmt::format("--rollout ep: ep {} must divide tp {}", r.shard.ep, r.shard.tp));
  }
  if (static_cast<int64_t>(r.dp) * r.shard.tp * r.shard.pp > kMaxRanks) {
    return InvalidArgumentError(fmt::format("--rollout: dp*tp*pp = {} exceeds {} ranks",
                                            static_cast<int64_t>(r.dp) * r.shard.tp * r.shard.pp,
                                            kMaxRanks));
  }
  return r;
}

int SyncWorldSize(const PlanInputs& in) { return in.trainer.world() + in.rollout.world(); }

Result<SyncRank> DescribeSyncRank(const PlanInputs& in, int sync_rank) {
  const int S = in.trainer.world();
  const int world = SyncWorldSize(in);
  if (sync_rank < 0 || sync_rank >= world) {
    return OutOfRangeError(
        fmt::format("--rank: sync rank {} outside the sync world [0, {})", sync_rank, world));
  }
  SyncRank r;
  if (sync_rank < S) {
    r.is_trainer = true;
    r.trainer_rank = sync_rank;
    return r;
  }
  const int j = sync_rank - S;
  const int T = in.rollout.shard.tp, P = in.rollout.shard.pp;
  r.replica = j / (T * P);
  r.pp_rank = (j % (T * P)) / T;
  r.tp_rank = j % T;
  return r;
}

}  // namespace shardsync
