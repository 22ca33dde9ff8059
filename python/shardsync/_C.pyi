# Type stubs of the native module shardsync._C (pybind11). Use the `shardsync` package API; the
# classes below are what its functions return (Region, ModelSpec, ShardMap, RankPlan, Layout, ...).
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from shardsync.types import (
    CommitReport,
    LaunchEnv,
    PlanSummary,
    SupportsDLPack,
    SyncRankInfo,
    SyncReport,
    TensorInfo,
)

__version__: str
PARTS: Tuple[str, ...]
DEVICE_BINDING: bool

def _raise_status(code: int, message: str) -> None: ...
def status_code_name(code: int) -> str: ...
def knobs() -> List[Dict[str, str]]: ...
def read_knob(name: str) -> Optional[str]: ...
def check_knobs() -> None: ...
def parse_dtype(name: str, field: str = "dtype") -> str: ...
def dtype_size(name: str, field: str = "dtype") -> int: ...
def dtype_torch_name(name: str, field: str = "dtype") -> str: ...
def tensor_info(tensor: SupportsDLPack) -> TensorInfo: ...
def checksum(tensor: SupportsDLPack) -> int: ...

class Region:
    def __init__(self, offset: Sequence[int], extent: Sequence[int]) -> None: ...
    @staticmethod
    def full(shape: Sequence[int]) -> Region: ...
    @property
    def ndim(self) -> int: ...
    @property
    def offset(self) -> List[int]: ...
    @property
    def extent(self) -> List[int]: ...
    @property
    def numel(self) -> int: ...
    def slices(self) -> Tuple[slice, ...]: ...

# ---- layout ----
class LayoutWorker:
    rank: int
    node: int
    gpu: int
    dp: int
    pp: int
    tp: int
    head: int
    role: str
    is_head: bool

class EngineRankPlacement:
    tp: int
    pp: int
    global_rank: int
    node: int
    node_rank: int
    gpu_index: int
    gpu: int
    worker: int
    broadcast_rank: int

class ReplicaNode:
    node: int
    node_rank: int
    cuda_visible_devices: List[int]

class ReplicaLayout:
    dp: int
    head: int
    node: int
    cuda_visible_devices: List[int]
    nodes: List[ReplicaNode]
    engine_ranks: List[EngineRankPlacement]
    rank_offset: int

class Layout:
    dp: int
    tp: int
    pp: int
    engine: str
    node_gpus: List[int]
    workers: List[LayoutWorker]
    replicas: List[ReplicaLayout]
    collecting_rank: int
    broadcast_world_size: int
    broadcast_rank_collision: bool
    def head_workers(self) -> List[int]: ...
    def to_json(self, trainer_world: int = 1) -> str: ...
    def to_table(self, trainer_world: int = 1) -> str: ...

def compute_layout(dp: int, tp: int, pp: int, engine: str, node_gpus: List[int],
                   base_gpu_id: int = 0, gpu_id_step: int = 1, allow_multinode: bool = False,
                   rollout_gpus: Optional[int] = None) -> Layout: ...
def sync_engine_rank(dp: int, tp: int, pp: int, trainer_world: int, replica: int, pp_rank: int,
                     tp_rank: int) -> int: ...

# ---- model and shard map ----
class ModelSpec:
    name: str
    architecture: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int
    dtype: str
    num_elements: int
    nbytes: int
    def hf_tensors(self) -> List[Tuple[str, List[int], str]]: ...

def load_model(name_or_path: str) -> ModelSpec: ...
def parse_model_config(json_text: str, source: str = "config.json") -> ModelSpec: ...
def embedded_models() -> List[str]: ...

class Piece:
    source: str
    src: Region
    dst: Region

class EngineParam:
    name: str
    shape: List[int]
    dtype: str
    torch_dtype: str
    pieces: List[Piece]
    zero_fills: List[Region]
    nbytes: int

class EngineRankShards:
    tp_rank: int
    pp_rank: int
    moe_ep_rank: int
    moe_tp_rank: int
    layer_start: int
    layer_end: int
    params: List[EngineParam]
    nbytes: int
    def param(self, name: str) -> EngineParam: ...

class ShardMap:
    engine: str
    tp: int
    pp: int
    ep: int
    model: ModelSpec
    ranks: List[EngineRankShards]
    def rank(self, tp_rank: int, pp_rank: int = 0) -> EngineRankShards: ...
    def explain(self, tp_rank: int, pp_rank: int, name: str) -> str: ...
    def validate(self) -> None: ...

def build_shard_map(model: Union[str, ModelSpec], engine: str = "sglang", tp: int = 1, pp: int = 1,
                    ep: int = 1, pp_partition: List[int] = ...,
                    expert_naming: str = "fused_moe", wire_dtype: str = "") -> ShardMap: ...

# ---- plan ----
class TransferOp:
    tensor: int
    param: int
    src: Region
    dst: Region
    wire_offset: int
    bytes: int

class LocalSource:
    param: int  # index into the sender's trainer_params(rank)
    region: Region  # region of that local parameter (same extents as the op's src)

class TrainerPiece:
    source: str
    src: Region
    local: Region

class TrainerParam:
    name: str
    chunk: int
    shape: List[int]
    dtype: str
    pieces: List[TrainerPiece]
    numel: int

class Bucket:
    op_begin: int
    op_end: int
    wire_offset: int
    bytes: int

class Message:
    src: int
    dst: int
    bytes: int
    ops: List[TransferOp]
    buckets: List[Bucket]
    # Megatron trainers: local[i] is where the sender holds ops[i]; empty for FSDP-like layouts.
    local: List[LocalSource]

class RankPlan:
    rank: int
    plan_hash: str
    sends: List[Message]
    recvs: List[Message]
    send_bytes: int
    recv_bytes: int

class PlanInputs:
    def __init__(self, model: Union[str, ModelSpec], trainer: str, rollout: str,
                 engine: str = "sglang", wire_dtype: str = "bf16", trainer_dtype: str = "fp32",
                 bucket_bytes: int = ..., pp_partition: List[int] = ...,
                 expert_naming: str = "fused_moe", quant: str = "",
                 fp8_split: str = "amax", encoding: str = "full") -> None: ...
    model: ModelSpec
    fp8_split: str
    encoding: str
    quant: Optional[str]
    trainer: str
    trainer_world: int
    dp: int
    tp: int
    pp: int
    ep: int
    expert_naming: str
    engine: str
    wire_dtype: str
    trainer_dtype: str
    bucket_bytes: int
    pp_partition: List[int]
    world_size: int
    hash: str
    def describe_rank(self, sync_rank: int) -> SyncRankInfo: ...
    def rank_plan(self, sync_rank: int) -> RankPlan: ...
    def summary(self) -> PlanSummary: ...
    def staging_bytes(self, sync_rank: int) -> int: ...
    def validate(self) -> None: ...
    def held_region(self, trainer_rank: int, shape: List[int]) -> Region: ...
    def trainer_params(self, trainer_rank: int) -> List[TrainerParam]: ...
    def trainer_coords(self, trainer_rank: int) -> Optional[Dict[str, int]]: ...
    def megatron_layout(self) -> Optional[Dict[str, Any]]: ...
    def report_json(self, nodes: int = 0, gpus_per_node: int = 8, intra_node_gbps: float = 450.0,
                    inter_node_gbps: float = 50.0) -> str: ...
    def heatmap_svg(self, nodes: int = 0, gpus_per_node: int = 8) -> str: ...

def parse_trainer_spec(spec: str) -> str: ...

# ---- store ----
class StoreServer:
    @staticmethod
    def start(host: str = "127.0.0.1", port: int = 0, token: str = "") -> StoreServer: ...
    port: int
    address: str
    def stop(self) -> None: ...

class StoreClient:
    @staticmethod
    def connect(address: str, token: str = "", timeout: float = 30.0) -> StoreClient: ...
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, timeout: float = 30.0) -> bytes: ...
    def add(self, key: str, delta: int = 1) -> int: ...
    def wait(self, keys: List[str], timeout: float = 30.0) -> None: ...
    def barrier(self, name: str, world: int, timeout: float = 30.0) -> None: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def set_ephemeral(self, key: str, value: bytes) -> None: ...
    def set_if_absent(self, key: str, value: bytes, ephemeral: bool = False) -> bytes: ...
    def mark_dead(self, key: str, reason: str) -> None: ...

def launch_env() -> LaunchEnv: ...
def launch_job_id() -> str: ...
def launch_job_secret() -> str: ...
def generate_job_secret() -> str: ...
def generate_store_token() -> str: ...
MIN_STORE_TOKEN_CHARS: int

# ---- session ----
class LoopbackHub:
    def __init__(self) -> None: ...

def transports() -> List[str]: ...
MAX_SYNC_VERSION: int

class SyncSession:
    def __init__(self, plan: PlanInputs, rank: int, store: str, token: str = "",
                 transport: str = "ucx", hub: Optional[LoopbackHub] = None, prefix: str = "ss/",
                 connect_timeout: float = 60.0, sync_timeout: float = 60.0,
                 transport_params: Dict[str, str] = ..., device: int = -1,
                 job_id: Optional[str] = None, job_secret: Optional[str] = None,
                 commit: str = "inplace", staging_memory: str = "auto",
                 commit_scope: str = "job", keep_previous: str = "auto") -> None: ...
    rank: int
    device: int
    job_id: str
    is_trainer: bool
    plan: RankPlan
    is_poisoned: bool
    last_good_version: int
    def expected_params(self) -> List[EngineParam]: ...
    def expected_sources(self) -> List[TrainerParam]: ...
    def bind_source(self, hf_name: str, tensor: SupportsDLPack,
                    region: Optional[Union[Region, Tuple[Sequence[int], Sequence[int]]]] = None,
                    chunk: Optional[int] = None) -> None: ...
    def bind_destination(self, name: str, tensor: SupportsDLPack) -> None: ...
    def fail_before_connect(self, why: str) -> None: ...
    def fail_sync(self, version: int, why: str) -> None: ...
    def connect(self) -> None: ...
    def sync(self, version: int) -> SyncReport: ...
    def commit(self, version: int) -> CommitReport: ...
    def rollback(self) -> None: ...
    staging_bytes: int
    committed_version: int
    keep_previous: str
    def close(self) -> None: ...
