"""Fake SGLang and vLLM engines that reproduce, on CPU, the behaviours the hooks must survive.

Each behaviour is taken from the engines' source (the hooks' docstrings cite the files):

SGLang (FakeSGLangEngine)
- one scheduler per (pp, tp), each a persistent thread (its own "process": thread-local parallel
  state and server args, read by the fake `sglang.srt.*` modules below);
- a control request is handled by every scheduler of stage 0, then forwarded to stage 1, ...
  (handle before forward); only pp0/tp0's answer is returned;
- update_weights_from_tensor pickles `named_tensors` once per tp rank with SGLang's patched
  reductions, whose unguarded `_modify_tuple` indexes arg 6 of a reduced tensor (IndexError for
  CPU tensors, UniRL #503), every stage reads `payloads[tp_rank]` (stage-local), values go
  through `.to(device)`, and the custom loader is called with no try: an exception kills the
  scheduler and with it the engine;
- newer versions (session_api=True) assert an open begin_weight_update session around every
  update; end_weight_update runs post_load_weights only when no load_weights ran
  (run_post_load = not loaded) and always the quant methods' process_weights_after_loading;
- external receivers: allowlisted factory, receive(payload) inside a try (failure -> success
  False in the reply, which only pp0/tp0 gives).

vLLM (FakeLLM / FakeWorker)
- collective_rpc runs a method on every worker concurrently and re-raises a worker's exception;
- native weight transfer: the worker creates the backend through WeightTransferEngineFactory in
  load_model and raises RuntimeError when none is configured; init / start / update / finish;
- model_loader.utils.process_weights_after_loading runs every quant method's
  process_weights_after_loading, then attention layers';
- MoE backends: TRITON keeps w13 as loaded; FLASHINFER_CUTLASS swaps w13 -> w31 through
  replace_parameter (a new tensor);
- sleep mode: CuMemAllocator.pointer_to_data with AllocationData(handle, tag, is_mapped).
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import queue
import sys
import threading
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

# ---------------------------------------------------------------------------------------------
# Model building blocks: layers named like the engines' classes, with bound weight loaders
# ---------------------------------------------------------------------------------------------


class _Layer(nn.Module):
    def weight_loader(self, param, loaded_weight, shard_id=None):  # the engines' signature
        param.data.copy_(loaded_weight)


class VocabParallelEmbedding(_Layer):
    pass


class ParallelLMHead(VocabParallelEmbedding):
    pass


class ColumnParallelLinear(_Layer):
    pass


class QKVParallelLinear(ColumnParallelLinear):
    pass


class MergedColumnParallelLinear(ColumnParallelLinear):
    pass


class RowParallelLinear(_Layer):
    pass


class ReplicatedLinear(_Layer):
    pass


class FusedMoE(_Layer):
    pass


class RMSNorm(nn.Module):
    pass


class Attention(nn.Module):
    """Derived weights rebuilt after load (vLLM: Attention/MLA process_weights_after_loading;
    SGLang: model.post_load_weights). Here: the sum of the layer's qkv weight."""

    def __init__(self, qkv: nn.Module):
        super().__init__()
        self._qkv = [qkv]  # not a submodule: no duplicate parameters
        self.register_buffer("derived", torch.zeros((), device=qkv.weight.device))
        self.rebuilds = 0

    def process_weights_after_loading(self, act_dtype=None):
        self.derived.copy_(self._qkv[0].weight.detach().double().sum().float())
        self.rebuilds += 1


def replace_parameter(mod: nn.Module, name: str, new: torch.Tensor) -> None:
    """vLLM quantization/utils/layer_utils.py: re-register a new Parameter (new storage)."""
    old = getattr(mod, name)
    p = nn.Parameter(new, requires_grad=False)
    for k, v in vars(old).items():
        setattr(p, k, v)
    delattr(mod, name)
    mod.register_parameter(name, p)


class UnquantizedLinearMethod:
    def __init__(self, replace_on_finalize: bool = False):
        self.replace_on_finalize = replace_on_finalize
        self.finalized = 0

    def process_weights_after_loading(self, layer):
        self.finalized += 1
        if self.replace_on_finalize:  # a finalize that swaps the bound tensor
            replace_parameter(layer, "weight", layer.weight.detach().clone())


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
    pass


class Fp8LinearMethod(UnquantizedLinearMethod):
    pass


class UnquantizedMoeBackend:
    def __init__(self, name):
        self.name = name


class UnquantizedFusedMoEMethod:
    def __init__(self, backend: str = "TRITON"):
        self.unquantized_backend = UnquantizedMoeBackend(backend)
        self.finalized = 0

    def process_weights_after_loading(self, layer):
        self.finalized += 1
        if self.unquantized_backend.name == "FLASHINFER_CUTLASS":
            # fused_moe/oracle/unquantized.py: swap_w13_to_w31, then replace_parameter.
            w = layer.w13_weight.detach()
            half = w.shape[1] // 2
            replace_parameter(layer, "w13_weight", torch.cat([w[:, half:], w[:, :half]], dim=1))


_KIND_CLASS = [
    ("embed_tokens.weight", VocabParallelEmbedding, {"output_dim": 0}),
    ("lm_head.weight", ParallelLMHead, {"output_dim": 0}),
    ("qkv_proj.weight", QKVParallelLinear, {"output_dim": 0, "input_dim": 1}),
    ("qkv_proj.bias", QKVParallelLinear, {"output_dim": 0}),
    ("gate_up_proj.weight", MergedColumnParallelLinear, {"output_dim": 0, "input_dim": 1}),
    ("o_proj.weight", RowParallelLinear, {"output_dim": 0, "input_dim": 1}),
    ("down_proj.weight", RowParallelLinear, {"output_dim": 0, "input_dim": 1}),
    ("mlp.gate.weight", ReplicatedLinear, {"output_dim": 0, "input_dim": 1}),
    ("w13_weight", FusedMoE, {}),
    ("w2_weight", FusedMoE, {}),
]


class FakeModel(nn.Module):
    """An engine rank's model: the shard map's parameters (engine names, local shapes) on layers
    of the engines' classes, each with its bound weight_loader and sharded-dim attributes."""

    def __init__(self, params, *, moe_backend="TRITON", overrides=None, replace_linear=(),
                 quant=None, extra=(), device="cpu", dtype=torch.float32):
        super().__init__()
        overrides = overrides or {}
        self._device, self._dtype = torch.device(device), dtype
        self.attention = []
        for p in params:
            self._add(p.name, list(overrides.get(p.name, p.shape)), moe_backend,
                      p.name in replace_linear, quant)
        for name, shape in extra:
            self._add(name, list(shape), moe_backend, False, quant)
        for mname, m in list(self.named_modules()):
            if isinstance(m, QKVParallelLinear) and mname.endswith("self_attn.qkv_proj"):
                attn = Attention(m)
                parent = self.get_submodule(mname.rsplit(".", 1)[0])
                parent.add_module("attn", attn)
                self.attention.append(attn)
        self.post_loads = 0

    def _module(self, path: str, cls) -> nn.Module:
        mod: nn.Module = self
        parts = path.split(".")
        for i, part in enumerate(parts):
            child = mod._modules.get(part)
            if child is None:
                child = (cls if i == len(parts) - 1 else nn.Module)()
                mod.add_module(part, child)
            mod = child
        return mod

    def _add(self, name, shape, moe_backend, replace, quant):
        owner_path, _, pname = name.rpartition(".")
        cls, attrs = RMSNorm, {}
        for suffix, c, a in _KIND_CLASS:
            if name.endswith(suffix):
                cls, attrs = c, a
                break
        mod = self._module(owner_path, cls)
        param = nn.Parameter(torch.zeros(shape, dtype=self._dtype, device=self._device),
                             requires_grad=False)
        if isinstance(mod, _Layer):
            param.weight_loader = mod.weight_loader
            for k, v in attrs.items():
                setattr(param, k, v)
        mod.register_parameter(pname, param)
        if isinstance(mod, FusedMoE):
            if not hasattr(mod, "quant_method"):
                mod.quant_method = UnquantizedFusedMoEMethod(moe_backend)
        elif isinstance(mod, _Layer) and not hasattr(mod, "quant_method"):
            if quant is not None and isinstance(mod, (RowParallelLinear, ColumnParallelLinear)):
                mod.quant_method = quant()
            elif isinstance(mod, VocabParallelEmbedding):
                mod.quant_method = UnquantizedEmbeddingMethod()
            else:
                mod.quant_method = UnquantizedLinearMethod(replace_on_finalize=replace)

    def post_load_weights(self):  # SGLang models that keep derived weights expose this
        self.post_loads += 1
        for a in self.attention:
            a.process_weights_after_loading()

    def tensor(self, name):
        return dict(self.named_parameters())[name]


# ---------------------------------------------------------------------------------------------
# Installing fake engine modules
# ---------------------------------------------------------------------------------------------

_local = threading.local()  # the calling "process": its ranks and engine config


def current():
    st = getattr(_local, "proc", None)
    if st is None:
        raise ImportError("not inside a fake engine process")  # as if the engine were absent
    return st


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    m.__path__ = []  # importable as a package
    return m


class _Group:
    def __init__(self, rank, size):
        self.rank_in_group, self.world_size = rank, size


@contextlib.contextmanager
def installed(modules: Dict[str, types.ModuleType]):
    """Puts fake modules in sys.modules for the test, then restores what was there."""
    saved = {k: sys.modules.get(k) for k in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


# ---- SGLang modules ----


def sglang_modules() -> Dict[str, types.ModuleType]:
    def post_load_weights(model):  # model_loader: run the model's own hook when it has one
        hook = getattr(model, "post_load_weights", None)
        if callable(hook):
            hook()

    return {
        "sglang": _module("sglang"),
        "sglang.srt": _module("sglang.srt"),
        "sglang.srt.distributed": _module(
            "sglang.srt.distributed",
            get_tensor_model_parallel_rank=lambda: current().tp_rank,
            get_tensor_model_parallel_world_size=lambda: current().tp_size,
            get_pp_group=lambda: _Group(current().pp_rank, current().pp_size),
        ),
        "sglang.srt.server_args": _module(
            "sglang.srt.server_args", get_global_server_args=lambda: current().server_args),
        "sglang.srt.model_loader": _module("sglang.srt.model_loader"),
        "sglang.srt.model_loader.loader": _module(
            "sglang.srt.model_loader.loader", post_load_weights=post_load_weights),
    }


def sglang_server_args(tp, pp, **over):
    args = dict(tp_size=tp, pp_size=pp, dp_size=1, ep_size=1, enable_dp_attention=False,
                enable_dp_lm_head=False, attn_cp_size=1, moe_dp_size=1, moe_dense_tp_size=None,
                ep_num_redundant_experts=0, enable_eplb=False, quantization=None,
                moe_runner_backend="auto", moe_a2a_backend="none", weight_cache_mode="off",
                enable_memory_saver=False,
                custom_weight_loader=["shardsync.hooks.sglang.load_weights"],
                weight_update_receivers=["shardsync.hooks.sglang.receiver"])
    args.update(over)
    return SimpleNamespace(**args)


def _modify_tuple_unguarded(t, index, modifier):
    # Older SGLang utils/patch_torch.py, before the length guard.
    return (*t[:index], modifier(t[index]), *t[index + 1:])


class _SGLangPickler(pickle.Pickler):
    """MultiprocessingSerializer with monkey_patch_torch_reductions applied."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            from torch.multiprocessing import reductions

            fn, args = reductions.reduce_tensor(obj)
            return fn, _modify_tuple_unguarded(args, 6, lambda dev: f"GPU-uuid-{dev}")
        return NotImplemented


def sglang_serialize(obj) -> bytes:
    import io

    buf = io.BytesIO()
    _SGLangPickler(buf).dump(obj)
    return buf.getvalue()


class SchedulerDied(RuntimeError):
    pass


@dataclass
class _SchedProc:
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    server_args: Any
    model: Any
    in_session: bool = False
    loaded: bool = False
    receivers: Dict[str, Any] = field(default_factory=dict)
    alive: bool = True


class FakeSGLangEngine:
    """One SGLang engine (one DP replica) of tp x pp schedulers; see the module docstring."""

    def __init__(self, models: Dict[Tuple[int, int], Any], tp: int, pp: int, *,
                 session_api: bool = True, receivers: bool = True, server_args=None,
                 stage_timeout: float = 60.0):
        self.tp, self.pp = tp, pp
        self.server_args = server_args or sglang_server_args(tp, pp)
        self.session_api = session_api
        self.receivers = receivers
        self.stage_timeout = stage_timeout
        self.dead: Optional[str] = None
        self.calls: List[str] = []
        self.procs = {(t, p): _SchedProc(t, p, tp, pp, self.server_args, models[(t, p)])
                      for p in range(pp) for t in range(tp)}
        self._inbox = {k: queue.Queue() for k in self.procs}
        self._threads = [threading.Thread(target=self._loop, args=(k,), daemon=True,
                                          name=f"sched-pp{k[1]}-tp{k[0]}") for k in self.procs]
        for t in self._threads:
            t.start()
        if not session_api:  # older SGLang: no begin/end on the engine
            self.begin_weight_update = None  # type: ignore[assignment]
            self.end_weight_update = None  # type: ignore[assignment]
        if not receivers:
            self.init_weights_update_group = self._init_group_old  # type: ignore[assignment]

    # ---- scheduler processes ----
    def _loop(self, key):
        _local.proc = self.procs[key]
        while True:
            item = self._inbox[key].get()
            if item is None:
                return
            fn, box, done = item
            try:
                box["value"] = fn(self.procs[key])
            except BaseException as e:  # noqa: BLE001 - an uncaught exception kills the process
                box["error"] = e
                self.procs[key].alive = False
            done.set()

    def _request(self, name: str, handler: Callable[[_SchedProc], Any]) -> Any:
        self.calls.append(name)
        if self.dead:
            raise SchedulerDied(f"engine is dead: {self.dead}")
        reply = None
        for p in range(self.pp):  # handle on stage p, then forward to p + 1
            boxes = []
            for t in range(self.tp):
                box, done = {}, threading.Event()
                self._inbox[(t, p)].put((handler, box, done))
                boxes.append((t, box, done))
            for t, box, done in boxes:
                if not done.wait(self.stage_timeout):
                    self.dead = f"scheduler pp{p}/tp{t} hung in {name}"
                    raise SchedulerDied(self.dead)
                if "error" in box:
                    e = box["error"]
                    self.dead = f"scheduler pp{p}/tp{t} died in {name}: {type(e).__name__}: {e}"
                    raise SchedulerDied(self.dead) from e
                if (t, p) == (0, 0):
                    reply = box.get("value")
        return reply

    def shutdown(self):
        """Ends the scheduler "processes": their shardsync sessions close with them."""
        def bye(s):
            for r in s.receivers.values():
                r.destroy()
            s.receivers.clear()
            from shardsync.hooks import sglang as ss

            ss.close()

        for k in self.procs:
            done = threading.Event()
            self._inbox[k].put((bye, {}, done))
            done.wait(30)
            self._inbox[k].put(None)

    # ---- requests ----
    def begin_weight_update(self, selector="all"):
        def h(s):
            assert not s.in_session, "begin_weight_update called while a session is already open"
            s.in_session, s.loaded = True, False
            return True, "Success"
        return self._request("begin_weight_update", h)

    def end_weight_update(self):
        def h(s):
            assert s.in_session, "end_weight_update called without begin_weight_update"
            if not s.loaded:
                s.model.post_load_weights()
            for _, m in s.model.named_modules():  # DefaultModelLoader.postprocess_weights
                qm = getattr(m, "quant_method", None)
                if qm is not None:
                    qm.process_weights_after_loading(m)
            s.in_session = False
            return True, "Success"
        return self._request("end_weight_update", h)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        payloads = [sglang_serialize(named_tensors) for _ in range(self.tp)]  # per tp rank

        def h(s):
            if self.session_api:
                assert s.in_session, ("update_weights_from_tensor requires an open "
                                      "begin_weight_update session")
            named = pickle.loads(payloads[s.tp_rank])  # stage-local tp_rank: PP stages share
            named = [(n, t.to("cpu")) for n, t in named]  # _unwrap_tensor
            if load_format in s.server_args.custom_weight_loader:
                mod, _, fn = load_format.rpartition(".")
                getattr(importlib.import_module(mod), fn)(s.model, named)  # no try
            else:
                raise NotImplementedError(f"Unknown load_format={load_format}")
            s.loaded = True
            return True, "Success"
        return self._request("update_weights_from_tensor", h)

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl",
                                  receiver=None, receiver_init_payload=None):
        def h(s):
            if receiver is None:
                return False, "torch process groups are not faked"
            if receiver not in (s.server_args.weight_update_receivers or ()):
                return False, f"receiver {receiver!r} is not listed in --weight-update-receivers"
            try:
                mod, _, fn = receiver.rpartition(".")
                ctx = SimpleNamespace(model=s.model, device=torch.device("cpu"),
                                      tp_rank=s.tp_rank, tp_size=s.tp_size, group_name=group_name,
                                      master_address=master_address, master_port=master_port,
                                      world_size=world_size, rank_offset=rank_offset,
                                      init_payload=receiver_init_payload)
                s.receivers[group_name] = getattr(importlib.import_module(mod), fn)(ctx)
            except Exception as e:  # noqa: BLE001 - the updater catches factory failures
                return False, f"Failed to initialize external weight-update receiver: {e}."
            return True, "Succeeded to initialize external weight-update receiver."
        return self._request("init_weights_update_group", h)

    def _init_group_old(self, master_address, master_port, rank_offset, world_size,
                        group_name="weight_update_group", backend="nccl"):
        return False, "torch process groups are not faked"

    def update_weights_from_distributed(self, names, dtypes, shapes,
                                        group_name="weight_update_group", flush_cache=True,
                                        load_format=None, receiver_payload=None):
        def h(s):
            if self.session_api:
                assert s.in_session, ("update_weights_from_distributed requires an open "
                                      "begin_weight_update session")
            try:
                s.receivers[group_name].receive(receiver_payload)
                ok, msg = True, "Succeeded to update parameter online."
            except Exception as e:  # noqa: BLE001 - scheduler_components/weight_updater.py
                ok, msg = False, f"Failed to update parameter online: {e}."
            if ok:
                s.loaded = True
            return ok, msg
        return self._request("update_weights_from_distributed", h)

    def destroy_weights_update_group(self, group_name):
        def h(s):
            r = s.receivers.pop(group_name, None)
            if r is None:
                return False, "The group to be destroyed does not exist."
            r.destroy()
            return True, "Succeeded to destroy external weight-update receiver."
        return self._request("destroy_weights_update_group", h)

    def release_memory_occupation(self, tags=None):
        return self._request("release_memory_occupation", lambda s: None)

    def resume_memory_occupation(self, tags=None):
        return self._request("resume_memory_occupation", lambda s: None)

    def pause_generation(self):
        return self._request("pause_generation", lambda s: None)

    def continue_generation(self):
        return self._request("continue_generation", lambda s: None)

    def flush_cache(self):
        return self._request("flush_cache", lambda s: True)


# ---- vLLM modules ----


@dataclass
class AllocationData:
    handle: Tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None
    is_mapped: bool = True


class CuMemAllocator:
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


class WeightTransferEngine:
    """distributed/weight_transfer/base.py (the parts the worker calls)."""

    init_info_cls: Any = None
    update_info_cls: Any = None

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


class WeightTransferEngineFactory:
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


def vllm_modules() -> Dict[str, types.ModuleType]:
    WeightTransferEngineFactory._registry = {}
    CuMemAllocator._instance = None
    return {
        "vllm": _module("vllm"),
        "vllm.distributed": _module("vllm.distributed"),
        "vllm.distributed.parallel_state": _module(
            "vllm.distributed.parallel_state",
            get_tensor_model_parallel_rank=lambda: current().tp_rank,
            get_pp_group=lambda: _Group(current().pp_rank, current().pp_size),
        ),
        "vllm.distributed.weight_transfer": _module("vllm.distributed.weight_transfer"),
        "vllm.distributed.weight_transfer.base": _module(
            "vllm.distributed.weight_transfer.base", WeightTransferEngine=WeightTransferEngine),
        "vllm.distributed.weight_transfer.factory": _module(
            "vllm.distributed.weight_transfer.factory",
            WeightTransferEngineFactory=WeightTransferEngineFactory),
        "vllm.model_executor": _module("vllm.model_executor"),
        "vllm.model_executor.model_loader": _module("vllm.model_executor.model_loader"),
        "vllm.model_executor.model_loader.utils": _module(
            "vllm.model_executor.model_loader.utils",
            process_weights_after_loading=process_weights_after_loading),
        "vllm.device_allocator": _module("vllm.device_allocator"),
        "vllm.device_allocator.cumem": _module("vllm.device_allocator.cumem",
                                               CuMemAllocator=CuMemAllocator),
    }


def vllm_config(tp, pp, *, dp=1, dp_rank=0, backend=None, sleep_mode=False, **over):
    pc = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              data_parallel_rank=dp_rank, enable_expert_parallel=False, enable_eplb=False,
              eplb_config=SimpleNamespace(num_redundant_experts=0),
              prefill_context_parallel_size=1, decode_context_parallel_size=1)
    mc = dict(quantization=None, enable_sleep_mode=sleep_mode, dtype=torch.float32)
    for k, v in over.items():
        (mc if k in mc else pc)[k] = v
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**pc), model_config=SimpleNamespace(**mc),
        weight_transfer_config=None if backend is None else SimpleNamespace(backend=backend))


class FakeWorker:
    """v1/worker/gpu_worker.py Worker, the parts weight sync touches."""

    def __init__(self, rank, vllm_config, model):
        self.rank, self.vllm_config = rank, vllm_config
        self.device = torch.device("cpu")
        self.model_runner = SimpleNamespace(model=model, get_model=lambda: model)
        self.weight_transfer_engine = None
        self.sleeping = False

    def load_model(self):
        if self.vllm_config.weight_transfer_config is not None:
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

    def start_weight_update(self):
        self._engine().start_weight_update()

    def update_weights(self, update_info):
        self._engine().update_weights(update_info)

    def finish_weight_update(self):
        self._engine().finish_weight_update()

    def sleep(self, level=1):
        CuMemAllocator.get_instance().sleep(offload_tags=("weights",) if level == 1 else ())

    def wake_up(self, tags=None):
        CuMemAllocator.get_instance().wake_up(tags)


class FakeLLM:
    """vllm.LLM of one replica: tp x pp workers, collective_rpc and the weight-sync API."""

    def __init__(self, models: Dict[Tuple[int, int], Any], vllm_config, *, extension=None,
                 call_timeout: float = 60.0):
        pc = vllm_config.parallel_config
        self.vllm_config = vllm_config
        self.tp, self.pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        cls = FakeWorker if extension is None else type("Worker", (FakeWorker, extension), {})
        self.workers = {}
        self.call_timeout = call_timeout
        self._sleeping = False
        for p in range(self.pp):
            for t in range(self.tp):
                w = cls(p * self.tp + t, vllm_config, models[(t, p)])
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

    def init_weight_transfer_engine(self, request):
        info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.collective_rpc("init_weight_transfer_engine", args=(info,))

    def start_weight_update(self):
        self.collective_rpc("start_weight_update")

    def update_weights(self, request):
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.collective_rpc("update_weights", args=(info,))

    def finish_weight_update(self):
        self.collective_rpc("finish_weight_update")

    def sleep(self, level=1):
        self.collective_rpc("sleep", args=(level,))
        self._sleeping = True

    def wake_up(self, tags=None):
        self.collective_rpc("wake_up", args=(tags,))
        self._sleeping = False

    def is_sleeping(self):
        return self._sleeping

    def pause_generation(self, **kw):
        return None

    def resume_generation(self):
        return None


# ---- HTTP servers in front of the fake engines (SGLang http_server.py, vLLM rlhf routes) ----


def serve_http(engine, kind):
    """Serves `engine` over HTTP on 127.0.0.1 in a thread; returns (base_url, server)."""
    import http.server
    import json as _json

    vllm_routes = {"pause": "pause_generation", "resume": "resume_generation"}

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _reply(self, code, obj):
            data = _json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/get_server_info" and kind == "sglang":
                return self._reply(200, dict(vars(engine.server_args)))
            if self.path == "/is_sleeping" and kind == "vllm":
                return self._reply(200, {"is_sleeping": engine.is_sleeping()})
            self._reply(404, {"detail": "Not Found"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = _json.loads(self.rfile.read(n) or b"null")
            path, _, query = self.path.lstrip("/").partition("?")
            name = vllm_routes.get(path, path) if kind == "vllm" else path
            fn = getattr(engine, name, None)
            if not callable(fn):
                return self._reply(404, {"detail": "Not Found"})
            try:
                if kind == "sglang":
                    out = fn(**(body or {}))
                elif name == "sleep":
                    out = fn(int(query.split("=")[1]) if query else 1)
                elif body is None:
                    out = fn()
                else:
                    out = fn(body)
            except Exception as e:  # noqa: BLE001 - the server answers 500, as FastAPI does
                return self._reply(500, {"detail": f"{type(e).__name__}: {e}"})
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], bool):
                out = {"success": out[0], "message": out[1]}
            self._reply(200, out)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv
