"""Issue 36, the API a new user meets first: what expected_params() / shard_map() say a rank
binds (the wire dtype), torch dtype names and an allocation helper, bind_engine with a dict,
layouts checked when the Plan is made (Megatron stages, spaces after commas), the engines'
"fp8" spelling, and the plan SVG's engine labels."""

from __future__ import annotations

import json

import numpy as np
import pytest

import shardsync

TOKEN = "test-token-0123456789"


def _engine_session(srv, plan, **kw):
    return shardsync.Session(plan, plan.trainer_world, srv.address, token=TOKEN,
                             transport="loopback", **kw)


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_expected_params_and_shard_map_say_the_wire_dtype(need_session, tiny_model, wire):
    """The tiny model's config says bfloat16; with wire_dtype fp32 both used to say BF16, and
    binding what they described was refused."""
    plan = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", wire_dtype=wire)
    want = {"fp32": "F32", "bf16": "BF16"}[wire]
    with shardsync.StoreServer(token=TOKEN) as srv:
        e = _engine_session(srv, plan)
        params = e.expected_params()
        assert {p.dtype for p in params} == {want}
        assert {p.dtype for p in plan.shard_map().rank(0, 0).params} == {want}
        if want == "F32":  # what they describe binds (numpy has no bfloat16)
            for p in params:
                e.bind_destination(p.name, np.zeros(p.shape, np.float32))
        e.close()
    # The module-level shard_map (no plan, no wire) keeps the model's dtype.
    assert {p.dtype for p in shardsync.shard_map(tiny_model, tp=2).rank(0, 0).params} == {"BF16"}


def test_torch_dtype_names_and_allocate_params(need_session, tiny_model):
    torch = pytest.importorskip("torch")
    plan = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1")
    params = plan.shard_map().rank(1, 0).params
    assert {p.torch_dtype for p in params} == {"bfloat16"}
    tensors = shardsync.allocate_params(params)
    assert list(tensors) == [p.name for p in params]
    for p in params:
        t = tensors[p.name]
        assert list(t.shape) == list(p.shape) and t.dtype == torch.bfloat16
        assert not t.any()
    # bind_engine takes the dict as it is (it used to fail with "too many values to unpack").
    with shardsync.StoreServer(token=TOKEN) as srv:
        e = shardsync.Session(plan, plan.trainer_world + 1, srv.address, token=TOKEN,
                              transport="loopback")
        assert shardsync.bind_engine(e, tensors) == len(params)
        e.close()


def test_megatron_layout_is_checked_when_the_plan_is_made(need_plan, tiny_model):
    # 4 layers cannot make 8 pipeline stages: refused here, naming the trainer layout.
    with pytest.raises(shardsync.InvalidArgumentError, match="not divisible by pp"):
        shardsync.Plan(tiny_model, "megatron=tp=2,pp=8", "dp=1,tp=2,pp=1")
    shardsync.Plan(tiny_model, "megatron=tp=2,pp=2", "dp=1,tp=2,pp=1")  # 2 layers a stage


def test_layouts_take_spaces_after_commas(need_plan, tiny_model):
    a = shardsync.Plan(tiny_model, "fsdp=2", "dp=1, tp=2, pp=1")
    b = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1")
    assert a.hash == b.hash
    m = shardsync.Plan(tiny_model, "megatron=tp=2, pp=2", "dp=1,tp=2,pp=1")
    assert m.hash == shardsync.Plan(tiny_model, "megatron=tp=2,pp=2", "dp=1,tp=2,pp=1").hash


def _config(tmp_path, quant):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 768,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
           "num_hidden_layers": 2, "vocab_size": 300, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    if quant:
        cfg["quantization_config"] = quant
    d = tmp_path / ("q" if quant else "plain")
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_quant_fp8_means_what_the_engines_mean(need_plan, tmp_path):
    """SGLang's / vLLM's `--quantization fp8` is block FP8 when the checkpoint's
    quantization_config has weight_block_size (then quant="fp8" is the config's own), per-tensor
    FP8 otherwise: refused, pointing at fp8-block128."""
    block = _config(tmp_path, {"quant_method": "fp8", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]})
    p = shardsync.Plan(block, "fsdp=1", "dp=1,tp=1,pp=1", quant="fp8")
    assert p.hash == shardsync.Plan(block, "fsdp=1", "dp=1,tp=1,pp=1").hash
    assert p.quant is not None
    plain = _config(tmp_path, None)
    with pytest.raises(shardsync.InvalidArgumentError, match="fp8-block128"):
        shardsync.Plan(plain, "fsdp=1", "dp=1,tp=1,pp=1", quant="fp8")
    q = shardsync.Plan(plain, "fsdp=1", "dp=1,tp=1,pp=1", quant="fp8-block128")
    assert q.quant is not None


def test_svg_labels_engine_columns_by_replica_tp_pp(need_plan, tiny_model):
    svg = shardsync.Plan(tiny_model, "fsdp=2", "dp=2,tp=2,pp=1").svg()
    assert ">r1 tp1 pp0<" in svg and ">e0<" not in svg
