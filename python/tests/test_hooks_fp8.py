"""Engine hooks on block-FP8 engines (docs/fp8.md "What the engines do after loading"): a plan
with quant='fp8-block128' syncs SGLang and vLLM ranks whose FP8 methods keep the canonical
e4m3 weight + fp32 weight_scale_inv (every byte and scale checked against the reference
quantizer after each version, the engine's post-load step run after each), and the backends
whose post-load step rewrites them are refused, naming the module and the fix (fakes_engines.py
Fp8LinearMethod / Fp8MoEMethod mirror the engines' attributes and post-load steps). vLLM's FP8
backends one by one, as each serves its weights after load: test_hooks_vllm_fp8.py."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import shardsync  # noqa: E402
from fakes_engines import FakeModel, Fp8LinearMethod, Fp8MoEMethod, installed  # noqa: E402
from fakes_sglang import FakeSGLangEngine, sglang_modules, sglang_server_args  # noqa: E402
from fakes_vllm import FakeLLM, vllm_config, vllm_modules  # noqa: E402
from hook_harness import Trainers, base_config, check_models, make_plan  # noqa: E402
from shardsync.engine_group import EngineGroup, worker_coords  # noqa: E402
from shardsync.hooks.driver import HookError, SGLangDriver, VLLMDriver  # noqa: E402

TOKEN = "hooks-test-token-0123456789"

# Qwen3-MoE with every TP part on the 128 grid at tp 2 (head_dim 128, 256-row experts).
FP8_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 2,
    "num_experts_per_tok": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 128, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [0],
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8-moe")
    (d / "config.json").write_text(json.dumps(FP8_MOE))
    return str(d)


def _models(plan, linear=None, moe=None):
    sm = plan.shard_map()
    lin = dict(linear or {})
    engine = lin.pop("engine", plan.engine)
    return {(d, tp, pp): FakeModel(
        sm.rank(tp, pp).params, quant=lambda: Fp8LinearMethod(engine, **lin),
        moe_quant=lambda: Fp8MoEMethod(**(moe or {})))
        for d in range(plan.dp) for pp in range(plan.pp) for tp in range(plan.tp)}


def _vllm(plan, models, **config_kw):
    from shardsync.hooks import vllm as vh

    llms = []
    for d in range(plan.dp):
        per = {(tp, pp): models[(d, tp, pp)] for pp in range(plan.pp) for tp in range(plan.tp)}
        llms.append(FakeLLM(per, vllm_config(plan.tp, plan.pp, **config_kw),
                            extension=vh.ShardsyncWorkerExtension))
    coords = worker_coords(plan.dp, plan.tp, plan.pp)
    return EngineGroup([llms[c.dp] if c.is_head else None for c in coords], tp=plan.tp,
                       pp=plan.pp)


def _sglang(plan, models, **server_kw):
    engines = []
    for d in range(plan.dp):
        per = {(tp, pp): models[(d, tp, pp)] for pp in range(plan.pp) for tp in range(plan.tp)}
        engines.append(FakeSGLangEngine(per, plan.tp, plan.pp, server_args=sglang_server_args(
            plan.tp, plan.pp, **server_kw)))
    coords = worker_coords(plan.dp, plan.tp, plan.pp)
    return EngineGroup([engines[c.dp] if c.is_head else None for c in coords], tp=plan.tp,
                       pp=plan.pp)


def _finalized(models, fp8=None):
    return sorted({qm.finalized for m in models.values() for _, mod in m.named_modules()
                   if (qm := getattr(mod, "quant_method", None)) is not None
                   and (fp8 is None or type(qm).__name__.startswith("Fp8") == fp8)})


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_block_fp8_engine_syncs_and_runs_its_post_load(need_session, fp8_moe, engine):
    plan = make_plan(fp8_moe, "dp=1,tp=2,pp=1", engine)
    assert plan.quant is not None  # from the config's quantization_config
    models = _models(plan)
    mods = vllm_modules() if engine == "vllm" else sglang_modules()
    with installed(mods), shardsync.StoreServer(token=TOKEN) as srv:
        if engine == "vllm":
            driver = VLLMDriver(_vllm(plan, models, quantization="fp8"), plan,
                                base_config(plan, srv))
        else:
            driver = SGLangDriver(_sglang(plan, models, quantization="fp8"), plan,
                                  base_config(plan, srv))
        trainers = Trainers(plan, srv).start()
        try:
            driver.init()
            for v in (1, 2):
                trainers.sync(v)
                rep = driver.sync(v)
                assert rep["verified"] and rep["version"] == v
                assert all(isinstance(r, dict) and r["verified"] for r in trainers.wait(v))
                check_models(plan, trainers.weights(v), models)
            if engine == "vllm":  # vLLM runs the post-load step after every sync, its FP8
                # methods' steps masked: the synced bytes are their result (hooks/vllm_fp8.py)
                assert _finalized(models, fp8=True) == [0]
                assert _finalized(models, fp8=False) == [2]
        finally:
            trainers.stop()
            driver.close()


@pytest.mark.parametrize("linear,moe,match", [
    ({"use_marlin": True}, None, "Marlin repacks"),
    ({"use_deep_gemm": True}, None, "VLLM_USE_DEEP_GEMM=0"),
    ({"block": (1, 128)}, None, r"weight_block_size=\[1, 128\]"),
    (None, {"backend": "FLASHINFER_TRTLLM"}, "FP8 MoE backend FLASHINFER_TRTLLM"),
    (None, {"backend": "DEEPGEMM"}, "FP8 MoE backend DEEPGEMM"),
])
def test_vllm_fp8_backends_that_rewrite_weights_are_refused(need_session, fp8_moe, linear, moe,
                                                            match):
    plan = make_plan(fp8_moe, "dp=1,tp=1,pp=1", "vllm")
    models = _models(plan, linear, moe)
    with installed(vllm_modules()), shardsync.StoreServer(token=TOKEN) as srv:
        driver = VLLMDriver(_vllm(plan, models), plan, base_config(plan, srv), timeout=10.0)
        with pytest.raises(HookError, match=match):
            driver.init()


@pytest.mark.parametrize("linear,match", [
    ({"ue8m0": True}, "SGLANG_ENABLE_JIT_DEEPGEMM=0"),
    ({"use_mxfp8": True}, "MXFP8"),
])
def test_sglang_fp8_backends_that_rewrite_weights_are_refused(need_session, fp8_moe, linear,
                                                              match):
    plan = make_plan(fp8_moe, "dp=1,tp=1,pp=1", "sglang")
    models = _models(plan, linear)
    with installed(sglang_modules()), shardsync.StoreServer(token=TOKEN) as srv:
        driver = SGLangDriver(_sglang(plan, models), plan, base_config(plan, srv), timeout=10.0)
        with pytest.raises(HookError, match=match):
            driver.init()


def test_plan_and_engine_must_agree_on_block_fp8(need_session, fp8_moe):
    """A bf16 plan on an FP8 engine, an FP8 plan on an engine quantized otherwise, an FP8 plan
    on an unquantized engine: each refused at init, naming the field or the parameter."""
    bf16 = make_plan(fp8_moe, "dp=1,tp=1,pp=1", "vllm", quant="none")
    fp8 = make_plan(fp8_moe, "dp=1,tp=1,pp=1", "vllm")
    with installed(vllm_modules()), shardsync.StoreServer(token=TOKEN) as srv:
        # The FP8 engine's layers (e4m3 weights, scales) under a bf16 plan: its quant methods.
        fp8_models = _models(fp8)
        driver = VLLMDriver(_vllm(bf16, fp8_models), bf16, base_config(bf16, srv), timeout=10.0)
        with pytest.raises(HookError, match="plan is not block FP8"):
            driver.init()
        driver = VLLMDriver(_vllm(fp8, _models(fp8), quantization="awq"), fp8,
                            base_config(fp8, srv, precheck=False), timeout=10.0)
        with pytest.raises(HookError, match="quantization='awq'"):
            driver.init()
        plain = {(0, 0, 0): FakeModel(bf16.shard_map().rank(0, 0).params)}
        driver = VLLMDriver(_vllm(fp8, plain), fp8, base_config(fp8, srv), timeout=10.0)
        with pytest.raises(HookError, match="engine dtype F32, the block-FP8 engine.s is F8_E4M3"):
            driver.init()
