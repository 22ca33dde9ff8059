"""vLLM worker extension: one shardsync session per vLLM worker (one per GPU).

Launch (written from reading vLLM's source around v0.10-v0.11 (`worker_extension_cls`,
`LLM.collective_rpc`); untested against a live engine here):

    llm = LLM(model=..., tensor_parallel_size=T, pipeline_parallel_size=P,
              worker_extension_cls="shardsync.hooks.vllm.ShardsyncWorkerExtension")
    llm.collective_rpc("shardsync_init", args=(config,))   # collective with the trainers
    ...
    llm.collective_rpc("shardsync_sync", args=(version,))  # every step, engine paused

vLLM mixes this class into its Worker, so `self` is the worker: `self.rank` is the worker's
rank in the engine's TP x PP world, which vLLM orders TP fastest (pp*T + tp), the same global
rank shardsync uses; `self.model_runner` holds the model.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from . import EngineRankConfig, open_engine_session

__all__ = ["ShardsyncWorkerExtension"]


class ShardsyncWorkerExtension:
    _shardsync_session: Any = None

    def _shardsync_ranks(self) -> Tuple[int, int, int, int]:
        """(tp_rank, pp_rank, tp_size, pp_size) of this worker."""
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        tp_size, pp_size = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        try:  # the engine's own answer when running inside vLLM
            from vllm.distributed.parallel_state import (  # type: ignore[import-not-found]
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group), tp_size, pp_size
        except ImportError:
            rank = int(self.rank)  # type: ignore[attr-defined]
            return rank % tp_size, (rank // tp_size) % pp_size, tp_size, pp_size

    def _shardsync_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        get = getattr(runner, "get_model", None)
        return get() if callable(get) else runner.model

    def _shardsync_replica(self, config: EngineRankConfig) -> Optional[int]:
        if config.get("replica") is not None:
            return int(config["replica"])
        if os.environ.get("SHARDSYNC_REPLICA"):
            return int(os.environ["SHARDSYNC_REPLICA"])
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        dp_rank = getattr(pc, "data_parallel_rank", None)
        return None if dp_rank is None else int(dp_rank)

    def shardsync_init(self, config: EngineRankConfig) -> Dict[str, Any]:
        """Creates this worker's session, binds model.named_parameters() and connects."""
        if self._shardsync_session is not None:
            self._shardsync_session.close()
        tp_rank, pp_rank, tp_size, pp_size = self._shardsync_ranks()
        model = self._shardsync_model()
        self._shardsync_session = open_engine_session(
            config, tp_rank, pp_rank, tp_size, pp_size, model.named_parameters(),
            replica=self._shardsync_replica(config),
        )
        s = self._shardsync_session
        return {"sync_rank": s.rank, "tp_rank": tp_rank, "pp_rank": pp_rank,
                "params": len(s.expected_params())}

    def shardsync_sync(self, version: int) -> Dict[str, Any]:
        """Receives weights `version` into the bound parameters; returns the job report."""
        from ..errors import FailedPreconditionError

        if self._shardsync_session is None:
            raise FailedPreconditionError("shardsync_sync before shardsync_init on this worker")
        return self._shardsync_session.sync(version)

    def shardsync_close(self) -> None:
        if self._shardsync_session is not None:
            self._shardsync_session.close()
            self._shardsync_session = None
