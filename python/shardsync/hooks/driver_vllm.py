"""VLLMDriver: vLLM's call sequences on every replica's head (see vllm.py for the hook).

- Native path (weight_transfer_config backend "shardsync", vLLM >= 0.22 with the four-phase
  API): init = `init_weight_transfer_engine(WeightTransferInitRequest(init_info=config))`; every
  round = `start_weight_update()` -> `update_weights(WeightTransferUpdateRequest(update_info=
  {"version": v}))` -> `finish_weight_update()`. Before PR #44353 (vLLM < 0.25) the worker owns
  start / finish and a start with is_checkpoint_format=True (its default) runs
  `initialize_layerwise_reload`; so the start says `is_checkpoint_format=False` wherever the
  engine takes it (in-process when its start_weight_update has the parameter, always over
  HTTP), and the backend's `receive_weights(info, load_weights=...)` is the whole round. In-process the request objects are the
  engine's own classes (vllm/distributed/weight_transfer/base.py: `LLM` accepts them or dicts,
  `AsyncLLM` only them); over HTTP the RLHF routes build them from `{"init_info": ...}` /
  `{"update_info": ...}` bodies (dev mode only).
- Extension path (any V1 vLLM, in-process): `collective_rpc("shardsync_init", args=(config,))`,
  then `collective_rpc("shardsync_sync", args=(v,))` per round.
- Staged commit (`Plan(commit="staged")`, extension path): `collective_rpc("shardsync_start")`
  starts the sync on a worker thread and returns, so the engine keeps stepping while it lands in
  staging (reports through the store, `shardsync_wait` joins), then `pause_generation(mode="keep",
  clear_cache=False)` (v1/engine/__init__.py PauseMode "keep": requests stay queued with their
  KV cache and resume on `resume_generation()`), `collective_rpc("shardsync_commit", args=(v,))`
  (copy + post-load on every worker), `resume_generation()`. Refused where the engine has no
  "keep" pause, and on the native path (its four phases have no commit step).
- AsyncLLM: every method above is `async def`; the EngineGroup awaits each on the engine's loop
  (`loop=`), bounded by its call timeout.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional

from ..errors import FailedPreconditionError, InvalidArgumentError
from .driver_base import _Driver
from .engines import require

__all__ = ["VLLMDriver"]


class VLLMDriver(_Driver):
    """Plays vLLM's call sequences on every replica's head (module docstring).

    path: "native", "extension", or "auto" (native when the engine has the four-phase API and
    its weight_transfer_config backend is "shardsync"). loop: the event loop an AsyncLLM runs on.
    draft: "refuse" (default) or "leave" a speculative draft model's weights as they are (the
    backend never retargets to it: supports_draft_weight_update is False)."""

    engine = "vllm"

    def __init__(self, group: Any, plan: Any, config: Dict[str, Any], *, path: str = "auto",
                 timeout: Optional[float] = None, draft: str = "refuse",
                 loop: Any = None) -> None:
        super().__init__(group, plan, config, timeout=timeout, draft=draft)
        if loop is not None:
            self.group.set_loop(loop)
        from . import vllm as vh

        self.vh = vh
        self.caps = caps = self._probe()
        if caps.asynchronous and getattr(self.group, "loop", None) is None:
            raise FailedPreconditionError(
                f"{caps.label}: the heads are async (AsyncLLM: async def weight-transfer "
                "methods): pass loop= (the event loop the engine runs on, running in its own "
                "thread) so every call is awaited there")
        if path == "auto":
            if caps.http:
                path = "native"
            else:
                path = "native" if caps.native and caps.backend == vh.BACKEND else "extension"
        if path == "native":
            require(caps, "dev_mode", "native", "request_classes")
            if not caps.http:
                require(caps, "backend")
        elif path == "extension":
            require(caps, "inproc", "collective_rpc")
        else:
            raise InvalidArgumentError(f"path: must be native, extension or auto, got {path!r}")
        self.path = path
        if self.staged:
            require(caps, "pause_in_place")
            if path != "extension":
                raise FailedPreconditionError(
                    f"{caps.label}: a staged commit needs a commit step, which the native "
                    "weight-transfer API (start / update / finish) has not: use path='extension'")
        self._req: Any = None
        if not caps.http and path == "native":
            from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found]
                WeightTransferInitRequest,
                WeightTransferUpdateRequest,
            )

            self._req = (WeightTransferInitRequest, WeightTransferUpdateRequest)

    def _facts(self, engine: Any) -> Dict[str, Any]:
        from .layout_check import vllm_facts

        if self.caps.http:
            return {}
        vc = getattr(engine, "vllm_config", None) or getattr(
            getattr(engine, "llm_engine", None), "vllm_config", None)
        return {} if vc is None else vllm_facts(vc, env={})

    def _init_request(self, d: int) -> Any:
        cfg = self.replica_config(d)
        return self._req[0](init_info=cfg) if self._req else {"init_info": cfg}

    def _update_request(self, version: int) -> Any:
        info = {"version": int(version)}
        return self._req[1](update_info=info) if self._req else {"update_info": info}

    def _refuse_sleeping(self) -> None:
        heads = self.group.head_engines
        # A method the engine class defines (never an attribute a proxy answers for any name).
        if not all(self.caps.http or inspect.getattr_static(type(e), "is_sleeping", None)
                   is not None for e in heads):
            return
        for d, s in enumerate(self.group.call("is_sleeping")):
            if s:
                raise FailedPreconditionError(
                    f"replica {d} is sleeping (is_sleeping() is True): "
                    "wake_up(tags=['weights']) before a sync")

    def init(self) -> Dict[str, Any]:
        if self.precheck_layout:
            self.precheck()
        init_id = self._new_init_id()
        if self.path == "native":
            self.group.call_each("init_weight_transfer_engine",
                                 lambda d: ((self._init_request(d),), {}))
        else:
            self.group.call_each("collective_rpc", lambda d: (
                ("shardsync_init",), {"args": (self.replica_config(d),)}))
        return self._collect("init", init_id)

    def sync(self, version: int) -> Dict[str, Any]:
        self._refuse_asleep()
        self._refuse_sleeping()
        v = int(version)
        if self.staged:
            return self._staged_round(v)
        if self.path == "native":
            kw = ({"is_checkpoint_format": False}
                  if self.caps.http or self.caps.lifecycle == "worker" else {})
            self.group.call("start_weight_update", **kw)
            try:
                self.group.call("update_weights", self._update_request(v))
            except BaseException:
                # vLLM's Worker clears its round when update_weights raised and then refuses a
                # finish ("without a matching start", gpu_worker.py): close the round on the
                # workers where it is still open, and report the first error, not that one.
                try:
                    self.group.call("finish_weight_update")
                except Exception:  # noqa: BLE001
                    pass
                raise
            self.group.call("finish_weight_update")
        else:
            self.group.call("collective_rpc", "shardsync_sync", args=(v,))
        return self._collect("sync", v)

    # ---- staged commit halves (driver_base._Driver._staged_round) ----
    def _transfer(self, v: int) -> Dict[str, Any]:
        """shardsync_start returns at once (the sync runs on a worker thread, so the engine core
        keeps stepping); every rank's report comes from the store; shardsync_wait joins."""
        self.group.call("collective_rpc", "shardsync_start", args=(v,))
        try:
            return self._collect("sync", v)
        finally:
            self.group.call("collective_rpc", "shardsync_wait")

    def _commit_call(self, op: str, v: int) -> None:
        self.group.call("collective_rpc", f"shardsync_{op}", args=(v,))

    def _pause(self) -> None:
        self.group.call("pause_generation", mode="keep", clear_cache=False)

    def _resume(self) -> None:
        self.group.call("resume_generation")

    def close(self) -> None:
        if self.path == "extension":
            self.group.call("collective_rpc", "shardsync_close")
