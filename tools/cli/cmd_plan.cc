// `shardsync plan`: the transfer plan's summary, cost estimate, one rank's ops, a heatmap.
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "command.h"
#include "plan/fp8_planner.h"
#include "plan/planner.h"

namespace shardsync::cli {
namespace {

// Every-op dumps without --rank are refused above this many ops.
constexpr int64_t kMaxDumpAllOps = 1'000'000;

struct Args {
  std::string model, trainer, rollout, engine = "sglang", pp_partition;
  std::string wire_dtype = "bf16", trainer_dtype = "fp32";
  int64_t bucket_mb = 512;
  int nodes = 0, gpus_per_node = 8;
  double intra_gbps = 450, inter_gbps = 50;
  bool json = false;
  std::string dump_ops, svg;
  std::optional<int> rank;
  std::optional<std::string> quant;  // --quant: fp8-block128 | none, overriding the config
  std::string fp8_split = "amax";    // --fp8-split
};

std::string Human(double b) {
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int i = 0;
  while (b >= 1024 && i < 5) {
    b /= 1024;
    ++i;
  }
  return fmt::format("{:.2f} {}", b, u[i]);
}

Result<PlanInputs> MakeInputs(const Args& a) {
  PlanInputs in;
  SS_ASSIGN_OR_RETURN(in.model, LoadModelSpec(a.model));
  SS_ASSIGN_OR_RETURN(in.trainer, ParseTrainerSpec(a.trainer));
  SS_ASSIGN_OR_RETURN(EngineKind engine, ParseEngineKind(a.engine, "--engine"));
  SS_ASSIGN_OR_RETURN(in.rollout, ParseRolloutSpec(a.rollout, engine));
  if (!a.pp_partition.empty()) {
    SS_ASSIGN_OR_RETURN(in.rollout.shard.pp_partition,
                        ParsePpPartition(a.pp_partition, "--pp-partition"));
  }
  SS_ASSIGN_OR_RETURN(in.options.wire_dtype, ParseDType(a.wire_dtype, "--wire-dtype"));
  SS_ASSIGN_OR_RETURN(in.trainer_dtype, ParseDType(a.trainer_dtype, "--trainer-dtype"));
  if (a.bucket_mb < 1 || a.bucket_mb > (int64_t{1} << 20)) {
    return InvalidArgumentError(
        fmt::format("--bucket-mb: must be in [1, 1048576] MiB, got {}", a.bucket_mb));
  }
  in.options.bucket_bytes = a.bucket_mb << 20;
  SS_ASSIGN_OR_RETURN(in.options.straddle, ParseFp8Split(a.fp8_split));
  if (a.quant) {
    SS_ASSIGN_OR_RETURN(in.model.quant, ParseQuantFlag(*a.quant));
    SS_RETURN_IF_ERROR(ValidateModelSpec(in.model));
  }
  return in;
}

// JSON lines are formatted directly (a rank can have millions of ops); names are JSON-escaped once.
std::string Quoted(const std::string& name) {
  return nlohmann::json(name).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void AppendRegion(const Region& r, std::string* out) {
  fmt::format_to(std::back_inserter(*out), "{{\"offset\":[{}],\"extent\":[{}]}}",
                 fmt::join(r.offset.begin(), r.offset.begin() + r.ndim, ","),
                 fmt::join(r.extent.begin(), r.extent.begin() + r.ndim, ","));
}

// Megatron senders' local parameters, built once per rank (ops name where the bytes sit).
class SenderParams {
 public:
  explicit SenderParams(const PlanInputs& in) : in_(in) {}
  Result<const TrainerRankParams*> Get(int rank) {
    auto it = cache_.find(rank);
    if (it == cache_.end()) {
      SS_ASSIGN_OR_RETURN(TrainerRankParams p,
                          BuildTrainerParams(in_.model, in_.trainer, rank, in_.trainer_dtype));
      it = cache_.emplace(rank, std::move(p)).first;
    }
    return &it->second;
  }

 private:
  const PlanInputs& in_;
  std::map<int, TrainerRankParams> cache_;
};

Status AppendOps(const plan_internal::PlanContext& ctx,
                 const std::vector<std::string>& tensor_names, const Message& m,
                 SenderParams* senders, std::string* out) {
  const int S = ctx.trainer_world();
  const int e = (m.dst - S) % ctx.engine_per_replica();
  const auto& params = ctx.map().ranks[e].params;
  std::vector<std::string> param_names(params.size());
  int bucket = 0;
  for (size_t i = 0; i < m.ops.size(); ++i) {
    while (bucket + 1 < static_cast<int>(m.buckets.size()) &&
           m.buckets[bucket].op_end <= static_cast<int32_t>(i)) {
      ++bucket;
    }
    const TransferOp& op = m.ops[i];
    std::string& pname = param_names[op.param];
    if (pname.empty()) pname = Quoted(params[op.param].name);
    fmt::format_to(
        std::back_inserter(*out),
        "{{\"src\":{},\"dst\":{},\"bucket\":{},\"tensor\":{},\"param\":{},\"src_region\":", m.src,
        m.dst, bucket, tensor_names[op.tensor], pname);
    AppendRegion(op.src, out);
    *out += ",\"dst_region\":";
    AppendRegion(op.dst, out);
    if (i < m.local.size()) {
      // Megatron: the sender's local parameter (name, model chunk) and the region inside it.
      SS_ASSIGN_OR_RETURN(const TrainerRankParams* sp, senders->Get(m.src));
      const TrainerParam& lp = sp->params.at(m.local[i].param);
      fmt::format_to(std::back_inserter(*out),
                     ",\"src_param\":{},\"src_chunk\":{},\"src_local\":", Quoted(lp.name),
                     lp.chunk);
      AppendRegion(m.local[i].region, out);
    }
    fmt::format_to(std::back_inserter(*out), ",\"wire_offset\":{},\"bytes\":{}}}\n", op.wire_offset,
                   op.bytes);
  }
  return OkStatus();
}

Result<std::string> DumpOps(const plan_internal::PlanContext& ctx, const DetailedSummary& ds,
                            std::optional<int> rank) {
  std::string out;
  std::vector<std::string> tensor_names;
  tensor_names.reserve(ctx.inventory().size());
  for (const HfTensor& t : ctx.inventory()) tensor_names.push_back(Quoted(t.name));
  SenderParams senders(ctx.inputs());
  if (rank) {
    SS_ASSIGN_OR_RETURN(RankPlan rp, ctx.PlanForRank(*rank));
    for (const Message& m : rp.sends)
      SS_RETURN_IF_ERROR(AppendOps(ctx, tensor_names, m, &senders, &out));
    for (const Message& m : rp.recvs)
      SS_RETURN_IF_ERROR(AppendOps(ctx, tensor_names, m, &senders, &out));
    return out;
  }
  if (ds.summary.ops > kMaxDumpAllOps) {
    return InvalidArgumentError(fmt::format(
        "--dump-ops: the job has {} ops (limit {} without --rank); pass --rank R to dump one rank",
        ds.summary.ops, kMaxDumpAllOps));
  }
  // Every op once: each trainer rank's sends.
  for (int t = 0; t < ctx.trainer_world(); ++t) {
    SS_ASSIGN_OR_RETURN(RankPlan rp, ctx.PlanForRank(t));
    for (const Message& m : rp.sends)
      SS_RETURN_IF_ERROR(AppendOps(ctx, tensor_names, m, &senders, &out));
  }
  return out;
}

using plan_internal::Stats;

std::string TextSummary(const PlanInputs& in, const DetailedSummary& ds) {
  const PlanSummary& s = ds.summary;
  const auto tsend = Stats(s.trainer_ranks, [](const auto& t) { return t.send_bytes; });
  const auto erecv = Stats(s.engine_ranks, [](const auto& e) { return e.recv_bytes; });
  const auto eown = Stats(s.engine_ranks, [](const auto& e) { return e.owned_bytes; });
  std::string o;
  o += fmt::format("shardsync plan: {}  {} -> dp={},tp={},pp={},ep={} ({})\n", in.model.name,
                   in.trainer.ToString(), in.rollout.dp, in.rollout.shard.tp, in.rollout.shard.pp,
                   in.rollout.shard.ep, EngineKindName(in.rollout.shard.engine));
  o += fmt::format("  {:<28}{} wire, {} on the trainer, buckets <= {}\n", "dtypes",
                   DTypeName(in.options.wire_dtype), DTypeName(in.trainer_dtype),
                   Human(static_cast<double>(in.options.bucket_bytes)));
  o += fmt::format("  {:<28}{}\n", "plan hash", s.plan_hash);
  o += fmt::format("  {:<28}{:.3f} s\n", "planning time", s.plan_seconds);
  o += fmt::format("  {:<28}{} ops in {} messages, {} total\n", "transfers", s.ops, s.messages,
                   Human(static_cast<double>(s.total_bytes)));
  o +=
      fmt::format("  {:<28}{} ranks; min {} / mean {} / max {} (max/mean {:.3f})\n",
                  "trainer send bytes", s.trainer_ranks.size(), Human(tsend.min), Human(tsend.mean),
                  Human(tsend.max), tsend.mean > 0 ? tsend.max / tsend.mean : 0.0);
  o += fmt::format("  {:<28}{} ranks; min {} / mean {} / max {}\n", "engine recv bytes",
                   s.engine_ranks.size(), Human(erecv.min), Human(erecv.mean), Human(erecv.max));
  o += fmt::format("  {:<28}min {} / mean {} / max {}\n", "engine owned bytes", Human(eown.min),
                   Human(eown.mean), Human(eown.max));
  const auto tops = Stats(ds.trainer_traffic, [](const RankTraffic& t) { return t.ops; });
  const auto eops = Stats(ds.engine_traffic, [](const RankTraffic& t) { return t.ops; });
  const auto tmsg = Stats(ds.trainer_traffic, [](const RankTraffic& t) { return t.messages; });
  const auto emsg = Stats(ds.engine_traffic, [](const RankTraffic& t) { return t.messages; });
  o += fmt::format("  {:<28}trainer max {} ops / {} messages; engine max {} ops / {} messages\n",
                   "per-rank plan size", tops.max, tmsg.max, eops.max, emsg.max);
  const double ratio = s.broadcast_recv_bytes_per_rank > 0
                           ? erecv.mean / static_cast<double>(s.broadcast_recv_bytes_per_rank)
                           : 0;
  o += fmt::format("  {:<28}{} per engine rank (plan receives {:.3f}x of it)\n",
                   "broadcast-all recv bytes",
                   Human(static_cast<double>(s.broadcast_recv_bytes_per_rank)), ratio);
  o += fmt::format("  {:<28}{} nodes x {} GPUs, {}\n", "placement", ds.placement.nodes,
                   ds.placement.gpus_per_node,
                   ds.placement.colocated ? "trainer and rollout colocated (rank i on GPU i)"
                                          : "trainer and rollout on separate GPUs");
  o += fmt::format("  {:<28}plan {:.3f} s | broadcast-all {:.3f} s | lower bound {:.3f} s\n",
                   "estimated sync time", ds.cost.seconds, ds.cost.broadcast_seconds,
                   ds.cost.lower_bound_seconds);
  return o;
}

// Writes each (flag, path, text) with a non-empty path to a temporary beside it and renames them
// only once every file was written, so an unwritable --svg never leaves a --dump-ops file behind
// (and vice versa). The error names the flag.
Status WriteFiles(
    std::initializer_list<std::tuple<const char*, const std::string&, const std::string&>> files) {
  std::vector<std::pair<std::string, std::string>> written;  // (temporary, final)
  auto discard = [&written] {
    for (const auto& w : written) std::remove(w.first.c_str());
  };
  for (const auto& [flag, path, text] : files) {
    if (path.empty()) continue;
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.close();
    if (!f) {
      std::remove(tmp.c_str());
      discard();
      return PermissionDeniedError(fmt::format("{}: cannot write '{}'", flag, path));
    }
    written.emplace_back(tmp, path);
  }
  for (const auto& [tmp, path] : written) {
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      discard();
      return PermissionDeniedError(fmt::format("cannot write '{}'", path));
    }
  }
  return OkStatus();
}

// ---- block-FP8 plans (fp8_plan.h) ----

void AppendFp8Ops(const plan_internal::Fp8Context& ctx, const Message& m, std::string* out) {
  const int e = (m.dst - ctx.trainer_world()) % ctx.engine_per_replica();
  const auto& params = ctx.map().ranks[e].params;
  int bucket = 0;
  for (size_t i = 0; i < m.ops.size(); ++i) {
    while (bucket + 1 < static_cast<int>(m.buckets.size()) &&
           m.buckets[bucket].op_end <= static_cast<int32_t>(i)) {
      ++bucket;
    }
    const TransferOp& op = m.ops[i];
    fmt::format_to(std::back_inserter(*out),
                   "{{\"src\":{},\"dst\":{},\"bucket\":{},\"kind\":\"{}\",\"tensor\":{},", m.src,
                   m.dst, bucket, EncodingName(op.encoding),
                   Quoted(ctx.inventory()[op.tensor].name));
    if (op.encoding == Encoding::kStage) {
      fmt::format_to(std::back_inserter(*out), "\"stage\":{},", op.stage);
    } else {
      fmt::format_to(std::back_inserter(*out), "\"param\":{},", Quoted(params[op.param].name));
    }
    *out += "\"src_region\":";
    AppendRegion(op.src, out);
    *out += ",\"dst_region\":";
    AppendRegion(op.dst, out);
    if (op.encoding == Encoding::kQuantize) {
      fmt::format_to(std::back_inserter(*out),
                     ",\"scale_param\":{},\"scale_region\":", Quoted(params[op.scale_param].name));
      AppendRegion(op.scale_dst, out);
    }
    fmt::format_to(std::back_inserter(*out), ",\"wire_offset\":{},\"bytes\":{}}}\n", op.wire_offset,
                   op.bytes);
  }
}

Result<std::string> DumpFp8Ops(const plan_internal::Fp8Context& ctx, const PlanSummary& s,
                               std::optional<int> rank) {
  std::string out;
  auto one = [&](int r) -> Status {
    SS_ASSIGN_OR_RETURN(RankPlan rp, ctx.PlanForRank(r));
    for (const Message& m : rp.sends) AppendFp8Ops(ctx, m, &out);
    for (const Message& m : rp.recvs) AppendFp8Ops(ctx, m, &out);
    const int e = (r - ctx.trainer_world()) % ctx.engine_per_replica();
    for (size_t i = 0; i < rp.staged.size(); ++i) {
      const StagedBand& b = rp.staged[i];
      const auto& params = ctx.map().ranks[e].params;
      fmt::format_to(std::back_inserter(out),
                     "{{\"rank\":{},\"staged\":{},\"tensor\":{},\"param\":{},\"src_region\":", r, i,
                     Quoted(ctx.inventory()[b.tensor].name), Quoted(params[b.param].name));
      AppendRegion(b.src, &out);
      out += ",\"dst_region\":";
      AppendRegion(b.dst, &out);
      out += ",\"scale_region\":";
      AppendRegion(b.scale_dst, &out);
      fmt::format_to(std::back_inserter(out), ",\"staging_offset\":{},\"bytes\":{}}}\n",
                     b.staging_offset, b.bytes);
    }
    return OkStatus();
  };
  if (rank) {
    SS_RETURN_IF_ERROR(one(*rank));
    return out;
  }
  if (s.ops > kMaxDumpAllOps) {
    return InvalidArgumentError(fmt::format(
        "--dump-ops: the job has {} ops (limit {} without --rank); pass --rank R to dump one rank",
        s.ops, kMaxDumpAllOps));
  }
  for (int t = 0; t < ctx.trainer_world(); ++t) SS_RETURN_IF_ERROR(one(t));
  return out;
}

std::string Fp8Text(const PlanInputs& in, const PlanSummary& s, double seconds) {
  const auto tsend = Stats(s.trainer_ranks, [](const auto& t) { return t.send_bytes; });
  const auto erecv = Stats(s.engine_ranks, [](const auto& e) { return e.recv_bytes; });
  const auto eown = Stats(s.engine_ranks, [](const auto& e) { return e.owned_bytes; });
  std::string o;
  o += fmt::format(
      "shardsync plan: {}  {} -> dp={},tp={},pp={},ep={} ({}), block FP8 ({}, from {})\n",
      in.model.name, in.trainer.ToString(), in.rollout.dp, in.rollout.shard.tp, in.rollout.shard.pp,
      in.rollout.shard.ep, EngineKindName(in.rollout.shard.engine),
      QuantConfigToString(*in.model.quant), in.model.quant->origin);
  o += fmt::format("  {:<28}{} wire for unquantized params, {} on the trainer, buckets <= {}\n",
                   "dtypes", DTypeName(in.options.wire_dtype), DTypeName(in.trainer_dtype),
                   Human(static_cast<double>(in.options.bucket_bytes)));
  o += fmt::format("  {:<28}{}\n", "plan hash", s.plan_hash);
  o += fmt::format("  {:<28}{:.3f} s\n", "planning time", seconds);
  o += fmt::format("  {:<28}{} ops in {} messages, {} total\n", "transfers", s.ops, s.messages,
                   Human(static_cast<double>(s.total_bytes)));
  o += fmt::format("  {:<28}{} elements; {} on the wire (e4m3 + scales)\n", "quantized by senders",
                   s.sender_quantized_elements, Human(static_cast<double>(s.quantize_bytes)));
  o += fmt::format(
      "  {:<28}{} elements in {} bands straddling trainer ranks; {} raw {} on the wire, staging "
      "<= {} per rank\n",
      "quantized by receivers", s.receiver_quantized_elements, s.staged_bands,
      Human(static_cast<double>(s.stage_bytes)), DTypeName(in.trainer_dtype),
      Human(static_cast<double>(s.max_staging_bytes)));
  o += fmt::format(
      "  {:<28}{} elements in {} blocks of {} bands straddling trainer ranks; {} on the wire "
      "(e4m3 + scales), staging 0; exchange {} written + {} read in the store per sync\n",
      "quantized by holders (amax)", s.amax_elements, s.amax_blocks, s.amax_bands,
      Human(static_cast<double>(s.amax_bytes)), Human(static_cast<double>(s.exchange_write_bytes)),
      Human(static_cast<double>(s.exchange_read_bytes)));
  o += fmt::format("  {:<28}{} on the wire\n", "unquantized copies",
                   Human(static_cast<double>(s.copy_bytes)));
  o +=
      fmt::format("  {:<28}{} ranks; min {} / mean {} / max {} (max/mean {:.3f})\n",
                  "trainer send bytes", s.trainer_ranks.size(), Human(tsend.min), Human(tsend.mean),
                  Human(tsend.max), tsend.mean > 0 ? tsend.max / tsend.mean : 0.0);
  o += fmt::format("  {:<28}{} ranks; min {} / mean {} / max {}\n", "engine recv bytes",
                   s.engine_ranks.size(), Human(erecv.min), Human(erecv.mean), Human(erecv.max));
  o += fmt::format("  {:<28}min {} / mean {} / max {}\n", "engine owned bytes", Human(eown.min),
                   Human(eown.mean), Human(eown.max));
  o += fmt::format("  {:<28}read {} (trainer values once) + write {} (engine bytes once) = {}\n",
                   "memory-bound work", Human(static_cast<double>(s.bound_read_bytes)),
                   Human(static_cast<double>(s.bound_write_bytes)),
                   Human(static_cast<double>(s.bound_read_bytes + s.bound_write_bytes)));
  return o;
}

std::string Fp8Json(const PlanInputs& in, const PlanSummary& s, double seconds) {
  nlohmann::json j;
  j["model"] = in.model.name;
  j["trainer"] = in.trainer.ToString();
  j["rollout"] = {{"dp", in.rollout.dp},
                  {"tp", in.rollout.shard.tp},
                  {"pp", in.rollout.shard.pp},
                  {"ep", in.rollout.shard.ep},
                  {"engine", std::string(EngineKindName(in.rollout.shard.engine))}};
  j["quant"] = {{"method", "fp8"},
                {"format", "e4m3"},
                {"weight_block_size", {in.model.quant->block_n, in.model.quant->block_k}},
                {"modules_to_not_convert", in.model.quant->ignored_modules},
                {"origin", in.model.quant->origin}};
  j["wire_dtype"] = std::string(DTypeName(in.options.wire_dtype));
  j["trainer_dtype"] = std::string(DTypeName(in.trainer_dtype));
  j["bucket_bytes"] = in.options.bucket_bytes;
  j["plan_hash"] = s.plan_hash;
  j["plan_seconds"] = seconds;
  j["ops"] = s.ops;
  j["messages"] = s.messages;
  j["total_bytes"] = s.total_bytes;
  j["copy_bytes"] = s.copy_bytes;
  j["quantize_bytes"] = s.quantize_bytes;
  j["stage_bytes"] = s.stage_bytes;
  j["sender_quantized_elements"] = s.sender_quantized_elements;
  j["receiver_quantized_elements"] = s.receiver_quantized_elements;
  j["staged_bands"] = s.staged_bands;
  j["max_staging_bytes"] = s.max_staging_bytes;
  j["fp8_split"] = std::string(Fp8SplitName(in.options.straddle));
  j["amax_bytes"] = s.amax_bytes;
  j["amax_elements"] = s.amax_elements;
  j["amax_bands"] = s.amax_bands;
  j["amax_blocks"] = s.amax_blocks;
  j["exchange_write_bytes"] = s.exchange_write_bytes;
  j["exchange_read_bytes"] = s.exchange_read_bytes;
  j["bound_read_bytes"] = s.bound_read_bytes;
  j["bound_write_bytes"] = s.bound_write_bytes;
  nlohmann::json tr = nlohmann::json::array();
  for (const auto& t : s.trainer_ranks)
    tr.push_back({{"rank", t.rank}, {"send_bytes", t.send_bytes}});
  j["trainer_ranks"] = std::move(tr);
  nlohmann::json er = nlohmann::json::array();
  const int S = in.trainer.world();
  for (size_t i = 0; i < s.engine_ranks.size(); ++i) {
    const auto& e = s.engine_ranks[i];
    er.push_back({{"sync_rank", S + static_cast<int>(i)},
                  {"replica", e.replica},
                  {"tp_rank", e.tp_rank},
                  {"pp_rank", e.pp_rank},
                  {"recv_bytes", e.recv_bytes},
                  {"owned_bytes", e.owned_bytes}});
  }
  j["engine_ranks"] = std::move(er);
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

int RunFp8(const PlanInputs& in, const Args& a) {
  if (!a.svg.empty()) {
    return ReportError(InvalidArgumentError(
        "--svg: the heatmap is not available for block-FP8 plans yet (drop --svg, or plan the "
        "bf16 engine with --quant none)"));
  }
  if (a.rank) {
    if (auto r = DescribeSyncRank(in, *a.rank); !r.ok()) return ReportError(r.status());
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto ctx = plan_internal::Fp8Context::Build(in);
  if (!ctx.ok()) return ReportError(ctx.status());
  auto s = SummarizePlan(in);
  if (!s.ok()) return ReportError(s.status());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!a.dump_ops.empty()) {
    auto d = DumpFp8Ops(*ctx, *s, a.rank);
    if (!d.ok()) return ReportError(d.status());
    if (Status w = WriteFiles({{"--dump-ops", a.dump_ops, *d}}); !w.ok()) return ReportError(w);
  }
  const std::string out = a.json ? Fp8Json(in, *s, seconds) : Fp8Text(in, *s, seconds);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return kExitOk;
}

int Run(const Args& a) {
  auto in = MakeInputs(a);
  if (!in.ok()) return ReportError(in.status());
  if (in->model.quant) return RunFp8(*in, a);
  Placement pl;
  pl.nodes = a.nodes;
  pl.gpus_per_node = a.gpus_per_node;
  pl.intra_node_gbps = a.intra_gbps;
  pl.inter_node_gbps = a.inter_gbps;
  SummaryOptions so;
  so.placement = pl;
  // Check placement before the (possibly long) planning.
  if (auto r = ResolvePlacement(*in, pl); !r.ok()) return ReportError(r.status());
  if (a.rank) {
    if (auto r = DescribeSyncRank(*in, *a.rank); !r.ok()) return ReportError(r.status());
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto ctx = plan_internal::MakeContext(*in);
  if (!ctx.ok()) return ReportError(ctx.status());
  auto ds = ctx->Summarize(so);
  if (!ds.ok()) return ReportError(ds.status());
  ds->summary.plan_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Everything is computed before anything is written: bad input writes nothing.
  std::string dump, svg;
  if (!a.dump_ops.empty()) {
    auto d = DumpOps(*ctx, *ds, a.rank);
    if (!d.ok()) return ReportError(d.status());
    dump = std::move(*d);
  }
  if (!a.svg.empty()) {
    svg = HeatmapSvg(*ds, PlanHeatmapTitle(*in));
  }
  if (Status w = WriteFiles({{"--dump-ops", a.dump_ops, dump}, {"--svg", a.svg, svg}}); !w.ok()) {
    return ReportError(w);
  }
  const std::string out = a.json ? PlanReportJson(*in, *ds, pl) : TextSummary(*in, *ds);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return kExitOk;
}

Registration reg(
    {"plan", [](CLI::App& app) {
       auto a = std::make_shared<Args>();
       auto rank = std::make_shared<int>(-1);
       auto* sub = app.add_subcommand(
           "plan", "Transfer plan trainer shards -> engine shards: summary, cost, ops");
       sub->add_option("--model", a->model, "Embedded model NAME or config PATH")->required();
       sub->add_option(
              "--trainer", a->trainer,
              "fsdp=S | hsdp=RxS | replicate=S | single | "
              "megatron=tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,cp=C][,dp=D][,first=N][,last=M]"
              "[,vocab_div=K][,experts=grouped|sequential][,norms=te|local][,glu_interleave=G]")
           ->required();
       sub->add_option("--rollout", a->rollout, "dp=D,tp=T,pp=P[,ep=E]")->required();
       sub->add_option("--engine", a->engine, "sglang | vllm")->capture_default_str();
       sub->add_option("--pp-partition", a->pp_partition,
                       "Explicit layers per PP stage, e.g. 12,12,12,12");
       sub->add_option("--nodes", a->nodes, "Nodes (default: as many as needed)");
       sub->add_option("--gpus-per-node", a->gpus_per_node, "GPUs per node")->capture_default_str();
       sub->add_option("--wire-dtype", a->wire_dtype, "Dtype on the wire")->capture_default_str();
       sub->add_option("--trainer-dtype", a->trainer_dtype,
                       "Dtype the trainer holds (cast on the sender)")
           ->capture_default_str();
       sub->add_option("--bucket-mb", a->bucket_mb, "Bucket cap in MiB")->capture_default_str();
       sub->add_option("--intra-node-gbps", a->intra_gbps,
                       "Intra-node GB/s per GPU per direction (H200 NVLink)")
           ->capture_default_str();
       sub->add_option("--inter-node-gbps", a->inter_gbps,
                       "Inter-node GB/s per GPU per direction (400 Gb/s NIC)")
           ->capture_default_str();
       sub->add_flag("--json", a->json, "Print the summary as JSON");
       auto* dump = sub->add_option("--dump-ops", a->dump_ops, "Write ops as JSON lines to FILE");
       sub->add_option("--rank", *rank, "Sync rank whose ops --dump-ops writes")->needs(dump);
       sub->add_option("--svg", a->svg, "Write a trainer x engine byte heatmap SVG");
       auto quant = std::make_shared<std::string>();
       sub->add_option("--quant", *quant,
                       "Engine weights: fp8-block128 (block FP8, overriding the config's "
                       "quantization_config) | none (the model dtype)");
       sub->add_option("--fp8-split", a->fp8_split,
                       "Block FP8, blocks whose rows straddle FSDP trainer ranks: amax (holders "
                       "exchange the block's amax) | stage (the receiver quantizes raw rows)")
           ->capture_default_str();
       return [a, rank, sub, quant] {
         if (sub->count("--rank") > 0) a->rank = *rank;
         if (sub->count("--quant") > 0) a->quant = *quant;
         if (sub->count("--dump-ops") > 0 && a->dump_ops.empty()) {
           return ReportError(InvalidArgumentError("--dump-ops: empty file name"));
         }
         if (sub->count("--svg") > 0 && a->svg.empty()) {
           return ReportError(InvalidArgumentError("--svg: empty file name"));
         }
         return Run(*a);
       };
     }});

}  // namespace
}  // namespace shardsync::cli
