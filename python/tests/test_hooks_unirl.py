"""ShardsyncWeightSync (shardsync.integrations.unirl) in a UniRL-shaped job: the fake of UniRL's
interface (fakes_unirl.py, its real signatures), an FSDP trainer of two ranks, and SGLang with
tp=2, pp=2 (the case UniRL #503 left blocked) behind UniRL's SGLang wrapper; real shardsync
sessions over host memory; every engine element verified, two versions."""

from __future__ import annotations

import importlib
import sys

import pytest

torch = pytest.importorskip("torch")

import shardsync  # noqa: E402
from conftest import reference_weights  # noqa: E402
from fakes import fsdp_state_dict  # noqa: E402
from fakes_engines import FakeModel, installed  # noqa: E402
from fakes_sglang import FakeSGLangEngine, sglang_modules  # noqa: E402
from fakes_unirl import (  # noqa: E402
    FakeActorHandle,
    FakeFSDPBackend,
    FakeRoleHandle,
    FakeUniRLSGLangEngine,
    unirl_modules,
)
from hook_harness import check_models  # noqa: E402


@pytest.fixture
def unirl(need_session):
    mods = dict(sglang_modules("0.5.4"), **unirl_modules())
    with installed(mods):
        sys.modules.pop("shardsync.integrations.unirl", None)
        yield importlib.import_module("shardsync.integrations.unirl")
        sys.modules.pop("shardsync.integrations.unirl", None)


def _job(unirl, tiny_model, *, profile="0.5.4", **kw):
    plan = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=2", engine="sglang",
                          wire_dtype="f32", trainer_dtype="f32")
    sm = plan.shard_map()
    models = {(0, tp, pp): FakeModel(sm.rank(tp, pp).params) for pp in range(2) for tp in range(2)}
    engine = FakeSGLangEngine({(tp, pp): m for (_, tp, pp), m in models.items()}, 2, 2,
                              profile=profile)
    actor = FakeActorHandle({"rollout": FakeUniRLSGLangEngine(engine)})
    full = reference_weights(plan, seed=1)
    state = [fsdp_state_dict(full, r, 2) for r in range(2)]
    syncs = [unirl.ShardsyncWeightSync(backend=FakeFSDPBackend(state[r]), model=tiny_model,
                                       wire_dtype="f32", trainer_dtype="f32",
                                       operation_timeout_s=20.0, **kw) for r in range(2)]
    return plan, models, engine, actor, state, FakeRoleHandle(syncs)


def test_unirl_sglang_tp2_pp2_syncs_every_element(unirl, tiny_model):
    plan, models, engine, actor, state, ws = _job(unirl, tiny_model, launched_with_loader=True)
    try:
        (addr, token), = ws.pick_store()
        ws.set_rollout_targets([actor], "rollout")
        ws.connect(store=addr, token=token, num_rollout_gpus=4, tp_size=2, pp_size=2)
        for v in (1, 2):
            fresh = reference_weights(plan, seed=v)
            for r in range(2):  # the trainer's step updates its FSDP shards in place
                new = fsdp_state_dict(fresh, r, 2)
                for n, dt in state[r].items():
                    dt._local[...] = new[n]._local
            ws.sync()
            check_models(plan, fresh, models)
            assert [s.weight_version for s in ws.remotes] == [v, v]
        # Only the UniRL wrapper's own method was called, with serialized payloads.
        assert set(actor.calls) == {"update_weights_from_tensor"}
        assert not engine.dead
    finally:
        ws.cleanup()
        engine.shutdown()


def test_unirl_refusals_reach_every_rank(unirl, tiny_model):
    """Refused before a byte moves, on every train rank, naming why: the loader not declared,
    the GPU accounting of PR #502, an SGLang whose session assert the wrapper cannot satisfy."""
    with pytest.raises(shardsync.UnimplementedError, match="lora_merged=True"):
        unirl.ShardsyncWeightSync(backend=FakeFSDPBackend({}), model=tiny_model, lora_merged=True)
    for kw, gpus, profile, match in (
            ({}, 4, "0.5.4", "custom-weight-loader"),
            ({"launched_with_loader": True}, 8, "0.5.4", r"num_rollout_gpus=8 must equal"),
            ({"launched_with_loader": True}, 4, "0.5.12", "exposes no begin_weight_update")):
        with installed(sglang_modules(profile)):
            plan, models, engine, actor, state, ws = _job(unirl, tiny_model, profile=profile,
                                                          **kw)
            try:
                (addr, token), = ws.pick_store()
                ws.set_rollout_targets([actor], "rollout")
                with pytest.raises(shardsync.FailedPreconditionError, match=match) as info:
                    ws.connect(store=addr, token=token, num_rollout_gpus=gpus, tp_size=2,
                               pp_size=2)
                assert "rank 0" in str(info.value)
                assert actor.calls == [] and not engine.dead
            finally:
                ws.cleanup()
                engine.shutdown()
