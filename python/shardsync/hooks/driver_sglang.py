"""SGLangDriver: SGLang's call sequences on every replica's head (see sglang.py for the hook).

- Loader path (SGLang >= 0.4.7 and sglang-miles, `--custom-weight-loader
  shardsync.hooks.sglang.load_weights`): init
  = [begin] `update_weights_from_tensor(init command)` + wait [end]; every round = [begin] start
  -> wait [end], each an `update_weights_from_tensor(command, load_format=LOADER,
  flush_cache=False)`. In-process engines and SGLang servers alike (the command is a pickle of a
  plain `torch.nn.Module`, sent base64 over HTTP).
- Receiver path (sglang-miles only): init = `init_weights_update_group(receiver=RECEIVER,
  receiver_init_payload=config)`; every round = `update_weights_from_distributed(names=[],
  receiver_payload={"op": ...})`.
- begin/end (`begin_weight_update` ... `end_weight_update`) bracket every request where the
  engine has the session (sglang-miles branch work, PRs #28710 + #28001: its scheduler asserts an
  open session around every update) and never where it has not (SGLang main releases);
  `engines.probe` decides, from the io_struct classes or the routes, never from the version.
- Post-load runs in the hook's `wait` on both paths (sglang.py docstring: sglang-miles marks a
  receiver round loaded too, so its `end_weight_update` skips post-load).
- Refused before any request (`engines.require`): a head launched with `--weight-cache-mode`
  other than off (SGLang's `WeightUpdater._assert_weight_cache_inactive` raises before any
  loader, and with no try around it the scheduler dies).
- Staged commit (`Plan(commit="staged")`): start -> wait while the engine serves (bytes land in
  staging), then `pause_generation(mode="in_place")` (requests and their KV cache stay: io_struct
  `PauseGenerationReqInput`, scheduler `pause_generation` only sets `_engine_paused`), a commit
  round (commit -> wait, post-load on every scheduler), `continue_generation()`. Refused where
  the engine has no in-place pause (`engines.require(caps, "pause_in_place")`). The prefix cache
  keeps the KV computed before the commit, as the in-place pause intends: no flush.
- The cache is flushed once per round after `end`, through `flush_cache` (retried until it
  answers success or `flush_timeout`): an update request's own `flush_cache=True` asserts inside
  the scheduler unless generation is fully idle (`flush_cache_after_weight_update`), which would
  kill it; the separate call answers False instead. `flush="with-update"` (for heads without a
  flush_cache call, e.g. UniRL's wrapper, whose callers pause generation around a sync) asks it
  of the round's last update; `flush="off"` leaves the cache alone.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import Error, FailedPreconditionError, InvalidArgumentError, UnimplementedError
from .driver_base import _check_replies, _Driver
from .engines import require

__all__ = ["SGLangDriver"]


def _flushed(reply: Any) -> bool:
    if isinstance(reply, bool):
        return reply
    if isinstance(reply, tuple) and reply and isinstance(reply[0], bool):
        return reply[0]
    ok = getattr(reply, "success", None)  # FlushCacheReqOutput
    if isinstance(ok, bool):
        return ok
    return reply is None  # an Engine API that returns nothing raised nothing either


class SGLangDriver(_Driver):
    """Plays SGLang's call sequences on every replica's head (module docstring).

    path: "loader", "receiver", or "auto" (the loader when the heads list it, else the receiver
    when the engine has receivers and lists ours). session: "auto" (what the engine has), or
    True / False, refused when the engine disagrees. draft: "refuse" (default) or "leave" a
    speculative draft model's weights as they are."""

    engine = "sglang"

    def __init__(self, group: Any, plan: Any, config: Dict[str, Any], *, path: str = "auto",
                 session: Any = "auto", group_name: str = "shardsync",
                 timeout: Optional[float] = None, draft: str = "refuse",
                 flush: str = "separate", flush_timeout: float = 30.0,
                 replicas: Optional[Sequence[int]] = None) -> None:
        super().__init__(group, plan, config, timeout=timeout, draft=draft, replicas=replicas)
        from . import sglang as ss

        self.ss = ss
        self.caps = caps = self._probe()
        if path == "auto":
            path = "loader" if caps.loader_listed else (
                "receiver" if caps.receiver and caps.receiver_listed else "loader")
        if path == "loader":
            require(caps, "loader", "loader_listed", "payload", "weight_cache")
        elif path == "receiver":
            require(caps, "receiver", "receiver_listed", "weight_cache")
        else:
            raise InvalidArgumentError(f"path: must be loader, receiver or auto, got {path!r}")
        self.path = path
        if session == "auto":
            session = caps.session_api
        elif bool(session) != caps.session_api:
            raise UnimplementedError(
                f"{caps.label}: session={session!r} but the engine "
                + ("asserts an open begin_weight_update session around every update"
                   if caps.session_api else "has no begin/end_weight_update")
                + "; leave session='auto'")
        self.session = bool(session)
        self.group_name = group_name
        if self.staged:
            require(caps, "pause_in_place")
        if flush not in ("separate", "with-update", "off"):
            raise InvalidArgumentError(
                f"flush: must be separate, with-update or off, got {flush!r}")
        self.flush_mode, self.flush_timeout = flush, float(flush_timeout)

    def _facts(self, engine: Any) -> Dict[str, Any]:
        from .layout_check import sglang_facts

        try:
            sa = getattr(engine, "server_args", None)
        except Error:
            return {}
        # The driver's environment is not the engine's: env-derived fields are checked by ranks.
        return {} if sa is None else sglang_facts(sa, env={})

    def _bracket(self, body: Callable[[], None]) -> None:
        if not self.session:
            body()
            return
        _check_replies("begin_weight_update", self.group.call("begin_weight_update"))
        try:
            body()
        finally:
            # Always close the session: a second begin on an open one asserts in the scheduler.
            _check_replies("end_weight_update", self.group.call("end_weight_update"))

    def _loader(self, named: List[Tuple[str, Any]], flush_cache: bool = False) -> None:
        _check_replies("update_weights_from_tensor", self.group.call(
            "update_weights_from_tensor", named, load_format=self.ss.LOADER,
            flush_cache=flush_cache))

    def _receive(self, payload: Dict[str, Any], flush_cache: bool = False) -> None:
        _check_replies("update_weights_from_distributed", self.group.call(
            "update_weights_from_distributed", names=[], dtypes=[], shapes=[],
            group_name=self.group_name, receiver_payload=payload, flush_cache=flush_cache))

    def flush(self) -> None:
        """Flushes every replica's cache, retrying while SGLang answers not-idle (bounded)."""
        deadline = time.monotonic() + self.flush_timeout
        pending = list(range(self.group.dp))
        while True:
            replies = self.group.call("flush_cache")
            pending = [d for d in pending if not _flushed(replies[d])]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise FailedPreconditionError(
                    f"flush_cache: replica {pending[0]} still refuses after "
                    f"{self.flush_timeout:.0f}s (requests running or waiting): pause generation "
                    "before a sync; the new weights landed, the old KV cache is still there")
            time.sleep(0.05)

    def init(self) -> Dict[str, Any]:
        """Every scheduler binds and connects (collective with the trainers, which connect
        concurrently). Returns the init summary; raises HookError naming failed ranks."""
        if self.precheck_layout:
            self.precheck()
        init_id = self._new_init_id()
        host, _, port = self.config["store"].rpartition(":")
        if self.path == "receiver":
            def args(d: int) -> Tuple[Sequence[Any], Dict[str, Any]]:
                return (), dict(master_address=host, master_port=int(port),
                                rank_offset=self.plan.engine_rank(self.replicas[d], 0, 0),
                                world_size=self.plan.world_size, group_name=self.group_name,
                                receiver=self.ss.RECEIVER,
                                receiver_init_payload=self.replica_config(d))
            _check_replies("init_weights_update_group",
                           self.group.call_each("init_weights_update_group", args))
        else:
            def body() -> None:
                _check_replies("update_weights_from_tensor", self.group.call_each(
                    "update_weights_from_tensor",
                    lambda d: ((self.ss.init_request(self.replica_config(d)),),
                               {"load_format": self.ss.LOADER, "flush_cache": False})))
                self._loader(self.ss.wait_request())
            self._bracket(body)
        return self._collect("init", init_id)

    def sync(self, version: int) -> Dict[str, Any]:
        """One round: begin -> start -> wait -> end on every replica, every rank's report, then
        one cache flush per replica."""
        self._refuse_asleep()
        v = int(version)
        if self.staged:
            return self._staged_round(v)
        last = self.flush_mode == "with-update"

        def body() -> None:
            if self.path == "receiver":
                self._receive(self.ss.receiver_payload("start", version=v))
                # Post-load in the hook on every path: sglang-miles marks a receiver round
                # loaded too, so end_weight_update skips it (sglang.py docstring).
                self._receive(self.ss.receiver_payload("wait", post_load=True), flush_cache=last)
            else:
                self._loader(self.ss.start_request(v))
                self._loader(self.ss.wait_request(post_load=True), flush_cache=last)

        self._bracket(body)
        out = self._collect("sync", v)
        if self.flush_mode == "separate":
            self.flush()
        return out

    # ---- staged commit halves (driver_base._Driver._staged_round) ----
    def _transfer(self, v: int) -> Dict[str, Any]:
        """start, then every rank's report from the store (a `wait` request now would hold the
        scheduler thread for the whole transfer), then `wait` to join the finished jobs."""
        out: Dict[str, Any] = {}

        def body() -> None:
            recv = self.path == "receiver"
            if recv:
                self._receive(self.ss.receiver_payload("start", version=v))
            else:
                self._loader(self.ss.start_request(v))
            try:
                out.update(self._collect("sync", v))
            finally:
                if recv:
                    self._receive(self.ss.receiver_payload("wait", post_load=False))
                else:
                    self._loader(self.ss.wait_request(post_load=False))

        self._bracket(body)
        return out

    def _commit_call(self, op: str, v: int) -> None:
        def body() -> None:
            if self.path == "receiver":
                self._receive(self.ss.receiver_payload(op, version=v))
                self._receive(self.ss.receiver_payload("wait", post_load=True))
            else:
                req = self.ss.commit_request(v) if op == "commit" else self.ss.rollback_request(v)
                self._loader(req)
                self._loader(self.ss.wait_request(post_load=True))

        self._bracket(body)

    def _pause(self) -> None:
        self.group.call("pause_generation", mode="in_place")

    def _resume(self) -> None:
        self.group.call("continue_generation")

    def close(self) -> None:
        if self.path == "receiver":
            self.group.call("destroy_weights_update_group", self.group_name)
        else:
            self._bracket(lambda: self._loader(self.ss.close_request()))
