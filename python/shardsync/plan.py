"""Plan, ShardMap and model helpers over the C++ planner."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from ._native import native

__all__ = ["Plan", "shard_map", "load_model"]


def load_model(name_or_path: str) -> Any:
    """An embedded model name (qwen2.5-0.5b, qwen3-8b, ...), a config.json, or its directory."""
    return native("model").load_model(name_or_path)


def shard_map(
    model: Any,
    engine: str = "sglang",
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    pp_partition: Sequence[int] = (),
    expert_naming: str = "fused_moe",
) -> Any:
    """Which bytes of which HF tensor every engine rank owns (shard_map.h). `expert_naming`:
    "fused_moe" ("...mlp.experts.w13_weight": SGLang, vLLM < 0.24) or "routed_experts"
    ("...mlp.experts.routed_experts.w13_weight": vLLM >= 0.24)."""
    return native("model").build_shard_map(model, engine, tp, pp, ep, list(pp_partition),
                                           expert_naming)


class Plan:
    """The transfer plan of one job: model x trainer layout x rollout layout.

    Every rank builds it locally from the same arguments; ranks compare `hash` at connect.
    `trainer` is "fsdp=S", "hsdp=RxS", "replicate=N", "single" or a Megatron-Core layout
    "megatron=tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,cp=C][,dp=D][,first=N][,last=M][,vocab_div=K]
    [,experts=grouped|sequential][,norms=te|local]" (docs/megatron.md); `rollout` is
    "dp=D,tp=T,pp=P[,ep=E]". The sync world is trainer ranks [0, S) then engine rank
    (replica d, tp, pp) at S + d*T*P + pp*T + tp (`engine_rank`). `expert_naming` is the engine
    version's name for stacked experts ("fused_moe", or "routed_experts" for vLLM >= 0.24:
    `shardsync.hooks.engines` probes it); it is part of the hash.
    """

    def __init__(
        self,
        model: Any,
        trainer: str,
        rollout: str,
        *,
        engine: str = "sglang",
        wire_dtype: str = "bf16",
        trainer_dtype: str = "f32",
        bucket_bytes: int = 512 << 20,
        expert_naming: str = "fused_moe",
    ) -> None:
        C = native("plan")
        self.inputs = C.PlanInputs(
            model,
            trainer,
            rollout,
            engine=engine,
            wire_dtype=wire_dtype,
            trainer_dtype=trainer_dtype,
            bucket_bytes=bucket_bytes,
            expert_naming=expert_naming,
        )
        self._spec: Dict[str, Any] = dict(
            model=model if isinstance(model, str) else self.inputs.model.name,
            trainer=trainer,
            rollout=rollout,
            engine=engine,
            wire_dtype=wire_dtype,
            trainer_dtype=trainer_dtype,
            bucket_bytes=bucket_bytes,
        )
        if expert_naming != "fused_moe":  # absent means the default: older specs stay valid
            self._spec["expert_naming"] = expert_naming

    @classmethod
    def from_spec(cls, spec: Dict[str, Any]) -> "Plan":
        """Rebuilds a plan from `spec` (what engine hooks receive through their config)."""
        s = dict(spec)
        return cls(s.pop("model"), s.pop("trainer"), s.pop("rollout"), **s)

    @property
    def spec(self) -> Dict[str, Any]:
        """JSON-serialisable arguments that rebuild this plan on another process."""
        return dict(self._spec)

    @property
    def hash(self) -> str:
        return self.inputs.hash

    @property
    def model(self) -> Any:
        return self.inputs.model

    @property
    def world_size(self) -> int:
        return self.inputs.world_size

    @property
    def trainer_world(self) -> int:
        return self.inputs.trainer_world

    @property
    def dp(self) -> int:
        return self.inputs.dp

    @property
    def tp(self) -> int:
        return self.inputs.tp

    @property
    def pp(self) -> int:
        return self.inputs.pp

    @property
    def engine(self) -> str:
        return self.inputs.engine

    @property
    def expert_naming(self) -> str:
        return self.inputs.expert_naming

    @property
    def wire_dtype(self) -> str:
        return self.inputs.wire_dtype

    @property
    def trainer_dtype(self) -> str:
        return self.inputs.trainer_dtype

    @property
    def trainer_spec(self) -> str:
        return self.inputs.trainer

    def engine_rank(self, replica: int, tp_rank: int, pp_rank: int = 0) -> int:
        """Sync rank of engine rank (replica, tp, pp): S + replica*T*P + pp*T + tp."""
        from .errors import OutOfRangeError

        if not (0 <= replica < self.dp and 0 <= tp_rank < self.tp and 0 <= pp_rank < self.pp):
            raise OutOfRangeError(
                f"engine rank (replica {replica}, tp {tp_rank}, pp {pp_rank}) outside "
                f"dp={self.dp}, tp={self.tp}, pp={self.pp}"
            )
        return self.trainer_world + replica * self.tp * self.pp + pp_rank * self.tp + tp_rank

    def describe_rank(self, sync_rank: int) -> Dict[str, Any]:
        return self.inputs.describe_rank(sync_rank)

    def rank_plan(self, sync_rank: int) -> Any:
        """What `sync_rank` sends and receives (messages, ops, buckets)."""
        return self.inputs.rank_plan(sync_rank)

    def summary(self) -> Dict[str, Any]:
        """Job-wide statistics: ops, messages, bytes per engine / trainer rank, plan hash."""
        return self.inputs.summary()

    def validate(self) -> None:
        """Exact-cover validation of the whole job (small jobs; enumerates every rank's plan)."""
        self.inputs.validate()

    def held_region(self, trainer_rank: int, shape: Sequence[int]) -> Any:
        """FSDP-like layouts: the region of a tensor of `shape` that `trainer_rank` holds."""
        return self.inputs.held_region(trainer_rank, list(shape))

    def trainer_params(self, trainer_rank: int) -> List[Any]:
        """The local parameters of trainer `trainer_rank` and the HF regions each holds.

        Megatron: Megatron-Core's local names per model chunk (`p.chunk`, `p.name` as the chunk's
        named_parameters() gives it without wrapper prefixes), local shapes, and pieces
        (`source` HF tensor, `src` region there, `local` region in the parameter). FSDP-like
        layouts: one parameter per HF tensor holding the rank's dim-0 chunk.
        """
        return self.inputs.trainer_params(trainer_rank)

    def trainer_coords(self, trainer_rank: int) -> Any:
        """Megatron coordinates of `trainer_rank` (tp, cp, dp, pp, etp, ep, edp), else None."""
        return self.inputs.trainer_coords(trainer_rank)

    def hf_tensors(self) -> List[Tuple[str, List[int], str]]:
        return self.inputs.model.hf_tensors()

    def shard_map(self) -> Any:
        ep = self.inputs.ep
        return shard_map(self.inputs.model, self.engine, self.tp, self.pp, ep,
                         expert_naming=self.expert_naming)

    def __repr__(self) -> str:
        return (
            f"Plan(model={self._spec['model']!r}, trainer={self.trainer_spec!r}, "
            f"rollout='dp={self.dp},tp={self.tp},pp={self.pp}', engine={self.engine!r}, "
            f"hash={self.hash})"
        )
