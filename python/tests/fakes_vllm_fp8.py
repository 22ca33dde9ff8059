"""vLLM's block-FP8 methods as a fake engine holds them: each method's load-time post-load step,
backend by backend, mirrored from vLLM's source (python/shardsync/hooks/vllm_fp8.py cites the
same files):

- `Fp8LinearMethod(generation="rename")`: vllm/model_executor/layers/quantization/fp8.py at
  1436674b `Fp8LinearMethod.__init__` (`cutlass_block_fp8_supported`, `use_marlin`,
  `use_deep_gemm = is_deep_gemm_supported()`, `w8a8_block_fp8_linear = W8A8BlockFp8LinearOp(...)`)
  and `process_weights_after_loading`: `process_fp8_weight_block_strategy` (identity on CUDA),
  `del layer.weight_scale_inv`, `layer.weight = Parameter(weight.data)`, `layer.weight_scale =
  Parameter(weight_scale.data)`, Marlin's `prepare_fp8_layer_for_marlin` and return, else
  quantization/utils/fp8_utils.py `maybe_post_process_fp8_weight_block(layer,
  cutlass_block_fp8_supported)`: DeepGEMM + E8M0 -> `requant_weight_ue8m0_inplace`; SM90 +
  CUTLASS + no DeepGEMM -> `layer.weight_scale = Parameter(weight_scale.data.T.contiguous())`.
  `W8A8BlockFp8LinearOp._dispatch_w8a8_blockscale_op`: `_run_cutlass` when CUTLASS block FP8 is
  supported, else `_run_aiter` (ROCm AITER), else `_run_triton`.
- `Fp8LinearMethod(generation="kernel")`: `self.fp8_linear` a block kernel
  (kernels/linear/scaled_mm/BlockScaledMMLinearKernel.py at e5bbb6c0
  `Fp8BlockScaledMMLinearKernel.process_weights_after_loading`: `replace_parameter` of `weight`
  and `weight_scale_inv` with what `process_fp8_weight_block_strategy` returns, the same
  tensors; scaled_mm/deep_gemm.py at 104b28a7 adds `deepgemm_post_process_fp8_weight_block`
  into new parameters; scaled_mm/cuda.py at 91e12fc9 `CudaFp8BlockScaledMMKernel` runs the base
  step, then its DeepGEMM kernel's; Marlin kernels repack). Fp8LinearMethod delegates its post-load to the
  kernel (read in a vLLM-derived tree of that generation; upstream's own fp8.py of that
  generation was not found in the index).
- `Fp8MoEMethod(backend)`: fused_moe/oracle/fp8.py at 39aa9c41
  `convert_to_fp8_moe_kernel_format`: TRITON / BATCHED_TRITON unchanged; DEEPGEMM
  `prepare_fp8_moe_layer_for_deepgemm`, MARLIN `prepare_fp8_moe_layer_for_marlin`, AITER
  `shuffle_weights`, FLASHINFER_* `prepare_fp8_moe_layer_for_fi` (w13 -> w31); then
  `replace_parameter` of w13/w2 and `w13_weight_scale_inv` / `w2_weight_scale_inv`.
- `Fp8KVCacheMethod`: quantization/kv_cache.py `BaseKVCacheMethod.create_weights` registers
  `k_scale` / `v_scale`; `process_weights_after_loading` ends with `del layer.k_scale`, `del
  layer.v_scale` (a second run raises AttributeError).

Refused backends' transforms are mirrored in what they do to names, storage and layout; the e4m3
requant of E8M0 / DeepGEMM is not (torch 1.13 has no float8): they are refused before a sync.
`vllm_fp8_modules(env)` provides `vllm.utils.deep_gemm` and `vllm.platforms` for `env`.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Dict

import torch

from fakes_engines import Attention, _module, replace_parameter

__all__ = ["Fp8Env", "Fp8LinearMethod", "Fp8MoEMethod", "Fp8KVCacheMethod", "vllm_fp8_modules",
           "attach_kv_cache_method"]


@dataclass
class Fp8Env:
    """The GPU and libraries vLLM's decisions read: device capability (90 = Hopper),
    CUTLASS_BLOCK_FP8_SUPPORTED, DeepGEMM used for these linears, its E8M0 scales."""
    capability: int = 90
    cutlass: bool = True
    deep_gemm: bool = False
    e8m0: bool = False


_ENV = Fp8Env()


def vllm_fp8_modules(env: Fp8Env) -> Dict[str, types.ModuleType]:
    global _ENV
    _ENV = env

    class _Platform:
        # vllm/platforms: current_platform.is_device_capability(cap) / has_device_capability.
        @staticmethod
        def is_device_capability(cap):
            return _ENV.capability == cap

        @staticmethod
        def has_device_capability(cap):
            return _ENV.capability >= cap

    def should_use_deepgemm_for_fp8_linear(output_dtype, weight, supports_deep_gemm=None):
        # vllm/utils/deep_gemm.py: DeepGEMM supported and bf16 output and N % 64, K % 128.
        return bool(_ENV.deep_gemm and weight.shape[0] % 64 == 0 and weight.shape[1] % 128 == 0)

    return {
        "vllm.utils": _module("vllm.utils"),
        "vllm.utils.deep_gemm": _module(
            "vllm.utils.deep_gemm",
            should_use_deepgemm_for_fp8_linear=should_use_deepgemm_for_fp8_linear,
            is_deep_gemm_e8m0_used=lambda: _ENV.e8m0,
            is_deep_gemm_supported=lambda: _ENV.deep_gemm),
        "vllm.platforms": _module("vllm.platforms", current_platform=_Platform()),
    }


def _requant_weight_ue8m0_inplace(weight, scale, block):
    # fp8_utils.py: scales rounded up to powers of two in place (the e4m3 requant of the weight
    # is not modelled, see the module docstring).
    scale.copy_(torch.exp2(torch.ceil(torch.log2(scale))))


def _marlin_repack(layer, name):
    # marlin_utils_fp8.py prepare_fp8_layer_for_marlin: a repacked int32 tile layout.
    w = getattr(layer, name).data
    replace_parameter(layer, name, w.reshape(-1).view(torch.int32).reshape(w.shape[1], -1)
                      if w.numel() % 4 == 0 and w.shape[1] % 4 == 0 else w.clone())


class W8A8BlockFp8LinearOp:
    """quantization/utils/fp8_utils.py: the op a rename-generation Fp8LinearMethod applies
    through; `w8a8_blockscale_op` is the bound method `_dispatch_w8a8_blockscale_op` chose."""

    def __init__(self, cutlass, aiter):
        self.is_hopper = _ENV.capability == 90
        self.w8a8_blockscale_op = (self._run_cutlass if cutlass else
                                   self._run_aiter if aiter else self._run_triton)

    def _run_cutlass(self, *a):
        raise NotImplementedError

    def _run_aiter(self, *a):
        raise NotImplementedError

    def _run_triton(self, *a):
        raise NotImplementedError


class _BlockKernel:
    """Fp8BlockScaledMMLinearKernel.process_weights_after_loading: replace_parameter of
    weight and weight_scale_inv (or weight_scale) with the same tensors."""

    def apply_block_scaled_mm(self, *a):
        raise NotImplementedError

    def process_weights_after_loading(self, layer):
        name = "weight_scale_inv" if "weight_scale_inv" in layer._parameters else "weight_scale"
        replace_parameter(layer, "weight", layer.weight.data)
        replace_parameter(layer, name, getattr(layer, name).data)


class _DeepGemmKernel(_BlockKernel):
    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        # deepgemm_post_process_fp8_weight_block: weight and TMA-aligned scales, new storage.
        replace_parameter(layer, "weight", layer.weight.data.clone())
        replace_parameter(layer, "weight_scale_inv", layer.weight_scale_inv.data.t().contiguous())


class _CudaDispatchKernel(_BlockKernel):
    """scaled_mm/cuda.py at 91e12fc9 CudaFp8BlockScaledMMKernel: a DeepGEMM kernel when DeepGEMM
    is supported, a CUTLASS fallback; post-load = the base step, then the DeepGEMM kernel's,
    which re-lays only where should_use_deepgemm_for_fp8_linear(orig_dtype, weight) holds."""

    def __init__(self):
        self.deepgemm_kernel = _kernel("DeepGemm") if _ENV.deep_gemm else None
        self.default_fallback_kernel = _kernel("Cutlass")

    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        w = layer.weight
        if self.deepgemm_kernel is not None and w.shape[0] % 64 == 0 and w.shape[1] % 128 == 0:
            _DeepGemmKernel.process_weights_after_loading(self.deepgemm_kernel, layer)


class _MarlinKernel:
    def process_weights_after_loading(self, layer):
        _marlin_repack(layer, "weight")


_KERNELS = {"Triton": "TritonFp8BlockScaledMMKernel", "Cutlass": "CutlassFp8BlockScaledMMKernel",
            "DeepGemm": "DeepGemmFp8BlockScaledMMKernel",
            "FlashInfer": "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
            "Marlin": "MarlinFP8ScaledMMLinearKernel", "Cuda": "CudaFp8BlockScaledMMKernel"}


def _kernel(name):
    base = {"DeepGemm": _DeepGemmKernel, "Marlin": _MarlinKernel,
            "Cuda": _CudaDispatchKernel}.get(name, _BlockKernel)
    return type(_KERNELS[name], (base,), {})()


class Fp8LinearMethod:
    """vLLM's block-FP8 linear method of one generation (module docstring)."""

    def __init__(self, generation="rename", kernel="Triton", marlin=False, aiter=False,
                 block=(128, 128)):
        self.generation = generation
        self.quant_config = types.SimpleNamespace(
            weight_block_size=list(block), activation_scheme="dynamic")
        self.weight_block_size = list(block)
        self.block_quant = True
        self.use_marlin = marlin
        self.finalized = 0  # post-load runs after the one at load
        self._loading = False
        if generation == "rename":
            self.cutlass_block_fp8_supported = _ENV.cutlass
            self.use_deep_gemm = _ENV.deep_gemm
            self.w8a8_block_fp8_linear = W8A8BlockFp8LinearOp(_ENV.cutlass, aiter)
        else:
            self.fp8_linear = _kernel("Marlin" if marlin else kernel)

    def loaded(self, layer):
        """The post-load step vLLM runs once, at load."""
        self._loading = True
        try:
            self.process_weights_after_loading(layer)
        finally:
            self._loading = False

    def process_weights_after_loading(self, layer):
        if not self._loading:
            self.finalized += 1
        if self.generation == "kernel":
            self.fp8_linear.process_weights_after_loading(layer)
            return
        weight, weight_scale = layer.weight, layer.weight_scale_inv  # AttributeError run twice
        del layer.weight_scale_inv
        layer.weight = torch.nn.Parameter(weight.data, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(weight_scale.data, requires_grad=False)
        if self.use_marlin:
            _marlin_repack(layer, "weight")
            return
        use_dg = _ENV.deep_gemm and layer.weight.shape[0] % 64 == 0 \
            and layer.weight.shape[1] % 128 == 0
        if _ENV.e8m0 and use_dg:
            _requant_weight_ue8m0_inplace(layer.weight.data, layer.weight_scale.data, (128, 128))
        elif _ENV.capability == 90 and self.cutlass_block_fp8_supported and not use_dg:
            layer.weight_scale = torch.nn.Parameter(layer.weight_scale.data.T.contiguous(),
                                                    requires_grad=False)


class _Backend:
    def __init__(self, name):
        self.name = name


class Fp8MoEMethod:
    """vLLM's block-FP8 MoE method with Fp8MoeBackend `backend` (module docstring)."""

    def __init__(self, backend="TRITON", block=(128, 128)):
        self.fp8_backend = _Backend(backend)
        self.quant_config = types.SimpleNamespace(weight_block_size=list(block))
        self.weight_block_size = list(block)
        self.block_quant = True
        self.finalized = 0
        self._loading = False

    def loaded(self, layer):
        self._loading = True
        try:
            self.process_weights_after_loading(layer)
        finally:
            self._loading = False

    def process_weights_after_loading(self, layer):
        if not self._loading:
            self.finalized += 1
        b = self.fp8_backend.name
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        s13, s2 = layer.w13_weight_scale_inv.data, layer.w2_weight_scale_inv.data
        if b in ("DEEPGEMM", "BATCHED_DEEPGEMM"):  # scales re-laid (TMA-aligned, new storage)
            s13, s2 = s13.transpose(1, 2).contiguous(), s2.transpose(1, 2).contiguous()
        elif b == "AITER":  # shuffle_weights: a permuted copy
            w13, w2 = w13.flip(1).contiguous(), w2.flip(1).contiguous()
        elif b in ("FLASHINFER_CUTLASS", "FLASHINFER_TRTLLM"):  # swap_w13_to_w31
            half, shalf = w13.shape[1] // 2, s13.shape[1] // 2
            w13 = torch.cat([w13[:, half:], w13[:, :half]], 1)
            s13 = torch.cat([s13[:, shalf:], s13[:, :shalf]], 1)
        elif b == "MARLIN":
            w13, w2 = w13.clone(), w2.clone()
        for name, t in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale_inv", s13),
                        ("w2_weight_scale_inv", s2)):
            replace_parameter(layer, name, t)


class Fp8KVCacheMethod:
    """quantization/kv_cache.py BaseKVCacheMethod on an Attention layer (module docstring)."""

    def __init__(self):
        self.finalized = 0

    def create_weights(self, layer):
        layer.k_scale = torch.nn.Parameter(torch.tensor(-1.0), requires_grad=False)
        layer.v_scale = torch.nn.Parameter(torch.tensor(-1.0), requires_grad=False)

    def process_weights_after_loading(self, layer):
        self.finalized += 1
        _ = layer.k_scale, layer.v_scale  # AttributeError when run twice
        del layer.k_scale
        del layer.v_scale


def attach_kv_cache_method(model: Any) -> None:
    """Fp8Config.get_quant_method gives every Attention layer an Fp8KVCacheMethod; its
    post-load ran at load."""
    for _, m in model.named_modules():
        if isinstance(m, Attention):
            m.quant_method = qm = Fp8KVCacheMethod()
            qm.create_weights(m)
            qm.process_weights_after_loading(m)
            qm.finalized = 0
