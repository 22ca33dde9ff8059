"""Planning objects through the bindings: layout, shard map, plan summary and rank plans agree
with each other and with the invariants (wire bytes per engine rank == owned bytes)."""

from __future__ import annotations

import json
import os
import subprocess

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
    with pytest.raises(shardsync.InvalidArgumentError, match="^engine: unknown engine 'trt'"):
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


def test_megatron_sessions_bind_local_parameters(need_session, tiny_model):
    """Megatron sessions are created and list the rank's local parameters (test_megatron.py
    syncs them)."""
    plan = shardsync.Plan(tiny_model, "megatron=tp=2", "dp=1,tp=2,pp=1")
    hub = shardsync.LoopbackHub()
    with shardsync.StoreServer(token="megatron-test-token-0123") as srv:
        with shardsync.Session(plan, 0, srv.address, token="megatron-test-token-0123",
                               transport="loopback", hub=hub) as s:
            assert [p.name for p in s.expected_sources()] == [
                p.name for p in plan.trainer_params(0)]


@pytest.mark.parametrize("rollout,kw,message", [
    # The engine's own asserts, at construction (not at summary() or connect()).
    ("dp=1,tp=3,pp=1", {}, "rollout tp=3: num_attention_heads 32 is not divisible by tp"),
    ("dp=1,tp=1,pp=64", {}, "rollout pp=64: num_hidden_layers 36 is smaller than pp"),
    ("dp=1,tp=2,pp=2", {"pp_partition": [30, 7]},
     "pp_partition: entries sum to 37, num_hidden_layers is 36"),
    ("dp=1,tp=2,pp=1,ep=2", {}, "rollout ep=2: expert parallelism needs an MoE model"),
    ("dp=0,tp=2,pp=1", {}, "rollout dp: must be in"),
    ("dp=1,tp=2", {"wire_dtype": "int8"}, "wire_dtype: I8 is not a supported floating type"),
    ("dp=1,tp=2", {"trainer_dtype": "fp33"}, "trainer_dtype: unknown dtype 'fp33'"),
    ("dp=1,tp=2", {"bucket_bytes": 100}, "bucket_bytes: bucket cap 100 bytes is below 4 KiB"),
    ("dp=1,tp=2", {"engine": "trt"}, "engine: unknown engine 'trt'"),
])
def test_plan_validates_at_construction_in_python_words(need_plan, rollout, kw, message):
    with pytest.raises(shardsync.InvalidArgumentError) as info:
        shardsync.Plan("qwen3-8b", "fsdp=8", rollout, **kw)
    assert str(info.value).startswith(message), str(info.value)
    assert "--" not in str(info.value)  # argument names, never the CLI's flags


def test_errors_never_name_cli_flags(need_plan):
    cases = [
        lambda: shardsync.Plan("qwen3-8b", "fsdp=0", "dp=1,tp=1,pp=1"),
        lambda: shardsync.Plan("qwen3-8b", "hsdp=2", "dp=1,tp=1,pp=1"),
        lambda: shardsync.Plan("no-such-model", "fsdp=1", "dp=1,tp=1,pp=1"),
        lambda: shardsync.Plan("qwen3-30b-a3b", "fsdp=8", "dp=1,tp=4,pp=1,ep=2", engine="vllm"),
        lambda: shardsync.Plan("qwen3-8b", "fsdp=8", "dp=1,tp=2,pp=1").describe_rank(99),
        lambda: shardsync.Plan("qwen3-8b", "fsdp=8", "dp=1,tp=2,pp=1").cost_model(nodes=1,
                                                                               gpus_per_node=4),
        lambda: shardsync.compute_layout(2, 0, 1),
        lambda: shardsync.compute_layout(2, 2, 2, gpus_per_node=3),
        lambda: shardsync.shard_map("qwen3-8b", "vllm", tp=3),
        lambda: shardsync.shard_map("qwen3-8b", "vllm", tp=2, pp=2, pp_partition=[1]),
        lambda: shardsync.load_model("/no/such/config.json"),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(shardsync.Error) as info:
            case()
        assert "--" not in str(info.value), f"case {i}: {info.value}"
    with pytest.raises(shardsync.InvalidArgumentError, match="^tp=3: num_attention_heads 32"):
        shardsync.shard_map("qwen3-8b", "vllm", tp=3)
    with pytest.raises(shardsync.OutOfRangeError, match="^rank: sync rank 99 outside"):
        shardsync.Plan("qwen3-8b", "fsdp=8", "dp=1,tp=2,pp=1").describe_rank(99)


@pytest.mark.parametrize("spelling", ["fp32", "f32", "float32", "F32", "float", "torch.float32"])
def test_every_dtype_spelling_makes_the_same_plan(need_plan, spelling):
    want = shardsync.Plan("qwen3-8b", "fsdp=2", "dp=1,tp=2,pp=1", trainer_dtype="f32",
                          wire_dtype="bfloat16")
    got = shardsync.Plan("qwen3-8b", "fsdp=2", "dp=1,tp=2,pp=1", trainer_dtype=spelling,
                         wire_dtype="bf16")
    assert got.hash == want.hash
    assert got.trainer_dtype == "F32" and got.wire_dtype == "BF16"
    assert got.spec["trainer_dtype"] == "float32" and got.spec["wire_dtype"] == "bfloat16"


def test_dtype_objects(need_plan):
    import numpy as np

    assert shardsync.dtype_name(np.float32) == "float32"
    assert shardsync.dtype_name(np.dtype("float16")) == "float16"
    assert shardsync.dtype_name("half") == "float16"
    torch = pytest.importorskip("torch")
    assert shardsync.dtype_name(torch.bfloat16) == "bfloat16"
    p = shardsync.Plan("qwen3-8b", "fsdp=2", "dp=1,tp=2,pp=1", trainer_dtype=torch.float32,
                       wire_dtype=torch.bfloat16)
    assert p.hash == shardsync.Plan("qwen3-8b", "fsdp=2", "dp=1,tp=2,pp=1").hash
    with pytest.raises(shardsync.InvalidArgumentError, match="^wire_dtype: expected a dtype"):
        shardsync.Plan("qwen3-8b", "fsdp=2", "dp=1,tp=2,pp=1", wire_dtype=3.5)


def test_pp_partition(need_plan, tiny_model):
    p = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=1,pp=2", pp_partition=[1, 3])
    assert p.pp_partition == [1, 3]
    assert p.hash != shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=1,pp=2").hash
    sm = p.shard_map()
    assert (sm.rank(0, 0).layer_start, sm.rank(0, 0).layer_end) == (0, 1)
    assert (sm.rank(0, 1).layer_start, sm.rank(0, 1).layer_end) == (1, 4)
    p.validate()
    assert shardsync.Plan.from_spec(json.loads(json.dumps(p.spec))).hash == p.hash


def _cli():
    """The shardsync executable to compare with: the installed one, else the build tree's."""
    from shardsync import _cli as cli_mod

    for path in (cli_mod.cli_path(), os.environ.get("SHARDSYNC_CLI", ""),
                 os.path.join(os.environ.get("SHARDSYNC_SOURCE_DIR", ""), "build", "shardsync"),
                 os.path.join(os.path.dirname(__file__), "..", "..", "build", "shardsync")):
        if path and os.access(str(path), os.X_OK):
            return str(path)
    pytest.skip("no shardsync executable found")


def test_cost_model_and_svg_match_the_cli(need_plan, tmp_path):
    args = dict(nodes=2, gpus_per_node=4, intra_node_gbps=300.0, inter_node_gbps=25.0)
    plan = shardsync.Plan("qwen3-8b", "fsdp=4", "dp=1,tp=2,pp=2", bucket_bytes=64 << 20)
    got = plan.cost_model(**args)
    svg_path = tmp_path / "p.svg"
    svg = plan.svg(svg_path)
    assert svg.startswith("<svg") and svg_path.read_text() == svg
    r = subprocess.run([_cli(), "plan", "--model", "qwen3-8b", "--trainer", "fsdp=4", "--rollout",
                        "dp=1,tp=2,pp=2", "--bucket-mb", "64", "--nodes", "2", "--gpus-per-node",
                        "4", "--intra-node-gbps", "300", "--inter-node-gbps", "25", "--json",
                        "--svg", str(tmp_path / "cli.svg")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    want = json.loads(r.stdout)
    got.pop("plan_seconds"), want.pop("plan_seconds")  # wall time, the only field that varies
    assert got == want
    assert (tmp_path / "cli.svg").read_text() == svg
    e = got["estimates"]
    assert 0 < e["lower_bound_seconds"] <= e["plan_seconds"] < e["broadcast_seconds"]
    assert got["placement"] == {"nodes": 2, "gpus_per_node": 4, "colocated": True}


def test_model_as_path(need_plan, tiny_model):
    import pathlib

    p = shardsync.Plan(pathlib.Path(tiny_model), "fsdp=2", "dp=1,tp=2,pp=1")
    assert p.spec["model"] == tiny_model and isinstance(p.spec["model"], str)
    assert p.hash == shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1").hash
    assert shardsync.load_model(pathlib.Path(tiny_model)).hidden_size == 64
