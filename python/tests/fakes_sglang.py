"""A fake SGLang that keeps SGLang's weight-update contract, version by version (a profile).

Mirrored from SGLang's own files (python/sglang/srt/...):
- one scheduler per (pp, tp), each a persistent thread standing for its process: thread-local
  parallel state and server args, read through the fake `sglang.srt.*` modules;
- a control request is handled by every scheduler of stage 0, then forwarded to stage 1 (handle
  before forward); only pp0/tp0's answer is returned (entrypoints/engine.py, scheduler);
- `update_weights_from_tensor`: the Engine pickles `named_tensors` once per tp rank with the
  patched torch reductions (utils/patch_torch.py `monkey_patch_torch_reductions`, whose
  `_modify_tuple` indexes arg 6 of every reduced tensor: IndexError for CPU tensors, UniRL #503);
  every scheduler, of every PP stage, deserializes `serialized_named_tensors[tp_rank]` with
  `MultiprocessingSerializer.deserialize` outside any try (utils/common.py; SafeUnpickler with
  the module-prefix allowlist since PR #11909, Oct 2025, CVE-2025-10164: "Blocked unsafe class
  loading" otherwise), then per model runner (target, then the speculative draft:
  SchedulerWeightUpdaterManager.get_model_runners) `_unwrap_tensor(t, tp_rank, device).to(device)`
  and the custom loader with no try (model_runner_components/weight_updater.py); an exception
  anywhere there kills the scheduler and with it the engine; the runners' order is the SGLang
  line's: SGLang main's EAGLE worker updates the draft runner first, then the target
  (sgl-project/sglang 006b0e3, speculative/eagle_worker_v2.py `EAGLEWorkerV2.
  update_weights_from_tensor`), sglang-miles' `SchedulerWeightUpdaterManager.get_model_runners`
  the target first (00a2ca2);
- `--weight-cache-mode` other than off: `WeightUpdater._assert_weight_cache_inactive` raises
  RuntimeError before any loader, with no try (027814e): the scheduler dies;
- `flush_cache_after_weight_update` asserts the flush succeeded, and a flush succeeds only when
  generation is fully idle (scheduler: flush_cache returns False with requests in flight);
- begin/end weight-update session (sglang-miles, PRs #28710 + #28001): every update asserts an
  open session, `end_weight_update` runs `post_load_weights` only when the session is not marked
  loaded (`run_post_load = not self._weight_update_loaded`), and every successful update marks
  it: `update_weights_from_tensor` and `update_weights_from_distributed`, a receiver round
  included (srt/managers/scheduler_components/weight_updater.py `SchedulerWeightUpdaterManager`,
  sgl-project/sglang 00a2ca2: `_weight_update_loaded = True` after `load_weights(weights)`, which
  for a receiver group is the empty list `receive_weights_from_distributed` returns after
  `external.receive(receiver_payload)`);
- external weight-update receivers exist only on the sglang-miles branch
  (weight_sync/external_receiver.py): a stock Engine's `init_weights_update_group` has no
  receiver keywords (TypeError), and its HTTP route drops unknown keys and opens a torch process
  group at the given address;
- pause / continue (issue 33): `PauseGenerationReqInput.mode: Literal["abort", "retract",
  "in_place"]` (srt/managers/io_struct.py): "in_place" pauses the scheduler's event loop from
  performing inference, only control requests are handled, and the paused requests continue
  with their old KV cache after `continue_generation` (`Scheduler.pause_generation` only sets
  `_engine_paused`; the event loop `continue`s past batch launches while it is set; in-flight GPU
  kernels still finish, which the hook's commit waits for with a device synchronize and this fake
  stands in for by letting the running forward step end before the pause answers). Versions
  whose `pause_generation()` takes no mode (SGLang <= 0.5.5, as verl's compatibility shim for
  `verlai/verl:sgl055` says: "pause_generation() takes no args") abort instead; the profiles
  before 0.5.12 have that pause. `generate()` is one forward step over every stage: a
  fingerprint of each scheduler's parameters, all read under one step.

Version strings of the profiles are labels; which release first shipped each capability is
given by the PR cited on the field. "0.5.12" stands for SGLang main's releases (loader +
SafeUnpickler, no session); "miles-session" and "miles" for the sglang-miles branch, which
reports release version strings too (only the capabilities tell it apart).
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import io
import json
import pickle
import queue
import threading
from dataclasses import dataclass, field, fields, make_dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from fakes_engines import _Group, _local, _module, current

__all__ = [
    "SGLangProfile",
    "SGLANG_PROFILES",
    "sglang_modules",
    "sglang_server_args",
    "sglang_serialize",
    "SchedulerDied",
    "FakeSGLangEngine",
    "serve_sglang_http",
    "ALLOWED_MODULE_PREFIXES",
]


@dataclass(frozen=True)
class SGLangProfile:
    version: str
    custom_loader: bool = True  # ServerArgs.custom_weight_loader (PR #7122, v0.4.7)
    safe_unpickler: bool = True  # SafeUnpickler in MultiprocessingSerializer (PR #11909)
    session_api: bool = False  # begin/end + the open-session assert (sglang-miles, PR #28001)
    receivers: bool = False  # external receivers (sglang-miles branch only)
    # PauseGenerationReqInput.mode values (empty: `pause_generation()` takes no mode, aborts)
    pause_modes: Tuple[str, ...] = ("abort", "retract", "in_place")


SGLANG_PROFILES: Dict[str, SGLangProfile] = {
    "0.4.6": SGLangProfile("0.4.6", custom_loader=False, safe_unpickler=False, pause_modes=()),
    "0.4.7": SGLangProfile("0.4.7", safe_unpickler=False, pause_modes=()),
    "0.5.4": SGLangProfile("0.5.4", pause_modes=()),
    "0.5.12": SGLangProfile("0.5.12"),  # SGLang main: no session
    "miles-session": SGLangProfile("0.5.12+miles", session_api=True),
    "miles": SGLangProfile("0.5.12+miles", session_api=True, receivers=True),
}

# srt/utils/common.py SafeUnpickler.ALLOWED_MODULE_PREFIXES / DENY_CLASSES (sgl-project/sglang
# 4e75f46), find_class exactly as there.
ALLOWED_MODULE_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
    "weakref.", "torch.", "torch._tensor.", "torch.storage.", "torch.nn.parameter.",
    "torch.autograd.function.", "torch.distributed.", "torch.distributed._shard.",
    "torch.distributed._composable.", "torch._C._distributed_c10d.",
    "torch._C._distributed_fsdp.", "torch.distributed.optim.",
    "multiprocessing.resource_sharer.", "multiprocessing.reduction.", "pickletools.", "peft.",
    "transformers.", "huggingface_hub.", "sglang.srt.weight_sync.tensor_bucket.",
    "sglang.srt.model_executor.model_runner.", "sglang.srt.layers.", "sglang.srt.utils.",
)
DENY_CLASSES = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"),
                ("os", "system"), ("subprocess", "Popen"), ("subprocess", "run"),
                ("codecs", "decode"), ("types", "CodeType"), ("types", "FunctionType")}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in DENY_CLASSES:
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name}), "
                               "to prevent exploitation of CVE-2025-10164")
        if any((module + ".").startswith(p) for p in ALLOWED_MODULE_PREFIXES):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe class loading ({module}.{name}), "
                           "to prevent exploitation of CVE-2025-10164")


def _modify_tuple_unguarded(t, index, modifier):
    # utils/patch_torch.py `_modify_tuple` without a length guard (UniRL #503).
    return (*t[:index], modifier(t[index]), *t[index + 1:])


class _SGLangPickler(pickle.Pickler):
    """ForkingPickler with monkey_patch_torch_reductions applied."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            from torch.multiprocessing import reductions

            fn, args = reductions.reduce_tensor(obj)
            return fn, _modify_tuple_unguarded(args, 6, lambda dev: f"GPU-uuid-{dev}")
        return NotImplemented


def sglang_serialize(obj) -> bytes:
    buf = io.BytesIO()
    _SGLangPickler(buf).dump(obj)
    return buf.getvalue()


def _serializer(profile: SGLangProfile) -> type:
    class MultiprocessingSerializer:
        @staticmethod
        def serialize(obj, output_str: bool = False):
            out = sglang_serialize(obj)
            return base64.b64encode(out).decode() if output_str else out

        @staticmethod
        def deserialize(data):
            if isinstance(data, str):
                data = base64.b64decode(data, validate=True)
            if profile.safe_unpickler:
                return SafeUnpickler(io.BytesIO(data)).load()
            return pickle.loads(data)

    return MultiprocessingSerializer


def _io_struct(profile: SGLangProfile) -> Dict[str, Any]:
    """managers/io_struct.py request classes of this version (fields as there)."""
    tensor = make_dataclass("UpdateWeightsFromTensorReqInput", [
        ("serialized_named_tensors", list, field(default_factory=list)),
        ("load_format", Optional[str], None), ("flush_cache", bool, True)])
    group = [("master_address", str, ""), ("master_port", int, 0), ("rank_offset", int, 0),
             ("world_size", int, 0), ("group_name", str, "weight_update_group"),
             ("backend", str, "nccl")]
    dist = [("names", list, field(default_factory=list)),
            ("dtypes", list, field(default_factory=list)),
            ("shapes", list, field(default_factory=list)),
            ("group_name", str, "weight_update_group"), ("flush_cache", bool, True),
            ("load_format", Optional[str], None)]
    if profile.receivers:
        group += [("receiver", Optional[str], None), ("receiver_init_payload", Any, None)]
        dist += [("receiver_payload", Any, None)]
    out = {"UpdateWeightsFromTensorReqInput": tensor,
           "InitWeightsUpdateGroupReqInput": make_dataclass("InitWeightsUpdateGroupReqInput",
                                                            group),
           "UpdateWeightsFromDistributedReqInput": make_dataclass(
               "UpdateWeightsFromDistributedReqInput", dist)}
    if profile.pause_modes:
        from typing import Literal

        out["PauseGenerationReqInput"] = make_dataclass(
            "PauseGenerationReqInput",
            [("mode", Literal[profile.pause_modes], "abort")])  # type: ignore[valid-type]
        out["ContinueGenerationReqInput"] = make_dataclass("ContinueGenerationReqInput", [])
    if profile.session_api:
        out["BeginWeightUpdateReqInput"] = make_dataclass(
            "BeginWeightUpdateReqInput", [("selector", str, "all")])
        out["EndWeightUpdateReqInput"] = make_dataclass("EndWeightUpdateReqInput", [])
    return out


def sglang_server_args(tp, pp, profile: Any = "0.5.12", **over):
    profile = SGLANG_PROFILES[profile] if isinstance(profile, str) else profile
    args = dict(tp_size=tp, pp_size=pp, dp_size=1, ep_size=1, enable_dp_attention=False,
                enable_dp_lm_head=False, attn_cp_size=1, moe_dp_size=1, moe_dense_tp_size=None,
                ep_num_redundant_experts=0, enable_eplb=False, quantization=None,
                moe_runner_backend="auto", moe_a2a_backend="none", weight_cache_mode="off",
                enable_memory_saver=False, speculative_algorithm=None)
    if profile.custom_loader:
        args["custom_weight_loader"] = ["shardsync.hooks.sglang.load_weights"]
    if profile.receivers:
        args["weight_update_receivers"] = ["shardsync.hooks.sglang.receiver"]
    args.update(over)
    return SimpleNamespace(**args)


def sglang_modules(profile: Any = "0.5.12") -> Dict[str, Any]:
    profile = SGLANG_PROFILES[profile] if isinstance(profile, str) else profile

    # model_loader/loader.py post_load_weights(model), called by WeightUpdater.end_weight_update.
    def post_load_weights(model):  # model_loader/loader.py: the model's own hook
        hook = getattr(model, "post_load_weights", None)
        if callable(hook):
            hook()

    sa_fields = [f for f in vars(sglang_server_args(1, 1, profile))]
    return {
        "sglang": _module("sglang", __version__=profile.version),
        "sglang.srt": _module("sglang.srt"),
        "sglang.srt.distributed": _module(
            "sglang.srt.distributed",
            get_tensor_model_parallel_rank=lambda: current().tp_rank,
            get_tensor_model_parallel_world_size=lambda: current().tp_size,
            get_pp_group=lambda: _Group(current().pp_rank, current().pp_size),
        ),
        "sglang.srt.server_args": _module(
            "sglang.srt.server_args", get_global_server_args=lambda: current().server_args,
            ServerArgs=make_dataclass("ServerArgs", [(f, Any, None) for f in sa_fields])),
        "sglang.srt.managers": _module("sglang.srt.managers"),
        "sglang.srt.managers.io_struct": _module("sglang.srt.managers.io_struct",
                                                 **_io_struct(profile)),
        "sglang.srt.utils": _module("sglang.srt.utils",
                                    MultiprocessingSerializer=_serializer(profile)),
        "sglang.srt.model_loader": _module("sglang.srt.model_loader"),
        "sglang.srt.model_loader.loader": _module(
            "sglang.srt.model_loader.loader", post_load_weights=post_load_weights),
    }


class SchedulerDied(RuntimeError):
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool


@dataclass
class _SchedProc:
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    server_args: Any
    model: Any
    draft: Any = None
    in_session: bool = False
    loaded: bool = False
    receivers: Dict[str, Any] = field(default_factory=dict)


def _unwrap_tensor(tensor, tp_rank, device):
    # model_runner_components/weight_updater.py `_unwrap_tensor`: LocalSerializedTensor ->
    # .get(tp_rank), then `tensor.to(device)` (sglang 027814e; LocalSerializedTensor not faked).
    return tensor.to(device)


class FakeSGLangEngine:
    """One SGLang engine (one DP replica) of tp x pp schedulers; see the module docstring."""

    def __init__(self, models: Dict[Tuple[int, int], Any], tp: int, pp: int, *,
                 profile: Any = "0.5.12", server_args=None,
                 drafts: Optional[Dict[Tuple[int, int], Any]] = None,
                 stage_timeout: float = 60.0):
        self.profile = SGLANG_PROFILES[profile] if isinstance(profile, str) else profile
        self.tp, self.pp = tp, pp
        self.server_args = server_args or sglang_server_args(
            tp, pp, self.profile, speculative_algorithm="EAGLE" if drafts else None)
        self.serializer = _serializer(self.profile)
        self.stage_timeout = stage_timeout
        self.dead: Optional[str] = None
        self.calls: List[str] = []
        self.pg_attempts: List[Tuple[Any, ...]] = []
        self.inflight = 0  # requests being generated: flush_cache refuses while > 0
        self.paused: Optional[str] = None  # the in-place pause's mode while it holds
        self._step = threading.Condition()
        self._forwards = 0  # forward steps running now
        self.procs = {(t, p): _SchedProc(t, p, tp, pp, self.server_args, models[(t, p)],
                                         (drafts or {}).get((t, p)))
                      for p in range(pp) for t in range(tp)}
        self._inbox = {k: queue.Queue() for k in self.procs}
        for k in self.procs:
            threading.Thread(target=self._loop, args=(k,), daemon=True,
                             name=f"sched-pp{k[1]}-tp{k[0]}").start()
        if self.profile.session_api:
            self.begin_weight_update = self._begin
            self.end_weight_update = self._end

    # ---- scheduler processes ----
    def _loop(self, key):
        _local.proc = self.procs[key]
        while True:
            item = self._inbox[key].get()
            if item is None:
                return
            fn, box, done = item
            try:
                box["value"] = fn(self.procs[key])
            except BaseException as e:  # noqa: BLE001 - an uncaught exception kills the process
                box["error"] = e
            done.set()

    def _request(self, name: str, handler: Callable[[_SchedProc], Any]) -> Any:
        self.calls.append(name)
        if self.dead:
            raise SchedulerDied(f"engine is dead: {self.dead}")
        reply = None
        for p in range(self.pp):  # handle on stage p, then forward to p + 1
            boxes = []
            for t in range(self.tp):
                box, done = {}, threading.Event()
                self._inbox[(t, p)].put((handler, box, done))
                boxes.append((t, box, done))
            for t, box, done in boxes:
                if not done.wait(self.stage_timeout):
                    self.dead = f"scheduler pp{p}/tp{t} hung in {name}"
                    raise SchedulerDied(self.dead)
                if "error" in box:
                    e = box["error"]
                    self.dead = f"scheduler pp{p}/tp{t} died in {name}: {type(e).__name__}: {e}"
                    raise SchedulerDied(self.dead) from e
                if (t, p) == (0, 0):
                    reply = box.get("value")
        return reply

    def shutdown(self):
        """Ends the scheduler "processes": their shardsync sessions close with them."""
        def bye(s):
            for r in s.receivers.values():
                r.destroy()
            s.receivers.clear()
            from shardsync.hooks import sglang as ss

            ss.close()

        for k in self.procs:
            done = threading.Event()
            self._inbox[k].put((bye, {}, done))
            done.wait(30)
            self._inbox[k].put(None)

    # ---- generation state ----
    @contextlib.contextmanager
    def generating(self, n: int = 1):
        """Requests in flight (the scheduler is not idle) for the duration."""
        self.inflight += n
        try:
            yield
        finally:
            self.inflight -= n

    def _flush(self) -> bool:
        return self.inflight == 0

    def _flush_after_update(self, flush_cache: bool) -> None:
        # scheduler flush_cache_after_weight_update
        if flush_cache:
            assert self._flush(), "Cache flush failed after updating weights"

    # ---- requests ----
    def _begin(self, selector="all"):
        def h(s):
            assert not s.in_session, "begin_weight_update called while a session is already open"
            s.in_session, s.loaded = True, False
            return True, "Success"
        return self._request("begin_weight_update", h)

    def _end(self):
        # SchedulerWeightUpdaterManager.end_weight_update: `run_post_load = not
        # self._weight_update_loaded`, then per runner WeightUpdater.end_weight_update ->
        # post_load_weights(model) when asked, then DefaultModelLoader.postprocess_weights.
        def h(s):
            assert s.in_session, "end_weight_update called without begin_weight_update"
            run_post_load = not s.loaded
            for model in [s.model] + ([s.draft] if s.draft is not None else []):
                if run_post_load:
                    model.post_load_weights()
                for _, m in model.named_modules():  # DefaultModelLoader.postprocess_weights
                    qm = getattr(m, "quant_method", None)
                    if qm is not None:
                        qm.process_weights_after_loading(m)
            s.in_session = False
            return True, "Success"
        return self._request("end_weight_update", h)

    def _runners(self, s):
        """The model runners an update reaches, in the line's order (module docstring)."""
        if s.draft is None:
            return [s.model]
        return [s.model, s.draft] if self.profile.session_api else [s.draft, s.model]

    @staticmethod
    def _assert_weight_cache_inactive(s, op):
        # model_runner_components/weight_updater.py WeightUpdater._assert_weight_cache_inactive
        mode = getattr(s.server_args, "weight_cache_mode", "off")
        if mode != "off":
            raise RuntimeError(f"[weight_cache] {op} is not supported while the weight cache is "
                               f"active (--weight-cache-mode {mode})")

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        """entrypoints/engine.py: one serialized payload per tp rank."""
        payloads = [self.serializer.serialize(named_tensors) for _ in range(self.tp)]
        return self.update_serialized(payloads, load_format, flush_cache)

    def update_serialized(self, serialized_named_tensors, load_format=None, flush_cache=True):
        """The scheduler's handling of UpdateWeightsFromTensorReqInput (also the HTTP route):
        srt/managers/scheduler_components/weight_updater.py SchedulerWeightUpdaterManager.
        update_weights_from_tensor asserts the open session, deserializes
        serialized_named_tensors[tp_rank] once, calls every runner of get_model_runners,
        sets _weight_update_loaded, then flush_cache_after_weight_update."""
        def h(s):
            if self.profile.session_api:
                assert s.in_session, ("update_weights_from_tensor requires an open "
                                      "begin_weight_update session")
            named = self.serializer.deserialize(serialized_named_tensors[s.tp_rank])
            for model in self._runners(s):
                self._assert_weight_cache_inactive(s, "update_weights_from_tensor")
                unwrapped = [(n, _unwrap_tensor(t, s.tp_rank, "cpu")) for n, t in named]
                if load_format in (getattr(s.server_args, "custom_weight_loader", None) or ()):
                    mod, _, fn = load_format.rpartition(".")
                    getattr(importlib.import_module(mod), fn)(model, unwrapped)  # no try
                else:
                    raise NotImplementedError(f"Unknown load_format={load_format}")
            s.loaded = True
            self._flush_after_update(flush_cache)
            return True, "Success"
        return self._request("update_weights_from_tensor", h)

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl", **receiver):
        if receiver and not self.profile.receivers:  # the stock signature has no such keywords
            raise TypeError(f"init_weights_update_group() got an unexpected keyword argument "
                            f"{next(iter(receiver))!r}")
        name = receiver.get("receiver")

        def h(s):
            if name is None:
                self.pg_attempts.append((master_address, master_port, rank_offset, world_size))
                return False, ("Failed to initialize custom process group: a torch process group "
                               f"at {master_address}:{master_port} (not faked)")
            if name not in (getattr(s.server_args, "weight_update_receivers", None) or ()):
                return False, f"receiver {name!r} is not listed in --weight-update-receivers"
            try:
                mod, _, fn = name.rpartition(".")
                ctx = SimpleNamespace(model=s.model, device=torch.device("cpu"),
                                      tp_rank=s.tp_rank, tp_size=s.tp_size, group_name=group_name,
                                      master_address=master_address, master_port=master_port,
                                      world_size=world_size, rank_offset=rank_offset,
                                      init_payload=receiver.get("receiver_init_payload"))
                s.receivers[group_name] = getattr(importlib.import_module(mod), fn)(ctx)
            except Exception as e:  # noqa: BLE001 - the updater catches factory failures
                return False, f"Failed to initialize external weight-update receiver: {e}."
            return True, "Succeeded to initialize external weight-update receiver."
        return self._request("init_weights_update_group", h)

    def update_weights_from_distributed(self, names, dtypes, shapes,
                                        group_name="weight_update_group", flush_cache=True,
                                        load_format=None, **receiver):
        if receiver and not self.profile.receivers:
            raise TypeError("update_weights_from_distributed() got an unexpected keyword "
                            f"argument {next(iter(receiver))!r}")

        def h(s):
            if self.profile.session_api:
                assert s.in_session, ("update_weights_from_distributed requires an open "
                                      "begin_weight_update session")
            r = s.receivers.get(group_name)
            if r is None:
                return False, f"Group {group_name} not in {list(s.receivers)}"
            self._assert_weight_cache_inactive(s, "update_weights_from_distributed")
            try:
                r.receive(receiver.get("receiver_payload"))
                ok, msg = True, "Succeeded to update parameter online."
            except Exception as e:  # noqa: BLE001 - weight_updater.py catches the receiver's
                ok, msg = False, f"Failed to update parameter online: {e}."
            if ok:  # load_weights([]) ran on every runner: marked loaded all the same (00a2ca2)
                s.loaded = True
                self._flush_after_update(flush_cache)
            return ok, msg
        return self._request("update_weights_from_distributed", h)

    def destroy_weights_update_group(self, group_name):
        def h(s):
            r = s.receivers.pop(group_name, None)
            if r is None:
                return False, "The group to be destroyed does not exist."
            r.destroy()
            return True, "Succeeded to destroy external weight-update receiver."
        return self._request("destroy_weights_update_group", h)

    def flush_cache(self):
        return self._request("flush_cache", lambda s: FlushCacheReqOutput(self._flush()))

    def release_memory_occupation(self, tags=None):
        return self._request("release_memory_occupation", lambda s: None)

    def resume_memory_occupation(self, tags=None):
        return self._request("resume_memory_occupation", lambda s: None)

    def pause_generation(self, mode: str = "abort"):
        if not self.profile.pause_modes:  # SGLang <= 0.5.5: pause_generation() takes no mode
            raise TypeError("pause_generation() got an unexpected keyword argument 'mode'")
        if mode not in self.profile.pause_modes:
            raise ValueError(f"Invalid mode: {mode!r}. Expected one of "
                             f"{list(self.profile.pause_modes)}.")
        with self._step:
            self.paused = mode
            # Stand-in for the GPU work in flight (module docstring): the running step ends.
            self._step.wait_for(lambda: self._forwards == 0, self.stage_timeout)
        return self._request("pause_generation", lambda s: None)

    def continue_generation(self):
        out = self._request("continue_generation", lambda s: None)
        with self._step:
            self.paused = None
            self._step.notify_all()
        return out

    def generate(self, timeout: float = 60.0) -> Tuple[Tuple[float, float], ...]:
        """One forward step over every stage (module docstring): per (pp, tp), the sum and the
        sum of squares of the scheduler's parameters. Waits while an in-place pause holds."""
        with self._step:
            if not self._step.wait_for(lambda: self.paused is None, timeout):
                raise TimeoutError("generate: the engine stayed paused")
            self._forwards += 1
        try:
            self.calls.append("generate")
            out = []
            for p in range(self.pp):
                for t in range(self.tp):
                    ps = [x.detach().double()
                          for _, x in self.procs[(t, p)].model.named_parameters()]
                    out.append((round(float(sum(x.sum() for x in ps)), 6),
                                round(float(sum((x * x).sum() for x in ps)), 6)))
            return tuple(out)
        finally:
            with self._step:
                self._forwards -= 1
                self._step.notify_all()


def serve_sglang_http(engine: FakeSGLangEngine):
    """entrypoints/http_server.py in front of `engine` on 127.0.0.1: POST routes take the request
    dataclass's fields from the JSON body (unknown keys dropped, as the request models do), a GET
    on a POST-only route answers 405, an unknown route 404. Returns (base_url, server)."""
    import http.server

    io_struct = _io_struct(engine.profile)
    post = {"update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
            "init_weights_update_group": "InitWeightsUpdateGroupReqInput",
            "update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
            "destroy_weights_update_group": None, "pause_generation": None,
            "continue_generation": None, "release_memory_occupation": None,
            "resume_memory_occupation": None}
    if engine.profile.session_api:
        post.update(begin_weight_update="BeginWeightUpdateReqInput",
                    end_weight_update="EndWeightUpdateReqInput")

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _reply(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _flush(self):
            ok = engine.flush_cache().success
            return self._reply(200 if ok else 400, "Cache flushed." if ok else "Cache not flushed.")

        def do_GET(self):
            path = self.path.lstrip("/").partition("?")[0]
            if path == "get_server_info":
                return self._reply(200, dict(vars(engine.server_args),
                                             version=engine.profile.version))
            if path == "flush_cache":
                return self._flush()
            if path in post:
                return self._reply(405, {"detail": "Method Not Allowed"})
            self._reply(404, {"detail": "Not Found"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"null") or {}
            path = self.path.lstrip("/").partition("?")[0]
            if path == "flush_cache":
                return self._flush()
            if path not in post:
                return self._reply(404, {"detail": "Not Found"})
            cls = io_struct.get(post[path]) if post[path] else None
            if cls is not None:  # the request model keeps its own fields only
                names = {f.name for f in fields(cls)}
                body = {k: v for k, v in body.items() if k in names}
            try:
                if path == "update_weights_from_tensor":
                    out = engine.update_serialized(**body)
                elif path == "begin_weight_update":
                    out = engine.begin_weight_update()
                else:
                    out = getattr(engine, path)(**body)
            except Exception as e:  # noqa: BLE001 - the server answers 500, as FastAPI does
                return self._reply(500, {"detail": f"{type(e).__name__}: {e}"})
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], bool):
                out = {"success": out[0], "message": out[1]}
            self._reply(200, out)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv
