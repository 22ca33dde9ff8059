"""Session: one sync rank of a job (a trainer rank or an engine rank), over the C++ SyncSession.

Tensors cross through DLPack with no copy: the session keeps each bound producer alive and the
C++ side reads (sources) or writes (destinations) the bound memory directly. Every blocking call
(connect, sync) releases the GIL.

Device tensors: with `device="auto"` (the default) a session whose first bound tensor is a CUDA
tensor becomes a device session on that tensor's GPU (builds with CUDA:
`shardsync._C.DEVICE_BINDING`): CUDA tensors are bound directly (packed, verified and landed on the
GPU, no copy) and every pair moves over the GPU transport that fits it (cuda_ipc on one GPU or
node, nccl across). `device=N` asks for that explicitly. A host session (`device=None`, or "auto"
with host tensors first) stages CUDA tensors through host copies when `staging` is "auto" (the
default) or "host": sources device -> host before each sync, destinations host -> device after
each successful one; `staging="never"` refuses them (UnimplementedError).

Transports: "auto" (the default) picks one per pair (transport.h, NewRoutedTransport): cuda_ipc /
nccl for device sessions, shm on one host / ucx across hosts for host sessions; a name ("ucx",
"shm", "nccl", ...) is tried first for every pair.
"""

from __future__ import annotations

import contextlib
from typing import (
    TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union)

from ._native import native
from .errors import FailedPreconditionError, InvalidArgumentError
from .plan import Plan

if TYPE_CHECKING:
    from . import _C
    from ._C import EngineParam, RankPlan, Region, TrainerParam
    from .types import SupportsDLPack, SyncReport

__all__ = ["Session", "LoopbackHub", "is_cuda_tensor"]

_DL_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


def is_cuda_tensor(t: Any) -> bool:
    """Whether `t` exports CUDA memory through DLPack (kDLCUDA or kDLCUDAManaged)."""
    dev = getattr(t, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return int(dev()[0]) in _DL_CUDA
    except Exception:  # noqa: BLE001 - a producer without a usable device is treated as host
        return False


def LoopbackHub() -> "_C.LoopbackHub":  # noqa: N802 - a factory that reads like the C++ class
    """A hub shared by every session of one process on the loopback transport (ranks as threads
    of one process: tests, single-process examples)."""
    return native("session").LoopbackHub()


_default_hub: "Optional[_C.LoopbackHub]" = None


def default_loopback_hub() -> "_C.LoopbackHub":
    """The process-wide hub loopback sessions use when none is given (in-process ranks only)."""
    global _default_hub
    if _default_hub is None:
        _default_hub = LoopbackHub()
    return _default_hub


class Session:
    """One sync rank of a job: a trainer rank (binds sources) or an engine rank (binds
    destinations). Construct, bind every tensor, `connect()` once (collective), then `sync(v)`
    once per step (collective; v increasing). Use as a context manager or call `close()`.

    Args:
        plan: the job's Plan, built from the same arguments on every rank.
        rank: this process's sync rank (trainer ranks first, then `plan.engine_rank(d, tp, pp)`).
        store: "host:port" of the rendezvous store (`StoreServer` or `shardsync store`).
        token: the store's shared secret.
        transport: "auto" (per pair: shm on one host, ucx across hosts; cuda_ipc / nccl for
            device sessions), "loopback" (ranks as threads of one process, sharing `hub`), or a
            registered name tried first for every pair (`shardsync._C.transports()`).
        hub: the LoopbackHub of loopback ranks (default: one per process).
        prefix: store key namespace; distinct jobs on one store need distinct prefixes (a second
            job on a prefix another job holds fails at connect with FailedPreconditionError
            naming the prefix and that job).
        job_id: the launch this rank belongs to: a rank never joins a job of another launch on
            its prefix. None (the default): from the environment (SHARDSYNC_JOB_ID, else
            torchrun's TORCHELASTIC_RUN_ID, else SLURM_JOB_ID.SLURM_STEP_ID, else RAY_JOB_ID);
            "" for none. Ranks of one job started by different launchers (trainer under
            torchrun, engines under SGLang) pass one id.
        job_secret: the launch's secret, which each rank proves to claim its slot (a process
            that only knows the id is refused). None (the default): SHARDSYNC_JOB_SECRET when
            the id is the environment's; "" for none. A job of several ranks whose ranks have
            neither an id nor a secret refuses to connect: ranks started by `multiprocessing`
            (no launcher) pass `**shardsync.new_launch()` made once in the parent.
        connect_timeout, sync_timeout: seconds before `connect()` / `sync()` give up with
            DeadlineExceededError (every wait is bounded).
        staging: CUDA tensors in a host session: "auto" / "host" stage them through host copies
            around each sync, "never" refuses them.
        transport_params: transport options (strings), e.g. {"nccl_depth": "2"}.
        device: "auto" (a CUDA tensor bound first makes this a device session on its GPU), a
            CUDA index, or None (host session).
        commit: "inplace" (bytes land in the bound parameters: the engine must not read them
            during `sync`) or "staged" (engine ranks land every sync in a staging area of their
            own while the engine keeps serving, and `commit(version)` copies a verified version
            into the bound parameters; docs/staged-commit.md). None: the plan's `commit`.
        staging_memory: commit="staged": "auto" (the bound parameters' memory), "device" or
            "host"; the transports land only in the parameters' memory, so the other is refused.
        commit_scope: commit="staged": the engine ranks that commit together, "job" or
            "replica" (this rank's DP replica).
        keep_previous: commit="staged": how `rollback()` restores the previous version: "auto"
            ("area" when it fits beside staging, else "swap"), "area" (a second copy made while
            the engine serves; the commit stall stays one copy), "swap" (the commit exchanges
            staging and parameters; no second area, twice the copy traffic), "none".
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        store: str,
        *,
        token: str = "",
        transport: str = "auto",
        hub: "Optional[_C.LoopbackHub]" = None,
        prefix: str = "ss/",
        connect_timeout: float = 60.0,
        sync_timeout: float = 60.0,
        staging: str = "auto",
        transport_params: Optional[Mapping[str, str]] = None,
        device: Union[str, int, None] = "auto",
        job_id: Optional[str] = None,
        job_secret: Optional[str] = None,
        commit: Optional[str] = None,
        staging_memory: str = "auto",
        commit_scope: str = "job",
        keep_previous: str = "auto",
    ) -> None:
        if staging not in ("auto", "host", "never"):
            raise InvalidArgumentError(f"staging: must be auto, host or never, got {staging!r}")
        if not isinstance(plan, Plan):
            raise InvalidArgumentError(f"plan: expected a shardsync.Plan, got {type(plan).__name__}")
        if transport == "loopback" and hub is None:
            hub = default_loopback_hub()
        if device != "auto" and device is not None and not isinstance(device, int):
            raise InvalidArgumentError(f"device: expected 'auto', None or a CUDA index, got {device!r}")
        if job_id is not None and not isinstance(job_id, str):
            raise InvalidArgumentError(f"job_id: expected a str or None, got {job_id!r}")
        if job_secret is not None and not isinstance(job_secret, str):
            # The value is not echoed: it is a secret.
            raise InvalidArgumentError(
                f"job_secret: expected a str or None, got a {type(job_secret).__name__}")
        self.plan = plan
        self.staging = staging
        if commit is None:
            commit = getattr(plan, "commit", "inplace")
        self.commit_mode = commit
        self._args: Dict[str, Any] = dict(
            rank=rank, store=store, token=token, transport=transport, hub=hub, prefix=prefix,
            connect_timeout=connect_timeout, sync_timeout=sync_timeout,
            transport_params=dict(transport_params or {}), job_id=job_id, job_secret=job_secret,
            commit=commit, staging_memory=staging_memory, commit_scope=commit_scope,
            keep_previous=keep_previous,
        )
        self._auto_device = device == "auto"
        self._bound = False
        self._native = self._make_native(device if isinstance(device, int) else None)
        # (device tensor, host copy) pairs staged around each sync.
        self._staged_sources: List[Tuple[Any, Any]] = []
        self._staged_dests: List[Tuple[Any, Any]] = []
        # (what, tensor, data_ptr at bind) of tensors bound without a copy that can move their
        # storage (torch: `.data = ...`, `share_memory_()`, `set_()`): checked before each sync.
        self._bound_ptrs: List[Tuple[str, Any, int]] = []
        self._connected = False

    def _make_native(self, device: Optional[int]) -> "_C.SyncSession":
        a = self._args
        native_session = native("session").SyncSession(
            self.plan.inputs, a["rank"], a["store"], token=a["token"], transport=a["transport"],
            hub=a["hub"], prefix=a["prefix"], connect_timeout=a["connect_timeout"],
            sync_timeout=a["sync_timeout"], transport_params=dict(a["transport_params"]),
            device=-1 if device is None else int(device), job_id=a["job_id"],
            job_secret=a["job_secret"],
            commit=a["commit"], staging_memory=a["staging_memory"],
            commit_scope=a["commit_scope"], keep_previous=a["keep_previous"],
        )
        self.device = device
        return native_session

    def _resolve_device(self, tensor: Any) -> None:
        """device="auto": the first bound tensor decides (a CUDA tensor: a device session on its
        GPU, where the build can bind device memory)."""
        if not self._auto_device or self._bound:
            return
        self._bound = True
        if not is_cuda_tensor(tensor) or not native().DEVICE_BINDING:
            return
        index = int(tensor.__dlpack_device__()[1])
        self._native.close()
        self._native = self._make_native(index)

    @classmethod
    def from_env(cls, plan: Plan, **kwargs: Any) -> "Session":
        """Rank, store and token from the launch contract (SHARDSYNC_STORE, RANK / SLURM_PROCID,
        SHARDSYNC_TOKEN), as torchrun, SLURM and Ray set them."""
        env = native("store").launch_env()
        if env["world_size"] != plan.world_size:
            raise InvalidArgumentError(
                f"WORLD_SIZE: {env['world_size']} but the plan's sync world is {plan.world_size}"
            )
        kwargs.setdefault("token", env["token"])
        return cls(plan, env["rank"], env["store"], **kwargs)

    # ---- identity ----
    @property
    def rank(self) -> int:
        """This session's sync rank."""
        return self._native.rank

    @property
    def job_id(self) -> str:
        """The launch id this session uses ("" for none): `job_id` or the environment's."""
        return self._native.job_id

    @property
    def is_trainer(self) -> bool:
        """True for a trainer rank (binds sources), False for an engine rank (destinations)."""
        return self._native.is_trainer

    @property
    def is_poisoned(self) -> bool:
        """An engine rank whose last sync failed: its parameters may hold a mix of versions until
        a later sync succeeds (the hooks refuse to serve from it)."""
        return self._native.is_poisoned

    @property
    def last_good_version(self) -> int:
        """The last version this rank synced and verified (0 before the first)."""
        return self._native.last_good_version

    @property
    def staging_bytes(self) -> int:
        """Engine ranks: bytes of the staging area a staged commit needs (`plan.staging_bytes`);
        0 for trainer ranks."""
        return int(self._native.staging_bytes)

    @property
    def committed_version(self) -> int:
        """The version the bound parameters hold: the last committed one (commit="staged"; 0
        before the first commit), else the last good version."""
        return int(self._native.committed_version)

    @property
    def keep_previous(self) -> str:
        """commit="staged", once connected: how `rollback()` restores ("area", "swap", "none")."""
        return str(self._native.keep_previous)

    @property
    def rank_plan(self) -> "RankPlan":
        """This rank's part of the plan: the messages it sends or receives."""
        return self._native.plan

    def expected_params(self) -> "List[EngineParam]":
        """Engine ranks: every parameter (engine name, local shape, dtype, pieces) to bind."""
        return list(self._native.expected_params())

    def expected_sources(self) -> "List[TrainerParam]":
        """Trainer ranks: this rank's local parameters (its trainer map, `plan.trainer_params`):
        Megatron's local names per model chunk, or one per HF tensor for FSDP-like layouts."""
        return list(self._native.expected_sources())

    # ---- binding ----
    def _stage(self, tensor: Any, what: str) -> Any:
        if not is_cuda_tensor(tensor) or self.device is not None:
            return None  # host tensor, or a device session that binds CUDA memory itself
        if self.staging == "never":
            raise _unimplemented(what)
        if not hasattr(tensor, "detach") or not hasattr(tensor, "copy_"):
            raise InvalidArgumentError(f"{what}: host staging of device tensors needs torch tensors")
        t = tensor.detach()
        return t.to("cpu").contiguous()

    def bind_source(self, hf_name: str, tensor: "SupportsDLPack",
                    region: "Optional[Region | Tuple[Sequence[int], Sequence[int]]]" = None,
                    chunk: Optional[int] = None) -> None:
        """Trainer ranks: the shard of HF tensor `hf_name` this rank holds, borrowed without a
        copy (its bytes are read at every sync, so update it in place). Default region: the
        plan's held region for this rank (`plan.held_region(rank, shape)`); the tensor's shape
        must equal the region's extents and its dtype the plan's trainer dtype.

        Megatron trainers bind local parameters instead: `hf_name` is then the local name inside
        model chunk `chunk` (default 0), as `expected_sources()` lists them
        ("decoder.layers.0.self_attention.linear_qkv.weight"), the whole tensor with its local
        shape, and no region. Passing `chunk` binds a local parameter on FSDP-like layouts too
        (named like its HF tensor). `shardsync.bind_trainer(session, model_chunks)` does this
        for every parameter of a Megatron model."""
        with self._failing_before_connect(f"bind_source('{hf_name}')"):
            self._resolve_device(tensor)
            host = self._stage(tensor, f"source '{hf_name}'")
            if host is not None:
                self._native.bind_source(hf_name, host, region, chunk)
                self._staged_sources.append((tensor, host))
            else:
                with _device_guard(tensor):
                    self._native.bind_source(hf_name, tensor, region, chunk)
                self._remember_ptr(f"source '{hf_name}'", tensor)

    def bind_destination(self, name: str, tensor: "SupportsDLPack") -> None:
        """Engine ranks: parameter `name` (the engine's name, e.g.
        "model.layers.3.self_attn.qkv_proj.weight") with its local shape and the wire dtype;
        each sync writes into it in place."""
        with self._failing_before_connect(f"bind_destination('{name}')"):
            self._resolve_device(tensor)
            host = self._stage(tensor, f"destination '{name}'")
            if host is not None:
                self._native.bind_destination(name, host)
                self._staged_dests.append((tensor, host))
            else:
                with _device_guard(tensor):
                    self._native.bind_destination(name, tensor)
                self._remember_ptr(f"destination '{name}'", tensor)

    def _remember_ptr(self, what: str, tensor: Any) -> None:
        ptr = getattr(tensor, "data_ptr", None)
        if callable(ptr):
            self._bound_ptrs.append((what, tensor, int(ptr())))

    def _check_bound_memory(self, version: int) -> None:
        """A bound torch tensor whose storage moved since it was bound (`param.data = new`,
        `share_memory_()`, `set_()`) leaves the session on the old bytes: reading them syncs
        stale weights that still verify (the checksums cover what was read), or freed memory.
        Refused before the sync, naming the tensor; the peers' sync fails at once (fail_sync)."""
        for what, t, ptr in self._bound_ptrs:
            now = int(t.data_ptr())
            if now != ptr:
                e = FailedPreconditionError(
                    f"rank {self.rank}, version {version}: {what} moved since it was bound "
                    f"(data_ptr {ptr:#x} -> {now:#x}: its storage was replaced, e.g. "
                    "`param.data = ...`, `share_memory_()` or `set_()`); the session still "
                    "reads the old memory. Update bound tensors in place (copy_, optimizer "
                    "steps), or move them before binding / bind a new session")
                self.fail_sync(version, e)
                raise e

    def fail_before_connect(self, why: "str | BaseException") -> None:
        """This rank will not connect: every peer waiting in `connect()` fails at once, naming
        this rank and `why` (an exception: its type and message), instead of at its
        connect_timeout. A failed bind_* call does this itself; call it for an error of your own
        between creating the session and `connect()` (e.g. `except Exception as e:
        session.fail_before_connect(e); raise`). No-op once connected."""
        if isinstance(why, BaseException):
            why = f"{type(why).__name__}: {why}"
        self._native.fail_before_connect(str(why))

    def fail_sync(self, version: int, why: "str | BaseException") -> None:
        """This rank will not run `sync(version)`: a check of your own failed before it (an
        exception: its type and message). Every peer in or entering that sync raises
        AbortedError at once, naming this rank and `why`, instead of at its sync_timeout; the
        version is spent (use a newer one next). Before `connect()`: `fail_before_connect`."""
        if isinstance(why, BaseException):
            why = f"{type(why).__name__}: {why}"
        self._native.fail_sync(int(version), str(why))

    @contextlib.contextmanager
    def _failing_before_connect(self, what: str) -> "Iterator[None]":
        """An exception inside (a bind's, the native one's or a conversion's) is posted to the
        peers before it propagates: the rank cannot connect without that binding."""
        try:
            yield
        except Exception as e:
            if not self._connected:
                try:
                    self.fail_before_connect(f"{what}: {type(e).__name__}: {e}")
                except Exception:  # a closed session: the original error matters, not this
                    pass
            raise

    def bind_sources(self, tensors: "Mapping[str, SupportsDLPack]") -> None:
        """`bind_source` for every (HF name, shard) of a mapping, each with its default region."""
        for name, t in tensors.items():
            self.bind_source(name, t)

    def bind_destinations(
        self,
        tensors: "Mapping[str, SupportsDLPack] | Iterable[Tuple[str, SupportsDLPack]]",
    ) -> None:
        """`bind_destination` for every (name, tensor): a mapping or `named_parameters()`."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        for name, t in items:
            self.bind_destination(name, t)

    # ---- run ----
    def connect(self) -> None:
        """Collective: joins the job (rank 0 claims `prefix`, the others join its claim), checks
        plan hashes and bindings on every rank, connects the transport. A rank that is gone (its
        process exited, or its session closed) fails every rank waiting on it within about a
        second, naming it; so does a rank whose bind failed (or that called
        `fail_before_connect`) since its Session was created: the others raise AbortedError
        naming it and its error. A connect that times out (DeadlineExceededError) names the ranks
        that never reached connect()."""
        self._native.connect()
        self._connected = True

    def sync(self, version: int) -> "SyncReport":
        """Replays the plan for `version`: equal on every rank, in 1 ..
        shardsync._C.MAX_SYNC_VERSION = 2**63 - 1 (else InvalidArgumentError), and greater than
        every version this rank attempted before (else FailedPreconditionError, "is stale",
        nothing touched; a failed version is not retried: use a newer one).
        Returns the job-wide report: version, bytes, seconds, gbps, slowest_rank, checksums_ok,
        checksums_total, verified, local, ranks. Raises the shardsync.Error subclass of the
        failure (DataLossError on a checksum mismatch, DeadlineExceededError, UnavailableError,
        AbortedError, ...) on every rank."""
        if not self._connected:
            raise FailedPreconditionError(f"rank {self.rank}: sync before connect")
        bound = native("session").MAX_SYNC_VERSION
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= bound:
            raise InvalidArgumentError(
                f"version: {version!r} outside 1..{bound} (MAX_SYNC_VERSION)")
        self._check_bound_memory(version)
        for dev, host in self._staged_sources:
            host.copy_(dev.detach())
        report = self._native.sync(int(version))
        # This rank's transfer (commit="inplace": the engine's stall too) and staging.
        report["transfer_seconds"] = report["local"]["seconds"]
        report["staging_bytes"] = self.staging_bytes if self.commit_mode == "staged" else 0
        if self.commit_mode != "staged":
            report["stall_seconds"] = report["transfer_seconds"]
            self._copy_out()
        return report

    def commit(self, version: int) -> Dict[str, Any]:
        """commit="staged", collective over the engine ranks of `commit_scope` (call it with the
        engine paused): once every one of them verified `version` (the last `sync`), copies the
        staging area into the bound parameters. Returns {version, bytes, stall_seconds,
        copy_seconds, keep_previous, staging_bytes}. A rank that cannot commit makes every rank of
        the scope raise, and those that already copied roll back: the bound parameters then hold
        the version they served. No-op on trainer ranks."""
        if not self._connected:
            raise FailedPreconditionError(f"rank {self.rank}: commit before connect")
        rep = dict(self._native.commit(int(version)))
        rep["staging_bytes"] = self.staging_bytes
        self._copy_out()
        return rep

    def rollback(self) -> None:
        """commit="staged", engine ranks (local; call it on every rank of the scope): restores the
        version committed before the last commit, bit for bit. Possible from a commit until the
        next sync replaces what was kept; FailedPreconditionError otherwise, and with
        keep_previous="none"."""
        self._native.rollback()
        self._copy_out()

    def _copy_out(self) -> None:
        """Host-staged CUDA destinations get what the bound host copies hold."""
        for dev, host in self._staged_dests:
            with _no_grad():
                dev.copy_(host)

    def close(self) -> None:
        """Leaves the job and releases every bound tensor (idempotent)."""
        self._native.close()
        self._staged_sources.clear()
        self._staged_dests.clear()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "trainer" if self.is_trainer else "engine"
        return f"Session(rank={self.rank}, {role}, plan={self.plan.hash})"


def _unimplemented(what: str) -> Exception:
    from .errors import UnimplementedError

    return UnimplementedError(
        f"{what}: CUDA tensors cannot be bound directly by this build and staging='never'"
    )


def _device_guard(tensor: Any) -> Any:
    """torch exports a CUDA tensor through DLPack only while its GPU is the current device
    ("Can't export tensors on a different CUDA device index", seen on 2 H200s with ranks on GPU 1
    whose current device had become 0): bind under that device."""
    dev = getattr(tensor, "device", None)
    index = getattr(dev, "index", None)
    if getattr(dev, "type", None) == "cuda" and index is not None:
        import torch

        return torch.cuda.device(index)
    return contextlib.nullcontext()


class _no_grad:
    """torch.no_grad() without importing torch unless a device tensor was staged."""

    def __enter__(self) -> None:
        import torch

        self._ctx = torch.no_grad()
        self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
