// `shardsync shards`: which bytes of which HF tensor every engine rank (tp, pp) owns, under the
// SGLang or vLLM loading rules.
#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "command.h"
#include "shardsync/shard_map.h"

namespace shardsync::cli {
namespace {

struct ShardsOptions {
  std::string model;
  std::string engine;
  int tp = 1;
  int pp = 1;
  int ep = 1;
  std::string pp_partition;
  bool json = false;
  std::string rank;
  std::string explain;
};

std::string HumanBytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

std::string HumanCount(int64_t n) {
  if (n >= 1000000000) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1000000) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1000) return fmt::format("{:.1f}K", n / 1e3);
  return std::to_string(n);
}

// "--rank 1,0" -> (tp 1, pp 0).
Result<std::pair<int, int>> ParseRank(const std::string& s, const ShardSpec& spec) {
  const auto comma = s.find(',');
  int tp = -1, pp = -1;
  char tail = 0;
  if (comma == std::string::npos || std::sscanf(s.c_str(), "%d,%d%c", &tp, &pp, &tail) != 2) {
    return InvalidArgumentError(fmt::format("--rank: '{}' is not TP_RANK,PP_RANK (e.g. 1,0)", s));
  }
  if (tp < 0 || tp >= spec.tp || pp < 0 || pp >= spec.pp) {
    return InvalidArgumentError(
        fmt::format("--rank {}: outside tp [0, {}) x pp [0, {})", s, spec.tp, spec.pp));
  }
  return std::make_pair(tp, pp);
}

std::string ToTable(const ShardMap& map, const std::vector<const EngineRankShards*>& ranks) {
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
  out += fmt::format(
      "\n{} ranks hold {} ({:.2f}x the checkpoint: replicated norms, router, kv "
      "heads, vocab padding{})\n",
      ranks.size(), HumanBytes(total),
      model_bytes > 0 ? static_cast<double>(total) / model_bytes : 0.0,
      m.tie_word_embeddings && map.spec.pp > 1 ? ", embedding on two stages" : "");
  return out;
}

nlohmann::ordered_json RegionJson(const std::vector<int64_t>& v) { return v; }

std::string ToJson(const ShardMap& map, const std::vector<const EngineRankShards*>& ranks) {
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
  return j.dump() + "\n";
}

// Where every byte of engine parameter `name` comes from, on each selected rank holding it. For an
// HF tensor name instead, where its bytes go.
Result<std::string> Explain(const ShardMap& map, const std::vector<const EngineRankShards*>& ranks,
                            const std::string& name) {
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

Result<std::string> Run(const ShardsOptions& o) {
  SS_ASSIGN_OR_RETURN(ModelSpec model, LoadModelSpec(o.model));
  ShardSpec spec;
  SS_ASSIGN_OR_RETURN(spec.engine, ParseEngineKind(o.engine, "--engine"));
  spec.tp = o.tp;
  spec.pp = o.pp;
  spec.ep = o.ep;
  if (!o.pp_partition.empty()) {
    SS_ASSIGN_OR_RETURN(spec.pp_partition, ParsePpPartition(o.pp_partition, "--pp-partition"));
  }
  SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(model, spec));
  std::vector<const EngineRankShards*> ranks;
  if (!o.rank.empty()) {
    SS_ASSIGN_OR_RETURN(auto tp_pp, ParseRank(o.rank, spec));
    ranks.push_back(&map.rank(tp_pp.first, tp_pp.second));
  } else {
    for (const auto& r : map.ranks) ranks.push_back(&r);
  }
  if (!o.explain.empty()) return Explain(map, ranks, o.explain);
  if (o.json) return ToJson(map, ranks);
  return ToTable(map, ranks);
}

Registration reg({"shards", [](CLI::App& app) {
                    auto o = std::make_shared<ShardsOptions>();
                    auto* sub = app.add_subcommand(
                        "shards",
                        "Which bytes of which HF tensor every engine rank (tp, pp) owns, under the "
                        "SGLang or vLLM loading rules");
                    sub->add_option("--model", o->model,
                                    "Embedded model name (qwen3-8b, ...) or a config.json path or "
                                    "directory")
                        ->required();
                    sub->add_option("--engine", o->engine, "sglang | vllm")->required();
                    sub->add_option("--tp", o->tp, "Tensor-parallel size (default 1)");
                    sub->add_option("--pp", o->pp, "Pipeline-parallel size (default 1)");
                    sub->add_option("--ep", o->ep,
                                    "Expert-parallel size (SGLang --ep-size; vLLM: 1, or tp with "
                                    "--enable-expert-parallel); default 1");
                    sub->add_option("--pp-partition", o->pp_partition,
                                    "Explicit layers per stage, e.g. 9,10,9 "
                                    "(SGLANG_PP_LAYER_PARTITION / VLLM_PP_LAYER_PARTITION)");
                    auto* json = sub->add_flag("--json", o->json,
                                               "Print one JSON object (schema: docs/cli.md)");
                    sub->add_option("--rank", o->rank, "Only rank TP_RANK,PP_RANK");
                    sub->add_option("--explain", o->explain,
                                    "Say where every byte of this engine parameter comes from")
                        ->excludes(json);
                    return [o] {
                      Result<std::string> out = Run(*o);
                      if (!out.ok()) return ReportError(out.status());
                      std::fwrite(out->data(), 1, out->size(), stdout);
                      return kExitOk;
                    };
                  }});

}  // namespace
}  // namespace shardsync::cli
