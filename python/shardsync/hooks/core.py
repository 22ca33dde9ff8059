"""The engine-rank half shared by the SGLang and vLLM hooks.

An `EngineRankHook` lives inside one engine worker process (an SGLang scheduler, a vLLM worker)
and owns that rank's shardsync session. Rules it keeps for both engines:

- It never raises into the engine. Every entry point returns a status dict
  (`ok, op, version, replica, tp_rank, pp_rank, rank, error, code, report`) and posts the same
  dict to the shardsync store under `<prefix>hooks/<op>/<version>/<replica>/<pp>/<tp>`, where the
  driver reads every rank's (`driver.collect_reports`). Reason: an exception in an SGLang custom
  loader kills the scheduler (model_runner_components/weight_updater.py calls the loader with no
  try), and only pp0/tp0 answers an SGLang request, so a later stage's failure is only visible
  through the store.
- It fails closed before a byte moves: the live engine config is checked against the shard map
  (`layout_check`), every bound parameter's weight loader, sharded dims, shape, dtype and
  `data_ptr` are checked at bind time and again before every sync, and after the engine's
  finalize step (which may re-register a parameter: vLLM's `replace_parameter`).
- Every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import (
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InvalidArgumentError,
    UnimplementedError,
)
from .checks import (
    _device_index,
    _dtype_str,
    check_finalize_methods,
    check_loaders,
    expected_loader_kind,
    loader_kind,
    tensor_ptr,
)
from .status import make_status, post_status, report_key

__all__ = [
    "EngineRankHook",
    "Probe",
    "make_status",
    "report_key",
    "tensor_ptr",
    "expected_loader_kind",
    "loader_kind",
    "check_loaders",
    "check_finalize_methods",
    "post_status",
]

# ---------------------------------------------------------------------------------------------
# Engine facts the hook reads from its process
# ---------------------------------------------------------------------------------------------


class Probe:
    """What a hook needs from its engine process, with engine-specific subclasses (sglang.py,
    vllm.py). Tests replace pieces through fake engine modules, not by subclassing."""

    engine = "?"

    def ranks(self) -> Tuple[int, int, int, int]:
        """(tp_rank, pp_rank, tp_size, pp_size) of the calling engine rank."""
        raise NotImplementedError

    def facts(self) -> Dict[str, Any]:
        """The live engine config, normalised for layout_check (empty when unknown)."""
        return {}

    def memory(self, tensors: Sequence[Tuple[str, Any]]) -> Dict[str, Any]:
        """{'cumem': [names in cuMem / VMM allocations], 'asleep': [names whose memory is
        released]} of the given parameters."""
        return {"cumem": [], "asleep": []}

    def fp8_views(self, model: Any, expected: Sequence[Any]) -> Any:
        """For a block-FP8 plan: where the engine serves the plan's FP8 parameters after its
        post-load step (vllm_fp8.VllmFp8Views: `modules`, `named`, `live_name`, `staged`,
        `after_sync`, `masked`), or None when it serves them as loaded under the plan's names."""
        return None


# ---------------------------------------------------------------------------------------------
# The hook
# ---------------------------------------------------------------------------------------------


class _Job:
    def __init__(self, op: str, version: int, fn: Callable[[], Dict[str, Any]], post: bool):
        self.op, self.version, self.fn, self.post = op, version, fn, post
        self.status: Optional[Dict[str, Any]] = None
        self.done = threading.Event()


class EngineRankHook:
    """One engine rank's shardsync state (see the module docstring).

    `get_model()` returns the live model (its named_parameters() are re-read before every sync);
    `probe` answers ranks, engine config and memory state; `finalize(model)` is the engine's
    post-load step, run after every landed sync.
    """

    def __init__(self, engine: str, get_model: Callable[[], Any], probe: Probe,
                 finalize: Optional[Callable[[Any], None]] = None) -> None:
        self.engine = engine
        self._get_model = get_model
        self.probe = probe
        self.finalize = finalize
        self.config: Optional[Dict[str, Any]] = None
        self.session: Any = None
        self.plan: Any = None
        self.coord: Dict[str, Any] = {}
        self.snapshot: Dict[str, Tuple[int, Tuple[int, ...], str]] = {}
        self.poisoned: Optional[str] = None
        # Set when the engine did something the job cannot survive (a draft runner the plan does
        # not cover): every later init / sync status of this rank reports it.
        self.fatal: Optional[str] = None
        self.loader_check = "not run"
        self.views: Any = None  # Probe.fp8_views of a block-FP8 plan
        self._owners: Dict[str, Any] = {}
        self._facts: Dict[str, Any] = {}
        self.last: Optional[Dict[str, Any]] = None
        self._queue: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._pending: List[_Job] = []
        self._lock = threading.Lock()
        self._worker: Optional[threading.Thread] = None

    # ---- guarded entry points (never raise) ----
    def _guard(self, op: str, version: int, fn: Callable[[], Dict[str, Any]],
               post: bool = True) -> Dict[str, Any]:
        t0 = time.monotonic()
        try:
            extra = fn() or {}
            st = make_status(op, version, self.coord, **extra)
        except BaseException as e:  # noqa: BLE001 - reported, never raised into the engine
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            extra = {}
            if not isinstance(e, Error):
                extra["traceback"] = traceback.format_exc(limit=6)
            st = make_status(op, version, self.coord, error=e, **extra)
        st["seconds"] = round(time.monotonic() - t0, 6)
        if post:
            st = self.post(st)
        self.last = st
        return st

    def post(self, st: Dict[str, Any]) -> Dict[str, Any]:
        # A fatal finding outranks whatever the job saw next (a peer timing out on this rank).
        if self.fatal and st.get("op") in ("init", "sync") and self.fatal not in str(
                st.get("error") or ""):
            st = make_status(st["op"], st.get("version") or 0, self.coord,
                             error=FailedPreconditionError(self.fatal))
        err = post_status(self.config, st)
        if err is not None:
            st = dict(st, store_error=err)
        return st

    def refuse(self, op: str, version: int, error: BaseException) -> Dict[str, Any]:
        """A status for a request refused before any work (bad command, wrong state)."""
        st = self.post(make_status(op, version, self.coord, error=error))
        self.last = st
        return st

    # ---- init ----
    def capture(self, config: Dict[str, Any]) -> Dict[str, Any]:
        """Reads everything that must be read on the engine's own thread (parallel state,
        server args) and parses the config. Guarded: returns a status, posted on failure."""
        def body() -> Dict[str, Any]:
            from ..plan import Plan

            if not isinstance(config, dict):
                raise InvalidArgumentError(
                    f"config: expected a JSON object (dict), got {type(config).__name__}")
            iid = config.get("init_id", 0)
            if not isinstance(iid, int) or isinstance(iid, bool):
                raise InvalidArgumentError(f"config['init_id']: expected an integer, got {iid!r}")
            self.config = dict(config)
            tp_rank, pp_rank, tp_size, pp_size = self.probe.ranks()
            self._facts = self.probe.facts()
            self.coord = {"tp_rank": tp_rank, "pp_rank": pp_rank, "tp_size": tp_size,
                          "pp_size": pp_size, "replica": self._replica(config)}
            if "plan" not in config:
                raise InvalidArgumentError("config: missing 'plan' (Plan.spec)")
            self.plan = Plan.from_spec(config["plan"])
            if self.plan.engine != self.engine:
                raise InvalidArgumentError(
                    f"config['plan']: engine '{self.plan.engine}' but this hook runs inside "
                    f"{self.engine}")
            if (self.plan.tp, self.plan.pp) != (tp_size, pp_size):
                raise InvalidArgumentError(
                    f"engine is tp={tp_size}, pp={pp_size} but the plan's rollout is "
                    f"tp={self.plan.tp}, pp={self.plan.pp}")
            if self.coord["replica"] is None:
                raise InvalidArgumentError(
                    "replica: not in the config and not given by the engine (set "
                    "config['replica'] or SHARDSYNC_REPLICA)")
            self.coord["rank"] = self.plan.engine_rank(int(self.coord["replica"]), tp_rank,
                                                       pp_rank)
            from .layout_check import check_layout

            check_layout(self.engine, self.plan, self._facts, config)
            return {}

        st = self._guard("capture", 0, body, post=False)
        if not st["ok"]:
            iid = config.get("init_id", 0) if isinstance(config, dict) else 0
            st = self.post(dict(st, op="init", version=iid if isinstance(iid, int) else 0))
            self.last = st
        return st

    def _replica(self, config: Dict[str, Any]) -> Optional[int]:
        from .._native import native

        if config.get("replica") is not None:
            return int(config["replica"])
        # Through the knob registry (docs/environment.md): "abc" or "-1" raises naming the knob.
        env = native().read_knob("SHARDSYNC_REPLICA")
        if env is not None:
            return int(env)
        r = self._facts.get("dp_rank")  # vLLM's own DP rank, when it runs replicas itself
        return None if r is None else int(r)

    def open(self, version: int = 0) -> Dict[str, Any]:
        """Validates and binds this rank's parameters, then connects (collective with every
        other sync rank). Call after a successful capture(). `version`: the driver's init id."""
        return self._guard("init", version, self.open_body)

    def open_body(self) -> Dict[str, Any]:
        """open() without the guard (raises)."""
        from ..adapters import check_engine_params
        from ..session import Session

        if self.plan is None or self.config is None:
            raise FailedPreconditionError("init before a successful capture of the config")
        if self.session is not None:
            self.session.close()
            self.session = None
        cfg = self.config
        model = self._get_model()
        expected = self.plan.shard_map().rank(self.coord["tp_rank"], self.coord["pp_rank"]).params
        fp8 = getattr(self.plan, "quant", None) is not None
        # Where a block-FP8 engine serves the plan's parameters after its post-load step (or a
        # refusal naming the backend), then every other module whose finalize step rewrites
        # layouts is refused, all before binding.
        self.views = self.probe.fp8_views(model, expected) if fp8 else None
        check_finalize_methods(model, fp8=fp8,
                               handled=self.views.modules if self.views is not None else ())
        named = list(model.named_parameters())
        if self.views is not None:
            named = self.views.named(named)
        _check_expert_naming(self.plan, expected, named)
        pairs = check_engine_params(
            list(expected), named, ignore_extra=bool(cfg.get("ignore_extra", False)),
            wire_dtype=self.plan.wire_dtype)
        self._owners = _owners(model, [n for n, _ in pairs])
        self.loader_check = (check_loaders(self._served(pairs, model), tp=self.plan.tp,
                                           owners=self._owners)
                             if cfg.get("check_loaders", True) else "disabled")
        self._check_memory(pairs, cfg)
        device = self._device(pairs, cfg)
        # transport / staging: the Session's defaults unless the config names them.
        kw = {k: cfg[k] for k in ("transport", "staging", "transport_params") if k in cfg}
        s = Session(
            self.plan, self.coord["rank"], cfg["store"], token=cfg.get("token", ""),
            prefix=cfg.get("prefix", "ss/"),
            # The driver's launch id (its trainer ranks'), never this engine process's own.
            job_id=str(cfg.get("job_id", "")), job_secret=str(cfg.get("job_secret", "")),
            connect_timeout=float(cfg.get("connect_timeout", 60.0)),
            sync_timeout=float(cfg.get("sync_timeout", 60.0)), device=device, **kw)
        try:
            for n, t in pairs:
                s.bind_destination(n, t)
            s.connect()
        except BaseException:
            s.close()
            raise
        self.session = s
        # What the engine serves (a staged scale's served tensor, not the staging) must stay.
        self.snapshot = {n: (tensor_ptr(t), tuple(int(d) for d in t.shape), _dtype_str(t))
                         for n, t in self._served(pairs, model)}
        self.poisoned = None
        out = {"params": len(pairs), "device": device, "loader_check": self.loader_check}
        if self.views is not None:
            out["fp8"] = self.views.describe()
        return out

    def _live(self, name: str) -> str:
        """The engine's own name of plan parameter `name` (a renamed FP8 scale)."""
        return self.views.live_name(name) if self.views is not None else name

    def _served(self, pairs: Sequence[Tuple[str, Any]], model: Any) -> List[Tuple[str, Any]]:
        """(plan name, the tensor the engine serves): a staged FP8 scale's served tensor."""
        if self.views is None:
            return list(pairs)
        live = dict(model.named_parameters())
        return [(n, live[self._live(n)] if self.views.staged(n) else t) for n, t in pairs]

    def _check_memory(self, pairs: Sequence[Tuple[str, Any]], cfg: Dict[str, Any]) -> None:
        mem = self.probe.memory(pairs)
        if mem.get("asleep"):
            names = mem["asleep"]
            raise FailedPreconditionError(
                f"engine is asleep: {len(names)} bound parameter(s) have no memory mapped "
                f"({', '.join(names[:3])}); wake it (vLLM wake_up(tags=['weights']), SGLang "
                "resume_memory_occupation(tags=['weights'])) before init or sync")
        # cuda_ipc exports every registered region with cudaIpcGetMemHandle
        # (cuda_ipc_transport.cc); "auto" routes device pairs on one node there too.
        if (mem.get("cumem") and cfg.get("transport", "auto") in ("cuda_ipc", "auto")
                and cfg.get("staging") != "host"):
            names = mem["cumem"]
            raise UnimplementedError(
                f"parameter '{names[0]}' (and {len(names) - 1} more) live in cuMem / VMM "
                "allocations (sleep mode / memory saver): cudaIpcGetMemHandle cannot export "
                "them for the cuda_ipc transport; use transport 'nccl', or a host transport "
                "('shm', 'ucx') with config['staging']='host'")

    @staticmethod
    def _device(pairs: Sequence[Tuple[str, Any]], cfg: Dict[str, Any]) -> Optional[int]:
        devs = {_device_index(t) for _, t in pairs}
        cuda = {d for d in devs if d is not None}
        if cuda and None in devs:
            host = next(n for n, t in pairs if _device_index(t) is None)
            raise InvalidArgumentError(
                f"parameter '{host}' is in host memory while others are on CUDA device(s) "
                f"{sorted(cuda)}: one rank binds one kind of memory")
        if len(cuda) > 1:
            raise InvalidArgumentError(f"parameters span CUDA devices {sorted(cuda)}")
        if not cuda or cfg.get("staging") == "host":
            return None  # host memory, or staging asked for
        return next(iter(cuda))

    # ---- sync ----
    def check_bound(self, when: str) -> None:
        """Re-reads the model's parameters: every bound one must still be the same memory with
        the same shape and dtype, and still pass the loader check (a failure poisons the rank:
        the session is bound to memory the engine may no longer read)."""
        model = self._get_model()
        live = dict(model.named_parameters())
        for name, (ptr, shape, dtype) in self.snapshot.items():
            t = live.get(self._live(name))
            if t is None:
                raise FailedPreconditionError(
                    f"{when}: parameter '{self._live(name)}' is gone from the model")
            now = (tensor_ptr(t), tuple(int(d) for d in t.shape), _dtype_str(t))
            if now != (ptr, shape, dtype):
                raise FailedPreconditionError(
                    f"{when}: parameter '{name}' was replaced (data_ptr {ptr:#x} -> {now[0]:#x}, "
                    f"shape {list(shape)} -> {list(now[1])}, dtype {dtype} -> {now[2]}); the "
                    "session is bound to the old memory, so a sync would land where the engine "
                    "no longer reads (the engine's post-load step re-registered it, e.g. vLLM "
                    "replace_parameter). This layout is refused; re-init after a reload")
        if self.loader_check == "checked":
            check_loaders([(n, live[self._live(n)]) for n in self.snapshot], tp=self.plan.tp,
                          owners=self._owners)

    def check_awake(self, when: str) -> None:
        """Refuses while bound parameters are unmapped (sleep); transient, does not poison."""
        live = dict(self._get_model().named_parameters())
        mem = self.probe.memory([(n, live[self._live(n)]) for n in self.snapshot
                                 if self._live(n) in live])
        if mem.get("asleep"):
            raise FailedPreconditionError(
                f"{when}: engine is asleep ({', '.join(mem['asleep'][:3])} released); wake it "
                "(vLLM wake_up(tags=['weights']), SGLang resume_memory_occupation) first")

    def check_ready(self, when: str) -> None:
        """Pre-sync check: the engine is awake and its bound tensors are still the live ones (a
        moved tensor poisons the rank: re-init)."""
        self.check_awake(when)
        try:
            self.check_bound(when)
        except Error as e:
            self.poisoned = str(e)
            raise

    def do_sync(self, version: int, finalize: bool = True) -> Dict[str, Any]:
        """The sync body (raises; wrap with _guard): pre-check, sync, finalize, post-check."""
        if self.session is None:
            raise FailedPreconditionError("sync before a successful init on this rank")
        try:
            if self.poisoned:
                raise FailedPreconditionError(f"rank refuses to sync: {self.poisoned}")
            self.check_ready("before sync")
        except Error as e:
            # The trainer ranks and the other engine ranks fail now, not at their sync timeout.
            self.session.fail_sync(int(version), e)
            raise
        report = self.session.sync(int(version))
        if self.staged:
            # Staged commit: the bytes are in staging, the engine still serves the live
            # parameters; post-load belongs to the commit (do_commit).
            return {"report": _summary(report), "staged": True}
        if self.views is not None:  # staged FP8 scales into their served layout
            self.views.after_sync(self._get_model())
        if finalize:
            self.run_finalize("after sync")
        return {"report": _summary(report)}

    @property
    def staged(self) -> bool:
        return getattr(self.session, "commit_mode", "inplace") == "staged"

    def do_commit(self, version: int, finalize: bool = True) -> Dict[str, Any]:
        """Staged commit (raises; wrap with _guard): the engine is paused in place, so finish
        what it queued on the GPU, copy the verified version into the live parameters
        (collective over the commit scope; a rank that cannot makes every rank roll back), then
        the engine's post-load step."""
        if self.session is None:
            raise FailedPreconditionError("commit before a successful init on this rank")
        if not self.staged:
            raise FailedPreconditionError(
                "commit: this rank's session is in place (the plan's commit is 'inplace')")
        self.check_ready("before commit")
        _synchronize_device(self.session)
        rep = self.session.commit(int(version))
        if self.views is not None:  # staged FP8 scales into their served layout
            self.views.after_sync(self._get_model())
        if finalize:
            self.run_finalize("after commit")
        return {"commit": rep}

    def do_rollback(self, finalize: bool = True) -> Dict[str, Any]:
        """Staged commit: the version committed before the last commit, bit for bit, then the
        engine's post-load step (raises; wrap with _guard)."""
        if self.session is None:
            raise FailedPreconditionError("rollback before a successful init on this rank")
        self.check_ready("before rollback")
        _synchronize_device(self.session)
        self.session.rollback()
        if self.views is not None:
            self.views.after_sync(self._get_model())
        if finalize:
            self.run_finalize("after rollback")
        return {"committed_version": self.session.committed_version}

    def run_finalize(self, when: str, run: bool = True) -> None:
        """The engine's post-load step (unless `run` is False: the engine runs it itself), then
        the bound-parameter re-check."""
        if run and self.finalize is not None:
            # Block FP8: the FP8 methods' own steps are masked, their result is what was synced.
            masked = self.views.masked() if self.views is not None else contextlib.nullcontext()
            with masked:
                self.finalize(self._get_model())
        try:
            self.check_bound(when + " + finalize")
        except Error as e:
            self.poisoned = str(e)
            raise

    def sync(self, version: int) -> Dict[str, Any]:
        """Blocking sync + finalize (vLLM; SGLang with pp == 1)."""
        return self._guard("sync", int(version), lambda: self.do_sync(version))

    # ---- background jobs (SGLang: a request is handled on stage 0 before it is forwarded, so
    # nothing collective may block the scheduler; engine-layouts.md 4.1) ----
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run_jobs, name="shardsync-hook",
                                            daemon=True)
            self._worker.start()

    def _run_jobs(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.status = self._guard(job.op, job.version, job.fn, post=job.post)
            job.done.set()

    def submit(self, op: str, version: int, fn: Callable[[], Dict[str, Any]],
               post: bool) -> Dict[str, Any]:
        job = _Job(op, version, fn, post)
        with self._lock:
            self._pending.append(job)
        self._ensure_worker()
        self._queue.put(job)
        return make_status(op, version, self.coord, queued=True)

    def wait(self, timeout: float) -> Tuple[List[Dict[str, Any]], Optional[BaseException]]:
        """Joins every job submitted since the last wait (bounded). Returns their statuses and a
        DeadlineExceededError when some are still running (they stay pending)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            jobs = list(self._pending)
        done: List[Dict[str, Any]] = []
        for j in jobs:
            if not j.done.wait(max(0.0, deadline - time.monotonic())):
                return done, DeadlineExceededError(
                    f"{j.op} (version {j.version}) still running after {timeout:.0f}s")
            assert j.status is not None
            done.append(j.status)
            with self._lock:
                self._pending.remove(j)
        return done, None

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def close(self) -> Dict[str, Any]:
        def body() -> Dict[str, Any]:
            if self.session is not None:
                self.session.close()
                self.session = None
            return {}

        st = self._guard("close", 0, body, post=False)
        if self._worker is not None and self._worker.is_alive():
            self._queue.put(None)
        return st


def _owners(model: Any, names: Sequence[str]) -> Dict[str, Any]:
    """Parameter name -> the module holding it: the layer a weight loader would be bound to, for
    parameters a post-load step re-registered without their loader (vLLM FP8's
    `layer.weight = Parameter(weight.data)`)."""
    mods = dict(model.named_modules()) if callable(getattr(model, "named_modules", None)) else {}
    out = {}
    for n in names:
        m = mods.get(n.rpartition(".")[0])
        if m is not None:
            out[n] = m
    return out


def _synchronize_device(session: Any) -> None:
    """The engines' in-place pauses stop scheduling, not the GPU: SGLang's in_place mode only
    sets `_engine_paused` and returns, leaving in-flight batches to finish (srt/managers/
    scheduler.py `Scheduler.pause_generation`), and vLLM's "keep" freezes the queue (v1/engine/
    core.py `EngineCore.pause_scheduler`). A forward still reading the live parameters must end
    before the commit writes them."""
    device = getattr(session, "device", None)
    if device is None:
        return
    import torch

    torch.cuda.synchronize(device)


def _check_expert_naming(plan: Any, expected: Sequence[Any], named: Sequence[Any]) -> None:
    """The engine's expert names against the plan's naming, with the fix in the message (vLLM
    >= 0.24 keeps them on RoutedExperts: fused_moe/routed_experts.py)."""
    have = {n for n, _ in named}
    want = [p.name for p in expected if ".experts." in p.name and p.name.endswith("_weight")]
    if not want or any(n in have for n in want):
        return
    routed, fused = ".experts.routed_experts.", ".experts."
    alt = {"fused_moe": ("routed_experts", lambda n: n.replace(fused, routed)),
           "routed_experts": ("fused_moe", lambda n: n.replace(routed, fused))}
    naming = getattr(plan, "expert_naming", "fused_moe")
    other, rename = alt[naming]
    if rename(want[0]) in have:
        raise InvalidArgumentError(
            f"engine parameter '{rename(want[0])}' uses expert naming '{other}' but the plan "
            f"expects '{want[0]}' ('{naming}'): build the Plan with expert_naming='{other}' "
            "(vLLM >= 0.24 names experts ...mlp.experts.routed_experts.*)")


def _summary(report: Any) -> Any:
    if not isinstance(report, dict):
        return report
    keep = ("version", "bytes", "seconds", "gbps", "slowest_rank", "checksums_ok",
            "checksums_total", "verified")
    out = {k: report.get(k) for k in keep if k in report}
    ranks = report.get("ranks")
    if isinstance(ranks, (list, tuple)):
        out["failed_ranks"] = [i for i, r in enumerate(ranks)
                               if isinstance(r, dict) and not r.get("ok", True)]
    return out
