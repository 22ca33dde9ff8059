"""Adapters between framework objects and sessions.

Trainer side: an FSDP2 module (or its state dict of DTensors: Shard(0) over a 1-d mesh, or
(Replicate(), Shard(0)) over a 2-d HSDP mesh) -> the trainer spec string and this rank's local
shards by HF name, checked against the plan; or a plain state dict (single source or replicated);
or a Megatron-Core rank's model chunks -> its local parameters by (chunk, local name), checked
against the plan's trainer map (docs/megatron.md).
Engine side: an engine's named_parameters() bound by the engine's names and local shapes,
checked against the shard map.

Duck-typed (DTensor is recognised by `to_local`, `placements`, `device_mesh`): torch is never
imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from . import megatron_checks as mc
from .errors import InvalidArgumentError, NotFoundError

__all__ = [
    "TrainerSources",
    "MegatronSources",
    "megatron_sources",
    "trainer_spec_of",
    "trainer_sources",
    "bind_trainer",
    "check_engine_params",
    "bind_engine",
    "default_rename",
]

_PREFIXES = ("_orig_mod.", "module.")  # torch.compile / DDP-style wrappers


def default_rename(name: str) -> str:
    """Strips wrapper prefixes (torch.compile `_orig_mod.`, `module.`) to reach the HF name."""
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if name.startswith(p):
                name = name[len(p) :]
                changed = True
        name = name.replace("._orig_mod.", ".")
    return name


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements") and hasattr(t, "device_mesh")


def _placement(p: Any) -> Tuple[str, Optional[int]]:
    is_shard = getattr(p, "is_shard", None)
    if callable(is_shard) and is_shard():
        return "shard", int(getattr(p, "dim"))
    is_rep = getattr(p, "is_replicate", None)
    if callable(is_rep) and is_rep():
        return "replicate", None
    return type(p).__name__.lower(), None


def _shape(t: Any) -> List[int]:
    return [int(d) for d in t.shape]


def _dtype_name(t: Any) -> str:
    """Canonical dtype name ("F32", "BF16") of a torch / numpy tensor."""
    from ._native import native

    name = str(t.dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    return native().parse_dtype(name)


def _state_dict(obj: Any) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    sd = getattr(obj, "state_dict", None)
    if callable(sd):
        return sd()
    raise InvalidArgumentError(
        f"expected a module with state_dict() or a mapping of tensors, got {type(obj).__name__}"
    )


def _dtensor_layout(name: str, t: Any) -> Tuple[str, int]:
    """(trainer spec, trainer rank) of one DTensor, or InvalidArgumentError naming it."""
    mesh = t.device_mesh
    shape = [int(s) for s in getattr(mesh, "shape", (mesh.size(),))]
    kinds = [_placement(p) for p in t.placements]
    desc = f"placements {kinds} over mesh {shape}"
    if len(shape) != len(kinds):
        raise InvalidArgumentError(f"tensor '{name}': {desc}: one placement per mesh dim expected")
    if len(shape) == 1:
        if kinds[0] == ("shard", 0):
            return f"fsdp={shape[0]}", int(mesh.get_local_rank(0))
        if kinds[0][0] == "replicate":
            return f"replicate={shape[0]}", int(mesh.get_local_rank(0))
    if len(shape) == 2 and kinds[0][0] == "replicate" and kinds[1] == ("shard", 0):
        g, s = int(mesh.get_local_rank(0)), int(mesh.get_local_rank(1))
        return f"hsdp={shape[0]}x{shape[1]}", g * shape[1] + s
    raise InvalidArgumentError(
        f"tensor '{name}': {desc} is not supported (Shard(0) over a 1-d mesh, (Replicate(), "
        "Shard(0)) over a 2-d mesh, or Replicate())"
    )


@dataclass
class TrainerSources:
    """This trainer rank's shards: HF name -> local tensor (row slab of the full tensor)."""

    spec: str  # "fsdp=4", "hsdp=2x4", "replicate=4", "single"
    rank: int  # trainer rank = sync rank
    tensors: Dict[str, Any] = field(default_factory=dict)
    full_shapes: Dict[str, List[int]] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)  # state-dict names with no HF tensor


def trainer_spec_of(module_or_state_dict: Any) -> Tuple[str, int]:
    """(trainer spec, trainer rank) from the DTensors of an FSDP2 module / state dict. Every
    DTensor must agree; a plain tensor among DTensors is an error naming it."""
    sd = _state_dict(module_or_state_dict)
    found: Optional[Tuple[str, int, str]] = None
    plain: Optional[str] = None
    for name, t in sd.items():
        if not _is_dtensor(t):
            plain = plain or name
            continue
        spec, rank = _dtensor_layout(name, t)
        if found is None:
            found = (spec, rank, name)
        elif (spec, rank) != found[:2]:
            raise InvalidArgumentError(
                f"tensor '{name}': layout {spec} (rank {rank}) differs from '{found[2]}': "
                f"{found[0]} (rank {found[1]})"
            )
    if found is None:
        raise InvalidArgumentError("state dict holds no DTensor: pass mode='single' or 'replicate'")
    if plain is not None:
        raise InvalidArgumentError(
            f"tensor '{plain}' is a plain tensor among DTensors ({found[0]}): shard it too or "
            "drop it from the state dict"
        )
    return found[0], found[1]


def trainer_sources(
    module_or_state_dict: Any,
    plan: Any = None,
    *,
    mode: str = "auto",
    rank: int = 0,
    world: int = 1,
    rename: Optional[Callable[[str], Optional[str]]] = None,
    strict: bool = False,
) -> TrainerSources:
    """This rank's sources from an FSDP2 module / state dict (mode "auto": DTensors) or a plain
    state dict (mode "single": rank 0 holds everything; "replicate": each of `world` ranks does).

    `rename` maps state-dict names to HF names (None skips one); default strips wrapper prefixes.
    With `plan`, checks the trainer spec, every full shape against the model, every local shape
    against the plan's held region, and that every HF tensor of the model is present. Names with
    no HF tensor are skipped (listed in .skipped), or an error when `strict`.
    """
    sd = _state_dict(module_or_state_dict)
    rename = rename or default_rename
    if mode == "auto":
        spec, trank = trainer_spec_of(sd)
    elif mode == "single":
        spec, trank = "single", rank
    elif mode == "replicate":
        spec, trank = f"replicate={world}", rank
    else:
        raise InvalidArgumentError(f"mode: must be auto, single or replicate, got {mode!r}")
    out = TrainerSources(spec=spec, rank=trank)
    for name, t in sd.items():
        hf = rename(name)
        if hf is None:
            out.skipped.append(name)
            continue
        if _is_dtensor(t):
            out.full_shapes[hf] = _shape(t)
            t = t.to_local()
        else:
            out.full_shapes[hf] = _shape(t)
        if hf in out.tensors:
            raise InvalidArgumentError(f"tensor '{name}': HF name '{hf}' appears twice")
        out.tensors[hf] = t
    if plan is not None:
        _check_against_plan(out, plan, strict)
    return out


def _check_against_plan(src: TrainerSources, plan: Any, strict: bool) -> None:
    from ._native import native

    want = native("plan").parse_trainer_spec(src.spec)
    if want != plan.trainer_spec:
        raise InvalidArgumentError(
            f"trainer layout: the module is {want} but the plan's trainer is {plan.trainer_spec}"
        )
    if src.rank >= plan.trainer_world:
        raise InvalidArgumentError(
            f"trainer rank {src.rank} outside the plan's trainer world {plan.trainer_world}"
        )
    model = {n: list(s) for n, s, _ in plan.hf_tensors()}
    extra = [n for n in src.tensors if n not in model]
    if extra and strict:
        raise InvalidArgumentError(
            f"{len(extra)} tensor(s) are not in model {plan.model.name}: {', '.join(extra[:5])}"
        )
    for n in extra:
        src.tensors.pop(n)
        src.full_shapes.pop(n, None)
        src.skipped.append(n)
    missing = [n for n in model if n not in src.tensors]
    if missing:
        raise NotFoundError(
            f"trainer rank {src.rank}: {len(missing)} HF tensor(s) of model {plan.model.name} "
            f"missing from the state dict: {', '.join(missing[:5])}"
        )
    for n, t in src.tensors.items():
        full = src.full_shapes[n]
        if full != model[n]:
            raise InvalidArgumentError(
                f"tensor '{n}': full shape {full}, the model says {model[n]}"
            )
        held = plan.held_region(src.rank, full)
        if _shape(t) != list(held.extent):
            raise InvalidArgumentError(
                f"tensor '{n}': local shard shape {_shape(t)} on trainer rank {src.rank}, the "
                f"plan's held region {held} has extents {list(held.extent)}"
            )
        dt = _dtype_name(t)
        if dt != plan.trainer_dtype:
            raise InvalidArgumentError(
                f"tensor '{n}': dtype {dt}, the plan's trainer dtype is {plan.trainer_dtype}"
            )


@dataclass
class MegatronSources:
    """A Megatron trainer rank's local parameters, bound by (model chunk, local name)."""

    spec: str  # the plan's trainer layout, "megatron=tp=2,pp=2"
    rank: int  # trainer rank = sync rank = torch.distributed rank
    tensors: Dict[Tuple[int, str], Any] = field(default_factory=dict)  # (chunk, name) -> tensor
    ignored: List[str] = field(default_factory=list)  # "chunk C: name" not in the trainer map
    # Where the rank's coordinates were read and checked ("megatron.core.parallel_state", "the
    # model chunk's pg_collection"), None when nothing carried them; whether a TransformerConfig
    # was checked.
    coords_from: Optional[str] = None
    config_checked: bool = False


def _named_parameters(chunk: Any, index: int) -> Iterable[Tuple[str, Any]]:
    if isinstance(chunk, Mapping):
        return chunk.items()
    named = getattr(chunk, "named_parameters", None)
    if callable(named):
        return named()
    raise InvalidArgumentError(
        f"model chunk {index}: expected a module with named_parameters() or a mapping of "
        f"tensors, got {type(chunk).__name__}"
    )


def megatron_sources(
    session_or_plan: Any,
    model_chunks: Any,
    *,
    rank: Optional[int] = None,
    rename: Optional[Callable[[str], Optional[str]]] = None,
    ignore_extra: bool = False,
    parallel_state: Any = "auto",
    config: Any = None,
) -> MegatronSources:
    """Matches a Megatron trainer rank's model chunks to its trainer map (the plan's
    `trainer_params(rank)`), checking everything before a byte moves.

    First what the rank's own objects say (megatron_checks.py, docs/megatron.md "What bind
    checks"): the spec the parameter names show (TE / local norms; TEGroupedMLP, SequentialMLP,
    or the refused legacy GroupedMLP) against the layout's norms / experts; the chunks'
    TransformerConfig (`config`, default `chunk.config`) against its parallel sizes and pipeline
    split, refusing by name the settings that change what stored bytes mean and the layout cannot
    express (layernorm_zero_centered_gamma, a custom pipeline layout) and requiring
    glu_interleave=G for TEGroupedMLP with moe_mlp_glu_interleave_size G; and the rank's
    coordinates from `parallel_state` ("auto": megatron.core.parallel_state when initialized,
    else the chunk's pg_collection; None: skip) against the layout's for `rank` (the default rank
    order tp-cp-ep-dp-pp; --use-tp-pp-dp-mapping is refused naming both placements).

    `model_chunks`: one model chunk or the list of them (virtual pipeline stages, in order), as
    Megatron-Core's `get_model` returns them (verl's `actor_module`); each a
    module whose `named_parameters()` give Megatron's local names (wrappers' `module.` prefixes
    are stripped: DDP, Float16Module) or a mapping of such names to tensors. `rename` maps a name
    to the trainer map's (None drops it). Errors name the first problem: a parameter the trainer
    map expects but the chunk lacks (NotFoundError), a shape or dtype that differs, a name given
    twice, or (unless `ignore_extra`) a parameter the trainer map does not know.
    """
    plan = getattr(session_or_plan, "plan", session_or_plan)
    if rank is None:
        rank = int(getattr(session_or_plan, "rank"))
    if not str(plan.trainer_spec).startswith("megatron="):
        raise InvalidArgumentError(
            f"layout 'megatron': the plan's trainer is {plan.trainer_spec}, not a Megatron layout"
        )
    if rank < 0 or rank >= plan.trainer_world:
        raise InvalidArgumentError(
            f"trainer rank {rank} outside the plan's trainer world {plan.trainer_world}"
        )
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    rename = rename or default_rename
    got: Dict[Tuple[int, str], Any] = {}
    for c, chunk in enumerate(chunks):
        for name, t in _named_parameters(chunk, c):
            n = rename(name)
            if n is None:
                continue
            if (c, n) in got:
                raise InvalidArgumentError(
                    f"model chunk {c}: '{name}' and another parameter are both '{n}'"
                )
            got[(c, n)] = t
    spec = str(plan.trainer_spec)
    layout = plan.megatron_layout()
    mc.check_spec(layout, spec, list(got))
    cfg = config if config is not None else mc.chunk_config(chunks)
    model = getattr(plan, "model", None)
    if cfg is not None:
        grouped = layout["experts"] == "grouped" and int(getattr(model, "num_experts", 0) or 0) > 0
        mc.check_config(layout, spec, cfg, model, grouped)
    out = MegatronSources(spec=spec, rank=rank)
    out.coords_from = mc.check_coords(plan, layout, spec, rank, parallel_state, chunks)
    out.config_checked = cfg is not None
    expected = plan.trainer_params(rank)
    nchunks = max((p.chunk for p in expected), default=0) + 1
    if len(chunks) != nchunks:
        raise InvalidArgumentError(
            f"trainer rank {rank} of {plan.trainer_spec} holds {nchunks} model chunk(s), "
            f"{len(chunks)} given"
        )
    missing = []
    for p in expected:
        t = got.get((p.chunk, p.name))
        if t is None:
            missing.append(f"chunk {p.chunk}: {p.name}")
            continue
        shape, want = _shape(t), list(p.shape)
        if shape != want:
            raise InvalidArgumentError(
                f"parameter '{p.name}' (chunk {p.chunk}) on trainer rank {rank}: shape {shape}, "
                f"the trainer map of {plan.trainer_spec} says {want}"
            )
        dt = _dtype_name(t)
        if dt != plan.trainer_dtype:
            raise InvalidArgumentError(
                f"parameter '{p.name}' (chunk {p.chunk}): dtype {dt}, the plan's trainer dtype "
                f"is {plan.trainer_dtype}"
            )
        out.tensors[(p.chunk, p.name)] = t
    if missing:
        raise NotFoundError(
            f"trainer rank {rank}: {len(missing)} local parameter(s) of the trainer map missing "
            f"from the model chunks: {', '.join(missing[:5])}"
        )
    extra = [f"chunk {c}: {n}" for (c, n) in got if (c, n) not in out.tensors]
    if extra and not ignore_extra:
        raise InvalidArgumentError(
            f"{len(extra)} parameter(s) of the model chunks are not in the trainer map of "
            f"{plan.trainer_spec} (rank {rank}): {', '.join(extra[:5])} (pass ignore_extra=True "
            "to leave them out)"
        )
    out.ignored = extra
    return out


def bind_trainer(session: Any, module_or_state_dict: Any, layout: str = "auto",
                 **kwargs: Any) -> Any:
    """Binds this trainer rank's parameters to `session`, checked against its plan first.

    layout "fsdp" (or "auto" with an FSDP-like plan): trainer_sources(...) of an FSDP2 module /
    state dict, bound by HF name (empty local shards are skipped: the plan reads nothing from
    them); returns TrainerSources. layout "megatron" (or "auto" with a Megatron plan):
    `module_or_state_dict` is the rank's model chunk(s), matched by (chunk, local name) with
    megatron_sources(...) and bound whole; returns MegatronSources."""
    megatron = str(session.plan.trainer_spec).startswith("megatron=")
    if layout not in ("auto", "fsdp", "megatron"):
        raise InvalidArgumentError(f"layout: must be auto, fsdp or megatron, got {layout!r}")
    if layout == "megatron" or (layout == "auto" and megatron):
        msrc = megatron_sources(session, module_or_state_dict, **kwargs)
        for (c, n), t in msrc.tensors.items():
            session.bind_source(n, t, chunk=c)
        return msrc
    src = trainer_sources(module_or_state_dict, session.plan, **kwargs)
    if src.rank != session.rank:
        raise InvalidArgumentError(
            f"trainer rank {src.rank} (from the module's mesh) but the session is sync rank "
            f"{session.rank}"
        )
    for n, t in src.tensors.items():
        if all(d > 0 for d in _shape(t)) or len(_shape(t)) == 0:
            session.bind_source(n, t)
    return src


def engine_dtype(param: Any, wire_dtype: str) -> str:
    """The dtype an engine parameter holds: block-FP8 weights ("F8_E4M3") and their fp32
    weight_scale_inv as the shard map says; every other parameter the wire dtype (the session's
    rule, fp8_plan.h Fp8DestDType)."""
    dt = str(getattr(param, "dtype", ""))
    if dt == "F8_E4M3" or (dt == "F32" and str(param.name).endswith("weight_scale_inv")):
        return dt
    return wire_dtype


def check_engine_params(
    expected: Sequence[Any],
    named_parameters: Any,
    *,
    rename: Optional[Callable[[str], Optional[str]]] = None,
    ignore_extra: bool = False,
    wire_dtype: Optional[str] = None,
) -> List[Tuple[str, Any]]:
    """Matches an engine's named_parameters() to the shard map's parameters of its rank
    (`expected`: EngineParam list, e.g. ShardMap.rank(tp, pp).params or
    Session.expected_params()). Returns [(engine name, tensor)] in shard-map order.

    Errors: a parameter the shard map expects but the engine lacks (NotFoundError), a shape
    mismatch naming the parameter and both shapes, a dtype other than `wire_dtype`, and (unless
    `ignore_extra`) an engine parameter the shard map does not know.
    """
    params: Dict[str, Any] = {}
    for name, t in _named_items(named_parameters):
        n = rename(name) if rename else name
        if n is not None:
            params[n] = t
    out: List[Tuple[str, Any]] = []
    names = set()
    missing = []
    for p in expected:
        names.add(p.name)
        t = params.get(p.name)
        if t is None:
            missing.append(p.name)
            continue
        got, want = _shape(t), list(p.shape)
        if got != want:
            raise InvalidArgumentError(
                f"parameter '{p.name}': engine shape {got}, the shard map says {want}"
            )
        if wire_dtype is not None:
            dt, want = _dtype_name(t), engine_dtype(p, wire_dtype)
            if dt == "U8" and want == "F8_E4M3":
                dt = want  # the e4m3 bytes as uint8 (torch < 2.1, numpy)
            if dt != want:
                raise InvalidArgumentError(
                    f"parameter '{p.name}': engine dtype {dt}, the "
                    + ("wire dtype" if want == wire_dtype else "block-FP8 engine's")
                    + f" is {want}"
                )
        out.append((p.name, t))
    if missing:
        raise NotFoundError(
            f"{len(missing)} parameter(s) of the shard map missing from the engine: "
            f"{', '.join(missing[:5])}"
        )
    extra = [n for n in params if n not in names]
    if extra and not ignore_extra:
        raise InvalidArgumentError(
            f"{len(extra)} engine parameter(s) not in the shard map: {', '.join(extra[:5])} "
            "(pass ignore_extra=True to leave them untouched)"
        )
    return out


def _named_items(named: Any) -> Iterable[Tuple[str, Any]]:
    """(name, tensor) pairs of a mapping ({name: tensor}), a module (its named_parameters()) or
    an iterable of pairs (named_parameters() itself)."""
    if isinstance(named, Mapping):
        return named.items()
    np_fn = getattr(named, "named_parameters", None)
    if callable(np_fn):
        return np_fn()
    return named


def allocate_params(params: Iterable[Any], device: Any = "cpu") -> Dict[str, Any]:
    """Zeroed torch tensors for engine parameters (`session.expected_params()`, or
    `plan.shard_map().rank(tp, pp).params`): {name: tensor}, each with its local shape and the
    dtype a session binds (`param.torch_dtype`), on `device`. What an engine rank without an
    engine of its own (tests, examples) binds with `bind_engine(session, tensors)`."""
    import torch

    return {p.name: torch.zeros(tuple(p.shape), dtype=getattr(torch, p.torch_dtype),
                                device=device)
            for p in params}


def bind_engine(session: Any, named_parameters: Any, **kwargs: Any) -> int:
    """Binds an engine rank's parameters (by engine names, local shapes) as destinations after
    check_engine_params against the session's shard map: `named_parameters` is a mapping
    {name: tensor}, a module (its named_parameters()) or (name, tensor) pairs. Returns how many
    were bound."""
    kwargs.setdefault("wire_dtype", session.plan.wire_dtype)
    pairs = check_engine_params(session.expected_params(), named_parameters, **kwargs)
    for n, t in pairs:
        session.bind_destination(n, t)
    return len(pairs)
