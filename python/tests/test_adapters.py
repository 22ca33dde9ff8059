"""Trainer adapters (FSDP2 / HSDP DTensor state dicts, plain state dicts) and engine adapters
(named_parameters against the shard map), alone and driving a sync."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import shardsync
from conftest import expected_param, reference_weights
from fakes import DTensor, Mesh, Partial, Replicate, Shard, EngineModel, fsdp_state_dict

TOKEN = "test-token-0123456789"  # stores refuse tokens under 16 characters


def _plan(model, trainer, rollout="dp=1,tp=2,pp=2", engine="sglang"):
    return shardsync.Plan(model, trainer, rollout, engine=engine, wire_dtype="f32",
                          trainer_dtype="f32", bucket_bytes=64 << 10)


def test_spec_from_dtensors(need_plan, tiny_model):
    plan = _plan(tiny_model, "fsdp=4")
    full = reference_weights(plan)
    for r in range(4):
        assert shardsync.trainer_spec_of(fsdp_state_dict(full, r, 4)) == ("fsdp=4", r)
    for r in range(6):
        assert shardsync.trainer_spec_of(fsdp_state_dict(full, r, 3, replicas=2)) == ("hsdp=2x3", r)
    rep = {n: DTensor(a, Mesh([2], [1]), [Replicate()], 0, 1) for n, a in full.items()}
    assert shardsync.trainer_spec_of(rep) == ("replicate=2", 1)


def test_spec_errors_name_the_tensor(need_plan, tiny_model):
    plan = _plan(tiny_model, "fsdp=2")
    full = reference_weights(plan)
    sd = fsdp_state_dict(full, 0, 2)
    name = next(iter(sd))
    bad = dict(sd)
    bad[name] = DTensor(full[name], Mesh([2], [0]), [Partial()], 0, 2)
    with pytest.raises(shardsync.InvalidArgumentError, match=f"tensor '{name}'"):
        shardsync.trainer_spec_of(bad)
    bad[name] = DTensor(full[name], Mesh([2], [0]), [Shard(1)], 0, 2)
    with pytest.raises(shardsync.InvalidArgumentError, match="not supported"):
        shardsync.trainer_spec_of(bad)
    bad[name] = full[name]
    with pytest.raises(shardsync.InvalidArgumentError, match="plain tensor among DTensors"):
        shardsync.trainer_spec_of(bad)
    other = fsdp_state_dict(full, 1, 2)
    mixed = dict(sd)
    mixed[name] = other[name]
    with pytest.raises(shardsync.InvalidArgumentError, match="differs from"):
        shardsync.trainer_spec_of(mixed)
    with pytest.raises(shardsync.InvalidArgumentError, match="no DTensor"):
        shardsync.trainer_spec_of(full)


def test_sources_checked_against_plan(need_plan, tiny_model):
    plan = _plan(tiny_model, "fsdp=2")
    full = reference_weights(plan)
    src = shardsync.trainer_sources(fsdp_state_dict(full, 1, 2), plan)
    assert src.spec == "fsdp=2" and src.rank == 1
    for n, t in src.tensors.items():
        reg = plan.held_region(1, full[n].shape)
        assert np.array_equal(t, full[n][reg.slices()])
    # Wrong layout for the plan.
    with pytest.raises(shardsync.InvalidArgumentError, match="plan's trainer is fsdp=2"):
        shardsync.trainer_sources(fsdp_state_dict(full, 0, 4), plan)
    # Missing tensor.
    sd = fsdp_state_dict(full, 0, 2)
    gone = sorted(sd)[0]
    del sd[gone]
    with pytest.raises(shardsync.NotFoundError, match=gone.replace(".", "\\.")):
        shardsync.trainer_sources(sd, plan)
    # Full shape disagreeing with the model names both shapes.
    sd = fsdp_state_dict(full, 0, 2)
    n = "model.norm.weight"
    sd[n] = DTensor(np.zeros(65, np.float32), Mesh([2], [0]), [Shard(0)], 0, 2)
    with pytest.raises(shardsync.InvalidArgumentError, match=r"full shape \[65\], the model says \[64\]"):
        shardsync.trainer_sources(sd, plan)
    # dtype other than the plan's trainer dtype.
    sd = fsdp_state_dict({k: v.astype(np.float16) for k, v in full.items()}, 0, 2)
    with pytest.raises(shardsync.InvalidArgumentError, match="trainer dtype is F32"):
        shardsync.trainer_sources(sd, plan)
    # Extra names are skipped, or refused when strict; wrapper prefixes are stripped.
    sd = {"_orig_mod." + k: v for k, v in fsdp_state_dict(full, 0, 2).items()}
    sd["rotary_emb.inv_freq"] = DTensor(np.zeros(8, np.float32), Mesh([2], [0]), [Shard(0)], 0, 2)
    src = shardsync.trainer_sources(sd, plan)
    assert src.skipped == ["rotary_emb.inv_freq"]
    with pytest.raises(shardsync.InvalidArgumentError, match="not in model"):
        shardsync.trainer_sources(sd, plan, strict=True)


def test_plain_state_dict_modes(need_plan, tiny_model):
    full = reference_weights(_plan(tiny_model, "single"))
    src = shardsync.trainer_sources(full, _plan(tiny_model, "single"), mode="single")
    assert src.spec == "single" and set(src.tensors) == set(full)
    src = shardsync.trainer_sources(full, _plan(tiny_model, "replicate=3"), mode="replicate",
                                    rank=2, world=3)
    assert (src.spec, src.rank) == ("replicate=3", 2)
    with pytest.raises(shardsync.InvalidArgumentError, match="mode"):
        shardsync.trainer_sources(full, mode="megatron")


def test_engine_params_checked_against_shard_map(need_plan, tiny_model):
    sm = shardsync.shard_map(tiny_model, "sglang", tp=2, pp=2)
    params = sm.rank(1, 1).params
    ok = EngineModel(params)
    pairs = shardsync.check_engine_params(params, ok.named_parameters(), wire_dtype="F32")
    assert [n for n, _ in pairs] == [p.name for p in params]
    # A shape mismatch names the parameter and both shapes.
    p0 = params[0]
    bad = EngineModel(params)
    bad.params[p0.name] = np.zeros([d + 2 for d in p0.shape], np.float32)
    want = f"parameter '{p0.name}': engine shape {[d + 2 for d in p0.shape]}, the shard map says {list(p0.shape)}"
    with pytest.raises(shardsync.InvalidArgumentError) as info:
        shardsync.check_engine_params(params, bad.named_parameters())
    assert str(info.value) == want
    # Missing and extra parameters.
    miss = EngineModel(params)
    del miss.params[params[-1].name]
    with pytest.raises(shardsync.NotFoundError, match=params[-1].name.replace(".", "\\.")):
        shardsync.check_engine_params(params, miss.named_parameters())
    extra = EngineModel(params, extra=[("model.layers.0.self_attn.rotary.cos", (4,))])
    with pytest.raises(shardsync.InvalidArgumentError, match="not in the shard map"):
        shardsync.check_engine_params(params, extra.named_parameters())
    assert len(shardsync.check_engine_params(params, extra.named_parameters(),
                                             ignore_extra=True)) == len(params)
    # Wrong dtype for in-place landing.
    with pytest.raises(shardsync.InvalidArgumentError, match="wire dtype is BF16"):
        shardsync.check_engine_params(params, ok.named_parameters(), wire_dtype="BF16")
    # Another rank's parameters (other stage) do not pass.
    with pytest.raises(shardsync.Error):
        shardsync.check_engine_params(params, EngineModel(sm.rank(1, 0).params).named_parameters())


@pytest.mark.parametrize("trainer,shards,replicas,rollout", [
    ("fsdp=3", 3, 1, "dp=1,tp=2,pp=2"),
    ("hsdp=2x2", 2, 2, "dp=2,tp=1,pp=2"),
])
def test_adapters_drive_a_sync(need_session, tiny_model, trainer, shards, replicas, rollout):
    plan = _plan(tiny_model, trainer, rollout)
    full = reference_weights(plan, seed=11)
    results, models = {}, {}
    with shardsync.StoreServer(token=TOKEN) as srv:
        def run(rank):
            try:
                s = shardsync.Session(plan, rank, srv.address, token=TOKEN, transport="loopback")
                if s.is_trainer:
                    shardsync.bind_trainer(s, fsdp_state_dict(full, rank, shards, replicas))
                else:
                    models[rank] = EngineModel(s.expected_params())
                    shardsync.bind_engine(s, models[rank].named_parameters())
                s.connect()
                results[rank] = s.sync(1)
                s.close()
            except Exception as e:  # noqa: BLE001 - checked below
                results[rank] = e

        ts = [threading.Thread(target=run, args=(r,)) for r in range(plan.world_size)]
        [t.start() for t in ts]
        [t.join(120) for t in ts]
    for r in range(plan.world_size):
        assert isinstance(results[r], dict), f"rank {r}: {results[r]!r}"
        assert results[r]["verified"]
    sm = plan.shard_map()
    for rank, m in models.items():
        d = plan.describe_rank(rank)
        for p in sm.rank(d["tp_rank"], d["pp_rank"]).params:
            assert np.array_equal(m.params[p.name], expected_param(p, full)), p.name
