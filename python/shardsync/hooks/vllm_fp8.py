"""vLLM block FP8 as vLLM serves it: bind the parameters its FP8 backends run with, after their
post-load step, and never run that step again.

A block-FP8 checkpoint loads into `weight` (e4m3 [N, K]) and `weight_scale_inv` (fp32
[ceil(N/128), ceil(K/128)]); the plan names those. What each vLLM generation serves after
`process_weights_after_loading`, read from vLLM's source:

- Linear, "rename" generation (vllm/model_executor/layers/quantization/fp8.py at 1436674b,
  `Fp8LinearMethod.process_weights_after_loading`): `process_fp8_weight_block_strategy` (the same
  tensors on CUDA: utils/fp8_utils.py, it pads only ROCm weights), `del layer.weight_scale_inv`,
  `layer.weight = Parameter(weight.data)`, `layer.weight_scale = Parameter(weight_scale.data)`
  (the same storage under a new name), then `maybe_post_process_fp8_weight_block(layer,
  cutlass_block_fp8_supported)` (fp8_utils.py, the version with that signature):
  DeepGEMM with E8M0 scales -> `requant_weight_ue8m0_inplace` rewrites weight and scales
  (refused); SM90 with CUTLASS block FP8 and no DeepGEMM -> `Parameter(weight_scale.data.T
  .contiguous())`, the scales transposed into new storage (bound transposed, below); otherwise
  the scales stay as loaded (Triton, SM100 CUTLASS, DeepGEMM without E8M0, which reads them as
  they are). Marlin (`use_marlin`) repacks the weight (`prepare_fp8_layer_for_marlin`): refused.
- Linear, "kernel" generation (`Fp8LinearMethod.fp8_linear` from `init_fp8_linear_kernel`;
  kernels/linear/scaled_mm/BlockScaledMMLinearKernel.py at e5bbb6c0): the block kernels'
  `process_weights_after_loading` re-registers `weight` and `weight_scale_inv` over the tensors
  `process_fp8_weight_block_strategy` returns (the same ones), so Triton and CUTLASS
  (scaled_mm/triton.py, cutlass.py: `Bs.T` is a view taken per call) keep the loaded layout, and
  so does the CUDA dispatcher `CudaFp8BlockScaledMMKernel` (scaled_mm/cuda.py at 91e12fc9)
  unless it has a DeepGEMM kernel that applies to the layer;
  DeepGEMM (scaled_mm/deep_gemm.py at 104b28a7: `deepgemm_post_process_fp8_weight_block`, E8M0
  requant and TMA-aligned scales in new storage), FlashInfer, AITER and Marlin kernels: refused.
- MoE (`Fp8MoEMethod.fp8_backend`; fused_moe/oracle/fp8.py at 39aa9c41
  `convert_to_fp8_moe_kernel_format`; quantization/fp8.py at 1436674b for the enum before the
  oracle): TRITON / BATCHED_TRITON (and CUTLASS_BLOCK_SCALED_GROUPED_GEMM, whose post-load at
  1436674b only re-registers the loaded tensors) keep w13 / w2 and their `*_weight_scale_inv`;
  DEEPGEMM / BATCHED_DEEPGEMM (`prepare_fp8_moe_layer_for_deepgemm`), MARLIN (repack), AITER
  (shuffle), FLASHINFER_CUTLASS / FLASHINFER_TRTLLM (w13 -> w31 swap, block shuffles): refused.
- Attention's `Fp8KVCacheMethod` (quantization/kv_cache.py `BaseKVCacheMethod`): its post-load
  ends with `del layer.k_scale`, so it cannot run twice; a sync never writes KV scales.

So a sync lands the e4m3 bytes and scales straight into the served tensors (transposed scales
through a small canonical staging tensor copied transposed after each sync: 4 bytes per 16384
weights), and the engine's whole-model post-load step runs with these methods' steps masked
(their work is already in the bytes; re-running them raises or would redo a one-way transform),
so attention / MLA products are still rebuilt. A backend not listed is refused by name at init,
before a byte moves.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import UnimplementedError

__all__ = ["VllmFp8Views", "FP8_LINEAR_KERNELS", "FP8_MOE_BACKENDS"]

# Block-scaled kernels whose post-load keeps the loaded `weight` / `weight_scale_inv`.
FP8_LINEAR_KERNELS = ("TritonFp8BlockScaledMMKernel", "CutlassFp8BlockScaledMMKernel")
# Fp8MoeBackend names whose post-load keeps w13 / w2 and their block scales as loaded.
FP8_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON", "CUTLASS_BLOCK_SCALED_GROUPED_GEMM")

_LINEAR, _MOE, _KV = "Fp8LinearMethod", "Fp8MoEMethod", "Fp8KVCacheMethod"


@dataclass
class _Scale:
    plan_name: str  # the plan's '<module>.weight_scale_inv' / '<module>.w13_weight_scale_inv'
    live_name: str  # the served parameter: '...weight_scale_inv' or '...weight_scale'
    layout: str  # "canonical" (as the plan) | "transposed" ([K/128, N/128], contiguous)
    backend: str
    staging: Any = None  # canonical-shape fp32 tensor the session writes, for "transposed"


def _mro_names(obj: Any) -> List[str]:
    return [c.__name__ for c in type(obj).__mro__]


def _block(qm: Any) -> Optional[List[int]]:
    """weight_block_size when it is [128, 128], else None."""
    cfg = getattr(qm, "quant_config", None)
    block = getattr(qm, "weight_block_size", None) or getattr(cfg, "weight_block_size", None)
    ok = block is not None and [int(b) for b in block] == [128, 128]
    return [128, 128] if ok else None


def _block_refusal(mname: str, qm: Any, what: str) -> UnimplementedError:
    cfg = getattr(qm, "quant_config", None)
    block = getattr(qm, "weight_block_size", None) or getattr(cfg, "weight_block_size", None)
    return UnimplementedError(
        f"module '{mname}': vLLM {what} with weight_block_size={block}: only block FP8 "
        "[128, 128] is synced (per-tensor and channel FP8 are other formats)")


def _vllm_fn(module: str, name: str) -> Any:
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _op_layout(mname: str, qm: Any, layer: Any) -> Tuple[str, str]:
    """(backend, layout) of a module applied through W8A8BlockFp8LinearOp, decided as its
    `maybe_post_process_fp8_weight_block(layer, cutlass_block_fp8_supported)` decided, with
    vLLM's own functions on the same inputs."""
    op = getattr(qm, "w8a8_block_fp8_linear", None)
    run = getattr(getattr(op, "w8a8_blockscale_op", None), "__name__", "")
    if run == "_run_aiter":
        raise UnimplementedError(
            f"module '{mname}': vLLM FP8 linear backend ROCm AITER (W8A8BlockFp8LinearOp "
            "_run_aiter) serves float8_e4m3fnuz; refused")
    use_dg_fn = _vllm_fn("vllm.utils.deep_gemm", "should_use_deepgemm_for_fp8_linear")
    e8m0_fn = _vllm_fn("vllm.utils.deep_gemm", "is_deep_gemm_e8m0_used")
    platform = _vllm_fn("vllm.platforms", "current_platform")
    if use_dg_fn is None or e8m0_fn is None or platform is None:
        raise UnimplementedError(
            f"module '{mname}': vllm.utils.deep_gemm / vllm.platforms do not answer whether "
            "DeepGEMM or SM90 CUTLASS re-laid the scales after load "
            "(maybe_post_process_fp8_weight_block); refused")
    use_dg = bool(use_dg_fn(getattr(layer, "orig_dtype", None), layer.weight))
    if use_dg and bool(e8m0_fn()):
        raise UnimplementedError(
            f"module '{mname}': vLLM FP8 linear backend DeepGEMM with E8M0 scales "
            "(requant_weight_ue8m0_inplace rewrote the e4m3 weight and its scales after load); "
            "run with VLLM_USE_DEEP_GEMM_E8M0=0 or VLLM_USE_DEEP_GEMM=0")
    if (bool(platform.is_device_capability(90))
            and bool(getattr(qm, "cutlass_block_fp8_supported", False)) and not use_dg):
        return "CUTLASS (SM90)", "transposed"
    if use_dg:
        return "DeepGEMM (fp32 scales)", "canonical"
    return {"_run_cutlass": "CUTLASS", "_run_triton": "Triton"}.get(run, run or "?"), "canonical"


def _linear(mname: str, qm: Any, layer: Any, own: Dict[str, Any]) -> Tuple[str, str]:
    if _block(qm) is None:
        raise _block_refusal(mname, qm, "Fp8LinearMethod")
    kernel = getattr(qm, "fp8_linear", None)
    kname = type(kernel).__name__ if kernel is not None else ""
    if getattr(qm, "use_marlin", False) or "Marlin" in kname:
        raise UnimplementedError(
            f"module '{mname}': vLLM FP8 linear backend Marlin repacks the e4m3 weight after "
            "load (prepare_fp8_layer_for_marlin, GPUs below SM89 or VLLM_TEST_FORCE_FP8_MARLIN); "
            "refused")
    if kname == "CudaFp8BlockScaledMMKernel":
        # scaled_mm/cuda.py at 91e12fc9: the CUDA dispatcher's post-load is the base step plus
        # its `deepgemm_kernel`'s (DeepGEMM installed and supported), which re-lays the weight
        # and scales wherever should_use_deepgemm_for_fp8_linear(orig_dtype, weight) holds;
        # otherwise it serves through its CUTLASS / Triton fallback, as loaded.
        use_dg_fn = _vllm_fn("vllm.utils.deep_gemm", "should_use_deepgemm_for_fp8_linear")
        fallback = type(getattr(kernel, "default_fallback_kernel", None)).__name__
        if getattr(kernel, "deepgemm_kernel", None) is not None and (
                use_dg_fn is None
                or use_dg_fn(getattr(layer, "orig_dtype", None), layer.weight)):
            raise UnimplementedError(
                f"module '{mname}': vLLM FP8 linear kernel CudaFp8BlockScaledMMKernel dispatches "
                "it to DeepGEMM, whose post-load (deepgemm_post_process_fp8_weight_block) "
                "re-laid the weight and scales; run with VLLM_USE_DEEP_GEMM=0 (its CUTLASS / "
                "Triton fallback keeps them as loaded)")
        return f"CudaFp8BlockScaledMMKernel ({fallback})", "canonical"
    if kernel is not None and hasattr(kernel, "apply_block_scaled_mm"):
        if kname not in FP8_LINEAR_KERNELS:
            raise UnimplementedError(
                f"module '{mname}': vLLM FP8 linear kernel {kname} re-lays the weight or its "
                "scales after load (e.g. DeepGEMM: deepgemm_post_process_fp8_weight_block); "
                f"supported kernels: {list(FP8_LINEAR_KERNELS)} (VLLM_USE_DEEP_GEMM=0)")
        return kname, "canonical"
    if getattr(qm, "w8a8_block_fp8_linear", None) is not None:
        # W8A8BlockFp8LinearOp: maybe_post_process_fp8_weight_block decided the scale layout,
        # whatever the scale is called now.
        return _op_layout(mname, qm, layer)
    if "weight_scale_inv" not in own and "weight_scale" in own:
        raise UnimplementedError(
            f"module '{mname}': this vLLM renamed weight_scale_inv to weight_scale after load "
            "but its Fp8LinearMethod has no W8A8BlockFp8LinearOp (w8a8_block_fp8_linear) or "
            "block kernel (fp8_linear) telling which backend serves it; refused")
    if getattr(qm, "use_deep_gemm", False):
        # Before the rename: maybe_post_process_fp8_weight_block(layer) ran
        # deepgemm_post_process_fp8_weight_block (E8M0 requant into new parameters).
        raise UnimplementedError(
            f"module '{mname}': vLLM FP8 linear backend DeepGEMM requantized the scales to "
            "E8M0 after load (maybe_post_process_fp8_weight_block); run with "
            "VLLM_USE_DEEP_GEMM=0")
    return "Triton / CUTLASS", "canonical"


def _moe(mname: str, qm: Any) -> Tuple[str, str]:
    if _block(qm) is None:
        raise _block_refusal(mname, qm, "Fp8MoEMethod")
    backend = getattr(qm, "fp8_backend", None)
    bname = getattr(backend, "name", str(backend)).split(".")[-1]
    extra = ("rocm_aiter_moe_enabled", "flashinfer_moe_backend")
    if bname not in FP8_MOE_BACKENDS or any(getattr(qm, a, None) for a in extra):
        raise UnimplementedError(
            f"module '{mname}': vLLM FP8 MoE backend {bname} re-lays w13 / w2 or their scales "
            "after load (fused_moe/oracle/fp8.py convert_to_fp8_moe_kernel_format: DeepGEMM "
            "relayout, Marlin repack, AITER shuffle, FlashInfer w13->w31 swap); supported: "
            f"{list(FP8_MOE_BACKENDS)} (e.g. VLLM_USE_DEEP_GEMM=0, moe_backend='triton')")
    return bname, "canonical"


class VllmFp8Views:
    """Every FP8 module of a vLLM model: its backend, where the plan's scale lives now and in
    what layout. Raises UnimplementedError naming the module and the backend for anything that
    is not served in a block layout this binds."""

    def __init__(self, model: Any, expected: Sequence[Any]) -> None:
        self.modules: Dict[str, Tuple[Any, str]] = {}  # module name -> (quant method, backend)
        self.scales: Dict[str, _Scale] = {}
        wanted = {p.name: p for p in expected}
        for mname, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            names = _mro_names(qm) if qm is not None else []
            if _KV in names or "BaseKVCacheMethod" in names:
                self.modules[mname] = (qm, "kv-cache scales")
                continue
            if _LINEAR not in names and _MOE not in names:
                continue
            own = dict(module.named_parameters(recurse=False))
            if _LINEAR in names:
                backend, layout = _linear(mname, qm, module, own)
                stems = ("",)
            else:
                backend, layout = _moe(mname, qm)
                stems = ("w13_", "w2_")
            self.modules[mname] = (qm, backend)
            for stem in stems:
                self._scale(mname, own, stem, backend, layout, wanted)

    def _scale(self, mname: str, own: Dict[str, Any], stem: str, backend: str, layout: str,
               wanted: Dict[str, Any]) -> None:
        prefix = f"{mname}." if mname else ""
        plan_name = f"{prefix}{stem}weight_scale_inv"
        p = wanted.get(plan_name)
        if p is None:
            return  # not this rank's (or not quantized in the plan): the name check reports it
        live = own.get(f"{stem}weight_scale_inv")
        leaf = f"{stem}weight_scale_inv"
        if live is None and f"{stem}weight_scale" in own:
            live, leaf = own[f"{stem}weight_scale"], f"{stem}weight_scale"
        if live is None:
            return
        want = [int(d) for d in p.shape]
        got = [int(d) for d in live.shape]
        expect = want if layout == "canonical" else want[::-1]
        if got != expect or not live.is_contiguous():
            raise UnimplementedError(
                f"module '{mname}': vLLM FP8 backend {backend}: scale '{prefix}{leaf}' is "
                f"{got}{'' if live.is_contiguous() else ' (strided)'}, the {layout} layout of "
                f"the plan's {want} would be {expect} (contiguous); refused")
        w = own.get(f"{stem}weight")
        if w is not None and not w.is_contiguous():
            raise UnimplementedError(
                f"module '{mname}': vLLM FP8 backend {backend}: weight '{prefix}{stem}weight' is "
                "strided (padded after load, e.g. VLLM_ROCM_FP8_PADDING); refused")
        s = _Scale(plan_name, f"{prefix}{leaf}", layout, backend)
        if layout == "transposed":
            import torch

            s.staging = torch.empty(want, dtype=live.dtype, device=live.device)
        self.scales[plan_name] = s

    # ---- what the hook binds and re-checks ----
    def named(self, named: Sequence[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
        """model.named_parameters() as the plan names them: a renamed scale under the plan's
        name, a transposed one as its canonical staging tensor."""
        live = dict(named)
        drop = {s.live_name for s in self.scales.values()}
        out = [(n, t) for n, t in named if n not in drop]
        for s in self.scales.values():
            out.append((s.plan_name, s.staging if s.staging is not None else live[s.live_name]))
        return out

    def live_name(self, plan_name: str) -> str:
        s = self.scales.get(plan_name)
        return s.live_name if s is not None else plan_name

    def staged(self, plan_name: str) -> bool:
        s = self.scales.get(plan_name)
        return s is not None and s.staging is not None

    def after_sync(self, model: Any) -> None:
        """Lays the staged scales out as served (transposed), once their bytes verified."""
        staged = [s for s in self.scales.values() if s.staging is not None]
        if not staged:
            return
        live = dict(model.named_parameters())
        for s in staged:
            live[s.live_name].data.copy_(s.staging.t())

    @contextlib.contextmanager
    def masked(self) -> Iterator[None]:
        """The engine's whole-model post-load step with these modules' FP8 steps masked (an
        instance attribute shadows the method vLLM's loop calls), restored afterwards."""
        patched: List[Tuple[Any, Optional[Any]]] = []
        try:
            for qm, _ in self.modules.values():
                if any(q is qm for q, _ in patched):
                    continue
                patched.append((qm, qm.__dict__.get("process_weights_after_loading")))
                qm.process_weights_after_loading = _skip
            yield
        finally:
            for qm, prev in patched:
                if prev is None:
                    qm.__dict__.pop("process_weights_after_loading", None)
                else:
                    qm.process_weights_after_loading = prev

    def describe(self) -> Dict[str, Any]:
        backends: Dict[str, int] = {}
        for _, b in self.modules.values():
            backends[b] = backends.get(b, 0) + 1
        return {"backends": backends,
                "transposed_scales": sum(1 for s in self.scales.values() if s.staging is not None),
                "renamed_scales": sum(1 for s in self.scales.values()
                                      if s.live_name != s.plan_name)}


def _skip(layer: Any) -> None:
    """Masks an FP8 method's post-load step: its result is what the sync wrote."""
