"""Issue 33 from Python: Plan(commit="staged") sessions (loopback, one thread per rank). A sync
lands in staging and leaves the bound engine arrays as they were; commit() makes it live on every
engine rank; rollback() restores the previous version element for element; a corrupted byte
fails the sync and leaves the live arrays untouched."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import shardsync
from conftest import expected_param, reference_weights

TOKEN = "test-token-0123456789"


class _Job:
    def __init__(self, model, srv, *, fault_rank=None, fault=None):
        self.plan = shardsync.Plan(model, "fsdp=2", "dp=1,tp=2,pp=1", engine="sglang",
                                   wire_dtype="f32", trainer_dtype="f32", bucket_bytes=16 << 10,
                                   commit="staged")
        self.full = {v: reference_weights(self.plan, seed=v) for v in (1, 2, 3)}
        self.sessions, self.src, self.dst = [], {}, {}
        for r in range(self.plan.world_size):
            params = {f"fault.{k}": str(v) for k, v in (fault or {}).items()} \
                if r == fault_rank else {}
            s = shardsync.Session(self.plan, r, srv.address, token=TOKEN, transport="loopback",
                                  connect_timeout=20, sync_timeout=10, transport_params=params)
            if s.is_trainer:
                for name, shape, _ in self.plan.hf_tensors():
                    reg = self.plan.held_region(r, shape)
                    a = np.ascontiguousarray(self.full[1][name][reg.slices()])
                    self.src[(r, name)] = (a, reg)
                    s.bind_source(name, a)
            else:
                for p in s.expected_params():
                    a = np.full(p.shape, 7.0, np.float32)
                    self.dst[(r, p.name)] = (a, p)
                    s.bind_destination(p.name, a)
            self.sessions.append(s)
        self.all(lambda s: s.connect())

    def all(self, fn):
        out, errs = {}, {}

        def run(r, s):
            try:
                out[r] = fn(s)
            except Exception as e:  # noqa: BLE001 - returned to the test
                errs[r] = e

        ts = [threading.Thread(target=run, args=(r, s)) for r, s in enumerate(self.sessions)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        return out, errs

    def set_version(self, v):
        for (r, name), (a, reg) in self.src.items():
            a[...] = self.full[v][name][reg.slices()]

    def live(self):
        return {k: a.copy() for k, (a, _) in self.dst.items()}

    def matches(self, v):
        return all(np.array_equal(a, expected_param(p, self.full[v]))
                   for a, p in self.dst.values())

    def close(self):
        for s in self.sessions:
            s.close()


def test_staged_commit_rollback_from_python(need_session, tiny_model):
    with shardsync.StoreServer(token=TOKEN) as srv:
        job = _Job(tiny_model, srv)
        try:
            plan = job.plan
            assert plan.spec["commit"] == "staged"
            engine = plan.trainer_world
            assert job.sessions[engine].staging_bytes == plan.staging_bytes(engine) > 0
            assert plan.staging_bytes(0) == 0
            before = job.live()
            reps, errs = job.all(lambda s: s.sync(1))
            assert not errs, errs
            assert all(np.array_equal(before[k], a) for k, a in job.live().items())
            rep = reps[engine]
            assert rep["verified"] and rep["staging_bytes"] == plan.staging_bytes(engine)
            assert rep["transfer_seconds"] > 0
            commits, errs = job.all(lambda s: s.commit(1))
            assert not errs, errs
            assert commits[engine]["stall_seconds"] > 0 and commits[engine]["bytes"] > 0
            assert commits[engine]["keep_previous"] == "area"
            assert job.matches(1)
            v1 = job.live()
            job.set_version(2)
            _, errs = job.all(lambda s: s.sync(2))
            assert not errs, errs
            _, errs = job.all(lambda s: s.commit(2))
            assert not errs, errs
            assert job.matches(2)
            _, errs = job.all(lambda s: None if s.is_trainer else s.rollback())
            assert not errs, errs
            assert all(np.array_equal(v1[k], a) for k, a in job.live().items())
            assert job.sessions[engine].committed_version == 1
            with pytest.raises(shardsync.FailedPreconditionError, match="no previous version"):
                job.sessions[engine].rollback()
        finally:
            job.close()


def test_corrupted_byte_leaves_live_arrays_untouched(need_session, tiny_model):
    """Trainer rank 1's 3rd data post carries a flipped byte: the sync fails on every rank with
    the checksum's DataLoss, and no engine array changed (they still hold what they served)."""
    with shardsync.StoreServer(token=TOKEN) as srv:
        job = _Job(tiny_model, srv, fault_rank=1, fault={"corrupt_data_post": 3,
                                                          "corrupt_byte": 5})
        try:
            served = job.live()
            _, errs = job.all(lambda s: s.sync(1))
            assert len(errs) == job.plan.world_size, errs
            assert any(isinstance(e, shardsync.DataLossError) for e in errs.values())
            engine = job.plan.trainer_world
            assert not job.sessions[engine].is_poisoned  # the live arrays are not
            assert all(np.array_equal(served[k], a) for k, a in job.live().items())
            _, errs = job.all(lambda s: s.commit(1))  # a failed version commits nowhere
            assert all(r in errs for r in range(engine, job.plan.world_size))
            assert all(np.array_equal(served[k], a) for k, a in job.live().items())
        finally:
            job.close()
