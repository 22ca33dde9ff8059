"""SGLang: one shardsync session per scheduler (one per GPU), driven by JSON payloads only.

Two entry points, both written from SGLang's source (see docs/python.md for launch recipes):

1. External weight-update receiver (newer SGLang: `--weight-update-receivers`,
   `weight_sync/external_receiver.py`). `receiver(context)` is the factory SGLang imports;
   `init_weights_update_group(..., receiver=RECEIVER, receiver_init_payload=config)` builds one per
   scheduler; every round is `update_weights_from_distributed(names=[], dtypes=[], shapes=[],
   group_name, receiver_payload={...})`, which the scheduler hands to `receive(payload)` inside a
   try (model_runner_components/weight_updater.py `receive_weights_from_distributed`).
2. Custom weight loader (older SGLang, `--custom-weight-loader`, PR #7122): `load_weights(model,
   named_tensors)`, reached through `update_weights_from_tensor(..., load_format=LOADER)`.
   The command is JSON text in a `str` subclass, never a tensor: SGLang pickles named_tensors
   with its patched torch reductions (utils/patch_torch.py), whose `_modify_tuple` indexed arg 6
   of every reduced tensor, absent for CPU tensors (IndexError; UniRL issue #503), and moves each
   value with `.to(device)` (`_unwrap_tensor`), which `Command.to` answers with itself. The loader
   runs unguarded inside the scheduler (an exception there kills it), so it never raises.

Both paths take the same ops: `init` (capture ranks and config on the scheduler thread, then
bind + connect in the background), `start` (sync in the background), `wait` (join, then run the
model's post_load_weights on the scheduler thread and post the report), `sync` (start + wait in
one blocking call: pp == 1 only), `close`. Background because SGLang handles a control request on
pipeline stage 0 before forwarding it to stage 1 (engine-layouts.md 4.1): a blocking collective on
stage 0 would wait for a stage that has not seen the request. Every PP stage gets the same
per-tp_rank payload (`serialized_named_tensors[tp_rank]`), which is why the payload carries no
rank: each scheduler reads its own (tp, pp) from `sglang.srt.distributed`.

Newer SGLang asserts an open `begin_weight_update` session around every update and refreshes
derived weights / packed layouts only in `end_weight_update` (scheduler_components/
weight_updater.py); the drivers in driver.py bracket each round with begin ... end. Because the
scheduler marks the session "loaded" after a successful update round, `end_weight_update` then
skips `post_load_weights` (run_post_load = not loaded): the hook runs it itself in `wait`.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import FailedPreconditionError, InvalidArgumentError
from .core import EngineRankHook, Probe, make_status
from .layout_check import sglang_facts

__all__ = [
    "LOADER",
    "RECEIVER",
    "GROUP_NAME",
    "Command",
    "command",
    "init_request",
    "start_request",
    "wait_request",
    "sync_request",
    "close_request",
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
_NAME = "shardsync.cmd"
_OPS = ("init", "start", "wait", "sync", "close")

log = logging.getLogger("shardsync.hooks.sglang")


class Command(str):
    """JSON command text standing where SGLang expects a tensor: pickled as a str (no tensor
    reduction), and `.to(device)` (SGLang's `_unwrap_tensor`) returns itself."""

    def to(self, *args: Any, **kwargs: Any) -> "Command":
        return self

    def __reduce__(self) -> Any:
        return (Command, (str(self),))


def command(op: str, **fields: Any) -> List[Tuple[str, Command]]:
    """named_tensors for update_weights_from_tensor(..., load_format=LOADER)."""
    if op not in _OPS:
        raise InvalidArgumentError(f"op: must be one of {', '.join(_OPS)}, got {op!r}")
    return [(_NAME, Command(json.dumps(dict(fields, op=op))))]


def init_request(config: Dict[str, Any]) -> List[Tuple[str, Command]]:
    return command("init", config=config)


def start_request(version: int) -> List[Tuple[str, Command]]:
    return command("start", version=int(version))


def wait_request(timeout: Optional[float] = None) -> List[Tuple[str, Command]]:
    return command("wait", **({} if timeout is None else {"timeout": float(timeout)}))


def sync_request(version: int) -> List[Tuple[str, Command]]:
    """Start and wait in one blocking call: only with pp == 1 (see the module docstring)."""
    return command("sync", version=int(version))


def close_request() -> List[Tuple[str, Command]]:
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
    try:  # newer SGLang
        from sglang.srt.server_args import get_global_server_args  # type: ignore

        return get_global_server_args()
    except (ImportError, AttributeError):
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
    """The model-level post-load step SGLang skips for bypassed loads (derived weights)."""
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
        return hook.submit("sync", version, lambda: hook.do_sync(version, finalize=False),
                           post=False)
    if op == "wait":
        return _wait(hook, msg)
    if op == "sync":
        if hook.coord.get("pp_size", 1) != 1:
            return hook.refuse("sync", version, FailedPreconditionError(
                "sync (blocking start + wait) needs pp == 1: SGLang handles a request on stage 0 "
                "before forwarding it, so stage 0 would block on a stage that has not seen it; "
                "use start then wait"))
        return hook.sync(version)
    if op == "close":
        return hook.close()
    return hook.refuse(str(op), version, InvalidArgumentError(
        f"unknown shardsync op {op!r} (one of {', '.join(_OPS)})"))


def _wait(hook: EngineRankHook, msg: Dict[str, Any]) -> Dict[str, Any]:
    timeout = _timeout(hook, msg)
    statuses, err = hook.wait(timeout)
    out = make_status("wait", 0, hook.coord, jobs=len(statuses))
    for st in statuses:
        if st["op"] == "sync":
            if st["ok"]:
                # Post-load on the scheduler thread, after the bytes landed, then re-check that
                # no parameter was swapped.
                fin = hook._guard("sync", st["version"],
                                  lambda: hook.run_finalize("after sync") or {}, post=False)
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
        _tls.hook = hook
    hook._holder["model"] = model  # type: ignore[attr-defined]
    return hook


def load_weights(model: Any, named_tensors: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """The custom loader SGLang calls on every scheduler (LOADER). Never raises: returns the
    status (SGLang ignores it) and posts it to the store."""
    hook = _loader_hook(model)
    try:
        items = list(named_tensors)
        if len(items) != 1 or items[0][0] != _NAME:
            names = [str(n) for n, _ in items][:3]
            raise InvalidArgumentError(
                f"shardsync loader: expected one '{_NAME}' command, got {len(items)} item(s) "
                f"{names}")
        value = items[0][1]
        if not isinstance(value, str):
            raise InvalidArgumentError(
                f"shardsync loader: the command must be JSON text (shardsync.hooks.sglang."
                f"command), got a {type(value).__name__}")
        msg = json.loads(str(value))
        if not isinstance(msg, dict):
            raise InvalidArgumentError("shardsync loader: the command must be a JSON object")
        st = _dispatch(hook, msg)
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
