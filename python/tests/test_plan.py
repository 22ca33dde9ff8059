"""Planning objects through the bindings: layout, shard map, plan summary and rank plans agree
with each other and with the invariants (wire bytes per engine rank == owned bytes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import shardsync
from conftest import expected_param, reference_weights


def test_layout_binding(need_plan):
    lay = shardsync.compute_layout(2, 2, 2, engine="sglang", gpus_per_node=8)
    assert [w.rank for w in lay.workers] == list(range(8))
    assert lay.head_workers() == [0, 4]
    assert [w.is_head for w in lay.workers] == [i in (0, 4) for i in range(8)]
    assert lay.replicas[1].rank_offset == 1 * 2 * 2 + 1
    ranks = lay.replicas[0].engine_ranks
    assert [(e.pp, e.tp, e.global_rank) for e in ranks] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    doc = json.loads(lay.to_json(4))
    assert isinstance(doc, dict)
    with pytest.raises(shardsync.InvalidArgumentError, match="--engine"):
        shardsync.compute_layout(1, 1, 1, engine="trt")


def test_shard_map_binding(need_plan, tiny_model):
    sm = shardsync.shard_map(tiny_model, "vllm", tp=2, pp=2)
    sm.validate()
    assert (sm.tp, sm.pp, sm.engine) == (2, 2, "vllm")
    r = sm.rank(1, 1)
    assert (r.tp_rank, r.pp_rank) == (1, 1)
    assert r.layer_start < r.layer_end
    p = r.params[0]
    assert r.param(p.name).shape == p.shape
    assert p.name in sm.explain(1, 1, p.name)
    with pytest.raises(shardsync.NotFoundError):
        r.param("model.nope")
    with pytest.raises(shardsync.OutOfRangeError):
        sm.rank(2, 0)


@pytest.mark.parametrize("trainer,rollout", [("fsdp=3", "dp=2,tp=2,pp=2"), ("hsdp=2x2", "dp=1,tp=1,pp=4")])
def test_plan_summary_and_rank_plans_agree(need_plan, tiny_model, trainer, rollout):
    plan = shardsync.Plan(tiny_model, trainer, rollout, bucket_bytes=4096)
    plan.validate()
    s = plan.summary()
    assert s["plan_hash"] == plan.hash
    for e in s["engine_ranks"]:
        assert e["recv_bytes"] == e["owned_bytes"]  # a rank never receives bytes it does not own
        rp = plan.rank_plan(plan.engine_rank(e["replica"], e["tp_rank"], e["pp_rank"]))
        assert rp.recv_bytes == e["recv_bytes"] and rp.plan_hash == plan.hash
        for m in rp.recvs:
            assert all(b.bytes <= 4096 or b.op_end - b.op_begin == 1 for b in m.buckets)
    sent = sum(plan.rank_plan(t["rank"]).send_bytes for t in s["trainer_ranks"])
    assert sent == s["total_bytes"] == sum(e["recv_bytes"] for e in s["engine_ranks"])
    assert plan.describe_rank(0)["is_trainer"]
    assert _roundtrips(plan)


def _roundtrips(plan):
    again = shardsync.Plan.from_spec(json.loads(json.dumps(plan.spec)))
    return again.hash == plan.hash


def test_plan_hash_depends_on_inputs(need_plan, tiny_model):
    a = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1")
    assert shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1").hash == a.hash
    assert shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", engine="vllm").hash != a.hash
    assert shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", wire_dtype="f32").hash != a.hash
    with pytest.raises(shardsync.InvalidArgumentError, match="bucket_bytes"):
        shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", bucket_bytes=0)


def test_session_from_env(need_session, tiny_model, monkeypatch):
    plan = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1")
    with shardsync.StoreServer(token="e") as srv:
        monkeypatch.setenv("SHARDSYNC_STORE", srv.address)
        monkeypatch.setenv("SHARDSYNC_TOKEN", "e")
        monkeypatch.setenv("RANK", "3")
        monkeypatch.setenv("WORLD_SIZE", str(plan.world_size))
        s = shardsync.Session.from_env(plan, transport="loopback")
        assert s.rank == 3 and not s.is_trainer
        s.close()
        monkeypatch.setenv("WORLD_SIZE", "7")
        with pytest.raises(shardsync.InvalidArgumentError, match="WORLD_SIZE"):
            shardsync.Session.from_env(plan, transport="loopback")


@pytest.mark.parametrize(
    "trainer,rollout",
    [("megatron=tp=2,pp=2", "dp=1,tp=2,pp=2"), ("megatron=tp=4,pp=2,vpp=2,dp=2", "dp=2,tp=4,pp=1")],
)
def test_megatron_plan_moves_local_regions(need_plan, tiny_model, trainer, rollout):
    """Megatron trainers: local parameters filled from their pieces, the plan's ops copied from
    (message.local: local parameter and region) into engine regions, give every engine parameter its expected value."""
    plan = shardsync.Plan(tiny_model, trainer, rollout, engine="vllm", bucket_bytes=4096)
    plan.validate()
    s = plan.summary()
    assert all(e["recv_bytes"] == e["owned_bytes"] for e in s["engine_ranks"])
    full = reference_weights(plan)
    sm = plan.shard_map()
    engines = {}
    for r in range(plan.trainer_world):
        params = plan.trainer_params(r)
        assert plan.trainer_coords(r)["pp"] == r // (plan.trainer_world // 2)
        local = []
        for p in params:
            t = np.full(p.shape, np.nan, dtype=np.float32)  # padding stays NaN: never sent
            for pc in p.pieces:
                t[pc.local.slices()] = full[pc.source][pc.src.slices()]
            local.append(t)
        for m in plan.rank_plan(r).sends:
            d = plan.describe_rank(m.dst)
            key = (d["replica"], d["tp_rank"], d["pp_rank"])
            if key not in engines:
                rank = sm.rank(d["tp_rank"], d["pp_rank"])
                engines[key] = (rank, [np.zeros(q.shape, np.float32) for q in rank.params])
            rank, bufs = engines[key]
            assert len(m.local) == len(m.ops)
            for op, src in zip(m.ops, m.local):
                v = local[src.param][src.region.slices()]
                bufs[op.param][op.dst.slices()] = v.reshape(op.dst.extent)
    assert len(engines) == plan.dp * plan.tp * plan.pp
    for rank, bufs in engines.values():
        for q, b in zip(rank.params, bufs):
            np.testing.assert_array_equal(b, expected_param(q, full), err_msg=q.name)
    with pytest.raises(shardsync.InvalidArgumentError, match="trainer_params"):
        plan.held_region(0, [4, 4])
    with pytest.raises(shardsync.OutOfRangeError):
        plan.trainer_params(plan.trainer_world)
    with pytest.raises(shardsync.InvalidArgumentError, match="vpp: virtual pipeline stages need pp > 1"):
        shardsync.Plan(tiny_model, "megatron=tp=2,vpp=2", rollout)


def test_megatron_sessions_refused_until_bound(need_session, tiny_model):
    plan = shardsync.Plan(tiny_model, "megatron=tp=2", "dp=1,tp=2,pp=1")
    hub = shardsync.LoopbackHub()
    with shardsync.StoreServer(token="m") as srv:
        with pytest.raises(shardsync.UnimplementedError, match="Megatron"):
            shardsync.Session(plan, 0, srv.address, token="m", transport="loopback", hub=hub)
