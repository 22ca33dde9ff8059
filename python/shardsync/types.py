"""Types of the dictionaries shardsync returns (plan summaries, sync reports, ...).

Plain `dict`s at run time; these TypedDicts document their keys for readers and type checkers.
The native classes (Region, RankPlan, ShardMap, EngineParam, ...) are typed in `shardsync/_C.pyi`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, List, Protocol, Tuple, TypedDict, Union

if TYPE_CHECKING:
    from ._C import ModelSpec

__all__ = [
    "SupportsDLPack",
    "ModelArg",
    "DTypeArg",
    "SyncRankInfo",
    "EngineRankSummary",
    "Fp8Summary",
    "TrainerRankSummary",
    "PlanSummary",
    "DeltaFallbacks",
    "DeltaStats",
    "RankStats",
    "SyncReport",
    "CommitReport",
    "LaunchEnv",
    "TensorInfo",
    "PlanReport",
]


class SupportsDLPack(Protocol):
    """A tensor shardsync can borrow without a copy: torch, numpy >= 1.22, cupy, jax arrays. (A
    read-only numpy array, which refuses DLPack export, is borrowed through the buffer protocol.)"""

    def __dlpack__(self, *args: object, **kwargs: object) -> object: ...

    def __dlpack_device__(self) -> Tuple[int, int]: ...


#: A model: an embedded name ("qwen3-8b"), a config.json or its directory, or a loaded ModelSpec.
ModelArg = Union[str, "os.PathLike[str]", "ModelSpec"]

#: A dtype: any spelling the CLI takes ("bf16", "bfloat16", "fp32", "f32", "float32", "fp16",
#: "half", ...) or a torch / numpy dtype object (torch.bfloat16, numpy.float32).
DTypeArg = Union[str, object]


class SyncRankInfo(TypedDict):
    """`Plan.describe_rank(r)`: who sync rank r is (-1 for the fields of the other role)."""

    is_trainer: bool
    trainer_rank: int
    replica: int
    tp_rank: int
    pp_rank: int


class EngineRankSummary(TypedDict):
    """One engine rank of `Plan.summary()`: wire bytes it receives and bytes it owns."""

    replica: int
    tp_rank: int
    pp_rank: int
    recv_bytes: int
    owned_bytes: int


class TrainerRankSummary(TypedDict):
    """One trainer rank of `Plan.summary()`."""

    rank: int
    send_bytes: int


class Fp8Summary(TypedDict):
    """`Plan.summary()["quant"]` of a block-FP8 plan (docs/fp8.md): wire bytes by op kind, where
    blocks are quantized (trainer ranks on the fly, or engine ranks from staged rows), and the
    memory-bound work (every trainer element read once, every engine byte written once)."""

    copy_bytes: int
    quantize_bytes: int
    stage_bytes: int
    sender_quantized_elements: int
    receiver_quantized_elements: int
    amax_elements: int
    amax_bytes: int
    exchange_write_bytes: int
    staged_bands: int
    max_staging_bytes: int
    bound_read_bytes: int
    bound_write_bytes: int


class _PlanSummaryBase(TypedDict):
    plan_hash: str
    ops: int
    messages: int
    total_bytes: int
    engine_ranks: List[EngineRankSummary]
    trainer_ranks: List[TrainerRankSummary]
    plan_seconds: float


class PlanSummary(_PlanSummaryBase, total=False):
    """`Plan.summary()`: job-wide statistics, computed analytically (no op is enumerated).
    `broadcast_recv_bytes_per_rank` for bf16 plans; `quant` for block-FP8 ones."""

    broadcast_recv_bytes_per_rank: int
    quant: Fp8Summary


class DeltaFallbacks(TypedDict):
    """Buckets sent whole because the engine's base was not the image the trainer kept."""

    no_kept_image: int  # the trainer's first sync of the bucket (a new job)
    base_version_differs: int  # a failed or uncommitted sync, a rollback
    base_checksum_differs: int  # same version, other bytes: corrupted or restored


class DeltaStats(TypedDict):
    """The delta encoding's figures of one sync (Plan(encoding="delta" | "auto"); zeros under
    "full"). A report's own `delta` sums the trainer ranks' (what crossed the wire)."""

    wire_bytes: int
    full_bytes: int
    changed: int
    elements: int
    density: float  # changed / elements
    buckets_delta: int
    buckets_full: int
    fallbacks: DeltaFallbacks
    full_by_size: int  # the delta was not smaller than the bucket
    full_by_cost: int  # "auto": the delta did not pay at the link speed
    full_by_auto: int  # "auto" ran as "full": no delta can pay at the knobs' speeds
    encode_seconds: float
    decode_seconds: float
    first_fallback: str  # this rank's first fallback in words ("" if none)
    held_bytes: int  # this rank's host memory the delta steps hold (docs/delta.md), local only


class RankStats(TypedDict):
    """One rank's part of a sync report."""

    rank: int
    ok: bool
    error: str
    send_bytes: int
    recv_bytes: int
    seconds: float
    checksums_ok: int
    checksums_total: int
    delta: DeltaStats


class _SyncReportBase(TypedDict):

    version: int
    bytes: int
    seconds: float
    gbps: float
    slowest_rank: int
    checksums_ok: int
    checksums_total: int
    verified: bool  # every bucket's checksum matched on both sides
    local: RankStats
    ranks: List[RankStats]
    delta: DeltaStats


class SyncReport(_SyncReportBase, total=False):
    """`Session.sync(v)`: the job-wide report, the same on every rank, and what
    shardsync.Session.sync adds for this rank: its transfer seconds, its staging bytes
    (commit="staged"), and with commit="inplace" the engine's stall (the whole transfer)."""

    transfer_seconds: float
    staging_bytes: int
    stall_seconds: float


class _CommitReportBase(TypedDict):

    version: int
    bytes: int  # copied from staging into the bound parameters
    stall_seconds: float  # the commit call: agreement with the scope's ranks and the copy
    copy_seconds: float  # the copy alone
    keep_previous: str  # "area", "swap", "none": how rollback() restores


class CommitReport(_CommitReportBase, total=False):
    """`Session.commit(v)` (commit="staged"): this rank's commit; shardsync.Session.commit adds
    its staging bytes."""

    staging_bytes: int


class LaunchEnv(TypedDict):
    """The launch contract read from the environment (SHARDSYNC_STORE, RANK / SLURM_PROCID,
    WORLD_SIZE / SLURM_NTASKS, SHARDSYNC_TOKEN) and the launch id (SHARDSYNC_JOB_ID,
    TORCHELASTIC_RUN_ID or SLURM_JOB_ID.SLURM_STEP_ID; "" when none is set)."""

    store: str
    rank: int
    world_size: int
    token: str
    job_id: str


class TensorInfo(TypedDict):
    """`shardsync._C.tensor_info(t)`: what shardsync sees of a tensor through DLPack."""

    data_ptr: int
    dtype: str
    shape: List[int]
    device: str
    device_index: int
    nbytes: int


class _Rollout(TypedDict):
    dp: int
    tp: int
    pp: int
    ep: int
    engine: str


class _MinMeanMax(TypedDict):
    min: int
    mean: float
    max: int
    max_over_mean: float


class _TrainerTraffic(TypedDict):
    rank: int
    send_bytes: int
    ops: int
    messages: int
    intra_node_bytes: int
    node: int


class _EngineTraffic(TypedDict):
    sync_rank: int
    replica: int
    tp_rank: int
    pp_rank: int
    recv_bytes: int
    owned_bytes: int
    ops: int
    messages: int
    intra_node_bytes: int
    node: int


class _NodePair(TypedDict):
    src_node: int
    dst_node: int
    bytes: int


class _Placement(TypedDict):
    nodes: int
    gpus_per_node: int
    colocated: bool


class _Estimates(TypedDict):
    intra_node_gbps: float
    inter_node_gbps: float
    plan_seconds: float  # the plan's estimated sync time
    broadcast_seconds: float  # broadcast-all's
    lower_bound_seconds: float


class PlanReport(TypedDict):
    """`Plan.cost_model(...)`: `shardsync plan --json` (docs/cli.md), the cost model's estimates
    under `estimates`, the GPU placement they assume under `placement`."""

    model: str
    trainer: str
    rollout: _Rollout
    wire_dtype: str
    trainer_dtype: str
    bucket_bytes: int
    plan_hash: str
    plan_seconds: float  # planning time
    ops: int
    messages: int
    total_bytes: int
    broadcast_recv_bytes_per_rank: int
    model_bytes: int
    trainer_send_bytes: _MinMeanMax
    trainer_ranks: List[_TrainerTraffic]
    engine_ranks: List[_EngineTraffic]
    node_pairs: List[_NodePair]
    placement: _Placement
    estimates: _Estimates
