"""Engine-side hooks: code that runs inside the engines' worker processes.

- vllm.ShardsyncWorkerExtension: a vLLM `worker_extension_cls`, driven by `collective_rpc`.
- sglang.load_weights: an SGLang `custom_weight_loader`, reached through
  `update_weights_from_tensor(..., load_format="shardsync.hooks.sglang.load_weights")`.

Both address the engine rank by its global rank pp*T + tp (never the stage-local tp_rank alone)
and bind the engine's own named_parameters() (engine names, local shapes) checked against the
shard map. Neither imports the engine at import time. See docs/python.md.
"""

from __future__ import annotations

from typing import Any, Dict

from ..adapters import bind_engine
from ..errors import InvalidArgumentError
from ..plan import Plan
from ..session import Session

__all__ = ["EngineRankConfig", "open_engine_session"]

# Keys of the config dict every hook takes (JSON-serialisable, built on the driver):
#   plan: Plan.spec (model, trainer, rollout, engine, wire_dtype, trainer_dtype, bucket_bytes)
#   store: "host:port"; token: str; transport: "ucx" (default) | registered name
#   replica: this engine's DP replica index (or env SHARDSYNC_REPLICA)
#   prefix, connect_timeout, sync_timeout, ignore_extra (engine params outside the shard map)
EngineRankConfig = Dict[str, Any]


def open_engine_session(
    config: EngineRankConfig, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int,
    named_parameters: Any, replica: "int | None" = None,
) -> Session:
    """Creates, binds and connects the session of engine rank (replica, tp_rank, pp_rank).

    Connect is collective over the whole sync world: trainers and every other engine rank must
    be connecting at the same time."""
    plan = Plan.from_spec(config["plan"])
    if (plan.tp, plan.pp) != (tp_size, pp_size):
        raise InvalidArgumentError(
            f"engine is tp={tp_size}, pp={pp_size} but the plan's rollout is tp={plan.tp}, "
            f"pp={plan.pp}"
        )
    if replica is None:
        replica = config.get("replica")
    if replica is None:
        raise InvalidArgumentError(
            "replica: not in the config and not given by the engine (set config['replica'] or "
            "SHARDSYNC_REPLICA)"
        )
    rank = plan.engine_rank(int(replica), tp_rank, pp_rank)
    session = Session(
        plan,
        rank,
        config["store"],
        token=config.get("token", ""),
        transport=config.get("transport", "ucx"),
        prefix=config.get("prefix", "ss/"),
        connect_timeout=float(config.get("connect_timeout", 60.0)),
        sync_timeout=float(config.get("sync_timeout", 60.0)),
    )
    bind_engine(session, named_parameters, ignore_extra=bool(config.get("ignore_extra", False)))
    session.connect()
    return session
