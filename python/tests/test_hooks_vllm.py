"""vLLM hooks against FakeLLM (fakes_engines.py): the native weight-transfer backend
(init / start / update / finish, created by the worker through the factory) and the worker
extension (collective_rpc), with the engine's post-load step, MoE backends that permute w13,
finalize steps that re-register parameters, and sleep-mode (cuMem) weights."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import shardsync  # noqa: E402
from fakes_engines import FakeModel, Fp8LinearMethod, installed  # noqa: E402
from fakes_vllm import CuMemAllocator, FakeLLM, serve_vllm_http, vllm_config, vllm_modules  # noqa: E402,E501
from hook_harness import TINY_MOE, Trainers, base_config, check_models, make_plan  # noqa: E402
from shardsync.engine_group import EngineGroup, worker_coords  # noqa: E402
from shardsync.hooks.driver import HookError, VLLMDriver  # noqa: E402


@pytest.fixture
def vllm_env(need_session):
    with installed(vllm_modules()):
        from shardsync.hooks import vllm as vh

        assert vh.register_vllm_backend()
        yield vh


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-moe")
    (d / "config.json").write_text(json.dumps(TINY_MOE))
    return str(d)


def _llms(plan, path, *, models=None, model_kw=None, config_kw=None, profile="0.23"):
    """One FakeLLM per replica; returns (EngineGroup, llms, models)."""
    from shardsync.hooks import vllm as vh

    sm = plan.shard_map()
    models = models if models is not None else {}
    llms = []
    for d in range(plan.dp):
        per = {}
        for pp in range(plan.pp):
            for tp in range(plan.tp):
                m = models.get((d, tp, pp)) or FakeModel(sm.rank(tp, pp).params,
                                                         **(model_kw or {}))
                models[(d, tp, pp)] = m
                per[(tp, pp)] = m
        cfg = vllm_config(plan.tp, plan.pp, backend="shardsync" if path == "native" else None,
                          **(config_kw or {}))
        llms.append(FakeLLM(per, cfg, profile=profile, extension=vh.ShardsyncWorkerExtension
                            if path == "extension" else None))
    coords = worker_coords(plan.dp, plan.tp, plan.pp)
    handles = [llms[c.dp] if c.is_head else None for c in coords]
    return EngineGroup(handles, tp=plan.tp, pp=plan.pp), llms, models


def _finalized(models):
    return [qm.finalized for m in models.values() for _, mod in m.named_modules()
            if (qm := getattr(mod, "quant_method", None)) is not None]


@pytest.mark.parametrize("path", ["native", "extension"])
def test_vllm_full_sync_runs_finalize(vllm_env, tiny_moe, path):
    """start -> update -> finish (or collective_rpc) lands every byte on every rank of
    dp=2 x tp=2 x pp=2 and runs process_weights_after_loading after each sync: derived
    attention weights follow the new weights, MoE/linear methods re-run their finalize."""
    plan = make_plan(tiny_moe, "dp=2,tp=2,pp=2", "vllm")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, models = _llms(plan, path)
        driver = VLLMDriver(group, plan, base_config(plan, srv))
        assert driver.path == path
        trainers = Trainers(plan, srv).start()
        try:
            init = driver.init()
            assert init["ranks"] == 8
            assert all(r["loader_check"] == "checked" for r in driver.last_reports)
            for v in (1, 2):
                trainers.sync(v)
                rep = driver.sync(v)
                assert rep["verified"] and rep["version"] == v
                assert all(isinstance(r, dict) and r["verified"] for r in trainers.wait(v))
                check_models(plan, trainers.weights(v), models)
                assert set(_finalized(models)) == {v}
                for m in models.values():
                    for a in m.attention:
                        assert float(a.derived) == pytest.approx(
                            float(a._qkv[0].weight.double().sum()), rel=1e-6)
        finally:
            trainers.stop()
            driver.close() if path == "extension" else [
                w.weight_transfer_engine.shutdown() for llm in llms for w in llm.workers.values()]


def test_vllm_permuted_moe_backend_refused(vllm_env, tiny_moe):
    """FlashInfer CUTLASS swaps w13 to w31 in its post-load step: same name, shape and dtype,
    different layout. The seed extension wrote canonical bytes into it (a silent mis-sync);
    the hook refuses the backend at init, naming the module, and no byte moves."""
    plan = make_plan(tiny_moe, "dp=1,tp=1,pp=1", "vllm")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, models = _llms(plan, "extension",
                                    model_kw={"moe_backend": "FLASHINFER_CUTLASS"})
        driver = VLLMDriver(group, plan, base_config(plan, srv), timeout=10.0)
        with pytest.raises(HookError, match=r"mlp\.experts': MoE backend FLASHINFER_CUTLASS "
                                            r"permutes w13/w2 after load"):
            driver.init()
        # The fake reproduces the mis-sync the check prevents: after post-load, canonical
        # bytes written into w13 are read back swapped.
        experts = models[(0, 0, 0)].get_submodule("model.layers.0.mlp.experts")
        w = experts.w13_weight
        canonical = torch.arange(w.numel(), dtype=torch.float32).reshape(w.shape)
        w.data.copy_(canonical)
        experts.quant_method.process_weights_after_loading(experts)
        assert not torch.equal(experts.w13_weight, canonical)


def test_vllm_replaced_parameter_detected_and_next_sync_refused(vllm_env, tiny_model):
    """A finalize that re-registers a parameter (replace_parameter) leaves the session bound to
    memory the engine no longer reads. The seed extension kept writing there (version 2 never
    reached the live parameter); the hook fails version 1 naming the parameter, and refuses
    version 2 before a byte moves."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "vllm")
    sm = plan.shard_map()
    victim = next(p.name for p in sm.rank(0, 0).params if p.name.endswith("o_proj.weight"))
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, models = _llms(plan, "native", model_kw={"replace_linear": {victim}})
        driver = VLLMDriver(group, plan, base_config(plan, srv))
        trainers = Trainers(plan, srv).start()
        try:
            driver.init()
            trainers.sync(1)
            with pytest.raises(HookError, match=f"parameter '{victim}' was replaced"):
                driver.sync(1)
            trainers.wait(1)
            before = {k: m.tensor(victim).clone() for k, m in models.items()}
            with pytest.raises(HookError, match="refuses to sync|was replaced"):
                driver.sync(2)
            for k, m in models.items():  # nothing landed in version 2
                assert torch.equal(m.tensor(victim), before[k])
        finally:
            trainers.stop()
            for llm in llms:
                for w in llm.workers.values():
                    w.weight_transfer_engine.shutdown()


def test_vllm_state_machine_and_errors_never_raise(vllm_env, tiny_model):
    """update before start, a second update in a round, a bad update_info, finish without
    start: each is a status, never an exception inside the worker."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "vllm")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, models = _llms(plan, "native")
        eng = llms[0].workers[(0, 0)].weight_transfer_engine
        st = eng.update_weights({"version": 1})
        assert not st["ok"] and "outside start_weight_update" in st["error"]
        st = eng.start_weight_update()
        assert not st["ok"] and "before a successful init_weight_transfer_engine" in st["error"]
        st = eng.finish_weight_update()
        assert not st["ok"] and "without start_weight_update" in st["error"]
        st = eng.update_weights({"versoin": 1})
        assert not st["ok"] and "expected {'version': int}" in st["error"]
        wrong = make_plan(tiny_model, "dp=1,tp=2,pp=1", "vllm")
        (st,) = llms[0].collective_rpc(  # on the worker thread, where the parallel state is
            lambda: eng.init_transfer_engine(eng.parse_init_info(base_config(wrong, srv))))
        assert not st["ok"] and "engine is tp=1, pp=1 but the plan's rollout is tp=2" in st["error"]
        assert eng.init_transfer_engine("nonsense")["ok"] is False


def test_vllm_update_that_raises_in_the_worker_is_reported_and_the_next_round_syncs(
        vllm_env, tiny_model):
    """vLLM's Worker clears its round when update_weights raises and then refuses the finish
    (the fake mirrors gpu_worker.py's `_weight_update_active`): the driver reports the update's
    error, not the finish's, and the engine's next start closes the abandoned round (here one
    whose bytes landed: the raise came after the engine's update) and syncs. The engine-owned
    lifecycle (vLLM >= 0.25)."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "vllm")
    with installed(vllm_modules("0.25")), \
            shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        vllm_env.register_vllm_backend()
        group, llms, models = _llms(plan, "native", profile="0.25")
        worker = llms[0].workers[(0, 0)]
        eng = worker.weight_transfer_engine
        driver = VLLMDriver(group, plan, base_config(plan, srv))
        trainers = Trainers(plan, srv).start()
        try:
            driver.init()
            real = eng.update_weights

            def dies(info):  # the bytes land, then the worker's call fails
                eng.update_weights = real
                real(info)
                raise ConnectionError("rpc to the worker died")

            eng.update_weights = dies
            trainers.sync(1)
            with pytest.raises(Exception, match="rpc to the worker died") as ei:
                driver.sync(1)
            assert "without a matching start" not in str(ei.value)
            assert worker._weight_update_active is False
            trainers.wait(1)
            trainers.sync(2)
            rep = driver.sync(2)
            assert rep["verified"] and rep["version"] == 2
            trainers.wait(2)
            check_models(plan, trainers.weights(2), models)
            with pytest.raises(RuntimeError, match="already active"):  # the fake's guard bites
                worker.start_weight_update()
                worker.start_weight_update()
        finally:
            trainers.stop()
            eng.shutdown()


@pytest.mark.parametrize("field,value,match", [
    ("enable_expert_parallel", True, "EP group spans DP replicas"),
    ("enable_eplb", True, "enable_eplb=True"),
    ("decode_context_parallel_size", 2, "decode_context_parallel_size=2"),
    ("prefill_context_parallel_size", 2, "prefill_context_parallel_size=2"),
    ("quantization", "fp8", "quantization='fp8'"),
])
def test_vllm_unmodelled_layouts_refused_from_live_config(vllm_env, tiny_moe, field, value,
                                                          match):
    plan = make_plan(tiny_moe, "dp=1,tp=1,pp=1", "vllm")
    kw = {field: value}
    if field == "enable_expert_parallel":
        kw.update(dp=2)
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, models = _llms(plan, "extension", config_kw=kw)
        driver = VLLMDriver(group, plan, base_config(plan, srv), timeout=10.0)
        with pytest.raises(shardsync.Error, match=match):  # the driver, from llm.vllm_config
            driver.init()
        driver = VLLMDriver(group, plan, base_config(plan, srv, precheck=False), timeout=10.0)
        with pytest.raises(HookError, match=match):  # every worker, from its own config
            driver.init()


def test_vllm_fp8_quant_method_refused(vllm_env, tiny_model):
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "vllm")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, models = _llms(plan, "extension", model_kw={"quant": Fp8LinearMethod})
        driver = VLLMDriver(group, plan, base_config(plan, srv), timeout=10.0)
        with pytest.raises(HookError, match="Fp8LinearMethod: the engine holds block-FP8 "
                                            "weights but the plan is not block FP8"):
            driver.init()


def test_vllm_loader_kind_mismatch_refused(vllm_env, tiny_model):
    """Name, shape and dtype agree, the layer does not: o_proj loaded by a column-parallel
    loader (a square matrix sharded the other way) is refused naming the parameter."""
    from fakes_engines import ColumnParallelLinear

    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "vllm")
    sm = plan.shard_map()
    model = FakeModel(sm.rank(0, 0).params)
    name = next(p.name for p in sm.rank(0, 0).params if p.name.endswith("o_proj.weight"))
    model.tensor(name).weight_loader = ColumnParallelLinear().weight_loader
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, _ = _llms(plan, "extension", models={(0, 0, 0): model})
        driver = VLLMDriver(group, plan, base_config(plan, srv), timeout=10.0)
        with pytest.raises(HookError, match=f"parameter '{name}': weight loader "
                                            "ColumnParallelLinear.weight_loader"):
            driver.init()
        model.tensor(name).weight_loader = model.get_submodule(
            name.rsplit(".", 1)[0]).weight_loader
        model.tensor(name).packed_dim = 1
        model.tensor(name).packed_factor = 8
        with pytest.raises(HookError, match="packed \\(quantized\\) storage"):
            driver.init()


def test_vllm_sleep_mode_weights(vllm_env, tiny_model):
    """Sleep-mode weights are cuMem allocations: the cuda_ipc transport (cudaIpcGetMemHandle)
    is refused for them with the alternatives named; an asleep engine refuses a sync (the
    driver through is_sleeping and the group's record, each rank through the allocator)."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "vllm")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, models = _llms(plan, "native", config_kw={"sleep_mode": True})
        CuMemAllocator.get_instance().track(list(models[(0, 0, 0)].parameters()))
        driver = VLLMDriver(group, plan, base_config(plan, srv, transport="cuda_ipc"),
                            timeout=10.0)
        with pytest.raises(HookError, match="cudaIpcGetMemHandle cannot export"):
            driver.init()
        driver = VLLMDriver(group, plan, base_config(plan, srv), timeout=10.0)
        trainers = Trainers(plan, srv).start()
        try:
            driver.init()
            group.sleep(1)
            with pytest.raises(shardsync.FailedPreconditionError, match="replica 0 is asleep"):
                driver.sync(1)
            # Asleep behind the group's back: the rank itself refuses, before any byte moves.
            group.wake_up()
            CuMemAllocator.get_instance().sleep()
            with pytest.raises(HookError, match="engine is asleep"):
                driver.sync(1)
            CuMemAllocator.get_instance().wake_up()
            trainers.sync(2)  # awake again: the next version lands
            assert driver.sync(2)["verified"]
            check_models(plan, trainers.weights(2), models)
        finally:
            trainers.stop()
            for w in llms[0].workers.values():
                w.weight_transfer_engine.shutdown()


def test_vllm_older_factory_without_model_points_to_the_extension(vllm_env, monkeypatch):
    """Older factories created engines as (config, parallel_config): no model to bind. The
    backend says so (a status, not an exception) and names the extension to use instead."""
    import fakes_vllm as fv

    def old_init(self, config, parallel_config):
        self.config, self.parallel_config = config, parallel_config

    monkeypatch.setattr(fv._WeightTransferEngineBase, "__init__", old_init)
    eng = vllm_env.make_backend_class()(object(), vllm_config(1, 1).parallel_config)
    st = eng.init_transfer_engine(eng.parse_init_info({"plan": {}}))
    assert not st["ok"] and "without the model" in st["error"] and vllm_env.EXTENSION in st["error"]


def test_vllm_native_over_http(vllm_env, tiny_model):
    """vllm serve deployments (VLLM_SERVER_DEV_MODE=1): init / start / update / finish over the
    RLHF routes, JSON only; the version from /version, is_sleeping over GET."""
    from shardsync.hooks.driver import HTTPEngine

    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "vllm")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        _, llms, models = _llms(plan, "native")
        url, http = serve_vllm_http(llms[0])
        trainers = Trainers(plan, srv).start()
        try:
            head = HTTPEngine(url, "vllm")
            group = EngineGroup([head, None], tp=2, pp=1)
            driver = VLLMDriver(group, plan, base_config(plan, srv))
            assert driver.path == "native" and driver.caps.version == "0.23.1"
            driver.init()
            trainers.sync(1)
            assert driver.sync(1)["verified"]
            check_models(plan, trainers.weights(1), models)
            head.sleep(1)
            with pytest.raises(shardsync.FailedPreconditionError, match="is sleeping"):
                driver.sync(2)
        finally:
            trainers.stop()
            http.shutdown()
            for w in llms[0].workers.values():
                w.weight_transfer_engine.shutdown()
