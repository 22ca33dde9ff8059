// Job-wide summary from the analytic (trainer, engine) pair stream, placement and cost model,
// heatmap rendering.
#include <fmt/format.h>
#include <algorithm>
#include <cmath>

#include "plan/planner.h"

namespace shardsync {

int ResolvedPlacement::TrainerNode(int rank) const { return rank / gpus_per_node; }

int ResolvedPlacement::EngineNode(int engine_index, int trainer_world) const {
  return (colocated ? engine_index : trainer_world + engine_index) / gpus_per_node;
}

Result<ResolvedPlacement> ResolvePlacement(const PlanInputs& in, const Placement& p) {
  if (p.gpus_per_node < 1) {
    return InvalidArgumentError(
        fmt::format("--gpus-per-node: must be positive, got {}", p.gpus_per_node));
  }
  if (p.nodes < 0)
    return InvalidArgumentError(fmt::format("--nodes: must be positive, got {}", p.nodes));
  if (!(p.intra_node_gbps > 0) || !(p.inter_node_gbps > 0)) {
    return InvalidArgumentError(fmt::format("--{}-node-gbps: bandwidth must be positive",
                                            p.intra_node_gbps > 0 ? "inter" : "intra"));
  }
  ResolvedPlacement r;
  r.gpus_per_node = p.gpus_per_node;
  const int64_t S = in.trainer.world(), E = in.rollout.world();
  r.colocated = S == E;
  const int64_t need = r.colocated ? S : S + E;
  const int64_t need_nodes = (need + p.gpus_per_node - 1) / p.gpus_per_node;
  if (p.nodes == 0) {
    r.nodes = static_cast<int>(need_nodes);
  } else if (p.nodes < need_nodes) {
    return InvalidArgumentError(fmt::format(
        "--nodes: {} nodes x {} GPUs hold {} GPUs, the job needs {} ({})", p.nodes, p.gpus_per_node,
        static_cast<int64_t>(p.nodes) * p.gpus_per_node, need,
        r.colocated ? "trainer and rollout colocated" : "trainer and rollout placed separately"));
  } else {
    r.nodes = p.nodes;
  }
  return r;
}

namespace plan_internal {

Result<DetailedSummary> PlanContext::Summarize(const SummaryOptions& opts) const {
  if (!copy_) return NotCopyPlan();
  DetailedSummary ds;
  SS_ASSIGN_OR_RETURN(ds.placement, ResolvePlacement(in_, opts.placement));
  if (opts.heatmap_max_blocks < 1) {
    return InvalidArgumentError("heatmap_max_blocks: must be positive");
  }
  PlanSummary& sum = ds.summary;
  sum.plan_hash = hash_;
  const int ER = D_ * E_;
  sum.trainer_ranks.resize(S_world_);
  for (int t = 0; t < S_world_; ++t) sum.trainer_ranks[t].rank = t;
  ds.trainer_traffic.resize(S_world_);
  ds.engine_traffic.resize(ER);
  // Owned bytes per engine rank of a replica: its parameters minus zero-fills, in wire dtype.
  std::vector<int64_t> owned(E_, 0);
  for (int e = 0; e < E_; ++e) {
    for (const EngineParam& prm : map_.ranks[e].params) {
      int64_t n = prm.numel();
      for (const ZeroFill& z : prm.zero_fills) n -= z.dst.numel();
      owned[e] += n * wire_;
    }
  }
  sum.engine_ranks.resize(ER);
  for (int j = 0; j < ER; ++j) {
    EngineRankSummary& er = sum.engine_ranks[j];
    er.replica = j / E_;
    er.pp_rank = (j % E_) / in_.rollout.shard.tp;
    er.tp_rank = j % in_.rollout.shard.tp;
    er.owned_bytes = owned[j % E_];
  }
  Heatmap& hm = ds.heatmap;
  hm.trainer_ranks = S_world_;
  hm.engine_ranks = ER;
  hm.trainer_block = (S_world_ + opts.heatmap_max_blocks - 1) / opts.heatmap_max_blocks;
  hm.engine_block = (ER + opts.heatmap_max_blocks - 1) / opts.heatmap_max_blocks;
  hm.rows = (S_world_ + hm.trainer_block - 1) / hm.trainer_block;
  hm.cols = (ER + hm.engine_block - 1) / hm.engine_block;
  hm.bytes.assign(static_cast<size_t>(hm.rows) * hm.cols, 0);
  const ResolvedPlacement& pl = ds.placement;
  const int N = pl.nodes;
  if (N <= DetailedSummary::kMaxNodePairNodes)
    ds.node_pair_bytes.assign(static_cast<size_t>(N) * N, 0);
  ForEachPair([&](int t, int sync_rank, int64_t bytes, int64_t ops) {
    const int j = sync_rank - S_world_;
    sum.ops += ops;
    sum.messages += 1;
    sum.total_bytes += bytes;
    sum.trainer_ranks[t].send_bytes += bytes;
    sum.engine_ranks[j].recv_bytes += bytes;
    RankTraffic& tt = ds.trainer_traffic[t];
    RankTraffic& et = ds.engine_traffic[j];
    tt.ops += ops;
    tt.messages += 1;
    et.ops += ops;
    et.messages += 1;
    const int tn = pl.TrainerNode(t), en = pl.EngineNode(j, S_world_);
    if (!ds.node_pair_bytes.empty()) ds.node_pair_bytes[static_cast<size_t>(tn) * N + en] += bytes;
    if (tn == en) {
      tt.intra_node_bytes += bytes;
      et.intra_node_bytes += bytes;
    }
    hm.bytes[static_cast<size_t>(t / hm.trainer_block) * hm.cols + j / hm.engine_block] += bytes;
  });
  int64_t B = 0;
  for (const HfTensor& t : inv_) B += t.numel() * wire_;
  sum.broadcast_recv_bytes_per_rank = B;

  // Cost: every GPU has one NVLink port and one NIC share, each per direction; a rank's time is
  // its heaviest directional link; the job's is the slowest rank's.
  const double intra = opts.placement.intra_node_gbps * 1e9;
  const double inter = opts.placement.inter_node_gbps * 1e9;
  double worst = 0;
  for (int t = 0; t < S_world_; ++t) {
    const RankTraffic& tt = ds.trainer_traffic[t];
    const int64_t far = sum.trainer_ranks[t].send_bytes - tt.intra_node_bytes;
    worst = std::max({worst, tt.intra_node_bytes / intra, far / inter});
  }
  for (int j = 0; j < ER; ++j) {
    const RankTraffic& et = ds.engine_traffic[j];
    const int64_t far = sum.engine_ranks[j].recv_bytes - et.intra_node_bytes;
    worst = std::max({worst, et.intra_node_bytes / intra, far / inter});
  }
  CostEstimate& c = ds.cost;
  c.seconds = worst;
  c.model_bytes = B;
  // Broadcast-all: every engine rank receives all B bytes from trainer rank 0. Modelled as a
  // pipelined (ring/tree) broadcast, the most generous reading: each rank's receive link carries B,
  // over the NIC as soon as any engine rank sits off trainer rank 0's node.
  bool off_node = false;
  for (int j = 0; j < ER && !off_node; ++j)
    off_node = pl.EngineNode(j, S_world_) != pl.TrainerNode(0);
  c.broadcast_seconds = B / (off_node ? inter : intra);
  // Lower bound at the fastest link: each engine rank must receive its share B/(T*P), each trainer
  // rank on average D*B/S.
  const double per_engine = static_cast<double>(B) / E_;
  const double per_trainer = static_cast<double>(D_) * B / S_world_;
  c.lower_bound_seconds = std::max(per_engine, per_trainer) / intra;
  return ds;
}

}  // namespace plan_internal

std::string HeatmapSvg(const DetailedSummary& s, std::string_view title) {
  const Heatmap& h = s.heatmap;
  const int cell = std::clamp(640 / std::max({h.rows, h.cols, 1}), 4, 40);
  // Engine columns are labelled "r<replica> tp<t> pp<p>" written downwards below the grid.
  const int left = 110, top = 60, legend_w = 260, col_labels = 78;
  const int W = left + h.cols * cell + 40, H = top + h.rows * cell + 110 + col_labels;
  const std::string subtitle = fmt::format(
      "bytes sent, trainer rank (rows, {} per block) x engine rank (columns, {} per block)",
      h.trainer_block, h.engine_block);
  // Wide enough for the title (14 px) and the subtitle (11 px) at about 0.6 em per character, so
  // neither is clipped on a narrow grid (issue 36).
  const int text_w =
      12 + static_cast<int>(std::max(title.size() * 8.4, subtitle.size() * 6.6)) + 20;
  const int width = std::max({W, left + legend_w + 40, text_w});
  int64_t vmax = 0;
  for (int64_t b : h.bytes) vmax = std::max(vmax, b);
  auto color = [&](int64_t b) {
    if (b <= 0) return std::string("#ffffff");
    // Linear in bytes: white -> dark blue.
    const double f = vmax > 0 ? static_cast<double>(b) / vmax : 0;
    const int r = static_cast<int>(std::lround(255 - f * (255 - 8)));
    const int g = static_cast<int>(std::lround(255 - f * (255 - 48)));
    const int bl = static_cast<int>(std::lround(255 - f * (255 - 107)));
    return fmt::format("#{:02x}{:02x}{:02x}", r, g, bl);
  };
  auto human = [](double b) {
    const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024 && i < 4) {
      b /= 1024;
      ++i;
    }
    return fmt::format("{:.3g} {}", b, u[i]);
  };
  std::string o;
  o += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n",
      width, H);
  o += fmt::format("<rect width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", width, H);
  std::string esc;
  for (char ch : title) {
    if (ch == '<')
      esc += "&lt;";
    else if (ch == '>')
      esc += "&gt;";
    else if (ch == '&')
      esc += "&amp;";
    else
      esc += ch;
  }
  o += fmt::format("<text x=\"12\" y=\"20\" font-size=\"14\">{}</text>\n", esc);
  o += fmt::format("<text x=\"12\" y=\"40\">{}</text>\n", subtitle);
  for (int r = 0; r < h.rows; ++r) {
    for (int c = 0; c < h.cols; ++c) {
      const int64_t b = h.bytes[static_cast<size_t>(r) * h.cols + c];
      o += fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"#dddddd\" "
          "stroke-width=\"0.5\"><title>trainer {}-{} -> engine {}-{}: {}</title></rect>\n",
          left + c * cell, top + r * cell, cell, cell, color(b), r * h.trainer_block,
          std::min(h.trainer_ranks, (r + 1) * h.trainer_block) - 1, c * h.engine_block,
          std::min(h.engine_ranks, (c + 1) * h.engine_block) - 1, human(static_cast<double>(b)));
    }
  }
  // Axis tick labels: about 8 per axis.
  const int rstep = std::max(1, h.rows / 8), cstep = std::max(1, h.cols / 8);
  for (int r = 0; r < h.rows; r += rstep) {
    o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">t{}</text>\n", left - 4,
                     top + r * cell + cell / 2 + 4, r * h.trainer_block);
  }
  const std::vector<EngineRankSummary>& er = s.summary.engine_ranks;
  for (int c = 0; c < h.cols; c += cstep) {
    const int j = c * h.engine_block;  // the block's first engine rank
    const std::string label =
        j < static_cast<int>(er.size())
            ? fmt::format("r{} tp{} pp{}", er[j].replica, er[j].tp_rank, er[j].pp_rank)
            : fmt::format("e{}", j);
    const int x = left + c * cell + cell / 2 + 4, y = top + h.rows * cell + 6;
    o += fmt::format(
        "<text x=\"{}\" y=\"{}\" transform=\"rotate(90 {} {})\" text-anchor=\"start\">{}</text>\n",
        x, y, x, y, label);
  }
  o += fmt::format(
      "<text x=\"12\" y=\"{}\" transform=\"rotate(-90 12 {})\" text-anchor=\"middle\">trainer "
      "rank</text>\n",
      top + h.rows * cell / 2, top + h.rows * cell / 2);
  o += fmt::format(
      "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">engine rank: replica, tp, pp (sync rank "
      "- {})</text>\n",
      left + h.cols * cell / 2, top + h.rows * cell + col_labels + 18, h.trainer_ranks);
  // Legend.
  const int ly = top + h.rows * cell + col_labels + 36;
  o += "<defs><linearGradient id=\"g\"><stop offset=\"0\" stop-color=\"#ffffff\"/>"
       "<stop offset=\"1\" stop-color=\"#08306b\"/></linearGradient></defs>\n";
  o += fmt::format(
      "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"12\" fill=\"url(#g)\" stroke=\"#999999\"/>\n",
      left, ly, legend_w - 60);
  o += fmt::format("<text x=\"{}\" y=\"{}\">0</text>\n", left, ly + 26);
  o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{} per block</text>\n",
                   left + legend_w - 60, ly + 26, human(static_cast<double>(vmax)));
  o += "</svg>\n";
  return o;
}

}  // namespace shardsync
