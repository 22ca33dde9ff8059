// Renderings of the trainer map (`shardsync shards --trainer`): the per-rank table, the JSON
// document (docs/cli.md) and where the bytes of one local parameter or HF tensor are held.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/human.h"
#include "shardsync/plan.h"

namespace shardsync {
namespace {

// Elements of HF bytes a rank holds (padding rows excluded) and the local parameters' bytes.
std::pair<int64_t, int64_t> Held(const TrainerRankParams& r) {
  int64_t hf = 0, bytes = 0;
  for (const TrainerParam& p : r.params) {
    bytes += p.numel() * DTypeSize(p.dtype);
    for (const TrainerPiece& pc : p.pieces) hf += pc.src.numel();
  }
  return {hf, bytes};
}

std::string Coords(const TrainerRankParams& r) {
  const MegatronCoords& c = r.coords;
  return fmt::format("tp {} cp {} dp {} pp {} | etp {} ep {} edp {}", c.tp, c.cp, c.dp, c.pp, c.etp,
                     c.ep, c.edp);
}

}  // namespace

std::string TrainerMapToTable(const ModelSpec& model, const TrainerSpec& t,
                              const std::vector<TrainerRankParams>& ranks) {
  std::string out = fmt::format("model {} ({}): {} layers, vocab {}, {} HF elements\n", model.name,
                                ArchitectureName(model.arch), model.num_hidden_layers,
                                model.vocab_size, ModelNumElements(model));
  out += fmt::format("trainer {}: world {}", t.ToString(), t.world());
  if (t.kind == TrainerSpec::Kind::kMegatron) {
    const MegatronLayout& m = t.megatron;
    out += fmt::format(", padded vocab {}, expert grid etp {} x ep {} x edp {} x pp {}",
                       MegatronPaddedVocab(m, model.vocab_size), m.etp, m.ep, m.expert_dp(), m.pp);
  }
  out += "\n\n";
  const bool mg = t.kind == TrainerSpec::Kind::kMegatron;
  out += fmt::format("{:>6} {}{:>8} {:>12} {:>12} {:>8}\n", "rank",
                     mg ? fmt::format("{:<38} {:>14} ", "megatron coordinates", "layers") : "",
                     "params", "HF elements", "bytes", "% model");
  const int64_t total = ModelNumElements(model);
  for (const TrainerRankParams& r : ranks) {
    const auto [hf, bytes] = Held(r);
    std::string layers;
    if (mg) {
      for (int v = 0; v < t.megatron.vpp; ++v) {
        auto range =
            MegatronChunkLayers(t.megatron, model.num_hidden_layers, r.coords.pp, v).value();
        layers += fmt::format("{}[{},{})", v ? " " : "", range.first, range.second);
      }
    }
    out += fmt::format("{:>6} {}{:>8} {:>12} {:>12} {:>7.2f}%\n", r.rank,
                       mg ? fmt::format("{:<38} {:>14} ", Coords(r), layers) : "", r.params.size(),
                       hf, HumanBytes(bytes), total > 0 ? 100.0 * hf / total : 0.0);
  }
  return out;
}

std::string TrainerMapToJson(const ModelSpec& model, const TrainerSpec& t,
                             const std::vector<TrainerRankParams>& ranks) {
  using nlohmann::ordered_json;
  ordered_json j;
  j["model"] = model.name;
  j["trainer"] = t.ToString();
  j["world"] = t.world();
  if (t.kind == TrainerSpec::Kind::kMegatron) {
    j["padded_vocab"] = MegatronPaddedVocab(t.megatron, model.vocab_size);
  }
  ordered_json rs = ordered_json::array();
  for (const TrainerRankParams& r : ranks) {
    ordered_json rj;
    rj["rank"] = r.rank;
    if (r.megatron) {
      const MegatronCoords& c = r.coords;
      rj["coords"] = ordered_json{{"tp", c.tp},   {"cp", c.cp}, {"dp", c.dp},  {"pp", c.pp},
                                  {"etp", c.etp}, {"ep", c.ep}, {"edp", c.edp}};
    }
    ordered_json ps = ordered_json::array();
    for (const TrainerParam& p : r.params) {
      ordered_json pj;
      pj["name"] = p.name;
      pj["chunk"] = p.chunk;
      pj["shape"] = p.shape;
      pj["dtype"] = DTypeTorchName(p.dtype);
      ordered_json pieces = ordered_json::array();
      for (const TrainerPiece& pc : p.pieces) {
        pieces.push_back(ordered_json{{"source", pc.source},
                                      {"src_offset", pc.src.offsets()},
                                      {"local_offset", pc.local.offsets()},
                                      {"extent", pc.src.extents()}});
      }
      pj["pieces"] = std::move(pieces);
      ps.push_back(std::move(pj));
    }
    rj["params"] = std::move(ps);
    rs.push_back(std::move(rj));
  }
  j["ranks"] = std::move(rs);
  return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace) + "\n";
}

Result<std::string> ExplainTrainerParam(const std::vector<TrainerRankParams>& ranks,
                                        std::string_view name) {
  std::string out;
  for (const TrainerRankParams& r : ranks) {
    for (const TrainerParam& p : r.params) {
      if (p.name != name) continue;
      out += fmt::format("trainer rank {} chunk {}: {} {} {}\n", r.rank, p.chunk, p.name,
                         ShapeToString(p.shape), DTypeTorchName(p.dtype));
      int64_t covered = 0;
      for (const TrainerPiece& pc : p.pieces) {
        out += fmt::format("  {} <- {}{}\n", pc.local.ToString(), pc.source, pc.src.ToString());
        covered += pc.src.numel();
      }
      if (covered < p.numel()) {
        out += fmt::format("  {} elements hold no HF byte (padding)\n", p.numel() - covered);
      }
    }
  }
  if (!out.empty()) return out;
  for (const TrainerRankParams& r : ranks) {
    for (const TrainerParam& p : r.params) {
      for (const TrainerPiece& pc : p.pieces) {
        if (pc.source != name) continue;
        out += fmt::format("trainer rank {}: {}{} -> chunk {} {}{}\n", r.rank, name,
                           pc.src.ToString(), p.chunk, p.name, pc.local.ToString());
      }
    }
  }
  if (!out.empty()) {
    return fmt::format("'{}' is an HF tensor; trainer ranks hold its bytes in:\n{}", name, out);
  }
  return NotFoundError(fmt::format(
      "--explain: no selected trainer rank holds a local parameter or HF tensor named '{}' "
      "(Megatron names look like decoder.layers.0.self_attention.linear_qkv.weight; see --json)",
      name));
}

}  // namespace shardsync
