"""Megatron-Core trainers bound with `bind_trainer(session, model_chunks, layout="megatron")`.

Each trainer rank builds fake Megatron model chunks: torch modules whose `named_parameters()`
give Megatron-Core's local names (wrapped in `module.` as DDP / Float16Module wrap them), their
values packed from the HF tensors by a Megatron packing written here from Megatron's own rules
(docs/megatron.md: fused QKV interleaved per query group, SwiGLU fc1 [gate_r; up_r], row-parallel
proj / fc2, padded vocab, layers per pipeline stage and model chunk), not from the trainer map.
The chunks are synced through real sessions (loopback, one thread per rank) and every engine
element is compared with the HF value it was cut from.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import shardsync
from conftest import TINY_CONFIG, expected_param, reference_weights

TOKEN = "megatron-test-token-0123"


def megatron_chunks(plan, rank, full, torch, tp, pp, vpp=1, vocab_div=128):
    """Rank `rank`'s model chunks as Megatron-Core lays them out, for the dense TINY_CONFIG
    (Qwen2: qkv bias, untied output layer, TE fused norms), as {local name: tensor} per chunk."""
    c = TINY_CONFIG
    H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n_heads, n_groups = c["num_attention_heads"], c["num_key_value_heads"]
    hn, inter = H // n_heads, c["intermediate_size"]
    t, p = rank % tp, rank // tp  # RankGenerator order tp-cp-ep-dp-pp with cp = dp = 1
    assert plan.trainer_coords(rank)["tp"] == t and plan.trainer_coords(rank)["pp"] == p
    vp = math.ceil(V / (vocab_div * tp)) * vocab_div * tp  # vocab_size_with_padding

    def f(name):
        return torch.from_numpy(full[name])

    def rows(x, parts, i):
        n = x.shape[0] // parts
        return x[i * n:(i + 1) * n]

    def padded(x):  # vocab rows past V hold garbage: they must never be read
        return torch.cat([x, torch.full((vp - V, H), float("nan"))])

    def qkv(layer, suffix):
        q, k, v = (f(f"model.layers.{layer}.self_attn.{n}_proj.{suffix}") for n in "qkv")
        per = n_heads // n_groups
        groups = []
        for g in range(n_groups):  # [q heads of the group | k | v], hn rows each
            groups += [q[g * per * hn:(g + 1) * per * hn], k[g * hn:(g + 1) * hn],
                       v[g * hn:(g + 1) * hn]]
        return rows(torch.cat(groups), tp, t)

    per_chunk = L // pp // vpp
    chunks = []
    for v in range(vpp):
        d = {}
        first = v * (L // vpp) + p * per_chunk  # get_transformer_layer_offset
        if v == 0 and p == 0:
            d["embedding.word_embeddings.weight"] = rows(padded(f("model.embed_tokens.weight")),
                                                         tp, t)
        for i in range(per_chunk):
            g, pre = first + i, f"decoder.layers.{i}."
            hf = f"model.layers.{g}."
            d[pre + "self_attention.linear_proj.weight"] = (
                f(hf + "self_attn.o_proj.weight").chunk(tp, dim=1)[t])
            d[pre + "self_attention.linear_qkv.layer_norm_weight"] = f(
                hf + "input_layernorm.weight")
            d[pre + "self_attention.linear_qkv.weight"] = qkv(g, "weight")
            d[pre + "self_attention.linear_qkv.bias"] = qkv(g, "bias")
            d[pre + "mlp.linear_fc1.layer_norm_weight"] = f(hf + "post_attention_layernorm.weight")
            d[pre + "mlp.linear_fc1.weight"] = torch.cat(
                [rows(f(hf + "mlp.gate_proj.weight"), tp, t), rows(f(hf + "mlp.up_proj.weight"), tp, t)])
            d[pre + "mlp.linear_fc2.weight"] = f(hf + "mlp.down_proj.weight").chunk(tp, dim=1)[t]
        if v == vpp - 1 and p == pp - 1:
            d["decoder.final_layernorm.weight"] = f("model.norm.weight")
            d["output_layer.weight"] = rows(padded(f("lm_head.weight")), tp, t)
        chunks.append({k: x.contiguous().clone() for k, x in d.items()})
    return chunks


def as_module(torch, params, wrappers=1):
    """A torch module tree whose named_parameters() are `params`' names, under `wrappers`
    levels of `module.` (DDP, Float16Module)."""
    root = torch.nn.Module()
    for name, value in params.items():
        node = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=True))
    for _ in range(wrappers):
        outer = torch.nn.Module()
        outer.add_module("module", root)
        root = outer
    return root


@pytest.mark.parametrize("layout", [
    dict(tp=2, pp=2), dict(tp=2, pp=2, vpp=2), dict(tp=1, pp=2, vocab_div=1)])
def test_bind_trainer_megatron_syncs_every_element(need_session, tiny_model, layout):
    torch = pytest.importorskip("torch")
    spec = ",".join(f"{k}={v}" for k, v in layout.items())
    plan = shardsync.Plan(tiny_model, f"megatron={spec}", "dp=1,tp=2,pp=2", engine="sglang",
                          wire_dtype="f32", trainer_dtype="f32", bucket_bytes=16 << 10)
    full = reference_weights(plan, seed=4)
    hub = shardsync.LoopbackHub()
    out, errors = {}, {}
    with shardsync.StoreServer(token=TOKEN) as srv:

        def body(r):
            try:
                with shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                       hub=hub, connect_timeout=30, sync_timeout=30) as s:
                    keep = {}
                    if s.is_trainer:
                        chunks = megatron_chunks(plan, r, full, torch, **layout)
                        # Chunk 0 behind DDP and Float16Module, the others behind DDP.
                        modules = [as_module(torch, c, 2 if i == 0 else 1)
                                   for i, c in enumerate(chunks)]
                        src = shardsync.bind_trainer(s, modules, layout="megatron")
                        assert src.rank == r and not src.ignored
                        assert len(src.tensors) == len(plan.trainer_params(r))
                    else:
                        for p in s.expected_params():
                            keep[p.name] = torch.full(tuple(p.shape), float("nan"))
                        shardsync.bind_engine(s, keep.items())
                    s.connect()
                    rep = s.sync(1)
                    out[r] = (rep, {n: t.numpy().copy() for n, t in keep.items()}, s.is_trainer)
            except Exception as e:  # noqa: BLE001 - reported below, per rank
                errors[r] = e

        threads = [threading.Thread(target=body, args=(r,)) for r in range(plan.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    checked = 0
    sm = plan.shard_map()
    for r, (rep, bufs, is_trainer) in out.items():
        assert rep["verified"], rep
        if is_trainer:
            continue
        d = plan.describe_rank(r)
        for q in sm.rank(d["tp_rank"], d["pp_rank"]).params:
            np.testing.assert_array_equal(bufs[q.name], expected_param(q, full), err_msg=q.name)
            checked += bufs[q.name].size
    assert checked == sum(int(np.prod(q.shape)) for rk in sm.ranks for q in rk.params)


def test_megatron_sources_name_the_first_mismatch(need_plan, tiny_model):
    torch = pytest.importorskip("torch")
    plan = shardsync.Plan(tiny_model, "megatron=tp=2,pp=2,vpp=2", "dp=1,tp=2,pp=2")
    full = reference_weights(plan)
    chunks = megatron_chunks(plan, 3, full, torch, tp=2, pp=2, vpp=2)
    ok = shardsync.megatron_sources(plan, [as_module(torch, c) for c in chunks], rank=3)
    assert {c for c, _ in ok.tensors} == {0, 1}
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"

    def check(mutate, err, match, **kw):
        cs = [dict(c) for c in chunks]
        mutate(cs)
        with pytest.raises(err, match=match):
            shardsync.megatron_sources(plan, [as_module(torch, c) for c in cs], rank=3, **kw)

    def shape(cs):
        cs[1][qkv] = cs[1][qkv][:-1]

    rows, cols = chunks[1][qkv].shape
    check(shape, shardsync.InvalidArgumentError,
          rf"'{qkv}' \(chunk 1\).*shape \[{rows - 1}, {cols}\].*says \[{rows}, {cols}\]")

    def dtype(cs):
        cs[0][qkv] = cs[0][qkv].to(torch.bfloat16)

    check(dtype, shardsync.InvalidArgumentError, r"\(chunk 0\): dtype BF16.*F32")

    def missing(cs):
        del cs[1]["output_layer.weight"]

    check(missing, shardsync.NotFoundError, "chunk 1: output_layer.weight")

    def extra(cs):
        cs[0]["decoder.layers.0.mlp.linear_fc1.bias"] = torch.zeros(64)

    check(extra, shardsync.InvalidArgumentError, "chunk 0: decoder.layers.0.mlp.linear_fc1.bias")

    def drop_chunk(cs):
        cs.pop()

    check(drop_chunk, shardsync.InvalidArgumentError, "holds 2 model chunk")
    cs = [dict(c) for c in chunks]
    extra(cs)
    src = shardsync.megatron_sources(plan, [as_module(torch, c) for c in cs], rank=3,
                                     ignore_extra=True)
    assert src.ignored == ["chunk 0: decoder.layers.0.mlp.linear_fc1.bias"]
    fsdp = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=2")
    with pytest.raises(shardsync.InvalidArgumentError, match="not a Megatron layout"):
        shardsync.megatron_sources(fsdp, chunks, rank=0)


def test_megatron_session_bind_source_by_local_name(need_session, tiny_model):
    """Session.bind_source on a Megatron rank takes local names and chunks; HF names, regions
    and wrong chunks are refused, naming the parameter."""
    plan = shardsync.Plan(tiny_model, "megatron=tp=2,pp=2,vpp=2", "dp=1,tp=2,pp=1")
    with shardsync.StoreServer(token=TOKEN) as srv:
        with shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback",
                               hub=shardsync.LoopbackHub()) as s:
            expected = s.expected_sources()
            assert [(p.chunk, p.name) for p in expected] == [
                (p.chunk, p.name) for p in plan.trainer_params(0)]
            p = next(q for q in expected if q.chunk == 1 and q.name.endswith("linear_qkv.weight"))
            a = np.zeros(list(p.shape), np.float32)
            with pytest.raises(shardsync.InvalidArgumentError, match="region must be None"):
                s.bind_source(p.name, a, region=([0, 0], list(p.shape)), chunk=1)
            with pytest.raises(shardsync.InvalidArgumentError, match=r"not a local parameter"):
                s.bind_source("model.embed_tokens.weight", a)
            rows, cols = p.shape
            with pytest.raises(shardsync.InvalidArgumentError,
                               match=rf"\(chunk 0\): shape \[{rows - 1}, {cols}\].*\[{rows}, {cols}\]"):
                s.bind_source(p.name, np.zeros([rows - 1, cols], np.float32))
            s.bind_source(p.name, a, chunk=1)
            with pytest.raises(shardsync.InvalidArgumentError, match="bound twice"):
                s.bind_source(p.name, a, chunk=1)
