"""What a Megatron-Core rank's own objects say, checked against the plan's layout before a byte
moves (docs/megatron.md, "What bind checks").

Three sources, each optional (a mapping of tensors carries none of them):
- the model's TransformerConfig (`chunk.config` of GPTModel: parallel sizes, pipeline split and
  the settings that keep names and shapes but change what the stored bytes mean);
- the modules' parameter names, which say which spec built them (Transformer-Engine or local
  norms; TEGroupedMLP, SequentialMLP or the legacy GroupedMLP experts);
- the rank's coordinates from `megatron.core.parallel_state` (or the chunk's `pg_collection`),
  which must be the layout's (the default rank order tp-cp-ep-dp-pp).

Every rule cites the Megatron-Core file and symbol it comes from (NVIDIA/Megatron-LM main at
d98e8a6, 2026-08; tags core_v0.13.0 .. core_v0.19.0 where a rule depends on the release).
Duck-typed: torch and Megatron are never imported here except `megatron.core.parallel_state`,
and only when the caller asks for "auto" and it is importable.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from .errors import InvalidArgumentError

__all__ = ["unwrap_chunk", "chunk_config", "check_spec", "check_config", "check_coords"]

# DDP / Float16Module / torch.compile wrappers keep the model in `.module` / `._orig_mod`.
_WRAPPER_ATTRS = ("module", "_orig_mod")


def unwrap_chunk(chunk: Any) -> Any:
    """The model inside DDP / Float16Module / torch.compile wrappers (Megatron's unwrap_model)."""
    for _ in range(8):
        if isinstance(chunk, Mapping):
            return chunk
        inner = None
        for a in _WRAPPER_ATTRS:
            inner = getattr(chunk, a, None)
            if inner is not None:
                break
        if inner is None:
            return chunk
        chunk = inner
    return chunk


def chunk_config(chunks: Sequence[Any]) -> Optional[Any]:
    """The TransformerConfig the chunks were built with (MegatronModule.config), or None."""
    for c in chunks:
        cfg = getattr(unwrap_chunk(c), "config", None)
        if cfg is not None and hasattr(cfg, "tensor_model_parallel_size"):
            return cfg
    return None


# ---- the spec, from the parameter names ----

# models/gpt/gpt_layer_specs.py: the TE spec fuses input_layernorm into linear_qkv
# (TELayerNormColumnParallelLinear: `layer_norm_weight`); the local spec
# (get_gpt_layer_local_submodules) keeps `input_layernorm` as its own module.
_TE_NORM = re.compile(r"(^|\.)self_attention\.linear_qkv\.layer_norm_weight$")
_LOCAL_NORM = re.compile(r"(^|\.)input_layernorm\.weight$")
# transformer/moe/experts.py: TEGroupedMLP registers linear_fc1.weight{i} per local expert
# (TEGroupedLinear); SequentialMLP local_experts.{i}.linear_fc1.weight; the legacy GroupedMLP
# (core 0.13-0.16 with moe_grouped_gemm: models/backends.py LocalSpecProvider.grouped_mlp_modules,
# or extensions/transformer_engine_spec_provider.py TESpecProvider.grouped_mlp_modules with
# moe_use_legacy_grouped_gemm; experts.py GroupedMLP.__init__ at core_v0.16.0 3bec9aa) weight1
# [hidden, experts*2*ffn/etp] / weight2, the experts transposed and concatenated;
# moe_single_grouped_weight (main) one `linear_fc1.weight` for all experts.
_GROUPED = re.compile(r"(^|\.)mlp\.experts\.linear_fc[12]\.weight\d+$")
_SEQUENTIAL = re.compile(r"(^|\.)mlp\.experts\.local_experts\.\d+\.linear_fc[12]\.weight$")
_LEGACY = re.compile(r"(^|\.)mlp\.experts\.weight[12]$")
_SINGLE = re.compile(r"(^|\.)mlp\.experts\.linear_fc[12]\.weight$")


def _first(names: Sequence[Tuple[int, str]], pat: "re.Pattern[str]") -> Optional[Tuple[int, str]]:
    for c, n in names:
        if pat.search(n):
            return c, n
    return None


def check_spec(layout: Mapping[str, Any], spec: str, names: Sequence[Tuple[int, str]]) -> None:
    """The spec the parameter names show (norms, experts) against the layout's, naming the
    parameter that shows it."""
    legacy = _first(names, _LEGACY)
    if legacy:
        raise InvalidArgumentError(
            f"model chunk {legacy[0]}: '{legacy[1]}' is the legacy GroupedMLP (Megatron-Core "
            "0.13-0.16 with moe_grouped_gemm: the local spec, or the TE spec with "
            "moe_use_legacy_grouped_gemm; models/backends.py LocalSpecProvider / "
            "TESpecProvider.grouped_mlp_modules), which stores the experts transposed and "
            "concatenated ([hidden, experts * 2 * ffn / etp]); not supported: build the experts "
            "as SequentialMLP (moe_grouped_gemm=False, layout norms=local) or with the "
            "Transformer-Engine spec (TEGroupedMLP)"
        )
    single = _first(names, _SINGLE)
    if single:
        raise InvalidArgumentError(
            f"model chunk {single[0]}: '{single[1]}' is one weight for every local expert "
            "(TransformerConfig.moe_single_grouped_weight); not supported: the layout maps "
            "TEGroupedMLP's per-expert linear_fc1.weight{i} / linear_fc2.weight{i}"
        )
    te, local = _first(names, _TE_NORM), _first(names, _LOCAL_NORM)
    if te and layout["norms"] != "te":
        raise InvalidArgumentError(
            f"model chunk {te[0]}: '{te[1]}' shows the Transformer-Engine spec (fused "
            f"TELayerNormColumnParallelLinear) but the layout {spec} says norms=local: drop "
            "norms=local"
        )
    if local and not te and layout["norms"] != "local":
        raise InvalidArgumentError(
            f"model chunk {local[0]}: '{local[1]}' shows the local spec "
            f"(get_gpt_layer_local_submodules: input_layernorm is its own module) but the layout "
            f"{spec} says norms=te: add norms=local"
        )
    grouped, seq = _first(names, _GROUPED), _first(names, _SEQUENTIAL)
    if grouped and layout["experts"] != "grouped":
        raise InvalidArgumentError(
            f"model chunk {grouped[0]}: '{grouped[1]}' shows TEGroupedMLP experts but the layout "
            f"{spec} says experts=sequential (SequentialMLP)"
        )
    if seq and layout["experts"] != "sequential":
        raise InvalidArgumentError(
            f"model chunk {seq[0]}: '{seq[1]}' shows SequentialMLP experts but the layout {spec} "
            "says experts=grouped (TEGroupedMLP): add experts=sequential"
        )


# ---- the TransformerConfig ----

# (TransformerConfig field, layout key, the value Megatron uses when the field is None)
_SIZES = (
    ("tensor_model_parallel_size", "tp", None),
    ("pipeline_model_parallel_size", "pp", None),
    ("virtual_pipeline_model_parallel_size", "vpp", 1),
    ("context_parallel_size", "cp", None),
    ("expert_model_parallel_size", "ep", None),
    # parallel_state.py initialize_model_parallel: expert_tensor_parallel_size defaults to tp.
    ("expert_tensor_parallel_size", "etp", "tp"),
    # transformer_config.py: decoder_first/last_pipeline_num_layers as config fields.
    ("num_layers_in_first_pipeline_stage", "first", 0),
    ("num_layers_in_last_pipeline_stage", "last", 0),
)


def _cfg(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def check_config(layout: Mapping[str, Any], spec: str, cfg: Any, model: Any,
                 experts_grouped: bool) -> None:
    """The chunks' TransformerConfig against the layout and the plan's model: every parallel
    size, the pipeline split, and each setting that changes what the stored bytes mean."""
    for field, key, default in _SIZES:
        v = _cfg(cfg, field)
        if v is None:
            v = layout["tp"] if default == "tp" else default
        if v is None:
            continue
        if int(v) != int(layout[key]):
            raise InvalidArgumentError(
                f"TransformerConfig.{field} is {v} but the layout {spec} has {key}={layout[key]}"
            )
    # transformer_config.py: a custom pipeline_model_parallel_layout or counting the embedding /
    # loss as layers moves layers between stages (transformer_block.py get_num_layers_to_build).
    for field in ("account_for_embedding_in_pipeline_split",
                  "account_for_loss_in_pipeline_split"):
        if _cfg(cfg, field):
            raise InvalidArgumentError(
                f"TransformerConfig.{field} is set: it moves layers between pipeline stages; not "
                "supported (the layout's even split or first=/last=)"
            )
    if _cfg(cfg, "pipeline_model_parallel_layout") is not None:
        raise InvalidArgumentError(
            "TransformerConfig.pipeline_model_parallel_layout is set: a custom layer placement; "
            "not supported (the layout's even split or first=/last=)"
        )
    # transformer_config.py layernorm_zero_centered_gamma (--apply-layernorm-1p): TENorm /
    # TELayerNormColumnParallelLinear (extensions/transformer_engine.py, zero_centered_gamma) and
    # FusedLayerNorm (fusions/fused_layer_norm.py forward: `weight + 1`) compute with the stored
    # weight + 1, so every norm weight holds gamma - 1 (torch_norm.py WrappedTorchNorm refuses it).
    if _cfg(cfg, "layernorm_zero_centered_gamma"):
        raise InvalidArgumentError(
            "TransformerConfig.layernorm_zero_centered_gamma (--apply-layernorm-1p) is set: every "
            "norm weight is stored as gamma - 1 (TENorm / FusedLayerNorm add 1 in the forward) "
            "and shardsync sends parameters as stored, so the engines would get gamma - 1; not "
            "supported"
        )
    # transformer/moe/experts.py TEGroupedMLP: with moe_mlp_glu_interleave_size G and a gated
    # linear unit the forward de-interleaves fc1's output (_remove_glu_interleaving), so the
    # stored rows are blocks [gate G | up G]; SequentialMLP never reads the setting.
    g = _cfg(cfg, "moe_mlp_glu_interleave_size")
    if not (experts_grouped and _cfg(cfg, "gated_linear_unit", True)):
        g = None
    want = int(layout.get("glu_interleave", 0) or 0)
    if (g or 0) != want:
        if g:
            raise InvalidArgumentError(
                f"TransformerConfig.moe_mlp_glu_interleave_size is {g}: TEGroupedMLP stores each "
                f"expert's linear_fc1 rows as blocks [gate {g} | up {g}], but the layout {spec} "
                f"has {'glu_interleave=' + str(want) if want else 'no glu_interleave'}: set "
                f"glu_interleave={g}"
            )
        raise InvalidArgumentError(
            f"the layout {spec} has glu_interleave={want} but "
            "TransformerConfig.moe_mlp_glu_interleave_size is not set for TEGroupedMLP experts "
            "(their linear_fc1 rows are [gate; up]): drop glu_interleave"
        )
    if _cfg(cfg, "moe_single_grouped_weight"):
        raise InvalidArgumentError(
            "TransformerConfig.moe_single_grouped_weight is set (one weight for every local "
            "expert); not supported: the layout maps TEGroupedMLP's per-expert weights"
        )
    # The model the plan was made for: the dimensions the names and shapes hang on.
    if model is not None:
        for field, attr in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                            ("num_attention_heads", "num_attention_heads")):
            v, m = _cfg(cfg, field), getattr(model, attr, None)
            if v is not None and m is not None and int(v) != int(m):
                raise InvalidArgumentError(
                    f"TransformerConfig.{field} is {v} but the plan's model "
                    f"{getattr(model, 'name', '')} has {attr} {m}"
                )
        experts = int(getattr(model, "num_experts", 0) or 0)
        v = _cfg(cfg, "num_moe_experts")
        if (v or 0) != experts and not (v is None and experts == 0):
            raise InvalidArgumentError(
                f"TransformerConfig.num_moe_experts is {v} but the plan's model "
                f"{getattr(model, 'name', '')} has num_experts {experts}"
            )


# ---- the rank's coordinates ----

# (coordinate, parallel_state rank getter, world-size getter, pg_collection group)
_COORDS = (
    ("tp", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "tp"),
    ("cp", "get_context_parallel_rank", "get_context_parallel_world_size", "cp"),
    ("dp", "get_data_parallel_rank", "get_data_parallel_world_size", "dp"),
    ("pp", "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size", "pp"),
    ("etp", "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size",
     "expt_tp"),
    ("ep", "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size", "ep"),
    ("edp", "get_expert_data_parallel_rank", "get_expert_data_parallel_world_size", "expt_dp"),
)
_SIZE_KEY = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "etp": "etp", "ep": "ep",
             "edp": "edp"}


def parallel_state_of(arg: Any) -> Optional[Any]:
    """`parallel_state` as given, or with "auto" megatron.core.parallel_state when importable and
    initialized (model_parallel_is_initialized), else None."""
    if arg is None or arg is False:
        return None
    if arg != "auto":
        return arg
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        try:
            from megatron.core import parallel_state as ps  # type: ignore[no-redef]
        except Exception:  # noqa: BLE001 - not a Megatron process: nothing to read
            return None
    try:
        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


def _read(ps: Any, chunks: Sequence[Any]) -> Tuple[str, Dict[str, int], Dict[str, int]]:
    """(source, coords, sizes) from parallel_state, else from the first chunk's pg_collection."""
    coords: Dict[str, int] = {}
    sizes: Dict[str, int] = {}
    if ps is not None:
        for key, rank_fn, size_fn, _ in _COORDS:
            r, s = getattr(ps, rank_fn, None), getattr(ps, size_fn, None)
            if callable(r) and callable(s):
                coords[key], sizes[key] = int(r()), int(s())
        vpp = getattr(ps, "get_virtual_pipeline_model_parallel_world_size", None)
        if callable(vpp):
            sizes["vpp"] = int(vpp() or 1)
        return "megatron.core.parallel_state", coords, sizes
    for c in chunks:
        pg = getattr(unwrap_chunk(c), "pg_collection", None)
        if pg is None:
            continue
        for key, _, _, attr in _COORDS:
            g = getattr(pg, attr, None)
            if g is not None and callable(getattr(g, "rank", None)):
                coords[key], sizes[key] = int(g.rank()), int(g.size())
        return "the model chunk's pg_collection", coords, sizes
    return "", coords, sizes


def _fmt(d: Mapping[str, int], keys: Sequence[str]) -> str:
    return ", ".join(f"{k} {d[k]}" for k in keys if k in d)


def check_coords(plan: Any, layout: Mapping[str, Any], spec: str, rank: int, parallel_state: Any,
                 chunks: Sequence[Any]) -> Optional[str]:
    """The rank's Megatron coordinates against the layout's rank `rank`; returns where they were
    read (None: nowhere to read them). Also the global rank, when torch.distributed runs, and each
    chunk's vp_stage."""
    ps = parallel_state_of(parallel_state)
    where, coords, sizes = _read(ps, chunks)
    for v, c in enumerate(chunks):
        st = getattr(unwrap_chunk(c), "vp_stage", None)
        if st is not None and layout["vpp"] > 1 and int(st) != v:
            raise InvalidArgumentError(
                f"model chunk {v} was built for virtual pipeline stage {st} (GPTModel.vp_stage): "
                "pass the chunks in virtual-pipeline order, as get_model returns them"
            )
    if not where:
        return None
    for key, size in sizes.items():
        want = layout[_SIZE_KEY.get(key, key)]
        if size != int(want):
            raise InvalidArgumentError(
                f"trainer rank {rank}: {where} has {key} size {size} but the layout {spec} has "
                f"{key}={want}"
            )
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        g = int(dist.get_rank())
        if g != rank:
            raise InvalidArgumentError(
                f"trainer rank {rank}: this process is torch.distributed rank {g}; a Megatron "
                "trainer's sync rank is its global rank"
            )
    want = plan.trainer_coords(rank)
    keys = [k for k, *_ in _COORDS]
    if any(k in coords and coords[k] != want[k] for k in keys):
        raise InvalidArgumentError(
            f"trainer rank {rank}: {where} places it at ({_fmt(coords, keys)}) but the layout "
            f"{spec} places rank {rank} at ({_fmt(want, keys)}): the ranks are not numbered in "
            "Megatron's default order tp-cp-ep-dp-pp (--use-tp-pp-dp-mapping numbers them "
            "tp-cp-ep-pp-dp), which shardsync does not support; bound anyway, a middle pipeline "
            "stage would send another stage's layers"
        )
    return where

