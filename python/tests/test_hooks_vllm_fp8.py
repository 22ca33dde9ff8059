"""vLLM block FP8 served as vLLM serves it (issue 32; python/shardsync/hooks/vllm_fp8.py): each
FP8 backend's post-load layout (fakes_vllm_fp8.py mirrors the steps, with citations) is bound
and written as served, scales renamed to `weight_scale` or transposed by SM90 CUTLASS included,
the MoE method too; every e4m3 byte and scale the engine serves is checked against the
reference quantizer (conftest.fp8_quantize) after each version, in-process and over HTTP, on
both vLLM lifecycles; the FP8 post-load steps never run again while attention's still do; the
backends that re-lay or requantize are refused by name at init, before a byte moves."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shardsync  # noqa: E402
from conftest import expected_fp8_param  # noqa: E402
from fakes_engines import FakeModel, installed  # noqa: E402
from fakes_vllm import FakeLLM, serve_vllm_http, vllm_config, vllm_modules  # noqa: E402
from fakes_vllm_fp8 import (  # noqa: E402
    Fp8Env,
    Fp8LinearMethod,
    Fp8MoEMethod,
    attach_kv_cache_method,
    vllm_fp8_modules,
)
from hook_harness import TOKEN, Trainers, base_config, make_plan  # noqa: E402
from shardsync.engine_group import EngineGroup, worker_coords  # noqa: E402
from shardsync.hooks.driver import HTTPEngine, HookError, VLLMDriver  # noqa: E402

# Qwen3-MoE with every TP part on the 128 grid at tp 2 (head_dim 128, 256-row experts), and a
# hidden size != 2 x intermediate so no scale matrix of the dense MLP is square.
FP8_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
    "intermediate_size": 768, "moe_intermediate_size": 256, "num_experts": 2,
    "num_experts_per_tok": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 128, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [0],
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}

# (name, env, linear method kwargs, MoE backend, how the linears' scales are served)
LAYOUTS = {
    "rename-triton": (Fp8Env(capability=90, cutlass=False), {"generation": "rename"},
                      "TRITON", "weight_scale"),
    "rename-sm90-cutlass": (Fp8Env(capability=90, cutlass=True), {"generation": "rename"},
                            "TRITON", "transposed"),
    "rename-sm100-cutlass": (Fp8Env(capability=100, cutlass=True), {"generation": "rename"},
                             "BATCHED_TRITON", "weight_scale"),
    "rename-deepgemm-fp32": (Fp8Env(capability=90, deep_gemm=True), {"generation": "rename"},
                             "TRITON", "weight_scale"),
    "kernel-triton": (Fp8Env(), {"generation": "kernel", "kernel": "Triton"}, "TRITON",
                      "weight_scale_inv"),
    "kernel-cutlass": (Fp8Env(), {"generation": "kernel", "kernel": "Cutlass"},
                       "BATCHED_TRITON", "weight_scale_inv"),
    "kernel-cuda-dispatch": (Fp8Env(), {"generation": "kernel", "kernel": "Cuda"}, "TRITON",
                             "weight_scale_inv"),
}


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-fp8-moe")
    (d / "config.json").write_text(json.dumps(FP8_MOE))
    return str(d)


def _models(plan, env, linear, moe_backend):
    vllm_fp8_modules(env)  # the env the methods read at construction and load
    sm = plan.shard_map()
    out = {}
    for d in range(plan.dp):
        for pp in range(plan.pp):
            for tp in range(plan.tp):
                m = FakeModel(sm.rank(tp, pp).params, quant=lambda: Fp8LinearMethod(**linear),
                              moe_quant=lambda: Fp8MoEMethod(moe_backend))
                attach_kv_cache_method(m)
                out[(d, tp, pp)] = m
    return out


def _group(plan, models, path, profile, *, http=False):
    from shardsync.hooks import vllm as vh

    vh.register_vllm_backend()
    llms, servers = [], []
    for d in range(plan.dp):
        per = {(tp, pp): models[(d, tp, pp)] for pp in range(plan.pp) for tp in range(plan.tp)}
        cfg = vllm_config(plan.tp, plan.pp, backend="shardsync" if path == "native" else None,
                          quantization="fp8")
        llms.append(FakeLLM(per, cfg, profile=profile,
                            extension=vh.ShardsyncWorkerExtension if path == "extension" else None))
    heads = llms
    if http:
        heads = []
        for llm in llms:
            url, srv = serve_vllm_http(llm)
            servers.append(srv)
            heads.append(HTTPEngine(url, "vllm"))
    coords = worker_coords(plan.dp, plan.tp, plan.pp)
    group = EngineGroup([heads[c.dp] if c.is_head else None for c in coords], tp=plan.tp,
                        pp=plan.pp)
    return group, llms, servers


def _served(model, name):
    """The tensor vLLM serves for plan parameter `name`, as numpy (a renamed scale under its
    served name)."""
    live = dict(model.named_parameters())
    t = live.get(name)
    if t is None and name.endswith("weight_scale_inv"):
        t = live[name[: -len("_inv")]]
    return t.detach().numpy()


def check_served(plan, full, models, layout):
    """Every e4m3 byte and every scale the engine serves equals the reference quantizer's, in
    the served layout (SM90 CUTLASS: linear scales transposed); other parameters as synced."""
    sm, cache, n = plan.shard_map(), {}, 0
    for (d, tp, pp), m in models.items():
        for p in sm.rank(tp, pp).params:
            want = expected_fp8_param(p, full, cache)
            got = _served(m, p.name)
            if (layout == "transposed" and p.name.endswith("weight_scale_inv")
                    and ".experts." not in p.name):
                assert got.shape == want.shape[::-1], p.name
                got = got.T
            if want.dtype == np.float32:
                got, want = got.view(np.uint32), want.view(np.uint32)
            assert np.array_equal(got, want), (d, tp, pp, p.name)
            n += 1
    assert n > 0


def _fp8_steps(models):
    """How often the FP8 methods' (linear, MoE, KV-cache) post-load ran after load."""
    return sorted({qm.finalized for m in models.values() for _, mod in m.named_modules()
                   if type(qm := getattr(mod, "quant_method", None)).__name__.startswith("Fp8")})


def _run(plan, models, driver, srv, layout, versions=(1, 2)):
    trainers = Trainers(plan, srv).start()
    try:
        driver.init()
        for v in versions:
            rebuilt = [a.rebuilds for m in models.values() for a in m.attention]
            trainers.sync(v)
            rep = driver.sync(v)
            assert rep["verified"] and rep["version"] == v
            assert all(isinstance(r, dict) and r["verified"] for r in trainers.wait(v))
            check_served(plan, trainers.weights(v), models, layout)
            # attention's derived weights rebuilt from the new bytes; the FP8 steps never rerun
            assert [a.rebuilds for m in models.values() for a in m.attention] == \
                [r + 1 for r in rebuilt]
            assert _fp8_steps(models) == [0]
    finally:
        trainers.stop()
        driver.close()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_vllm_fp8_backend_layouts_sync_as_served(need_session, fp8_moe, name):
    env, linear, moe, layout = LAYOUTS[name]
    plan = make_plan(fp8_moe, "dp=1,tp=2,pp=1", "vllm")
    models = _models(plan, env, linear, moe)
    with installed({**vllm_modules(), **vllm_fp8_modules(env)}), \
            shardsync.StoreServer(token=TOKEN) as srv:
        group, _, _ = _group(plan, models, "extension", "0.23")
        _run(plan, models, VLLMDriver(group, plan, base_config(plan, srv)), srv, layout)


@pytest.mark.parametrize("profile,http", [("0.23", False), ("0.25", False), ("0.23", True),
                                          ("0.25", True)])
def test_vllm_fp8_native_in_process_and_over_http(need_session, fp8_moe, profile, http):
    """The native backend on both lifecycles (0.23: the worker owns start / finish; 0.25: the
    engine does), in-process and over `vllm serve`, SM90 CUTLASS's transposed scales and the MoE
    method; the expert names as each version has them."""
    env, linear, moe, layout = LAYOUTS["rename-sm90-cutlass"]
    naming = "routed_experts" if profile == "0.25" else "fused_moe"
    plan = shardsync.Plan(fp8_moe, "fsdp=2", "dp=1,tp=2,pp=1", engine="vllm", wire_dtype="f32",
                          trainer_dtype="f32", bucket_bytes=64 << 10, expert_naming=naming)
    models = _models(plan, env, linear, moe)
    with installed({**vllm_modules(profile), **vllm_fp8_modules(env)}), \
            shardsync.StoreServer(token=TOKEN) as srv:
        group, llms, servers = _group(plan, models, "native", profile, http=http)
        try:
            driver = VLLMDriver(group, plan, base_config(plan, srv))
            assert driver.path == "native"
            assert driver.caps.lifecycle == ("engine" if profile == "0.25" else "worker")
            _run(plan, models, driver, srv, layout)
        finally:
            for s in servers:
                s.shutdown()


@pytest.mark.parametrize("env,linear,moe,match", [
    (Fp8Env(deep_gemm=True, e8m0=True), {"generation": "rename"}, "TRITON",
     "DeepGEMM with E8M0 scales"),
    (Fp8Env(cutlass=False), {"generation": "rename", "aiter": True}, "TRITON", "ROCm AITER"),
    (Fp8Env(), {"generation": "rename", "marlin": True}, "TRITON", "backend Marlin"),
    (Fp8Env(), {"generation": "kernel", "kernel": "DeepGemm"}, "TRITON",
     "kernel DeepGemmFp8BlockScaledMMKernel"),
    (Fp8Env(), {"generation": "kernel", "kernel": "FlashInfer"}, "TRITON",
     "kernel FlashInferFp8DeepGEMMDynamicBlockScaledKernel"),
    (Fp8Env(deep_gemm=True), {"generation": "kernel", "kernel": "Cuda"}, "TRITON",
     "CudaFp8BlockScaledMMKernel dispatches it to DeepGEMM"),
    (Fp8Env(), {"generation": "kernel", "marlin": True}, "TRITON", "backend Marlin"),
    (Fp8Env(), {"generation": "rename", "block": (1, 128)}, "TRITON",
     r"weight_block_size=\[1, 128\]"),
] + [(Fp8Env(cutlass=False), {"generation": "rename"}, b, f"FP8 MoE backend {b} ")
     for b in ("DEEPGEMM", "BATCHED_DEEPGEMM", "MARLIN", "AITER", "FLASHINFER_CUTLASS",
               "FLASHINFER_TRTLLM")])
def test_vllm_fp8_backends_that_relay_are_refused_by_name_before_a_byte_moves(
        need_session, fp8_moe, env, linear, moe, match):
    plan = make_plan(fp8_moe, "dp=1,tp=1,pp=1", "vllm")
    models = _models(plan, env, linear, moe)
    before = {n: t.detach().clone() for n, t in models[(0, 0, 0)].named_parameters()}
    with installed({**vllm_modules(), **vllm_fp8_modules(env)}), \
            shardsync.StoreServer(token=TOKEN) as srv:
        group, _, _ = _group(plan, models, "extension", "0.23")
        driver = VLLMDriver(group, plan, base_config(plan, srv), timeout=10.0)
        with pytest.raises(HookError, match=match):
            driver.init()
    after = dict(models[(0, 0, 0)].named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_vllm_worker_owned_round_started_as_checkpoint_format_is_refused_untouched(
        need_session, fp8_moe):
    """vLLM < 0.25: a round someone started with is_checkpoint_format=True (the route's default)
    holds meta placeholders until finalize_layerwise_reload: the backend refuses it naming the
    reload, writes nothing, the finish puts the served tensors back, and the next round the
    driver starts (is_checkpoint_format=False) syncs every byte."""
    env, linear, moe, layout = LAYOUTS["rename-triton"]
    plan = make_plan(fp8_moe, "dp=1,tp=1,pp=1", "vllm")
    models = _models(plan, env, linear, moe)
    with installed({**vllm_modules("0.23"), **vllm_fp8_modules(env)}), \
            shardsync.StoreServer(token=TOKEN) as srv:
        group, llms, _ = _group(plan, models, "native", "0.23")
        driver = VLLMDriver(group, plan, base_config(plan, srv))
        trainers = Trainers(plan, srv).start()
        try:
            driver.init()
            before = {n: t.detach().clone() for n, t in models[(0, 0, 0)].named_parameters()}
            from fakes_vllm import WeightTransferUpdateRequest

            llms[0].start_weight_update()  # is_checkpoint_format=True: layerwise placeholders
            llms[0].update_weights(WeightTransferUpdateRequest(update_info={"version": 1}))
            st = llms[0].workers[(0, 0)].weight_transfer_engine._ss_last
            assert not st["ok"] and "layerwise" in st["error"]
            assert "is_checkpoint_format" in st["error"]
            llms[0].finish_weight_update()
            after = dict(models[(0, 0, 0)].named_parameters())
            assert set(after) == set(before)
            assert all(torch.equal(before[n], after[n]) for n in before)
            trainers.sync(2)
            assert driver.sync(2)["verified"]
            check_served(plan, trainers.weights(2), models, layout)
        finally:
            trainers.stop()
            driver.close()
