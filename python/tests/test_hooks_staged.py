"""Issue 33: staged commit through the engine hooks, against FakeSGLangEngine (fakes_sglang.py:
pause_generation mode "in_place" keeps the requests, the running forward step ends before the
pause answers, `generate()` is one forward step over every stage).

A round lands in staging while the engine serves, then one in-place pause commits it on every
rank: a forward step running concurrently with the rounds only ever sees one committed version
across every (tp, pp), never a mix. Engine versions without an in-place pause are refused."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

import shardsync  # noqa: E402
from fakes_engines import installed  # noqa: E402
from fakes_sglang import sglang_modules  # noqa: E402
from hook_harness import Trainers, base_config, check_models, make_plan  # noqa: E402
from shardsync.hooks.driver import SGLangDriver  # noqa: E402
from test_hooks_sglang import engines_for  # noqa: E402


def _generate_loop(engines, stop, seen, errors):
    while not stop.is_set():
        try:
            seen.append(engines[0].generate(timeout=30.0))
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            return


@pytest.mark.parametrize("profile", ["0.5.12", "miles-session"])
def test_sglang_staged_rounds_never_serve_a_mixed_version(need_session, tiny_model, profile):
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=2", "sglang", commit="staged")
    with installed(sglang_modules(profile)), \
            shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, models = engines_for(plan, profile=profile)
        driver = SGLangDriver(group, plan, base_config(plan, srv))
        trainers = Trainers(plan, srv).start()
        stop, seen, errors = threading.Event(), [], []
        try:
            driver.init()
            assert all(x is True for x in trainers.wait("connect"))
            committed = {engines[0].generate()}  # what the engine served before any round
            gen = threading.Thread(target=_generate_loop, args=(engines, stop, seen, errors),
                                   daemon=True)
            gen.start()
            outs = []
            for v in (1, 2, 3):
                served_before = len(seen)
                trainers.sync(v)
                out = driver.sync(v)
                assert all(isinstance(r, dict) and r["verified"] for r in trainers.wait(v))
                outs.append(out)
                check_models(plan, trainers.weights(v), models)  # every rank committed v
                committed.add(engines[0].generate())
                assert len(seen) > served_before, "the engine served nothing during round %d" % v
            stop.set()
            gen.join(30)
            assert not errors, errors
            # Every forward step saw one committed version on every (tp, pp): never a mix.
            mixed = [s for s in seen if s not in committed]
            assert not mixed, f"{len(mixed)} of {len(seen)} steps saw a mix of versions"
            for out in outs:
                assert out["verified"] and out["commit"]["ok"]
                assert 0 <= out["stall_seconds"] < out["transfer_seconds"] + 5
            calls = engines[0].calls
            assert calls.count("pause_generation") == 3 and calls.count("continue_generation") == 3
            # Rollback: every rank back to version 2, bit for bit, under the same pause.
            rb = driver.rollback()
            assert rb["ok"]
            check_models(plan, trainers.weights(2), models)
            for m in models.values():
                assert m.post_loads > 0  # post-load ran after the commits and the rollback
        finally:
            stop.set()
            trainers.stop()


def test_sglang_without_an_in_place_pause_is_refused_by_name(need_session, tiny_model):
    """SGLang <= 0.5.5's pause_generation() takes no mode (it aborts every request): a staged
    commit would drain the engine, so the driver refuses before any request."""
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang", commit="staged")
    with installed(sglang_modules("0.5.4")), \
            shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = engines_for(plan, profile="0.5.4")
        with pytest.raises(shardsync.UnimplementedError, match="in_place"):
            SGLangDriver(group, plan, base_config(plan, srv))
        assert engines[0].calls == []


def test_in_place_plans_keep_their_round_and_refuse_commit(need_session, tiny_model):
    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    with installed(sglang_modules("0.5.12")), \
            shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, engines, _ = engines_for(plan, profile="0.5.12")
        driver = SGLangDriver(group, plan, base_config(plan, srv))
        with pytest.raises(shardsync.FailedPreconditionError, match="inplace"):
            driver.commit(1)
        assert "pause_generation" not in engines[0].calls


def test_vllm_staged_rounds_never_serve_a_mixed_version(need_session, tiny_model):
    """Extension path: shardsync_start returns while the sync runs on a worker thread (the
    engine keeps stepping), pause_generation(mode="keep") holds the steps for the commit only."""
    from fakes_vllm import vllm_modules
    from shardsync.hooks.driver import VLLMDriver
    from test_hooks_vllm import _llms

    plan = make_plan(tiny_model, "dp=1,tp=2,pp=2", "vllm", commit="staged")
    with installed(vllm_modules("0.24")), \
            shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, llms, models = _llms(plan, "extension", profile="0.24")
        driver = VLLMDriver(group, plan, base_config(plan, srv), path="extension")
        trainers = Trainers(plan, srv).start()
        stop, seen, errors = threading.Event(), [], []
        try:
            driver.init()
            assert all(x is True for x in trainers.wait("connect"))
            committed = {llms[0].generate()}
            gen = threading.Thread(target=_generate_loop, args=(llms, stop, seen, errors),
                                   daemon=True)
            gen.start()
            for v in (1, 2):
                trainers.sync(v)
                out = driver.sync(v)
                assert all(isinstance(r, dict) and r["verified"] for r in trainers.wait(v))
                assert out["verified"] and out["commit"]["ok"]
                check_models(plan, trainers.weights(v), models)
                committed.add(llms[0].generate())
            stop.set()
            gen.join(30)
            assert not errors, errors
            assert seen and all(s in committed for s in seen)
        finally:
            stop.set()
            trainers.stop()


@pytest.mark.parametrize("profile", ["0.21"])
def test_vllm_without_a_keep_pause_is_refused_by_name(need_session, tiny_model, profile):
    from fakes_vllm import vllm_modules
    from shardsync.hooks.driver import VLLMDriver
    from test_hooks_vllm import _llms

    plan = make_plan(tiny_model, "dp=1,tp=2,pp=1", "vllm", commit="staged")
    with installed(vllm_modules(profile)), \
            shardsync.StoreServer(token="hooks-test-token-0123456789") as srv:
        group, _, _ = _llms(plan, "extension", profile=profile)
        with pytest.raises(shardsync.UnimplementedError, match="keep"):
            VLLMDriver(group, plan, base_config(plan, srv), path="extension")
