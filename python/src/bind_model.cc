// Model spec (model.h) and shard map (shard_map.h).
#include <pybind11/stl.h>

#include <optional>

#include "common.h"
#include "shardsync/model.h"
#include "shardsync/shard_map.h"

namespace shardsync::py_bind {

namespace {
ModelSpec ModelFromPy(py::handle obj) {
  if (py::isinstance<ModelSpec>(obj)) return obj.cast<ModelSpec>();
  if (py::isinstance<py::str>(obj)) return Unwrap(LoadModelSpec(obj.cast<std::string>()));
  ThrowIfError(InvalidArgumentError("model: expected a ModelSpec or an embedded name / path"));
  return {};
}
}  // namespace

ModelSpec ModelArg(py::handle obj) { return ModelFromPy(obj); }

void RegisterModel(py::module_& m) {
  py::class_<ModelSpec>(m, "ModelSpec",
                        "A model's dimensions (from an embedded config or a Hugging Face "
                        "config.json); `hf_tensors()` lists its checkpoint.")
      .def_readonly("name", &ModelSpec::name)
      .def_property_readonly(
          "architecture", [](const ModelSpec& s) { return std::string(ArchitectureName(s.arch)); })
      .def_readonly("hidden_size", &ModelSpec::hidden_size)
      .def_readonly("num_attention_heads", &ModelSpec::num_attention_heads)
      .def_readonly("num_key_value_heads", &ModelSpec::num_key_value_heads)
      .def_readonly("head_dim", &ModelSpec::head_dim)
      .def_readonly("num_hidden_layers", &ModelSpec::num_hidden_layers)
      .def_readonly("intermediate_size", &ModelSpec::intermediate_size)
      .def_readonly("vocab_size", &ModelSpec::vocab_size)
      .def_readonly("tie_word_embeddings", &ModelSpec::tie_word_embeddings)
      .def_readonly("num_experts", &ModelSpec::num_experts)
      .def_property_readonly("dtype",
                             [](const ModelSpec& s) { return std::string(DTypeName(s.dtype)); })
      .def_property_readonly("num_elements", [](const ModelSpec& s) { return ModelNumElements(s); })
      .def_property_readonly("nbytes", [](const ModelSpec& s) { return ModelBytes(s); })
      .def(
          "hf_tensors",
          [](const ModelSpec& s) {
            py::list out;
            for (const HfTensor& t : HfTensorInventory(s)) {
              out.append(py::make_tuple(t.name, t.shape, std::string(DTypeName(t.dtype))));
            }
            return out;
          },
          "[(name, shape, dtype)] of the HF checkpoint, in the planner's order.")
      .def("__repr__", [](const ModelSpec& s) {
        return "ModelSpec(" + s.name + ", " + std::string(ArchitectureName(s.arch)) + ")";
      });
  m.def(
      "load_model", [](const std::string& n) { return Unwrap(LoadModelSpec(n)); },
      py::arg("name_or_path"), "An embedded model name, a config.json, or a directory with one.");
  m.def(
      "parse_model_config",
      [](const std::string& text, const std::string& source) {
        return Unwrap(ParseModelConfig(text, source));
      },
      py::arg("json_text"), py::arg("source") = "config.json",
      "A ModelSpec from the text of a Hugging Face config.json (`source` names it in errors).");
  m.def("embedded_models", &EmbeddedModelNames, "Names of the models whose configs are built in.");

  py::class_<Piece>(m, "Piece",
                    "Bytes of HF tensor `source` (region `src`) that land in region `dst` of an "
                    "engine parameter.")
      .def_readonly("source", &Piece::source)
      .def_readonly("src", &Piece::src)
      .def_readonly("dst", &Piece::dst)
      .def("__repr__", [](const Piece& p) {
        return "Piece(" + p.source + p.src.ToString() + " -> " + p.dst.ToString() + ")";
      });
  py::class_<EngineParam>(
      m, "EngineParam",
      "One engine parameter on one rank: engine name, local shape, dtype, the pieces that fill it "
      "and the regions the engine zero-fills (padded vocab).")
      .def_readonly("name", &EngineParam::name)
      .def_readonly("shape", &EngineParam::shape)
      .def_property_readonly("dtype",
                             [](const EngineParam& p) { return std::string(DTypeName(p.dtype)); })
      .def_property_readonly(
          "torch_dtype", [](const EngineParam& p) { return std::string(DTypeTorchName(p.dtype)); },
          "torch's name of `dtype` (\"bfloat16\"): getattr(torch, p.torch_dtype)")
      .def_readonly("pieces", &EngineParam::pieces)
      .def_property_readonly("zero_fills",
                             [](const EngineParam& p) {
                               std::vector<Region> out;
                               for (const auto& z : p.zero_fills) out.push_back(z.dst);
                               return out;
                             })
      .def_property_readonly("nbytes", &EngineParam::bytes)
      .def("__repr__", [](const EngineParam& p) {
        return "EngineParam(" + p.name + ", " + ShapeToString(p.shape) + ", " +
               std::string(DTypeName(p.dtype)) + ")";
      });
  py::class_<EngineRankShards>(m, "EngineRankShards",
                               "Everything one engine rank (tp_rank, pp_rank) owns: its layer "
                               "range and parameters in the engine's named_parameters order.")
      .def_readonly("tp_rank", &EngineRankShards::tp_rank)
      .def_readonly("pp_rank", &EngineRankShards::pp_rank)
      .def_readonly("moe_ep_rank", &EngineRankShards::moe_ep_rank)
      .def_readonly("moe_tp_rank", &EngineRankShards::moe_tp_rank)
      .def_readonly("layer_start", &EngineRankShards::layer_start)
      .def_readonly("layer_end", &EngineRankShards::layer_end)
      .def_readonly("params", &EngineRankShards::params)
      .def_property_readonly("nbytes", &EngineRankShards::bytes)
      .def(
          "param",
          [](const EngineRankShards& r, const std::string& name) {
            const EngineParam* p = FindParam(r, name);
            if (p == nullptr) {
              ThrowIfError(NotFoundError("engine rank (tp " + std::to_string(r.tp_rank) + ", pp " +
                                         std::to_string(r.pp_rank) + ") has no parameter '" + name +
                                         "'"));
            }
            return *p;
          },
          py::arg("name"));
  py::class_<ShardMap>(m, "ShardMap",
                       "One replica's shard map: `rank(tp, pp)` for each engine rank, `explain(tp, "
                       "pp, name)`, `validate()` (exact cover).")
      .def_property_readonly(
          "engine", [](const ShardMap& s) { return std::string(EngineKindName(s.spec.engine)); })
      .def_property_readonly("tp", [](const ShardMap& s) { return s.spec.tp; })
      .def_property_readonly("pp", [](const ShardMap& s) { return s.spec.pp; })
      .def_property_readonly("ep", [](const ShardMap& s) { return s.spec.ep; })
      .def_readonly("model", &ShardMap::model)
      .def_readonly("ranks", &ShardMap::ranks)
      .def(
          "rank",
          [](const ShardMap& s, int tp_rank, int pp_rank) {
            if (tp_rank < 0 || tp_rank >= s.spec.tp || pp_rank < 0 || pp_rank >= s.spec.pp) {
              ThrowIfError(OutOfRangeError("engine rank (tp " + std::to_string(tp_rank) + ", pp " +
                                           std::to_string(pp_rank) +
                                           ") outside tp=" + std::to_string(s.spec.tp) +
                                           ", pp=" + std::to_string(s.spec.pp)));
            }
            return s.rank(tp_rank, pp_rank);
          },
          py::arg("tp_rank"), py::arg("pp_rank") = 0)
      .def(
          "explain",
          [](const ShardMap& s, int tp_rank, int pp_rank, const std::string& name) {
            return Unwrap(ExplainParam(s, s.rank(tp_rank, pp_rank), name));
          },
          py::arg("tp_rank"), py::arg("pp_rank"), py::arg("name"))
      .def("validate", [](const ShardMap& s) { ThrowIfError(ValidateShardMap(s)); });
  m.def(
      "build_shard_map",
      [](py::handle model, const std::string& engine, int tp, int pp, int ep,
         std::vector<int64_t> pp_partition, const std::string& expert_naming,
         const std::string& wire_dtype) {
        ShardSpec spec;
        spec.engine = Unwrap(ParseEngineKind(engine));
        spec.tp = tp;
        spec.pp = pp;
        spec.ep = ep;
        spec.pp_partition = std::move(pp_partition);
        spec.expert_naming = Unwrap(ParseExpertNaming(expert_naming));
        std::optional<DType> wire;
        if (!wire_dtype.empty()) wire = Unwrap(ParseDType(wire_dtype, "wire_dtype"));
        ModelSpec ms = ModelFromPy(model);
        py::gil_scoped_release nogil;
        ShardMap map = Unwrap(BuildShardMap(ms, spec));
        if (wire) {
          // What a session's engine parameters hold (fp8_plan.h Fp8DestDType): block-FP8
          // e4m3 weights and their fp32 weight_scale_inv as the map says, the rest wire bytes.
          for (EngineRankShards& r : map.ranks) {
            for (EngineParam& p : r.params) {
              const bool fp8 = p.dtype == DType::kF8E4M3 ||
                               (p.dtype == DType::kF32 && p.name.ends_with("weight_scale_inv"));
              if (!fp8) p.dtype = *wire;
            }
          }
        }
        return map;
      },
      py::arg("model"), py::arg("engine") = "sglang", py::arg("tp") = 1, py::arg("pp") = 1,
      py::arg("ep") = 1, py::arg("pp_partition") = std::vector<int64_t>{},
      py::arg("expert_naming") = "fused_moe", py::arg("wire_dtype") = "",
      "The shard map of one replica: which bytes of which HF tensor every engine rank owns; "
      "with `wire_dtype`, each parameter's dtype is what a session binds (the wire dtype; "
      "block-FP8 weights and scales as they are), else the model's.");
}

}  // namespace shardsync::py_bind
