"""Block FP8 from Python (docs/fp8.md): Plan(quant=...) and a config's quantization_config, the
FP8 summary and outline, layouts the engines refuse named at construction, and a sync through
Python sessions (one thread per rank, loopback) whose every e4m3 byte and scale is compared with
a numpy reference of the engines' block quantizer (conftest.fp8_quantize, after
vllm/utils/deep_gemm.py per_block_cast_to_fp8)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import shardsync
from conftest import fp8_quantize as quantize

TOKEN = "test-token-0123456789"

FP8_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 768,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
    "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("fp8-model")
    cfg = dict(FP8_QWEN3, quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": [128, 128]})
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _bind_fsdp_shards(plan, r, s, full, keep):
    """An FSDP trainer rank: its dim-0 slab of every HF tensor."""
    for n, a in full.items():
        reg = plan.held_region(r, a.shape)
        if reg.numel:
            keep[n] = np.ascontiguousarray(a[reg.slices()])
            s.bind_source(n, keep[n])


def _bind_megatron_params(plan, r, s, full, keep):
    """A Megatron trainer rank: its local parameters, filled from the HF tensors they hold."""
    for p in plan.trainer_params(r):
        t = np.full(p.shape, np.nan, np.float32)  # padding: never read
        for pc in p.pieces:
            t[pc.local.slices()] = full[pc.source][pc.src.slices()]
        keep[(p.chunk, p.name)] = t
        s.bind_source(p.name, t, chunk=p.chunk)


def _run_sessions(plan, bind_trainer, full, versions, before=None):
    """One thread per rank over loopback: bind (trainers by `bind_trainer`, engines to arrays
    filled with junk), connect, then sync each of `versions`. Before each sync the main thread
    runs `before(v, params, trainers)` while every rank waits. Returns (params, trainers,
    reports): `params[rank] = (expected_params, bound arrays)` of engines, `trainers[rank]` the
    bound arrays, `reports[v][rank]` each sync's report."""
    params, errors, reports, trainers = {}, {}, {}, {}
    with shardsync.StoreServer(token=TOKEN) as srv:
        ready = threading.Barrier(plan.world_size + 1)
        go = threading.Barrier(plan.world_size + 1)

        def body(r):
            try:
                s = shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                      connect_timeout=60, sync_timeout=60)
                keep = {}
                if s.is_trainer:
                    bind_trainer(plan, r, s, full, keep)
                    trainers[r] = keep
                else:
                    for p in s.expected_params():
                        dt = {"F8_E4M3": np.uint8}.get(p.dtype, np.float32)
                        keep[p.name] = np.full(p.shape, 0xA5 if dt == np.uint8 else np.nan, dt)
                    shardsync.bind_engine(s, keep.items())
                    params[r] = (s.expected_params(), keep)
                s.connect()
                for v in versions:
                    ready.wait(60)
                    go.wait(60)
                    reports.setdefault(v, {})[r] = s.sync(v)
                s.close()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[r] = e
                ready.abort()
                go.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(plan.world_size)]
        for t in threads:
            t.start()
        try:
            for v in versions:
                ready.wait(60)
                if before:
                    before(v, params, trainers)
                go.wait(60)
        except threading.BrokenBarrierError:
            pass  # a rank failed: its error is reported below
        except BaseException:  # a failed check in `before` releases the ranks, then propagates
            ready.abort()
            go.abort()
            raise
        finally:
            for t in threads:
                t.join(120)
    assert not errors, errors
    return params, trainers, reports


def _sync_and_check(plan, bind_trainer, seed):
    """One sync of random fp32 weights; then every engine element against the HF value, every
    e4m3 byte and scale against the reference quantizer."""
    rng = np.random.default_rng(seed)
    full = {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s, _ in plan.hf_tensors()}
    params, _, _ = _run_sessions(plan, bind_trainer, full, [1])
    _check_landed(params, full)


def _check_landed(params, full):
    """Every engine element against the HF value `full`, every e4m3 byte and scale against the
    reference quantizer; `params[rank] = (expected_params, bound arrays)`."""
    ref, checked = {}, 0
    for expected, keep in params.values():
        for p in expected:
            for pc in p.pieces:
                scale = p.name.endswith("weight_scale_inv")
                w = pc.source[: -len("_scale_inv")] if scale else pc.source
                if p.dtype == "F8_E4M3" or scale:
                    ref.setdefault(w, quantize(full[w]))
                    want = ref[w][1 if scale else 0][pc.src.slices()]
                else:
                    want = full[pc.source][pc.src.slices()]
                have = keep[p.name][pc.dst.slices()].reshape(want.shape)
                if want.dtype == np.float32:
                    assert np.array_equal(have.view(np.uint32), want.view(np.uint32)), p.name
                else:
                    assert np.array_equal(have, want), (p.name, int((have != want).sum()))
                checked += want.size
    assert checked > 0


# ---- tests ----

def test_plan_quant_summary_outline_and_refusals(need_plan, fp8_model, tiny_model):
    plan = shardsync.Plan(fp8_model, "fsdp=2", "dp=1,tp=2,pp=1", trainer_dtype="bf16")
    assert plan.quant == "fp8 e4m3 128x128"
    q = plan.summary()["quant"]
    assert q["sender_quantized_elements"] > 0 and q["bound_write_bytes"] > 0
    assert "broadcast_recv_bytes_per_rank" not in plan.summary()
    rp = plan.rank_plan(plan.engine_rank(0, 0))
    assert sum(m.bytes for m in rp.recvs) > 0
    # --quant none plans the model dtype; the flag rides in the spec.
    bf16 = shardsync.Plan(fp8_model, "fsdp=2", "dp=1,tp=2,pp=1", quant="none")
    assert bf16.quant is None and bf16.hash != plan.hash
    assert "broadcast_recv_bytes_per_rank" in bf16.summary()
    assert shardsync.Plan.from_spec(bf16.spec).hash == bf16.hash
    flagged = shardsync.Plan(fp8_model, "fsdp=2", "dp=1,tp=1,pp=1", quant="fp8-block128")
    assert flagged.spec["quant"] == "fp8-block128"
    assert shardsync.Plan.from_spec(flagged.spec).hash == flagged.hash
    # A shard off the 128 grid: refused at construction, naming the tensor (the tiny model's
    # 16-wide heads: every fused qkv part must be whole blocks).
    with pytest.raises(shardsync.InvalidArgumentError, match="qkv_proj.weight"):
        shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=1,pp=1", quant="fp8-block128")
    with pytest.raises(shardsync.InvalidArgumentError, match="quant: unknown value"):
        shardsync.Plan(fp8_model, "fsdp=2", "dp=1,tp=2,pp=1", quant="int4")
    with pytest.raises(shardsync.InvalidArgumentError, match="fp8_split"):
        shardsync.Plan(fp8_model, "fsdp=2", "dp=1,tp=2,pp=1", fp8_split="gather")


@pytest.mark.parametrize("split", ["amax", "stage"])
def test_sync_lands_the_quantizers_bytes(need_session, fp8_model, split):
    if "loopback" not in shardsync.native().transports():
        pytest.skip("loopback transport not built")
    # fsdp=4: gate/up (768 rows) straddle trainer ranks, so both paths run: blocks quantized by
    # their sender and blocks shared by trainer ranks, quantized by their holders with the amax
    # they exchange (the default split) or by the engine rank from staged raw values.
    spec = dict(model=fp8_model, trainer="fsdp=4", rollout="dp=1,tp=2,pp=1", engine="vllm",
                wire_dtype="f32", trainer_dtype="f32", bucket_bytes=256 << 10)
    if split != "amax":
        spec["fp8_split"] = split
    plan = shardsync.Plan.from_spec(spec)
    assert plan.fp8_split == split
    assert shardsync.Plan.from_spec(plan.spec).hash == plan.hash
    q = plan.summary()["quant"]
    assert q["sender_quantized_elements"] > 0
    if split == "amax":
        assert q["amax_elements"] > 0 and q["receiver_quantized_elements"] == 0
    else:
        assert q["amax_elements"] == 0 and q["receiver_quantized_elements"] > 0
    _sync_and_check(plan, _bind_fsdp_shards, seed=7)


def test_megatron_trainer_quantizes_from_its_local_parameters(need_session, fp8_model):
    """Megatron-Core trainers (docs/fp8.md): each rank binds its local parameters
    (linear_qkv's interleaved groups, linear_fc1's [gate; up]) and quantizes whole blocks from
    them; every e4m3 byte and scale equals the reference quantizer's. Shards that cut a block
    are refused at construction naming the tensor and the Megatron rank."""
    if "loopback" not in shardsync.native().transports():
        pytest.skip("loopback transport not built")
    plan = shardsync.Plan(fp8_model, "megatron=tp=2,pp=2", "dp=1,tp=2,pp=2", engine="sglang",
                          wire_dtype="f32", trainer_dtype="f32", bucket_bytes=256 << 10)
    q = plan.summary()["quant"]
    assert q["sender_quantized_elements"] > 0 and q["receiver_quantized_elements"] == 0
    _sync_and_check(plan, _bind_megatron_params, seed=11)
    with pytest.raises(shardsync.InvalidArgumentError,
                       match=r"Megatron rank 0 holds rows \[0, 192\).*gate_proj\.weight"):
        shardsync.Plan(fp8_model, "megatron=tp=4", "dp=1,tp=1,pp=1")


def test_delta_syncs_of_small_updates_land_the_quantizers_bytes(need_session, fp8_model):
    """Issue 35: block FP8 under encoding delta. The engine rebuilds each bucket's base from its
    e4m3 codes, scales and copies; after every sync every byte equals the reference quantizer's of
    the updated masters, and a corrupted e4m3 byte sends its bucket whole in the same sync."""
    if "loopback" not in shardsync.native().transports():
        pytest.skip("loopback transport not built")
    plan = shardsync.Plan.from_spec(dict(
        model=fp8_model, trainer="fsdp=4", rollout="dp=1,tp=2,pp=1", engine="vllm",
        wire_dtype="f32", trainer_dtype="f32", bucket_bytes=64 << 10, encoding="delta"))
    rng = np.random.default_rng(3)
    full = {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s, _ in plan.hf_tensors()}

    def before(v, params, trainers):
        if v > 1:  # what the last sync landed, then 1% of the masters move by a few steps
            _check_landed(params, full)
            for a in full.values():
                mask = rng.random(a.shape) < 0.01
                a[mask] = a[mask] * (1 + 1 / 16) + 1e-3
            for r, keep in trainers.items():
                for n, t in keep.items():
                    t[...] = full[n][plan.held_region(r, full[n].shape).slices()]
        if v == 3:  # one e4m3 code corrupted behind the session's back
            _, keep = params[max(params)]
            name = next(n for n, a in sorted(keep.items()) if a.dtype == np.uint8)
            keep[name].reshape(-1)[0] ^= 0x10

    params, _, reports = _run_sessions(plan, _bind_fsdp_shards, full, range(1, 5), before)
    _check_landed(params, full)
    assert reports[1][0]["delta"]["buckets_delta"] == 0
    for v in (2, 3, 4):
        d = reports[v][0]["delta"]
        assert d["buckets_delta"] > 0 and d["wire_bytes"] < d["full_bytes"], (v, d)
        assert sum(d["fallbacks"].values()) == (1 if v == 3 else 0), (v, d)
    assert reports[3][0]["delta"]["fallbacks"]["base_checksum_differs"] == 1
    assert all(rep["verified"] for per in reports.values() for rep in per.values())
