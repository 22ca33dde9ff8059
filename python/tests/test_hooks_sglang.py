"""SGLang hooks against FakeSGLangEngine (fakes_sglang.py), which keeps SGLang's contract for a
weight-update request: stage-by-stage handling with only pp0/tp0 answering, the allowlisted
unpickler outside any try, per-tp_rank payloads shared by every PP stage, unguarded custom
loaders, begin/end session asserts and external receivers (both sglang-miles only), the flush
assert. Most tests run the sglang-miles session profile ("miles-session"); SGLang main's
releases ("0.5.12", no session) are covered in test_hooks_engine_versions.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import shardsync  # noqa: E402
from fakes_engines import FakeModel, installed  # noqa: E402
from fakes_sglang import (  # noqa: E402
    FakeSGLangEngine,
    SchedulerDied,
    serve_sglang_http,
    sglang_modules,
    sglang_serialize,
    sglang_server_args,
)
from hook_harness import Trainers, base_config, check_models, make_plan  # noqa: E402
from shardsync.engine_group import EngineGroup, worker_coords  # noqa: E402
from shardsync.hooks import sglang as ss  # noqa: E402
from shardsync.hooks.driver import HookError, HTTPEngine, SGLangDriver  # noqa: E402


@pytest.fixture
def sglang_env(need_session):
    with installed(sglang_modules("miles-session")):
        yield


def engines_for(plan, *, models=None, overrides=None, profile="miles-session", drafts=False,
                **kw):
    """One FakeSGLangEngine per replica; returns (EngineGroup over the workers, engines, models).
    With `drafts`, every scheduler also runs a draft model runner (its own FakeModel)."""
    sm = plan.shard_map()
    models = models if models is not None else {}
    engines = []
    for d in range(plan.dp):
        per, draft = {}, {}
        for pp in range(plan.pp):
            for tp in range(plan.tp):
                m = models.get((d, tp, pp)) or FakeModel(
                    sm.rank(tp, pp).params, overrides=(overrides or {}).get((d, tp, pp)))
                models[(d, tp, pp)] = per[(tp, pp)] = m
                if drafts:
                    draft[(tp, pp)] = FakeModel(sm.rank(tp, pp).params[:2])
        engines.append(FakeSGLangEngine(per, plan.tp, plan.pp, profile=profile,
                                        drafts=draft or None, **kw))
    coords = worker_coords(plan.dp, plan.tp, plan.pp)
    handles = [engines[c.dp] if c.is_head else None for c in coords]
    return EngineGroup(handles, tp=plan.tp, pp=plan.pp), engines, models


def run_versions(plan, srv, driver, models, versions=(1, 2)):
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


def test_sglang_pp2_full_sync_with_session(sglang_env, tiny_model):
    """Every PP stage reads the same per-tp_rank payload and still lands its own layers: the
    command carries no rank; each scheduler reads its (tp, pp) from SGLang's parallel state.
    begin/end brackets every round; post_load_weights rebuilt derived weights after landing."""
    plan = make_plan(tiny_model, "dp=2,tp=2,pp=2", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan)
        driver = SGLangDriver(group, plan, base_config(plan, srv))
        assert (driver.path, driver.session) == ("loader", True)
        reps = run_versions(plan, srv, driver, models)
        assert [r["version"] for r in reps] == [1, 2] and all(r["verified"] for r in reps)
        for m in models.values():
            assert m.post_loads == 2  # once per landed sync
            for a in m.attention:  # derived weights match the new qkv, not the old
                assert float(a.derived) == pytest.approx(
                    float(a._qkv[0].weight.double().sum()), rel=1e-6)
        for e in engines:
            assert not e.dead
            assert e.calls.count("begin_weight_update") == e.calls.count("end_weight_update")
            e.shutdown()


def test_sglang_payload_contract_of_the_fake():
    """What SGLang does with payloads other than shardsync's: a CPU tensor fails in the patched
    reductions (UniRL #503); a class outside the unpickler's allowlist is blocked; a str has no
    `.to`. The first is raised in the caller, the others kill the scheduler."""
    with pytest.raises(IndexError):
        sglang_serialize([("x", torch.tensor([1], dtype=torch.int64))])
    import fractions

    plan_models = {(0, 0): torch.nn.Module()}
    # A class of any module the allowlist does not list (as shardsync.hooks.sglang.Command was).
    outside = fractions.Fraction(1, 3)
    for value, why in ((outside, "Blocked unsafe class loading"), ('{"op": "wait"}', "to")):
        with installed(sglang_modules("0.5.12")):
            eng = FakeSGLangEngine(plan_models, 1, 1, profile="0.5.4")
            with pytest.raises(SchedulerDied, match=why):
                eng.update_weights_from_tensor([("shardsync.cmd", value)], load_format=ss.LOADER)
            eng.shutdown()


def test_sglang_loader_exception_never_reaches_the_scheduler(sglang_env, tiny_model):
    """A loader that raises kills the scheduler (SGLang calls custom loaders with no try). A
    bad config, a bad command, an unknown op: each is a status posted to the store, the engine
    keeps serving, and the driver names the rank and the field."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    wrong = make_plan(tiny_model, "dp=1,tp=4,pp=1", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = engines_for(plan)
        eng = engines[0]
        driver = SGLangDriver(group, plan, base_config(plan, srv))
        driver.config["plan"] = wrong.spec  # the engine is tp=2, the config says tp=4
        with pytest.raises(HookError, match=r"engine is tp=2, pp=1 but the plan's rollout is tp=4"):
            driver.init()
        assert not eng.dead and eng.flush_cache().success
        bad_json, no_attr = torch.nn.Module(), torch.nn.Module()
        bad_json.shardsync_command = "{not json"
        eng.begin_weight_update()
        for named in ([("shardsync.cmd", bad_json)], [("shardsync.cmd", no_attr)],
                      [("model.embed_tokens.weight", bad_json)], ss.command("close", seq="x"),
                      ss.start_request(3), ss.wait_request(timeout=5)):
            eng.update_weights_from_tensor(named, load_format=ss.LOADER, flush_cache=False)
        eng.end_weight_update()
        assert not eng.dead
        eng.shutdown()


def test_sglang_pp1_stage_failure_is_not_silent(sglang_env, tiny_model):
    """Only pp0/tp0 answers an SGLang request. A stage-1 rank whose parameter does not match the
    shard map reports through the store; the driver names it although the reply said success."""
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=2", "sglang")
    bad = plan.shard_map().rank(0, 1).params[1]
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = engines_for(plan, overrides={(0, 0, 1): {bad.name: [3]}})
        driver = SGLangDriver(group, plan, base_config(plan, srv, connect_timeout=1.0,
                                                       sync_timeout=1.0), timeout=15.0)
        replies = []
        real = engines[0].update_weights_from_tensor

        def spy(*a, **k):
            replies.append(real(*a, **k))
            return replies[-1]

        engines[0].update_weights_from_tensor = spy
        with pytest.raises(HookError) as info:
            driver.init()
        assert all(r[0] is True for r in replies)  # pp0/tp0 said success
        err = info.value
        assert (0, 1) in {(f["tp_rank"], f["pp_rank"]) for f in err.failures}
        assert any(bad.name in (f.get("error") or "") for f in err.failures)
        assert not engines[0].dead
        engines[0].shutdown()


def test_sglang_session_asserts(sglang_env, tiny_model):
    """sglang-miles asserts an open begin_weight_update session around updates (an assert in a
    scheduler kills it). The driver brackets every round and closes the session even when the
    round failed, so the next begin does not assert."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan)
        with pytest.raises(SchedulerDied, match="requires an open begin_weight_update"):
            engines[0].update_weights_from_tensor(ss.wait_request(), load_format=ss.LOADER)
        engines[0].shutdown()

        group, engines, models = engines_for(plan)
        driver = SGLangDriver(group, plan, base_config(plan, srv, sync_timeout=1.0), timeout=15.0)
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
        group, engines, models = engines_for(
            plan, server_args=sglang_server_args(2, 1, enable_dp_attention=True))
        driver = SGLangDriver(group, plan, base_config(plan, srv), timeout=10.0)
        with pytest.raises(shardsync.UnimplementedError, match="enable_dp_attention=True"):
            driver.init()
        assert engines[0].calls == []
        driver = SGLangDriver(group, plan, base_config(plan, srv, precheck=False), timeout=10.0)
        with pytest.raises(HookError, match="enable_dp_attention=True"):
            driver.init()
        for m in models.values():
            assert all(float(p.abs().sum()) == 0.0 for p in m.parameters())
        engines[0].shutdown()


def test_sglang_asleep_replica_refused(sglang_env, tiny_model):
    plan = make_plan(tiny_model, "dp=1,tp=1,pp=1", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = engines_for(plan)
        driver = SGLangDriver(group, plan, base_config(plan, srv))
        group.release_memory_occupation(tags=["weights"])
        with pytest.raises(shardsync.FailedPreconditionError, match="replica 0 is asleep"):
            driver.sync(1)
        group.resume_memory_occupation(tags=["weights"])
        assert group.asleep_replicas() == []
        engines[0].shutdown()


def test_sglang_loader_over_http(sglang_env, tiny_model):
    """launch_server deployments (verl, slime): the loader path over SGLang's HTTP routes, the
    command pickled per tp rank as base64; capabilities from /get_server_info and route probes."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=2", "sglang")
    with shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        _, engines, models = engines_for(plan)
        url, http = serve_sglang_http(engines[0])
        try:
            group = EngineGroup([HTTPEngine(url, "sglang")] + [None] * 3, tp=2, pp=2)
            driver = SGLangDriver(group, plan, base_config(plan, srv))
            assert driver.path == "loader" and driver.session is True
            assert driver.caps.version == "0.5.12+miles" and driver.caps.http
            run_versions(plan, srv, driver, models, versions=(1,))
            driver.close()
            assert not engines[0].dead
        finally:
            http.shutdown()
            engines[0].shutdown()
