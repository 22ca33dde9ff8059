"""`ShardsyncWeightSync`: a UniRL full-weight sync handler, shard-aware and PP-capable.

UniRL (Tencent-Hunyuan/UniRL) builds its sync handler from the trainer's Hydra `sync:` block and
calls only `sync()`. Every reliance below was read in UniRL's source (commit given per file;
"main" = the fetched snapshot, 1a7b501):

- Colocated trainer, `unirl/trainer/ar.py` `ARTrainer.__init__` (0bd34ab):
  `self.weight_sync = remote_hydra(sync_cfg, backend=self.backend, rollout=self.rollout)` inside
  `placement(self.pool, fraction=1.0, shared_workers=True)`, then `train_step` calls
  `self.rollout.wake_up(); self.weight_sync.sync(); self.rollout.generate(req)`. Nothing else:
  no store, no connect, no targets.
- `unirl/utils/hydra.py` `remote_hydra` = `remote(**parse_hydra_cfg(cfg), **kwargs)`: the block's
  fields (minus `_target_`) plus the trainer's keywords become constructor keywords (main);
  `unirl/distributed/group/placement.py` `remote` forwards every kwarg, a Handle as a `HandleRef`
  carrying its tp/pp/sp sizes (1ad99db).
- `unirl/distributed/group/handle.py` (ec153a9): `_parallel_shape_from_init_kwargs` makes a role
  given `rollout=<HandleRef>` inherit the rollout's (dp, pp, tp) rank layout, TP fastest, so this
  handler's `rank_info` on worker i carries that worker's tp_rank / pp_rank / dp_rank; the
  SGLang engine of a TP group lives on its tp_rank == 0 worker (`tp_zero_workers`; the "engine
  replicas" are the tp_rank == 0 and pp_rank == 0 workers, `Handle.engine_replicas` in a later
  handle.py); `unirl/distributed/group/worker.py` `Worker.add_remote` resolves the HandleRef to
  the LOCAL sibling Remote, constructs the role, then `setup(..., rank_info, dist_env)` (main):
  `rank_info` exists only after construction, hence the lazy setup on the first `sync()`.
  `dist_env["MASTER_ADDR"]` is the node of the role's rank 0 (`Handle.__init__`,
  `_group_master_addr = workers[0].get_node_ip()`).
- The rollout sibling, `unirl/rollout/engine/sglang/engine.py` `SGLangRolloutEngine` (09bbaa7c):
  `cfg` (SGLangEngineConfig: `pretrained_model_ckpt_path`, `engine_kwargs` forwarded into the
  server args, `config.py` `server_intent`, ec153a9), a no-op shell unless tp_rank == 0,
  `update_weights_from_tensor(*, serialized_named_tensors, load_format, flush_cache,
  track_prefix)` which ends with `self._version += 1`, and `set_version(train_version)`
  (`unirl/rollout/engine/synchronous.py` `SyncRolloutEngine`, 09bbaa7c), whose `_version` is
  stamped on every generated sample (`_stamp_output_version`). A shardsync round is two updates
  (start, wait), so this handler stamps the version once per round itself (`set_version(v)`,
  or `_version` where the wrapper predates it): without it the sample versions advance by 2.
- UniRL's own collective is torch.distributed's default group, set up by the FSDP backend in
  each worker process: `full/nccl.py` `NCCLWeightSync._raise_if_rank0_phase_failed` and
  `full/tensor.py` `TensorWeightSync` `dist.all_gather_object` over it (3a3f885, and the
  TP-aware tensor.py). The store address and token travel that way here.
- Async trainers (`unirl/trainer/async_ar.py` 09bbaa7c / ec153a9, `agentic_async.py`
  09bbaa7c) build the handler with `backend=` only and `_connect_separate` refuses any target
  but `*NCCLWeightSync`; then `pick_master()[0]`, `set_rollout_targets(targets, role_name)`,
  `connect(master_addr=, master_port=, num_rollout_gpus=[, tp_size=, pp_size=])` (the NCCL
  handler's signatures, `full/nccl.py`). `unirl-async.patch` (next to this file) is the one-line
  change per trainer that lets this handler through; the rest is here.
- `unirl/rollout/engine/sglang/config.py` `SGLangEngineConfig.__post_init__` refuses
  `pp_size > 1` as UniRL ships (UniRL issue #490); PR #502 (unmerged) makes one engine per
  replica span tp x pp GPUs on its pp0/tp0 worker. This handler already addresses every PP
  stage, so with PR #502 it syncs pp > 1 unchanged.

Colocated (ar.py): every train rank holds the rollout sibling of its own worker. On the first
`sync()`, rank 0 serves a shardsync store on its node and shares (address, token) through
torch.distributed; every rank binds a Session to its own FSDP shards (no all-gather); the head
of each replica (tp_rank == 0 and pp_rank == 0) drives its own engine's init and rounds
in-process; every engine rank, every PP stage included, receives exactly its slices and verifies
them. Errors are agreed across ranks after each phase (all_gather_object), so a refusal reaches
every rank, never a hang. Separate slabs (async trainers, with the patch): rank 0 drives every
replica's head over UniRL's `Worker.call`.

The rollout must list the loader: `engine_kwargs: {custom_weight_loader:
[shardsync.hooks.sglang.load_weights]}` in its config (read from the sibling when colocated; the
separate slabs cannot read it, so there say `launched_with_loader: true`). `lora_merged=True` is
refused: folding LoRA into the base needs full tensors, which is what this handler avoids.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from unirl.distributed.group.dispatch import Dispatch, Execute, distributed
from unirl.distributed.weight_sync.full.base import FullWeightSync, _apply_name_remap

from ..errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnimplementedError,
)

__all__ = ["ShardsyncWeightSync", "UniRLRolloutHead"]

log = logging.getLogger("shardsync.integrations.unirl")


class UniRLRolloutHead:
    """One replica's UniRL SGLang wrapper as a shardsync engine head. `local`: the wrapper object
    itself (colocated sibling); otherwise `target` is its Worker actor handle, called as
    `handle.call.remote(role_name, method, (), kwargs)` and awaited with `ray.get(ref, timeout=)`
    (UniRL's Worker.call, as full/nccl.py uses it)."""

    def __init__(self, target: Any, role_name: Optional[str], *, local: bool, tp_size: int,
                 timeout: float, loader_listed: bool, session_methods: bool,
                 track_prefix: str, weight_cache: Optional[str] = None,
                 draft: Optional[str] = None) -> None:
        self.target, self.role, self.local = target, role_name, bool(local)
        self.tp_size, self.timeout = int(tp_size), float(timeout)
        self.loader_listed = bool(loader_listed)
        self.session_methods = bool(session_methods)
        self.track_prefix = track_prefix
        self.weight_cache, self.draft = weight_cache, draft
        self.server_args = None  # not readable through UniRL's wrapper

    def _call(self, method: str, **kwargs: Any) -> Any:
        if self.local:
            return getattr(self.target, method)(**kwargs)
        import ray

        ref = self.target.call.remote(self.role, method, (), kwargs)
        try:
            return ray.get(ref, timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - ray's timeout type varies by version
            if "timeout" in type(e).__name__.lower():
                raise DeadlineExceededError(
                    f"rollout {self.role}.{method}: no answer within {self.timeout:.0f}s") from e
            raise

    def probe(self) -> Any:
        """The SGLang installed beside this rank (the rollout's image): version, session API,
        payload; what the rollout launched with from its config (colocated) or the handler's
        arguments (separate slabs)."""
        from ..hooks.engines import probe_installed

        caps = probe_installed("sglang")
        where = "its colocated rollout sibling" if self.local else \
            f"rollout role '{self.role}' over UniRL Worker.call"
        return dataclasses.replace(
            caps, source=f"{caps.source}, {where}",
            loader_listed=self.loader_listed and caps.custom_loader,
            receiver=False, receiver_listed=False, tp_size=self.tp_size,
            weight_cache=self.weight_cache, draft=self.draft or caps.draft)

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

    def set_version(self, version: int) -> None:
        """One stamp per round (module docstring); the wrapper's own counter where it predates
        `set_version` (colocated only: the attribute is not reachable over Worker.call)."""
        if not self.local:
            self._call("set_version", train_version=int(version))
        elif callable(getattr(self.target, "set_version", None)):
            self.target.set_version(int(version))
        else:
            self.target._version = int(version)


def _base_kwargs(**kw: Any) -> Dict[str, Any]:
    """FullWeightSync's keyword arguments this UniRL version takes (adapter_name is newer)."""
    params = inspect.signature(FullWeightSync.__init__).parameters
    return {k: v for k, v in kw.items() if k in params}


def _engine_kwargs(rollout: Any) -> Dict[str, Any]:
    cfg = getattr(rollout, "cfg", None)
    kw = getattr(cfg, "engine_kwargs", None)
    return dict(kw) if isinstance(kw, dict) else {}


def _dist() -> Any:
    """torch.distributed when its default group spans more than this rank, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


class ShardsyncWeightSync(FullWeightSync):
    """UniRL full-weight sync over shardsync (module docstring).

    Built by UniRL from the Hydra `sync:` block: `backend` (and, colocated, `rollout`) come from
    the trainer; the rest from the block. `model`: the HF model name or path the plan is built
    from (default: the rollout sibling's `pretrained_model_ckpt_path`; required on separate
    slabs). `wire_dtype` / `trainer_dtype`: the engine's and the FSDP masters' dtypes ("bf16" /
    "f32"). `draft`: "refuse" or "leave" a speculative draft model's weights."""

    def __init__(
        self,
        *,
        backend: Any,
        rollout: Any = None,
        model: Optional[str] = None,
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
        if draft not in ("refuse", "leave"):
            raise InvalidArgumentError(f"draft: must be refuse or leave, got {draft!r}")
        self._rollout = rollout
        self._model_name, self._engine = model, engine
        self._wire, self._trainer_dtype = wire_dtype, trainer_dtype
        self._transport = transport
        self._launched_with_loader = bool(launched_with_loader)
        self._session_methods = bool(session_methods)
        self._draft = draft
        self._timeout = float(operation_timeout_s)
        self._store_server: Any = None
        self._token: Optional[str] = None
        self._launch: Dict[str, str] = {}
        self._targets: List[Any] = []
        self._role: Optional[str] = None
        self._session: Any = None
        self._driver: Any = None
        self._heads: List[UniRLRolloutHead] = []
        self._stamp = True

    # ---- UniRL's collective ----
    @property
    def _rank_world(self) -> Tuple[int, int]:
        ri = self.rank_info
        return (int(ri.rank), int(ri.world_size)) if ri is not None else (0, 1)

    def _check_group(self) -> Any:
        """The default torch.distributed group UniRL's FSDP backend set up on this worker; it
        must be the train ranks' (rank i of world n)."""
        rank, world = self._rank_world
        if world == 1:
            return None
        dist = _dist()
        if dist is None:
            raise FailedPreconditionError(
                f"ShardsyncWeightSync rank {rank}/{world}: torch.distributed is not initialized "
                "in this worker (UniRL's FSDP backend sets it up); the handler shares its store "
                "and verdicts through it")
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise FailedPreconditionError(
                f"ShardsyncWeightSync: torch.distributed rank {dist.get_rank()}/"
                f"{dist.get_world_size()} is not this handler's rank {rank}/{world}: the sync "
                "role must span the FSDP backend's workers")
        return dist

    def _broadcast(self, obj: Any) -> Any:
        dist = _dist() if self._rank_world[1] > 1 else None
        if dist is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _agree(self, error: Optional[str], phase: str) -> None:
        """Every rank's error for `phase`; the first is raised on every rank (no hangs)."""
        rank, world = self._rank_world
        local = {"rank": rank, "error": error}
        dist = _dist() if world > 1 else None
        if dist is not None:
            gathered: List[Any] = [None] * world
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        errors = [g for g in gathered if g is not None and g.get("error")]
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
            raise FailedPreconditionError(
                f"ShardsyncWeightSync {phase} failed on rank {first['rank']}: "
                f"{first['error']}{more}")

    @staticmethod
    def _capture(fn: Any) -> Tuple[Any, Optional[str]]:
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - agreed across ranks, then raised
            return None, f"{type(e).__name__}: {e}"

    def _host(self) -> str:
        host = (self.dist_env or {}).get("MASTER_ADDR")  # rank 0's node (module docstring)
        if host:
            return str(host)
        try:
            import ray

            return str(ray._private.services.get_node_ip_address())
        except Exception:  # noqa: BLE001 - no ray: a single-host job
            return "127.0.0.1"

    def _serve_store(self) -> Tuple[str, int]:
        from ..store import StoreServer

        if self._store_server is None:
            self._token = os.urandom(16).hex()
            self._store_server = StoreServer(self._host(), 0, self._token)
        host, _, port = self._store_server.address.rpartition(":")
        return host, int(port)

    # ---- separate slabs (async trainers, with unirl-async.patch) ----
    @distributed(dispatch_mode=Dispatch.BROADCAST, execute_mode=Execute.RANK_ZERO)
    def pick_master(self) -> Tuple[str, int]:
        """Rank 0 serves the shardsync store on its node; returns its (address, port), as
        NCCLWeightSync.pick_master returns its rendezvous."""
        return self._serve_store()

    @distributed(dispatch_mode=Dispatch.BROADCAST, execute_mode=Execute.RANK_ZERO)
    def set_rollout_targets(self, actor_handles: List[Any], role_name: str,
                            transactional: bool = False) -> None:
        """Rank 0 keeps the rollout Worker handles the trainer passes (replica order)."""
        if not actor_handles:
            raise InvalidArgumentError("ShardsyncWeightSync needs at least one rollout target")
        self._targets, self._role = list(actor_handles), str(role_name)

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def connect(self, *, master_addr: str, master_port: int, num_rollout_gpus: int,
                tp_size: int = 1, pp_size: int = 1) -> None:
        """Every train rank: plan, Session bound to its FSDP shards, connect; rank 0 also drives
        every replica's init (module docstring)."""
        if self._rollout is not None:
            raise FailedPreconditionError(
                "ShardsyncWeightSync.connect: this handler was built with a rollout sibling "
                "(colocated); it sets itself up on the first sync()")
        self._setup(store=f"{master_addr}:{int(master_port)}",
                    layout=(int(num_rollout_gpus), int(tp_size), int(pp_size)))

    def _separate_heads(self, gpus: int, tp: int, pp: int) -> List[Any]:
        """The replicas' heads among the targets: one per replica (engine heads, PR #502) when
        gpus == n * tp * pp; every pp-th of the tp-zero workers (async_ar.py passes
        `tp_zero_workers`, dp-major then pp) when gpus == n * tp."""
        if self._role is None:
            raise FailedPreconditionError(
                "ShardsyncWeightSync.connect: call set_rollout_targets() first")
        n = len(self._targets)
        if gpus == n * tp * pp:
            return list(self._targets)
        if pp > 1 and gpus == n * tp and n % pp == 0:
            return list(self._targets[::pp])
        raise InvalidArgumentError(
            f"num_rollout_gpus={gpus} must equal len(rollout_targets)({n}) * tp_size({tp}) * "
            f"pp_size({pp}) (one target per replica) or len(rollout_targets) * tp_size "
            "(the tp_rank == 0 workers)")

    # ---- setup, shared by both layouts ----
    def _colocated_layout(self) -> Dict[str, Any]:
        ri = self.rank_info
        tp = int(getattr(ri, "tp_size", 1) or 1)
        pp = int(getattr(ri, "pp_size", 1) or 1)
        for field, mine in (("tp", tp), ("pp", pp)):
            theirs = getattr(self._rollout, f"_{field}_size", None)
            if theirs is not None and int(theirs) != mine:
                raise FailedPreconditionError(
                    f"ShardsyncWeightSync: this rank's {field}_size={mine} (inherited from the "
                    f"rollout handle) but its rollout sibling says {field}_size={theirs}")
        world = self._rank_world[1]
        if world % (tp * pp):
            raise InvalidArgumentError(
                f"ShardsyncWeightSync: {world} ranks do not split into tp={tp} x pp={pp}")
        return {"dp": world // (tp * pp), "tp": tp, "pp": pp}

    def _model(self) -> str:
        model = self._model_name
        if model is None and self._rollout is not None:
            model = getattr(getattr(self._rollout, "cfg", None), "pretrained_model_ckpt_path",
                            None)
        if not model:
            raise InvalidArgumentError(
                "ShardsyncWeightSync: no model: set `model:` in the sync block (the rollout "
                "sibling's pretrained_model_ckpt_path is used when colocated)")
        return str(model)

    def _head(self, target: Any, tp: int, local: bool) -> UniRLRolloutHead:
        from ..hooks import sglang as ss

        kw = _engine_kwargs(target) if local else {}
        listed = ss.LOADER in list(kw.get("custom_weight_loader") or []) if local else \
            self._launched_with_loader
        return UniRLRolloutHead(
            target, self._role, local=local, tp_size=tp, timeout=self._timeout,
            loader_listed=listed, session_methods=self._session_methods,
            track_prefix=self._track_prefix,
            weight_cache=str(kw.get("weight_cache_mode") or "off") if local else None,
            draft=kw.get("speculative_algorithm") if local else None)

    def _make_driver(self, heads: List[UniRLRolloutHead], plan: Any, store: str,
                     replicas: Optional[Sequence[int]]) -> Any:
        from ..engine_group import EngineGroup
        from ..hooks.driver import SGLangDriver

        group = EngineGroup(heads, tp=1, pp=1, call_timeout=self._timeout)
        caps = heads[0].probe()
        if caps.session_api and not self._session_methods:
            raise UnimplementedError(
                f"{caps.label}: this SGLang (the sglang-miles line) asserts an open "
                "begin_weight_update session around every update, and UniRL's SGLang wrapper "
                "exposes no begin_weight_update / end_weight_update (pass session_methods=True "
                "once the rollout role does)")
        config = {"store": store, "token": self._token, "transport": self._transport,
                  "connect_timeout": self._timeout, "sync_timeout": self._timeout,
                  "precheck": False,  # the wrapper's server args are not readable
                  **self._launch}  # the engine ranks join this job's launch identity
        # UniRL pauses generation around a sync (ar.py: sleep/wake, async trainers: quiesce)
        # and the wrapper has no flush_cache call: flush with the round's last update, as
        # UniRL's own handlers do (flush on is_last).
        return SGLangDriver(group, plan, config, path="loader", draft=self._draft,
                            timeout=self._timeout * 2 + 30.0, replicas=replicas,
                            flush="with-update" if self._flush_cache else "off")

    def _setup(self, *, store: Optional[str] = None,
               layout: Optional[Tuple[int, int, int]] = None) -> None:
        """Both layouts: rank 0 decides and shares (store, token, layout, model) through
        UniRL's collective; every rank builds the plan and its Session; the drivers' init runs
        beside every rank's connect; errors are agreed after each phase."""
        from ..adapters import bind_trainer, trainer_spec_of
        from ..plan import Plan
        from ..session import Session
        from ..store import new_launch

        rank, _ = self._rank_world
        _, err = self._capture(self._check_group)
        self._agree(err, "setup (process group)")
        colocated = self._rollout is not None
        shared: Dict[str, Any] = {}
        if rank == 0:
            def decide() -> Dict[str, Any]:
                out: Dict[str, Any] = {"model": self._model()}
                if colocated:
                    host, port = self._serve_store()
                    out.update(self._colocated_layout(), store=f"{host}:{port}")
                else:
                    gpus, tp, pp = layout  # type: ignore[misc]
                    heads = self._separate_heads(gpus, tp, pp)
                    out.update(dp=len(heads), tp=tp, pp=pp, store=store)
                    self._heads = [self._head(h, tp, local=False) for h in heads]
                out["token"] = self._token
                # A fresh launch identity per job (docs/security.md "Job identity"): UniRL
                # starts its workers through Ray, not a launcher shardsync reads, and a job of
                # several ranks without one refuses to connect; shared with the store token.
                out["launch"] = new_launch()
                return out

            got, err = self._capture(decide)
            shared = dict(got or {}, error=err)
        shared = self._broadcast(shared)
        self._agree(shared.get("error") if rank == 0 else None, "setup (rank 0)")
        self._token = shared["token"]
        self._launch = dict(shared["launch"])
        state = self._backend.model.state_dict()

        def build() -> Any:
            spec, _ = trainer_spec_of(state)
            return Plan(shared["model"], spec,
                        f"dp={shared['dp']},tp={shared['tp']},pp={shared['pp']}",
                        engine=self._engine, wire_dtype=self._wire,
                        trainer_dtype=self._trainer_dtype, bucket_bytes=self._bucket_bytes)

        plan, err = self._capture(build)
        self._agree(err, "setup (plan)")
        ri = self.rank_info

        def driver() -> Any:
            if colocated:
                if int(getattr(ri, "tp_rank", 0)) == 0 and int(getattr(ri, "pp_rank", 0)) == 0:
                    self._heads = [self._head(self._rollout, shared["tp"], local=True)]
                    return self._make_driver(self._heads, plan, shared["store"],
                                             replicas=[int(getattr(ri, "dp_rank", 0))])
                return None
            return self._make_driver(self._heads, plan, shared["store"], None) \
                if rank == 0 else None

        self._driver, err = self._capture(driver)
        self._agree(err, "setup (engine probe)")

        def session() -> Any:
            s = Session(plan, rank, shared["store"], token=self._token,
                        transport=self._transport, connect_timeout=self._timeout,
                        sync_timeout=self._timeout, **self._launch)
            remap = self._name_remap
            bind_trainer(s, state, rename=lambda n: _apply_name_remap(n, remap))
            return s

        self._session, err = self._capture(session)
        self._agree(err, "setup (bind)")
        _, err = self._capture(lambda: self._run_beside(
            self._session.connect, self._driver.init if self._driver is not None else None,
            "init"))
        self._agree(err, "connect")

    def _run_beside(self, mine: Any, engines: Any, what: str) -> Any:
        """Runs this rank's collective while the driver (if any) plays the engines' part (both
        block on each other); the first error wins."""
        box: Dict[str, Any] = {}

        def drive() -> None:
            try:
                box["out"] = engines()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        t = None
        if engines is not None:
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
        """Every train rank sends its own shards of version weight_version + 1 while the heads'
        drivers play the engines' round; every engine rank verifies what landed; each engine's
        version is stamped once. Colocated: the first call sets everything up."""
        if self._session is None:
            if self._rollout is None:
                raise FailedPreconditionError(
                    "ShardsyncWeightSync.sync before connect(): on separate slabs the trainer "
                    "calls pick_master / set_rollout_targets / connect first (unirl-async.patch)")
            self._setup()
        v = self.weight_version + 1
        _, err = self._capture(lambda: self._run_beside(
            lambda: self._session.sync(v),
            (lambda: self._driver.sync(v)) if self._driver is not None else None, "sync"))
        self._agree(err, f"sync {v}")
        self._stamp_version(v)
        self.weight_version = v

    def _stamp_version(self, v: int) -> None:
        if self._rollout is not None:  # every rank stamps its own sibling (shells too)
            UniRLRolloutHead(self._rollout, None, local=True, tp_size=1, timeout=self._timeout,
                             loader_listed=True, session_methods=False,
                             track_prefix="").set_version(v)
            return
        if self._driver is None or not self._stamp:
            return
        for h in self._heads:
            try:
                h.set_version(v)
            except Exception as e:  # noqa: BLE001 - a wrapper that predates set_version
                self._stamp = False
                log.warning("rollout role '%s' takes no set_version (%s): the engine's version "
                            "is left to the trainer", self._role, e)
                return

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def cleanup(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        try:
            if self._driver is not None:
                self._driver.close()
        finally:
            self._driver = None
            if self._session is not None:
                self._session.close()
                self._session = None
            if self._store_server is not None:
                self._store_server.stop()
                self._store_server = None
