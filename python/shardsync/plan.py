"""Plan, ShardMap and model helpers over the C++ planner (plan.h, shard_map.h, model.h)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from ._native import native
from .errors import InvalidArgumentError, OutOfRangeError

if TYPE_CHECKING:
    from ._C import ModelSpec, PlanInputs, RankPlan, Region, ShardMap, TrainerParam
    from .types import DTypeArg, ModelArg, PlanReport, PlanSummary, SyncRankInfo

__all__ = ["Plan", "shard_map", "load_model", "dtype_name"]


def _model_arg(model: "ModelArg") -> Any:
    """What the native side takes: a ModelSpec, or a name / path as str."""
    if isinstance(model, os.PathLike):
        return os.fspath(model)
    return model


def dtype_name(dtype: "DTypeArg", field: str = "dtype") -> str:
    """Canonical name ("bfloat16", "float32", ...) of any dtype spelling shardsync takes: the CLI's
    ("bf16", "fp32", "f32", "fp16", "half", "F32", ...), torch's ("bfloat16", torch.bfloat16) or
    numpy's (numpy.float32, numpy.dtype("float32")). InvalidArgumentError names `field`."""
    if isinstance(dtype, str):
        text = dtype
    else:
        text = str(dtype)  # torch.bfloat16 -> "torch.bfloat16"
        if not text.startswith("torch."):
            name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None)
            if not isinstance(name, str):
                raise InvalidArgumentError(
                    f"{field}: expected a dtype name (bf16, fp32, ...) or a torch / numpy dtype, "
                    f"got {dtype!r}")
            text = name  # numpy.dtype("float32").name, numpy.float32.__name__
    return native().dtype_torch_name(text, field)


def load_model(name_or_path: "ModelArg") -> "ModelSpec":
    """An embedded model (`shardsync._C.embedded_models()`: qwen2.5-0.5b, qwen3-8b, ...), a
    Hugging Face config.json, or a directory holding one."""
    return native("model").load_model(_model_arg(name_or_path))


def shard_map(
    model: "ModelArg",
    engine: str = "sglang",
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    pp_partition: Sequence[int] = (),
    expert_naming: str = "fused_moe",
) -> "ShardMap":
    """Which bytes of which HF tensor every engine rank owns under `engine`'s TP x PP (x EP) rules
    (shard_map.h). Raises InvalidArgumentError naming the argument when the engine would refuse the
    layout ("tp=3: num_attention_heads 32 is not divisible by tp"). `expert_naming`: "fused_moe"
    ("...mlp.experts.w13_weight": SGLang, vLLM < 0.24) or "routed_experts"
    ("...mlp.experts.routed_experts.w13_weight": vLLM >= 0.24)."""
    return native("model").build_shard_map(_model_arg(model), engine, tp, pp, ep,
                                           list(pp_partition), expert_naming)


class Plan:
    """The transfer plan of one job: model x trainer layout x rollout layout.

    Every rank builds it locally from the same arguments (cheap: nothing is enumerated until a
    rank asks for its own part) and the ranks compare `hash` at connect. Construction checks every
    divisibility the engine asserts, so a layout the engine would refuse fails here, naming the
    argument and field (`rollout tp=3: num_attention_heads 32 is not divisible by tp`).

    Args:
        model: an embedded model name ("qwen3-8b"), a config.json path or its directory, or a
            ModelSpec from `load_model`.
        trainer: how the trainer holds the weights: "fsdp=S" (FSDP2 Shard(0) over S ranks),
            "hsdp=RxS" (R replicas of S shards), "replicate=N" (N full copies), "single", or a
            Megatron-Core layout "megatron=tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,cp=C][,dp=D]
            [,first=N][,last=M][,vocab_div=K][,experts=grouped|sequential][,norms=te|local]
            [,glu_interleave=G]" (docs/megatron.md).
        rollout: the engines: "dp=D,tp=T,pp=P[,ep=E]" (D replicas of T x P ranks, E expert
            parallel size for MoE models).
        engine: "sglang" or "vllm": whose parameter names, fusions and layer split to follow.
        wire_dtype: the dtype on the wire and in the engines' parameters (default bf16).
        trainer_dtype: the dtype of the trainer's shards (default fp32; cast while packing).
        bucket_bytes: bytes per checksummed bucket (the unit of verification and completion).
        pp_partition: explicit decoder layers per PP stage (the engines'
            *_PP_LAYER_PARTITION); default: the engine's own split.
        expert_naming: the engine version's name for stacked experts ("fused_moe", or
            "routed_experts" for vLLM >= 0.24: `shardsync.hooks.engines` probes it); part of the
            hash.
        quant: the engines' weights: "fp8-block128" (block FP8: float8_e4m3fn weights with an fp32
            weight_scale_inv per 128 x 128 block, quantized at sync time; docs/fp8.md), "none"
            (the model dtype, dropping a config's quantization_config), or None (as the config
            says). "fp8", SGLang's and vLLM's spelling, means what it means to them: block FP8
            when the config's quantization_config has weight_block_size [128, 128] (then the
            same as None), per-tensor FP8 otherwise, which is refused (InvalidArgumentError). A block-FP8 layout the engines refuse (a shard off the 128 grid) fails here
            naming the tensor.
        fp8_split: block FP8 only, for 128 x 128 blocks whose rows straddle FSDP trainer ranks:
            "amax" (the default: the holders exchange per-block amax through the store each sync
            and each quantizes its own rows; e4m3 on the wire, no staging; host memory, or device
            memory over cuda_ipc pairs) or
            "stage" (raw values to the engine rank, which quantizes them from a staging buffer,
            in host or device memory). docs/fp8.md.
        encoding: how buckets travel each sync (the host path, cuda_ipc and nccl pairs, bf16
            and block FP8, in place or staged): "full" (the default: whole), "delta"
            (only the wire elements that changed since the engine's verified base; a bucket
            whose base is not the one the trainer kept, e.g. after a restart, a rollback or a
            corrupted byte, goes whole in the same sync; docs/delta.md) or "auto" (delta where
            it pays over each pair's link, docs/delta.md "Memory and cost"; full where none
            can). Every rank must agree: part of the hash when not "full". The session's
            report has the figures under "delta".
        commit: the default of the sessions built on this plan: "inplace" (bytes land in the
            engine's live parameters; the engine must be idle for the whole transfer) or
            "staged" (they land in a staging area while the engine serves, and
            `Session.commit(version)` copies a verified version in during a short pause;
            docs/staged-commit.md). Not part of the hash.

    Sync ranks: trainer ranks [0, S), then engine rank (replica d, tp, pp) at S + d*T*P + pp*T +
    tp (`engine_rank`). Dtypes take any spelling: "bf16" / "bfloat16" / torch.bfloat16, "fp32" /
    "f32" / "float32" / numpy.float32, "fp16" / "half".
    """

    def __init__(
        self,
        model: "ModelArg",
        trainer: str,
        rollout: str,
        *,
        engine: str = "sglang",
        wire_dtype: "DTypeArg" = "bf16",
        trainer_dtype: "DTypeArg" = "fp32",
        bucket_bytes: int = 512 << 20,
        pp_partition: Optional[Sequence[int]] = None,
        expert_naming: str = "fused_moe",
        quant: Optional[str] = None,
        fp8_split: str = "amax",
        encoding: str = "full",
        commit: str = "inplace",
    ) -> None:
        if commit not in ("inplace", "staged"):
            from .errors import InvalidArgumentError

            raise InvalidArgumentError(f"commit: expected 'inplace' or 'staged', got {commit!r}")
        self.commit = commit
        C = native("plan")
        wire = dtype_name(wire_dtype, "wire_dtype")
        held = dtype_name(trainer_dtype, "trainer_dtype")
        partition = [int(n) for n in (pp_partition or ())]
        self.inputs: "PlanInputs" = C.PlanInputs(
            _model_arg(model),
            trainer,
            rollout,
            engine=engine,
            wire_dtype=wire,
            trainer_dtype=held,
            bucket_bytes=bucket_bytes,
            pp_partition=partition,
            expert_naming=expert_naming,
            quant=quant or "",
            fp8_split=fp8_split,
            encoding=encoding,
        )
        model_spec = model if isinstance(model, str) else None
        if isinstance(model, os.PathLike):
            model_spec = os.fspath(model)
        self._spec: Dict[str, Any] = dict(
            model=model_spec if model_spec is not None else self.inputs.model.name,
            trainer=trainer,
            rollout=rollout,
            engine=engine,
            wire_dtype=wire,
            trainer_dtype=held,
            bucket_bytes=bucket_bytes,
        )
        if partition:
            self._spec["pp_partition"] = partition
        if expert_naming != "fused_moe":  # absent means the default: older specs stay valid
            self._spec["expert_naming"] = expert_naming
        if quant:
            self._spec["quant"] = quant
        if fp8_split != "amax":  # absent means the default: older specs stay valid
            self._spec["fp8_split"] = fp8_split
        if encoding != "full":  # absent means the default: older specs stay valid
            self._spec["encoding"] = encoding
        if commit != "inplace":  # absent means the default: older specs stay valid
            self._spec["commit"] = commit

    @classmethod
    def from_spec(cls, spec: Dict[str, Any]) -> "Plan":
        """Rebuilds a plan from `spec` (what engine hooks and remote workers receive)."""
        s = dict(spec)
        return cls(s.pop("model"), s.pop("trainer"), s.pop("rollout"), **s)

    @property
    def spec(self) -> Dict[str, Any]:
        """JSON-serialisable arguments that rebuild this plan in another process
        (`Plan.from_spec`). A model given as a ModelSpec is recorded by name, so only embedded
        models round-trip that way; pass a path to ship a custom config."""
        return dict(self._spec)

    @property
    def encoding(self) -> str:
        """How buckets travel each sync: "full", "delta" or "auto"."""
        return self.inputs.encoding

    @property
    def hash(self) -> str:
        """32 hex digits over everything that defines the plan; equal on every rank of a job."""
        return self.inputs.hash

    @property
    def model(self) -> "ModelSpec":
        """The model's dimensions (hidden size, heads, layers, experts, ...)."""
        return self.inputs.model

    @property
    def world_size(self) -> int:
        """Sync ranks in the job: trainer ranks plus every engine rank of every replica."""
        return self.inputs.world_size

    @property
    def trainer_world(self) -> int:
        """Trainer ranks (S): sync ranks [0, S)."""
        return self.inputs.trainer_world

    @property
    def dp(self) -> int:
        """Engine replicas."""
        return self.inputs.dp

    @property
    def tp(self) -> int:
        """Tensor parallel size of each replica."""
        return self.inputs.tp

    @property
    def pp(self) -> int:
        """Pipeline parallel size of each replica."""
        return self.inputs.pp

    @property
    def ep(self) -> int:
        """Expert parallel size (1 for dense models)."""
        return self.inputs.ep

    @property
    def pp_partition(self) -> List[int]:
        """Decoder layers per PP stage when given explicitly ([] for the engine's split)."""
        return list(self.inputs.pp_partition)

    @property
    def engine(self) -> str:
        """"sglang" or "vllm"."""
        return self.inputs.engine

    @property
    def expert_naming(self) -> str:
        """The engine's name for stacked experts: "fused_moe" or "routed_experts" (vLLM >= 0.24)."""
        return self.inputs.expert_naming

    @property
    def fp8_split(self) -> str:
        """How block-FP8 blocks split across trainer ranks are quantized: "amax" or "stage"."""
        return self.inputs.fp8_split

    @property
    def quant(self) -> Optional[str]:
        """The engines' weight format: "fp8 e4m3 128x128" (block FP8) or None (the model
        dtype)."""
        return self.inputs.quant

    @property
    def wire_dtype(self) -> str:
        """Wire and engine-parameter dtype, safetensors spelling ("BF16")."""
        return self.inputs.wire_dtype

    @property
    def trainer_dtype(self) -> str:
        """Dtype of the trainer's shards, safetensors spelling ("F32")."""
        return self.inputs.trainer_dtype

    @property
    def bucket_bytes(self) -> int:
        """Bytes per checksummed bucket."""
        return self.inputs.bucket_bytes

    @property
    def trainer_spec(self) -> str:
        """Canonical trainer layout ("fsdp=8", "hsdp=2x4", "replicate=4", "single")."""
        return self.inputs.trainer

    def engine_rank(self, replica: int, tp_rank: int, pp_rank: int = 0) -> int:
        """Sync rank of engine rank (replica, tp, pp): S + replica*T*P + pp*T + tp."""
        if not (0 <= replica < self.dp and 0 <= tp_rank < self.tp and 0 <= pp_rank < self.pp):
            raise OutOfRangeError(
                f"engine rank (replica {replica}, tp {tp_rank}, pp {pp_rank}) outside "
                f"dp={self.dp}, tp={self.tp}, pp={self.pp}"
            )
        return self.trainer_world + replica * self.tp * self.pp + pp_rank * self.tp + tp_rank

    def staging_bytes(self, sync_rank: int) -> int:
        """Bytes of staging engine sync rank `sync_rank` needs under commit="staged": its
        parameters in the dtypes it binds them (each on a 256-byte boundary); 0 for trainer
        ranks. A session refuses at connect, naming the rank and the numbers, when they do not
        fit the memory they would live in (device: free device memory)."""
        return int(self.inputs.staging_bytes(sync_rank))

    def describe_rank(self, sync_rank: int) -> "SyncRankInfo":
        """Who `sync_rank` is: a trainer rank, or engine rank (replica, tp_rank, pp_rank)."""
        return self.inputs.describe_rank(sync_rank)

    def rank_plan(self, sync_rank: int) -> "RankPlan":
        """What `sync_rank` sends and receives: messages, their ops and checksummed buckets.
        Block FP8: each op's `encoding` says how it travels (copy, quantize, stage or amax)."""
        return self.inputs.rank_plan(sync_rank)

    def summary(self) -> "PlanSummary":
        """Job-wide statistics: ops, messages, bytes per engine / trainer rank, plan hash. Block
        FP8: also "quant" (elements quantized by the trainer / engine ranks, wire bytes by kind,
        the memory-bound work), and no broadcast-all figure."""
        return self.inputs.summary()

    def cost_model(
        self,
        *,
        nodes: int = 0,
        gpus_per_node: int = 8,
        intra_node_gbps: float = 450.0,
        inter_node_gbps: float = 50.0,
    ) -> "PlanReport":
        """The report of `shardsync plan --json` with the same flags: per-rank traffic, node
        placement and the estimated sync time against broadcast-all and the lower bound
        (`["estimates"]`). Trainer rank i runs on GPU i; engines are colocated (engine rank j on
        GPU j) when both worlds have the same size, else placed after the trainer. `nodes` 0:
        as many as needed. Bandwidths are GB/s per GPU per direction (defaults: H200 NVLink,
        400 Gb/s NIC)."""
        text = self.inputs.report_json(nodes=nodes, gpus_per_node=gpus_per_node,
                                       intra_node_gbps=float(intra_node_gbps),
                                       inter_node_gbps=float(inter_node_gbps))
        return json.loads(text)

    def svg(self, path: "Optional[str | os.PathLike[str]]" = None) -> str:
        """The trainer x engine byte heatmap of `shardsync plan --svg`, as SVG text; also written
        to `path` when given."""
        text = self.inputs.heatmap_svg()
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def validate(self) -> None:
        """Exact-cover validation of the whole job, element by element (small jobs only: it
        enumerates every rank's plan; raises naming the first defect)."""
        self.inputs.validate()

    def held_region(self, trainer_rank: int, shape: Sequence[int]) -> "Region":
        """The part of a tensor of `shape` that trainer `trainer_rank` holds (FSDP2 Shard(0):
        torch.chunk rows; empty when it holds none). `region.slices()` cuts it from the full
        tensor: `full[region.slices()]` is what that rank binds with `Session.bind_source`."""
        return self.inputs.held_region(trainer_rank, [int(d) for d in shape])

    def trainer_params(self, trainer_rank: int) -> "List[TrainerParam]":
        """The local parameters of trainer `trainer_rank` and the HF regions each holds.

        Megatron: Megatron-Core's local names per model chunk (`p.chunk`, `p.name` as the chunk's
        named_parameters() gives it without wrapper prefixes), local shapes, and pieces
        (`source` HF tensor, `src` region there, `local` region in the parameter). FSDP-like
        layouts: one parameter per HF tensor holding the rank's dim-0 chunk.
        """
        return self.inputs.trainer_params(trainer_rank)

    def trainer_coords(self, trainer_rank: int) -> Optional[Dict[str, int]]:
        """Megatron coordinates of `trainer_rank` (tp, cp, dp, pp, etp, ep, edp), else None."""
        return self.inputs.trainer_coords(trainer_rank)

    def megatron_layout(self) -> Optional[Dict[str, Any]]:
        """Every field of a Megatron trainer layout (tp, pp, vpp, ep, etp, cp, dp, edp, first,
        last, vocab_div, experts "grouped"/"sequential", norms "te"/"local", glu_interleave),
        defaults filled in; None for other layouts."""
        return self.inputs.megatron_layout()

    def hf_tensors(self) -> List[Tuple[str, List[int], str]]:
        """[(name, shape, dtype)] of the model's Hugging Face checkpoint, in the planner's order."""
        return self.inputs.model.hf_tensors()

    def shard_map(self) -> "ShardMap":
        """The engine-side shard map of one replica under this plan's layout, each parameter's
        dtype the one an engine rank binds: the plan's wire dtype (block-FP8 weights "F8_E4M3"
        and their "F32" weight_scale_inv as they are), as `Session.expected_params()` says."""
        return native("model").build_shard_map(
            _model_arg(self.inputs.model), self.engine, self.tp, self.pp, self.ep,
            list(self.pp_partition), self.expert_naming, self.wire_dtype)

    def __repr__(self) -> str:
        ep = f",ep={self.ep}" if self.ep > 1 else ""
        return (
            f"Plan(model={self._spec['model']!r}, trainer={self.trainer_spec!r}, "
            f"rollout='dp={self.dp},tp={self.tp},pp={self.pp}{ep}', engine={self.engine!r}, "
            f"hash={self.hash})"
        )
