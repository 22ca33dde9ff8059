// Transfer planner (plan.h).
#include <pybind11/stl.h>

#include "common.h"
#include "plan_inputs.h"
#include "shardsync/fp8_plan.h"
#include "shardsync/plan.h"
#include "shardsync/session.h"

namespace shardsync::py_bind {

ModelSpec ModelArg(py::handle obj);  // bind_model.cc

PlanInputs MakePlanInputs(py::handle model, const std::string& trainer, const std::string& rollout,
                          const std::string& engine, const std::string& wire_dtype,
                          const std::string& trainer_dtype, int64_t bucket_bytes,
                          std::vector<int64_t> pp_partition, const std::string& expert_naming,
                          const std::string& quant, const std::string& fp8_split,
                          const std::string& encoding) {
  PlanInputs in;
  in.model = ModelArg(model);
  // "fp8-block128" (block-FP8 engine weights), "none" (the model dtype), "" (as the config says),
  // and the engines' own spelling "fp8": SGLang's and vLLM's `--quantization fp8` is block FP8
  // only when the checkpoint's quantization_config has weight_block_size (Fp8Config.from_config:
  // vllm/model_executor/layers/quantization/fp8.py, python/sglang/srt/layers/quantization/fp8.py),
  // and per-tensor FP8 otherwise, which no shardsync plan produces: accepted as "as the config
  // says" for a block-128 config, refused otherwise.
  if (quant == "fp8") {
    const auto& q = in.model.quant;
    if (!q || q->block_n != 128 || q->block_k != 128) {
      ThrowIfError(InvalidArgumentError(
          "quant: 'fp8' is SGLang's / vLLM's --quantization fp8, which is block FP8 only for a "
          "checkpoint whose quantization_config has weight_block_size [128, 128], and per-tensor "
          "FP8 otherwise (not supported); model " +
          in.model.name + " has " +
          (q ? "blocks of " + std::to_string(q->block_n) + " x " + std::to_string(q->block_k)
             : std::string("no quantization_config")) +
          ": for block-128 FP8 engine weights pass quant='fp8-block128'"));
    }
  } else if (!quant.empty()) {
    in.model.quant = Unwrap(ParseQuantFlag(quant));
  }
  in.trainer = Unwrap(ParseTrainerSpec(trainer));
  try {
    in.rollout = Unwrap(ParseRolloutSpec(rollout, Unwrap(ParseEngineKind(engine, "engine"))));
  } catch (StatusException& e) {
    e.wording = Wording::kRollout;  // "--tp" arrived as rollout="...,tp=3"
    throw;
  }
  in.rollout.shard.pp_partition = std::move(pp_partition);
  in.options.wire_dtype = Unwrap(ParseDType(wire_dtype, "wire_dtype"));
  in.trainer_dtype = Unwrap(ParseDType(trainer_dtype, "trainer_dtype"));
  if (bucket_bytes <= 0) {
    ThrowIfError(InvalidArgumentError("bucket_bytes: must be positive, got " +
                                      std::to_string(bucket_bytes)));
  }
  in.options.bucket_bytes = bucket_bytes;
  in.options.straddle = Unwrap(ParseFp8Split(fp8_split, "fp8_split"));
  in.options.encoding = Unwrap(ParseWireEncoding(encoding, "encoding"));
  in.rollout.shard.expert_naming = Unwrap(ParseExpertNaming(expert_naming));
  if (in.rollout.shard.expert_naming != ExpertNaming::kFusedMoe) {
    // Refuse an engine without that naming now, not at the first shard map.
    ThrowIfError(ComputeShardDims(in.model, in.rollout.shard).status());
  }
  // Every check planning would make, now: a Plan that constructs can be summarised and
  // connected, and a bad one fails here naming the field rather than at summary() or connect().
  Status valid = ValidatePlanInputs(in);
  if (!valid.ok()) throw StatusException{std::move(valid), Wording::kRollout};
  return in;
}

namespace {

Placement MakePlacement(int nodes, int gpus_per_node, double intra_gbps, double inter_gbps) {
  Placement p;
  p.nodes = nodes;
  p.gpus_per_node = gpus_per_node;
  p.intra_node_gbps = intra_gbps;
  p.inter_node_gbps = inter_gbps;
  return p;
}

// The detailed summary under `placement`, planned without the GIL.
DetailedSummary Detailed(const PlanInputs& in, const Placement& placement) {
  SummaryOptions so;
  so.placement = placement;
  Result<DetailedSummary> ds = [&]() -> Result<DetailedSummary> {
    py::gil_scoped_release nogil;
    SS_RETURN_IF_ERROR(ResolvePlacement(in, placement));
    return SummarizePlanDetailed(in, so);
  }();
  return Unwrap(std::move(ds));
}

py::dict SyncRankToPy(const SyncRank& r) {
  py::dict d;
  d["is_trainer"] = r.is_trainer;
  d["trainer_rank"] = r.trainer_rank;
  d["replica"] = r.replica;
  d["tp_rank"] = r.tp_rank;
  d["pp_rank"] = r.pp_rank;
  return d;
}

py::dict SummaryToPy(const PlanSummary& s) {
  py::dict d;
  d["plan_hash"] = s.plan_hash;
  d["ops"] = s.ops;
  d["messages"] = s.messages;
  d["total_bytes"] = s.total_bytes;
  py::list engines;
  for (const auto& e : s.engine_ranks) {
    py::dict x;
    x["replica"] = e.replica;
    x["tp_rank"] = e.tp_rank;
    x["pp_rank"] = e.pp_rank;
    x["recv_bytes"] = e.recv_bytes;
    x["owned_bytes"] = e.owned_bytes;
    engines.append(x);
  }
  d["engine_ranks"] = engines;
  py::list trainers;
  for (const auto& t : s.trainer_ranks) {
    py::dict x;
    x["rank"] = t.rank;
    x["send_bytes"] = t.send_bytes;
    trainers.append(x);
  }
  d["trainer_ranks"] = trainers;
  d["broadcast_recv_bytes_per_rank"] = s.broadcast_recv_bytes_per_rank;
  d["plan_seconds"] = s.plan_seconds;
  return d;
}

// A block-FP8 plan's summary: the keys of a bf16 one (bytes on the wire; owned bytes in the
// engines' dtypes) plus "quant" with where blocks are quantized and the memory-bound work.
// Block FP8: the same dict with the codec's figures under "quant" (and no broadcast-all figure:
// the engines' own update paths load bf16 and requantize).
py::dict Fp8SummaryToPy(const PlanSummary& f) {
  py::dict d = SummaryToPy(f);
  d.attr("pop")("broadcast_recv_bytes_per_rank");
  py::dict q;
  q["copy_bytes"] = f.copy_bytes;
  q["quantize_bytes"] = f.quantize_bytes;
  q["stage_bytes"] = f.stage_bytes;
  q["sender_quantized_elements"] = f.sender_quantized_elements;
  q["receiver_quantized_elements"] = f.receiver_quantized_elements;
  q["amax_elements"] = f.amax_elements;  // blocks shared by trainer ranks (amax exchange)
  q["amax_bytes"] = f.amax_bytes;
  q["exchange_write_bytes"] = f.exchange_write_bytes;
  q["staged_bands"] = f.staged_bands;
  q["max_staging_bytes"] = f.max_staging_bytes;
  q["bound_read_bytes"] = f.bound_read_bytes;
  q["bound_write_bytes"] = f.bound_write_bytes;
  d["quant"] = q;
  return d;
}

}  // namespace

void RegisterPlan(py::module_& m) {
  py::class_<TransferOp>(m, "TransferOp",
                         "One contiguous destination run of a message: HF tensor region `src` -> "
                         "engine parameter region `dst`, at `wire_offset`, with its `encoding`.")
      .def_readonly("tensor", &TransferOp::tensor)
      .def_readonly("param", &TransferOp::param)
      .def_readonly("src", &TransferOp::src)
      .def_readonly("dst", &TransferOp::dst)
      .def_readonly("wire_offset", &TransferOp::wire_offset)
      .def_readonly("bytes", &TransferOp::bytes)
      .def_property_readonly(
          "encoding", [](const TransferOp& op) { return std::string(EncodingName(op.encoding)); },
          "How the op travels: copy (cast to the wire dtype) | quantize | stage | amax (block FP8, "
          "docs/fp8.md).");
  py::class_<LocalSource>(
      m, "LocalSource",
      "Where a Megatron sender holds one op's bytes: its local parameter and region.")
      .def_readonly("param", &LocalSource::param)
      .def_readonly("region", &LocalSource::region);
  py::class_<TrainerPiece>(
      m, "TrainerPiece",
      "HF bytes a trainer parameter holds: `src` of HF tensor `source` at `local`.")
      .def_readonly("source", &TrainerPiece::source)
      .def_readonly("src", &TrainerPiece::src)
      .def_readonly("local", &TrainerPiece::local)
      .def("__repr__", [](const TrainerPiece& p) {
        return "TrainerPiece(" + p.local.ToString() + " <- " + p.source + p.src.ToString() + ")";
      });
  py::class_<TrainerParam>(
      m, "TrainerParam",
      "A trainer rank's local parameter (Megatron name per model chunk) and its pieces.")
      .def_readonly("name", &TrainerParam::name)
      .def_readonly("chunk", &TrainerParam::chunk)
      .def_readonly("shape", &TrainerParam::shape)
      .def_property_readonly("dtype",
                             [](const TrainerParam& p) { return std::string(DTypeName(p.dtype)); })
      .def_readonly("pieces", &TrainerParam::pieces)
      .def_property_readonly("numel", &TrainerParam::numel)
      .def("__repr__", [](const TrainerParam& p) {
        return "TrainerParam(" + p.name + ", chunk " + std::to_string(p.chunk) + ", " +
               ShapeToString(p.shape) + ", " + std::to_string(p.pieces.size()) + " pieces)";
      });
  py::class_<Bucket>(m, "Bucket",
                     "A slice of a message's ops sent and verified as one unit (one checksum).")
      .def_readonly("op_begin", &Bucket::op_begin)
      .def_readonly("op_end", &Bucket::op_end)
      .def_readonly("wire_offset", &Bucket::wire_offset)
      .def_readonly("bytes", &Bucket::bytes);
  py::class_<Message>(
      m, "Message",
      "Everything sync rank `src` sends sync rank `dst` in one sync: ops and buckets.")
      .def_readonly("src", &Message::src)
      .def_readonly("dst", &Message::dst)
      .def_readonly("bytes", &Message::bytes)
      .def_readonly("ops", &Message::ops)
      .def_readonly("buckets", &Message::buckets)
      .def_readonly("local", &Message::local);
  py::class_<RankPlan>(m, "RankPlan",
                       "One sync rank's part of the plan: the messages it sends and receives.")
      .def_readonly("rank", &RankPlan::rank)
      .def_readonly("plan_hash", &RankPlan::plan_hash)
      .def_readonly("sends", &RankPlan::sends)
      .def_readonly("recvs", &RankPlan::recvs)
      .def_property_readonly("send_bytes",
                             [](const RankPlan& p) {
                               int64_t b = 0;
                               for (const auto& msg : p.sends) b += msg.bytes;
                               return b;
                             })
      .def_property_readonly("recv_bytes", [](const RankPlan& p) {
        int64_t b = 0;
        for (const auto& msg : p.recvs) b += msg.bytes;
        return b;
      });

  py::class_<PlanInputs>(m, "PlanInputs",
                         "The planner's inputs (model, trainer and rollout layouts, dtypes, bucket "
                         "cap); use shardsync.Plan.")
      .def(py::init(&MakePlanInputs), py::arg("model"), py::arg("trainer"), py::arg("rollout"),
           py::arg("engine") = "sglang", py::arg("wire_dtype") = "bf16",
           py::arg("trainer_dtype") = "fp32", py::arg("bucket_bytes") = int64_t{512} << 20,
           py::arg("pp_partition") = std::vector<int64_t>{}, py::arg("expert_naming") = "fused_moe",
           py::arg("quant") = "", py::arg("fp8_split") = "amax", py::arg("encoding") = "full")
      .def_property_readonly(
          "encoding",
          [](const PlanInputs& in) { return std::string(WireEncodingName(in.options.encoding)); })
      .def_property_readonly(
          "fp8_split",
          [](const PlanInputs& in) { return std::string(Fp8SplitName(in.options.straddle)); })
      .def_property_readonly("quant",
                             [](const PlanInputs& in) -> py::object {
                               if (!in.model.quant) return py::none();
                               return py::str(QuantConfigToString(*in.model.quant));
                             })
      .def_readonly("model", &PlanInputs::model)
      .def_property_readonly("trainer", [](const PlanInputs& in) { return in.trainer.ToString(); })
      .def_property_readonly("trainer_world",
                             [](const PlanInputs& in) { return in.trainer.world(); })
      .def_property_readonly("dp", [](const PlanInputs& in) { return in.rollout.dp; })
      .def_property_readonly("tp", [](const PlanInputs& in) { return in.rollout.shard.tp; })
      .def_property_readonly("pp", [](const PlanInputs& in) { return in.rollout.shard.pp; })
      .def_property_readonly("ep", [](const PlanInputs& in) { return in.rollout.shard.ep; })
      .def_property_readonly("expert_naming",
                             [](const PlanInputs& in) {
                               return std::string(ExpertNamingName(in.rollout.shard.expert_naming));
                             })
      .def_property_readonly(
          "engine",
          [](const PlanInputs& in) { return std::string(EngineKindName(in.rollout.shard.engine)); })
      .def_property_readonly(
          "wire_dtype",
          [](const PlanInputs& in) { return std::string(DTypeName(in.options.wire_dtype)); })
      .def_property_readonly(
          "trainer_dtype",
          [](const PlanInputs& in) { return std::string(DTypeName(in.trainer_dtype)); })
      .def_property_readonly("bucket_bytes",
                             [](const PlanInputs& in) { return in.options.bucket_bytes; })
      .def_property_readonly("pp_partition",
                             [](const PlanInputs& in) { return in.rollout.shard.pp_partition; })
      .def_property_readonly("world_size", [](const PlanInputs& in) { return SyncWorldSize(in); })
      .def_property_readonly("hash", [](const PlanInputs& in) { return PlanHash(in); })
      .def(
          "describe_rank",
          [](const PlanInputs& in, int r) { return SyncRankToPy(Unwrap(DescribeSyncRank(in, r))); },
          py::arg("sync_rank"))
      .def(
          "rank_plan",
          [](const PlanInputs& in, int r) {
            py::gil_scoped_release nogil;
            return Unwrap(PlanForRank(in, r));
          },
          py::arg("sync_rank"))
      .def("summary",
           [](const PlanInputs& in) {
             Result<PlanSummary> s = [&] {
               py::gil_scoped_release nogil;
               return SummarizePlan(in);
             }();
             return in.model.quant ? Fp8SummaryToPy(Unwrap(std::move(s)))
                                   : SummaryToPy(Unwrap(std::move(s)));
           })
      .def("validate",
           [](const PlanInputs& in) {
             Status s;
             {
               py::gil_scoped_release nogil;
               s = ValidatePlan(in);
             }
             ThrowIfError(s);
           })
      .def(
          "held_region",
          [](const PlanInputs& in, int trainer_rank, const Shape& shape) {
            if (trainer_rank < 0 || trainer_rank >= in.trainer.world()) {
              ThrowIfError(OutOfRangeError("trainer rank " + std::to_string(trainer_rank) +
                                           " outside [0, " + std::to_string(in.trainer.world()) +
                                           ")"));
            }
            if (in.trainer.kind == TrainerSpec::Kind::kMegatron) {
              ThrowIfError(InvalidArgumentError(
                  "held_region: " + in.trainer.ToString() +
                  " ranks hold local parameters, not HF regions; use trainer_params(rank)"));
            }
            return TrainerHeldRegion(in.trainer, trainer_rank, shape);
          },
          py::arg("trainer_rank"), py::arg("shape"),
          "Region of a tensor of `shape` that trainer `trainer_rank` holds.")
      .def(
          "trainer_params",
          [](const PlanInputs& in, int trainer_rank) {
            return Unwrap(BuildTrainerParams(in.model, in.trainer, trainer_rank, in.trainer_dtype))
                .params;
          },
          py::arg("trainer_rank"),
          "Local parameters of trainer `trainer_rank` (Megatron: per model chunk, Megatron's "
          "local names) and the HF regions each holds.")
      .def(
          "trainer_coords",
          [](const PlanInputs& in, int trainer_rank) -> py::object {
            if (trainer_rank < 0 || trainer_rank >= in.trainer.world()) {
              ThrowIfError(OutOfRangeError("trainer rank " + std::to_string(trainer_rank) +
                                           " outside [0, " + std::to_string(in.trainer.world()) +
                                           ")"));
            }
            if (in.trainer.kind != TrainerSpec::Kind::kMegatron) return py::none();
            const MegatronCoords c = MegatronRankCoords(in.trainer.megatron, trainer_rank);
            py::dict d;
            d["tp"] = c.tp;
            d["cp"] = c.cp;
            d["dp"] = c.dp;
            d["pp"] = c.pp;
            d["etp"] = c.etp;
            d["ep"] = c.ep;
            d["edp"] = c.edp;
            return d;
          },
          py::arg("trainer_rank"),
          "Megatron coordinates of a trainer rank (dense tp/cp/dp/pp, expert etp/ep/edp); None "
          "for other layouts.")
      .def(
          "megatron_layout",
          [](const PlanInputs& in) -> py::object {
            if (in.trainer.kind != TrainerSpec::Kind::kMegatron) return py::none();
            const MegatronLayout& m = in.trainer.megatron;
            py::dict d;
            d["tp"] = m.tp;
            d["pp"] = m.pp;
            d["vpp"] = m.vpp;
            d["ep"] = m.ep;
            d["etp"] = m.etp;
            d["cp"] = m.cp;
            d["dp"] = m.dp;
            d["edp"] = m.expert_dp();
            d["first"] = m.first;
            d["last"] = m.last;
            d["vocab_div"] = m.vocab_div;
            d["experts"] = m.sequential_experts ? "sequential" : "grouped";
            d["norms"] = m.local_norms ? "local" : "te";
            d["glu_interleave"] = m.glu_interleave;
            return d;
          },
          "Every field of a Megatron trainer layout, defaults filled in (etp, experts), plus the "
          "expert data-parallel size edp; None for other layouts.")
      .def(
          "staging_bytes",
          [](const PlanInputs& in, int sync_rank) { return Unwrap(StagingBytes(in, sync_rank)); },
          py::arg("sync_rank"),
          "Bytes of staging engine sync rank `sync_rank` needs under a staged commit (its "
          "parameters as it binds them); 0 for trainer ranks.")
      .def(
          "report_json",
          [](const PlanInputs& in, int nodes, int gpus_per_node, double intra, double inter) {
            const Placement p = MakePlacement(nodes, gpus_per_node, intra, inter);
            return PlanReportJson(in, Detailed(in, p), p);
          },
          py::arg("nodes") = 0, py::arg("gpus_per_node") = 8, py::arg("intra_node_gbps") = 450.0,
          py::arg("inter_node_gbps") = 50.0,
          "`shardsync plan --json` for these inputs and placement (cost model included).")
      .def(
          "heatmap_svg",
          [](const PlanInputs& in, int nodes, int gpus_per_node) {
            const Placement p = MakePlacement(nodes, gpus_per_node, 450.0, 50.0);
            return HeatmapSvg(Detailed(in, p), PlanHeatmapTitle(in));
          },
          py::arg("nodes") = 0, py::arg("gpus_per_node") = 8,
          "`shardsync plan --svg`: the trainer x engine byte heatmap.");
  m.def(
      "parse_trainer_spec",
      [](const std::string& s) { return Unwrap(ParseTrainerSpec(s)).ToString(); }, py::arg("spec"),
      "Canonical spelling of a trainer spec (\"fsdp=8\", \"hsdp=2x4\", \"replicate=4\", "
      "\"single\", \"megatron=tp=2,pp=2\").");
}

}  // namespace shardsync::py_bind
