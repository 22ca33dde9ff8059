"""A fake of UniRL (Tencent-Hunyuan/UniRL) that keeps the call sequence its trainers use to build
and drive a sync handler, written from UniRL's source (file, symbol, commit read; "main" = the
fetched snapshot 1a7b501; none of UniRL's code is copied):

- `unirl/distributed/group/dispatch.py` (main): `Dispatch`, `Execute`, `distributed(
  dispatch_mode=, execute_mode=)` storing its config on the function (`_distributed_config`);
  a Handle call runs on every worker of the role concurrently (Ray actors), BROADCAST with the
  same arguments, RANK_ZERO on worker 0 only, and returns the list of results.
- `unirl/distributed/group/remote.py` (main): `RankInfo`; `Remote.setup(transport, device,
  rank_info, dist_env, get_sibling)` is called by `Worker.add_remote` AFTER the constructor
  (`os.environ.update(dist_env)` there is left out: the fake's workers are threads of one
  process).
- `unirl/distributed/group/worker.py` (main): `Worker.add_remote(role_name, role_cls, rank_info,
  init_kwargs, dist_env)` resolves a `HandleRef` kwarg to the LOCAL sibling (`self._roles[name]`)
  and a nested `_target_` dict to `get_method(target)(**children)` (`_resolve_init_kwargs`),
  constructs the role, then `setup`; `Worker.call(role_name, method_name, args, kwargs)` reached
  as `worker.call.remote(...)` and collected with `ray.get(ref, timeout=)`. One thread per worker
  stands for its actor process (calls run one at a time, in order).
- `unirl/distributed/group/handle.py` (ec153a9): `HandleRef(role_name, sp_size, tp_size,
  pp_size, ep_size)`; `_parallel_shape_from_init_kwargs` (rollout tp/pp from the SGLang role's
  `config`, or inherited from any HandleRef kwarg: "colocated weight sync roles adopt their
  rollout sibling's TP layout"), `_build_rank_infos` ((dp, pp, tp), TP fastest), the per-rank
  kwargs injected into the SGLang role only (`tp_rank`, `tp_size`, `tp_device_ids` = the
  engine's devices, `pp_rank`, `pp_size`, `ep_rank`, `ep_size`), `dist_env` with MASTER_ADDR =
  worker 0's node; `tp_zero_workers`; `engine_replicas` (tp_rank == 0 and pp_rank == 0, from a
  later handle.py the index stored without naming its commit). The SGLang role is recognised by
  `_accepts_rollout_tp_kwargs` (engine.py 09bbaa7c).
- `unirl/distributed/group/placement.py` (1ad99db): `placement(pool, fraction=,
  shared_workers=True)` scopes claim disjoint top-level slabs; `remote(role_cls, **kwargs)`
  forwards every kwarg, a Handle as a HandleRef carrying its sp/tp/pp/ep sizes (`_to_marker`).
- `unirl/utils/hydra.py` (main): `parse_hydra_cfg(cfg)` = `{"role_cls": get_method(_target_),
  **fields}` (reserved `_`-keys dropped, nested `_target_` blocks left as data);
  `remote_hydra(cfg, **kwargs)` = `remote(**parse_hydra_cfg(cfg), **kwargs)`.
- `unirl/distributed/weight_sync/full/base.py` (17863c4): `FullWeightSync(Remote)` constructor
  (backend, bucket_size_mb, flush_cache, lora_merged, adapter_name, name_remap, track_prefix,
  wire_dtype), `_validate_name_remap` / `_apply_name_remap`, `_bucket_bytes`, `_flush_cache`,
  `_track_prefix`, `weight_version`, `_my_rank`.
- `unirl/rollout/engine/sglang/engine.py` `SGLangRolloutEngine` (09bbaa7c): constructor
  `(config, *, ..., tp_rank, tp_size, tp_visible_devices, tp_device_ids, pp_rank, pp_size, ...)`,
  `self.cfg = config` before the shell return, a no-op shell unless tp_rank == 0, the live one
  owning the SGLang server of its TP group (here: the FakeSGLangEngine registered for its
  devices, `ENGINES`); `update_weights_from_tensor(*, serialized_named_tensors,
  target_modules=None, load_format=None, flush_cache=True, track_prefix="")` forwarding the list
  to the server and then `self._version += 1`; `sleep` / `wake_up` BROADCAST;
  `unirl/rollout/engine/synchronous.py` `SyncRolloutEngine.set_version(train_version)` BROADCAST
  and `_stamp_output_version` (every generated sample carries `_version`; `generate` here returns
  it, DP_SCATTER reduced to one call per head).
- `unirl/rollout/engine/sglang/config.py` `SGLangEngineConfig` (ec153a9 fields:
  `pretrained_model_ckpt_path`, `tp_size`, `pp_size`, `backend`, `engine_kwargs`, ...) and the
  `__post_init__` refusal of `pp_size > 1` UniRL ships (`SGLangEngineConfig.pp_size>1 is not
  supported yet`, issue #490; PR #502 unmerged).
- The FSDP backend: `backend.model.state_dict()` of FSDP2 DTensors (fakes.py stand-ins),
  `rollout_adapter_name`, and torch.distributed's default group over the backend's workers, which
  UniRL's handlers use as their collective (`full/nccl.py` `_raise_if_rank0_phase_failed`,
  3a3f885: `dist.all_gather_object`). `FakeProcessGroups` stands for it: a default group per
  worker thread, with `broadcast_object_list` / `all_gather_object` patched onto
  torch.distributed for the test.
- Async trainers, `unirl/trainer/async_ar.py` (09bbaa7c; ec153a9 the same) and
  `agentic_async.py` (09bbaa7c): two disjoint slabs (`placement(fraction=train_fraction)` with
  `remote_hydra(sync_cfg, backend=self.backend)`, then the rollout slab), and `_connect_separate`:
  refuse a `_target_` not ending in "NCCLWeightSync", `pick_master()[0]`, targets =
  `rollout.tp_zero_workers` (agentic: `rollout.workers`), `set_rollout_targets(targets,
  role_name)`, `connect(master_addr=, master_port=, num_rollout_gpus=len(targets) * tp_size,
  tp_size=, pp_size=)` (agentic: `num_rollout_gpus=len(workers)` only). `AsyncBatchControl.
  sync_rollout` (async_batch_control.py 09bbaa7c) then calls `weight_sync.sync()` and
  `rollout.set_version(train_version)`.
- `unirl/config/require.py` `require(cond, msg)` raises ValueError.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import itertools
import queue
import threading
from dataclasses import dataclass, field
from enum import Enum, auto
from functools import wraps
from typing import Any, Callable, Dict, List, Optional, Tuple

from fakes_engines import _module

__all__ = ["unirl_modules", "RankInfo", "DevicePool", "placement", "remote", "remote_hydra",
           "parse_hydra_cfg", "FakeProcessGroups", "FakeFSDPBackend", "SGLangRolloutEngine",
           "SGLangEngineConfig", "ENGINES", "async_connect_separate"]

# ---------------------------------------------------------------------------------------------
# dispatch.py / remote.py
# ---------------------------------------------------------------------------------------------


@dataclass
class RankInfo:
    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


class Remote:
    def __init__(self) -> None:
        self.transport = None
        self.device: Optional[str] = None
        self.rank_info: Optional[RankInfo] = None
        self.dist_env: Dict[str, str] = {}
        self._get_sibling = None

    def setup(self, transport, device, rank_info, dist_env=None, get_sibling=None) -> None:
        self.transport, self.device, self.rank_info = transport, device, rank_info
        self.dist_env = dist_env or {}
        self._get_sibling = get_sibling


class Dispatch(Enum):
    BROADCAST = auto()
    SCATTER = auto()
    DP_SCATTER = auto()
    DP_SCATTER_HEAD = auto()


class Execute(Enum):
    ALL = auto()
    RANK_ZERO = auto()


DISTRIBUTED_CONFIG_ATTR = "_distributed_config"


def distributed(_func=None, *, dispatch_mode=Dispatch.DP_SCATTER, execute_mode=Execute.ALL):
    def decorator(func):
        @wraps(func)
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)

        setattr(wrapper, DISTRIBUTED_CONFIG_ATTR,
                {"dispatch_mode": dispatch_mode, "execute_mode": execute_mode})
        return wrapper

    return decorator(_func) if _func is not None else decorator


def require(condition, message):
    if not condition:
        raise ValueError(message)


# ---------------------------------------------------------------------------------------------
# full/base.py
# ---------------------------------------------------------------------------------------------


def _one_star(s):
    return isinstance(s, str) and s.count("*") == 1


def _validate_name_remap(name_remap):
    rules = dict(name_remap or {})
    keys = list(rules.keys())
    for i, (key, value) in enumerate(rules.items()):
        require(_one_star(key), f"name_remap key {key!r} needs one '*'.")
        require(value is None or _one_star(value),
                f"name_remap[{key!r}] value: null or one '*'; got {value!r}.")
        require(key != "*" or i == len(keys) - 1,
                f"name_remap '*' must be last; shadows {keys[i + 1:]!r}.")
    return rules


def _apply_name_remap(name, name_remap):
    for key, value in name_remap.items():
        pre, _, post = key.partition("*")
        if name.startswith(pre) and name.endswith(post) and len(name) >= len(pre) + len(post):
            if value is None:
                return None
            vpre, _, vpost = value.partition("*")
            return vpre + name[len(pre): len(name) - len(post)] + vpost
    return name


class FullWeightSync(Remote):
    def __init__(self, *, backend, bucket_size_mb=512, flush_cache=True, lora_merged=False,
                 adapter_name=None, name_remap=None, track_prefix="", wire_dtype=None):
        super().__init__()
        self._backend = backend
        self._bucket_bytes = int(bucket_size_mb) * 1024 * 1024
        self._flush_cache = bool(flush_cache)
        self._lora_merged = bool(lora_merged)
        self._adapter_name = str(adapter_name) if adapter_name is not None else str(
            backend.rollout_adapter_name)
        self._name_remap = _validate_name_remap(name_remap)
        self._track_prefix = str(track_prefix or "")
        self._wire_dtype = wire_dtype
        self.weight_version = 0

    @property
    def _my_rank(self):
        ri = self.rank_info
        return ri.rank if ri is not None else 0


# ---------------------------------------------------------------------------------------------
# torch.distributed's default group, one per job (the FSDP backend's), a member per worker
# ---------------------------------------------------------------------------------------------


class _Group:
    def __init__(self, world: int) -> None:
        self.world = world
        self._cv = threading.Condition()
        self._gen = 0
        self._slots: Dict[int, Any] = {}
        self._done: Dict[int, List[Any]] = {}

    def exchange(self, rank: int, obj: Any, timeout: float = 120.0) -> List[Any]:
        with self._cv:
            gen = self._gen
            self._slots[rank] = obj
            if len(self._slots) == self.world:
                self._done[gen] = [self._slots[r] for r in range(self.world)]
                self._slots, self._gen = {}, gen + 1
                self._cv.notify_all()
            elif not self._cv.wait_for(lambda: gen in self._done, timeout):
                raise RuntimeError(f"collective {gen}: rank {rank} waited {timeout:.0f}s")
            return list(self._done[gen])


class FakeProcessGroups:
    """torch.distributed as a UniRL worker process has it after the FSDP backend's
    init_process_group: `join(group, rank)` on the worker's thread; `patched()` installs
    is_available / is_initialized / get_rank / get_world_size / broadcast_object_list /
    all_gather_object on torch.distributed for the test."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.groups: Dict[str, _Group] = {}
        self.calls: List[Tuple[str, int]] = []

    def join(self, key: str, rank: int, world: int) -> None:
        g = self.groups.setdefault(key, _Group(world))
        self._local.member = (g, rank)

    def _me(self) -> Tuple[_Group, int]:
        m = getattr(self._local, "member", None)
        if m is None:
            raise RuntimeError("Default process group has not been initialized")
        return m

    def is_initialized(self) -> bool:
        return getattr(self._local, "member", None) is not None

    def get_rank(self) -> int:
        return self._me()[1]

    def get_world_size(self) -> int:
        return self._me()[0].world

    def broadcast_object_list(self, objs: List[Any], src: int = 0) -> None:
        g, rank = self._me()
        self.calls.append(("broadcast_object_list", rank))
        got = g.exchange(rank, objs[0] if rank == src else None)
        objs[0] = got[src]

    def all_gather_object(self, out: List[Any], obj: Any) -> None:
        g, rank = self._me()
        self.calls.append(("all_gather_object", rank))
        out[:] = g.exchange(rank, obj)

    @contextlib.contextmanager
    def patched(self):
        import torch.distributed as dist

        names = ("is_available", "is_initialized", "get_rank", "get_world_size",
                 "broadcast_object_list", "all_gather_object")
        saved = {n: getattr(dist, n, None) for n in names}
        mine = dict(is_available=lambda: True, is_initialized=self.is_initialized,
                    get_rank=self.get_rank, get_world_size=self.get_world_size,
                    broadcast_object_list=self.broadcast_object_list,
                    all_gather_object=self.all_gather_object)
        for n, f in mine.items():
            setattr(dist, n, f)
        try:
            yield self
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)


PROCESS_GROUPS = FakeProcessGroups()

# ---------------------------------------------------------------------------------------------
# worker.py / handle.py / placement.py / hydra.py
# ---------------------------------------------------------------------------------------------


class _Ref:
    def __init__(self, fut: concurrent.futures.Future) -> None:
        self._fut = fut


class GetTimeoutError(TimeoutError):
    """ray.exceptions.GetTimeoutError."""


def _ray_get(ref, timeout=None):
    if isinstance(ref, list):
        return [_ray_get(r, timeout) for r in ref]
    try:
        return ref._fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError as e:
        raise GetTimeoutError(f"Get timed out: some object(s) not ready after {timeout}s") from e


class _ActorMethod:
    def __init__(self, worker: "Worker", fn: Callable[..., Any]) -> None:
        self._worker, self._fn = worker, fn

    def remote(self, *args, **kwargs) -> _Ref:
        return self._worker._submit(lambda: self._fn(*args, **kwargs))


class Worker:
    """One GPU's actor: its roles by name; calls run on its own thread, one at a time."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.worker_id = f"dw{index}"
        self._roles: Dict[str, Any] = {}
        self._q: "queue.Queue[Any]" = queue.Queue()
        self.calls: List[Tuple[str, str]] = []
        self.call = _ActorMethod(self, self._call)
        self.add_remote = _ActorMethod(self, self._add_remote)
        threading.Thread(target=self._loop, name=f"unirl-worker-{index}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - surfaced by ray.get
                fut.set_exception(e)

    def _submit(self, fn: Callable[[], Any]) -> _Ref:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fn, fut))
        return _Ref(fut)

    def stop(self) -> None:
        self._q.put(None)

    def _add_remote(self, role_name, role_cls, rank_info, init_kwargs=None, dist_env=None):
        role = role_cls(**self._resolve_init_kwargs(init_kwargs or {}))
        role.setup(transport=None, device=f"cuda:{self.index}", rank_info=rank_info,
                   dist_env=dist_env, get_sibling=lambda name: self._roles[name])
        self._roles[role_name] = role

    def _resolve_init_kwargs(self, obj):
        if isinstance(obj, HandleRef):
            try:
                return self._roles[obj.role_name]
            except KeyError:
                raise RuntimeError(f"Cannot resolve sibling Handle '{obj.role_name}' on Worker "
                                   f"{self.worker_id}: not registered on this Worker") from None
        if isinstance(obj, dict):
            children = {k: self._resolve_init_kwargs(v) for k, v in obj.items() if k != "_target_"}
            if "_target_" in obj:
                return get_method(obj["_target_"])(**children)
            return children
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._resolve_init_kwargs(v) for v in obj)
        return obj

    def _call(self, role_name, method_name, args, kwargs):
        self.calls.append((role_name, method_name))
        return getattr(self._roles[role_name], method_name)(*args, **kwargs)


@dataclass(frozen=True)
class HandleRef:
    role_name: str
    sp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1


_role_counter = itertools.count()


def _is_sglang_rollout_role(role_cls) -> bool:
    return getattr(role_cls, "_accepts_rollout_tp_kwargs", False) is True


def _cfg_get(cfg, key, default):
    val = cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)
    return int(val or default)


def _parallel_shape(init_kwargs, world, role_cls):
    tp = pp = 1
    if _is_sglang_rollout_role(role_cls) and init_kwargs.get("config") is not None:
        tp = max(tp, _cfg_get(init_kwargs["config"], "tp_size", 1))
        pp = max(pp, _cfg_get(init_kwargs["config"], "pp_size", 1))
    for value in init_kwargs.values():
        if isinstance(value, HandleRef):
            tp, pp = max(tp, value.tp_size), max(pp, value.pp_size)
    if world % (tp * pp):
        raise ValueError(f"world_size ({world}) must be divisible by tp_size*pp_size ({tp * pp})")
    return tp, pp


def _rank_infos(world, tp, pp):
    inner = tp * pp
    return [RankInfo(rank=i, world_size=world, dp_rank=i // inner, dp_size=world // inner,
                     tp_rank=i % tp, tp_size=tp, pp_rank=(i // tp) % pp, pp_size=pp)
            for i in range(world)]


class Handle:
    def __init__(self, role_cls, pool: "DevicePool", device_ids: List[int],
                 init_kwargs: Dict[str, Any]) -> None:
        self.role_cls, self.pool = role_cls, pool
        self.role_name = f"{role_cls.__name__}_{next(_role_counter)}"
        self.device_ids = list(device_ids)
        self.world_size = len(device_ids)
        self.workers = [pool.workers[d] for d in device_ids]
        tp, pp = _parallel_shape(init_kwargs, self.world_size, role_cls)
        self.rank_infos = _rank_infos(self.world_size, tp, pp)
        base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + device_ids[0]),
                "WORLD_SIZE": str(self.world_size), "GROUP_NAME": self.role_name}
        is_tp_engine = _is_sglang_rollout_role(role_cls)

        def kwargs_of(i):
            kw, ri = dict(init_kwargs), self.rank_infos[i]
            if is_tp_engine and (ri.tp_size > 1 or ri.pp_size > 1):
                start = (ri.dp_rank * ri.pp_size + ri.pp_rank) * ri.tp_size
                kw.update(tp_rank=ri.tp_rank, tp_size=ri.tp_size, pp_rank=ri.pp_rank,
                          pp_size=ri.pp_size, ep_rank=0, ep_size=1,
                          tp_device_ids=self.device_ids[start:start + ri.tp_size])
            return kw

        _ray_get([w.add_remote.remote(self.role_name, role_cls, self.rank_infos[i],
                                      init_kwargs=kwargs_of(i),
                                      dist_env={"RANK": str(i), **base})
                  for i, w in enumerate(self.workers)], timeout=120)
        for name in dir(role_cls):
            cfg = getattr(getattr(role_cls, name, None), DISTRIBUTED_CONFIG_ATTR, None)
            if cfg is not None:
                setattr(self, name, self._bind(name, cfg))

    def _bind(self, name, cfg):
        def call(*args, **kwargs):
            assert cfg["dispatch_mode"] is Dispatch.BROADCAST, "only BROADCAST is faked"
            targets = self.workers[:1] if cfg["execute_mode"] is Execute.RANK_ZERO \
                else self.workers
            return _ray_get([w.call.remote(self.role_name, name, args, kwargs) for w in targets],
                            timeout=300)

        return call

    @property
    def dp_size(self):
        return self.rank_infos[0].dp_size

    @property
    def tp_size(self):
        return self.rank_infos[0].tp_size

    @property
    def pp_size(self):
        return self.rank_infos[0].pp_size

    @property
    def sp_size(self):
        return 1

    @property
    def ep_size(self):
        return 1

    @property
    def tp_zero_workers(self):
        return [w for w, ri in zip(self.workers, self.rank_infos) if ri.tp_rank == 0]

    @property
    def engine_replicas(self):
        return [i for i, ri in enumerate(self.rank_infos) if ri.tp_rank == 0 and ri.pp_rank == 0]

    def local(self, i: int) -> Any:
        """Test access: the role object on worker i (what the Worker holds)."""
        return self.workers[i]._roles[self.role_name]


class DevicePool:
    def __init__(self, num_gpus: int) -> None:
        self.num_devices = num_gpus
        self.workers = [Worker(i) for i in range(num_gpus)]
        self._claimed: set = set()

    def create_remote(self, role_cls, init_kwargs):
        return Handle(role_cls, self, list(_current[-1]), init_kwargs)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()


_current: List[Tuple[int, ...]] = []


@contextlib.contextmanager
def placement(pool: DevicePool, *, fraction: float = 1.0, shared_workers: bool = True):
    assert shared_workers and not _current, "top-level shared scopes only"
    free = [d for d in range(pool.num_devices) if d not in pool._claimed]
    n = int(round(fraction * pool.num_devices))
    devices = tuple(free[:n])
    pool._claimed.update(devices)
    _current.append(devices)
    try:
        yield devices
    finally:
        _current.pop()


def _to_marker(value):
    if isinstance(value, Handle):
        return HandleRef(value.role_name, value.sp_size, value.tp_size, value.pp_size,
                         value.ep_size)
    return value


def remote(role_cls, **kwargs):
    if not _current:
        raise RuntimeError("remote() must be called inside a placement(...) block")
    return _pool_of_scope.create_remote(role_cls, {k: _to_marker(v) for k, v in kwargs.items()})


_pool_of_scope: Any = None


def get_method(path: str):
    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


_RESERVED = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})


def parse_hydra_cfg(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """cfg: the block as OmegaConf.to_container(resolve=True) gives it (plain data)."""
    return {"role_cls": get_method(cfg["_target_"]),
            **{k: v for k, v in cfg.items() if k not in _RESERVED}}


def remote_hydra(cfg: Dict[str, Any], **kwargs):
    return remote(**parse_hydra_cfg(cfg), **kwargs)


# ---------------------------------------------------------------------------------------------
# The FSDP backend and the SGLang rollout role
# ---------------------------------------------------------------------------------------------


class FakeFSDPBackend(Remote):
    """UniRL's FSDP backend as the handler sees it: `.model.state_dict()` of FSDP2 DTensor
    stand-ins of `full` (its own shard per rank), `rollout_adapter_name`, and the default
    torch.distributed group over its workers, joined on its worker's thread."""

    rollout_adapter_name = "default"

    def __init__(self, full: Dict[str, Any], group: str = "fsdp") -> None:
        super().__init__()
        self._full, self._group = full, group
        self.state: Dict[str, Any] = {}
        self.model = type("Model", (), {"state_dict": lambda _m: self.state})()

    def setup(self, transport, device, rank_info, dist_env=None, get_sibling=None) -> None:
        from fakes import fsdp_state_dict

        super().setup(transport, device, rank_info, dist_env, get_sibling)
        self.state = fsdp_state_dict(self._full, rank_info.rank, rank_info.world_size)
        PROCESS_GROUPS.join(self._group, rank_info.rank, rank_info.world_size)

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def load_full(self, full: Dict[str, Any]) -> None:
        """The optimizer step, as far as the sync sees it: new values in the same shards."""
        from fakes import fsdp_state_dict

        fresh = fsdp_state_dict(full, self.rank_info.rank, self.rank_info.world_size)
        for n, dt in self.state.items():
            dt._local[...] = fresh[n]._local


# The SGLang servers the live rollout roles boot, by their engine's device ids (stands for the
# server process SGLangRolloutEngine spawns over its TP group's GPUs).
ENGINES: Dict[Tuple[int, ...], Any] = {}


@dataclass
class SGLangEngineConfig:
    pretrained_model_ckpt_path: str = ""
    model_family: Optional[str] = None
    tp_size: Optional[int] = None
    pp_size: Optional[int] = None
    ep_size: Optional[int] = None
    dp_size: Optional[int] = None
    backend: str = "http"
    engine_kwargs: Optional[Dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engine_kwargs is None:
            self.engine_kwargs = {}
        require(bool(self.pretrained_model_ckpt_path),
                "SGLangEngineConfig.pretrained_model_ckpt_path must be set")
        require(self.pp_size is None or self.pp_size == 1,
                "SGLangEngineConfig.pp_size>1 is not supported yet (UniRL as shipped; PR #502)")


class SGLangRolloutEngine(Remote):
    _accepts_rollout_tp_kwargs = True
    _version: int = 0  # SyncRolloutEngine's class attribute

    def __init__(self, config, *, device=None, strategy=None, rank=None, model_config=None,
                 ports=None, tp_rank=0, tp_size=1, tp_visible_devices=None, tp_device_ids=None,
                 pp_rank=0, pp_size=1, ep_rank=0, ep_size=1):
        super().__init__()
        require(isinstance(config, SGLangEngineConfig),
                f"SGLangRolloutEngine requires SGLangEngineConfig; got {type(config).__name__}")
        self.cfg = config
        self._tp_rank, self._tp_size = int(tp_rank), int(tp_size)
        self._pp_rank, self._pp_size = int(pp_rank), int(pp_size)
        self._is_tp_zero = self._tp_rank == 0
        self.updates = 0
        if not self._is_tp_zero:
            self._backend = None
            return
        self._backend = ENGINES[tuple(tp_device_ids)]
        self._version = 0

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def wake_up(self, tags=None) -> None:
        pass

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def sleep(self, tags=None) -> None:
        pass

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def set_version(self, train_version: int) -> None:
        if train_version < 0:
            raise ValueError(f"train_version must be >= 0, got {train_version}")
        self._version = train_version

    @distributed(dispatch_mode=Dispatch.BROADCAST)
    def generate(self, req: Any = None) -> Optional[Dict[str, int]]:
        if not self._is_tp_zero:
            return None
        return {"output_version": self._version}

    def update_weights_from_tensor(self, *, serialized_named_tensors, target_modules=None,
                                   load_format=None, flush_cache=True, track_prefix=""):
        if not self._is_tp_zero:
            return
        ok, message = self._backend.update_serialized(serialized_named_tensors, load_format,
                                                      flush_cache)
        if not ok:
            raise RuntimeError(f"update_weights_from_tensor failed: {message}")
        self.updates += 1
        self._version += 1


# ---------------------------------------------------------------------------------------------
# async trainers: _connect_separate as written in async_ar.py / agentic_async.py (module
# docstring); `accepts` is the tuple of _target_ suffixes the trainer lets through
# ---------------------------------------------------------------------------------------------


def async_connect_separate(trainer: Any, sync_cfg: Dict[str, Any], *, accepts: Tuple[str, ...],
                           agentic: bool = False) -> None:
    target = str(sync_cfg.get("_target_", ""))
    if not target.endswith(accepts):
        raise ValueError(f"AsyncARTrainer (separate slabs) requires a cross-slab weight sync "
                         f"(NCCLWeightSync); got sync._target_={target!r}.")
    addr, port = trainer.weight_sync.pick_master()[0]
    if agentic:
        trainer.weight_sync.set_rollout_targets(trainer.rollout.workers, trainer.rollout.role_name)
        trainer.weight_sync.connect(master_addr=addr, master_port=port,
                                    num_rollout_gpus=len(trainer.rollout.workers))
        return
    tp_size, pp_size = trainer.rollout.tp_size, trainer.rollout.pp_size
    targets = trainer.rollout.tp_zero_workers
    trainer.weight_sync.set_rollout_targets(targets, trainer.rollout.role_name)
    trainer.weight_sync.connect(master_addr=addr, master_port=port,
                                num_rollout_gpus=len(targets) * tp_size, tp_size=tp_size,
                                pp_size=pp_size)


# ---------------------------------------------------------------------------------------------
# sys.modules
# ---------------------------------------------------------------------------------------------


def unirl_modules() -> Dict[str, Any]:
    return {
        "unirl": _module("unirl"),
        "unirl.config": _module("unirl.config"),
        "unirl.config.require": _module("unirl.config.require", require=require),
        "unirl.distributed": _module("unirl.distributed"),
        "unirl.distributed.group": _module("unirl.distributed.group"),
        "unirl.distributed.group.remote": _module("unirl.distributed.group.remote",
                                                  RankInfo=RankInfo, Remote=Remote),
        "unirl.distributed.group.dispatch": _module(
            "unirl.distributed.group.dispatch", Dispatch=Dispatch, Execute=Execute,
            distributed=distributed, DISTRIBUTED_CONFIG_ATTR=DISTRIBUTED_CONFIG_ATTR),
        "unirl.distributed.weight_sync": _module("unirl.distributed.weight_sync"),
        "unirl.distributed.weight_sync.full": _module("unirl.distributed.weight_sync.full"),
        "unirl.distributed.weight_sync.full.base": _module(
            "unirl.distributed.weight_sync.full.base", FullWeightSync=FullWeightSync,
            _validate_name_remap=_validate_name_remap, _apply_name_remap=_apply_name_remap),
        "unirl.rollout": _module("unirl.rollout"),
        "unirl.rollout.engine": _module("unirl.rollout.engine"),
        "unirl.rollout.engine.sglang": _module("unirl.rollout.engine.sglang"),
        "unirl.rollout.engine.sglang.engine": _module(
            "unirl.rollout.engine.sglang.engine", SGLangRolloutEngine=SGLangRolloutEngine),
        "unirl.rollout.engine.sglang.config": _module(
            "unirl.rollout.engine.sglang.config", SGLangEngineConfig=SGLangEngineConfig),
        "ray": _module("ray", get=_ray_get),
    }


@contextlib.contextmanager
def job(num_gpus: int):
    """A DevicePool whose scopes `remote` uses, torch.distributed patched; stops the workers."""
    global _pool_of_scope
    pool = DevicePool(num_gpus)
    _pool_of_scope = pool
    PROCESS_GROUPS.groups.clear()
    PROCESS_GROUPS.calls.clear()
    try:
        with PROCESS_GROUPS.patched():
            yield pool
    finally:
        _pool_of_scope = None
        pool.stop()
