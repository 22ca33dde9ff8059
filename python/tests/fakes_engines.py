"""Engine building blocks shared by the fake SGLang, vLLM and UniRL stand-ins (fakes_sglang.py,
fakes_vllm.py, fakes_unirl.py): layers named like the engines' classes with their bound weight
loaders, the post-load steps, and the machinery that installs fake engine modules.

Each fake reproduces an engine's *contract* as its source has it, version by version, citing the
file and symbol it mirrors; a fake written from our own reading hides exactly the bugs a real
engine shows. Model blocks (SGLang layers/linear.py, layers/vocab_parallel_embedding.py,
layers/moe/fused_moe_triton/layer.py; vLLM model_executor/layers/linear.py, fused_moe/layer.py,
fused_moe/routed_experts.py, quantization/utils/layer_utils.py replace_parameter):
- every sharded parameter carries `weight_loader`, a bound method of its layer, plus
  `output_dim` / `input_dim` (UnquantizedLinearMethod.create_weights);
- vLLM >= 0.24 (PR #41184): stacked experts live on `...mlp.experts.routed_experts` (class
  RoutedExperts, owner of w13_weight / w2_weight and of their loader) under a MoERunner;
- post-load: quant methods' process_weights_after_loading, attention layers' derived weights.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import threading
import types
from typing import Dict

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


class RoutedExperts(_Layer):
    """vLLM >= 0.24 fused_moe/routed_experts.py: owns w13_weight / w2_weight and their
    weight_loader; its parent `experts` is the MoERunner the FusedMoE factory returns."""


class MoERunner(nn.Module):
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
    """Fp8LinearMethod of sglang srt/layers/quantization/fp8.py and vllm
    model_executor/layers/quantization/fp8.py, the parts the hooks read and the post-load steps:
    - attributes: quant_config.weight_block_size, use_marlin (both), use_deep_gemm (vLLM),
      use_mxfp8 (SGLang);
    - post-load of block FP8 on CUDA without DeepGEMM: SGLang keeps the Parameter objects
      (process_weights_after_loading_block_quant: `layer.weight.data = weight.data`); vLLM
      re-registers them over the same storage (replace_parameter copies the attributes);
    - `ue8m0`: SGLang's DeepGEMM requant (requant_weight_ue8m0_inplace) ran at load and marked the
      scale `format_ue8m0`.
    vLLM's FP8 generations backend by backend (the scale renamed to weight_scale, SM90 CUTLASS's
    transposed scales, kernels): fakes_vllm_fp8.py."""

    def __init__(self, engine="sglang", block=(128, 128), use_marlin=False, use_deep_gemm=False,
                 use_mxfp8=False, ue8m0=False):
        super().__init__()
        self.engine, self.ue8m0 = engine, ue8m0
        self.quant_config = types.SimpleNamespace(
            weight_block_size=None if block is None else list(block))
        self.block_quant = block is not None
        self.use_marlin, self.use_mxfp8 = use_marlin, use_mxfp8
        if engine == "vllm":
            self.use_deep_gemm = use_deep_gemm

    def loaded(self, layer):
        """What the engine's load-time post-load left on the layer."""
        scale = getattr(layer, "weight_scale_inv", None)
        if self.ue8m0 and scale is not None:
            scale.format_ue8m0 = True

    def process_weights_after_loading(self, layer):
        # vLLM quantization/fp8.py at 0071b24b Fp8LinearMethod.process_weights_after_loading
        # (block quant, CUDA): `layer.weight = Parameter(weight)`, `layer.weight_scale_inv =
        # Parameter(weight_scale_inv)` over the same storage.
        self.finalized += 1
        scale = getattr(layer, "weight_scale_inv", None)
        if self.engine == "vllm" and scale is not None:
            replace_parameter(layer, "weight", layer.weight.data)
            replace_parameter(layer, "weight_scale_inv", scale.data)
        elif scale is not None:
            layer.weight.data = layer.weight.data
            layer.weight_scale_inv.data = scale.data


class Fp8MoEMethod:
    """Fp8MoEMethod of vllm model_executor/layers/quantization/fp8.py (`fp8_backend` from
    fused_moe/oracle/fp8.py select_fp8_moe_backend; convert_to_fp8_moe_kernel_format leaves
    TRITON / BATCHED_TRITON weights as loaded) and of sglang srt/layers/quantization/fp8.py."""

    def __init__(self, backend="TRITON", block=(128, 128)):
        self.fp8_backend = UnquantizedMoeBackend(backend)
        self.quant_config = types.SimpleNamespace(weight_block_size=list(block))
        self.block_quant = True
        self.finalized = 0

    def loaded(self, layer):
        pass

    def process_weights_after_loading(self, layer):
        self.finalized += 1


class UnquantizedMoeBackend:
    def __init__(self, name):
        self.name = name


class UnquantizedFusedMoEMethod:
    # vLLM fused_moe/unquantized_fused_moe_method.py: `self.unquantized_backend =
    # select_unquantized_moe_backend(...)`, an UnquantizedMoeBackend enum (.name read).
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
    ("routed_experts.w13_weight", RoutedExperts, {}),
    ("routed_experts.w2_weight", RoutedExperts, {}),
    ("w13_weight", FusedMoE, {}),
    ("w2_weight", FusedMoE, {}),
]


class FakeModel(nn.Module):
    """An engine rank's model: the shard map's parameters (engine names, local shapes) on layers
    of the engines' classes, each with its bound weight_loader and sharded-dim attributes."""

    def __init__(self, params, *, moe_backend="TRITON", overrides=None, replace_linear=(),
                 quant=None, moe_quant=None, extra=(), device="cpu", dtype=torch.float32):
        super().__init__()
        overrides = overrides or {}
        self._device, self._dtype = torch.device(device), dtype
        self._moe_quant = moe_quant
        self.attention = []
        for p in params:
            # Block-FP8 weights as their bytes (torch 1.13 has no float8; the sessions and hooks
            # take uint8 for e4m3), their scales in fp32.
            pdt = {"F8_E4M3": torch.uint8}.get(p.dtype, torch.float32 if
                                               p.name.endswith("weight_scale_inv") else None)
            self._add(p.name, list(overrides.get(p.name, p.shape)), moe_backend,
                      p.name in replace_linear, quant, pdt)
        for name, shape in extra:
            self._add(name, list(shape), moe_backend, False, quant)
        for _, m in self.named_modules():  # the engine's own post-load at startup
            qm = getattr(m, "quant_method", None)
            if hasattr(qm, "loaded"):
                qm.loaded(m)
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
                last = i == len(parts) - 1
                runner = not last and parts[i + 1] == "routed_experts"
                child = (cls if last else MoERunner if runner else nn.Module)()
                mod.add_module(part, child)
            mod = child
        return mod

    def _add(self, name, shape, moe_backend, replace, quant, dtype=None):
        owner_path, _, pname = name.rpartition(".")
        cls, attrs = RMSNorm, {}
        for suffix, c, a in _KIND_CLASS:
            if name.endswith(suffix):
                cls, attrs = c, a
                break
        mod = self._module(owner_path, cls)
        param = nn.Parameter(torch.zeros(shape, dtype=dtype or self._dtype, device=self._device),
                             requires_grad=False)
        if isinstance(mod, _Layer):
            param.weight_loader = mod.weight_loader
            for k, v in attrs.items():
                setattr(param, k, v)
        mod.register_parameter(pname, param)
        if isinstance(mod, (FusedMoE, RoutedExperts)):
            if not hasattr(mod, "quant_method"):
                mod.quant_method = (self._moe_quant() if self._moe_quant is not None
                                    else UnquantizedFusedMoEMethod(moe_backend))
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
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # find_spec works
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



# The engines, for callers that import everything from here (the demo, older tests).
from fakes_sglang import *  # noqa: E402,F401,F403
from fakes_vllm import *  # noqa: E402,F401,F403
