"""Engine-hook building blocks, engine-free: weight-loader checks, layout refusal from the live
config, JSON commands, report collection, device selection, the SGLang Engine adapter. The hooks
inside fake engines are in test_hooks_sglang.py and test_hooks_vllm.py."""

from __future__ import annotations

import json
import pickle
import time
from types import SimpleNamespace

import pytest

import shardsync
from shardsync.hooks import core
from shardsync.hooks.layout_check import check_layout, sglang_facts, vllm_facts

torch = pytest.importorskip("torch")

from fakes_engines import (  # noqa: E402
    ColumnParallelLinear,
    FakeModel,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    sglang_server_args,
    vllm_config,
)


def _plan(model, rollout, engine):
    return shardsync.Plan(model, "fsdp=2", rollout, engine=engine, wire_dtype="f32",
                          trainer_dtype="f32")


# ---- weight loaders ----


def _params(need_plan, tiny_model, tp=2):
    plan = _plan(tiny_model, f"dp=1,tp={tp},pp=1", "vllm")
    m = FakeModel(plan.shard_map().rank(0, 0).params)
    return m, list(m.named_parameters())


def test_loader_check_accepts_engine_layers(need_plan, tiny_model):
    m, pairs = _params(need_plan, tiny_model)
    assert core.check_loaders(pairs, tp=2) == "checked"
    kinds = {n.rsplit(".", 2)[-2]: core.loader_kind(t)[0] for n, t in pairs}
    assert kinds["qkv_proj"] == "qkv" and kinds["o_proj"] == "row"
    assert kinds["gate_up_proj"] == "merged" and kinds["embed_tokens"] == "vocab"


def test_loader_check_skips_plain_tensors():
    pairs = [("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(4, 4))]
    assert core.check_loaders(pairs, tp=2) == "skipped"


@pytest.mark.parametrize("mutate,match", [
    (lambda m, n: setattr(m.tensor(n), "weight_loader", RowParallelLinear().weight_loader),
     "RowParallelLinear.weight_loader \\(row\\), the shard map expects a qkv layer"),
    (lambda m, n: setattr(m.tensor(n), "weight_loader",
                          MergedColumnParallelLinear().weight_loader), "\\(merged\\)"),
    (lambda m, n: setattr(m.tensor(n), "output_dim", 1),
     "output_dim=1, the shard map splits dim 0"),
    (lambda m, n: setattr(m.tensor(n), "packed_dim", 0), "packed \\(quantized\\) storage"),
    (lambda m, n: setattr(m.tensor(n), "is_shuffled", True), "shuffled by the MoE backend"),
    (lambda m, n: delattr(m.tensor(n), "weight_loader"), "weight loader no weight_loader"),
])
def test_loader_check_refuses(need_plan, tiny_model, mutate, match):
    m, pairs = _params(need_plan, tiny_model)
    name = next(n for n, _ in pairs if n.endswith("qkv_proj.weight"))
    mutate(m, name)
    with pytest.raises(shardsync.Error, match=f"parameter '{name}'.*{match}|{match}"):
        core.check_loaders(list(m.named_parameters()), tp=2)


def test_replicated_param_with_a_sharded_loader_refused(need_plan, tiny_model):
    m, pairs = _params(need_plan, tiny_model)
    norm = next(n for n, _ in pairs if n.endswith("input_layernorm.weight"))
    m.tensor(norm).weight_loader = ColumnParallelLinear().weight_loader
    with pytest.raises(shardsync.InvalidArgumentError, match="holds it replicated"):
        core.check_loaders(list(m.named_parameters()), tp=2)


def test_expected_kinds_table():
    assert core.expected_loader_kind("model.layers.3.mlp.experts.w13_weight") == "moe"
    assert core.expected_loader_kind("lm_head.weight") == "vocab"
    assert core.expected_loader_kind("model.layers.0.mlp.gate.weight") == "replicated"
    assert core.expected_loader_kind("model.layers.0.mlp.down_proj.weight") == "row"
    assert core.expected_loader_kind("model.layers.0.self_attn.q_norm.weight") == "replicated"
    assert issubclass(QKVParallelLinear, ColumnParallelLinear)  # most derived class wins


# ---- layout refusal ----

SG = [
    ({"dp_size": 2}, "dp_size=2"),
    ({"enable_dp_attention": True}, "enable_dp_attention=True"),
    ({"enable_dp_lm_head": True}, "enable_dp_lm_head=True"),
    ({"attn_cp_size": 2}, "attn_cp_size=2"),
    ({"moe_dp_size": 2}, "moe_dp_size=2"),
    ({"moe_dense_tp_size": 1}, "moe_dense_tp_size=1"),
    ({"ep_num_redundant_experts": 8}, "ep_num_redundant_experts=8"),
    ({"enable_eplb": True}, "enable_eplb=True"),
    ({"quantization": "fp8"}, "quantization='fp8'"),
    ({"moe_runner_backend": "flashinfer_trtllm"}, "moe_runner_backend='flashinfer_trtllm'"),
    ({"moe_a2a_backend": "deepep"}, "moe_a2a_backend='deepep'"),
    ({"weight_cache_mode": "daemon"}, "weight_cache_mode='daemon'"),
    ({"ep_size": 2}, "ep_size=2 but the plan's rollout has ep=1"),
    ({"tp_size": 4}, "tp_size=4 but the plan's rollout has tp=2"),
]


@pytest.mark.parametrize("over,match", SG)
def test_sglang_layout_refused(need_plan, tiny_model, over, match):
    plan = _plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    check_layout("sglang", plan, sglang_facts(sglang_server_args(2, 1), env={}))
    with pytest.raises(shardsync.Error, match=match):
        check_layout("sglang", plan, sglang_facts(sglang_server_args(2, 1, **over), env={}))


def test_layout_partition_env_refused(need_plan, tiny_model):
    plan = _plan(tiny_model, "dp=1,tp=1,pp=2", "sglang")
    facts = sglang_facts(sglang_server_args(1, 2), env={"SGLANG_PP_LAYER_PARTITION": "1,3"})
    with pytest.raises(shardsync.UnimplementedError, match="SGLANG_PP_LAYER_PARTITION"):
        check_layout("sglang", plan, facts)
    vplan = _plan(tiny_model, "dp=1,tp=1,pp=2", "vllm")
    facts = vllm_facts(vllm_config(1, 2), env={"VLLM_PP_LAYER_PARTITION": "1,3"})
    with pytest.raises(shardsync.UnimplementedError, match="VLLM_PP_LAYER_PARTITION"):
        check_layout("vllm", vplan, facts)


VL = [
    ({"enable_expert_parallel": True, "dp": 2}, "EP group spans DP replicas"),
    ({"enable_expert_parallel": True}, "expert parallel size 2 .* plan's rollout has ep=1"),
    ({"enable_eplb": True}, "enable_eplb=True"),
    ({"eplb_config": SimpleNamespace(num_redundant_experts=4)}, "num_redundant_experts=4"),
    ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
    ({"quantization": "fp8"}, "quantization='fp8'"),
    ({"pipeline_parallel_size": 2}, "pp_size=2 but the plan's rollout has pp=1"),
]


@pytest.mark.parametrize("over,match", VL)
def test_vllm_layout_refused(need_plan, tiny_model, over, match):
    plan = _plan(tiny_model, "dp=1,tp=2,pp=1", "vllm")
    check_layout("vllm", plan, vllm_facts(vllm_config(2, 1), env={}))
    over = dict(over)
    dp = over.pop("dp", 1)
    with pytest.raises(shardsync.Error, match=match):
        check_layout("vllm", plan, vllm_facts(vllm_config(2, 1, dp=dp, **over), env={}))


def test_vllm_ep_with_one_replica_matches_plan_ep(need_plan, tmp_path):
    from hook_harness import TINY_MOE

    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    plan = _plan(str(tmp_path), "dp=1,tp=2,pp=1,ep=2", "vllm")
    check_layout("vllm", plan, vllm_facts(vllm_config(2, 1, enable_expert_parallel=True), env={}))


# ---- commands, reports ----


def test_sglang_commands_are_plain_modules_carrying_json():
    """The command is a torch.nn.Module with one text attribute: no class of ours in the pickle
    (SGLang's SafeUnpickler allowlists module prefixes), no tensor (the patched reductions), and
    `.to(device)` returns it unchanged (_unwrap_tensor); each command carries a fresh nonce."""
    import io

    from shardsync.hooks import sglang as ss

    seqs = set()
    for named in (ss.init_request({"a": 1}), ss.start_request(3), ss.wait_request(5.0),
                  ss.sync_request(4), ss.close_request()):
        ((name, cmd),) = named
        assert name == "shardsync.cmd" and type(cmd) is torch.nn.Module
        assert cmd.to("cuda:3") is cmd and cmd.to(0) is cmd
        msg = json.loads(ss.command_text(cmd))
        assert msg["op"] in ("init", "start", "wait", "sync", "close")
        seqs.add(msg["seq"])
        blob = pickle.dumps(named)
        found = []

        class Globals(pickle.Unpickler):
            def find_class(self, module, name):
                found.append(f"{module}.{name}")
                return super().find_class(module, name)

        back = Globals(io.BytesIO(blob)).load()
        assert set(found) <= {"torch.nn.modules.module.Module", "collections.OrderedDict"}, found
        assert ss.command_text(back[0][1]) == ss.command_text(cmd)
    assert len(seqs) == 5
    assert ss.wait_request(post_load=False)[0][1].shardsync_command.count('"post_load": false')
    assert ss.receiver_payload("start", version=2) == {"op": "start", "version": 2}
    with pytest.raises(shardsync.InvalidArgumentError, match="op: must be one of"):
        ss.command("bogus")


def test_collect_reports_names_silent_ranks(need_plan, tiny_model):
    from shardsync.hooks.driver import HookError, check_reports, collect_reports

    plan = _plan(tiny_model, "dp=2,tp=1,pp=2", "sglang")
    with shardsync.StoreServer(token="test-token-0123456789") as srv:
        cfg = {"store": srv.address, "token": "test-token-0123456789", "prefix": "x/"}
        for d, pp in ((0, 0), (0, 1), (1, 0)):
            st = core.make_status("sync", 9, {"replica": d, "tp_rank": 0, "pp_rank": pp,
                                              "rank": plan.engine_rank(d, 0, pp)},
                                  report={"verified": True, "bytes": 1})
            assert core.post_status(cfg, st) is None
        t0 = time.monotonic()
        reps = collect_reports(plan, cfg, "sync", 9, timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert [r["ok"] for r in reps] == [True, True, True, False]
        assert reps[3]["code"] == "no_report" and reps[3]["pp_rank"] == 1
        with pytest.raises(HookError, match=r"engine rank 5 \(replica 1, tp 0, pp 1\)"):
            check_reports(reps, "sync", 9)
        assert check_reports(reps[:3], "sync", 9)["verified"] is True


def test_post_status_never_raises():
    st = core.make_status("sync", 1, {}, ok=True)
    assert "no store" in core.post_status(None, st)
    err = core.post_status({"store": "127.0.0.1:1", "store_timeout": 0.2}, st)
    assert err is not None


class _Dev:
    """A CUDA tensor stand-in (DLPack device only)."""

    def __init__(self, index):
        self.device = SimpleNamespace(index=index)
        self.shape = (1,)

    def __dlpack_device__(self):
        return (2, self.device.index)


def test_device_follows_the_parameters():
    pick = core.EngineRankHook._device
    assert pick([("a", torch.zeros(1))], {}) is None
    assert pick([("a", _Dev(3)), ("b", _Dev(3))], {}) == 3
    assert pick([("a", _Dev(3))], {"staging": "host"}) is None  # staging only when asked
    with pytest.raises(shardsync.InvalidArgumentError, match="'b' is in host memory"):
        pick([("a", _Dev(0)), ("b", torch.zeros(1))], {})
    with pytest.raises(shardsync.InvalidArgumentError, match="span CUDA devices"):
        pick([("a", _Dev(0)), ("b", _Dev(1))], {})


def test_memory_saver_weights_count_as_vmm():
    from shardsync.hooks.sglang import SGLangProbe

    p = SGLangProbe()
    p._facts = {"memory_saver": True}  # --enable-memory-saver: torch_memory_saver (VMM)
    assert p.memory([("a", _Dev(0)), ("b", torch.zeros(1))]) == {"cumem": ["a"], "asleep": []}
    p._facts = {"memory_saver": False}
    assert p.memory([("a", _Dev(0))])["cumem"] == []


def test_hook_entry_points_without_init_return_status():
    from shardsync.hooks import sglang as ss

    st = ss.load_weights(object(), [("x", torch.zeros(1))])  # a real tensor: refused, no raise
    assert not st["ok"] and "expected one 'shardsync.cmd' command" in st["error"]
    st = ss.load_weights(object(), [("shardsync.cmd", '{"op": "wait"}')])  # a str: refused
    assert not st["ok"] and "must be a torch.nn.Module" in st["error"]
    st = ss.load_weights(object(), ss.start_request(1))
    assert not st["ok"] and "start before init" in st["error"]
    st = ss.load_weights(object(), ss.wait_request(0.1))
    assert st["ok"] and st["jobs"] == 0
    r = ss.receiver(SimpleNamespace(model=None, tp_rank=0, tp_size=1, init_payload=None))
    assert not r.last["ok"] and "receiver_init_payload" in r.last["error"]
    r.receive("nonsense")
    assert not r.last["ok"] and "expected a JSON object" in r.last["error"]
    r.receive({"op": "start", "version": "seven"})
    assert not r.last["ok"] and "version: expected an integer" in r.last["error"]
    r.destroy()
    bad = ss.receiver(SimpleNamespace(model=None, tp_rank=0, tp_size=1,
                                      init_payload={"init_id": "x", "plan": {}}))
    assert not bad.last["ok"] and "init_id" in bad.last["error"]
    ss.close()


# ---- SGLang Engine adapter ----


def test_sglang_adapter_routes_missing_methods_through_the_tokenizer_manager():
    import asyncio

    from shardsync.hooks.driver import SGLangEngineAdapter

    seen = []

    class TM:
        async def begin_weight_update(self, req, request):
            seen.append(("begin", req))
            return True, "ok"

        async def init_weights_update_group(self, req, request):
            seen.append(("init", req))
            return True, "ok"

    class Engine:  # an Engine whose Python API predates the receiver keywords and begin/end
        loop = asyncio.new_event_loop()
        tokenizer_manager = TM()

        def init_weights_update_group(self, master_address, master_port, rank_offset,
                                      world_size, group_name, backend="nccl"):
            seen.append(("own", group_name))
            return True, "own"

        def flush_cache(self):
            return "flushed"

    io = SimpleNamespace(BeginWeightUpdateReqInput=lambda **k: ("Begin", k),
                         InitWeightsUpdateGroupReqInput=lambda **k: ("Init", k))
    a = SGLangEngineAdapter(Engine(), io_struct=io)
    assert a.flush_cache() == "flushed"
    assert a.begin_weight_update() == (True, "ok")
    kw = dict(master_address="h", master_port=1, rank_offset=2, world_size=3, group_name="g")
    assert a.init_weights_update_group(**kw) == (True, "own")
    assert a.init_weights_update_group(**kw, receiver="r", receiver_init_payload={}) == (True, "ok")
    assert seen[-1] == ("init", ("Init", dict(kw, receiver="r", receiver_init_payload={})))
    with pytest.raises(shardsync.UnimplementedError, match="no end_weight_update"):
        a.end_weight_update()
    Engine.loop.close()


def test_expert_naming_is_part_of_the_plan(need_plan, tmp_path):
    """Two naming choices never share a plan hash; the default keeps the hash and spec it had;
    the spec rebuilds the plan elsewhere; SGLang refuses vLLM's RoutedExperts naming."""
    from hook_harness import TINY_MOE

    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    kw = dict(engine="vllm", wire_dtype="f32", trainer_dtype="f32")
    fused = shardsync.Plan(str(tmp_path), "fsdp=2", "dp=1,tp=2,pp=1", **kw)
    routed = shardsync.Plan(str(tmp_path), "fsdp=2", "dp=1,tp=2,pp=1", **kw,
                            expert_naming="routed_experts")
    assert fused.hash != routed.hash and "expert_naming" not in fused.spec
    assert shardsync.Plan.from_spec(routed.spec).hash == routed.hash
    names = [p.name for p in routed.shard_map().rank(1, 0).params if ".experts." in p.name]
    assert names and all(".experts.routed_experts.w" in n for n in names)
    with pytest.raises(shardsync.InvalidArgumentError, match="vLLM's \\(>= 0.24\\) naming"):
        shardsync.Plan(str(tmp_path), "fsdp=2", "dp=1,tp=2,pp=1", engine="sglang",
                       expert_naming="routed_experts")


def test_sglang_facts_from_an_older_args_dict_leave_missing_sizes_unknown(need_plan, tiny_model):
    """Older SGLang's schedule_batch.global_server_args_dict holds only GLOBAL_SERVER_ARGS_KEYS
    (no tp_size / pp_size / ep_size): those facts are unknown, not 1, so a tp=2 plan is not
    refused for a field the engine never stated (the per-parameter checks still run); a stated
    size that differs is still refused."""
    plan = _plan(tiny_model, "dp=1,tp=2,pp=1", "sglang")
    facts = sglang_facts({"device": "cuda", "disable_radix_cache": False}, env={})
    assert facts["tp"] is None and facts["pp"] is None and facts["ep"] is None
    check_layout("sglang", plan, facts)
    with pytest.raises(shardsync.Error, match="tp_size=4"):
        check_layout("sglang", plan, sglang_facts({"tp_size": 4}, env={}))
