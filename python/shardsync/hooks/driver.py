"""Driver side of the engine hooks: play each engine's call sequence, read every rank's report.

The engines answer a weight-update request from one rank only (SGLang: pp0/tp0; vLLM's
collective_rpc returns every worker's value but the native update API returns None), and the
hooks never raise, so the truth is in the store: every engine rank posts its status under
`<prefix>hooks/<op>/<version>/<replica>/<pp>/<tp>` and `collect_reports` reads all of them, with
one deadline for the lot, naming each rank that failed or never answered.

- `SGLangDriver`: init = `init_weights_update_group(receiver=RECEIVER, receiver_init_payload=...)`
  (external receiver) or [begin] `update_weights_from_tensor(init_request)` + wait [end] (custom
  loader); every sync = `begin_weight_update` -> start -> wait -> `end_weight_update` (begin/end
  when the engine has them: newer SGLang asserts the open session).
- `VLLMDriver`: init = `init_weight_transfer_engine({"init_info": config})` (native backend) or
  `collective_rpc("shardsync_init")` (extension); every sync = `start_weight_update` ->
  `update_weights({"update_info": {"version": v}})` -> `finish_weight_update`, or
  `collective_rpc("shardsync_sync")`.

Drivers run on the driver, not inside an engine, so they raise (`HookError`) when any rank
failed. Trainer ranks sync concurrently with `Session.sync(version)`.
"""

from __future__ import annotations

import inspect
import json
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..engine_group import EngineGroup
from ..errors import Error, FailedPreconditionError, InvalidArgumentError, UnimplementedError
from .core import report_key

__all__ = [
    "HookError",
    "collect_reports",
    "check_reports",
    "SGLangDriver",
    "VLLMDriver",
    "SGLangEngineAdapter",
    "HTTPEngine",
]


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
                 timeout: Optional[float] = None) -> None:
        if not isinstance(group, EngineGroup):
            group = EngineGroup(list(group), tp=1, pp=1)  # one handle per replica, heads only
        if group.dp != plan.dp:
            raise InvalidArgumentError(
                f"group has {group.dp} replica(s), the plan's rollout dp={plan.dp}")
        if plan.engine != self.engine:
            raise InvalidArgumentError(f"plan engine '{plan.engine}', driver for {self.engine}")
        for key in ("store",):
            if key not in config:
                raise InvalidArgumentError(f"config: missing '{key}'")
        self.group, self.plan = group, plan
        self.config = dict(config, plan=plan.spec)
        self.timeout = float(timeout if timeout is not None else
                             float(config.get("connect_timeout", 60.0))
                             + float(config.get("sync_timeout", 60.0)) + 30.0)
        self.init_id = 0
        self.last_reports: List[Dict[str, Any]] = []
        self.precheck_layout = bool(config.get("precheck", True))

    def replica_config(self, d: int) -> Dict[str, Any]:
        return dict(self.config, replica=d, init_id=self.init_id)

    def _collect(self, op: str, version: int) -> Dict[str, Any]:
        self.last_reports = collect_reports(self.plan, self.config, op, version,
                                            timeout=self.timeout)
        return check_reports(self.last_reports, op, version)

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

    def _heads_have(self, method: str) -> bool:
        return all(callable(getattr(e, method, None)) for e in self.group.head_engines)


class SGLangDriver(_Driver):
    """Plays SGLang's call sequences on every replica's head (see the module docstring).

    path: "receiver" (external receiver; SGLang launched with --weight-update-receivers
    shardsync.hooks.sglang.receiver), "loader" (--custom-weight-loader
    shardsync.hooks.sglang.load_weights), or "auto" (receiver when every head has
    `init_weights_update_group` accepting `receiver`, else loader). session: bracket with
    begin/end_weight_update ("auto": when the heads have them)."""

    engine = "sglang"

    def __init__(self, group: Any, plan: Any, config: Dict[str, Any], *, path: str = "auto",
                 session: Any = "auto", group_name: str = "shardsync",
                 timeout: Optional[float] = None) -> None:
        super().__init__(group, plan, config, timeout=timeout)
        from . import sglang as ss

        self.ss = ss
        if path == "auto":
            path = self._auto_path()
        if path not in ("receiver", "loader"):
            raise InvalidArgumentError(f"path: must be receiver, loader or auto, got {path!r}")
        self.path = path
        self.session = self._heads_have("begin_weight_update") if session == "auto" else session
        self.group_name = group_name

    def _auto_path(self) -> str:
        """receiver when every head's server args allowlist RECEIVER, loader when they list
        LOADER as a custom weight loader (read from the live engine)."""
        found = set()
        for e in self.group.head_engines:
            sa = getattr(e, "server_args", None)
            if sa is None:
                raise InvalidArgumentError(
                    "path='auto' cannot read the heads' server_args: pass path='receiver' "
                    "or path='loader'")
            if self.ss.RECEIVER in (getattr(sa, "weight_update_receivers", None) or ()):
                found.add("receiver")
            elif self.ss.LOADER in (getattr(sa, "custom_weight_loader", None) or ()):
                found.add("loader")
            else:
                raise InvalidArgumentError(
                    f"engine launched with neither --weight-update-receivers {self.ss.RECEIVER} "
                    f"nor --custom-weight-loader {self.ss.LOADER}")
        if len(found) != 1:
            raise InvalidArgumentError(f"replicas disagree on the path: {sorted(found)}")
        return found.pop()

    def _facts(self, engine: Any) -> Dict[str, Any]:
        from .layout_check import sglang_facts

        try:
            sa = getattr(engine, "server_args", None)
        except Error:
            return {}
        # The driver's environment is not the engine's: env-derived fields are checked by ranks.
        return {} if sa is None else sglang_facts(sa, env={})

    def _bracket(self, body: Callable[[], None]) -> None:
        if not self.session:
            body()
            return
        self.group.call("begin_weight_update")
        try:
            body()
        finally:
            # Always close the session: a second begin on an open one asserts in the scheduler.
            self.group.call("end_weight_update")

    def _loader(self, named: List[Tuple[str, Any]], flush_cache: bool = False) -> None:
        _check_replies("update_weights_from_tensor", self.group.call(
            "update_weights_from_tensor", named, load_format=self.ss.LOADER,
            flush_cache=flush_cache))

    def _receive(self, payload: Dict[str, Any], flush_cache: bool = False) -> None:
        _check_replies("update_weights_from_distributed", self.group.call(
            "update_weights_from_distributed", names=[], dtypes=[], shapes=[],
            group_name=self.group_name, receiver_payload=payload, flush_cache=flush_cache))

    def init(self) -> Dict[str, Any]:
        """Every scheduler binds and connects (collective with the trainers, which connect
        concurrently). Returns the init summary; raises HookError naming failed ranks."""
        if self.precheck_layout:
            self.precheck()
        init_id = self._new_init_id()
        host, _, port = self.config["store"].rpartition(":")
        if self.path == "receiver":
            def args(d: int) -> Tuple[Sequence[Any], Dict[str, Any]]:
                return (), dict(master_address=host, master_port=int(port),
                                rank_offset=self.plan.engine_rank(d, 0, 0),
                                world_size=self.plan.world_size, group_name=self.group_name,
                                receiver=self.ss.RECEIVER,
                                receiver_init_payload=self.replica_config(d))
            _check_replies("init_weights_update_group",
                           self.group.call_each("init_weights_update_group", args))
        else:
            def body() -> None:
                _check_replies("update_weights_from_tensor", self.group.call_each(
                    "update_weights_from_tensor",
                    lambda d: ((self.ss.init_request(self.replica_config(d)),),
                               {"load_format": self.ss.LOADER, "flush_cache": False})))
                self._loader(self.ss.wait_request())
            self._bracket(body)
        return self._collect("init", init_id)

    def sync(self, version: int) -> Dict[str, Any]:
        """One round: begin -> start -> wait -> end on every replica, then every rank's report."""
        self._refuse_asleep()
        v = int(version)

        def body() -> None:
            if self.path == "receiver":
                self._receive(self.ss.receiver_payload("start", version=v))
                self._receive(self.ss.receiver_payload("wait"), flush_cache=True)
            else:
                self._loader(self.ss.start_request(v))
                self._loader(self.ss.wait_request(), flush_cache=True)

        self._bracket(body)
        return self._collect("sync", v)

    def close(self) -> None:
        if self.path == "receiver" and self._heads_have("destroy_weights_update_group"):
            self.group.call("destroy_weights_update_group", self.group_name)
        elif self.path == "loader":
            self._bracket(lambda: self._loader(self.ss.close_request()))


class VLLMDriver(_Driver):
    """Plays vLLM's call sequences on every replica's head (see the module docstring).

    path: "native" (weight_transfer_config backend "shardsync"), "extension"
    (worker_extension_cls), or "auto" (native when the heads have init_weight_transfer_engine)."""

    engine = "vllm"

    def __init__(self, group: Any, plan: Any, config: Dict[str, Any], *, path: str = "auto",
                 timeout: Optional[float] = None) -> None:
        super().__init__(group, plan, config, timeout=timeout)
        from . import vllm as vh

        self.vh = vh
        if path == "auto":
            path = self._auto_path()
        if path not in ("native", "extension"):
            raise InvalidArgumentError(f"path: must be native, extension or auto, got {path!r}")
        self.path = path

    def _facts(self, engine: Any) -> Dict[str, Any]:
        from .layout_check import vllm_facts

        vc = getattr(engine, "vllm_config", None) or getattr(
            getattr(engine, "llm_engine", None), "vllm_config", None)
        return {} if vc is None else vllm_facts(vc, env={})

    def _auto_path(self) -> str:
        backends = set()
        for e in self.group.head_engines:
            vc = getattr(e, "vllm_config", None) or getattr(
                getattr(e, "llm_engine", None), "vllm_config", None)
            wtc = getattr(vc, "weight_transfer_config", None)
            backends.add(getattr(wtc, "backend", None) if vc is not None else "?")
        if backends == {self.vh.BACKEND}:
            return "native"
        if "?" in backends:
            raise InvalidArgumentError(
                "path='auto' cannot read the heads' vllm_config: pass path='native' "
                "(weight_transfer_config backend 'shardsync') or path='extension'")
        return "extension"

    def _refuse_sleeping(self) -> None:
        if self._heads_have("is_sleeping"):
            for d, s in enumerate(self.group.call("is_sleeping")):
                if s:
                    raise FailedPreconditionError(
                        f"replica {d} is sleeping (is_sleeping() is True): "
                        "wake_up(tags=['weights']) before a sync")

    def init(self) -> Dict[str, Any]:
        if self.precheck_layout:
            self.precheck()
        init_id = self._new_init_id()
        if self.path == "native":
            self.group.call_each("init_weight_transfer_engine",
                                 lambda d: ((self.vh.init_request(self.replica_config(d)),), {}))
        else:
            self.group.call_each("collective_rpc", lambda d: (
                ("shardsync_init",), {"args": (self.replica_config(d),)}))
        return self._collect("init", init_id)

    def sync(self, version: int) -> Dict[str, Any]:
        self._refuse_asleep()
        self._refuse_sleeping()
        v = int(version)
        if self.path == "native":
            self.group.call("start_weight_update")
            try:
                self.group.call("update_weights", self.vh.update_request(v))
            finally:
                self.group.call("finish_weight_update")
        else:
            self.group.call("collective_rpc", "shardsync_sync", args=(v,))
        return self._collect("sync", v)

    def close(self) -> None:
        if self.path == "extension":
            self.group.call("collective_rpc", "shardsync_close")


def _accepts(obj: Any, method: str, kwarg: str) -> bool:
    fn = getattr(obj, method, None)
    if not callable(fn):
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return kwarg in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


class SGLangEngineAdapter:
    """Gives an in-process `sglang.Engine` the methods the driver calls when its Python API
    lacks them: begin/end_weight_update, pause/continue_generation, and the receiver keywords of
    init_weights_update_group / update_weights_from_distributed exist as io_struct requests and
    tokenizer-manager methods (HTTP routes) before Engine methods (entrypoints/engine.py).
    Each missing call becomes `engine.loop.run_until_complete(
    engine.tokenizer_manager.<method>(io_struct.<Request>(**kwargs), None))`."""

    _REQUESTS = {
        "begin_weight_update": "BeginWeightUpdateReqInput",
        "end_weight_update": "EndWeightUpdateReqInput",
        "pause_generation": "PauseGenerationReqInput",
        "continue_generation": "ContinueGenerationReqInput",
        "init_weights_update_group": "InitWeightsUpdateGroupReqInput",
        "update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
        "release_memory_occupation": "ReleaseMemoryOccupationReqInput",
        "resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    }

    def __init__(self, engine: Any, io_struct: Any = None) -> None:
        self._engine = engine
        self._io = io_struct

    def _io_struct(self) -> Any:
        if self._io is None:
            import importlib

            self._io = importlib.import_module("sglang.srt.managers.io_struct")
        return self._io

    def __getattr__(self, name: str) -> Any:
        engine = object.__getattribute__(self, "_engine")
        if name not in self._REQUESTS:
            return getattr(engine, name)
        own = getattr(engine, name, None)

        def call(*args: Any, **kwargs: Any) -> Any:
            if callable(own) and not args and all(_accepts(engine, name, k) for k in kwargs):
                return own(**kwargs)
            if callable(own) and args:
                return own(*args, **kwargs)
            cls = getattr(self._io_struct(), self._REQUESTS[name], None)
            tm = getattr(engine, "tokenizer_manager", None)
            fn = getattr(tm, name, None)
            if cls is None or fn is None:
                raise UnimplementedError(
                    f"this SGLang has no {name} ({self._REQUESTS[name]} / tokenizer_manager."
                    f"{name}): upgrade SGLang, or use a path that does not need it")
            return engine.loop.run_until_complete(fn(cls(**kwargs), None))

        return call


class HTTPEngine:
    """An engine server reached over HTTP, with the method names the drivers call: JSON in, JSON
    out, so the receiver (SGLang) and native (vLLM) paths work against `launch_server` / `vllm
    serve` deployments, as verl and slime run them.

    SGLang routes (entrypoints/http_server.py): POST /<method> with the keyword arguments as the
    body (`/init_weights_update_group`, `/update_weights_from_distributed`, `/begin_weight_update`,
    `/end_weight_update`, `/pause_generation`, `/continue_generation`,
    `/release_memory_occupation`, `/resume_memory_occupation`, `/destroy_weights_update_group`,
    `/flush_cache`); server args from GET /get_server_info. vLLM routes
    (entrypoints/serve/dev/rlhf/api_router.py, as its HTTPVLLMWeightSyncClient posts them):
    `/init_weight_transfer_engine` {"init_info"}, `/start_weight_update`, `/update_weights`
    {"update_info"}, `/finish_weight_update`, plus `/pause`, `/resume`, `/sleep?level=`,
    `/wake_up`, GET `/is_sleeping`. The loader path (tensor payloads) is not offered over HTTP."""

    _SGLANG = ("init_weights_update_group", "update_weights_from_distributed",
               "begin_weight_update", "end_weight_update", "pause_generation",
               "continue_generation", "release_memory_occupation", "resume_memory_occupation",
               "destroy_weights_update_group", "flush_cache")
    _VLLM = {"init_weight_transfer_engine": "init_weight_transfer_engine",
             "start_weight_update": "start_weight_update", "update_weights": "update_weights",
             "finish_weight_update": "finish_weight_update", "pause_generation": "pause",
             "resume_generation": "resume", "wake_up": "wake_up"}

    def __init__(self, base_url: str, engine: str, timeout: float = 300.0) -> None:
        if engine not in ("sglang", "vllm"):
            raise InvalidArgumentError(f"engine: must be sglang or vllm, got {engine!r}")
        self.base_url, self.engine, self.timeout = base_url.rstrip("/"), engine, float(timeout)

    def _http(self, method: str, path: str, body: Any = None) -> Any:
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base_url}/{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                text = r.read().decode() or "null"
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise FailedPreconditionError(f"{self.base_url}/{path}: HTTP {e.code}: {detail}")
        except (urllib.error.URLError, OSError) as e:
            from ..errors import UnavailableError

            raise UnavailableError(f"{self.base_url}/{path}: {e}")
        try:
            return json.loads(text)
        except ValueError:
            return text

    @property
    def server_args(self) -> Any:
        if self.engine != "sglang":
            raise AttributeError("server_args")
        from types import SimpleNamespace

        return SimpleNamespace(**self._http("GET", "get_server_info"))

    def is_sleeping(self) -> bool:
        if self.engine != "vllm":
            raise UnimplementedError("is_sleeping is a vLLM route")
        out = self._http("GET", "is_sleeping")
        return bool(out.get("is_sleeping") if isinstance(out, dict) else out)

    def sleep(self, level: int = 1) -> Any:
        return self._http("POST", f"sleep?level={int(level)}")

    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> Any:
        raise UnimplementedError(
            "the custom-loader path sends pickled payloads; over HTTP use the external "
            "receiver path (SGLangDriver(path='receiver'))")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self.engine == "sglang" and name in self._SGLANG:
            def call(*args: Any, **kwargs: Any) -> Any:
                if args:  # destroy_weights_update_group(group_name)
                    kwargs = dict(kwargs, group_name=args[0])
                return self._http("POST", name, kwargs)
            return call
        if self.engine == "vllm" and name in self._VLLM:
            route = self._VLLM[name]

            def vcall(*args: Any, **kwargs: Any) -> Any:
                body = args[0] if args else (kwargs or None)
                return self._http("POST", route, body)
            return vcall
        raise AttributeError(f"{self.engine} over HTTP has no route for {name!r}")
