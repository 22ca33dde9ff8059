"""One rank of a multi-process sync driven from Python (spawned by test_sync.py)."""

from __future__ import annotations

import traceback

import numpy as np

import shardsync
from conftest import expected_param, reference_weights


def make_tensor(kind, array, dtype):
    if kind == "torch":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(array))
        return t.to({"F32": torch.float32, "BF16": torch.bfloat16}[dtype]).contiguous()
    assert dtype == "F32"
    return np.ascontiguousarray(array, dtype=np.float32)


def to_numpy_f32(kind, t):
    if kind == "torch":
        return t.float().numpy()
    return np.asarray(t, dtype=np.float32)


def expected_on_wire(kind, arr, wire):
    """The values a destination of dtype `wire` must hold: the source cast like the packer."""
    if wire == "F32":
        return arr.astype(np.float32)
    import torch  # bf16 rounding as torch does it (round to nearest even)

    return torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16).float().numpy()


def run_rank(args):
    (rank, spec, store, token, transport, kind, versions, seed) = args
    try:
        plan = shardsync.Plan.from_spec(spec)
        full = reference_weights(plan, seed)
        s = shardsync.Session(plan, rank, store, token=token, transport=transport,
                              connect_timeout=60, sync_timeout=60)
        keep = {}
        if s.is_trainer:
            for n, a in full.items():
                reg = plan.held_region(rank, a.shape)
                if reg.numel == 0:
                    continue
                keep[n] = make_tensor(kind, a[reg.slices()], plan.trainer_dtype)
                s.bind_source(n, keep[n])
        else:
            for p in s.expected_params():
                keep[p.name] = make_tensor(kind, np.zeros(p.shape, np.float32), plan.wire_dtype)
            shardsync.bind_engine(s, keep.items())
        s.connect()
        reports = []
        for v in versions:
            if s.is_trainer and v != versions[0]:
                # New weights every version: trainers hold version-dependent values.
                full_v = reference_weights(plan, seed + v)
                for n, t in keep.items():
                    reg = plan.held_region(rank, full_v[n].shape)
                    new = make_tensor(kind, full_v[n][reg.slices()], plan.trainer_dtype)
                    if kind == "torch":
                        t.copy_(new)
                    else:
                        t[...] = new
            reports.append(s.sync(v))
        checked = 0
        if not s.is_trainer:
            last = versions[-1]
            ref = full if last == versions[0] else reference_weights(plan, seed + last)
            for p in s.expected_params():
                want = expected_on_wire(kind, expected_param(p, ref), plan.wire_dtype)
                got = to_numpy_f32(kind, keep[p.name])
                if not np.array_equal(got, want):
                    bad = int(np.sum(got != want))
                    return ("mismatch", rank, f"{p.name}: {bad} of {got.size} elements differ")
                checked += got.size
        s.close()
        return ("ok", rank, {"reports": reports, "checked": checked})
    except Exception as e:  # noqa: BLE001 - reported to the parent with its type
        return ("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
