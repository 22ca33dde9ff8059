"""shardsync: verified, shard-aware weight sync from RL trainers into inference engines.

    plan = shardsync.Plan("qwen3-8b", trainer="fsdp=8", rollout="dp=2,tp=4,pp=2")
    session = shardsync.Session.from_env(plan)   # or Session(plan, rank, store, token=...)
    ... bind_source / bind_destination ..., session.connect(), session.sync(version)

Guide and API: docs/python.md; runnable jobs: examples/. Pure-Python parts (errors, EngineGroup,
engine hooks, adapters) import without the native module; Layout / Plan / Session / Store need
`shardsync._C` (`pip install .` builds it). torch is never imported at import time.
"""

from __future__ import annotations

from . import types
from ._native import has_part, native
from .engine_group import LIFECYCLE_METHODS, EngineGroup, EngineWorker, ReplicaError, worker_coords
from .errors import (
    AbortedError,
    DataLossError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    UnavailableError,
    UnimplementedError,
)
from .layout import compute_layout
from .plan import Plan, dtype_name, load_model, shard_map
from .session import LoopbackHub, Session
from .store import StoreClient, StoreServer, new_launch
from .adapters import (
    MegatronSources,
    TrainerSources,
    allocate_params,
    bind_engine,
    bind_trainer,
    check_engine_params,
    megatron_sources,
    trainer_sources,
    trainer_spec_of,
)

__version__ = "0.1.0"

__all__ = [
    "Error",
    "InvalidArgumentError",
    "FailedPreconditionError",
    "NotFoundError",
    "DataLossError",
    "DeadlineExceededError",
    "UnavailableError",
    "InternalError",
    "UnimplementedError",
    "PermissionDeniedError",
    "AbortedError",
    "OutOfRangeError",
    "ReplicaError",
    "EngineGroup",
    "EngineWorker",
    "LIFECYCLE_METHODS",
    "worker_coords",
    "compute_layout",
    "Plan",
    "load_model",
    "shard_map",
    "dtype_name",
    "Session",
    "LoopbackHub",
    "StoreServer",
    "StoreClient",
    "new_launch",
    "TrainerSources",
    "MegatronSources",
    "megatron_sources",
    "trainer_spec_of",
    "trainer_sources",
    "bind_trainer",
    "bind_engine",
    "allocate_params",
    "check_engine_params",
    "has_part",
    "native",
]
