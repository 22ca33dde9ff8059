"""Plan-time refusal of engine layouts the shard map does not model, read from the live engine.

`sglang_facts(server_args)` / `vllm_facts(vllm_config)` normalise an engine's config (duck-typed:
attributes read with getattr, so a config object of any version, or a plain namespace, works);
`check_layout(engine, plan, facts)` refuses, naming the field, every layout whose bytes-per-rank
differ from the shard map's. The hooks call it inside each engine rank before binding; drivers
can call it on the head before init (`check_engine_config`).

Fields and why (engine-layouts.md 3.7-3.8 and the engines' sources):
- SGLang (`server_args.py`): tp_size / pp_size / ep_size must equal the plan's; dp_size > 1 puts
  several replicas in one engine (one engine per replica here); enable_dp_attention shards
  attention over attn_tp = tp/dp and replicates the embedding; enable_dp_lm_head, attn_cp_size,
  moe_dense_tp_size, moe_dp_size change the TP groups of some layers; ep_num_redundant_experts /
  enable_eplb place logical experts in several physical slots; quantization other than the
  plan's (block FP8 plans: "fp8"; others: none) holds other bytes;
  moe_runner_backend other than auto/triton (FlashInfer TRT-LLM swaps w1/w3, triton_kernels
  transposes) and moe_a2a_backend (DeepEP MoE classes) change the expert layout;
  weight_cache_mode != off shares weights with a daemon (model_runner_components/weight_updater.py
  refuses in-place mutation then); SGLANG_PP_LAYER_PARTITION moves layer boundaries.
- vLLM (`config/parallel.py`, `config/model.py`): enable_expert_parallel with
  data_parallel_size > 1 spans EP over DP replicas (EP group = DP x PCP x TP); enable_eplb /
  num_redundant_experts; prefill/decode context parallel (PCP / DCP); quantization;
  VLLM_PP_LAYER_PARTITION.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

from ..errors import InvalidArgumentError, UnimplementedError

__all__ = ["sglang_facts", "vllm_facts", "check_layout"]


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for p in path:
        if obj is None:
            return default
        obj = obj.get(p) if isinstance(obj, Mapping) else getattr(obj, p, None)
    return default if obj is None else obj


def sglang_facts(server_args: Any, env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    env = os.environ if env is None else env
    g = lambda name, d=None: _get(server_args, name, default=d)  # noqa: E731
    return {
        "source": "sglang server_args",
        # None where the source lacks the field (older SGLang's global_server_args_dict holds
        # only GLOBAL_SERVER_ARGS_KEYS): unknown, not 1; the per-parameter checks still run.
        "tp": g("tp_size"), "pp": g("pp_size"), "dp": g("dp_size", 1),
        "ep": g("ep_size"),
        "dp_attention": bool(g("enable_dp_attention", False)),
        "dp_lm_head": bool(g("enable_dp_lm_head", False)),
        "attn_cp": g("attn_cp_size", 1),
        "moe_dp": g("moe_dp_size", 1),
        "moe_dense_tp": g("moe_dense_tp_size"),
        "redundant_experts": g("ep_num_redundant_experts", 0),
        "eplb": bool(g("enable_eplb", False)),
        "quantization": g("quantization"),
        "moe_backend": g("moe_runner_backend", "auto"),
        "a2a_backend": g("moe_a2a_backend", "none"),
        "weight_cache_mode": g("weight_cache_mode", "off"),
        "pp_partition_env": env.get("SGLANG_PP_LAYER_PARTITION"),
        "memory_saver": bool(g("enable_memory_saver", False)),
        "weight_update_receivers": list(g("weight_update_receivers", []) or []),
        "custom_weight_loader": list(g("custom_weight_loader", []) or []),
    }


def vllm_facts(vllm_config: Any, env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    env = os.environ if env is None else env
    pc = _get(vllm_config, "parallel_config")
    mc = _get(vllm_config, "model_config")
    tp = _get(pc, "tensor_parallel_size", default=1)
    dp = _get(pc, "data_parallel_size", default=1)
    ep_on = bool(_get(pc, "enable_expert_parallel", default=False))
    redundant = _get(pc, "eplb_config", "num_redundant_experts", default=None)
    if redundant is None:
        redundant = _get(pc, "num_redundant_experts", default=0)
    return {
        "source": "vllm vllm_config",
        "tp": tp, "pp": _get(pc, "pipeline_parallel_size", default=1), "dp": dp,
        "dp_rank": _get(pc, "data_parallel_rank"),
        "ep_enabled": ep_on,
        # EP is all-or-nothing in vLLM: ep = dp * tp (pcp = 1), MoE TP 1 (engine-layouts.md 3.7).
        "ep": tp * dp if ep_on else 1,
        "eplb": bool(_get(pc, "enable_eplb", default=False)),
        "redundant_experts": redundant,
        "pcp": _get(pc, "prefill_context_parallel_size", default=1),
        "dcp": _get(pc, "decode_context_parallel_size", default=1),
        "quantization": _get(mc, "quantization"),
        "sleep_mode": bool(_get(mc, "enable_sleep_mode", default=False)),
        "pp_partition_env": env.get("VLLM_PP_LAYER_PARTITION"),
        "weight_transfer_backend": _get(vllm_config, "weight_transfer_config", "backend"),
    }


def _refuse(engine: str, field: str, value: Any, why: str) -> UnimplementedError:
    return UnimplementedError(f"{engine}: {field}={value!r}: {why} (not modelled by the shard "
                              "map; refused before any byte moves)")


def check_layout(engine: str, plan: Any, facts: Mapping[str, Any],
                 config: Optional[Mapping[str, Any]] = None) -> None:
    """Raises naming the field when the engine's live layout is not the plan's. `facts` empty
    (config not readable) passes: the per-parameter checks still run."""
    if not facts:
        return
    config = config or {}
    src = facts.get("source", engine)
    plan_ep = int(getattr(plan.inputs, "ep", 1) or 1)
    # Block-FP8 plans sync engines that run quantization "fp8" (sglang srt/layers/quantization
    # fp8.py Fp8Config, vllm model_executor/layers/quantization/fp8.py Fp8Config; None where the
    # engine reads it from the checkpoint's quantization_config: the per-module check decides);
    # other plans, unquantized engines only.
    fp8_plan = getattr(plan, "quant", None) is not None
    quant_bad = (lambda v: v is not None and str(v) != "fp8") if fp8_plan else (
        lambda v: v is not None)
    quant_why = ("the plan is block FP8 [128, 128]; only the engines' fp8 method loads it"
                 if fp8_plan else
                 "quantized weights are not the bytes of this plan; a block-FP8 engine needs a "
                 "Plan with quant='fp8-block128' (or the FP8 checkpoint's config.json)")
    for key, want in (("tp", plan.tp), ("pp", plan.pp)):
        got = facts.get(key)
        if got is not None and int(got) != int(want):
            raise InvalidArgumentError(
                f"{src}: {key}_size={got} but the plan's rollout has {key}={want}")
    if engine == "sglang":
        if int(facts.get("dp", 1) or 1) > 1:
            raise _refuse(engine, "dp_size", facts["dp"],
                          "several DP replicas inside one engine; launch one engine per replica "
                          "(the plan's dp) instead")
        if facts.get("ep") is not None and int(facts["ep"] or 1) != plan_ep:
            raise InvalidArgumentError(
                f"{src}: ep_size={facts.get('ep')} but the plan's rollout has ep={plan_ep}")
        checks = (
            ("enable_dp_attention", facts.get("dp_attention"), bool,
             "attention is sharded over attn_tp = tp/dp and the embedding replicated"),
            ("enable_dp_lm_head", facts.get("dp_lm_head"), bool,
             "lm_head is sharded over the attention-TP group"),
            ("attn_cp_size", facts.get("attn_cp"), lambda v: int(v or 1) > 1,
             "attention context parallelism changes attn_tp"),
            ("moe_dp_size", facts.get("moe_dp"), lambda v: int(v or 1) > 1,
             "MoE data parallelism changes moe_tp"),
            ("moe_dense_tp_size", facts.get("moe_dense_tp"), lambda v: v is not None,
             "dense MLP layers use their own TP size"),
            ("ep_num_redundant_experts", facts.get("redundant_experts"),
             lambda v: int(v or 0) > 0, "logical experts have several physical copies"),
            ("enable_eplb", facts.get("eplb"), bool, "expert placement is rebalanced at runtime"),
            ("quantization", facts.get("quantization"), quant_bad,
             quant_why),
            ("moe_runner_backend", facts.get("moe_backend"),
             lambda v: str(v or "auto") not in ("auto", "triton"),
             "the backend's expert layout differs from [E, 2I, H] gate|up (FlashInfer TRT-LLM "
             "swaps w1/w3, triton_kernels transposes)"),
            ("moe_a2a_backend", facts.get("a2a_backend"),
             lambda v: str(v or "none") != "none", "DeepEP/a2a MoE classes own their layout"),
            ("weight_cache_mode", facts.get("weight_cache_mode"),
             lambda v: str(v or "off") != "off",
             "weights are shared with the weight-cache daemon; SGLang refuses in-place updates"),
            ("SGLANG_PP_LAYER_PARTITION", facts.get("pp_partition_env"), bool,
             "custom layer partition; the plan uses the engine's default get_pp_indices"),
        )
    elif engine == "vllm":
        if facts.get("ep_enabled") and int(facts.get("dp", 1) or 1) > 1:
            raise _refuse(engine, "parallel_config.enable_expert_parallel with "
                          "data_parallel_size", facts.get("dp"),
                          "the EP group spans DP replicas (ep = dp x tp)")
        if facts.get("ep") is not None and int(facts["ep"] or 1) != plan_ep:
            raise InvalidArgumentError(
                f"{src}: expert parallel size {facts.get('ep')} (enable_expert_parallel="
                f"{facts.get('ep_enabled')}) but the plan's rollout has ep={plan_ep}")
        checks = (
            ("parallel_config.enable_eplb", facts.get("eplb"), bool,
             "expert placement is rebalanced at runtime"),
            ("eplb_config.num_redundant_experts", facts.get("redundant_experts"),
             lambda v: int(v or 0) > 0, "logical experts have several physical copies"),
            ("prefill_context_parallel_size", facts.get("pcp"), lambda v: int(v or 1) > 1,
             "PCP adds a rank axis between PP and TP"),
            ("decode_context_parallel_size", facts.get("dcp"), lambda v: int(v or 1) > 1,
             "DCP shards the KV heads across TP ranks"),
            ("model_config.quantization", facts.get("quantization"), quant_bad,
             quant_why),
            ("VLLM_PP_LAYER_PARTITION", facts.get("pp_partition_env"), bool,
             "custom layer partition; the plan uses the engine's default get_pp_indices"),
        )
    else:
        raise InvalidArgumentError(f"engine: must be sglang or vllm, got {engine!r}")
    for field, value, bad, why in checks:
        if bad(value):
            raise _refuse(engine, field, value, why)
