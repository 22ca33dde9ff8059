"""A fake vLLM that keeps vLLM's weight-transfer contract, version by version (a profile).

Mirrored from vLLM's own files (vllm/...):
- `LLM.collective_rpc(method, timeout=None, args=(), kwargs=None)` runs a method on every worker
  and re-raises a worker's exception (v1/executor);
- native weight transfer (distributed/weight_transfer/base.py, factory.py; PR #31943): the worker
  creates the backend through `WeightTransferEngineFactory.create_engine(config, vllm_config,
  device, model)` in `load_model`, and raises RuntimeError when none is configured; the worker
  methods are `init_weight_transfer_engine(init_info)`, `start_weight_update()`,
  `update_weights(update_info)`, `finish_weight_update()` (v1/worker/gpu_worker.py); start/finish
  exist from vLLM 0.22 (the four-phase API), in two generations: before PR #44353 (vLLM < 0.25,
  profiles 0.23 / 0.24) the worker owns them: `Worker.start_weight_update(is_checkpoint_format=
  True)` runs `initialize_layerwise_reload(model)` itself when True, `update_weights` parses the
  info and calls `engine.receive_weights(info, load_weights=model.load_weights)` (checkpoint
  format) or `load_weights=load_weights_direct`, `finish_weight_update` runs
  `finalize_layerwise_reload(model, model_config)` when the start was checkpoint format (the
  gpu_worker.py of that generation, read from a copy in the index); `LLM` / `AsyncLLM.
  start_weight_update(is_checkpoint_format=True)` pass it on, and the HTTP route reads
  `body.get("is_checkpoint_format", True)` (entrypoints/serve/dev/rlhf/api_router.py). From PR
  #44353 (profile 0.25) each engine owns start / finish and the route reads no body. Before
  0.22 (profile 0.21) the worker's single `update_weights` reads the parsed info's
  `is_checkpoint_format` (WeightTransferUpdateInfo, base.py) the same way;
- `model_loader/reload/layerwise.py`: `initialize_layerwise_reload` keeps each layer's served
  tensors aside (`info.kernel_tensors`) and registers meta placeholders in their place;
  `finalize_layerwise_reload` puts the served tensors back into every layer nothing was loaded
  into (`load_numel <= 0`) and re-runs attention layers' post-load;
- `LLM.init_weight_transfer_engine(request: WeightTransferInitRequest | dict)` and
  `update_weights(request)` call `collective_rpc(..., kwargs={"init_info": ...})`
  (entrypoints/llm.py); `AsyncLLM`'s are `async def`, take only the request objects (TypeError
  otherwise: v1/engine/async_llm.py) and run on the loop the engine was created on;
- `model_loader/utils.py::process_weights_after_loading`: quant methods, then attention layers;
- MoE backends (fused_moe/oracle/unquantized.py convert_to_unquantized_kernel_format): TRITON
  keeps w13 as loaded; FLASHINFER_CUTLASS swaps w13 -> w31 through replace_parameter;
- vLLM >= 0.24 (PR #41184): experts on `...mlp.experts.routed_experts.*` (RoutedExperts), and the
  module `model_executor/layers/fused_moe/routed_experts.py` exists;
- sleep mode: `CuMemAllocator.pointer_to_data` with AllocationData(handle, tag, is_mapped);
  `wake_up(tags)` maps only the tags given (None: all);
- `vllm serve` (entrypoints/serve/dev/*/api_router.py): `/sleep?level=&mode=`,
  `/wake_up?tags=` (query_params.getlist), GET `/is_sleeping`, and the RLHF routes exist only
  with VLLM_SERVER_DEV_MODE=1; GET `/version` always;
- pause / resume (issue 33): `PauseMode = Literal["abort", "wait", "keep"]` (v1/engine/
  __init__.py; "keep": freeze requests in the queue, they resume on `resume_generation()`), taken
  by `LLM` / `AsyncLLM.pause_generation(*, mode="abort", wait_for_inflight_requests=None,
  clear_cache=True)` (v1/engine/async_llm.py) and `EngineCore.pause_scheduler(mode, clear_cache)`
  (v1/engine/core.py: "keep" sets PAUSED_ALL, so no step runs, and completes once the output
  queue is empty: the running step ends first). Profiles without `pause_modes` have the older
  `pause_generation(*, wait_for_inflight_requests=False, clear_cache=True)`, which aborts or
  drains. `generate()` is one engine step over every worker: a fingerprint of each worker's
  parameters, all read in that step.

Version strings of the profiles are labels for the capability sets cited above.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, Tuple

import torch

from fakes_engines import Attention, _Group, _local, _module, current

__all__ = [
    "VLLMProfile",
    "VLLM_PROFILES",
    "AllocationData",
    "CuMemAllocator",
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferInitRequest",
    "WeightTransferUpdateRequest",
    "process_weights_after_loading",
    "vllm_modules",
    "vllm_config",
    "FakeWorker",
    "FakeLLM",
    "FakeAsyncLLM",
    "serve_vllm_http",
]


@dataclass(frozen=True)
class VLLMProfile:
    version: str
    native: bool = True  # distributed/weight_transfer/ (PR #31943)
    four_phase: bool = True  # start/finish_weight_update (vLLM 0.22)
    engine_owned: bool = False  # start/finish owned by the engine (PR #44353, vLLM 0.25)
    routed_experts: bool = False  # RoutedExperts (vLLM 0.24, PR #41184)
    pause_modes: Tuple[str, ...] = ("abort", "wait", "keep")  # v1/engine/__init__.py PauseMode


VLLM_PROFILES: Dict[str, VLLMProfile] = {
    "0.16": VLLMProfile("0.16.0", native=False, four_phase=False, pause_modes=()),
    "0.21": VLLMProfile("0.21.0", four_phase=False, pause_modes=()),
    "0.23": VLLMProfile("0.23.1"),
    "0.24": VLLMProfile("0.24.0", routed_experts=True),
    "0.25": VLLMProfile("0.25.0", engine_owned=True, routed_experts=True),
}


def _profile(p: Any) -> VLLMProfile:
    return VLLM_PROFILES[p] if isinstance(p, str) else p


# vllm/device_allocator/cumem.py AllocationData(handle, tag, cpu_backup_tensor=None,
# is_mapped=True) in the keep_tags version (is_mapped False after sleep, True after wake_up);
# handle = (py_device, py_alignedSize, py_d_mem, py_p_memHandle). Older cumem.py (010c211) has no
# is_mapped: only cpu_backup_tensor marks an offloaded allocation.
@dataclass
class AllocationData:
    handle: Tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None
    is_mapped: bool = True


class CuMemAllocator:
    # cumem.py CuMemAllocator: singleton via get_instance() (class attribute `instance` there),
    # pointer_to_data keyed by d_mem; wake_up(tags=None) maps only the tags given.
    _instance = None

    def __init__(self):
        self.pointer_to_data: Dict[int, AllocationData] = {}

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def track(self, tensors, tag="weights"):
        for t in tensors:
            n = t.numel() * t.element_size()
            self.pointer_to_data[t.data_ptr()] = AllocationData((0, n, t.data_ptr(), 0), tag)

    def sleep(self, offload_tags=()):
        for d in self.pointer_to_data.values():
            d.is_mapped = False

    def wake_up(self, tags=None):
        for d in self.pointer_to_data.values():
            if tags is None or d.tag in tags:
                d.is_mapped = True

    def asleep_tags(self):
        return {d.tag for d in self.pointer_to_data.values() if not d.is_mapped}


# distributed/weight_transfer/base.py WeightTransferInitRequest(init_info: dict) /
# WeightTransferUpdateRequest(update_info: dict), both dataclasses (vllm 02f250b).
@dataclass
class WeightTransferInitRequest:
    init_info: Dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    update_info: Dict[str, Any] = field(default_factory=dict)


class _WeightTransferEngineBase:
    """distributed/weight_transfer/base.py (the parts the worker calls), before vLLM 0.22.
    __init__(config, vllm_config, device, model), _default_model, parse_*_info raising
    ValueError on TypeError, update_weights -> parse_update_info -> receive_weights: as
    WeightTransferEngine in base.py at vllm 02f250b."""

    init_info_cls: Any = None
    update_info_cls: Any = None
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model):
        self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self._default_model = model

    def parse_init_info(self, init_dict):
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

    def parse_update_info(self, update_dict):
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {type(self).__name__}: {e}") from e

    def update_weights(self, update_info):
        self.receive_weights(self.parse_update_info(update_info))


class WeightTransferEngine(_WeightTransferEngineBase):
    """vLLM >= 0.25 (PR #44353): each engine owns start_weight_update / finish_weight_update."""

    def start_weight_update(self):
        raise NotImplementedError

    def finish_weight_update(self):
        raise NotImplementedError


def _base_class(profile: VLLMProfile) -> type:
    return WeightTransferEngine if profile.engine_owned else _WeightTransferEngineBase


class _LayerInfo:
    def __init__(self):
        self.kernel_tensors, self.load_numel = None, 0


def initialize_layerwise_reload(model):
    """model_loader/reload/layerwise.py: served tensors aside, meta placeholders in place."""
    for layer in model.modules():
        own = dict(layer._parameters)
        if not own:
            continue
        info = layer.__dict__.setdefault("_ss_fake_reload", _LayerInfo())
        info.kernel_tensors, info.load_numel = own, 0
        for name, t in own.items():
            if t is None:
                continue
            ph = torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"),
                                    requires_grad=False)
            for k, v in vars(t).items():
                setattr(ph, k, v)
            delattr(layer, name)
            layer.register_parameter(name, ph)


def finalize_layerwise_reload(model, model_config):
    """layerwise.py: attention layers get their served tensors back and re-run their post-load;
    so does every layer nothing was loaded into (load_numel <= 0)."""
    for layer in model.modules():
        info = layer.__dict__.get("_ss_fake_reload")
        if info is not None and info.kernel_tensors is not None and info.load_numel <= 0:
            for name in list(layer._parameters):
                delattr(layer, name)
            for name, t in info.kernel_tensors.items():
                layer.register_parameter(name, t)
            info.kernel_tensors = None
        if isinstance(layer, Attention):
            layer.process_weights_after_loading(model_config.dtype)


class WeightTransferEngineFactory:
    # distributed/weight_transfer/factory.py: register_engine(name, module_path_or_cls,
    # class_name=None) (ValueError on a duplicate), create_engine(config, vllm_config, device,
    # model) (ValueError "Invalid weight transfer backend").
    _registry: Dict[str, Callable[[], type]] = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = lambda: module_path_or_cls

    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        if config.backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {config.backend}.")
        return cls._registry[config.backend]()(config, vllm_config, device, model)


def process_weights_after_loading(model, model_config, target_device):
    """model_loader/utils.py: quant methods first, then attention layers."""
    for _, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(module)
    for _, module in model.named_modules():
        if isinstance(module, Attention):
            module.process_weights_after_loading(model_config.dtype)


def vllm_modules(profile: Any = "0.23") -> Dict[str, Any]:
    profile = _profile(profile)
    WeightTransferEngineFactory._registry = {}
    CuMemAllocator._instance = None
    mods = {
        "vllm": _module("vllm", __version__=profile.version),
        "vllm.distributed": _module("vllm.distributed"),
        "vllm.distributed.parallel_state": _module(
            "vllm.distributed.parallel_state",
            get_tensor_model_parallel_rank=lambda: current().tp_rank,
            get_pp_group=lambda: _Group(current().pp_rank, current().pp_size),
        ),
        "vllm.model_executor": _module("vllm.model_executor"),
        "vllm.model_executor.model_loader": _module("vllm.model_executor.model_loader"),
        "vllm.model_executor.model_loader.utils": _module(
            "vllm.model_executor.model_loader.utils",
            process_weights_after_loading=process_weights_after_loading),
        "vllm.model_executor.model_loader.reload": _module(
            "vllm.model_executor.model_loader.reload",
            initialize_layerwise_reload=initialize_layerwise_reload,
            finalize_layerwise_reload=finalize_layerwise_reload),
        "vllm.device_allocator": _module("vllm.device_allocator"),
        "vllm.device_allocator.cumem": _module("vllm.device_allocator.cumem",
                                               CuMemAllocator=CuMemAllocator),
    }
    if profile.native:
        base = _base_class(profile)
        if not profile.engine_owned:
            for name in ("start_weight_update", "finish_weight_update"):
                assert not hasattr(base, name)
        mods.update({
            "vllm.distributed.weight_transfer": _module("vllm.distributed.weight_transfer"),
            "vllm.distributed.weight_transfer.base": _module(
                "vllm.distributed.weight_transfer.base", WeightTransferEngine=base,
                WeightTransferInitRequest=WeightTransferInitRequest,
                WeightTransferUpdateRequest=WeightTransferUpdateRequest),
            "vllm.distributed.weight_transfer.factory": _module(
                "vllm.distributed.weight_transfer.factory",
                WeightTransferEngineFactory=WeightTransferEngineFactory),
        })
    if profile.pause_modes:
        from typing import Literal

        mods["vllm.v1"] = _module("vllm.v1")
        mods["vllm.v1.engine"] = _module("vllm.v1.engine",
                                         PauseMode=Literal[profile.pause_modes])
    if profile.routed_experts:
        for name in ("vllm.model_executor.layers", "vllm.model_executor.layers.fused_moe",
                     "vllm.model_executor.layers.fused_moe.routed_experts"):
            mods[name] = _module(name)
    return mods


def vllm_config(tp, pp, *, dp=1, dp_rank=0, backend=None, sleep_mode=False, spec=None, **over):
    pc = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              data_parallel_rank=dp_rank, enable_expert_parallel=False, enable_eplb=False,
              eplb_config=SimpleNamespace(num_redundant_experts=0),
              prefill_context_parallel_size=1, decode_context_parallel_size=1)
    mc = dict(quantization=None, enable_sleep_mode=sleep_mode, dtype=torch.float32)
    for k, v in over.items():
        (mc if k in mc else pc)[k] = v
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**pc), model_config=SimpleNamespace(**mc),
        weight_transfer_config=None if backend is None else SimpleNamespace(backend=backend),
        speculative_config=None if spec is None else SimpleNamespace(method=spec))


class FakeWorker:
    """v1/worker/gpu_worker.py Worker, the parts weight sync touches: load_model creates the
    engine with WeightTransferEngineFactory.create_engine(weight_transfer_config, vllm_config,
    device, model_runner.get_model()); _check_weight_transfer_engine raises the RuntimeError
    below. Four-phase profiles mirror the Worker's `_weight_update_active` flag, read in a recent
    v1/worker/gpu_worker.py with engine-owned start/finish (its commit not known to us; the copy
    read imports WeightTransferEngine / WeightTransferEngineFactory from
    vllm.distributed.weight_transfer): `Worker.__init__` sets it False; `start_weight_update`
    raises RuntimeError("start_weight_update called while a weight update is already active. Call
    finish_weight_update first.") when set, else calls the engine's start and sets it;
    `update_weights` raises "start_weight_update must be called before update_weights." when
    clear, and on any BaseException from the engine's update_weights clears it and re-raises;
    `finish_weight_update` raises "finish_weight_update called without a matching
    start_weight_update." when clear, else calls the engine's finish and clears it."""

    def __init__(self, rank, vllm_config, model, profile: VLLMProfile):
        self.rank, self.vllm_config, self.profile = rank, vllm_config, profile
        self.device = torch.device("cpu")
        self.model_runner = SimpleNamespace(model=model, get_model=lambda: model)
        self.weight_transfer_engine = None
        self._weight_update_active = False

    def load_model(self):
        if self.vllm_config.weight_transfer_config is not None:
            if not self.profile.native:
                raise TypeError("weight_transfer_config: unexpected argument (vLLM "
                                f"{self.profile.version} has no weight transfer engines)")
            self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
                self.vllm_config.weight_transfer_config, self.vllm_config, self.device,
                self.model_runner.get_model())

    def _engine(self):
        if self.weight_transfer_engine is None:
            raise RuntimeError("Weight transfer not configured. Please set "
                               "weight_transfer_config to enable weight transfer.")
        return self.weight_transfer_engine

    def init_weight_transfer_engine(self, init_info):
        e = self._engine()
        e.init_transfer_engine(e.parse_init_info(init_info))

    def start_weight_update(self, is_checkpoint_format=True):
        e = self._engine()
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already "
                               "active. Call finish_weight_update first.")
        if self.profile.engine_owned:
            e.start_weight_update()
        elif is_checkpoint_format:
            initialize_layerwise_reload(self.model_runner.get_model())
        self._is_checkpoint_format = is_checkpoint_format
        self._weight_update_active = True

    def _receive(self, e, typed, checkpoint):
        model = self.model_runner.get_model()

        def load_weights_direct(weights):
            for name, weight in weights:
                model.get_parameter(name).copy_(weight)

        e.receive_weights(typed, load_weights=getattr(model, "load_weights", None)
                          if checkpoint else load_weights_direct)

    def update_weights(self, update_info):
        e = self._engine()
        if not self.profile.four_phase:  # vLLM < 0.22: one call, the info says the format
            typed = e.parse_update_info(update_info)
            checkpoint = getattr(typed, "is_checkpoint_format", True)
            if checkpoint:
                initialize_layerwise_reload(self.model_runner.get_model())
            self._receive(e, typed, checkpoint)
            if checkpoint:
                finalize_layerwise_reload(self.model_runner.get_model(),
                                          self.vllm_config.model_config)
            return
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        if not self.profile.engine_owned:
            self._receive(e, e.parse_update_info(update_info), self._is_checkpoint_format)
            return
        try:
            e.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            raise

    def finish_weight_update(self):
        e = self._engine()
        if not self._weight_update_active:
            raise RuntimeError(
                "finish_weight_update called without a matching start_weight_update.")
        if self.profile.engine_owned:
            e.finish_weight_update()
        elif self._is_checkpoint_format:
            finalize_layerwise_reload(self.model_runner.get_model(),
                                      self.vllm_config.model_config)
        self._weight_update_active = False

    def sleep(self, level=1):
        CuMemAllocator.get_instance().sleep(offload_tags=("weights",) if level == 1 else ())

    def wake_up(self, tags=None):
        CuMemAllocator.get_instance().wake_up(tags)


class FakeLLM:
    """vllm.LLM of one replica: tp x pp workers, collective_rpc and the weight-sync API."""

    def __init__(self, models: Dict[Tuple[int, int], Any], vllm_config, *, extension=None,
                 profile: Any = "0.23", call_timeout: float = 60.0):
        pc = vllm_config.parallel_config
        self.profile = _profile(profile)
        self.vllm_config = vllm_config
        self.tp, self.pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        cls = FakeWorker if extension is None else type("Worker", (FakeWorker, extension), {})
        self.workers = {}
        self.call_timeout = call_timeout
        for p in range(self.pp):
            for t in range(self.tp):
                w = cls(p * self.tp + t, vllm_config, models[(t, p)], self.profile)
                w.load_model()
                self.workers[(t, p)] = w

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        results, errors, threads = {}, {}, []
        for (t, p), w in self.workers.items():
            def run(t=t, p=p, w=w):
                _local.proc = SimpleNamespace(tp_rank=t, pp_rank=p, tp_size=self.tp,
                                              pp_size=self.pp)
                try:
                    fn = method if callable(method) else getattr(w, method)
                    results[(t, p)] = fn(*args, **(kwargs or {}))
                except BaseException as e:  # noqa: BLE001
                    errors[(t, p)] = e
            th = threading.Thread(target=run, daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join(self.call_timeout)
            if th.is_alive():
                raise TimeoutError(f"collective_rpc({method}) did not return")
        if errors:
            k = sorted(errors)[0]
            raise RuntimeError(f"worker tp{k[0]}/pp{k[1]}: {errors[k]}") from errors[k]
        return [results[(t, p)] for p in range(self.pp) for t in range(self.tp)]

    # entrypoints/llm.py: a request object or its dict form.
    def init_weight_transfer_engine(self, request):
        info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})

    def update_weights(self, request):
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.collective_rpc("update_weights", kwargs={"update_info": info})

    def __new__(cls, *args, profile: Any = "0.23", **kwargs):
        p = _profile(profile)
        if cls is FakeLLM and p.four_phase:
            cls = _EngineOwnedLLM if p.engine_owned else _WorkerOwnedLLM
        elif cls is FakeLLM and not p.pause_modes:  # before PauseMode (module docstring)
            cls = _FakeLLMWithoutPauseModes
        return super().__new__(cls)

    # The engine core's sleep state (is_sleeping answers it; the allocator tracks tags).
    _sleeping = False

    def sleep(self, level=1):
        self.collective_rpc("sleep", args=(level,))
        self._sleeping = True

    def wake_up(self, tags=None):
        self.collective_rpc("wake_up", args=(tags,))
        self._sleeping = bool(CuMemAllocator.get_instance().asleep_tags())

    def is_sleeping(self):
        return self._sleeping

    # The engine core's pause (module docstring): "keep" holds every step until resume.
    _paused = None
    _forwards = 0

    @property
    def _step(self):
        if "_step_cond" not in self.__dict__:
            self.__dict__["_step_cond"] = threading.Condition()
        return self.__dict__["_step_cond"]

    def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None,
                         clear_cache=True):
        if mode not in self.profile.pause_modes:
            raise ValueError(f"Invalid pause mode: {mode}")
        with self._step:
            self._paused = mode
            self._step.wait_for(lambda: self._forwards == 0, self.call_timeout)
        return None

    def resume_generation(self):
        with self._step:
            self._paused = None
            self._step.notify_all()
        return None

    def generate(self, timeout: float = 60.0):
        """One engine step over every worker (module docstring): per (pp, tp), the sum and the
        sum of squares of the worker's parameters. Waits while a pause holds."""
        with self._step:
            if not self._step.wait_for(lambda: self._paused is None, timeout):
                raise TimeoutError("generate: the engine stayed paused")
            self._forwards += 1
        try:
            out = []
            for p in range(self.pp):
                for t in range(self.tp):
                    model = self.workers[(t, p)].model_runner.model
                    ps = [x.detach().double() for _, x in model.named_parameters()]
                    out.append((round(float(sum(x.sum() for x in ps)), 6),
                                round(float(sum((x * x).sum() for x in ps)), 6)))
            return tuple(out)
        finally:
            with self._step:
                self._forwards -= 1
                self._step.notify_all()


class _FakeLLMWithoutPauseModes(FakeLLM):
    """Versions before PauseMode: `pause_generation(*, wait_for_inflight_requests=False,
    clear_cache=True)` aborts in-flight requests (or drains them), no mode."""

    def pause_generation(self, *, wait_for_inflight_requests=False, clear_cache=True):
        return None


class _EngineOwnedLLM(FakeLLM):
    # entrypoints/llm.py (PR #44353 on): start_weight_update() / finish_weight_update().
    def start_weight_update(self):
        self.collective_rpc("start_weight_update")

    def finish_weight_update(self):
        self.collective_rpc("finish_weight_update")


class _WorkerOwnedLLM(FakeLLM):
    # entrypoints/llm.py before PR #44353: the format goes to the workers.
    def start_weight_update(self, is_checkpoint_format: bool = True):
        self.collective_rpc("start_weight_update",
                            kwargs={"is_checkpoint_format": is_checkpoint_format})

    def finish_weight_update(self):
        self.collective_rpc("finish_weight_update")


class FakeAsyncLLM:
    """v1/engine/async_llm.py AsyncLLM: every method `async def`, request objects only, bound to
    the event loop it was created on (its output handler runs there)."""

    def __init__(self, llm: FakeLLM, loop: asyncio.AbstractEventLoop):
        self._llm, self._loop = llm, loop
        self.vllm_config = llm.vllm_config

    def _check_loop(self):
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("Task got Future attached to a different loop")

    async def _rpc(self, method, **kw):
        self._check_loop()
        return await asyncio.to_thread(self._llm.collective_rpc, method, **kw)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await self._rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    async def init_weight_transfer_engine(self, request):
        if not isinstance(request, WeightTransferInitRequest):
            raise TypeError(f"Expected WeightTransferInitRequest, got {type(request)}")
        await self._rpc("init_weight_transfer_engine", kwargs={"init_info": request.init_info})

    async def update_weights(self, request):
        if not isinstance(request, WeightTransferUpdateRequest):
            raise TypeError(f"Expected WeightTransferUpdateRequest, got {type(request)}")
        await self._rpc("update_weights", kwargs={"update_info": request.update_info})

    def __new__(cls, llm, *args, **kwargs):
        if cls is FakeAsyncLLM and llm.profile.four_phase:
            cls = _EngineOwnedAsyncLLM if llm.profile.engine_owned else _WorkerOwnedAsyncLLM
        return super().__new__(cls)

    async def finish_weight_update(self, weight_version=None):
        await self._rpc("finish_weight_update")

    async def is_sleeping(self):
        self._check_loop()
        return self._llm.is_sleeping()


class _EngineOwnedAsyncLLM(FakeAsyncLLM):
    async def start_weight_update(self):
        await self._rpc("start_weight_update")


class _WorkerOwnedAsyncLLM(FakeAsyncLLM):
    # v1/engine/async_llm.py before PR #44353: collective_rpc("start_weight_update",
    # kwargs={"is_checkpoint_format": is_checkpoint_format}).
    async def start_weight_update(self, is_checkpoint_format: bool = True):
        await self._rpc("start_weight_update",
                        kwargs={"is_checkpoint_format": is_checkpoint_format})


def serve_vllm_http(llm: FakeLLM, *, dev_mode: bool = True):
    """`vllm serve` in front of `llm` on 127.0.0.1 (module docstring). Returns (url, server)."""
    import http.server
    from urllib.parse import parse_qs

    worker_owned = llm.profile.four_phase and not llm.profile.engine_owned
    dev_post = {"sleep", "wake_up", "pause", "resume", "init_weight_transfer_engine",
                "start_weight_update", "update_weights", "finish_weight_update"}

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _reply(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = self.path.lstrip("/").partition("?")[0]
            if path == "version":
                return self._reply(200, {"version": llm.profile.version})
            if dev_mode and path == "is_sleeping":
                return self._reply(200, {"is_sleeping": llm.is_sleeping()})
            if dev_mode and path in dev_post:
                return self._reply(405, {"detail": "Method Not Allowed"})
            self._reply(404, {"detail": "Not Found"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"null")
            path, _, query = self.path.lstrip("/").partition("?")
            q = parse_qs(query)
            if not dev_mode or path not in dev_post:
                return self._reply(404, {"detail": "Not Found"})
            try:
                if path == "sleep":
                    llm.sleep(int(q.get("level", ["1"])[0]))
                elif path == "wake_up":  # query_params.getlist("tags"); [] -> None (all)
                    llm.wake_up(q.get("tags") or None)
                elif path in ("pause", "resume"):
                    pass
                elif path == "init_weight_transfer_engine":
                    llm.init_weight_transfer_engine(
                        WeightTransferInitRequest(init_info=body["init_info"]))
                elif path == "update_weights":
                    llm.update_weights(WeightTransferUpdateRequest(update_info=body["update_info"]))
                elif path == "start_weight_update" and worker_owned:
                    # The route of that generation: body.get("is_checkpoint_format", True).
                    llm.start_weight_update(is_checkpoint_format=(body or {}).get(
                        "is_checkpoint_format", True))
                else:
                    getattr(llm, path)()
            except Exception as e:  # noqa: BLE001 - the server answers 500, as FastAPI does
                return self._reply(500, {"detail": f"{type(e).__name__}: {e}"})
            self._reply(200, {"message": "ok"})

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv
