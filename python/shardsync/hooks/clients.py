"""Engine handles the drivers call: an in-process SGLang adapter, and HTTP heads for
`launch_server` / `vllm serve` deployments (as verl and slime run them).

Every HTTP head answers `probe()` from its routes (engines.py), calls only the routes the engine
really has, and sends arguments where the route reads them:
- SGLang (entrypoints/http_server.py): POST /<method> with the keyword arguments as a JSON body;
  `/flush_cache` answers 200 or 400 (not flushed: requests running); `/get_server_info` carries
  the server args and `version`. A GET on a POST-only route answers 405 (the route exists), an
  unknown route 404: that is how the begin/end session routes are probed without opening one.
- vLLM: `/sleep?level=&mode=`, `/wake_up?tags=..&tags=..` (query parameters: a body is ignored
  and every tag wakes), GET `/is_sleeping`, and the RLHF routes (`/init_weight_transfer_engine`
  {"init_info"}, `/start_weight_update`, `/update_weights` {"update_info"},
  `/finish_weight_update`, `/pause`, `/resume`) are mounted only with `VLLM_SERVER_DEV_MODE=1`
  (entrypoints/serve/dev/*/api_router.py, registered by register_vllm_dev_api_routers); GET
  `/version` always answers.
"""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import FailedPreconditionError, InvalidArgumentError, UnimplementedError
from .engines import EngineCaps, parse_version

__all__ = ["SGLangEngineAdapter", "HTTPEngine", "SGLangHTTP", "VLLMHTTP"]


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
    lacks them (begin/end_weight_update, pause/continue_generation exist as io_struct requests and
    tokenizer-manager methods before Engine methods: entrypoints/engine.py). Each missing call
    becomes `engine.loop.run_until_complete(engine.tokenizer_manager.<method>(io_struct.<Request>
    (**kwargs), None))`. Which of them the engine really has is `engines.probe`'s answer (the
    io_struct classes), never this adapter's attributes."""

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


class _HTTP:
    engine = "?"

    def __init__(self, base_url: str, engine: str, timeout: float = 300.0) -> None:
        self.base_url, self.timeout = base_url.rstrip("/"), float(timeout)
        self._caps: Optional[EngineCaps] = None

    def _request(self, method: str, path: str, body: Any = None,
                 query: Optional[Sequence[Tuple[str, Any]]] = None) -> Tuple[int, Any]:
        """(HTTP status, decoded body); raises only for transport failures."""
        import urllib.error
        import urllib.parse
        import urllib.request

        url = f"{self.base_url}/{path}"
        if query:
            url += "?" + urllib.parse.urlencode([(k, str(v)) for k, v in query])
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                code, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            code, text = e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as e:
            from ..errors import UnavailableError

            raise UnavailableError(f"{url}: {e}")
        try:
            return code, json.loads(text or "null")
        except ValueError:
            return code, text

    def _http(self, method: str, path: str, body: Any = None,
              query: Optional[Sequence[Tuple[str, Any]]] = None) -> Any:
        code, out = self._request(method, path, body, query)
        if code >= 400:
            raise FailedPreconditionError(
                f"{self.base_url}/{path}: HTTP {code}: {str(out)[:500]}")
        return out

    def _route_exists(self, path: str) -> bool:
        """A GET on a POST-only route answers 405; a route that is not mounted, 404."""
        code, _ = self._request("GET", path)
        return code != 404

    def probe(self) -> EngineCaps:
        if self._caps is None:
            self._caps = self._probe()
        return self._caps

    def _probe(self) -> EngineCaps:
        raise NotImplementedError


class SGLangHTTP(_HTTP):
    """An SGLang server (`python -m sglang.launch_server`)."""

    engine = "sglang"

    def _info(self) -> Dict[str, Any]:
        info = self._http("GET", "get_server_info")
        if not isinstance(info, dict):
            raise UnimplementedError(f"{self.base_url}/get_server_info: not a JSON object")
        return info

    @property
    def server_args(self) -> Any:
        return SimpleNamespace(**self._info())

    def _probe(self) -> EngineCaps:
        from . import sglang as ss

        info = self._info()
        version = info.get("version")
        if not version or parse_version(version) is None:
            raise UnimplementedError(
                f"{self.base_url}/get_server_info reports no SGLang version ({version!r}): "
                "cannot decide its weight-update capabilities; refused")
        return EngineCaps(
            engine="sglang", version=str(version), http=True,
            source=f"http {self.base_url} (/get_server_info, route probes)",
            custom_loader="custom_weight_loader" in info,
            loader_listed=ss.LOADER in (info.get("custom_weight_loader") or []),
            session_api=self._route_exists("begin_weight_update"),
            receiver="weight_update_receivers" in info,
            receiver_listed=ss.RECEIVER in (info.get("weight_update_receivers") or []),
            draft=info.get("speculative_algorithm") or None,
            weight_cache=str(info.get("weight_cache_mode") or "off"),
            tp_size=int(info.get("tp_size") or 1),
        )

    def _post(self, name: str, **kwargs: Any) -> Any:
        out = self._http("POST", name, kwargs)
        if isinstance(out, dict) and isinstance(out.get("success"), bool):
            return out["success"], out.get("message", "")
        return out

    def update_weights_from_tensor(self, named_tensors: Any = None, load_format: Any = None,
                                   flush_cache: bool = True,
                                   serialized_named_tensors: Optional[List[str]] = None) -> Any:
        """Serializes a shardsync command per tp rank (the scheduler reads [tp_rank])."""
        from . import sglang as ss

        if serialized_named_tensors is None:
            serialized_named_tensors = ss.serialize_for_http(named_tensors, self.probe().tp_size)
        return self._post("update_weights_from_tensor",
                          serialized_named_tensors=serialized_named_tensors,
                          load_format=load_format, flush_cache=bool(flush_cache))

    def flush_cache(self) -> bool:
        code, _ = self._request("POST", "flush_cache")
        if code == 404:
            raise FailedPreconditionError(f"{self.base_url}/flush_cache: HTTP 404")
        return code == 200

    def destroy_weights_update_group(self, group_name: str) -> Any:
        return self._post("destroy_weights_update_group", group_name=group_name)

    def __getattr__(self, name: str) -> Any:
        if name in ("init_weights_update_group", "update_weights_from_distributed",
                    "begin_weight_update", "end_weight_update", "pause_generation",
                    "continue_generation", "release_memory_occupation",
                    "resume_memory_occupation"):
            return lambda **kwargs: self._post(name, **kwargs)
        raise AttributeError(f"sglang over HTTP has no route for {name!r}")


class VLLMHTTP(_HTTP):
    """A `vllm serve` server; weight sync needs `VLLM_SERVER_DEV_MODE=1` (module docstring)."""

    engine = "vllm"

    def _probe(self) -> EngineCaps:
        code, out = self._request("GET", "version")
        version = out.get("version") if isinstance(out, dict) else None
        parsed = parse_version(version)
        if code != 200 or parsed is None:
            raise UnimplementedError(
                f"{self.base_url}/version: HTTP {code} {str(out)[:200]}: cannot read the vLLM "
                "version; refused")
        dev = self._request("GET", "is_sleeping")[0] != 404
        native = dev and self._route_exists("start_weight_update")
        return EngineCaps(
            engine="vllm", version=str(version), http=True, dev_mode=dev,
            source=f"http {self.base_url} (/version, route probes)",
            native=native,
            # Who owns start / finish: only the version tells over HTTP (PR #44353, vLLM 0.25).
            # Either way start_weight_update sends is_checkpoint_format=False (below).
            lifecycle=(None if not native else "engine" if parsed >= (0, 25, 0) else "worker"),
            request_classes=True,  # the routes build the request objects themselves
            # RoutedExperts arrived in vLLM 0.24 (PR #41184); over HTTP only the version tells.
            expert_naming="routed_experts" if parsed >= (0, 24, 0) else "fused_moe",
        )

    def _dev(self, what: str) -> None:
        if not self.probe().dev_mode:
            raise UnimplementedError(
                f"vLLM {self.probe().version} at {self.base_url}: {what} is a dev-mode route; "
                "launch `vllm serve` with VLLM_SERVER_DEV_MODE=1")

    def is_sleeping(self) -> bool:
        self._dev("/is_sleeping")
        out = self._http("GET", "is_sleeping")
        return bool(out.get("is_sleeping") if isinstance(out, dict) else out)

    def sleep(self, level: int = 1, mode: str = "abort") -> Any:
        self._dev("/sleep")
        return self._http("POST", "sleep", query=[("level", int(level)), ("mode", mode)])

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> Any:
        """`tags` as repeated query parameters (the route reads query_params.getlist('tags'))."""
        self._dev("/wake_up")
        if isinstance(tags, str):
            tags = [tags]
        return self._http("POST", "wake_up", query=[("tags", t) for t in (tags or [])])

    def pause_generation(self, mode: str = "abort") -> Any:
        self._dev("/pause")
        return self._http("POST", "pause", query=[("mode", mode)])

    def resume_generation(self) -> Any:
        self._dev("/resume")
        return self._http("POST", "resume")

    def init_weight_transfer_engine(self, request: Any) -> Any:
        self._dev("/init_weight_transfer_engine")
        return self._http("POST", "init_weight_transfer_engine", _body(request, "init_info"))

    def update_weights(self, request: Any) -> Any:
        self._dev("/update_weights")
        return self._http("POST", "update_weights", _body(request, "update_info"))

    def start_weight_update(self, is_checkpoint_format: bool = False) -> Any:
        """Always says the format: before PR #44353 (vLLM < 0.25) the route reads
        `body.get("is_checkpoint_format", True)` and the worker then runs
        `initialize_layerwise_reload` itself (entrypoints/serve/dev/rlhf/api_router.py,
        v1/worker/gpu_worker.py of that generation), a reload shardsync's in-place writes never
        fill; from PR #44353 on the route reads no body, so the key is ignored there."""
        self._dev("/start_weight_update")
        return self._http("POST", "start_weight_update",
                          {"is_checkpoint_format": bool(is_checkpoint_format)})

    def finish_weight_update(self) -> Any:
        self._dev("/finish_weight_update")
        return self._http("POST", "finish_weight_update", {})


def _body(request: Any, key: str) -> Dict[str, Any]:
    if isinstance(request, dict):
        return {key: request[key]} if key in request else {key: request}
    return {key: getattr(request, key)}


def HTTPEngine(base_url: str, engine: str, timeout: float = 300.0) -> Any:  # noqa: N802
    """An engine server reached over HTTP: `SGLangHTTP` or `VLLMHTTP`."""
    if engine == "sglang":
        return SGLangHTTP(base_url, engine, timeout)
    if engine == "vllm":
        return VLLMHTTP(base_url, engine, timeout)
    raise InvalidArgumentError(f"engine: must be sglang or vllm, got {engine!r}")
