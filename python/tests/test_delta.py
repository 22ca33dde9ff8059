"""The delta encoding through the Python session API (issue 35): in-process loopback threads, a
trainer holding fp32 torch tensors, engines holding bf16 ones. Small updates travel as deltas and
every engine element equals the trainer's value cast to bf16 after every sync; a corrupted
engine byte sends its bucket whole in the same sync, and the report says why."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import shardsync
from conftest import expected_param, reference_weights

TOKEN = "test-token-0123456789"


def _run_job(plan, steps):
    """Every rank in a thread; `steps(version, trainer_tensors, engine_tensors)` runs between
    syncs on the main thread (ranks wait at a barrier). The reports per version, per rank."""
    torch = pytest.importorskip("torch")
    world = plan.world_size
    full = reference_weights(plan, 7)
    trainer, engines, reports, errors = {}, {}, {}, {}
    sessions = {}
    with shardsync.StoreServer(token=TOKEN) as srv:
        ready = threading.Barrier(world + 1)
        go = threading.Barrier(world + 1)
        versions = [v for v, _ in steps]

        def body(r):
            try:
                s = shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                      connect_timeout=30, sync_timeout=30)
                sessions[r] = s
                if s.is_trainer:
                    for n, a in full.items():
                        reg = plan.held_region(r, a.shape)
                        trainer[n] = torch.from_numpy(a[reg.slices()].copy())
                        s.bind_source(n, trainer[n])
                else:
                    mine = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16)
                            for p in s.expected_params()}
                    engines[r] = mine
                    shardsync.bind_engine(s, mine.items())
                s.connect()
                for v in versions:
                    ready.wait(60)
                    go.wait(60)
                    reports.setdefault(v, {})[r] = s.sync(v)
            except BaseException as e:  # noqa: BLE001 - reported to the test
                errors[r] = e
                ready.abort()
                go.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for v, step in steps:
            ready.wait(60)
            step(v, trainer, engines, sessions)
            go.wait(60)
        for t in threads:
            t.join(60)
        assert not errors, errors
    return reports, trainer, engines, sessions


def _expect_exact(plan, trainer, engines, sessions):
    """Every engine element equals the trainer's fp32 master rounded to bf16."""
    torch = pytest.importorskip("torch")
    hf = {n: t.numpy() for n, t in trainer.items()}
    checked = 0
    for r, mine in engines.items():
        for p in sessions[r].expected_params():
            want = torch.from_numpy(expected_param(p, hf)).to(torch.bfloat16)
            got = mine[p.name]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), p.name
            checked += got.numel()
    assert checked > 0


def test_small_updates_travel_as_deltas_and_every_element_verifies(need_session, tiny_model):
    torch = pytest.importorskip("torch")
    plan = shardsync.Plan(tiny_model, "single", "dp=1,tp=2,pp=1", wire_dtype="bf16",
                          bucket_bytes=16 << 10, encoding="delta")
    assert plan.encoding == "delta"
    assert plan.hash != shardsync.Plan(tiny_model, "single", "dp=1,tp=2,pp=1",
                                       bucket_bytes=16 << 10).hash
    rng = np.random.default_rng(0)
    seen = {}

    def update(v, trainer, engines, sessions):
        if v > 1:
            if seen:  # what the previous sync landed, checked before the masters move
                _expect_exact(plan, trainer, engines, sessions)
            for t in trainer.values():
                mask = torch.from_numpy(rng.random(t.shape) < 0.01)
                t[mask] = t[mask] * (1 + 1 / 64) + 1e-3
        seen[v] = True
        if v == 4:  # one engine byte corrupted behind the session's back
            r = min(engines)
            name = sorted(engines[r])[0]
            engines[r][name].view(torch.int16).view(-1)[0] ^= 0x10

    reports, trainer, engines, sessions = _run_job(plan, [(v, update) for v in range(1, 6)])
    _expect_exact(plan, trainer, engines, sessions)
    first = reports[1][0]["delta"]
    assert first["buckets_delta"] == 0
    assert first["fallbacks"]["no_kept_image"] == first["buckets_full"] > 0
    for v in (2, 3, 5):
        d = reports[v][0]["delta"]
        assert d["buckets_delta"] > 0 and sum(d["fallbacks"].values()) == 0, (v, d)
        assert d["wire_bytes"] < d["full_bytes"] / 5
        assert 0 < d["density"] < 0.05
        assert d["encode_seconds"] > 0 and d["decode_seconds"] > 0
        assert all(rep["delta"]["wire_bytes"] == d["wire_bytes"] for rep in reports[v].values())
    d4 = reports[4][0]["delta"]
    assert d4["fallbacks"]["base_checksum_differs"] == 1
    # The trainer (sync rank 0) saw it and says which bucket and why.
    assert "base checksum differs" in reports[4][0]["local"]["delta"]["first_fallback"]
    assert all(rep["verified"] for per in reports.values() for rep in per.values())


def test_encoding_is_checked(need_plan, tiny_model):
    with pytest.raises(shardsync.InvalidArgumentError, match="encoding"):
        shardsync.Plan(tiny_model, "single", "dp=1,tp=1", encoding="sparse")
    p = shardsync.Plan(tiny_model, "single", "dp=1,tp=1", encoding="auto")
    assert shardsync.Plan.from_spec(p.spec).hash == p.hash
    assert shardsync.Plan(tiny_model, "single", "dp=1,tp=1").encoding == "full"
