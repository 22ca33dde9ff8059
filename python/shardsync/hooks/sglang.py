"""SGLang: one shardsync session per scheduler (one per GPU), driven by small commands.

Two entry points, both written from SGLang's source (see docs/python.md for launch recipes and
the version table; `engines.py` probes which one the running engine has):

1. Custom weight loader (`--custom-weight-loader`, PR #7122, v0.4.7+; SGLang main releases
   and sglang-miles alike):
   `load_weights(model, named_tensors)`, reached through `update_weights_from_tensor(
   serialized_named_tensors, load_format=LOADER, flush_cache=False)`. The scheduler unpickles
   `serialized_named_tensors[tp_rank]` with `MultiprocessingSerializer.deserialize`
   (srt/utils/common.py) outside any try, then calls `_unwrap_tensor(value, tp_rank, device)
   .to(device)` on every value and the loader with no try: anything that raises there kills the
   scheduler and the engine. The command is therefore a plain `torch.nn.Module` carrying JSON
   text in one attribute (`shardsync_command`):
   - it pickles as `torch.nn.modules.module.Module` + `collections.OrderedDict`, both inside
     every `SafeUnpickler.ALLOWED_MODULE_PREFIXES` we read ("torch.", "collections.", since
     PR #11909, Oct 2025, CVE-2025-10164); a class of ours ("shardsync.") is "Blocked unsafe
     class loading", and plain pickle (older SGLang) accepts anything;
   - it holds no tensor, so the patched torch reductions (utils/patch_torch.py, whose
     `_modify_tuple` indexed arg 6 of every reduced tensor: IndexError for CPU tensors, UniRL
     #503) never run, and no CUDA IPC handle is opened (a pp>0 stage sits on another GPU);
   - `Module.to(device)` with no parameters returns itself without touching the device, so
     `_unwrap_tensor` cannot fail; a plain `str` would (no `.to`).
   Every PP stage reads the same per-tp_rank payload, so the command carries no rank: each
   scheduler reads its own (tp, pp) from `sglang.srt.distributed`.
2. External weight-update receiver (`--weight-update-receivers`, `weight_sync/
   external_receiver.py`): only on the sglang-miles branch, not SGLang main (stock `Engine`
   raises TypeError on the receiver keywords; over HTTP they are dropped and SGLang opens a torch
   process group at the store's address). The drivers use it only where `engines.probe` found it.

Ops (both paths): `init` (capture ranks and config on the scheduler thread, then bind + connect
in the background), `start` (sync in the background), `wait` (join, post-load on the scheduler
thread, report), `sync` (start + wait: pp == 1 only), `close`. Background because SGLang handles
a control request on stage 0 before forwarding it to stage 1 (engine-layouts.md 4.1).

Speculative decoding: the scheduler calls the loader once per model runner, in an order that
depends on the SGLang line: SGLang main's EAGLE worker calls the draft runner first, then the
target (sgl-project/sglang 006b0e3, speculative/eagle_worker_v2.py `EAGLEWorkerV2.
update_weights_from_tensor`: `self.draft_worker.draft_runner.update_weights_from_tensor(...)`,
then `self.target_worker.model_runner...`; the scheduler hands the request to `self.draft_worker
or self.tp_worker`), while sglang-miles' `SchedulerWeightUpdaterManager.get_model_runners` yields
the target first. So the hook never binds "the first call": at init it binds the runner whose
parameters are the plan's (every name the shard map gives this rank), deferring a runner that
is not until the one that is arrives; an init no runner matches binds the runner that came, at
the next request, and fails there naming the parameter. Every command carries a nonce (`seq`);
the bound runner handles it once, any other runner is "another runner of the same request": it
never rebinds or syncs. The plan covers the target model only, so the draft is refused unless
the config says `draft: "leave"` (its weights then stay as they are).

Post-load runs in the hook's `wait` on every path. With the begin/end session (sglang-miles,
PRs #28710 + #28001) `end_weight_update` runs `post_load_weights` only when no update ran in the
session (`run_post_load = not self._weight_update_loaded`, srt/managers/scheduler_components/
weight_updater.py `SchedulerWeightUpdaterManager.end_weight_update`, sgl-project/sglang 00a2ca2;
per runner `WeightUpdater.end_weight_update(run_post_load=)` -> `post_load_weights(model)` +
`DefaultModelLoader.postprocess_weights`, 027814e). Every successful update marks the session
loaded: `update_weights_from_tensor` (our loader rounds), and `update_weights_from_distributed`,
which sets `_weight_update_loaded = True` after `load_weights(weights)` on every runner (00a2ca2)
and so also after a receiver round, whose `WeightUpdater.receive_weights_from_distributed` calls
`external.receive(receiver_payload)` and returns no weights (the receiver-bearing weight_updater.py
of the sglang-miles line). Nothing shows the engine running post-load after either kind of
round, so the hook runs it itself; SGLang's `end_weight_update` then runs the quant methods'
`process_weights_after_loading`, in SGLang's own order (post-load first).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import FailedPreconditionError, InvalidArgumentError
from .core import EngineRankHook, Probe, make_status
from .layout_check import sglang_facts

__all__ = [
    "LOADER",
    "RECEIVER",
    "GROUP_NAME",
    "ATTR",
    "command",
    "command_text",
    "serialize_for_http",
    "payload_error",
    "init_request",
    "start_request",
    "wait_request",
    "sync_request",
    "close_request",
    "commit_request",
    "rollback_request",
    "receiver_payload",
    "load_weights",
    "receiver",
    "ShardsyncReceiver",
    "SGLangProbe",
    "last_result",
    "close",
]

LOADER = "shardsync.hooks.sglang.load_weights"
RECEIVER = "shardsync.hooks.sglang.receiver"
GROUP_NAME = "shardsync"
ATTR = "shardsync_command"  # the attribute of the command Module holding the JSON text
_NAME = "shardsync.cmd"
_OPS = ("init", "start", "wait", "sync", "close", "commit", "rollback")

log = logging.getLogger("shardsync.hooks.sglang")


def command(op: str, **fields: Any) -> List[Tuple[str, Any]]:
    """named_tensors for update_weights_from_tensor(..., load_format=LOADER): one plain
    torch.nn.Module whose `shardsync_command` attribute is the JSON command (module docstring)."""
    if op not in _OPS:
        raise InvalidArgumentError(f"op: must be one of {', '.join(_OPS)}, got {op!r}")
    import torch

    fields.setdefault("seq", os.urandom(8).hex())
    m = torch.nn.Module()
    setattr(m, ATTR, json.dumps(dict(fields, op=op)))
    return [(_NAME, m)]


def command_text(value: Any) -> Optional[str]:
    """The JSON text of a command value, or None when it is not one."""
    text = getattr(value, ATTR, None) if not isinstance(value, (str, bytes)) else None
    return text if isinstance(text, str) else None


def serialize_for_http(named: List[Tuple[str, Any]], tp_size: int) -> List[str]:
    """`serialized_named_tensors` for POST /update_weights_from_tensor: one base64 pickle per tp
    rank (the scheduler indexes it by tp_rank), as MultiprocessingSerializer.serialize(output_str=
    True) writes it; the command holds no tensor, so plain pickle gives ForkingPickler's bytes."""
    blob = base64.b64encode(pickle.dumps(named)).decode()
    return [blob] * int(tp_size)


def payload_error() -> Optional[str]:
    """Round-trips a command through this process's SGLang serializer and `_unwrap_tensor`
    step; None when the installed SGLang accepts it, else why not."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found]
    except ImportError as e:
        return f"sglang.srt.utils.MultiprocessingSerializer is not importable ({e})"
    try:
        named = command("wait", timeout=0.0)
        out = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(named))
        value = out[0][1].to("cpu")
        if command_text(value) is None:
            return f"the command came back as a {type(value).__name__} without {ATTR}"
        return None
    except Exception as e:  # noqa: BLE001 - the answer is the error
        return f"{type(e).__name__}: {e}"


def init_request(config: Dict[str, Any]) -> List[Tuple[str, Any]]:
    return command("init", config=config)


def start_request(version: int) -> List[Tuple[str, Any]]:
    return command("start", version=int(version))


def wait_request(timeout: Optional[float] = None, post_load: bool = True) -> List[Tuple[str, Any]]:
    extra: Dict[str, Any] = {} if timeout is None else {"timeout": float(timeout)}
    return command("wait", post_load=bool(post_load), **extra)


def sync_request(version: int) -> List[Tuple[str, Any]]:
    """Start and wait in one blocking call: only with pp == 1 (see the module docstring)."""
    return command("sync", version=int(version))


def commit_request(version: int) -> List[Tuple[str, Any]]:
    """Staged commit of a verified version (in the background, like start; `wait` joins it and
    runs post-load on the scheduler thread)."""
    return command("commit", version=int(version))


def rollback_request(version: int) -> List[Tuple[str, Any]]:
    """Staged commit: back to the version committed before `version` (background; `wait`)."""
    return command("rollback", version=int(version))


def close_request() -> List[Tuple[str, Any]]:
    return command("close")


def receiver_payload(op: str, **fields: Any) -> Dict[str, Any]:
    """receiver_payload for update_weights_from_distributed on a receiver group."""
    if op not in _OPS:
        raise InvalidArgumentError(f"op: must be one of {', '.join(_OPS)}, got {op!r}")
    return dict(fields, op=op)


# ---------------------------------------------------------------------------------------------
# What the hook reads from the scheduler process
# ---------------------------------------------------------------------------------------------


def _server_args() -> Any:
    # srt/server_args.py `get_global_server_args()` returns the scheduler's `_global_server_args`
    # (set by set_global_server_args_for_scheduler; ValueError while unset). Older SGLang:
    # srt/managers/schedule_batch.py `global_server_args_dict = {k: getattr(ServerArgs, k) for k
    # in GLOBAL_SERVER_ARGS_KEYS}`, a subset of the fields only (sglang_facts reports the missing
    # layout fields as unknown). Any failure of the getter (unset, or a version where it raises)
    # falls through: the hook never raises into the scheduler, and without facts the
    # per-parameter checks still run.
    try:  # newer SGLang
        from sglang.srt.server_args import get_global_server_args  # type: ignore

        return get_global_server_args()
    except Exception:  # noqa: BLE001 - see above
        pass
    try:  # older SGLang kept a dict on schedule_batch
        from sglang.srt.managers.schedule_batch import global_server_args_dict  # type: ignore

        return global_server_args_dict
    except ImportError:
        return None


class SGLangProbe(Probe):
    engine = "sglang"

    def __init__(self, context: Any = None) -> None:
        self._ctx = context
        self._facts: Optional[Dict[str, Any]] = None

    def ranks(self) -> Tuple[int, int, int, int]:
        # get_pp_group() returns a GroupCoordinator with rank_in_group / world_size (vLLM
        # lineage: vllm/distributed/parallel_state.py get_pp_group; vLLM's own worker reads
        # get_pp_group().rank_in_group, v1/worker/gpu_worker.py). SGLang's re-export from
        # sglang.srt.distributed was not confirmed from SGLang's source when this was written.
        from sglang.srt.distributed import (  # type: ignore[import-not-found]
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pp = get_pp_group()
        tp_rank = int(get_tensor_model_parallel_rank())
        tp_size = int(get_tensor_model_parallel_world_size())
        ctx = self._ctx
        if ctx is not None and (int(ctx.tp_rank), int(ctx.tp_size)) != (tp_rank, tp_size):
            raise InvalidArgumentError(
                f"receiver context says tp_rank={ctx.tp_rank}/{ctx.tp_size}, the parallel state "
                f"{tp_rank}/{tp_size}")
        return tp_rank, int(pp.rank_in_group), tp_size, int(pp.world_size)

    def facts(self) -> Dict[str, Any]:
        # Read once, on the scheduler thread (capture); server args do not change at runtime,
        # and the hook's background thread then reuses them.
        if self._facts is None:
            sa = _server_args()
            self._facts = sglang_facts(sa) if sa is not None else {}
        return self._facts

    def memory(self, tensors: Sequence[Tuple[str, Any]]) -> Dict[str, Any]:
        # --enable-memory-saver allocates weights through torch_memory_saver (CUDA VMM), which
        # cudaIpcGetMemHandle cannot export. Release/resume state is tracked by the driver.
        from ..session import is_cuda_tensor

        if self.facts().get("memory_saver"):
            return {"cumem": [n for n, t in tensors if is_cuda_tensor(t)], "asleep": []}
        return {"cumem": [], "asleep": []}


def _post_load(model: Any) -> None:
    """The model-level post-load step SGLang skips for bypassed loads (derived weights).
    srt/model_loader/loader.py `post_load_weights(model)`: imported and called so by
    model_executor/model_runner_components/weight_updater.py WeightUpdater.end_weight_update
    (sglang 027814e)."""
    try:
        from sglang.srt.model_loader.loader import post_load_weights  # type: ignore
    except ImportError:
        post_load_weights = None
    if post_load_weights is not None:
        post_load_weights(model)
        return
    hook = getattr(model, "post_load_weights", None)
    if callable(hook):
        hook()


def _new_hook(get_model: Any, context: Any = None) -> EngineRankHook:
    return EngineRankHook("sglang", get_model, SGLangProbe(context), finalize=_post_load)


# ---------------------------------------------------------------------------------------------
# Ops shared by both entry points
# ---------------------------------------------------------------------------------------------


def _timeout(hook: EngineRankHook, msg: Dict[str, Any]) -> float:
    if msg.get("timeout") is not None:
        return float(msg["timeout"])
    cfg = hook.config or {}
    return float(cfg.get("connect_timeout", 60.0)) + float(cfg.get("sync_timeout", 60.0)) + 30.0


def _dispatch(hook: EngineRankHook, msg: Dict[str, Any]) -> Dict[str, Any]:
    try:
        return _dispatch_op(hook, msg)
    except BaseException as e:  # noqa: BLE001 - never raise into the scheduler
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return hook.refuse(str(msg.get("op")), 0, e)


def _dispatch_op(hook: EngineRankHook, msg: Dict[str, Any]) -> Dict[str, Any]:
    op = msg.get("op")
    version = msg.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise InvalidArgumentError(f"version: expected an integer, got {version!r}")
    if op == "init":
        config = msg.get("config")
        if hook.busy:
            return hook.refuse("init", 0, FailedPreconditionError(
                "init while a previous init/start is still pending (send wait first)"))
        st = hook.capture(config)
        if not st["ok"]:
            return st
        init_id = config.get("init_id", 0)  # capture checked it
        hook.submit("init", init_id, hook.open_body, post=True)
        return dict(st, op="init", version=init_id, queued=True)
    if op == "start":
        if hook.config is None:
            return hook.refuse("sync", version,
                               FailedPreconditionError("start before init on this rank"))
        # Staged: the status goes to the store when the transfer ends (the driver reads it
        # while the engine serves; `wait` only joins). In place, `wait` posts it after post-load.
        return hook.submit("sync", version, lambda: hook.do_sync(version, finalize=False),
                           post=hook.staged)
    if op == "wait":
        return _wait(hook, msg)
    if op == "sync":
        if hook.coord.get("pp_size", 1) != 1:
            return hook.refuse("sync", version, FailedPreconditionError(
                "sync (blocking start + wait) needs pp == 1: SGLang handles a request on stage 0 "
                "before forwarding it, so stage 0 would block on a stage that has not seen it; "
                "use start then wait"))
        return hook.sync(version)
    if op in ("commit", "rollback"):
        # Collective over the commit scope, which spans PP stages: in the background, as start.
        if hook.config is None:
            return hook.refuse(op, version, FailedPreconditionError(f"{op} before init"))
        if op == "commit":
            return hook.submit("commit", version,
                               lambda: hook.do_commit(version, finalize=False), post=False)
        return hook.submit("rollback", version, lambda: hook.do_rollback(finalize=False),
                           post=False)
    if op == "close":
        return hook.close()
    return hook.refuse(str(op), version, InvalidArgumentError(
        f"unknown shardsync op {op!r} (one of {', '.join(_OPS)})"))


def _wait(hook: EngineRankHook, msg: Dict[str, Any]) -> Dict[str, Any]:
    timeout = _timeout(hook, msg)
    statuses, err = hook.wait(timeout)
    out = make_status("wait", 0, hook.coord, jobs=len(statuses))
    post_load = bool(msg.get("post_load", True))
    for st in statuses:
        if st["op"] in ("sync", "commit", "rollback"):
            # Staged syncs changed nothing the engine reads: post-load follows their commit.
            if st["ok"] and not st.get("staged"):
                # Post-load on the scheduler thread, after the bytes landed (unless the engine's
                # end_weight_update runs it: module docstring), then re-check that no parameter
                # was swapped.
                when = "after " + st["op"]
                fin = hook._guard(st["op"], st["version"],
                                  lambda: hook.run_finalize(when, run=post_load) or {},
                                  post=False)
                if not fin["ok"]:
                    st = dict(st, ok=False, error=fin["error"], code=fin["code"])
            st = hook.post(st)
            hook.last = st
        if not st["ok"] and out["ok"]:
            out.update(ok=False, error=st["error"], code=st["code"])
    if err is not None:
        # Report the still-running job as failed now, so the driver sees it without waiting
        # for its own timeout; the job keeps running and the session poisons itself on failure.
        with hook._lock:
            pending = list(hook._pending)
        for j in pending:
            hook.post(make_status(j.op, j.version, hook.coord, error=err))
        out.update(ok=False, error=f"{type(err).__name__}: {err}", code=err.code)
    if not statuses or err is not None:
        hook.last = out
    return out


# ---------------------------------------------------------------------------------------------
# Entry point 1: external weight-update receiver
# ---------------------------------------------------------------------------------------------


class ShardsyncReceiver:
    """What `receiver(context)` returns: SGLang calls receive(payload) and destroy()."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.hook = _new_hook(lambda: context.model, context)
        self.last: Optional[Dict[str, Any]] = None
        config = getattr(context, "init_payload", None)
        if config is None:
            self.last = make_status("init", 0, {}, error=InvalidArgumentError(
                "receiver_init_payload: missing (pass the shardsync config as "
                "receiver_init_payload to init_weights_update_group)"))
            log.error("shardsync receiver: %s", self.last["error"])
            return
        self.last = _dispatch(self.hook, {"op": "init", "config": config})

    def receive(self, payload: Optional[Dict[str, Any]]) -> None:
        try:
            if not isinstance(payload, dict):
                raise InvalidArgumentError(
                    f"receiver_payload: expected a JSON object, got {type(payload).__name__}")
            if payload.get("op") == "init":
                raise InvalidArgumentError(
                    "op init goes through init_weights_update_group(receiver_init_payload=...)")
            self.last = _dispatch(self.hook, payload)
        except BaseException as e:  # noqa: BLE001 - never raise into the scheduler
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.last = self.hook.refuse("receive", 0, e)
        if not self.last.get("ok", False):
            log.error("shardsync receiver: %s", self.last.get("error"))

    def destroy(self) -> None:
        self.last = self.hook.close()


def receiver(context: Any) -> ShardsyncReceiver:
    """The factory named in --weight-update-receivers (RECEIVER)."""
    return ShardsyncReceiver(context)


# ---------------------------------------------------------------------------------------------
# Entry point 2: custom weight loader
# ---------------------------------------------------------------------------------------------

# One SGLang scheduler per process calls the loader from its event-loop thread; state keyed by
# that thread is per scheduler there, and lets tests run schedulers as threads of one process.
_tls = threading.local()


def _loader_hook(model: Any) -> EngineRankHook:
    hook = getattr(_tls, "hook", None)
    if hook is None:
        holder = {"model": model}
        hook = _new_hook(lambda: holder["model"])
        hook._holder = holder  # type: ignore[attr-defined]
        hook._bound = False  # type: ignore[attr-defined]  # an init chose a runner
        hook._seq = None  # type: ignore[attr-defined]  # the request being handled
        hook._done = False  # type: ignore[attr-defined]  # the bound runner handled it
        hook._deferred = []  # type: ignore[attr-defined]  # init runners that are not the plan's
        hook._deferred_msg = None  # type: ignore[attr-defined]
        _tls.hook = hook
    return hook


def _parse(named_tensors: Any) -> Dict[str, Any]:
    items = list(named_tensors)
    if len(items) != 1 or items[0][0] != _NAME:
        names = [str(n) for n, _ in items][:3]
        raise InvalidArgumentError(
            f"shardsync loader: expected one '{_NAME}' command, got {len(items)} item(s) {names}")
    text = command_text(items[0][1])
    if text is None:
        raise InvalidArgumentError(
            f"shardsync loader: the command must be a torch.nn.Module with a '{ATTR}' text "
            f"attribute (shardsync.hooks.sglang.command), got a {type(items[0][1]).__name__}")
    msg = json.loads(text)
    if not isinstance(msg, dict):
        raise InvalidArgumentError("shardsync loader: the command must be a JSON object")
    return msg


def _plan_model(hook: EngineRankHook, model: Any) -> bool:
    """Whether `model` holds every parameter the plan gives this rank (by name): the target
    runner, not a speculative draft (a few layers of its own)."""
    expected = hook.plan.shard_map().rank(hook.coord["tp_rank"], hook.coord["pp_rank"]).params
    have = {n for n, _ in model.named_parameters()}
    return all(p.name in have for p in expected)


def _other_runner(hook: EngineRankHook, model: Any, msg: Dict[str, Any]) -> Dict[str, Any]:
    """A call for the same request (same seq) with a runner the hook did not bind: the
    speculative draft. It never rebinds nor syncs; without draft='leave' the job fails by name."""
    op = str(msg.get("op"))
    cfg = hook.config or {}
    if cfg.get("draft") == "leave":
        return make_status(op, 0, hook.coord, draft="left untouched")
    why = (f"speculative decoding: SGLang called the loader for a second model runner "
           f"({type(model).__name__}, the draft) on request '{op}'; the plan covers the target "
           "model only, so the draft's weights would go stale. Launch without speculative "
           "decoding, or pass draft='leave' to the driver to keep the draft as it is")
    hook.fatal = why
    iid = cfg.get("init_id", 0)
    return hook.refuse("init" if op == "init" else "sync",
                       iid if op == "init" else int(msg.get("version", 0) or 0),
                       FailedPreconditionError(why))


def _bind_init(hook: EngineRankHook, model: Any, msg: Dict[str, Any]) -> Dict[str, Any]:
    """Binds `model` (captured config) and queues the init job; the runners deferred for this
    request are then other runners."""
    hook._holder["model"] = model  # type: ignore[attr-defined]
    hook._bound = True  # type: ignore[attr-defined]
    hook._done = True  # type: ignore[attr-defined]
    init_id = msg["config"].get("init_id", 0)
    deferred, hook._deferred = hook._deferred, []  # type: ignore[attr-defined]
    for other in deferred:  # a draft called first: refused before anything binds
        o = _other_runner(hook, other, msg)
        if not o.get("ok"):
            return o
    hook.submit("init", init_id, hook.open_body, post=True)
    return make_status("init", init_id, hook.coord, queued=True)


def _flush_deferred(hook: EngineRankHook) -> None:
    """An init no runner of the request matched: bind the runner that came, so its init fails
    naming the parameter (open_body's checks) instead of never reporting."""
    if hook._deferred and not hook._done:  # type: ignore[attr-defined]
        _bind_init(hook, hook._deferred[0], hook._deferred_msg)  # type: ignore[attr-defined]
    hook._deferred, hook._deferred_msg = [], None  # type: ignore[attr-defined]


def _init(hook: EngineRankHook, model: Any, msg: Dict[str, Any]) -> Dict[str, Any]:
    if hook._done:  # type: ignore[attr-defined]  # the plan's runner already took it
        return _other_runner(hook, model, msg)
    if hook.busy:
        return hook.refuse("init", 0, FailedPreconditionError(
            "init while a previous init/start is still pending (send wait first)"))
    config = msg.get("config")
    st = hook.capture(config)
    if not st["ok"]:
        hook._done = True  # type: ignore[attr-defined]
        return st
    if _plan_model(hook, model):
        return _bind_init(hook, model, msg)
    hook._deferred.append(model)  # type: ignore[attr-defined]
    hook._deferred_msg = msg  # type: ignore[attr-defined]
    return make_status("init", 0, hook.coord, deferred=(
        f"{type(model).__name__} lacks the plan's parameters (a speculative draft runner?): "
        "waiting for the runner that holds them"))


def load_weights(model: Any, named_tensors: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """The custom loader SGLang calls on every scheduler (LOADER). Never raises: returns the
    status (SGLang ignores it) and posts it to the store.
    Called as `dynamic_import(load_format)(self.get_model(), named_tensors)` with no try, after
    `_unwrap_tensor(tensor, tp_rank=, device=)` (= `tensor.to(device)`), when `load_format in
    self.custom_weight_loaders`: model_runner_components/weight_updater.py
    WeightUpdater.update_weights_from_tensor (sglang 027814e); once per model runner, the
    speculative draft's included, in the engine's order (module docstring)."""
    hook = _loader_hook(model)
    try:
        msg = _parse(named_tensors)
        seq = msg.get("seq")
        if seq is None or seq != hook._seq:  # type: ignore[attr-defined]  # a new request
            _flush_deferred(hook)
            hook._seq, hook._done = seq, False  # type: ignore[attr-defined]
        holder = hook._holder  # type: ignore[attr-defined]
        if msg.get("op") == "init":
            st = _init(hook, model, msg)
        elif not hook._bound or model is holder["model"]:  # type: ignore[attr-defined]
            if hook._done:  # type: ignore[attr-defined]
                st = make_status(str(msg.get("op")), 0, hook.coord, duplicate=True)
            else:
                if not hook._bound:  # type: ignore[attr-defined]  # before any init
                    holder["model"] = model
                hook._done = True  # type: ignore[attr-defined]
                st = _dispatch(hook, msg)
        elif hook.plan is not None and _plan_model(hook, model):
            raise FailedPreconditionError(
                "the model SGLang passes is not the one bound at init (reloaded?): re-init")
        else:
            st = _other_runner(hook, model, msg)
    except BaseException as e:  # noqa: BLE001 - an exception here would kill the scheduler
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        st = hook.refuse("load_weights", 0, e)
    if not st.get("ok", False):
        log.error("shardsync loader: %s", st.get("error"))
    _tls.last = st
    return st


def last_result() -> Optional[Dict[str, Any]]:
    """The calling scheduler's last status (custom-loader path)."""
    hook = getattr(_tls, "hook", None)
    return None if hook is None else hook.last


def close() -> None:
    """Closes the calling scheduler's session (custom-loader path)."""
    hook = getattr(_tls, "hook", None)
    if hook is not None:
        hook.close()
        _tls.hook = None
