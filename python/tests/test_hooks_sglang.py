"""SGLang hooks against FakeSGLangEngine (fakes_engines.py), which reproduces what SGLang does
with a weight-update request: stage-by-stage handling with only pp0/tp0 answering, patched
tensor pickling, per-tp_rank payloads shared by every PP stage, unguarded custom loaders,
begin/end session asserts, external receivers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import shardsync  # noqa: E402
from fakes_engines import (  # noqa: E402
    FakeModel,
    FakeSGLangEngine,
    SchedulerDied,
    installed,
    sglang_modules,
    sglang_serialize,
    sglang_server_args,
)
from hook_harness import Trainers, base_config, check_models, make_plan  # noqa: E402
from shardsync.engine_group import EngineGroup, worker_coords  # noqa: E402
from shardsync.hooks import sglang as ss  # noqa: E402
from shardsync.hooks.driver import HookError, SGLangDriver  # noqa: E402


@pytest.fixture
def sglang_env(need_session):
    with installed(sglang_modules()):
        yield


def _engines(plan, *, models=None, overrides=None, **kw):
    """One FakeSGLangEngine per replica; returns (EngineGroup over the workers, engines, models)."""
    sm = plan.shard_map()
    models = models if models is not None else {}
    engines = []
    for d in range(plan.dp):
        per = {}
        for pp in range(plan.pp):
            for tp in range(plan.tp):
                m = models.get((d, tp, pp)) or FakeModel(
                    sm.rank(tp, pp).params, overrides=(overrides or {}).get((d, tp, pp)))
                models[(d, tp, pp)] = m
                per[(tp, pp)] = m
        engines.append(FakeSGLangEngine(per, plan.tp, plan.pp, **kw))
    coords = worker_coords(plan.dp, plan.tp, plan.pp)
    handles = [engines[c.dp] if c.is_head else None for c in coords]
    return EngineGroup(handles, tp=plan.tp, pp=plan.pp), engines, models


def _run(plan, srv, driver, models, versions=(1, 2)):
    trainers = Trainers(plan, srv).start()
    try:
        driver.init()
        assert all(x is True for x in trainers.wait("connect"))
        out = []
        for v in versions:
            trainers.sync(v)
            out.append(driver.sync(v))
            assert all(isinstance(r, dict) and r["verified"] for r in trainers.wait(v))
            check_models(plan, trainers.weights(v), models)
        return out
    finally:
        trainers.stop()


@pytest.mark.parametrize("path", ["receiver", "loader"])
def test_sglang_pp2_full_sync_with_session(sglang_env, tiny_model, path):
    """Every PP stage reads the same per-tp_rank payload and still lands its own layers: the
    command carries no rank; each scheduler reads its (tp, pp) from SGLang's parallel state.
    begin/end brackets every round; post_load_weights rebuilt derived weights after landing."""
    plan = make_plan(tiny_model, "dp=2,tp=2,pp=2", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = _engines(plan)
        driver = SGLangDriver(group, plan, base_config(plan, srv), path=path)
        assert driver.session is True
        reps = _run(plan, srv, driver, models)
        assert [r["version"] for r in reps] == [1, 2] and all(r["verified"] for r in reps)
        for m in models.values():
            assert m.post_loads >= 2  # after each landed sync
            for a in m.attention:  # derived weights match the new qkv, not the old
                assert float(a.derived) == pytest.approx(
                    float(a._qkv[0].weight.double().sum()), rel=1e-6)
        for e in engines:
            assert not e.dead
            assert e.calls.count("begin_weight_update") == e.calls.count("end_weight_update")
            e.shutdown()


def test_sglang_cpu_tensor_commands_fail_in_patched_pickling():
    """SGLang's patched reductions index arg 6 of every reduced tensor; a CPU tensor has 3
    (UniRL #503). The seed's commands were CPU tensors; shardsync's are JSON text."""
    with pytest.raises(IndexError):
        sglang_serialize([("shardsync.start", torch.tensor([1], dtype=torch.int64))])
    blob = sglang_serialize(ss.start_request(7))
    import pickle

    ((name, cmd),) = pickle.loads(blob)
    assert name == "shardsync.cmd" and isinstance(cmd, str) and cmd.to("cuda:3") is cmd
    assert '"version": 7' in cmd


def test_sglang_loader_exception_never_reaches_the_scheduler(sglang_env, tiny_model):
    """A loader that raises kills the scheduler (SGLang calls custom loaders with no try). A
    bad config, a bad command, an unknown op: each is a status posted to the store, the engine
    keeps serving, and the driver names the rank and the field."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    wrong = make_plan(tiny_model, "dp=1,tp=4,pp=1", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = _engines(plan)
        eng = engines[0]
        driver = SGLangDriver(group, plan, base_config(plan, srv), path="loader")
        driver.config["plan"] = wrong.spec  # the engine is tp=2, the config says tp=4
        with pytest.raises(HookError, match=r"engine is tp=2, pp=1 but the plan's rollout is tp=4"):
            driver.init()
        assert not eng.dead and eng.flush_cache() is True
        # Not JSON, not a command, an unknown op: answered, never raised.
        eng.begin_weight_update()
        eng.update_weights_from_tensor([("shardsync.cmd", ss.Command("{not json"))],
                                       load_format=ss.LOADER)
        eng.update_weights_from_tensor([("model.embed_tokens.weight", ss.Command("{}"))],
                                       load_format=ss.LOADER)
        eng.update_weights_from_tensor([("shardsync.cmd", ss.Command('{"op": "bogus"}'))],
                                       load_format=ss.LOADER)
        eng.update_weights_from_tensor(ss.start_request(3), load_format=ss.LOADER)
        eng.update_weights_from_tensor(ss.wait_request(timeout=5), load_format=ss.LOADER)
        eng.end_weight_update()
        assert not eng.dead
        eng.shutdown()


def test_sglang_pp1_stage_failure_is_not_silent(sglang_env, tiny_model):
    """Only pp0/tp0 answers an SGLang request. A stage-1 rank whose parameter does not match the
    shard map reports through the store; the driver names it although the reply said success."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=2", "sglang")
    sm = plan.shard_map()
    bad = sm.rank(0, 1).params[1]
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = _engines(plan, overrides={(0, 0, 1): {bad.name: [3]}})
        driver = SGLangDriver(group, plan, base_config(plan, srv, connect_timeout=1.0,
                                                       sync_timeout=1.0), path="receiver",
                              timeout=15.0)
        replies = []
        real = engines[0].init_weights_update_group

        def spy(*a, **k):
            replies.append(real(*a, **k))
            return replies[-1]

        engines[0].init_weights_update_group = spy
        with pytest.raises(HookError) as info:
            driver.init()
        assert replies[0][0] is True  # pp0/tp0 said success
        err = info.value
        failed = {(f["pp_rank"], f["tp_rank"]) for f in err.failures}
        assert (0, 1) in {(f["tp_rank"], f["pp_rank"]) for f in err.failures}
        assert f"parameter '{bad.name}'" in str(err) or any(
            bad.name in (f.get("error") or "") for f in err.failures), failed
        assert not engines[0].dead
        engines[0].shutdown()


def test_sglang_session_asserts(sglang_env, tiny_model):
    """Newer SGLang asserts an open begin_weight_update session around updates (an assert in a
    scheduler kills it). The driver brackets every round and closes the session even when the
    round failed, so the next begin does not assert."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = _engines(plan)
        eng = engines[0]
        # Without begin: the scheduler dies, as SGLang's does.
        with pytest.raises(SchedulerDied, match="requires an open begin_weight_update"):
            eng.update_weights_from_tensor(ss.wait_request(), load_format=ss.LOADER)
        eng.shutdown()

        group, engines, models = _engines(plan)
        driver = SGLangDriver(group, plan, base_config(plan, srv, sync_timeout=1.0),
                              path="receiver", timeout=15.0)
        trainers = Trainers(plan, srv).start()
        try:
            driver.init()
            # A round nobody sends for: every rank times out, reports, and end still runs.
            with pytest.raises(HookError, match="sync 5"):
                driver.sync(5)
            assert engines[0].calls[-1] == "end_weight_update"
            assert not engines[0].dead
        finally:
            trainers.stop()
            engines[0].shutdown()


def test_sglang_layout_refused_from_live_server_args(sglang_env, tiny_model):
    """DP attention is not modelled: the driver refuses from the head's server args before it
    contacts the engine; each scheduler refuses again from its own (precheck off here), naming
    the field, before any byte moves."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = _engines(
            plan, server_args=sglang_server_args(2, 1, enable_dp_attention=True))
        driver = SGLangDriver(group, plan, base_config(plan, srv), path="receiver", timeout=10.0)
        with pytest.raises(shardsync.UnimplementedError, match="enable_dp_attention=True"):
            driver.init()
        assert engines[0].calls == []
        driver = SGLangDriver(group, plan, base_config(plan, srv, precheck=False),
                              path="receiver", timeout=10.0)
        with pytest.raises(HookError, match="enable_dp_attention=True"):
            driver.init()
        for m in models.values():
            assert all(float(p.abs().sum()) == 0.0 for p in m.parameters())
        engines[0].shutdown()


def test_sglang_asleep_replica_refused(sglang_env, tiny_model):
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = _engines(plan)
        driver = SGLangDriver(group, plan, base_config(plan, srv), path="receiver")
        group.release_memory_occupation(tags=["weights"])
        with pytest.raises(shardsync.FailedPreconditionError, match="replica 0 is asleep"):
            driver.sync(1)
        group.resume_memory_occupation(tags=["weights"])
        assert group.asleep_replicas() == []
        engines[0].shutdown()


def test_sglang_receiver_over_http(sglang_env, tiny_model):
    """launch_server deployments (verl, slime): the receiver path is JSON end to end, so the
    driver runs it over SGLang's HTTP routes, path read from /get_server_info."""
    from fakes_engines import serve_http
    from shardsync.hooks.driver import HTTPEngine

    plan = make_plan(tiny_model, "dp=1,tp=1,pp=2", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        _, engines, models = _engines(plan)
        url, http = serve_http(engines[0], "sglang")
        try:
            group = EngineGroup([HTTPEngine(url, "sglang"), None], tp=1, pp=2)
            driver = SGLangDriver(group, plan, base_config(plan, srv))
            assert driver.path == "receiver" and driver.session is True
            _run(plan, srv, driver, models, versions=(1,))
            with pytest.raises(shardsync.UnimplementedError, match="receiver path"):
                group.head_engines[0].update_weights_from_tensor([])
            driver.close()
        finally:
            http.shutdown()
            engines[0].shutdown()
