"""Engine hooks against stand-in workers that carry the engines' parameter names and local
shapes: the vLLM worker extension (collective_rpc methods) and the SGLang custom loader
(update_weights_from_tensor payloads), each receiving a full sync from trainer ranks."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import shardsync
from conftest import expected_param, reference_weights
from fakes import EngineModel, fsdp_state_dict, vllm_worker


def _plan(model, rollout, engine):
    return shardsync.Plan(model, "fsdp=2", rollout, engine=engine, wire_dtype="f32",
                          trainer_dtype="f32", bucket_bytes=64 << 10)


def _run_job(plan, full, srv, engine_rank_fn):
    """Trainer ranks bind fake FSDP2 shards and sync versions 1 and 2; engine ranks run
    engine_rank_fn(replica, tp, pp) in their own thread."""
    results = {}

    def trainer(rank):
        try:
            s = shardsync.Session(plan, rank, srv.address, token="h", transport="loopback")
            shardsync.bind_trainer(s, fsdp_state_dict(full, rank, plan.trainer_world))
            s.connect()
            results[rank] = [s.sync(1), s.sync(2)]
            s.close()
        except Exception as e:  # noqa: BLE001
            results[rank] = e

    def engine(rank):
        d = plan.describe_rank(rank)
        try:
            results[rank] = engine_rank_fn(d["replica"], d["tp_rank"], d["pp_rank"])
        except Exception as e:  # noqa: BLE001
            results[rank] = e

    ts = [threading.Thread(target=trainer if r < plan.trainer_world else engine, args=(r,))
          for r in range(plan.world_size)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert not any(t.is_alive() for t in ts)
    return results


def _check(plan, full, models):
    sm = plan.shard_map()
    n = 0
    for (replica, tp, pp), m in models.items():
        for p in sm.rank(tp, pp).params:
            assert np.array_equal(m.params[p.name], expected_param(p, full)), p.name
            n += 1
    assert n > 0


@pytest.mark.parametrize("rollout", ["dp=1,tp=2,pp=2", "dp=2,tp=1,pp=2"])
def test_vllm_worker_extension(need_session, tiny_model, rollout):
    from shardsync.hooks.vllm import ShardsyncWorkerExtension

    plan = _plan(tiny_model, rollout, "vllm")
    full = reference_weights(plan, seed=21)
    models = {}
    with shardsync.StoreServer(token="h") as srv:
        config = json.loads(json.dumps({  # what crosses collective_rpc: plain JSON data
            "plan": plan.spec, "store": srv.address, "token": "h", "transport": "loopback",
            "ignore_extra": True}))

        def engine(replica, tp, pp):
            sm = plan.shard_map()
            model = EngineModel(sm.rank(tp, pp).params, extra=[("model.rotary.cache", (8,))])
            models[(replica, tp, pp)] = model
            # vLLM's worker rank inside one engine: pp*T + tp; replica from data_parallel_rank.
            w = vllm_worker(ShardsyncWorkerExtension, pp * plan.tp + tp, plan.tp, plan.pp,
                            replica, model)
            info = w.shardsync_init(config)
            assert (info["tp_rank"], info["pp_rank"]) == (tp, pp)
            assert info["sync_rank"] == plan.engine_rank(replica, tp, pp)
            reps = [w.shardsync_sync(1), w.shardsync_sync(2)]
            w.shardsync_close()
            return reps

        results = _run_job(plan, full, srv, engine)
    for r, v in results.items():
        assert isinstance(v, list), f"rank {r}: {v!r}"
        assert v[-1]["verified"] and v[-1]["version"] == 2
    _check(plan, full, models)


def test_vllm_sync_before_init_fails():
    from shardsync.hooks.vllm import ShardsyncWorkerExtension

    w = ShardsyncWorkerExtension()
    with pytest.raises(shardsync.FailedPreconditionError):
        w.shardsync_sync(1)


def test_sglang_custom_loader_pp2(need_session, tiny_model):
    pytest.importorskip("torch")
    from shardsync.hooks import sglang as hook

    plan = _plan(tiny_model, "dp=1,tp=2,pp=2", "sglang")
    full = reference_weights(plan, seed=31)
    models = {}
    with shardsync.StoreServer(token="h") as srv:
        config = {"plan": plan.spec, "store": srv.address, "token": "h", "transport": "loopback",
                  "replica": 0}

        def scheduler(replica, tp, pp):
            # One SGLang scheduler: the loader is called with each request's named_tensors,
            # identical for every rank (the head sends one payload per tp rank, all equal).
            model = EngineModel(plan.shard_map().rank(tp, pp).params)
            models[(replica, tp, pp)] = model
            hook.set_rank_provider(lambda: (tp, pp, plan.tp, plan.pp))
            hook.load_weights(model, hook.init_request(config))  # returns at once
            hook.load_weights(model, hook.wait_request())
            reps = []
            for v in (1, 2):
                hook.load_weights(model, hook.start_request(v))
                hook.load_weights(model, hook.wait_request())
                reps.append(hook.last_result())
            assert model.post_loads == 2  # after each landed sync, not after init
            hook.close()
            return reps

        results = _run_job(plan, full, srv, scheduler)
    for r, v in results.items():
        assert isinstance(v, list), f"rank {r}: {v!r}"
        assert v[-1]["verified"] and v[-1]["version"] == 2
    _check(plan, full, models)


def test_sglang_loader_errors(need_session, tiny_model):
    torch = pytest.importorskip("torch")
    from shardsync.hooks import sglang as hook

    model = EngineModel([])
    with pytest.raises(shardsync.InvalidArgumentError, match="expected one shardsync"):
        hook.load_weights(model, [("model.embed_tokens.weight", torch.zeros(2))])
    with pytest.raises(shardsync.InvalidArgumentError, match="unknown command"):
        hook.load_weights(model, [("shardsync.bogus", torch.zeros(1))])
    with pytest.raises(shardsync.FailedPreconditionError, match="wait without"):
        hook.load_weights(model, hook.wait_request())
    with pytest.raises(shardsync.FailedPreconditionError, match="before a successful init"):
        hook.load_weights(model, hook.sync_request(1))
    # An init whose engine shape disagrees with the plan surfaces at wait, naming both sizes.
    plan = _plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    hook.set_rank_provider(lambda: (0, 0, 4, 1))
    hook.load_weights(model, hook.init_request({"plan": plan.spec, "store": "127.0.0.1:1",
                                                "replica": 0, "transport": "loopback"}))
    with pytest.raises(shardsync.InvalidArgumentError, match="engine is tp=4, pp=1"):
        hook.load_weights(model, hook.wait_request())
    hook.set_rank_provider(None)
