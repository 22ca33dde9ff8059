"""Syncs driven from Python: every engine parameter compared element for element against the
HF tensors it was cut from. Multi-process over UCX (one process per rank), and in-process over
the loopback transport (one thread per rank, which also shows the GIL is released)."""

from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest

import shardsync
from conftest import expected_param, reference_weights
from sync_worker import run_rank

TOKEN = "test-token-0123456789"  # stores refuse tokens under 16 characters

LAYOUTS = [
    # (trainer, rollout, engine)
    ("fsdp=2", "dp=1,tp=2,pp=2", "sglang"),
    ("hsdp=2x2", "dp=2,tp=2,pp=1", "vllm"),
    ("single", "dp=1,tp=1,pp=2", "sglang"),
    ("replicate=2", "dp=1,tp=2,pp=1", "vllm"),
]


def _spec(model, trainer, rollout, engine, wire="f32"):
    return dict(model=model, trainer=trainer, rollout=rollout, engine=engine, wire_dtype=wire,
                trainer_dtype="f32", bucket_bytes=64 << 10)


def _have_transport(name):
    return shardsync.has_part("session") and (
        name == "auto" or name in shardsync.native().transports())


def run_multiprocess(spec, kind, versions=(1,), seed=3, timeout=120, transport="ucx"):
    plan = shardsync.Plan.from_spec(spec)
    with shardsync.StoreServer(token=TOKEN) as srv:
        ctx = mp.get_context("spawn")
        args = [(r, spec, srv.address, TOKEN, transport, kind, list(versions), seed)
                for r in range(plan.world_size)]
        with ctx.Pool(plan.world_size) as pool:
            res = pool.map_async(run_rank, args).get(timeout)
    return plan, res


@pytest.mark.parametrize("transport", ["ucx", "shm", "auto"])
@pytest.mark.parametrize("trainer,rollout,engine", LAYOUTS[:3])
def test_multiprocess_numpy(need_session, tiny_model, trainer, rollout, engine, transport):
    if not _have_transport(transport):
        pytest.skip(f"{transport} transport not built")
    plan, res = run_multiprocess(_spec(tiny_model, trainer, rollout, engine), "numpy",
                                 versions=(1, 2), transport=transport)
    for status, rank, detail in res:
        assert status == "ok", f"rank {rank}: {detail}"
    engine_checked = sum(d["checked"] for _, _, d in res)
    reports = [d["reports"][-1] for _, _, d in res]
    assert all(r["verified"] and r["version"] == 2 for r in reports)
    assert len({r["bytes"] for r in reports}) == 1  # one report, every rank agrees
    assert engine_checked > 0


def test_multiprocess_torch_bf16(need_session, tiny_model):
    pytest.importorskip("torch")
    if not _have_transport("ucx"):
        pytest.skip("ucx transport not built")
    spec = _spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=2", "sglang", wire="bf16")
    plan, res = run_multiprocess(spec, "torch")
    for status, rank, detail in res:
        assert status == "ok", f"rank {rank}: {detail}"


def _in_process(spec, kind="numpy", versions=(1,)):
    plan = shardsync.Plan.from_spec(spec)
    with shardsync.StoreServer(token=TOKEN) as srv:
        out = {}

        def body(r):
            # Each thread runs one rank; loopback sessions share the process's default hub.
            args = (r, spec, srv.address, srv.token, "loopback", kind, list(versions), 5)
            out[r] = run_rank(args)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(plan.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a rank hung"
    return plan, out


@pytest.mark.parametrize("trainer,rollout,engine", LAYOUTS)
def test_in_process_loopback_threads(need_session, tiny_model, trainer, rollout, engine):
    if not _have_transport("loopback"):
        pytest.skip("loopback transport not built")
    plan, out = _in_process(_spec(tiny_model, trainer, rollout, engine), versions=(1, 3))
    for r in range(plan.world_size):
        status, rank, detail = out[r]
        assert status == "ok", f"rank {rank}: {detail}"
        rep = detail["reports"][-1]
        assert rep["verified"] and rep["version"] == 3
        assert rep["checksums_ok"] == rep["checksums_total"] > 0


def test_in_process_torch_bf16(need_session, tiny_model):
    pytest.importorskip("torch")
    spec = _spec(tiny_model, "hsdp=2x2", "dp=2,tp=2,pp=1", "sglang", wire="bf16")
    plan, out = _in_process(spec, kind="torch")
    for r in range(plan.world_size):
        assert out[r][0] == "ok", out[r]


def test_session_errors(need_session, tiny_model):
    spec = _spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang")
    plan = shardsync.Plan.from_spec(spec)
    with shardsync.StoreServer(token=TOKEN) as srv:
        with pytest.raises(shardsync.PermissionDeniedError):
            shardsync.Session(plan, 0, srv.address, token="bad-token-0123456789",
                              transport="loopback", connect_timeout=5)
        with pytest.raises(shardsync.OutOfRangeError, match="sync world"):
            shardsync.Session(plan, plan.world_size, srv.address, token=TOKEN, transport="loopback")
        s = shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback",
                              connect_timeout=1, sync_timeout=1)
        name, shape, _ = plan.hf_tensors()[1]
        reg = plan.held_region(0, shape)
        with pytest.raises(shardsync.InvalidArgumentError, match="does not match the held region"):
            s.bind_source(name, np.zeros([e + 1 for e in reg.extent], np.float32))
        with pytest.raises(shardsync.InvalidArgumentError, match="trainer dtype"):
            s.bind_source(name, np.zeros(reg.extent, np.float64))
        with pytest.raises(shardsync.NotFoundError, match="no such tensor"):
            s.bind_source("model.nope.weight", np.zeros(3, np.float32))
        with pytest.raises(shardsync.FailedPreconditionError, match="trainer rank"):
            s.bind_destination("x", np.zeros(3, np.float32))
        with pytest.raises(shardsync.FailedPreconditionError, match="before connect"):
            s.sync(1)
        # Nobody else joins: connect runs out its deadline (DeadlineExceeded) rather than hang.
        with pytest.raises((shardsync.DeadlineExceededError, shardsync.NotFoundError)):
            s.connect()
        e = shardsync.Session(plan, plan.trainer_world, srv.address, token=TOKEN,
                              transport="loopback")
        p = e.expected_params()[0]
        with pytest.raises(shardsync.InvalidArgumentError, match="the shard map says"):
            e.bind_destination(p.name, np.zeros([d + 1 for d in p.shape], np.float32))
        s.close()
        e.close()
        with pytest.raises(shardsync.FailedPreconditionError, match="closed"):
            s.bind_source(name, np.zeros(reg.extent, np.float32))


def _threads(plan, body):
    out = {}

    def run(r):
        try:
            out[r] = body(r)
        except Exception as e:  # noqa: BLE001 - checked by the caller
            out[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in range(plan.world_size)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert not any(t.is_alive() for t in ts), "a rank hung"
    return out


def test_corrupted_transfer_is_data_loss_then_recovers(need_session, tiny_model):
    """A byte flipped in transit (fault-injecting transport on trainer 0): receivers raise
    DataLossError and stay poisoned; the next version syncs cleanly and clears it."""
    spec = _spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang")
    plan = shardsync.Plan.from_spec(spec)
    full = reference_weights(plan, 9)
    with shardsync.StoreServer(token=TOKEN) as srv:
        sessions, dests = {}, {}
        for r in range(plan.world_size):
            params = {"fault.corrupt_data_post": "1", "fault.corrupt_byte": "3"} if r == 0 else {}
            s = shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                  prefix="fault/", sync_timeout=20, transport_params=params)
            if s.is_trainer:
                for n, a in full.items():
                    reg = plan.held_region(r, a.shape)
                    if reg.numel:
                        s.bind_source(n, np.ascontiguousarray(a[reg.slices()]))
            else:
                dests[r] = {p.name: np.zeros(p.shape, np.float32) for p in s.expected_params()}
                shardsync.bind_engine(s, dests[r].items())
            sessions[r] = s
        _threads(plan, lambda r: sessions[r].connect())
        first = _threads(plan, lambda r: sessions[r].sync(1))
        # The receiver of the corrupted bucket raises DataLossError; every other rank learns of
        # it and raises AbortedError; all name the checksum mismatch. Nobody reports success.
        for r, e in first.items():
            assert isinstance(e, (shardsync.DataLossError, shardsync.AbortedError)), f"rank {r}: {e!r}"
            assert "checksum mismatch" in str(e)
        assert any(isinstance(e, shardsync.DataLossError) for e in first.values())
        assert all(sessions[r].is_poisoned for r in dests)
        second = _threads(plan, lambda r: sessions[r].sync(2))
        for r, rep in second.items():
            assert isinstance(rep, dict) and rep["verified"], f"rank {r}: {rep!r}"
        assert not any(sessions[r].is_poisoned for r in dests)
        assert all(sessions[r].last_good_version == 2 for r in dests)
        sm = plan.shard_map()
        for r, d in dests.items():
            info = plan.describe_rank(r)
            for p in sm.rank(info["tp_rank"], info["pp_rank"]).params:
                assert np.array_equal(d[p.name], expected_param(p, full)), p.name
        for s in sessions.values():
            s.close()


def test_a_bound_tensor_whose_storage_moved_is_refused_before_the_sync(need_session, tiny_model):
    """A source updated in place syncs; one whose storage was replaced after binding (`.data =`,
    as `module.to()` or a re-materialisation does) would leave the session on the old bytes,
    syncing stale weights that still verify: the sync refuses it on that rank, naming the tensor,
    and the others fail at once (fail_sync), naming it too, instead of reporting success."""
    torch = pytest.importorskip("torch")
    spec = _spec(tiny_model, "single", "dp=1,tp=1,pp=1", "sglang")
    plan = shardsync.Plan.from_spec(spec)
    full = reference_weights(plan, 5)
    with shardsync.StoreServer(token=TOKEN) as srv:
        sessions, srcs, dests = {}, {}, {}
        for r in range(plan.world_size):
            s = shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                  prefix="moved/", sync_timeout=60)
            if s.is_trainer:
                srcs = {n: torch.from_numpy(a.copy()) for n, a in full.items()}
                s.bind_sources(srcs)
            else:
                dests[r] = {p.name: np.zeros(p.shape, np.float32) for p in s.expected_params()}
                shardsync.bind_engine(s, dests[r].items())
            sessions[r] = s
        _threads(plan, lambda r: sessions[r].connect())
        name = next(iter(srcs))
        srcs[name].add_(1.0)  # in place: the bound memory itself
        ok = _threads(plan, lambda r: sessions[r].sync(1))
        assert all(isinstance(rep, dict) and rep["verified"] for rep in ok.values()), ok
        old_storage = srcs[name].data
        srcs[name].data = srcs[name].clone()  # new storage: the session still reads the old one
        # Peers that timed out would raise DeadlineExceededError; they raise AbortedError naming
        # rank 0's refusal, posted by fail_sync.
        moved = _threads(plan, lambda r: sessions[r].sync(2))
        assert isinstance(moved[0], shardsync.FailedPreconditionError), moved[0]
        assert f"source '{name}' moved since it was bound" in str(moved[0])
        for r in range(1, plan.world_size):
            assert isinstance(moved[r], shardsync.AbortedError), moved[r]
            assert "sync rank 0 failed" in str(moved[r]) and "moved since it was bound" in str(
                moved[r])
        # The next version with the tensor bound again is not possible (connected); with the
        # storage put back it syncs.
        srcs[name].data = old_storage
        again = _threads(plan, lambda r: sessions[r].sync(3))
        assert all(isinstance(rep, dict) and rep["verified"] for rep in again.values()), again
        for s in sessions.values():
            s.close()


def test_unknown_fault_field_rejected(need_session, tiny_model):
    plan = shardsync.Plan.from_spec(_spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang"))
    with shardsync.StoreServer(token=TOKEN) as srv:
        with pytest.raises(shardsync.InvalidArgumentError, match="unknown fault field"):
            shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback",
                              transport_params={"fault.bogus": "1"})
        with pytest.raises(shardsync.InvalidArgumentError, match="expected an integer"):
            shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback",
                              transport_params={"fault.fail_post": "x"})


def test_device_sessions_need_cuda(need_session, tiny_model):
    plan = shardsync.Plan.from_spec(_spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang"))
    with shardsync.StoreServer(token=TOKEN) as srv:
        if not shardsync.native().DEVICE_BINDING:
            with pytest.raises(shardsync.UnimplementedError, match="without CUDA"):
                shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback", device=0)
        with pytest.raises(shardsync.InvalidArgumentError, match="device"):
            shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback", device=-5)


def test_unwritable_and_shared_destinations_refused_at_bind(need_session, tiny_model, tmp_path):
    """Issue 26: a read-only array used to be written by the sync and a read-only np.memmap
    segfaulted the process; two destinations sharing one buffer failed only at sync. All are
    InvalidArgumentError at bind now, and the process lives on."""
    plan = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", wire_dtype="f32")
    with shardsync.StoreServer() as srv:
        e = shardsync.Session(plan, plan.trainer_world, srv.address, token=srv.token,
                              transport="loopback")
        p0, p1 = e.expected_params()[:2]
        shape0 = tuple(p0.shape)

        ro = np.zeros(shape0, np.float32)
        ro.setflags(write=False)
        with pytest.raises(shardsync.InvalidArgumentError, match="read-only"):
            e.bind_destination(p0.name, ro)

        path = tmp_path / "weights.bin"
        np.zeros(shape0, np.float32).tofile(path)
        mm = np.memmap(path, dtype=np.float32, mode="r", shape=shape0)
        with pytest.raises(shardsync.InvalidArgumentError, match="read-only"):
            e.bind_destination(p0.name, mm)
        try:
            import torch  # noqa: F401 - optional: torch has no read-only flag to look at
        except ImportError:
            torch = None
        if torch is not None:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns about non-writable arrays
                t = torch.from_numpy(mm)  # a torch tensor over the read-only mapping
            with pytest.raises(shardsync.InvalidArgumentError, match="mapped read-only"):
                e.bind_destination(p0.name, t)
            # Issue 37: tensors over an immutable bytes object (torch.frombuffer, or from_numpy
            # of np.frombuffer), at its start or at an offset, are refused naming the parameter.
            n = int(np.prod(shape0))
            blob = bytes(4 * n + 64)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                over = [torch.frombuffer(blob, dtype=torch.float32, count=n).reshape(shape0),
                        torch.frombuffer(blob, dtype=torch.float32, count=n,
                                         offset=64).reshape(shape0),
                        torch.from_numpy(np.frombuffer(blob, np.float32, n).reshape(shape0))]
            for t in over:
                with pytest.raises(shardsync.InvalidArgumentError, match="immutable Python bytes"
                                   ) as err:
                    e.bind_destination(p0.name, t)
                assert p0.name in str(err.value)
            # A bytearray is the caller's to write: accepted.
            mutable = bytearray(4 * n)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                e.bind_destination(p0.name, torch.frombuffer(mutable, dtype=torch.float32)
                                   .reshape(shape0))
            e.close()
            e = shardsync.Session(plan, plan.trainer_world, srv.address, token=srv.token,
                                  transport="loopback")

        # Two parameters over overlapping bytes of one buffer.
        n0 = int(np.prod(p0.shape))
        n1 = int(np.prod(p1.shape))
        buf = np.zeros(n0 + n1, np.float32)
        e.bind_destination(p0.name, buf[:n0].reshape(p0.shape))
        with pytest.raises(shardsync.InvalidArgumentError, match="shares memory with"):
            e.bind_destination(p1.name, buf[n0 - 1:n0 - 1 + n1].reshape(p1.shape))
        # Adjacent, not overlapping: fine.
        e.bind_destination(p1.name, buf[n0:].reshape(p1.shape))
        e.close()


def _job_rank(plan, rank, address, seed, job_id, out, versions=(1,), done=None, job_secret=None):
    """One rank of a job on the shm transport (as its own process would run it): binds the
    weights of `seed`, connects, syncs; engine ranks compare every element with their own job's
    weights. out[rank] = ("connect" | "sync", exception) or ("ok", verified, mismatches). With
    `done` (a threading.Barrier) the session stays open until every rank passed it, so jobs that
    run together overlap for their whole life (a job that closed before another began is not a
    conflict: its claim is gone)."""
    full = reference_weights(plan, seed)
    s = shardsync.Session(plan, rank, address, token=TOKEN, transport="shm", job_id=job_id,
                          job_secret=job_secret, connect_timeout=10, sync_timeout=10)
    try:
        keep = {}
        if s.is_trainer:
            for n, a in full.items():
                reg = plan.held_region(rank, a.shape)
                if reg.numel:
                    keep[n] = np.ascontiguousarray(a[reg.slices()])
                    s.bind_source(n, keep[n])
        else:
            for p in s.expected_params():
                keep[p.name] = np.zeros(p.shape, np.float32)
                s.bind_destination(p.name, keep[p.name])
        try:
            s.connect()
        except shardsync.Error as e:
            out[rank] = ("connect", e)
            return
        try:
            verified = all(s.sync(v)["verified"] for v in versions)
        except shardsync.Error as e:
            out[rank] = ("sync", e)
            return
        bad = 0
        if not s.is_trainer:
            for p in s.expected_params():
                bad += int(np.sum(keep[p.name] != expected_param(p, full)))
        out[rank] = ("ok", verified, bad)
    finally:
        if done is not None:
            try:
                done.wait(60)
            except threading.BrokenBarrierError:
                pass
        s.close()


def test_two_jobs_on_one_prefix_never_merge(need_session, tiny_model):
    """Issue 26: two jobs with different weights on one store and the default prefix merged
    (report["verified"] True with 12k-90k wrong elements in 4 of 8 trials). Now exactly one job
    syncs its own weights and every rank of the other fails at connect, naming the prefix."""
    if not _have_transport("shm"):
        pytest.skip("shm transport not built")
    plan = shardsync.Plan.from_spec(_spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang"))
    with shardsync.StoreServer(token=TOKEN) as srv:
        for trial in range(6):
            jobs = {"a": ({}, 3, f"a-{trial}"), "b": ({}, 4, f"b-{trial}")}
            done = threading.Barrier(2 * plan.world_size)
            threads = [threading.Thread(target=_job_rank,
                                        args=(plan, r, srv.address, seed, jid, out, (1,), done))
                       for out, seed, jid in jobs.values() for r in range(plan.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a rank hung"
            won = [k for k, (out, _, _) in jobs.items()
                   if all(o[0] == "ok" for o in out.values())]
            assert len(won) == 1, {k: out for k, (out, _, _) in jobs.items()}
            for r, o in jobs[won[0]][0].items():
                assert o == ("ok", True, 0), f"trial {trial} rank {r}: {o}"
            for r, o in jobs["b" if won[0] == "a" else "a"][0].items():
                assert o[0] == "connect", f"trial {trial} rank {r}: {o}"
                assert "key prefix 'ss/'" in str(o[1]), str(o[1])


def test_a_lone_process_never_takes_a_late_ranks_slot(need_session, tiny_model):
    """Issue 37: a job's trainer rank 1 starts late and a lone process (other weights) claims its
    slot first: with no launch identity, with the job's id, with the job's id and a wrong secret,
    with another launch's id and secret. It is refused at connect every time and the job syncs,
    verified, with its own weights (the issue saw verified=True holding the intruder's)."""
    if not _have_transport("shm"):
        pytest.skip("shm transport not built")
    plan = shardsync.Plan.from_spec(_spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang"))
    with shardsync.StoreServer(token=TOKEN) as srv:
        for kind in ("none", "id", "wrong secret", "other launch"):
            launch = shardsync.new_launch()
            bad = {"none": {"job_id": "", "job_secret": ""},
                   "id": {"job_id": launch["job_id"], "job_secret": ""},
                   "wrong secret": {"job_id": launch["job_id"],
                                    "job_secret": shardsync.new_launch()["job_secret"]},
                   "other launch": shardsync.new_launch()}[kind]
            job, intruder = {}, {}
            threads = [threading.Thread(target=_job_rank,
                                        args=(plan, r, srv.address, 3, launch["job_id"], job),
                                        kwargs={"job_secret": launch["job_secret"]})
                       for r in (0, 2, 3)]
            threads.append(threading.Thread(
                target=_job_rank, args=(plan, 1, srv.address, 9, bad["job_id"], intruder),
                kwargs={"job_secret": bad["job_secret"]}))
            for t in threads:
                t.start()
            threads[-1].join(30)  # the intruder had its chance: the job's own rank 1 comes
            late = threading.Thread(target=_job_rank,
                                    args=(plan, 1, srv.address, 3, launch["job_id"], job),
                                    kwargs={"job_secret": launch["job_secret"]})
            late.start()
            for t in threads + [late]:
                t.join(60)
            assert intruder[1][0] == "connect", (kind, intruder)
            assert isinstance(intruder[1][1], shardsync.FailedPreconditionError), (kind, intruder)
            for r in range(4):
                assert job[r] == ("ok", True, 0), (kind, r, job[r])


def test_jobs_without_launch_identity_refuse_to_connect(need_session, tiny_model):
    """Issue 37: ranks started by multiprocessing without a launch identity could merge with
    another such job (2 of 24 trials verified the other's weights). A job of several ranks
    without one now refuses to connect, naming shardsync.new_launch()."""
    if not _have_transport("shm"):
        pytest.skip("shm transport not built")
    plan = shardsync.Plan.from_spec(_spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang"))
    with shardsync.StoreServer(token=TOKEN) as srv:
        for trial in range(24):  # two such jobs on one store and prefix, as the issue ran them
            a, b = {}, {}
            threads = [threading.Thread(target=_job_rank,
                                        args=(plan, r, srv.address, seed, "", out),
                                        kwargs={"job_secret": ""})
                       for out, seed in ((a, 3), (b, 4)) for r in range(plan.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            for r, o in list(a.items()) + list(b.items()):
                assert o[0] == "connect", (trial, r, o)
                assert "no launch identity" in str(o[1]) and "new_launch()" in str(o[1]), str(o[1])


def test_job_id_and_version_bounds(need_session, tiny_model):
    plan = shardsync.Plan.from_spec(_spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang"))
    with shardsync.StoreServer(token=TOKEN) as srv:
        s = shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback",
                              job_id="my-launch")
        assert s.job_id == "my-launch"
        s.close()
        with pytest.raises(shardsync.InvalidArgumentError, match="job_id"):
            shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback",
                              job_id="two words")
    assert shardsync.native().MAX_SYNC_VERSION == 2**63 - 1


def test_sync_version_outside_the_range_is_refused(need_session, tiny_model):
    plan = shardsync.Plan.from_spec(_spec(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", "sglang"))
    hub = shardsync.LoopbackHub()
    with shardsync.StoreServer(token=TOKEN) as srv:
        sessions = [shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                      hub=hub) for r in range(plan.world_size)]
        full = reference_weights(plan, 1)
        keep = []
        for s in sessions:
            if s.is_trainer:
                for n, a in full.items():
                    reg = plan.held_region(s.rank, a.shape)
                    if reg.numel:
                        keep.append(np.ascontiguousarray(a[reg.slices()]))
                        s.bind_source(n, keep[-1])
            else:
                for p in s.expected_params():
                    keep.append(np.zeros(p.shape, np.float32))
                    s.bind_destination(p.name, keep[-1])
        threads = [threading.Thread(target=s.connect) for s in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for v in (0, -1, 2**63, 2**64 - 1, True, "3"):
            with pytest.raises(shardsync.InvalidArgumentError, match="MAX_SYNC_VERSION"):
                sessions[0].sync(v)
        for s in sessions:
            s.close()


@pytest.mark.parametrize("how", ["bind", "own_error"])
def test_a_rank_failing_at_bind_fails_the_others_at_once_naming_it(need_session, tiny_model,
                                                                    how):
    """Issue 36: one of four ranks raises at bind (a shardsync bind error, or an error of the
    caller's own posted with fail_before_connect); the other three, waiting in connect() with a
    60 s timeout, fail within 5 s naming that rank and its error."""
    import time

    plan = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", wire_dtype="f32",
                          trainer_dtype="f32")
    assert plan.world_size == 4
    bad = 2  # engine rank tp 0
    hub = shardsync.LoopbackHub()
    full = reference_weights(plan)
    with shardsync.StoreServer(token=TOKEN) as srv:
        sessions = [shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                      hub=hub, connect_timeout=60, job_id="issue36")
                    for r in range(plan.world_size)]
        ended = {}
        t0 = time.monotonic()

        def body(r):
            s = sessions[r]
            try:
                if r == bad:
                    time.sleep(0.3)  # the others are waiting in connect()
                    p = s.expected_params()[0]
                    if how == "bind":
                        s.bind_destination(p.name, np.zeros([d + 1 for d in p.shape], np.float32))
                    try:
                        raise RuntimeError("the engine's weight loader is not ready")
                    except RuntimeError as e:
                        s.fail_before_connect(e)
                        raise
                if s.is_trainer:
                    for name, shape, _ in plan.hf_tensors():
                        region = plan.held_region(r, shape)
                        if region.numel:
                            s.bind_source(name, np.ascontiguousarray(full[name][region.slices()]))
                else:
                    for p in s.expected_params():
                        s.bind_destination(p.name, np.zeros(p.shape, np.float32))
                s.connect()
                return "connected"
            finally:
                ended[r] = time.monotonic() - t0

        out = _threads(plan, body)
        for s in sessions:
            s.close()
    if how == "bind":
        assert isinstance(out[bad], shardsync.InvalidArgumentError), out[bad]
        why = "the shard map says"
    else:
        assert isinstance(out[bad], RuntimeError), out[bad]
        why = "RuntimeError: the engine's weight loader is not ready"
    for r in range(plan.world_size):
        if r == bad:
            continue
        # AbortedError from its presence key, or UnavailableError from a peer that saw it first
        # and left (whose reason carries this one).
        assert isinstance(out[r], (shardsync.AbortedError, shardsync.UnavailableError)), (r, out[r])
        assert f"sync rank {bad} failed before connect" in str(out[r]), (r, out[r])
        assert why in str(out[r]), (r, out[r])
        assert ended[r] < 5.0, (r, ended[r], out[r])
