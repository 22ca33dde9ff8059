"""SGLang custom weight loader: one shardsync session per SGLang scheduler (one per GPU).

Written from reading SGLang's source (v0.5.x: `ServerArgs.custom_weight_loader`, and the
scheduler's `update_weights_from_tensor`, which for a load_format listed in
custom_weight_loader calls `dynamic_import(load_format)(model, named_tensors)` on every
scheduler); untested against a live engine here.

Launch: add the loader to the engine's server args
    sglang.Engine(..., custom_weight_loader=["shardsync.hooks.sglang.load_weights"])
    (CLI: --custom-weight-loader shardsync.hooks.sglang.load_weights)
and drive it from the head with update_weights_from_tensor, whose named_tensors carry the
command (the payload is the same for every rank, so SGLang's per-tp_rank payload indexing and
its PP fan-out do not matter):

    engine.update_weights_from_tensor(init_request(config), load_format=LOADER)
    engine.update_weights_from_tensor(wait_request(), load_format=LOADER)
    # each step, engine paused:
    engine.update_weights_from_tensor(start_request(version), load_format=LOADER)
    engine.update_weights_from_tensor(wait_request(), load_format=LOADER)

Why start + wait: SGLang handles a control request on pipeline stage 0 before forwarding it to
stage 1 (engine-layouts.md 4.1), so a blocking collective on stage 0 would wait for a stage that
has not received the request yet. `init` and `start` therefore run in a background thread of
each scheduler and return at once; `wait` joins it and raises its error. `sync_request` (start
and wait in one call) is only safe with pp == 1.

Each scheduler computes its global rank pp*T + tp from SGLang's parallel state (never the
stage-local tp_rank alone); the DP replica comes from config["replica"] or SHARDSYNC_REPLICA
(one SGLang engine per replica, its schedulers inherit the head's environment).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import EngineRankConfig, open_engine_session
from ..errors import FailedPreconditionError, InvalidArgumentError

__all__ = [
    "LOADER",
    "load_weights",
    "init_request",
    "start_request",
    "wait_request",
    "sync_request",
    "set_rank_provider",
    "last_result",
    "close",
]

LOADER = "shardsync.hooks.sglang.load_weights"
_PREFIX = "shardsync."

# Per scheduler state. SGLang calls the loader from each scheduler process's event-loop thread,
# so state keyed by the calling thread is per scheduler there, and lets tests run several
# "schedulers" as threads of one process.
_tls = threading.local()


def _st() -> Dict[str, Any]:
    st = getattr(_tls, "state", None)
    if st is None:
        st = {"session": None, "thread": None, "result": None, "error": None, "ranks": None}
        _tls.state = st
    return st


def set_rank_provider(fn: Optional[Callable[[], Tuple[int, int, int, int]]]) -> None:
    """Overrides how (tp_rank, pp_rank, tp_size, pp_size) are found for the calling scheduler
    thread (tests, other launchers)."""
    _st()["ranks"] = fn


def _ranks() -> Tuple[int, int, int, int]:
    fn = _st()["ranks"]
    if fn is not None:
        return fn()
    from sglang.srt.distributed import (  # type: ignore[import-not-found]
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    pp = get_pp_group()
    return (int(get_tensor_model_parallel_rank()), int(pp.rank_in_group),
            int(get_tensor_model_parallel_world_size()), int(pp.world_size))


def _torch() -> Any:
    import torch

    return torch


def init_request(config: EngineRankConfig) -> List[Tuple[str, Any]]:
    """named_tensors that make every scheduler open its session (asynchronously)."""
    torch = _torch()
    data = json.dumps(config).encode()
    return [(_PREFIX + "init", torch.tensor(list(data), dtype=torch.uint8))]


def start_request(version: int) -> List[Tuple[str, Any]]:
    torch = _torch()
    return [(_PREFIX + "start", torch.tensor([int(version)], dtype=torch.int64))]


def wait_request() -> List[Tuple[str, Any]]:
    torch = _torch()
    return [(_PREFIX + "wait", torch.zeros(1, dtype=torch.int64))]


def sync_request(version: int) -> List[Tuple[str, Any]]:
    """Start and wait in one call: only for pp == 1 (see the module docstring)."""
    torch = _torch()
    return [(_PREFIX + "sync", torch.tensor([int(version)], dtype=torch.int64))]


def _run_async(fn: Callable[[], Any]) -> None:
    st = _st()
    t = st["thread"]
    if t is not None:
        raise FailedPreconditionError("shardsync: a previous init/start was not waited for")
    st["result"], st["error"] = None, None

    def body() -> None:
        try:
            st["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the next wait
            st["error"] = e

    t = threading.Thread(target=body, name="shardsync", daemon=True)
    st["thread"] = t
    t.start()


def _wait() -> Any:
    st = _st()
    t = st["thread"]
    if t is None:
        raise FailedPreconditionError("shardsync: wait without a pending init or start")
    t.join()  # bounded: connect and sync each run under their own timeouts
    st["thread"] = None
    err, st["error"] = st["error"], None
    if err is not None:
        raise err
    return st["result"]


def _open(st: Dict[str, Any], model: Any, config: EngineRankConfig,
          ranks: Tuple[int, int, int, int]) -> Any:
    tp_rank, pp_rank, tp_size, pp_size = ranks
    replica = config.get("replica")
    if replica is None and os.environ.get("SHARDSYNC_REPLICA"):
        replica = int(os.environ["SHARDSYNC_REPLICA"])
    if st["session"] is not None:
        st["session"].close()
        st["session"] = None
    s = open_engine_session(config, tp_rank, pp_rank, tp_size, pp_size,
                            model.named_parameters(), replica=replica)
    st["session"] = s
    return {"sync_rank": s.rank, "tp_rank": tp_rank, "pp_rank": pp_rank}


def _sync(st: Dict[str, Any], version: int) -> Any:
    s = st["session"]
    if s is None:
        raise FailedPreconditionError("shardsync: start before a successful init on this scheduler")
    return s.sync(version)


def _post_load(model: Any) -> None:
    # SGLang's custom-loader path skips the hook that rebuilds derived weight caches (SGLang PR
    # #31937); run it on the scheduler thread once new weights have landed.
    hook = getattr(model, "post_load_weights", None)
    if callable(hook):
        hook()


def _values(t: Any) -> List[int]:
    if hasattr(t, "detach"):
        return t.detach().to("cpu").tolist()
    import numpy as np

    return np.asarray(t).tolist()


def load_weights(model: Any, named_tensors: List[Tuple[str, Any]]) -> None:
    """The custom loader SGLang calls on every scheduler with the request's named_tensors."""
    if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(_PREFIX):
        names = [n for n, _ in named_tensors][:3]
        raise InvalidArgumentError(f"shardsync loader: expected one shardsync.* command, got {names}")
    name, t = named_tensors[0]
    op = name[len(_PREFIX):]
    values = _values(t)
    st = _st()
    if op == "init":
        config = json.loads(bytes(values).decode())
        ranks = _ranks()  # on the scheduler thread: SGLang's parallel state lives there
        _run_async(lambda: _open(st, model, config, ranks))
    elif op == "start":
        version = int(values[0])
        st["post_load"] = True
        _run_async(lambda: _sync(st, version))
    elif op == "wait":
        post = st.pop("post_load", False)
        _wait()
        if post:
            _post_load(model)
    elif op == "sync":
        st["result"] = _sync(st, int(values[0]))
        _post_load(model)
    else:
        raise InvalidArgumentError(f"shardsync loader: unknown command {op!r}")


def last_result() -> Any:
    """The last finished init / sync result of the calling scheduler (report dict)."""
    return _st()["result"]


def close() -> None:
    """Closes the calling scheduler's session."""
    st = _st()
    if st["session"] is not None:
        st["session"].close()
        st["session"] = None
