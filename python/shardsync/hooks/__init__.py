"""Engine-side hooks (code that runs inside the engines' worker processes) and their drivers.

- `sglang`: a custom weight loader (`load_weights`, SGLang main) taking each command as a plain
  torch.nn.Module carrying JSON (what SGLang's allowlisted unpickler accepts), and an external
  weight-update receiver (`receiver`, sglang-miles only).
- `vllm`: a native weight-transfer backend ("shardsync", registered with vLLM's
  WeightTransferEngineFactory) and a worker extension (`ShardsyncWorkerExtension`, older vLLM).
- `engines`: what the running engine really has (version, entry points, request shapes,
  expert naming), probed in one place; unknown means refused.
- `driver`: `SGLangDriver` / `VLLMDriver` play each engine's call sequence on the replicas'
  heads (through `EngineGroup`) and read every engine rank's report from the store; `clients`:
  the in-process SGLang adapter and the HTTP heads.
- `core`: the engine-rank half both share (never raises into the engine; validates loaders,
  pointers, layout and memory state); `checks`: the loader / finalize checks; `status`: the
  status dicts posted to the store.
- `layout_check`: plan-time refusal of engine layouts the shard map does not model.

Every rank addresses itself by its global rank pp*T + tp from the engine's own parallel state
(never the stage-local tp_rank alone) and binds the engine's own named_parameters(). Nothing here
imports an engine at import time. See docs/python.md ("Engine hooks").
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["EngineRankConfig"]

# The JSON object every hook takes (built on the driver; drivers add replica and init_id):
#   plan: Plan.spec (model, trainer, rollout, engine, wire_dtype, trainer_dtype, bucket_bytes)
#   store: "host:port"; token: str; prefix: store key prefix ("ss/")
#   job_id: the trainers' launch id (Session(job_id=...)); drivers set it from their environment
#   job_secret: that launch's secret (Session(job_secret=...)); drivers set it with job_id
#   transport: the Session's default unless named ("auto", "shm", "ucx", "cuda_ipc", "nccl",
#   "loopback" for tests); staging: "host" stages CUDA parameters through host memory
#   replica: this engine's DP replica (or env SHARDSYNC_REPLICA, or vLLM's data_parallel_rank)
#   init_id: the driver's id of this init (keys the init reports)
#   connect_timeout, sync_timeout, store_timeout (seconds); ignore_extra (engine parameters
#   outside the shard map are left alone); check_loaders (default True)
#   draft: "refuse" (default) or "leave" a speculative draft model's weights as they are
EngineRankConfig = Dict[str, Any]
