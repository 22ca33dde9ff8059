"""EngineGroup: the rollout half of the design, on the driver side.

One engine handle per rollout worker (one worker per GPU). Worker i sits at tp = i % T,
pp = (i // T) % P, dp = i // (T*P). Per DP replica exactly one worker, the head at
pp == 0 and tp == 0, owns a live engine spanning the replica's T x P GPUs (UniRL PR #502); every
other worker is a shell. Gated methods run on heads only; a shell returns None and never touches
its handle (it may be None).

Gated methods: the seed's 16 wrapper names (LIFECYCLE_METHODS) and the engines' own
(ENGINE_METHODS): SGLang's Engine / HTTP API (`pause_generation`, `continue_generation`,
`release_memory_occupation`, `resume_memory_occupation`, `begin_weight_update`,
`end_weight_update`, ...) and vLLM's LLM / AsyncLLM (`collective_rpc`,
`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`,
`resume_generation`, `is_sleeping`, ...). The group also remembers which replicas released their
weights (sleep / release_memory_occupation), so a sync can refuse an asleep replica by name.

Async engines (vLLM `AsyncLLM`: `async def` weight-transfer methods, v1/engine/async_llm.py):
a gated call that returns a coroutine is awaited on the engine's event loop (`loop=`, the loop
the engine was created on and runs on) with `call_timeout`; without a loop it is closed unrun and
refused by name, never left unawaited (an unawaited coroutine runs nothing: every rank would then
time out with "no report").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .errors import DeadlineExceededError, Error, FailedPreconditionError, InvalidArgumentError

__all__ = [
    "LIFECYCLE_METHODS",
    "ENGINE_METHODS",
    "GATED_METHODS",
    "WorkerCoord",
    "worker_coords",
    "EngineGroup",
    "EngineWorker",
    "ReplicaError",
]

# The 16 methods gated to the live engine (../shared/reference/unirl-system.md section 1).
LIFECYCLE_METHODS: Tuple[str, ...] = (
    "generate",
    "abort",
    "pause",
    "resume",
    "sleep",
    "wake_up",
    "onload_weights",
    "health_check",
    "shutdown",
    "update_weights_from_tensor",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "set_lora_from_tensors",
    "lora_dirty",
    "update_weights_from_checkpoint_engine_ipc",
)

# The engines' own names (SGLang entrypoints/engine.py + http_server.py, vLLM entrypoints/llm.py
# + engine/protocol.py EngineClient), gated exactly like the seed's.
ENGINE_METHODS: Tuple[str, ...] = (
    # SGLang
    "pause_generation",
    "continue_generation",
    "release_memory_occupation",
    "resume_memory_occupation",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_disk",
    "update_weights_from_ipc",
    "get_weights_by_name",
    "flush_cache",
    # vLLM
    "collective_rpc",
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "resume_generation",
    "is_sleeping",
    "reset_prefix_cache",
)

GATED_METHODS: Tuple[str, ...] = LIFECYCLE_METHODS + ENGINE_METHODS

# GPU memory tags (SGLang constants.py GPU_MEMORY_ALL_TYPES; vLLM cumem tags weights/kv_cache).
_ALL_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})


@dataclass(frozen=True)
class WorkerCoord:
    rank: int
    dp: int
    pp: int
    tp: int

    @property
    def is_head(self) -> bool:
        return self.pp == 0 and self.tp == 0


def worker_coords(dp: int, tp: int, pp: int) -> List[WorkerCoord]:
    """Coordinates of every worker, TP fastest, then PP, then DP (the C++ layout planner's rule)."""
    for field, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v <= 0:
            raise InvalidArgumentError(f"--{field}: must be a positive integer, got {v!r}")
    return [
        WorkerCoord(rank=i, dp=i // (tp * pp), pp=(i // tp) % pp, tp=i % tp)
        for i in range(dp * tp * pp)
    ]


class ReplicaError(Error):
    """A lifecycle method failed on one or more heads. Names the first failing replica; `failures`
    holds every (replica, worker, exception) in replica order."""

    code = "replica_error"

    def __init__(self, method: str, failures: List[Tuple[int, int, BaseException]]) -> None:
        replica, worker, exc = failures[0]
        more = f" (and {len(failures) - 1} more replica(s))" if len(failures) > 1 else ""
        super().__init__(
            f"{method}: replica {replica} (head worker {worker}) failed: "
            f"{type(exc).__name__}: {exc}{more}"
        )
        self.method = method
        self.replica = replica
        self.worker = worker
        self.failures = failures


class EngineWorker:
    """The per-worker view: calls forward to the engine on a head and return None on a shell.

    Every gated method (GATED_METHODS) is an attribute; any other attribute is not gated and is
    refused, so a typo cannot silently become a no-op.
    """

    def __init__(self, coord: WorkerCoord, engine: Any, loop: Any = None,
                 call_timeout: float = 600.0) -> None:
        self.coord = coord
        self._engine = engine
        self._loop = loop
        self._call_timeout = float(call_timeout)

    @property
    def is_head(self) -> bool:
        return self.coord.is_head

    @property
    def engine(self) -> Any:
        return self._engine

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        _check_gated(method)
        if not self.coord.is_head:
            return None
        fn = getattr(self._engine, method, None)
        if fn is None:
            raise InvalidArgumentError(
                f"worker {self.coord.rank} (replica {self.coord.dp}): engine "
                f"{type(self._engine).__name__} has no method {method!r}"
            )
        out = fn(*args, **kwargs)
        if inspect.iscoroutine(out):
            return self._await(method, out)
        return out

    def _await(self, method: str, coro: Any) -> Any:
        """Runs an async engine method's coroutine to completion on the engine's loop."""
        loop = self._loop
        where = f"worker {self.coord.rank} (replica {self.coord.dp})"
        if loop is None or loop.is_closed():
            coro.close()
            raise FailedPreconditionError(
                f"{where}: {type(self._engine).__name__}.{method} is async (e.g. vLLM AsyncLLM): "
                "pass loop= (the event loop the engine runs on) to the EngineGroup / driver")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise FailedPreconditionError(
                f"{where}: {method} called on the engine's own event loop thread: it would "
                "block the loop it waits for; call the driver from another thread")
        if not loop.is_running():
            coro.close()
            raise FailedPreconditionError(
                f"{where}: the event loop given for {method} is not running (the engine's loop "
                "must run in a thread of its own, as AsyncLLM's output handler needs)")
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result(timeout=self._call_timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise DeadlineExceededError(
                f"{where}: {method} did not finish within {self._call_timeout:.0f}s")

    def __repr__(self) -> str:
        c = self.coord
        role = "head" if c.is_head else "shell"
        return f"EngineWorker(rank={c.rank}, dp={c.dp}, pp={c.pp}, tp={c.tp}, {role})"


def _check_gated(method: str) -> None:
    if method not in GATED_METHODS:
        raise InvalidArgumentError(
            f"method {method!r} is not a lifecycle method (one of {', '.join(GATED_METHODS)})"
        )


def _released_after(method: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                    released: frozenset) -> Optional[frozenset]:
    """The memory tags a replica holds released after a successful `method` (None: unchanged)."""
    raw = kwargs.get("tags", args[0] if args else None)
    if isinstance(raw, str):
        tags: Optional[frozenset] = frozenset({raw})
    elif isinstance(raw, (list, tuple, set, frozenset)):
        tags = frozenset(str(t) for t in raw)
    else:
        tags = None  # None (every tag), or a wrapper's own argument (a sleep level)
    if method == "sleep":  # vLLM: level 1 offloads weights, level 2 discards them; KV freed
        return released | {"weights", "kv_cache"}
    if method == "release_memory_occupation":
        return released | (frozenset(tags) if tags else _ALL_TAGS)
    if method in ("wake_up", "resume_memory_occupation", "onload_weights"):
        if method == "onload_weights":
            return released - {"weights"}
        return released - (frozenset(tags) if tags else _ALL_TAGS)
    return None


class EngineGroup:
    """Driver-side handle over every rollout worker's engine.

    `engines[i]` is worker i's handle; shells' entries are never called and may be None. Each
    gated method (GATED_METHODS), called on the group, runs on every head (concurrently when
    `concurrent=True`) and returns the heads' results as a list in replica order. If any head
    raises, every head still finishes, then ReplicaError names the first failing replica.
    `call_each(method, fn)` gives each replica its own arguments.

    The layout comes from the C++ planner (shardsync._C.compute_layout) when `gpus_per_node` is
    given and the native module is built; otherwise from the same rule in Python.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        tp: int = 1,
        pp: int = 1,
        dp: Optional[int] = None,
        engine: str = "sglang",
        gpus_per_node: Optional[int] = None,
        concurrent: bool = True,
        loop: Any = None,
        call_timeout: float = 600.0,
    ) -> None:
        n = len(engines)
        if not isinstance(tp, int) or tp <= 0 or not isinstance(pp, int) or pp <= 0:
            raise InvalidArgumentError(f"--tp/--pp: must be positive integers, got tp={tp!r}, pp={pp!r}")
        if dp is None:
            if n % (tp * pp) != 0:
                raise InvalidArgumentError(
                    f"engines: {n} worker handles is not a multiple of tp*pp = {tp * pp}"
                )
            dp = n // (tp * pp)
        if dp * tp * pp != n:
            raise InvalidArgumentError(
                f"engines: got {n} worker handles, dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}"
            )
        self.dp, self.tp, self.pp = dp, tp, pp
        self.concurrent = concurrent
        self.layout: Any = None
        coords = None
        if gpus_per_node is not None:
            from . import layout as _layout

            self.layout = _layout.compute_layout(
                dp=dp, tp=tp, pp=pp, engine=engine, gpus_per_node=gpus_per_node
            )
            coords = [
                WorkerCoord(rank=w.rank, dp=w.dp, pp=w.pp, tp=w.tp) for w in self.layout.workers
            ]
        if coords is None:
            coords = worker_coords(dp, tp, pp)
        self.loop = loop
        self.workers: List[EngineWorker] = [
            EngineWorker(c, e, loop=loop, call_timeout=call_timeout) for c, e in zip(coords, engines)
        ]
        self._heads = [w for w in self.workers if w.is_head]
        self._heads.sort(key=lambda w: w.coord.dp)
        if [w.coord.dp for w in self._heads] != list(range(dp)):
            raise InvalidArgumentError(f"layout: expected one head per replica 0..{dp - 1}")
        for h in self._heads:
            if h.engine is None:
                raise InvalidArgumentError(
                    f"engines[{h.coord.rank}]: the head of replica {h.coord.dp} has no engine handle"
                )
        self._released: Dict[int, frozenset] = {d: frozenset() for d in range(dp)}

    def set_loop(self, loop: Any) -> None:
        """The event loop async engines (AsyncLLM) run on; their coroutines are awaited there."""
        self.loop = loop
        for w in self.workers:
            w._loop = loop

    def __len__(self) -> int:
        return len(self.workers)

    def worker(self, rank: int) -> EngineWorker:
        if not 0 <= rank < len(self.workers):
            raise InvalidArgumentError(f"worker rank {rank} outside [0, {len(self.workers)})")
        return self.workers[rank]

    @property
    def heads(self) -> List[int]:
        """Head worker ranks in replica order."""
        return [w.coord.rank for w in self._heads]

    @property
    def shells(self) -> List[int]:
        return [w.coord.rank for w in self.workers if not w.is_head]

    @property
    def head_engines(self) -> List[Any]:
        """The heads' engine handles in replica order."""
        return [h.engine for h in self._heads]

    def released(self, replica: int) -> frozenset:
        """GPU memory tags replica `replica` holds released (sleep / release_memory_occupation
        called through this group and not yet undone)."""
        return self._released[replica]

    def asleep_replicas(self) -> List[int]:
        """Replicas whose weights are released: a sync into them would write unmapped memory."""
        return [d for d in range(self.dp) if "weights" in self._released[d]]

    def call(self, method: str, *args: Any, **kwargs: Any) -> List[Any]:
        """Runs a gated method on every head; results in replica order."""
        return self.call_each(method, lambda d: (args, kwargs))

    def call_each(self, method: str,
                  fn: Callable[[int], Tuple[Sequence[Any], Dict[str, Any]]]) -> List[Any]:
        """Runs a gated method on every head with per-replica (args, kwargs) = fn(replica);
        results in replica order."""
        _check_gated(method)
        per = {h.coord.dp: fn(h.coord.dp) for h in self._heads}
        outcomes: Dict[int, Tuple[bool, Any]] = {}

        def run(h: EngineWorker) -> Tuple[bool, Any]:
            a, kw = per[h.coord.dp]
            try:
                out = True, h.call(method, *a, **kw)
            except BaseException as e:  # noqa: BLE001 - re-raised below, naming the replica
                return False, e
            after = _released_after(method, tuple(a), dict(kw), self._released[h.coord.dp])
            if after is not None:
                self._released[h.coord.dp] = after
            return out

        if self.concurrent and len(self._heads) > 1:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(self._heads)) as pool:
                futs = {h.coord.dp: pool.submit(run, h) for h in self._heads}
                for dp, f in futs.items():
                    outcomes[dp] = f.result()
        else:
            for h in self._heads:
                outcomes[h.coord.dp] = run(h)
        failures = [
            (h.coord.dp, h.coord.rank, outcomes[h.coord.dp][1])
            for h in self._heads
            if not outcomes[h.coord.dp][0]
        ]
        if failures:
            for _, _, exc in failures:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise exc
            raise ReplicaError(method, failures) from failures[0][2]
        return [outcomes[h.coord.dp][1] for h in self._heads]

    def __repr__(self) -> str:
        return f"EngineGroup(dp={self.dp}, tp={self.tp}, pp={self.pp}, heads={self.heads})"


def _gated(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.call(name, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = name
    method.__doc__ = f"Lifecycle method {name!r}, gated on the head (pp_rank == 0 and tp_rank == 0)."
    return method


# Explicit methods rather than __getattr__, so a typo is an AttributeError, never a silent no-op.
for _name in GATED_METHODS:
    setattr(EngineWorker, _name, _gated(_name))
    setattr(EngineGroup, _name, _gated(_name))
del _name
