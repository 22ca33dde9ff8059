"""Driver side of the engine hooks, shared by both engines (driver.py is the public module).

The engines answer a weight-update request from one rank only and the hooks never raise, so the
truth is in the store: `collect_reports` reads every engine rank's status, with one deadline for
the lot, naming each rank that failed or never answered. `_Driver` probes every head before any
request (`engines.probe`) and refuses a speculative draft the plan does not cover.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Sequence

from ..engine_group import EngineGroup
from ..errors import Error, FailedPreconditionError, InvalidArgumentError, UnimplementedError
from .core import report_key

__all__ = ["HookError", "collect_reports", "check_reports"]


class HookError(Error):
    """One or more engine ranks reported a failure (or no report). `reports` holds every rank's
    status; `failures` the failed ones, in sync-rank order."""

    code = "hook_failed"

    def __init__(self, op: str, version: int, failures: List[Dict[str, Any]],
                 reports: List[Dict[str, Any]]) -> None:
        f = failures[0]
        more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
        super().__init__(
            f"{op} {version}: engine rank {f.get('rank')} (replica {f.get('replica')}, "
            f"tp {f.get('tp_rank')}, pp {f.get('pp_rank')}) failed: {f.get('error')}{more}")
        self.op, self.version, self.failures, self.reports = op, version, failures, reports


def collect_reports(plan: Any, config: Dict[str, Any], op: str, version: int, *,
                    timeout: float, replicas: Optional[Sequence[int]] = None
                    ) -> List[Dict[str, Any]]:
    """Every engine rank's status for (op, version), in sync-rank order. A rank with no report
    within `timeout` (one deadline for all) gets a synthesized failed status naming it."""
    from ..store import StoreClient

    deadline = time.monotonic() + timeout
    prefix = config.get("prefix", "ss/")
    client = StoreClient(config["store"], config.get("token", ""), timeout=max(timeout, 1.0))
    out: List[Dict[str, Any]] = []
    for d in (range(plan.dp) if replicas is None else replicas):
        for pp in range(plan.pp):
            for tp in range(plan.tp):
                rank = plan.engine_rank(d, tp, pp)
                key = report_key(prefix, op, version, d, pp, tp)
                coord = {"rank": rank, "replica": d, "tp_rank": tp, "pp_rank": pp}
                left = deadline - time.monotonic()
                try:
                    st = json.loads(client.get(key, timeout=max(left, 0.001)))
                    st.setdefault("rank", rank)
                except Error as e:
                    st = dict(coord, op=op, version=version, ok=False, code="no_report",
                              error=f"no report within {timeout:.0f}s ({type(e).__name__}: {e}); "
                                    "the rank may have died or never received the request")
                out.append(st)
    return out


def check_reports(reports: List[Dict[str, Any]], op: str, version: int) -> Dict[str, Any]:
    """Raises HookError if any rank failed; else a job summary."""
    failures = [r for r in reports if not r.get("ok")]
    if failures:
        raise HookError(op, version, failures, reports)
    summary: Dict[str, Any] = {"op": op, "version": version, "ranks": len(reports), "ok": True}
    if op == "sync":
        reps = [r.get("report") or {} for r in reports]
        summary["verified"] = all(bool(r.get("verified")) for r in reps)
        summary["bytes"] = reps[0].get("bytes") if reps else None
        summary["seconds"] = max((r.get("seconds") or 0.0) for r in reports)
        if not summary["verified"]:
            raise HookError(op, version, [dict(reports[0], error="report not verified")], reports)
    return summary


def _check_replies(method: str, replies: List[Any]) -> None:
    """SGLang replies (success, message) / objects with .success; a False names the replica."""
    for d, r in enumerate(replies):
        ok, msg = True, None
        if isinstance(r, tuple) and len(r) >= 1 and isinstance(r[0], bool):
            ok, msg = r[0], r[1] if len(r) > 1 else ""
        elif isinstance(r, dict) and isinstance(r.get("success"), bool):
            ok, msg = r["success"], r.get("message")
        elif hasattr(r, "success") and isinstance(getattr(r, "success"), bool):
            ok, msg = r.success, getattr(r, "message", "")
        if not ok:
            raise FailedPreconditionError(f"{method}: replica {d} answered failure: {msg}")


class _Driver:
    engine = "?"

    def __init__(self, group: Any, plan: Any, config: Dict[str, Any], *,
                 timeout: Optional[float] = None, draft: str = "refuse",
                 replicas: Optional[Sequence[int]] = None) -> None:
        if not isinstance(group, EngineGroup):
            group = EngineGroup(list(group), tp=1, pp=1)  # one handle per replica, heads only
        if draft not in ("refuse", "leave"):
            raise InvalidArgumentError(f"draft: must be refuse or leave, got {draft!r}")
        # `replicas`: the plan's replicas this group's heads are, in order (a driver per head,
        # e.g. UniRL's colocated ranks each driving their own engine); default all of them.
        self.replicas = list(range(plan.dp)) if replicas is None else [int(r) for r in replicas]
        if any(not 0 <= r < plan.dp for r in self.replicas) or \
                len(set(self.replicas)) != len(self.replicas):
            raise InvalidArgumentError(
                f"replicas {self.replicas}: distinct replica indices of the plan's dp={plan.dp}")
        if group.dp != len(self.replicas):
            raise InvalidArgumentError(
                f"group has {group.dp} replica(s), the plan's rollout dp={plan.dp}"
                + ("" if replicas is None else f" of which it drives {self.replicas}"))
        if plan.engine != self.engine:
            raise InvalidArgumentError(f"plan engine '{plan.engine}', driver for {self.engine}")
        for key in ("store",):
            if key not in config:
                raise InvalidArgumentError(f"config: missing '{key}'")
        self.group, self.plan = group, plan
        self.config = dict(config, plan=plan.spec, draft=draft)
        # The engine ranks join the trainer ranks' job: they take the trainers' launch id (this
        # process's, unless the config names one), not the engine processes' own environment.
        if "job_id" not in self.config:
            from .._native import native

            self.config["job_id"] = native("store").launch_job_id()
            # With the id, its secret (SHARDSYNC_JOB_SECRET): the engine ranks prove it to
            # claim their slots (docs/security.md "Job identity").
            self.config.setdefault("job_secret", native("store").launch_job_secret())
        self.timeout = float(timeout if timeout is not None else
                             float(config.get("connect_timeout", 60.0))
                             + float(config.get("sync_timeout", 60.0)) + 30.0)
        self.init_id = 0
        self.last_reports: List[Dict[str, Any]] = []
        # Staged commit (Plan(commit="staged")): rounds land in staging while the engines serve,
        # then one short in-place pause commits them (`_staged_round`).
        self.staged = getattr(plan, "commit", "inplace") == "staged"
        self.committed = 0
        self.precheck_layout = bool(config.get("precheck", True))

    def replica_config(self, d: int) -> Dict[str, Any]:
        """The config of the group's head `d` (the plan's replica `replicas[d]`)."""
        return dict(self.config, replica=self.replicas[d], init_id=self.init_id)

    def _collect(self, op: str, version: int) -> Dict[str, Any]:
        self.last_reports = collect_reports(self.plan, self.config, op, version,
                                            timeout=self.timeout, replicas=self.replicas)
        return check_reports(self.last_reports, op, version)

    # ---- staged commit: the engine-specific halves are _transfer (start the round, collect
    # every rank's report from the store while the engine serves, join), _commit_call, _pause,
    # _resume (driver_sglang.py, driver_vllm.py) ----
    def _staged_round(self, version: int) -> Dict[str, Any]:
        """Transfer while the engines serve (every rank verifies into staging), then pause in
        place, commit on every rank (a rank that cannot rolls every rank back), post-load,
        resume. The stall the engines see is the pause-to-resume interval only."""
        t0 = time.monotonic()
        out = self._transfer(version)
        out["transfer_seconds"] = time.monotonic() - t0
        commit = self.commit(version)
        out.update(stall_seconds=commit["stall_seconds"], commit=commit)
        return out

    def commit(self, version: int) -> Dict[str, Any]:
        """Pauses every replica in place, commits `version` (verified by the last round) on every
        engine rank, runs post-load, resumes; raises HookError naming the ranks that could not
        commit (every rank then serves the version it served before)."""
        if not self.staged:
            raise FailedPreconditionError("commit: the plan's commit is 'inplace'")
        p0 = time.monotonic()
        self._pause()
        try:
            self._commit_call("commit", version)
            out = self._collect("commit", version)
        finally:
            self._resume()
        out["stall_seconds"] = time.monotonic() - p0
        self.committed = int(version)
        return out

    def rollback(self) -> Dict[str, Any]:
        """Every engine rank back to the version committed before the last commit (bit for
        bit), under the same in-place pause."""
        if not self.staged or not self.committed:
            raise FailedPreconditionError("rollback: no staged commit to roll back")
        p0 = time.monotonic()
        self._pause()
        try:
            self._commit_call("rollback", self.committed)
            out = self._collect("rollback", self.committed)
        finally:
            self._resume()
        out["stall_seconds"] = time.monotonic() - p0
        return out

    def _refuse_asleep(self) -> None:
        asleep = self.group.asleep_replicas()
        if asleep:
            raise FailedPreconditionError(
                f"replica {asleep[0]} is asleep (weights released through this group): wake it "
                "(vLLM wake_up(tags=['weights']) / SGLang resume_memory_occupation) before a sync")

    def _new_init_id(self) -> int:
        # Unique per init so a stale report of an earlier init is never read as this one's.
        self.init_id = max(self.init_id + 1, int(time.time() * 1000) % (1 << 31))
        return self.init_id

    def precheck(self) -> int:
        """Plan-time refusal on the driver, from the heads' live config where readable (the
        ranks check again in their own processes, env included). Returns heads checked."""
        from .layout_check import check_layout

        n = 0
        for e in self.group.head_engines:
            facts = self._facts(e)
            if facts:
                check_layout(self.engine, self.plan, facts, self.config)
                n += 1
        return n

    def _facts(self, engine: Any) -> Dict[str, Any]:
        return {}

    def _probe(self) -> Any:
        """Every head's capabilities (one engine version per driver), the plan checked against
        them, and a speculative draft the plan does not cover refused."""
        from .engines import agree, check_plan, probe

        caps = agree([probe(e, self.engine) for e in self.group.head_engines])
        check_plan(caps, self.plan)
        if caps.draft and self.config["draft"] != "leave":
            raise UnimplementedError(
                f"{caps.label}: speculative decoding ({caps.draft}) runs a draft model the plan "
                "does not cover (its weights would go stale): launch without it, or pass "
                "draft='leave' to keep the draft's weights as they are")
        return caps
