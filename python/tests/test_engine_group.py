"""EngineGroup: gated methods (the seed's wrapper names and the engines' own) run on heads only,
results in replica order, errors name the replica, no shell's handle is ever touched, and the
group remembers which replicas released their weights."""

from __future__ import annotations

import threading
import time

import pytest

import shardsync
from shardsync import LIFECYCLE_METHODS, EngineGroup, ReplicaError, worker_coords
from shardsync.engine_group import ENGINE_METHODS, GATED_METHODS


class RecordingEngine:
    """Records every lifecycle call; returns a value naming itself."""

    def __init__(self, name, fail_on=(), delay=0.0):
        self.name = name
        self.calls = []
        self.fail_on = set(fail_on)
        self.delay = delay
        self._lock = threading.Lock()
        for m in GATED_METHODS:
            setattr(self, m, self._make(m))

    def _make(self, method):
        def call(*args, **kwargs):
            with self._lock:
                self.calls.append((method, args, kwargs))
            if self.delay:
                time.sleep(self.delay)
            if method in self.fail_on:
                raise RuntimeError(f"{self.name} broke in {method}")
            return f"{self.name}:{method}:{args}"

        return call


class ShellTrap:
    """A shell's handle: any attribute access at all fails the test."""

    touched = []

    def __getattribute__(self, name):
        ShellTrap.touched.append(name)
        raise AssertionError(f"shell engine handle touched: {name}")


def make_group(dp, tp, pp, **kw):
    coords = worker_coords(dp, tp, pp)
    engines = [RecordingEngine(f"r{c.dp}") if c.is_head else ShellTrap() for c in coords]
    return EngineGroup(engines, tp=tp, pp=pp, **kw), engines


def test_sixteen_methods():
    assert len(LIFECYCLE_METHODS) == 16
    assert len(set(LIFECYCLE_METHODS)) == 16
    for m in LIFECYCLE_METHODS:
        assert callable(getattr(EngineGroup, m))


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (1, 2, 2), (2, 2, 2), (3, 1, 4), (2, 4, 1)])
def test_coords_rule(dp, tp, pp):
    coords = worker_coords(dp, tp, pp)
    assert len(coords) == dp * tp * pp
    for i, c in enumerate(coords):
        assert (c.tp, c.pp, c.dp) == (i % tp, (i // tp) % pp, i // (tp * pp))
    heads = [c.rank for c in coords if c.is_head]
    assert heads == [d * tp * pp for d in range(dp)]


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("dp,tp,pp", [(1, 2, 2), (2, 2, 2), (3, 1, 4), (4, 2, 1)])
def test_every_method_runs_on_heads_only_in_replica_order(dp, tp, pp, concurrent):
    ShellTrap.touched = []
    group, engines = make_group(dp, tp, pp, concurrent=concurrent)
    assert group.heads == [d * tp * pp for d in range(dp)]
    for m in LIFECYCLE_METHODS:
        out = getattr(group, m)(7, key="v")
        assert out == [f"r{d}:{m}:(7,)" for d in range(dp)]
    for d in range(dp):
        head = engines[d * tp * pp]
        assert [c[0] for c in head.calls] == list(LIFECYCLE_METHODS)
        assert all(c[1] == (7,) and c[2] == {"key": "v"} for c in head.calls)
    assert ShellTrap.touched == []


def test_collection_order_independent_of_finish_order():
    # Replica 0 is slowest: results must still come back in replica order.
    coords = worker_coords(3, 2, 1)
    engines = []
    for c in coords:
        if c.is_head:
            engines.append(RecordingEngine(f"r{c.dp}", delay=0.2 - 0.08 * c.dp))
        else:
            engines.append(None)
    group = EngineGroup(engines, tp=2, pp=1)
    assert group.generate("p") == [f"r{d}:generate:('p',)" for d in range(3)]


def test_shell_worker_returns_none_without_side_effects():
    ShellTrap.touched = []
    group, engines = make_group(2, 2, 2)
    for w in group.workers:
        for m in LIFECYCLE_METHODS:
            r = getattr(w, m)("x")
            if w.is_head:
                assert r == f"r{w.coord.dp}:{m}:('x',)"
            else:
                assert r is None
    assert ShellTrap.touched == []
    # Shell handles may be None.
    group2 = EngineGroup([RecordingEngine("r0"), None, None, None], tp=2, pp=2)
    assert group2.worker(3).generate() is None
    assert group2.shells == [1, 2, 3]


def test_error_names_replica_and_all_heads_still_run():
    coords = worker_coords(3, 1, 2)
    engines = [
        RecordingEngine(f"r{c.dp}", fail_on={"sleep"} if c.dp in (1, 2) else ())
        if c.is_head
        else None
        for c in coords
    ]
    group = EngineGroup(engines, tp=1, pp=2)
    with pytest.raises(ReplicaError) as info:
        group.sleep()
    e = info.value
    assert isinstance(e, shardsync.Error)
    assert e.replica == 1 and e.worker == 2 and e.method == "sleep"
    assert "replica 1" in str(e) and "r1 broke in sleep" in str(e)
    assert [f[0] for f in e.failures] == [1, 2]
    assert isinstance(e.__cause__, RuntimeError)
    for c in coords:
        if c.is_head:
            assert [x[0] for x in engines[c.rank].calls] == ["sleep"]


def test_rejects_bad_shapes_and_methods():
    with pytest.raises(shardsync.InvalidArgumentError, match="multiple of tp\\*pp"):
        EngineGroup([object()] * 3, tp=2, pp=1)
    with pytest.raises(shardsync.InvalidArgumentError, match="dp\\*tp\\*pp"):
        EngineGroup([object()] * 4, tp=2, pp=1, dp=3)
    with pytest.raises(shardsync.InvalidArgumentError, match="head of replica 1"):
        EngineGroup([object(), None, None, None], tp=2, pp=1)
    group, _ = make_group(1, 2, 1)
    with pytest.raises(shardsync.InvalidArgumentError, match="not a lifecycle method"):
        group.call("load_weights")
    with pytest.raises(AttributeError):
        group.genrate  # noqa: B018 - a typo is an error, never a silent no-op
    with pytest.raises(ReplicaError, match="no method 'abort'"):
        EngineGroup([object()], tp=1).abort()


def test_layout_from_cpp_planner_matches_python_rule():
    if not shardsync.has_part("layout"):
        pytest.skip("layout part not built")
    for dp, tp, pp, gpn in [(2, 2, 2, 8), (2, 2, 2, 4), (4, 2, 1, 8), (1, 1, 4, 4)]:
        engines = [RecordingEngine(f"w{i}") for i in range(dp * tp * pp)]
        g = EngineGroup(engines, tp=tp, pp=pp, gpus_per_node=gpn)
        assert g.layout is not None
        py = worker_coords(dp, tp, pp)
        assert [(w.coord.dp, w.coord.pp, w.coord.tp) for w in g.workers] == [
            (c.dp, c.pp, c.tp) for c in py
        ]
        assert g.heads == list(g.layout.head_workers())
        g.health_check()
        for i, e in enumerate(engines):
            assert bool(e.calls) == (i in g.heads)
    with pytest.raises(shardsync.InvalidArgumentError):
        # a replica of 4 GPUs straddling nodes of 2 GPUs is rejected by the planner
        EngineGroup([object()] * 4, tp=2, pp=2, gpus_per_node=2)


# The engines' own names (SGLang Engine / HTTP, vLLM LLM / AsyncLLM), as the issue lists them.
ENGINE_NAMES = ("pause_generation", "continue_generation", "release_memory_occupation",
                "begin_weight_update", "end_weight_update", "collective_rpc",
                "start_weight_update", "finish_weight_update", "init_weight_transfer_engine",
                "update_weights", "resume_generation")


def test_engine_method_names_gated_on_heads():
    assert set(ENGINE_NAMES) <= set(ENGINE_METHODS)
    assert not set(ENGINE_METHODS) & set(LIFECYCLE_METHODS)
    ShellTrap.touched = []
    group, engines = make_group(2, 2, 2)
    for m in ENGINE_METHODS:
        assert getattr(group, m)(1) == [f"r{d}:{m}:(1,)" for d in range(2)]
    for w in group.workers:
        assert (w.collective_rpc("x") is None) == (not w.is_head)
    assert ShellTrap.touched == []
    assert [c[0] for c in engines[0].calls][: len(ENGINE_METHODS)] == list(ENGINE_METHODS)


def test_call_each_gives_each_replica_its_arguments():
    group, engines = make_group(3, 1, 2)
    out = group.call_each("init_weight_transfer_engine", lambda d: ((d * 10,), {"k": d}))
    assert out == [f"r{d}:init_weight_transfer_engine:({d * 10},)" for d in range(3)]
    assert [engines[d * 2].calls[0][2] for d in range(3)] == [{"k": 0}, {"k": 1}, {"k": 2}]
    with pytest.raises(shardsync.InvalidArgumentError, match="not a lifecycle method"):
        group.call_each("load_weights", lambda d: ((), {}))


def test_group_tracks_released_weights():
    group, _ = make_group(2, 1, 1)
    assert group.asleep_replicas() == []
    group.release_memory_occupation(tags=["kv_cache"])
    assert group.asleep_replicas() == [] and group.released(0) == {"kv_cache"}
    group.release_memory_occupation()  # None: every tag (SGLang GPU_MEMORY_ALL_TYPES)
    assert group.asleep_replicas() == [0, 1]
    group.resume_memory_occupation(tags=["weights"])
    assert group.asleep_replicas() == [] and group.released(1) == {"kv_cache", "cuda_graph"}
    group.sleep(1)  # vLLM: level 1 offloads weights
    assert group.asleep_replicas() == [0, 1]
    group.wake_up(tags=["kv_cache"])
    assert group.asleep_replicas() == [0, 1]
    group.wake_up()
    assert group.asleep_replicas() == []
    # A head that failed keeps its previous state; the others move on.
    coords = worker_coords(2, 1, 1)
    engines = [RecordingEngine(f"r{c.dp}", fail_on={"sleep"} if c.dp == 1 else ())
               for c in coords]
    g = EngineGroup(engines, tp=1, pp=1)
    with pytest.raises(ReplicaError):
        g.sleep(1)
    assert g.asleep_replicas() == [0]


def test_async_engine_methods_awaited_on_the_engines_loop():
    """An async engine (vLLM AsyncLLM) returns coroutines: awaited on the loop given, refused by
    name (and closed, never left unawaited) without one."""
    import asyncio
    import warnings

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    seen = []

    class AsyncEngine:
        async def start_weight_update(self):
            seen.append(asyncio.get_running_loop())
            return "started"

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail
            group = EngineGroup([AsyncEngine(), None], tp=2, pp=1)
            with pytest.raises(ReplicaError, match="is async .*pass loop="):
                group.start_weight_update()
            group.set_loop(loop)
            assert group.start_weight_update() == ["started"]
            assert seen == [loop]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
