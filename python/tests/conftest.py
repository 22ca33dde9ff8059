"""Shared fixtures: a tiny model config, reference tensors, expected engine parameters."""

from __future__ import annotations

import json

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


def _need(part: str) -> None:
    if not shardsync.has_part(part):
        pytest.skip(f"native module built without the {part!r} part")


@pytest.fixture
def need_session():
    _need("session")


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


def engine_index(plan, sync_rank):
    d = plan.describe_rank(sync_rank)
    return d["replica"], d["tp_rank"], d["pp_rank"]
