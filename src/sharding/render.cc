// Text renderings of a shard map: the per-rank table, the JSON document (docs/cli.md) and the
// byte-by-byte account of one parameter (`shardsync shards`).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/human.h"
#include "shardsync/shard_map.h"

namespace shardsync {
namespace {

std::string HumanCount(int64_t n) {
  if (n >= 1000000000) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1000000) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1000) return fmt::format("{:.1f}K", n / 1e3);
  return std::to_string(n);
}

}  // namespace

std::string ShardMapToTable(const ShardMap& map,
                            const std::vector<const EngineRankShards*>& ranks) {
  const ModelSpec& m = map.model;
  const int64_t model_bytes = ModelBytes(m);
  auto dims = ComputeShardDims(m, map.spec);  // cannot fail: the map was built
  std::string out = fmt::format(
      "model {} ({}): {} layers, hidden {}, heads {}/{} (q/kv), head_dim {}, vocab {} (padded "
      "{}){}, {} params, {} {}\n",
      m.name, ArchitectureName(m.arch), m.num_hidden_layers, m.hidden_size, m.num_attention_heads,
      m.num_key_value_heads, m.head_dim, m.vocab_size, dims.ok() ? dims->padded_vocab : 0,
      m.tie_word_embeddings ? ", tied embeddings" : "", HumanCount(ModelNumElements(m)),
      HumanBytes(model_bytes), DTypeTorchName(m.dtype));
  if (m.quant) {
    out += fmt::format(
        "engine weights: block FP8 ({}, from {}): quantized linears as e4m3 + fp32 "
        "weight_scale_inv\n",
        QuantConfigToString(*m.quant), m.quant->origin);
  }
  out += fmt::format("engine {}: tp {}, pp {}", EngineKindName(map.spec.engine), map.spec.tp,
                     map.spec.pp);
  if (m.is_moe() && dims.ok()) {
    out += fmt::format(", ep {} (moe_tp {}, {} of {} experts per rank)", map.spec.ep, dims->moe_tp,
                       dims->experts_per_rank, m.num_experts);
  }
  if (dims.ok() && dims->kv_head_replicas > 1) {
    out += fmt::format(", each kv head on {} ranks", dims->kv_head_replicas);
  }
  out += "\n\n";
  const bool moe = m.is_moe();
  out += fmt::format("{:>4} {:>4} {}{:>12} {:>8} {:>10} {:>12} {:>8}\n", "tp", "pp",
                     moe ? fmt::format("{:>6} {:>6} ", "ep", "moe_tp") : "", "layers", "params",
                     "elements", "bytes", "% model");
  int64_t total = 0;
  for (const EngineRankShards* r : ranks) {
    int64_t elems = 0;
    for (const auto& p : r->params) elems += p.numel();
    total += r->bytes();
    out += fmt::format(
        "{:>4} {:>4} {}{:>12} {:>8} {:>10} {:>12} {:>7.2f}%\n", r->tp_rank, r->pp_rank,
        moe ? fmt::format("{:>6} {:>6} ", r->moe_ep_rank, r->moe_tp_rank) : "",
        fmt::format("[{}, {})", r->layer_start, r->layer_end), r->params.size(), HumanCount(elems),
        HumanBytes(r->bytes()), model_bytes > 0 ? 100.0 * r->bytes() / model_bytes : 0.0);
  }
  const double ratio = model_bytes > 0 ? static_cast<double>(total) / model_bytes : 0.0;
  if (ranks.size() == map.ranks.size()) {
    out += fmt::format(
        "\n{} ranks hold {} ({:.3f}x the {}checkpoint; above 1x by replicated norms, router and "
        "kv heads, vocab padding{}{})\n",
        ranks.size(), HumanBytes(total), ratio,
        m.quant ? fmt::format("{} ", DTypeTorchName(m.dtype)) : std::string(),
        m.tie_word_embeddings && map.spec.pp > 1 ? ", the embedding on two stages" : "",
        m.quant ? "; below by the 1-byte FP8 weights" : "");
  } else {
    out += fmt::format("\n{} of {} ranks shown, holding {} ({:.2f}% of the checkpoint)\n",
                       ranks.size(), map.ranks.size(), HumanBytes(total), 100.0 * ratio);
  }
  return out;
}

namespace {
nlohmann::ordered_json RegionJson(const std::vector<int64_t>& v) { return v; }

}  // namespace

std::string ShardMapToJson(const ShardMap& map, const std::vector<const EngineRankShards*>& ranks) {
  using nlohmann::ordered_json;
  ordered_json j;
  j["model"] = map.model.name;
  j["engine"] = EngineKindName(map.spec.engine);
  j["tp"] = map.spec.tp;
  j["pp"] = map.spec.pp;
  j["ep"] = map.spec.ep;
  ordered_json rs = ordered_json::array();
  for (const EngineRankShards* r : ranks) {
    ordered_json rj;
    rj["tp_rank"] = r->tp_rank;
    rj["pp_rank"] = r->pp_rank;
    rj["moe_ep_rank"] = r->moe_ep_rank;
    rj["moe_tp_rank"] = r->moe_tp_rank;
    rj["layers"] = {r->layer_start, r->layer_end};
    ordered_json ps = ordered_json::array();
    for (const auto& p : r->params) {
      ordered_json pj;
      pj["name"] = p.name;
      pj["shape"] = p.shape;
      pj["dtype"] = DTypeTorchName(p.dtype);
      ordered_json pieces = ordered_json::array();
      for (const auto& pc : p.pieces) {
        pieces.push_back(ordered_json{{"source", pc.source},
                                      {"src_offset", RegionJson(pc.src.offsets())},
                                      {"dst_offset", RegionJson(pc.dst.offsets())},
                                      {"extent", RegionJson(pc.dst.extents())}});
      }
      pj["pieces"] = std::move(pieces);
      ordered_json zf = ordered_json::array();
      for (const auto& z : p.zero_fills) {
        zf.push_back(ordered_json{{"offset", RegionJson(z.dst.offsets())},
                                  {"extent", RegionJson(z.dst.extents())}});
      }
      pj["zero_fill"] = std::move(zf);
      ps.push_back(std::move(pj));
    }
    rj["params"] = std::move(ps);
    rs.push_back(std::move(rj));
  }
  j["ranks"] = std::move(rs);
  // The model name is the config path for file models, which need not be UTF-8; a strict dump
  // would throw (and abort the CLI). Invalid bytes become U+FFFD instead.
  return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace) + "\n";
}

// Where every byte of engine parameter `name` comes from, on each selected rank holding it. For an
// HF tensor name instead, where its bytes go.
Result<std::string> ExplainParamOnRanks(const ShardMap& map,
                                        const std::vector<const EngineRankShards*>& ranks,
                                        std::string_view name) {
  std::string out;
  for (const EngineRankShards* r : ranks) {
    if (FindParam(*r, name) == nullptr) continue;
    SS_ASSIGN_OR_RETURN(std::string e, ExplainParam(map, *r, name));
    out += e;
  }
  if (!out.empty()) return out;
  // Not an engine parameter: maybe an HF tensor name.
  for (const EngineRankShards* r : ranks) {
    for (const auto& p : r->params) {
      for (const auto& pc : p.pieces) {
        if (pc.source != name) continue;
        out +=
            fmt::format("{} rank (tp {}, pp {}): {}{} <- {}{}\n", EngineKindName(map.spec.engine),
                        r->tp_rank, r->pp_rank, p.name, pc.dst.ToString(), name, pc.src.ToString());
      }
    }
  }
  if (!out.empty()) {
    return fmt::format("'{}' is an HF tensor, not an engine parameter; its bytes land in:\n{}",
                       name, out);
  }
  return NotFoundError(fmt::format(
      "--explain: no selected rank holds an engine parameter or HF tensor named '{}' (engine "
      "names look like model.layers.0.self_attn.qkv_proj.weight; see --json)",
      name));
}

std::vector<const EngineRankShards*> AllRanks(const ShardMap& map) {
  std::vector<const EngineRankShards*> out;
  for (const auto& r : map.ranks) out.push_back(&r);
  return out;
}

}  // namespace shardsync
