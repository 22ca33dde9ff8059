"""`ShardsyncWeightSync`: UniRL's full-weight sync contract, shard-aware and PP-capable.

UniRL (Tencent-Hunyuan/UniRL) syncs through `FullWeightSync` subclasses
(`unirl/distributed/weight_sync/full/base.py`): a `Remote` beside the FSDP backend on the train
slab, whose `@distributed(dispatch_mode=Dispatch.BROADCAST)` `sync()` pushes the current weights
into the rollout engine(s), with one-time setup driven from the trainer as `nccl.py` does
(`pick_master` / `set_rollout_targets` / `connect`, rank 0 only) and `weight_version` counted
up per sync. Its three handlers send full HF tensors and address receivers by the stage-local
tp_rank, so under SGLang `pp_size > 1` they fail or mis-sync silently (UniRL #503).

This handler keeps the same lifecycle and replaces the transport:
- `pick_store()` (rank 0): a shardsync store on rank 0's node; returns (address, token).
- `set_rollout_targets(handles, role_name)` (rank 0): the replicas' engine-head workers (one
  live SGLang engine per replica, owner rule pp_rank == 0 and tp_rank == 0, UniRL PR #502).
- `connect(store=, token=, num_rollout_gpus=, tp_size=, pp_size=)` (every train rank): the
  plan (the model x the FSDP layout read from the backend's DTensors x dp=len(handles), tp, pp),
  one shardsync `Session` per train rank bound to its own FSDP shards (no all-gather), and on
  rank 0 the SGLang driver over the heads (custom-loader path; the command travels as
  `serialized_named_tensors`, which UniRL's SGLang wrapper forwards as
  `UpdateWeightsFromTensorReqInput`). Rank 0 checks everything first and publishes its verdict
  through the store, so a refusal is raised on every rank, never a hang.
- `sync()` (every train rank, BROADCAST): version = weight_version + 1; every rank's session
  sends its own slices point to point while rank 0 plays the engine's round (start, wait), and
  every engine rank, every PP stage included, verifies its checksums.

The rollout side must launch SGLang with `custom_weight_loader:
[shardsync.hooks.sglang.load_weights]` (say so with `launched_with_loader=True`: the loader is
not visible through UniRL's gated methods, and an unlisted loader kills the scheduler). SGLang
versions with the begin/end session assert need a rollout role that exposes
`begin_weight_update` / `end_weight_update` (`session_methods=True`); otherwise they are refused.
`lora_merged=True` is refused: folding LoRA into the base needs full tensors, which is what this
handler avoids.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

from unirl.distributed.group.dispatch import Dispatch, Execute, distributed
from unirl.distributed.weight_sync.full.base import FullWeightSync, _apply_name_remap

from ..errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnimplementedError,
)

__all__ = ["ShardsyncWeightSync", "UniRLRolloutHead"]


class UniRLRolloutHead:
    """One replica's head worker as a shardsync engine handle: each call is
    `handle.call.remote(role_name, method, (), kwargs)` awaited with `ray.get(ref, timeout=)`
    (UniRL's Worker.call, as nccl.py uses it)."""

    def __init__(self, handle: Any, role_name: str, *, tp_size: int, timeout: float,
                 launched_with_loader: bool, session_methods: bool, track_prefix: str) -> None:
        self.handle, self.role = handle, role_name
        self.tp_size, self.timeout = int(tp_size), float(timeout)
        self.launched_with_loader = bool(launched_with_loader)
        self.session_methods = bool(session_methods)
        self.track_prefix = track_prefix
        self.server_args = None  # not readable through UniRL's gated methods

    def _call(self, method: str, **kwargs: Any) -> Any:
        import ray

        ref = self.handle.call.remote(self.role, method, (), kwargs)
        try:
            return ray.get(ref, timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - ray's timeout type varies by version
            if "timeout" in type(e).__name__.lower():
                raise DeadlineExceededError(
                    f"rollout {self.role}.{method}: no answer within {self.timeout:.0f}s") from e
            raise

    def probe(self) -> Any:
        """The SGLang installed beside this trainer (the rollout's image): version, session API,
        payload; what the rollout launched with comes from the handler's arguments."""
        import dataclasses

        from ..hooks.engines import probe_installed

        caps = probe_installed("sglang")
        return dataclasses.replace(
            caps, source=f"{caps.source}, rollout role '{self.role}' over UniRL Worker.call",
            loader_listed=self.launched_with_loader and caps.custom_loader,
            receiver=False, receiver_listed=False, tp_size=self.tp_size)

    def update_weights_from_tensor(self, named: Any, load_format: Any = None,
                                   flush_cache: bool = True) -> Any:
        from ..hooks.sglang import serialize_for_http

        return self._call("update_weights_from_tensor",
                          serialized_named_tensors=serialize_for_http(named, self.tp_size),
                          load_format=load_format, flush_cache=bool(flush_cache),
                          track_prefix=self.track_prefix)

    def begin_weight_update(self) -> Any:
        return self._call("begin_weight_update")

    def end_weight_update(self) -> Any:
        return self._call("end_weight_update")


def _base_kwargs(**kw: Any) -> Dict[str, Any]:
    """FullWeightSync's keyword arguments this UniRL version takes (adapter_name is newer)."""
    params = inspect.signature(FullWeightSync.__init__).parameters
    return {k: v for k, v in kw.items() if k in params}


class ShardsyncWeightSync(FullWeightSync):
    """UniRL full-weight sync over shardsync (module docstring). `model`: the HF model name or
    path the plan is built from; `wire_dtype` / `trainer_dtype`: the engine's and the FSDP
    masters' dtypes ("bf16" / "f32")."""

    def __init__(
        self,
        *,
        backend: Any,
        model: str,
        engine: str = "sglang",
        wire_dtype: str = "bf16",
        trainer_dtype: str = "f32",
        bucket_size_mb: int = 512,
        flush_cache: bool = True,
        lora_merged: bool = False,
        adapter_name: Optional[str] = None,
        name_remap: Optional[Dict[str, Optional[str]]] = None,
        track_prefix: str = "",
        transport: str = "auto",
        launched_with_loader: bool = False,
        session_methods: bool = False,
        draft: str = "refuse",
        operation_timeout_s: float = 300.0,
    ) -> None:
        if lora_merged:
            raise UnimplementedError(
                "ShardsyncWeightSync: lora_merged=True needs full tensors to fold LoRA into; "
                "shardsync sends each FSDP shard as it is. Use NCCLWeightSync / TensorWeightSync "
                "for merged-LoRA runs, or sync the adapter with a LoRA handler")
        super().__init__(**_base_kwargs(
            backend=backend, bucket_size_mb=bucket_size_mb, flush_cache=flush_cache,
            lora_merged=False, adapter_name=adapter_name, name_remap=name_remap,
            track_prefix=track_prefix, wire_dtype=None))
        if engine != "sglang":
            raise UnimplementedError(f"engine '{engine}': this handler drives SGLang rollouts")
        self._model_name, self._engine = model, engine
        self._wire, self._trainer_dtype = wire_dtype, trainer_dtype
        self._transport = transport
        self._launched_with_loader = bool(launched_with_loader)
        self._session_methods = bool(session_methods)
        self._draft = draft
        self._timeout = float(operation_timeout_s)
        self._store_server: Any = None
        self._targets: List[Any] = []
        self._role: Optional[str] = None
        self._session: Any = None
        self._driver: Any = None
        self._connect_args: Dict[str, Any] = {}

    # ---- one-time setup (driver-called) ----
    @distributed(dispatch_mode=Dispatch.BROADCAST, execute_mode=Execute.RANK_ZERO)
    def pick_store(self, host: Optional[str] = None) -> Tuple[str, str]:
        """Rank 0 serves the shardsync store on its node; returns (address, token)."""
        from ..store import StoreServer

        if host is None:
            try:
                import ray

                host = ray._private.services.get_node_ip_address()
            except Exception:  # noqa: BLE001 - no ray: a single-host job
                host = "127.0.0.1"
        token = os.urandom(16).hex()
        self._store_server = StoreServer(host, 0, token)
        return self._store_server.address, token

    @distributed(dispatch_mode=Dispatch.BROADCAST, execute_mode=Execute.RANK_ZERO)
    def set_rollout_targets(self, actor_handles: List[Any], role_name: str) -> None:
        """Rank 0 keeps the replicas' engine-head Worker handles (replica order)."""
        if not actor_handles:
            raise InvalidArgumentError("ShardsyncWeightSync needs at least one rollout target")
        self._targets, self._role = list(actor_handles), str(role_name)

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def connect(self, *, store: str, token: str, num_rollout_gpus: int, tp_size: int = 1,
                pp_size: int = 1, num_replicas: Optional[int] = None) -> None:
        """Every train rank: plan, session bound to its FSDP shards, connect (collective with
        every engine rank); rank 0 also inits the engines (module docstring)."""
        from ..adapters import bind_trainer, trainer_spec_of
        from ..plan import Plan
        from ..session import Session
        from ..store import StoreClient

        rank = self._my_rank
        client = StoreClient(store, token, timeout=self._timeout)
        verdict_key = "ss/unirl/connect"
        error = None
        if rank == 0:
            try:
                if self._role is None:
                    raise FailedPreconditionError(
                        "ShardsyncWeightSync.connect: call set_rollout_targets() first")
                dp = len(self._targets)
                if num_rollout_gpus != dp * tp_size * pp_size:
                    raise InvalidArgumentError(
                        f"num_rollout_gpus={num_rollout_gpus} must equal len(rollout_targets)"
                        f"({dp}) * tp_size({tp_size}) * pp_size({pp_size})")
            except Exception as e:  # noqa: BLE001 - published, then raised on every rank
                error = f"{type(e).__name__}: {e}"
            dp = len(self._targets)
            client.set(verdict_key + "/dp", str(dp))
        state = self._backend.model.state_dict()
        spec, _ = trainer_spec_of(state)
        dp = int(client.get(verdict_key + "/dp", timeout=self._timeout))
        plan = Plan(self._model_name, spec, f"dp={dp},tp={int(tp_size)},pp={int(pp_size)}",
                    engine=self._engine, wire_dtype=self._wire, trainer_dtype=self._trainer_dtype,
                    bucket_bytes=self._bucket_bytes)
        if rank == 0 and error is None:
            try:
                self._driver = self._make_driver(plan, store, token, tp_size)
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
        if rank == 0:
            client.set(verdict_key, json.dumps({"error": error}))
        verdict = json.loads(client.get(verdict_key, timeout=self._timeout))
        if verdict["error"]:
            raise FailedPreconditionError(f"ShardsyncWeightSync.connect (rank 0): "
                                          f"{verdict['error']}")
        session = Session(plan, rank, store, token=token, transport=self._transport,
                          connect_timeout=self._timeout, sync_timeout=self._timeout)
        remap = self._name_remap
        bind_trainer(session, state, rename=lambda n: _apply_name_remap(n, remap))
        self._run_beside(rank, session.connect, self._driver.init if rank == 0 else None, "init")
        self._session = session

    def _make_driver(self, plan: Any, store: str, token: str, tp_size: int) -> Any:
        from ..engine_group import EngineGroup
        from ..hooks.driver import SGLangDriver

        heads = [UniRLRolloutHead(h, self._role, tp_size=tp_size, timeout=self._timeout,
                                  launched_with_loader=self._launched_with_loader,
                                  session_methods=self._session_methods,
                                  track_prefix=self._track_prefix) for h in self._targets]
        group = EngineGroup(heads, tp=1, pp=1, call_timeout=self._timeout)
        caps = heads[0].probe()
        if caps.session_api and not self._session_methods:
            raise UnimplementedError(
                f"{caps.label}: this SGLang asserts an open begin_weight_update session around "
                f"every update, and rollout role '{self._role}' exposes no begin_weight_update / "
                "end_weight_update (pass session_methods=True once it does)")
        config = {"store": store, "token": token, "transport": self._transport,
                  "connect_timeout": self._timeout, "sync_timeout": self._timeout}
        # UniRL pauses generation around a sync and its wrapper has no separate flush_cache:
        # flush with the round's last update, as UniRL's own handlers do (flush on is_last).
        return SGLangDriver(group, plan, config, path="loader", draft=self._draft,
                            timeout=self._timeout * 2 + 30.0,
                            flush="with-update" if self._flush_cache else "off")

    def _run_beside(self, rank: int, mine: Any, rank0: Any, what: str) -> Any:
        """Runs this rank's collective while rank 0 also drives the engines (both block on
        each other); the first error wins, on every path."""
        box: Dict[str, Any] = {}

        def drive() -> None:
            try:
                box["out"] = rank0()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        t = None
        if rank0 is not None:
            t = threading.Thread(target=drive, name=f"shardsync-unirl-{what}", daemon=True)
            t.start()
        err: Optional[BaseException] = None
        try:
            mine()
        except BaseException as e:  # noqa: BLE001
            err = e
        if t is not None:
            t.join(self._timeout * 2 + 60.0)
            if t.is_alive():
                err = err or DeadlineExceededError(f"engine {what} did not return")
            err = err or box.get("error")
        if err is not None:
            raise err
        return box.get("out")

    # ---- per step ----
    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def sync(self) -> None:
        """Every train rank sends its own shards of version weight_version + 1; rank 0 plays the
        engines' round; every engine rank verifies what landed."""
        if self._session is None:
            raise FailedPreconditionError("ShardsyncWeightSync.sync called before connect()")
        v = self.weight_version + 1
        rank = self._my_rank
        self._run_beside(rank, lambda: self._session.sync(v),
                         (lambda: self._driver.sync(v)) if rank == 0 else None, "sync")
        self.weight_version = v

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def cleanup(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self._driver is not None:
            try:
                self._driver.close()
            finally:
                self._driver = None
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._store_server is not None:
            self._store_server.stop()
            self._store_server = None
