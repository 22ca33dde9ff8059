"""What the running engine really has, decided in one place: probed, never guessed.

`probe(handle, engine)` returns an `EngineCaps` for one replica's head: the engine's version, the
weight-update entry points it has, the request shapes it takes and how it names stacked experts.
In-process handles are probed through the engine's own modules (request classes, io_struct
fields, the unpickler); HTTP heads through their routes (`HTTPEngine.probe`). A method found on a
handle proves nothing (adapters and HTTP proxies answer every name), so nothing here uses
`getattr(handle, name)` to decide a capability. `require(caps, need)` refuses, naming the engine
version and the missing capability; the drivers call it before contacting the engine.

Facts each probe relies on (engine files read for this module):
- SGLang `srt/utils/common.py` `MultiprocessingSerializer.deserialize` unpickles with
  `SafeUnpickler` (module-prefix allowlist, PR #11909, Oct 2025, CVE-2025-10164); the scheduler
  calls it outside any try (`update_weights_from_tensor`), so a refused payload kills the engine.
  The probe round-trips the real command payload through the installed serializer.
- SGLang `srt/managers/io_struct.py`: `BeginWeightUpdateReqInput` exists with the begin/end
  weight-update session (PR #28001, Jun 2026, on top of PR #28710's scheduler assert of an open
  session around every update; the HTTP route is `@app.post("/begin_weight_update")`, so a GET
  answers 405 where it exists); `InitWeightsUpdateGroupReqInput.receiver` and
  `ServerArgs.weight_update_receivers` (`weight_sync/external_receiver.py`). Both are sglang-miles
  branch work (sgl-project/sglang@sglang-miles, the SGLang miles installs), not SGLang main's
  releases; the branch reports release version strings, so only the probe can tell them apart.
- SGLang `ServerArgs.weight_cache_mode` (`--weight-cache-mode {off,daemon,client}`): with any
  mode but off, `WeightUpdater._assert_weight_cache_inactive` raises RuntimeError at the top of
  `update_weights_from_tensor` / `_from_distributed` / `_from_ipc`, before any custom loader
  (model_runner_components/weight_updater.py, sgl-project/sglang 027814e), and the scheduler
  calls it with no try: the scheduler dies. Refused from the head's server args before any
  request (`require(caps, "weight_cache")`).
- SGLang `ServerArgs.custom_weight_loader` (PR #7122, v0.4.7) and `speculative_algorithm`.
- vLLM `distributed/weight_transfer/base.py`: `WeightTransferInitRequest` /
  `WeightTransferUpdateRequest` (API-level request classes). The four-phase API (start /
  update / finish, vLLM >= 0.22) in two generations: before PR #44353 (vLLM < 0.25) the worker
  owns start / finish (`Worker.start_weight_update(is_checkpoint_format=True)` runs
  `initialize_layerwise_reload` itself; `update_weights` calls `engine.receive_weights(info,
  load_weights=...)`; `LLM` / `AsyncLLM.start_weight_update(is_checkpoint_format)`); from it on
  each engine owns them (`WeightTransferEngine.start_weight_update` / `finish_weight_update`).
- vLLM `model_executor/layers/fused_moe/routed_experts.py` (vLLM >= 0.24, PR #41184): expert
  parameters are `...mlp.experts.routed_experts.w13_weight`.
- SGLang `srt/managers/io_struct.py` `PauseGenerationReqInput.mode: Literal["abort", "retract",
  "in_place"]`: "in_place" pauses the scheduler's event loop (only control requests are handled)
  and keeps every request with its KV cache until `ContinueGenerationReqInput`; `srt/managers/
  scheduler.py` `Scheduler.pause_generation` only sets `_engine_paused` in that mode. Versions
  whose pause takes no mode (SGLang <= 0.5.5: `pause_generation()` aborts) have no in-place pause.
- vLLM `v1/engine/__init__.py` `PauseMode = Literal["abort", "wait", "keep"]` ("keep": freeze
  requests in the queue, they resume on `resume_generation()`), taken by `AsyncLLM.
  pause_generation(*, mode=..., clear_cache=...)` (`v1/engine/async_llm.py`) and `EngineCore.
  pause_scheduler(mode, clear_cache)` (`v1/engine/core.py`: "keep" sets PAUSED_ALL). Older
  versions' `pause_generation(*, wait_for_inflight_requests, clear_cache)` abort or drain.
- vLLM `v1/engine/async_llm.py`: AsyncLLM's weight-transfer methods are `async def` and take the
  request objects (older ones raise TypeError on anything else).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..errors import InvalidArgumentError, UnimplementedError

__all__ = ["EngineCaps", "probe", "probe_installed", "require", "parse_version", "SUPPORT",
           "support_rows", "plan_kwargs", "check_plan"]


@dataclass(frozen=True)
class EngineCaps:
    engine: str  # "sglang" | "vllm"
    version: str  # the engine's own version string
    source: str  # how it was probed ("in-process", "http GET /get_server_info", ...)
    http: bool = False
    # SGLang
    custom_loader: bool = False  # ServerArgs has custom_weight_loader
    loader_listed: bool = False  # the head lists shardsync's loader
    session_api: bool = False  # begin/end_weight_update (and the open-session assert)
    receiver: bool = False  # external receivers (sglang-miles)
    receiver_listed: bool = False
    payload_error: Optional[str] = None  # why the unpickler refuses the command payload
    draft: Optional[str] = None  # speculative algorithm / config when a draft model runs
    weight_cache: Optional[str] = None  # ServerArgs.weight_cache_mode of the head (None: unread)
    tp_size: int = 1
    # vLLM
    native: bool = False  # four-phase weight-transfer API (start/update/finish)
    # "engine": engine-owned start / finish (PR #44353, vLLM >= 0.25); "worker": the worker owns
    # them and takes is_checkpoint_format (vLLM 0.22 .. 0.24); None: no four-phase API.
    lifecycle: Optional[str] = None
    request_classes: bool = False  # WeightTransferInitRequest / UpdateRequest importable
    asynchronous: bool = False  # AsyncLLM: async def methods
    collective_rpc: bool = False
    backend: Optional[str] = None  # weight_transfer_config.backend
    dev_mode: Optional[bool] = None  # HTTP: VLLM_SERVER_DEV_MODE routes mounted
    expert_naming: str = "fused_moe"
    # Both: a pause that keeps requests and their KV cache (staged commit pauses the engine so
    # for the commit only): SGLang's pause_generation mode "in_place", vLLM's "keep".
    pause_in_place: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{'SGLang' if self.engine == 'sglang' else 'vLLM'} {self.version}"


# Engine version range x path -> supported / refused, and why. docs/python.md's table holds the
# SGLang and UniRL rows as `support_rows` renders them (test_hooks_unirl.py checks).
SUPPORT: Tuple[Tuple[str, str, str, str], ...] = (
    ("sglang", "< 0.4.7", "any", "refused: no `--custom-weight-loader` (PR #7122)"),
    ("sglang", ">= 0.4.7, before SafeUnpickler (PR #11909, Oct 2025)", "loader",
     "supported: plain pickle; no begin/end session"),
    ("sglang", "main releases with SafeUnpickler", "loader",
     "supported: the command is an allowlisted `torch.nn.Module`; no begin/end session"),
    ("sglang", "sglang-miles, with begin/end_weight_update (PRs #28710 + #28001)", "loader",
     "supported: every request bracketed by begin/end"),
    ("sglang", "main, any version", "receiver",
     "refused: external receivers exist only on the sglang-miles branch"),
    ("sglang", "sglang-miles, with `--weight-update-receivers`", "receiver",
     "supported: post-load runs in the hook (the branch marks receiver rounds loaded, so its "
     "`end_weight_update` skips it)"),
    ("sglang", "any, `--weight-cache-mode` other than off", "any",
     "refused: `WeightUpdater._assert_weight_cache_inactive` raises before any loader and would "
     "kill the scheduler"),
    ("sglang", "any, speculative decoding", "any",
     "refused unless `draft=\"leave\"` (the plan covers the target only); then the hook binds the "
     "runner whose parameters are the plan's (SGLang main's EAGLE worker calls the draft first)"),
    ("unirl", "`ar.py` (colocated), as shipped", "`ShardsyncWeightSync`",
     "supported, no patch: the Hydra block only"),
    ("unirl", "`async_ar.py`, `agentic_async.py` (separate slabs)", "`ShardsyncWeightSync`",
     "supported with `integrations/unirl-async.patch` (one line per trainer)"),
    ("unirl", "SGLang rollout `pp_size > 1`", "`ShardsyncWeightSync`",
     "needs UniRL PR #502 (unmerged): as shipped `SGLangEngineConfig` refuses it"),
    ("vllm", "< 0.22 (no start/finish_weight_update)", "native",
     "refused: use the worker extension"),
    ("vllm", "any V1", "extension", "supported (collective_rpc; in-process only)"),
    ("vllm", ">= 0.22, < 0.25 (worker-owned start / finish)", "native",
     "supported: rounds started with is_checkpoint_format=False (no layerwise reload); the "
     "backend's receive_weights(info, load_weights=...) is the round"),
    ("vllm", ">= 0.25 (engine-owned start / finish, PR #44353)", "native", "supported"),
    ("vllm", ">= 0.24", "native / extension",
     "supported: RoutedExperts names (Plan(expert_naming='routed_experts'))"),
    ("vllm", "any, block FP8", "native / extension / http",
     "supported where the FP8 backend serves a block layout (Triton, CUTLASS incl. SM90's "
     "transposed scales, DeepGEMM with fp32 scales; MoE TRITON / BATCHED_TRITON); refused by "
     "backend name: Marlin, DeepGEMM E8M0, FlashInfer, AITER, DeepGEMM MoE"),
    ("vllm", "AsyncLLM", "native", "supported: awaited on the engine's loop (loop=)"),
    ("vllm", "vllm serve without VLLM_SERVER_DEV_MODE=1", "http",
     "refused: /sleep, /wake_up, /is_sleeping and the RLHF routes are dev-mode routes"),
)


def support_rows(*engines: str) -> List[str]:
    """SUPPORT's rows of `engines` as docs/python.md's markdown table has them."""
    label = {"sglang": "SGLang", "vllm": "vLLM", "unirl": "UniRL"}
    return [f"| {label[e]} {rng} | {path} | {verdict} |"
            for e, rng, path, verdict in SUPPORT if e in engines]


def parse_version(v: Any) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) of "0.24.1", "0.24.0rc1", "v0.5.4.post1"; None when unparsable."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(v or ""))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _has_module(name: str) -> bool:
    """Whether `name` is importable, without importing it (nor failing on a missing parent)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _fields(cls: Any) -> List[str]:
    if cls is None:
        return []
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(getattr(cls, "__struct_fields__", ()))  # msgspec.Struct (newer io_struct)


def _literal_args(cls_or_alias: Any, attr: Optional[str]) -> List[str]:
    """The values of a Literal: a class field's annotation (`attr`) or the alias itself."""
    import typing

    ann: Any = cls_or_alias
    if attr is not None:
        anns: Dict[str, Any] = {}
        for c in reversed(getattr(cls_or_alias, "__mro__", ())):
            anns.update(getattr(c, "__annotations__", {}) or {})
        ann = anns.get(attr)
    if ann is None:
        return []
    if isinstance(ann, str):  # postponed annotations: the source text of the Literal
        return re.findall(r"['\"]([A-Za-z_]+)['\"]", ann)
    return [str(a) for a in typing.get_args(ann)]


def _version_of(mod: Any, engine: str) -> str:
    v = getattr(mod, "__version__", None)
    if v is None:
        ver = _module(f"{engine}.version")
        v = getattr(ver, "__version__", None)
    if not v:
        raise UnimplementedError(
            f"{engine}: the installed package reports no version (__version__): cannot decide "
            "its weight-update capabilities; refused")
    return str(v)


def _head_attr(handle: Any, *path: str) -> Any:
    """A config object the engine handle holds (server_args, vllm_config): data, not a method."""
    obj = handle
    for p in path:
        try:
            obj = getattr(obj, p, None)
        except Exception:  # noqa: BLE001 - a proxy that raises means "not readable"
            return None
        if obj is None:
            return None
    return obj


def _weight_cache(server_args: Any) -> Optional[str]:
    """The head's --weight-cache-mode ("off" when the version has no such field), or None when
    its server args are not readable."""
    if server_args is None:
        return None
    get = server_args.get if isinstance(server_args, dict) else (
        lambda k, d=None: getattr(server_args, k, d))
    return str(get("weight_cache_mode", None) or "off")


def _probe_sglang(handle: Any) -> EngineCaps:
    from . import sglang as ss

    mod = _module("sglang")
    if mod is None:
        raise UnimplementedError(
            "sglang is not importable in this process: pass an HTTPEngine head (probed over "
            "HTTP) or run the driver where SGLang is installed")
    version = _version_of(mod, "sglang")
    io = _module("sglang.srt.managers.io_struct")
    sa_mod = _module("sglang.srt.server_args")
    sa_fields = _fields(getattr(sa_mod, "ServerArgs", None))
    sa = _head_attr(handle, "server_args")
    loaders = list(getattr(sa, "custom_weight_loader", None) or [])
    receivers = list(getattr(sa, "weight_update_receivers", None) or [])
    init_fields = _fields(getattr(io, "InitWeightsUpdateGroupReqInput", None))
    draft = getattr(sa, "speculative_algorithm", None)
    return EngineCaps(
        engine="sglang", version=version, source="in-process (sglang modules)",
        custom_loader="custom_weight_loader" in sa_fields,
        loader_listed=ss.LOADER in loaders,
        session_api=getattr(io, "BeginWeightUpdateReqInput", None) is not None,
        receiver="receiver" in init_fields and "weight_update_receivers" in sa_fields,
        receiver_listed=ss.RECEIVER in receivers,
        payload_error=ss.payload_error(),
        draft=str(draft) if draft else None,
        weight_cache=_weight_cache(sa),
        tp_size=int(getattr(sa, "tp_size", 1) or 1),
        pause_in_place="in_place" in _literal_args(
            getattr(io, "PauseGenerationReqInput", None), "mode"),
    )


def _probe_vllm(handle: Any) -> EngineCaps:
    mod = _module("vllm")
    if mod is None:
        raise UnimplementedError(
            "vllm is not importable in this process: pass an HTTPEngine head (probed over HTTP)")
    version = _version_of(mod, "vllm")
    base = _module("vllm.distributed.weight_transfer.base")
    wte = getattr(base, "WeightTransferEngine", None)
    req = (getattr(base, "WeightTransferInitRequest", None) is not None
           and getattr(base, "WeightTransferUpdateRequest", None) is not None)
    routed = _has_module("vllm.model_executor.layers.fused_moe.routed_experts")
    cls = type(handle)
    fn = inspect.getattr_static(cls, "init_weight_transfer_engine", None) or \
        inspect.getattr_static(cls, "collective_rpc", None)
    engine_owned = wte is not None and hasattr(wte, "start_weight_update") \
        and hasattr(wte, "finish_weight_update")
    # Before PR #44353: LLM / AsyncLLM.start_weight_update(is_checkpoint_format=True) drives the
    # worker-owned lifecycle (entrypoints/llm.py, v1/engine/async_llm.py of that generation).
    worker_owned = not engine_owned and wte is not None and _takes(
        inspect.getattr_static(cls, "start_weight_update", None), "is_checkpoint_format")
    vc = _head_attr(handle, "vllm_config") or _head_attr(handle, "llm_engine", "vllm_config")
    spec = getattr(vc, "speculative_config", None)
    return EngineCaps(
        engine="vllm", version=version, source="in-process (vllm modules)",
        native=engine_owned or worker_owned,
        lifecycle="engine" if engine_owned else "worker" if worker_owned else None,
        request_classes=req,
        asynchronous=inspect.iscoroutinefunction(fn),
        collective_rpc=inspect.getattr_static(cls, "collective_rpc", None) is not None,
        backend=getattr(getattr(vc, "weight_transfer_config", None), "backend", None),
        expert_naming="routed_experts" if routed else "fused_moe",
        draft=str(getattr(spec, "method", "speculative")) if spec is not None else None,
        pause_in_place="keep" in _literal_args(
            getattr(_module("vllm.v1.engine"), "PauseMode", None), None)
        and "mode" in _params(inspect.getattr_static(cls, "pause_generation", None)),
    )


def _takes(fn: Any, name: str) -> bool:
    """Whether callable `fn` (a function as the class holds it) has parameter `name`."""
    fn = getattr(fn, "__func__", fn)
    if not callable(fn):
        return False
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _params(fn: Any) -> List[str]:
    try:
        return list(inspect.signature(fn).parameters) if callable(fn) else []
    except (TypeError, ValueError):
        return []


def probe(handle: Any, engine: str) -> EngineCaps:
    """The capabilities of one head: its own `probe()` (HTTP heads), else the engine's modules in
    this process (in-process `sglang.Engine`, `vllm.LLM` / `AsyncLLM`, or their adapters)."""
    own = inspect.getattr_static(type(handle), "probe", None)
    if own is not None:
        caps = handle.probe()
        if not isinstance(caps, EngineCaps) or caps.engine != engine:
            raise InvalidArgumentError(f"head {handle!r}: probe() is not a {engine} EngineCaps")
        return caps
    if engine == "sglang":
        return _probe_sglang(handle)
    if engine == "vllm":
        return _probe_vllm(handle)
    raise InvalidArgumentError(f"engine: must be sglang or vllm, got {engine!r}")


class _Installed:
    """No running engine: the probe reads only the package installed in this process."""


def probe_installed(engine: str) -> EngineCaps:
    """The engine package installed in this process, with no engine running yet: what a plan
    built here must say (`plan_kwargs`); the drivers check the running heads again."""
    return probe(_Installed(), engine)


def agree(caps: List[EngineCaps]) -> EngineCaps:
    """One replica set runs one engine version; replicas that disagree are refused by name."""
    first = caps[0]
    for d, c in enumerate(caps[1:], 1):
        if dataclasses.replace(c, source=first.source) != first:
            raise InvalidArgumentError(
                f"replica {d} runs {c.label} with other capabilities than replica 0 "
                f"({first.label}): one driver drives one engine version")
    return first


_WHY = {
    "loader": "no --custom-weight-loader (ServerArgs.custom_weight_loader, SGLang >= 0.4.7)",
    "loader_listed": "the engine was not launched with --custom-weight-loader "
                     "shardsync.hooks.sglang.load_weights",
    "payload": "its unpickler refuses the command payload",
    "receiver": "no external weight-update receivers (weight_sync/external_receiver.py exists "
                "only on the sglang-miles branch; InitWeightsUpdateGroupReqInput has no "
                "'receiver' field, so the keywords raise TypeError in-process and are dropped "
                "over HTTP)",
    "receiver_listed": "the engine was not launched with --weight-update-receivers "
                       "shardsync.hooks.sglang.receiver",
    "native": "no four-phase weight-transfer API (WeightTransferEngine.start_weight_update / "
              "finish_weight_update, vLLM >= 0.22): use path='extension'",
    "request_classes": "no WeightTransferInitRequest / WeightTransferUpdateRequest",
    "backend": "weight_transfer_config.backend is not 'shardsync'",
    "collective_rpc": "no collective_rpc (worker extension path)",
    "dev_mode": "the dev-mode routes (/sleep, /wake_up, /is_sleeping, /init_weight_transfer_"
                "engine, ...) are not mounted: launch `vllm serve` with VLLM_SERVER_DEV_MODE=1",
    "inproc": "the path needs an in-process engine (pickled or RPC payloads), not HTTP",
    "pause_in_place": "no pause that keeps requests and their KV cache (SGLang: "
                      "PauseGenerationReqInput.mode 'in_place'; vLLM: pause_generation(mode="
                      "'keep')), which a staged commit needs to swap versions without draining; "
                      "use Plan(commit='inplace')",
    "weight_cache": "launched with --weight-cache-mode {mode}: the weights are shared with the "
                    "weight-cache daemon and WeightUpdater._assert_weight_cache_inactive raises "
                    "before any loader, with no try around it (the scheduler would die); "
                    "relaunch with --weight-cache-mode off",
}


def require(caps: EngineCaps, *needs: str) -> None:
    """Raises UnimplementedError naming the engine version and the first missing capability."""
    have = {
        "loader": caps.custom_loader, "loader_listed": caps.loader_listed,
        "payload": caps.payload_error is None, "receiver": caps.receiver,
        "receiver_listed": caps.receiver_listed, "native": caps.native,
        "request_classes": caps.request_classes, "backend": caps.backend == "shardsync",
        "collective_rpc": caps.collective_rpc, "dev_mode": caps.dev_mode is not False,
        "inproc": not caps.http,
        "weight_cache": caps.weight_cache in (None, "off"),
        "pause_in_place": caps.pause_in_place,
    }
    for n in needs:
        if not have[n]:
            why = _WHY[n]
            if n == "payload":
                why += f": {caps.payload_error}"
            if n == "weight_cache":
                why = why.format(mode=caps.weight_cache)
            raise UnimplementedError(f"{caps.label} ({caps.source}): {why}; refused at init")


def plan_kwargs(caps: EngineCaps) -> Dict[str, Any]:
    """Plan keyword arguments the engine version decides (`Plan(..., **plan_kwargs(caps))`)."""
    return {"expert_naming": caps.expert_naming} if caps.engine == "vllm" else {}


def check_plan(caps: EngineCaps, plan: Any) -> None:
    """The plan must name experts the way this engine version does (MoE models only)."""
    if caps.engine != "vllm" or not int(getattr(plan.model, "num_experts", 0) or 0):
        return
    have = getattr(plan, "expert_naming", "fused_moe")
    if have != caps.expert_naming:
        names = {"fused_moe": "...mlp.experts.w13_weight (FusedMoE)",
                 "routed_experts": "...mlp.experts.routed_experts.w13_weight (RoutedExperts)"}
        raise InvalidArgumentError(
            f"{caps.label} names its expert parameters {names[caps.expert_naming]} but the plan "
            f"uses expert_naming='{have}': build the Plan with "
            f"expert_naming='{caps.expert_naming}' (shardsync.hooks.engines.plan_kwargs)")
