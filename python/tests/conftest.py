"""Shared fixtures: a tiny model config, reference tensors, expected engine parameters."""

from __future__ import annotations

import json
import os
import secrets

import numpy as np
import pytest

import shardsync

# Small enough for a 2-core CI machine, yet exercising fused qkv / gate_up, GQA, vocab padding
# (200 -> 256 rows, zero-filled) and untied lm_head.
TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 200,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# The test run is one launch, as torchrun or `shardsync run` would start its ranks: sessions (and
# the worker processes tests spawn, which inherit it) take this id and secret unless a test passes
# its own; a job of several ranks without a launch identity refuses to connect
# (docs/security.md "Job identity"). Tests of that refusal pass job_id="", job_secret="".
os.environ.setdefault("SHARDSYNC_JOB_ID", f"pytest-{os.getpid()}")
os.environ.setdefault("SHARDSYNC_JOB_SECRET", secrets.token_hex(16))


def _need(part: str) -> None:
    if not shardsync.has_part(part):
        pytest.skip(f"native module built without the {part!r} part")


@pytest.fixture
def need_session():
    _need("session")


@pytest.fixture(autouse=True)
def _fresh_loopback_hub():
    """Each test gets its own process-wide loopback hub, as each engine / trainer process of a
    real job has its own: engine-side sessions of the vLLM native backend live until vLLM shuts
    the backend down (WeightTransferEngine.shutdown), which a test's fake HTTP server never does,
    so a later test joining the same ranks would meet them ("rank 2 already joined this hub")."""
    import shardsync.session as ss_session

    ss_session._default_hub = None
    yield
    ss_session._default_hub = None


@pytest.fixture
def need_plan():
    _need("plan")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-model")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(d)


def reference_weights(plan, seed: int = 0):
    """Full HF tensors (float32) of the plan's model, deterministic per seed."""
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s, _ in plan.hf_tensors()}


def expected_param(param, full, dtype=np.float32):
    """What engine parameter `param` must hold after a sync: its pieces cut from the full HF
    tensors, zeros where it is zero-filled."""
    out = np.full(param.shape, np.nan, dtype=np.float64)
    for pc in param.pieces:
        src = full[pc.source][pc.src.slices()]
        out[pc.dst.slices()] = src.reshape(pc.dst.extent)
    for z in param.zero_fills:
        out[z.slices()] = 0.0
    assert not np.isnan(out).any(), f"{param.name}: pieces do not cover the parameter"
    return out.astype(dtype)


# ---- block FP8: a numpy reference of the engines' block quantizer (docs/fp8.md; independent of
# the library's): amax per 128 x 128 block clamped at 1e-4, scale = amax / 448 (fp32),
# e4m3(x * (1 / scale)) rounded to nearest even, saturating at 448 ----

def _e4m3_values() -> np.ndarray:
    out = []
    for c in range(0x7F):
        e, m = (c >> 3) & 15, c & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


_E4M3 = _e4m3_values()


def _e4m3_encode(v: np.ndarray) -> np.ndarray:
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(_E4M3, a), 0, len(_E4M3) - 1)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = a - _E4M3[lo], _E4M3[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def fp8_quantize(x: np.ndarray):
    """(e4m3 codes as uint8, fp32 block scales) of a float32 matrix, blocks aligned at (0, 0)."""
    rows, cols = x.shape
    q = np.zeros(x.shape, np.uint8)
    s = np.zeros(((rows + 127) // 128, (cols + 127) // 128), np.float32)
    for br in range(s.shape[0]):
        for bc in range(s.shape[1]):
            blk = x[br * 128:(br + 1) * 128, bc * 128:(bc + 1) * 128].astype(np.float32)
            amax = np.float32(max(float(np.abs(blk).max()), float(np.float32(1e-4))))
            scale = np.float32(amax / np.float32(448.0))
            s[br, bc] = scale
            q[br * 128:(br + 1) * 128, bc * 128:(bc + 1) * 128] = _e4m3_encode(
                (blk * np.float32(np.float32(1.0) / scale)).astype(np.float32))
    return q, s


def expected_fp8_param(param, full, cache):
    """expected_param for a block-FP8 map: e4m3 weights (uint8) and their fp32 scales from
    fp8_quantize of the full tensors (`cache`: name -> quantized), other parameters as usual."""
    if param.dtype != "F8_E4M3" and not param.name.endswith("weight_scale_inv"):
        return expected_param(param, full)
    scale = param.dtype != "F8_E4M3"
    out = np.zeros(param.shape, np.float32 if scale else np.uint8)
    for pc in param.pieces:
        src = pc.source[: -len("_scale_inv")] if scale else pc.source
        if src not in cache:
            cache[src] = fp8_quantize(full[src])
        out[pc.dst.slices()] = cache[src][1 if scale else 0][pc.src.slices()].reshape(
            pc.dst.extent)
    return out


def engine_index(plan, sync_rank):
    d = plan.describe_rank(sync_rank)
    return d["replica"], d["tp_rank"], d["pp_rank"]
