"""A fake of UniRL's weight-sync interface, with its real signatures (Tencent-Hunyuan/UniRL):

- `unirl/distributed/group/remote.py`: `RankInfo` (rank, world_size, dp/tp/pp/... ranks and
  sizes) and `Remote` (rank_info, device, dist_env set by `setup`);
- `unirl/distributed/group/dispatch.py`: `Dispatch` (BROADCAST, SCATTER, DP_SCATTER,
  DP_SCATTER_HEAD), `Execute` (ALL, RANK_ZERO), `distributed(dispatch_mode=, execute_mode=)`
  storing its config on the function (`_distributed_config`); the Handle calls the method on
  every worker of the role (Ray actors: concurrently), BROADCAST with the same arguments,
  RANK_ZERO on rank 0 only;
- `unirl/distributed/weight_sync/full/base.py`: `FullWeightSync(Remote)` with its constructor
  (backend, bucket_size_mb, flush_cache, lora_merged, adapter_name, name_remap, track_prefix,
  wire_dtype), `_validate_name_remap` / `_apply_name_remap` (ordered one-'*' rewrites, None
  drops), `_bucket_bytes`, `_flush_cache`, `_track_prefix`, `weight_version`, `_my_rank`;
- `unirl/distributed/group/worker.py` `Worker.call(role_name, method_name, args, kwargs)`
  reached as `handle.call.remote(...)` and collected with `ray.get(ref, timeout=)`;
- `unirl/rollout/engine/sglang/engine.py`: the SGLang wrapper's `update_weights_from_tensor(*,
  serialized_named_tensors, target_modules=None, load_format=None, flush_cache=True,
  track_prefix="")`, which forwards an `UpdateWeightsFromTensorReqInput` to the scheduler
  (here: FakeSGLangEngine.update_serialized); no begin/end_weight_update among its methods;
- `unirl/config/require.py` `require(cond, msg)` raises ValueError.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from enum import Enum, auto
from functools import wraps
from typing import Any, Dict, List, Optional

from fakes_engines import _module

__all__ = ["unirl_modules", "FakeRoleHandle", "FakeActorHandle", "FakeUniRLSGLangEngine",
           "FakeFSDPBackend", "RankInfo"]


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

    def setup(self, transport, device, rank_info, dist_env=None, get_sibling=None) -> None:
        self.transport, self.device, self.rank_info = transport, device, rank_info
        self.dist_env = dist_env or {}


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
        "ray": _module("ray", get=_ray_get),
    }


class FakeRoleHandle:
    """The Handle over one role's Remotes (one per train rank, Ray actors: concurrent)."""

    def __init__(self, remotes: List[Any]):
        self.remotes = remotes
        for r, remote in enumerate(remotes):
            remote.setup(None, "cpu", RankInfo(rank=r, world_size=len(remotes),
                                               dp_rank=r, dp_size=len(remotes)))

    def __getattr__(self, name):
        cfg = getattr(getattr(type(self.remotes[0]), name), DISTRIBUTED_CONFIG_ATTR)
        assert cfg["dispatch_mode"] is Dispatch.BROADCAST

        def call(*args, **kwargs):
            targets = self.remotes[:1] if cfg["execute_mode"] is Execute.RANK_ZERO \
                else self.remotes
            with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
                futs = [pool.submit(getattr(r, name), *args, **kwargs) for r in targets]
                return [f.result(timeout=120) for f in futs]

        return call


class _Ref:
    def __init__(self, fn):
        self._fut = concurrent.futures.Future()

        def run():
            try:
                self._fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - surfaced by ray.get
                self._fut.set_exception(e)

        threading.Thread(target=run, daemon=True).start()


class GetTimeoutError(TimeoutError):
    """ray.exceptions.GetTimeoutError."""


def _ray_get(ref, timeout=None):
    try:
        return ref._fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError as e:
        raise GetTimeoutError(f"Get timed out: some object(s) not ready after {timeout}s") from e


class FakeActorHandle:
    """A rollout Worker actor: `handle.call.remote(role_name, method_name, args, kwargs)`."""

    def __init__(self, roles: Dict[str, Any]):
        self._roles = roles
        self.calls: List[str] = []
        outer = self

        class _Call:
            @staticmethod
            def remote(role_name, method_name, args, kwargs):
                outer.calls.append(method_name)
                return _Ref(lambda: getattr(outer._roles[role_name], method_name)(*args,
                                                                                  **kwargs))

        self.call = _Call()


class FakeUniRLSGLangEngine:
    """UniRL's SGLang engine wrapper (live head) around a FakeSGLangEngine."""

    def __init__(self, engine):
        self.engine = engine

    def update_weights_from_tensor(self, *, serialized_named_tensors, target_modules=None,
                                   load_format=None, flush_cache=True, track_prefix=""):
        require(bool(serialized_named_tensors), "serialized_named_tensors must be non-empty")
        ok, message = self.engine.update_serialized(serialized_named_tensors, load_format,
                                                    flush_cache)
        if not ok:  # _extract_update_status: a failed update raises in the wrapper
            raise RuntimeError(f"update_weights_from_tensor failed: {message}")


class FakeFSDPBackend:
    """The FSDP backend sibling: `.model.state_dict()` of DTensor stand-ins (fakes.py)."""

    rollout_adapter_name = "default"

    def __init__(self, state_dict):
        self.model = type("Model", (), {"state_dict": lambda _self: state_dict})()
