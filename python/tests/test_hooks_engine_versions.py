"""Issue 23, one test per "Why" bullet: the engines as they ship (fakes_sglang.py /
fakes_vllm.py profiles, each keeping its engine's contract), driven through the hooks.

Every test here failed on the hooks before issue 23 (see each docstring for how)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

torch = pytest.importorskip("torch")

import shardsync  # noqa: E402
from fakes_engines import FakeModel, installed  # noqa: E402
from fakes_sglang import serve_sglang_http, sglang_modules  # noqa: E402
from fakes_vllm import (  # noqa: E402
    CuMemAllocator,
    FakeAsyncLLM,
    FakeLLM,
    serve_vllm_http,
    vllm_config,
    vllm_modules,
)
from hook_harness import TINY_MOE, Trainers, base_config, check_models, make_plan  # noqa: E402
from shardsync.engine_group import EngineGroup, worker_coords  # noqa: E402
from shardsync.hooks.driver import (  # noqa: E402
    HTTPEngine,
    SGLangDriver,
    SGLangEngineAdapter,
    VLLMDriver,
)
from test_hooks_sglang import engines_for, run_versions  # noqa: E402


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-moe")
    (d / "config.json").write_text(json.dumps(TINY_MOE))
    return str(d)


def _group(handles, plan):
    coords = worker_coords(plan.dp, plan.tp, plan.pp)
    return EngineGroup([handles[c.dp] if c.is_head else None for c in coords],
                       tp=plan.tp, pp=plan.pp)


def _llm(plan, profile, *, native=True, models=None):
    from shardsync.hooks import vllm as vh

    vh.register_vllm_backend()
    sm = plan.shard_map()
    models = {} if models is None else models
    per = {}
    for pp in range(plan.pp):
        for tp in range(plan.tp):
            models[(0, tp, pp)] = per[(tp, pp)] = FakeModel(sm.rank(tp, pp).params)
    cfg = vllm_config(plan.tp, plan.pp, backend="shardsync" if native else None)
    return FakeLLM(per, cfg, profile=profile,
                   extension=None if native else vh.ShardsyncWorkerExtension), models


def _shutdown(llm):
    for w in llm.workers.values():
        if w.weight_transfer_engine is not None:
            w.weight_transfer_engine.shutdown()


# ---- vLLM >= 0.24 MoE names -----------------------------------------------------------------


def test_vllm_024_routed_experts_names(need_session, tiny_moe):
    """vLLM 0.24 keeps experts on RoutedExperts ("...mlp.experts.routed_experts.w13_weight"):
    the probe reads the naming, the plan built from it syncs every element, and a plan with the
    old naming is refused by the driver naming the fix. Before: every MoE init failed (the shard
    map had only "...mlp.experts.w13_weight"; no probe, no expert_naming)."""
    with installed(vllm_modules("0.24")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        from shardsync.hooks import vllm as vh

        vh.register_vllm_backend()
        default = make_plan(tiny_moe, "dp=1,tp=2,pp=2", "vllm")  # FusedMoE names
        with pytest.raises(shardsync.InvalidArgumentError,
                           match="expert_naming='routed_experts'"):
            VLLMDriver(_group([_llm(default, "0.24")[0]], default), default,
                       base_config(default, srv))
        from shardsync.hooks import engines

        caps = engines.probe_installed("vllm")
        assert caps.expert_naming == "routed_experts" and caps.version == "0.24.0"
        plan = shardsync.Plan(tiny_moe, "fsdp=2", "dp=1,tp=2,pp=2", engine="vllm",
                              wire_dtype="f32", trainer_dtype="f32", bucket_bytes=64 << 10,
                              **engines.plan_kwargs(caps))
        llm, models = _llm(plan, "0.24")
        names = [n for n, _ in models[(0, 0, 0)].named_parameters()]
        assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in names
        driver = VLLMDriver(_group([llm], plan), plan, base_config(plan, srv))
        trainers = Trainers(plan, srv).start()
        try:
            driver.init()
            assert all(r["loader_check"] == "checked" for r in driver.last_reports)
            trainers.sync(1)
            assert driver.sync(1)["verified"]
            check_models(plan, trainers.weights(1), models)
        finally:
            trainers.stop()
            _shutdown(llm)


def test_vllm_worker_names_the_naming_fix(need_session, tiny_moe):
    """Inside the worker, a plan whose expert names miss (the engine names them the other way)
    fails with the fix, not a bare 'missing parameters' list (precheck of the driver bypassed)."""
    with installed(vllm_modules("0.23")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        plan = make_plan(tiny_moe, "dp=1,tp=1,pp=1", "vllm")
        routed = shardsync.Plan(tiny_moe, "fsdp=2", "dp=1,tp=1,pp=1", engine="vllm",
                                wire_dtype="f32", trainer_dtype="f32",
                                expert_naming="routed_experts")
        llm, _ = _llm(plan, "0.23", native=False)
        (st,) = llm.collective_rpc("shardsync_init", args=(dict(
            base_config(routed, srv, connect_timeout=1.0), replica=0),))
        assert not st["ok"]
        assert "uses expert naming 'fused_moe'" in st["error"]
        assert "expert_naming='fused_moe'" in st["error"]


# ---- SGLang command payload -----------------------------------------------------------------


@pytest.mark.parametrize("profile", ["0.4.7", "0.5.4", "0.5.12", "miles-session"])
def test_sglang_command_survives_the_safe_unpickler(need_session, tiny_model, profile):
    """SGLang's unpickler (allowlisted since PR #11909) refused the hooks' `Command` (a class of
    shardsync) outside any try: the scheduler died on the first push. The command is now a plain
    torch.nn.Module: tp=2, pp=2 syncs on plain-pickle, SafeUnpickler and session versions alike,
    every PP stage opening the same per-tp_rank payload on its own. Only sglang-miles has the
    begin/end session; SGLang main's releases (0.5.12 here) do not."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=2", "sglang")
    with installed(sglang_modules(profile)), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan, profile=profile)
        driver = SGLangDriver(group, plan, base_config(plan, srv))
        run_versions(plan, srv, driver, models)
        assert not engines[0].dead
        assert driver.caps.payload_error is None and driver.session is (profile == "miles-session")
        engines[0].shutdown()


# ---- SGLang external receiver ---------------------------------------------------------------


def test_sglang_stock_engine_has_no_receiver(need_session, tiny_model):
    """External receivers exist only on sglang-miles. On stock SGLang the receiver path is
    refused at driver construction, naming the version and the missing capability, before any
    request: in-process the Engine would raise TypeError on the keywords, over HTTP the keys
    would be dropped and SGLang would open a torch process group at the store's address. Before:
    path='receiver' called init_weights_update_group (TypeError / a process group attempt)."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=2", "sglang")
    with installed(sglang_modules("0.5.12")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = engines_for(plan, profile="0.5.12")
        url, http = serve_sglang_http(engines[0])
        try:
            for head in (engines[0], HTTPEngine(url, "sglang")):
                with pytest.raises(shardsync.UnimplementedError,
                                   match=r"SGLang 0\.5\.12 .*sglang-miles.*refused at init"):
                    SGLangDriver(EngineGroup([head, None], tp=1, pp=2), plan,
                                 base_config(plan, srv), path="receiver")
            assert engines[0].calls == [] and engines[0].pg_attempts == []
        finally:
            http.shutdown()
            engines[0].shutdown()


def test_sglang_miles_receiver_round_runs_post_load(need_session, tiny_model):
    """sglang-miles marks a receiver round loaded like any update (SchedulerWeightUpdaterManager.
    update_weights_from_distributed sets _weight_update_loaded after load_weights([]) on every
    runner), so its end_weight_update skips post_load_weights. Before: the driver told the hook
    not to run it on receiver rounds either, so derived weights went stale, silently (0 post-
    loads). Now the hook runs it in every round's wait: once per round, and the derived weights
    follow the new qkv."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    with installed(sglang_modules("miles")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan, profile="miles")
        driver = SGLangDriver(group, plan, base_config(plan, srv), path="receiver")
        run_versions(plan, srv, driver, models, versions=(1, 2))
        assert [m.post_loads for m in models.values()] == [2, 2]
        for m in models.values():
            for a in m.attention:
                assert float(a.derived) == pytest.approx(
                    float(a._qkv[0].weight.double().sum()), rel=1e-6)
        assert all(p.loaded for p in engines[0].procs.values())  # end saw the round loaded
        driver.close()
        engines[0].shutdown()


# ---- capability detection -------------------------------------------------------------------


@pytest.mark.parametrize("over", ["adapter", "http"])
def test_sglang_without_session_api_behind_a_proxy(need_session, tiny_model, over):
    """session='auto' asked `callable(getattr(head, 'begin_weight_update'))`, which the Engine
    adapter and HTTPEngine always satisfy: on an SGLang without the session API every round
    failed. The probe now reads the engine's io_struct (in-process) or routes (HTTP)."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    with installed(sglang_modules("0.5.4")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan, profile="0.5.4")
        url, http = serve_sglang_http(engines[0])
        head = SGLangEngineAdapter(engines[0]) if over == "adapter" else HTTPEngine(url, "sglang")
        try:
            assert callable(getattr(head, "begin_weight_update", None))  # the proxy's answer
            driver = SGLangDriver(EngineGroup([head, None], tp=2, pp=1), plan,
                                  base_config(plan, srv))
            assert driver.session is False
            run_versions(plan, srv, driver, models, versions=(1,))
            assert "begin_weight_update" not in engines[0].calls
        finally:
            http.shutdown()
            engines[0].shutdown()


def test_unsupported_sglang_refused_naming_version(need_session, tiny_model):
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "sglang")
    with installed(sglang_modules("0.4.6")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = engines_for(plan, profile="0.4.6")
        with pytest.raises(shardsync.UnimplementedError,
                           match=r"SGLang 0\.4\.6 .*no --custom-weight-loader"):
            SGLangDriver(group, plan, base_config(plan, srv))
        engines[0].shutdown()


# ---- vLLM AsyncLLM --------------------------------------------------------------------------


def test_vllm_async_llm_awaited_on_its_loop(need_session, tiny_model):
    """AsyncLLM's weight-transfer methods are async def and take request objects. Before, the
    EngineGroup never awaited them: nothing ran and every rank timed out with "no report". Now
    each is awaited on the engine's own loop, with WeightTransferInit/UpdateRequest objects."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "vllm")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    with installed(vllm_modules("0.23")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        llm, models = _llm(plan, "0.23")
        engine = FakeAsyncLLM(llm, loop)
        with pytest.raises(shardsync.FailedPreconditionError, match="async.*pass loop="):
            VLLMDriver(_group([engine], plan), plan, base_config(plan, srv))
        driver = VLLMDriver(_group([engine], plan), plan, base_config(plan, srv), loop=loop)
        assert driver.caps.asynchronous and driver.path == "native"
        trainers = Trainers(plan, srv).start()
        try:
            driver.init()
            trainers.sync(1)
            assert driver.sync(1)["verified"]
            check_models(plan, trainers.weights(1), models)
        finally:
            trainers.stop()
            _shutdown(llm)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


# ---- vLLM HTTP ------------------------------------------------------------------------------


def test_vllm_http_wake_tags_are_query_parameters(need_session, tiny_model):
    """`/wake_up` reads `tags` from query parameters (query_params.getlist). Before: the body
    carried them, the route saw none and woke every tag; now only the tags named wake."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "vllm")
    with installed(vllm_modules("0.23")):
        llm, models = _llm(plan, "0.23")
        url, http = serve_vllm_http(llm, dev_mode=True)
        try:
            alloc = CuMemAllocator.get_instance()
            m = models[(0, 0, 0)]
            alloc.track([p for n, p in m.named_parameters() if "layers.0." in n], tag="kv_cache")
            alloc.track([p for n, p in m.named_parameters() if "layers.0." not in n])
            head = HTTPEngine(url, "vllm")
            head.sleep(1)
            head.wake_up(tags=["weights"])
            assert alloc.asleep_tags() == {"kv_cache"}
            head.wake_up()
            assert alloc.asleep_tags() == set()
        finally:
            http.shutdown()
            _shutdown(llm)


def test_vllm_http_without_dev_mode_refused_at_init(need_session, tiny_model):
    """`/sleep`, `/wake_up`, `/is_sleeping` and the RLHF routes exist only with
    VLLM_SERVER_DEV_MODE=1. Before: a server without it failed later with a bare HTTP 404; now
    the driver refuses at construction naming the variable, and no route is posted to."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "vllm")
    with installed(vllm_modules("0.23")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        llm, _ = _llm(plan, "0.23")
        url, http = serve_vllm_http(llm, dev_mode=False)
        try:
            with pytest.raises(shardsync.UnimplementedError,
                               match=r"vLLM 0\.23\.1 .*VLLM_SERVER_DEV_MODE=1"):
                VLLMDriver(EngineGroup([HTTPEngine(url, "vllm")]), plan, base_config(plan, srv),
                           path="native")
        finally:
            http.shutdown()
            _shutdown(llm)


# ---- smaller --------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", ["0.5.12", "miles-session"])
def test_sglang_speculative_draft(need_session, tiny_model, profile):
    """With speculative decoding SGLang calls the loader once per runner: SGLang main's EAGLE
    worker the draft first (eagle_worker_v2.py), sglang-miles the target first. The draft is
    refused at init (the plan covers the target only) unless draft='leave'; then the hook binds
    the runner whose parameters are the plan's, whatever the order, and syncs it once per round
    while the draft keeps its weights. Before: init bound the first caller, the draft on SGLang
    main, and failed."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    with installed(sglang_modules(profile)), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan, drafts=True, profile=profile)
        with pytest.raises(shardsync.UnimplementedError, match="speculative decoding.*draft"):
            SGLangDriver(group, plan, base_config(plan, srv))
        driver = SGLangDriver(group, plan, base_config(plan, srv), draft="leave")
        drafts = [p.draft for p in engines[0].procs.values()]
        before = [[t.clone() for t in d.parameters()] for d in drafts]
        run_versions(plan, srv, driver, models, versions=(1, 2))
        for d, old in zip(drafts, before):
            assert all(torch.equal(a, b) for a, b in zip(d.parameters(), old))
            assert d.post_loads == 0
        assert [m.post_loads for m in models.values()] == [2, 2]
        assert not engines[0].dead
        engines[0].shutdown()


def test_sglang_draft_first_without_leave_is_refused_in_the_hook(need_session, tiny_model):
    """The driver's probe refuses a draft from the head's server args; where those are not
    readable (precheck or not), the hook still refuses: with the draft called first, the init
    binds the target and reports the draft runner by name instead of binding the draft."""
    from shardsync.hooks import sglang as ss

    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "sglang")
    with installed(sglang_modules("0.5.12")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan, drafts=True, profile="0.5.12")
        cfg = dict(base_config(plan, srv, connect_timeout=2.0), replica=0, init_id=7)
        eng = engines[0]
        eng.update_weights_from_tensor(ss.init_request(cfg), load_format=ss.LOADER,
                                       flush_cache=False)
        eng.update_weights_from_tensor(ss.wait_request(timeout=5), load_format=ss.LOADER,
                                       flush_cache=False)
        st = json.loads(shardsync.StoreClient(srv.address, "hooks-test-token-0123456789").get(
            "ss/hooks/init/7/0/0/0", timeout=5.0))
        assert not st["ok"] and "second model runner" in st["error"], st
        assert "draft" in st["error"] and not eng.dead
        eng.shutdown()


def test_sglang_weight_cache_mode_refused_by_name(need_session, tiny_model):
    """--weight-cache-mode other than off: SGLang's WeightUpdater._assert_weight_cache_inactive
    raises before any loader, with no try, and the scheduler dies. Before: the driver probed
    nothing, and with precheck off (or server args read only by the ranks) the first request
    killed the engine. Now the probe reads the mode and the driver refuses at construction, in
    process and over HTTP, naming the flag; no request reaches the engine."""
    from fakes_sglang import SchedulerDied, sglang_server_args
    from shardsync.hooks import sglang as ss

    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    with installed(sglang_modules("0.5.12")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        sa = sglang_server_args(2, 1, "0.5.12", weight_cache_mode="client")
        group, engines, _ = engines_for(plan, profile="0.5.12", server_args=sa)
        url, http = serve_sglang_http(engines[0])
        try:
            for head in (engines[0], HTTPEngine(url, "sglang")):
                for path in ("loader", "auto"):
                    with pytest.raises(shardsync.UnimplementedError,
                                       match=r"--weight-cache-mode client.*"
                                             r"_assert_weight_cache_inactive"):
                        SGLangDriver(EngineGroup([head, None], tp=2, pp=1), plan,
                                     base_config(plan, srv, precheck=False), path=path)
            assert engines[0].calls == [] and not engines[0].dead
            # What the refusal prevents: the engine's own assert kills the scheduler.
            with pytest.raises(SchedulerDied, match="weight_cache"):
                engines[0].update_weights_from_tensor(ss.wait_request(), load_format=ss.LOADER)
        finally:
            http.shutdown()
            engines[0].shutdown()


def test_sglang_flush_never_asserts_in_the_scheduler(need_session, tiny_model):
    """flush_cache_after_weight_update asserts inside the scheduler unless generation is idle.
    Before: the wait request carried flush_cache=True, and a sync with requests in flight killed
    the engine. Now updates never ask for it; the driver flushes after end, retrying until the
    engine is idle, and names a replica that stays busy; the engine keeps serving."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "sglang")
    # Every version has the assert; 0.4.7 (plain pickle) isolates it from the unpickler finding.
    with installed(sglang_modules("0.4.7")), shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan, profile="0.4.7")
        driver = SGLangDriver(group, plan, base_config(plan, srv))
        trainers = Trainers(plan, srv).start()
        busy = engines[0].generating()
        try:
            driver.init()
            trainers.sync(1)
            busy.__enter__()  # requests in flight; they finish 0.5 s into the round
            threading.Timer(0.5, busy.__exit__, (None, None, None)).start()
            assert driver.sync(1)["verified"]
            assert not engines[0].dead and engines[0].calls[-1] == "flush_cache"
            check_models(plan, trainers.weights(1), models)
            trainers.sync(2)
            driver.flush_timeout = 0.3
            with engines[0].generating():
                with pytest.raises(shardsync.FailedPreconditionError,
                                   match="flush_cache: replica 0 still refuses"):
                    driver.sync(2)
            assert not engines[0].dead
            check_models(plan, trainers.weights(2), models)  # the weights landed all the same
        finally:
            trainers.stop()
            engines[0].shutdown()
