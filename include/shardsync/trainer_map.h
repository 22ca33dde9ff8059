// Trainer map: the trainer-side analogue of the engine shard map. For every trainer sync rank, the
// local parameters it holds, named as its framework names them, and for each the regions of HF
// tensors it carries and where they sit inside the parameter. Pure and deterministic.
//
// FSDP / HSDP / replicate / single are the trivial case: one local parameter per HF tensor, named
// like it, holding the rank's dim-0 chunk as one piece. Megatron-Core layouts follow Megatron's
// own rules (docs/megatron.md states each with the Megatron-Core file and function it comes from).
// The builders live in plan.h (they take a TrainerSpec).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/region.h"

namespace shardsync {

// A Megatron-Core parallel layout: "megatron=tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,cp=C][,dp=D]
// [,first=N][,last=M][,vocab_div=K][,experts=grouped|sequential][,norms=te|local]
// [,glu_interleave=G]".
//
// World = tp*cp*dp*pp; the expert grid is etp x ep x edp x pp with edp = world / (etp*ep*pp).
// Trainer sync rank = Megatron global rank (parallel_state.py RankGenerator, default order
// tp-cp-ep-dp-pp): dense rank = tp + T*(cp + C*(dp + D*pp)); expert rank = etp + X*(ep + E*(edp +
// EDP*pp)).
struct MegatronLayout {
  int tp = 1;
  int pp = 1;
  int vpp = 1;  // model chunks per pipeline rank (virtual_pipeline_model_parallel_size; 1: none)
  int cp = 1;   // context parallel: ranks hold identical parameters
  int dp = 1;   // data parallel of the dense grid (Megatron's data_parallel_size)
  int ep = 1;   // expert_model_parallel_size
  int etp = 1;  // expert_tensor_parallel_size (parsed default: tp, as in Megatron)
  // decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers; 0: not set.
  int64_t first = 0;
  int64_t last = 0;
  int vocab_div = 128;  // make_vocab_size_divisible_by (padding multiple: vocab_div*tp)
  // SequentialMLP names instead of TEGroupedMLP's weight{i}. The local spec builds only
  // SequentialMLP (models/backends.py LocalSpecProvider.grouped_mlp_modules), so local_norms
  // implies it.
  bool sequential_experts = false;
  bool local_norms = false;  // local spec norm names instead of TE fused layer_norm_weight
  // moe_mlp_glu_interleave_size (TEGroupedMLP): each expert's local linear_fc1 rows are blocks of
  // G gate rows then G up rows instead of [gate; up]. 0: not set.
  int glu_interleave = 0;

  int world() const { return tp * cp * dp * pp; }
  int expert_dp() const { return world() / (etp * ep * pp); }
  // Canonical spelling: "megatron=tp=T,pp=P" plus every field that differs from its default
  // (etp when it differs from tp; experts when it differs from what the norms imply), in the
  // order of the grammar above.
  std::string ToString() const;
};

// Coordinates of one Megatron rank in the dense and the expert grid.
struct MegatronCoords {
  int tp = 0, cp = 0, dp = 0, pp = 0;  // dense grid
  int etp = 0, ep = 0, edp = 0;        // expert grid (same pp)
};
MegatronCoords MegatronRankCoords(const MegatronLayout& m, int rank);
// Global rank of dense-grid coordinates / of expert-grid coordinates.
int MegatronDenseRank(const MegatronLayout& m, int tp, int cp, int dp, int pp);
int MegatronExpertRank(const MegatronLayout& m, int etp, int ep, int edp, int pp);

// Bytes of one HF tensor inside a local parameter: `src` in the HF tensor, `local` in the
// parameter, same extents (a box translation).
struct TrainerPiece {
  std::string source;  // HF tensor name
  Region src;
  Region local;
};

struct TrainerParam {
  // Megatron: the local name inside its model chunk, as the chunk's named_parameters() gives it
  // without wrapper prefixes ("decoder.layers.0.self_attention.linear_qkv.weight"); FSDP-like: the
  // HF name.
  std::string name;
  int chunk = 0;  // virtual pipeline model chunk (0 without VPP)
  Shape shape;    // local shape
  DType dtype = DType::kF32;
  // HF bytes it holds. Elements no piece covers hold no HF byte (padded vocab rows at the tail).
  std::vector<TrainerPiece> pieces;
  int64_t numel() const { return NumElements(shape); }
};

struct TrainerRankParams {
  int rank = 0;
  bool megatron = false;
  MegatronCoords coords;  // megatron only
  // Megatron: chunk by chunk, each in the chunk's named_parameters() order; FSDP-like: HF
  // inventory order (a rank whose dim-0 chunk is empty keeps the parameter with no piece).
  std::vector<TrainerParam> params;
};

}  // namespace shardsync
