"""Planning objects through the bindings: layout, shard map, plan summary and rank plans agree
with each other and with the invariants (wire bytes per engine rank == owned bytes)."""

from __future__ import annotations

import json

import pytest

import shardsync


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
    with shardsync.StoreServer(token="test-token-0123456789") as srv:
        monkeypatch.setenv("SHARDSYNC_STORE", srv.address)
        monkeypatch.setenv("SHARDSYNC_TOKEN", "test-token-0123456789")
        monkeypatch.setenv("RANK", "3")
        monkeypatch.setenv("WORLD_SIZE", str(plan.world_size))
        s = shardsync.Session.from_env(plan, transport="loopback")
        assert s.rank == 3 and not s.is_trainer
        s.close()
        monkeypatch.setenv("WORLD_SIZE", "7")
        with pytest.raises(shardsync.InvalidArgumentError, match="WORLD_SIZE"):
            shardsync.Session.from_env(plan, transport="loopback")
