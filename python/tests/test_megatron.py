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

import dataclasses
import json
import math
import threading
from typing import Any, Optional

import numpy as np
import pytest

import shardsync
from conftest import TINY_CONFIG, expected_param, reference_weights

TOKEN = "megatron-test-token-0123"


# A small Qwen3-MoE (qk-norm, no qkv bias, 4 experts, layer 1 dense) for the expert rules.
TINY_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": True,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4,
    "vocab_size": 200, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-moe")
    (d / "config.json").write_text(json.dumps(TINY_MOE_CONFIG))
    return str(d)


def rank_coords(rank, tp=1, pp=1, cp=1, dp=None, ep=1, etp=None, order="tp-cp-ep-dp-pp",
                world=None):
    """A rank's (dense, expert) coordinates as megatron/core/parallel_state.py's RankGenerator
    numbers them (generate_masked_orthogonal_rank_groups: the first token of `order` varies
    fastest; the dense generator has ep 1, the expert one tp=etp, cp 1, dp=world/(etp*ep*pp)).
    `order` "tp-cp-ep-pp-dp" is what training/initialize.py passes for --use-tp-pp-dp-mapping."""
    etp = tp if etp is None else etp
    world = world or tp * cp * (dp or 1) * pp
    dp = world // (tp * cp * pp)
    edp = world // (etp * ep * pp)

    def split(sizes):
        out, r = {}, rank
        for k in order.split("-"):
            out[k] = r % sizes[k]
            r //= sizes[k]
        return out

    d = split(dict(tp=tp, cp=cp, ep=1, dp=dp, pp=pp))
    e = split(dict(tp=etp, cp=1, ep=ep, dp=edp, pp=pp))
    return dict(tp=d["tp"], cp=d["cp"], dp=d["dp"], pp=d["pp"], etp=e["tp"], ep=e["ep"],
                edp=e["dp"])


def megatron_chunks(plan, rank, full, torch, tp, pp, vpp=1, vocab_div=128, config=None,
                    coords=None, ep=1, etp=None, norms="te", experts="grouped", glu=0, **_):
    """Rank `rank`'s model chunks as Megatron-Core lays them out, as {local name: tensor} per
    chunk: TINY_CONFIG (Qwen2: qkv bias, untied output layer) or TINY_MOE_CONFIG (Qwen3-MoE:
    q/k layernorm, experts). `coords` (default: the layout's own, from rank_coords) say which
    stage / tp / expert slice the rank holds. Written from Megatron's rules, not the trainer map:
    - names: models/gpt/gpt_layer_specs.py (TE spec: linear_qkv.layer_norm_weight and
      mlp.linear_fc1.layer_norm_weight fused; local spec, get_gpt_layer_local_submodules:
      input_layernorm / pre_mlp_layernorm modules); MoE layers keep pre_mlp_layernorm;
    - experts: transformer/moe/experts.py TEGroupedMLP linear_fc1.weight{i} (with
      moe_mlp_glu_interleave_size G its rows are [gate G | up G] blocks: the inverse of
      _remove_glu_interleaving), SequentialMLP local_experts.{i}.linear_fc1.weight; local expert
      i of ep rank k is global expert k * E / ep + i (moe_layer.py);
    - fused QKV per query group, SwiGLU [gate_r; up_r], row-parallel proj / fc2, padded vocab,
      layers per stage and chunk (docs/megatron.md, "Rules")."""
    c = config or TINY_CONFIG
    H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n_heads, n_groups = c["num_attention_heads"], c["num_key_value_heads"]
    hn, inter = c.get("head_dim", H // n_heads), c["intermediate_size"]
    moe = "num_experts" in c
    etp = tp if etp is None else etp
    if coords is None:
        coords = plan.trainer_coords(rank)
    t, p = coords["tp"], coords["pp"]
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

    def swiglu(gate, up, parts, i, interleave=0):
        g, u = rows(gate, parts, i), rows(up, parts, i)
        if not interleave:
            return torch.cat([g, u])
        blocks = []
        for b in range(g.shape[0] // interleave):
            blocks += [g[b * interleave:(b + 1) * interleave],
                       u[b * interleave:(b + 1) * interleave]]
        return torch.cat(blocks)

    def is_moe_layer(layer):
        return moe and layer not in c.get("mlp_only_layers", [])

    te = norms == "te"
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
            if not te:
                d[pre + "input_layernorm.weight"] = f(hf + "input_layernorm.weight")
            d[pre + "self_attention.linear_proj.weight"] = (
                f(hf + "self_attn.o_proj.weight").chunk(tp, dim=1)[t])
            if te:
                d[pre + "self_attention.linear_qkv.layer_norm_weight"] = f(
                    hf + "input_layernorm.weight")
            d[pre + "self_attention.linear_qkv.weight"] = qkv(g, "weight")
            if not moe:
                d[pre + "self_attention.linear_qkv.bias"] = qkv(g, "bias")
            else:
                d[pre + "self_attention.q_layernorm.weight"] = f(hf + "self_attn.q_norm.weight")
                d[pre + "self_attention.k_layernorm.weight"] = f(hf + "self_attn.k_norm.weight")
            post_norm = f(hf + "post_attention_layernorm.weight")
            if not is_moe_layer(g):
                if te:
                    d[pre + "mlp.linear_fc1.layer_norm_weight"] = post_norm
                else:
                    d[pre + "pre_mlp_layernorm.weight"] = post_norm
                d[pre + "mlp.linear_fc1.weight"] = swiglu(
                    f(hf + "mlp.gate_proj.weight"), f(hf + "mlp.up_proj.weight"), tp, t)
                d[pre + "mlp.linear_fc2.weight"] = (
                    f(hf + "mlp.down_proj.weight").chunk(tp, dim=1)[t])
                continue
            d[pre + "pre_mlp_layernorm.weight"] = post_norm
            d[pre + "mlp.router.weight"] = f(hf + "mlp.gate.weight")
            n = c["num_experts"] // ep
            for e in range(n):
                x = f"{hf}mlp.experts.{coords['ep'] * n + e}."
                fc1 = swiglu(f(x + "gate_proj.weight"), f(x + "up_proj.weight"), etp,
                             coords["etp"], glu if experts == "grouped" else 0)
                fc2 = f(x + "down_proj.weight").chunk(etp, dim=1)[coords["etp"]]
                if experts == "sequential":
                    d[pre + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
                    d[pre + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
                else:
                    d[pre + f"mlp.experts.linear_fc1.weight{e}"] = fc1
                    d[pre + f"mlp.experts.linear_fc2.weight{e}"] = fc2
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


def sync_and_check(plan, full, make_modules, bind_kw=lambda rank: {}):
    """Every sync rank in a thread over loopback: trainers bind make_modules(rank) with
    bind_trainer(..., layout="megatron", **bind_kw(rank)), engines bind NaN buffers; after one
    sync every engine element must equal its HF value. Returns the elements checked."""
    torch = pytest.importorskip("torch")
    hub = shardsync.LoopbackHub()
    out, errors = {}, {}
    with shardsync.StoreServer(token=TOKEN) as srv:

        def body(r):
            try:
                with shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                       hub=hub, connect_timeout=30, sync_timeout=30) as s:
                    keep = {}
                    if s.is_trainer:
                        src = shardsync.bind_trainer(s, make_modules(r), layout="megatron",
                                                     **bind_kw(r))
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
    return checked


@pytest.mark.parametrize("layout", [
    dict(tp=2, pp=2), dict(tp=2, pp=2, vpp=2), dict(tp=1, pp=2, vocab_div=1)])
def test_bind_trainer_megatron_syncs_every_element(need_session, tiny_model, layout):
    torch = pytest.importorskip("torch")
    spec = ",".join(f"{k}={v}" for k, v in layout.items())
    plan = shardsync.Plan(tiny_model, f"megatron={spec}", "dp=1,tp=2,pp=2", engine="sglang",
                          wire_dtype="f32", trainer_dtype="f32", bucket_bytes=16 << 10)
    full = reference_weights(plan, seed=4)

    def modules(r):
        chunks = megatron_chunks(plan, r, full, torch, **layout)
        # Chunk 0 behind DDP and Float16Module, the others behind DDP.
        return [as_module(torch, c, 2 if i == 0 else 1) for i, c in enumerate(chunks)]

    sync_and_check(plan, full, modules)


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


# ---- what bind reads from Megatron's own objects (megatron_checks.py) ----
# Fakes mirroring NVIDIA/Megatron-LM main at d98e8a6 (2026-08): the TransformerConfig fields bind
# reads, GPTModel's attributes, and megatron.core.parallel_state's getters.

@dataclasses.dataclass
class TransformerConfig:
    """The fields of megatron/core/transformer/transformer_config.py TransformerConfig (and its
    base model_parallel_config.py ModelParallelConfig) that bind reads, with Megatron's
    defaults (gated_linear_unit False: Qwen / Llama models set it)."""

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: Any = None
    layernorm_zero_centered_gamma: bool = False  # --apply-layernorm-1p
    gated_linear_unit: bool = False
    num_moe_experts: Optional[int] = None
    moe_mlp_glu_interleave_size: Optional[int] = None
    moe_single_grouped_weight: bool = False


def config_for(hf, **kw):
    """A TransformerConfig as Megatron-Bridge's providers fill it from an HF config
    (models/qwen/qwen3_moe_bridge.py provider_bridge: num_layers, hidden_size, heads,
    num_moe_experts; gated_linear_unit for SwiGLU)."""
    base = dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                num_attention_heads=hf["num_attention_heads"], gated_linear_unit=True,
                num_moe_experts=hf.get("num_experts"))
    base.update(kw)
    return TransformerConfig(**base)


def gpt_model(torch, params, config, vp_stage=None, wrappers=1):
    """A module tree like megatron/core/models/gpt/gpt_model.py GPTModel: `config` (the
    TransformerConfig, MegatronModule.__init__), `vp_stage`, `pre_process` / `post_process`,
    parameters under Megatron's local names, behind `wrappers` levels of `module.` (DDP,
    Float16Module)."""
    root = as_module(torch, params, wrappers=0)
    root.config = config
    root.vp_stage = vp_stage
    root.pre_process = "embedding.word_embeddings.weight" in params
    root.post_process = "decoder.final_layernorm.weight" in params
    for _ in range(wrappers):
        outer = torch.nn.Module()
        outer.add_module("module", root)
        root = outer
    return root


class FakeParallelState:
    """megatron/core/parallel_state.py as one rank sees it after initialize_model_parallel(...,
    order=...): model_parallel_is_initialized and the get_*_rank / get_*_world_size getters bind
    reads, coordinates numbered as its RankGenerator numbers them (rank_coords above)."""

    def __init__(self, rank, tp=1, pp=1, cp=1, dp=1, ep=1, etp=None, vpp=None,
                 order="tp-cp-ep-dp-pp"):
        etp = tp if etp is None else etp
        world = tp * pp * cp * dp
        self.c = rank_coords(rank, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp, order=order)
        self.s = dict(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp, edp=world // (etp * ep * pp))
        self.vpp = vpp

    def model_parallel_is_initialized(self):
        return True

    def get_virtual_pipeline_model_parallel_world_size(self):
        return self.vpp  # None without virtual pipeline stages, as in Megatron


for _key, _name in (("tp", "tensor_model_parallel"), ("pp", "pipeline_model_parallel"),
                    ("cp", "context_parallel"), ("dp", "data_parallel"),
                    ("ep", "expert_model_parallel"), ("etp", "expert_tensor_parallel"),
                    ("edp", "expert_data_parallel")):
    setattr(FakeParallelState, f"get_{_name}_rank", lambda self, k=_key: self.c[k])
    setattr(FakeParallelState, f"get_{_name}_world_size", lambda self, k=_key: self.s[k])


MOE_LAYOUTS = [
    # TEGroupedMLP with moe_mlp_glu_interleave_size 8: supported, the trainer map reads the blocks.
    (dict(tp=2, pp=2, ep=2, etp=1, glu=8), "tp=2,pp=2,ep=2,etp=1,glu_interleave=8"),
    # The local spec: SequentialMLP experts, implied by norms=local.
    (dict(tp=2, pp=2, ep=2, etp=1, norms="local", experts="sequential"),
     "tp=2,pp=2,ep=2,etp=1,norms=local"),
]


@pytest.mark.parametrize("layout,spec", MOE_LAYOUTS)
def test_moe_chunks_with_their_config_and_parallel_state_sync_every_element(
        need_session, tiny_moe, layout, spec):
    torch = pytest.importorskip("torch")
    plan = shardsync.Plan(tiny_moe, f"megatron={spec}", "dp=1,tp=2,pp=2", engine="sglang",
                          wire_dtype="f32", trainer_dtype="f32", bucket_bytes=16 << 10)
    full = reference_weights(plan, seed=7)
    cfg = config_for(TINY_MOE_CONFIG, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                     expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                     moe_mlp_glu_interleave_size=layout.get("glu") or None)

    def modules(r):
        chunks = megatron_chunks(plan, r, full, torch, config=TINY_MOE_CONFIG, **layout)
        return [gpt_model(torch, c, cfg) for c in chunks]

    # Each trainer rank reads its own parallel state, as each Megatron process would.
    checked = sync_and_check(plan, full, modules, bind_kw=lambda r: dict(
        parallel_state=FakeParallelState(r, tp=2, pp=2, ep=2, etp=1)))
    assert checked > 0


def test_each_meaning_changing_setting_is_supported_or_refused_by_name(need_plan, tiny_moe):
    torch = pytest.importorskip("torch")
    spec = "tp=2,pp=2,ep=2,etp=1"
    plan = shardsync.Plan(tiny_moe, f"megatron={spec}", "dp=1,tp=2,pp=2")
    full = reference_weights(plan)
    base = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    ps = FakeParallelState(1, tp=2, pp=2, ep=2, etp=1)

    def bind(p=plan, rank=1, glu=0, norms="te", experts="grouped", **cfg_kw):
        chunks = megatron_chunks(p, rank, full, torch, config=TINY_MOE_CONFIG, tp=2, pp=2, ep=2,
                                 etp=1, glu=glu, norms=norms, experts=experts)
        cfg = config_for(TINY_MOE_CONFIG, **{**base, **cfg_kw})
        return shardsync.megatron_sources(p, [gpt_model(torch, c, cfg) for c in chunks],
                                          rank=rank, parallel_state=ps)

    ok = bind()
    assert ok.config_checked and ok.coords_from == "megatron.core.parallel_state"
    # --apply-layernorm-1p: norms stored as gamma - 1; refused by name.
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"layernorm_zero_centered_gamma \(--apply-layernorm-1p\).*gamma - 1"):
        bind(layernorm_zero_centered_gamma=True)
    # moe_mlp_glu_interleave_size with a layout that does not say so: refused naming both.
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"moe_mlp_glu_interleave_size is 8.*\[gate 8 \| up 8\].*"
                             r"no glu_interleave: set glu_interleave=8"):
        bind(glu=8, moe_mlp_glu_interleave_size=8)
    # ... and supported once the layout says it (the sync test above checks every element).
    glu_plan = shardsync.Plan(tiny_moe, f"megatron={spec},glu_interleave=8", "dp=1,tp=2,pp=2")
    bind(p=glu_plan, glu=8, moe_mlp_glu_interleave_size=8)
    with pytest.raises(shardsync.InvalidArgumentError, match="drop glu_interleave"):
        bind(p=glu_plan, glu=8)
    # A custom pipeline layout / embedding-as-layer moves layers between stages: refused.
    with pytest.raises(shardsync.InvalidArgumentError, match="pipeline_model_parallel_layout"):
        bind(pipeline_model_parallel_layout="Et|tL")
    with pytest.raises(shardsync.InvalidArgumentError,
                       match="account_for_embedding_in_pipeline_split"):
        bind(account_for_embedding_in_pipeline_split=True)
    # Parallel sizes from the config against the layout.
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"TransformerConfig.expert_tensor_parallel_size is 2.*etp=1"):
        bind(expert_tensor_parallel_size=2)
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"TransformerConfig.num_layers is 8.*num_hidden_layers 4"):
        bind(num_layers=8)
    # The spec from the modules: local norms against a TE layout, and the other way round.
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"input_layernorm.weight' shows the local spec.*add norms=local"):
        bind(norms="local", experts="sequential")
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"local_experts.0.linear_fc1.weight' shows SequentialMLP"):
        bind(experts="sequential")
    local = shardsync.Plan(tiny_moe, f"megatron={spec},norms=local", "dp=1,tp=2,pp=2")
    bind(p=local, norms="local", experts="sequential")
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"linear_qkv.layer_norm_weight' shows the Transformer-Engine spec"):
        bind(p=local)


def test_legacy_grouped_mlp_is_refused_by_name(need_plan, tiny_moe):
    """Core 0.13-0.16's GroupedMLP (models/backends.py LocalSpecProvider.grouped_mlp_modules with
    moe_grouped_gemm at core_v0.16.0): experts.weight1 [hidden, experts*2*ffn/etp] and weight2
    [experts*ffn/etp, hidden] (experts.py GroupedMLP.__init__)."""
    torch = pytest.importorskip("torch")
    plan = shardsync.Plan(tiny_moe, "megatron=tp=2,pp=2,ep=2,etp=1,norms=local", "dp=1,tp=2,pp=2")
    full = reference_weights(plan)
    chunks = megatron_chunks(plan, 0, full, torch, config=TINY_MOE_CONFIG, tp=2, pp=2, ep=2, etp=1,
                             norms="local", experts="sequential")
    c = {k: v for k, v in chunks[0].items() if "local_experts" not in k}
    c["decoder.layers.0.mlp.experts.weight1"] = torch.zeros(64, 2 * 2 * 32)
    c["decoder.layers.0.mlp.experts.weight2"] = torch.zeros(2 * 32, 64)
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"'decoder.layers.0.mlp.experts.weight1' is the legacy GroupedMLP"):
        shardsync.megatron_sources(plan, [as_module(torch, c)], rank=0)


def test_parallel_state_in_another_rank_order_fails_at_bind_naming_both(need_plan, tiny_model):
    """--use-tp-pp-dp-mapping (training/initialize.py: order 'tp-cp-ep-pp-dp'): rank 2 of tp1 pp4
    dp2 is pipeline stage 2 there, stage 1 in the default order. Both are middle stages with the
    same local names and shapes, so the chunks bind cleanly to the wrong layers unless the
    coordinates are checked."""
    torch = pytest.importorskip("torch")
    plan = shardsync.Plan(tiny_model, "megatron=tp=1,pp=4,dp=2", "dp=1,tp=2,pp=2")
    full = reference_weights(plan)
    theirs = rank_coords(2, tp=1, pp=4, dp=2, order="tp-cp-ep-pp-dp")
    assert theirs["pp"] == 2 and plan.trainer_coords(2)["pp"] == 1
    chunks = megatron_chunks(plan, 2, full, torch, tp=1, pp=4, coords=theirs)
    cfg = config_for(TINY_CONFIG, pipeline_model_parallel_size=4)
    mods = [gpt_model(torch, c, cfg) for c in chunks]
    # Nothing to read the coordinates from: names and shapes match, the danger the check removes.
    assert shardsync.megatron_sources(plan, mods, rank=2, parallel_state=None).coords_from is None
    ps = FakeParallelState(2, tp=1, pp=4, dp=2, order="tp-cp-ep-pp-dp")
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"trainer rank 2: megatron.core.parallel_state places it at "
                             r"\(tp 0, cp 0, dp 0, pp 2, .*\) but the layout megatron=tp=1,pp=4,"
                             r"dp=2 places rank 2 at \(tp 0, cp 0, dp 0, pp 1, .*"
                             r"--use-tp-pp-dp-mapping"):
        shardsync.megatron_sources(plan, mods, rank=2, parallel_state=ps)
    # The default order binds, read from parallel_state; wrong sizes are named.
    good = megatron_chunks(plan, 2, full, torch, tp=1, pp=4)
    ok = shardsync.megatron_sources(plan, [gpt_model(torch, c, cfg) for c in good], rank=2,
                                    parallel_state=FakeParallelState(2, tp=1, pp=4, dp=2))
    assert ok.coords_from == "megatron.core.parallel_state"
    with pytest.raises(shardsync.InvalidArgumentError, match=r"has dp size 4 .* dp=2"):
        shardsync.megatron_sources(plan, [gpt_model(torch, c, cfg) for c in good], rank=2,
                                   parallel_state=FakeParallelState(2, tp=1, pp=2, dp=4))
    # Without parallel_state, the chunk's pg_collection (GPTModel.pg_collection) is read.

    class Group:
        def __init__(self, r, n):
            self.r, self.n = r, n

        def rank(self):
            return self.r

        def size(self):
            return self.n

    pg = type("ProcessGroupCollection", (), {})()
    for k, (r, n) in dict(tp=(0, 1), pp=(2, 4), cp=(0, 1), dp=(0, 2)).items():
        setattr(pg, k, Group(r, n))
    mods[0].module.pg_collection = pg
    with pytest.raises(shardsync.InvalidArgumentError, match=r"the model chunk's pg_collection "
                                                             r"places it at \(tp 0, cp 0, dp 0, "
                                                             r"pp 2\)"):
        shardsync.megatron_sources(plan, mods, rank=2, parallel_state=None)


def test_vp_stage_order_is_checked(need_plan, tiny_model):
    torch = pytest.importorskip("torch")
    plan = shardsync.Plan(tiny_model, "megatron=tp=2,pp=2,vpp=2", "dp=1,tp=2,pp=2")
    full = reference_weights(plan)
    chunks = megatron_chunks(plan, 3, full, torch, tp=2, pp=2, vpp=2)
    cfg = config_for(TINY_CONFIG, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                     virtual_pipeline_model_parallel_size=2)
    mods = [gpt_model(torch, c, cfg, vp_stage=v) for v, c in enumerate(chunks)]
    assert shardsync.megatron_sources(plan, mods, rank=3).config_checked
    with pytest.raises(shardsync.InvalidArgumentError, match=r"model chunk 0 was built for virtual "
                                                             r"pipeline stage 1"):
        shardsync.megatron_sources(plan, mods[::-1], rank=3)
