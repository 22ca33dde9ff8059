"""What every bound engine parameter must be: its weight loader, sharded dims, post-load step.

Name, shape and dtype cannot tell two layouts apart (a row- and a column-parallel square matrix, a
packed quantized weight of the same byte size); the loader that owns a parameter can.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

from ..errors import InvalidArgumentError, UnimplementedError

__all__ = [
    "tensor_ptr",
    "expected_loader_kind",
    "loader_kind",
    "check_loaders",
    "check_finalize_methods",
    "CANONICAL_MOE_BACKENDS",
    "CANONICAL_FP8_MOE_BACKENDS",
]

# ---------------------------------------------------------------------------------------------
# Parameters: pointers, weight loaders, sharded dims
# ---------------------------------------------------------------------------------------------


def tensor_ptr(t: Any) -> int:
    """Address of a tensor's first element (torch data_ptr, numpy ctypes.data)."""
    p = getattr(t, "data_ptr", None)
    if callable(p):
        return int(p())
    ct = getattr(t, "ctypes", None)
    if ct is not None:
        return int(ct.data)
    raise InvalidArgumentError(f"cannot read the address of a {type(t).__name__}")


def _dtype_str(t: Any) -> str:
    return str(getattr(t, "dtype", "?")).replace("torch.", "")


def _device_index(t: Any) -> Optional[int]:
    """CUDA device index of a tensor, None for host memory."""
    from ..session import is_cuda_tensor

    if not is_cuda_tensor(t):
        return None
    dev = getattr(t, "device", None)
    idx = getattr(dev, "index", None)
    if idx is None:
        idx = int(t.__dlpack_device__()[1])
    return int(idx)


# Which weight loader every engine parameter of the shard map must have, by engine name. Both
# engines build these layers from the same lineage (SGLang layers/linear.py,
# layers/vocab_parallel_embedding.py, layers/moe/fused_moe_triton/layer.py; vLLM
# model_executor/layers/linear.py, vocab_parallel_embedding.py, fused_moe/layer.py): the loader
# is a bound method of the layer (`param.weight_loader`, or BasevLLMParameter.weight_loader).
_EXPECTED_KIND: Sequence[Tuple[str, str]] = (
    (r"(^|\.)embed_tokens\.weight$", "vocab"),
    (r"(^|\.)lm_head\.weight$", "vocab"),
    (r"\.qkv_proj\.(weight|bias)$", "qkv"),
    (r"\.gate_up_proj\.weight$", "merged"),
    (r"\.(o_proj|down_proj)\.weight$", "row"),
    # vLLM >= 0.24 keeps the stacks on a RoutedExperts child (fused_moe/routed_experts.py).
    (r"\.experts\.(routed_experts\.)?(w13|w2)_weight$", "moe"),
    (r"\.mlp\.gate\.weight$", "replicated"),
    (r"norm\.weight$", "replicated"),
)

# Layer class -> kind, searched along the MRO of the loader's owner (QKVParallelLinear is a
# ColumnParallelLinear: the first hit wins, so the most derived class decides).
_LOADER_CLASSES: Dict[str, str] = {
    "VocabParallelEmbedding": "vocab",
    "ParallelLMHead": "vocab",
    "QKVParallelLinear": "qkv",
    "MergedColumnParallelLinear": "merged",
    "RowParallelLinear": "row",
    "ColumnParallelLinear": "column",
    "ReplicatedLinear": "replicated",
    "FusedMoE": "moe",
    # vLLM >= 0.24: FusedMoE became a factory returning a MoERunner; the expert parameters and
    # their loader (RoutedExperts.weight_loader) live on RoutedExperts
    # (model_executor/layers/fused_moe/routed_experts.py).
    "RoutedExperts": "moe",
}

# The dim each sharded kind splits: column-parallel layers shard the output rows (output_dim 0),
# row-parallel ones the input columns (input_dim 1): UnquantizedLinearMethod.create_weights sets
# these attributes in both engines; BasevLLMParameter exposes them as properties.
_SHARD_DIM: Dict[str, Tuple[str, int]] = {
    "vocab": ("output_dim", 0),
    "qkv": ("output_dim", 0),
    "merged": ("output_dim", 0),
    "row": ("input_dim", 1),
}


def expected_loader_kind(name: str) -> Optional[str]:
    for pat, kind in _EXPECTED_KIND:
        if re.search(pat, name):
            return kind
    return None


def _class_kind(owner: Any) -> Optional[str]:
    for cls in type(owner).__mro__:
        kind = _LOADER_CLASSES.get(cls.__name__)
        if kind is not None:
            return kind
    return None


def loader_kind(param: Any, owner: Any = None) -> Tuple[Optional[str], str]:
    """(kind, description) of a parameter's weight loader; kind None when it carries none.
    `owner`: the module holding the parameter, read when a post-load step re-registered it
    without its loader (vLLM FP8: `layer.weight = Parameter(weight.data)`): the loader was a
    bound method of that layer, so its class says the same."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        kind = _class_kind(owner) if owner is not None else None
        if kind is not None:
            return kind, f"{type(owner).__name__} (loader dropped after load; its layer's class)"
        return None, "no weight_loader"
    owner = getattr(loader, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        for cls in type(owner).__mro__:
            kind = _LOADER_CLASSES.get(cls.__name__)
            if kind is not None:
                fn = getattr(loader, "__name__", "weight_loader")
                return kind, f"{type(owner).__name__}.{fn}"
        return "other", f"{type(owner).__name__}.{getattr(loader, '__name__', '?')}"
    qual = getattr(loader, "__qualname__", getattr(loader, "__name__", repr(loader)))
    return "default", str(qual)


def _attr(param: Any, name: str) -> Any:
    try:
        return getattr(param, name, None)
    except Exception:  # noqa: BLE001 - a property that raises means "not set"
        return None


def check_loaders(pairs: Iterable[Tuple[str, Any]], *, tp: int,
                  owners: Optional[Dict[str, Any]] = None) -> str:
    """Checks each parameter's weight loader and sharded dims against its shard-map kind.

    Name, shape and dtype cannot tell two layouts apart (a row- and a column-parallel square
    matrix, a packed quantized weight of the same byte size); the loader can. Returns "checked",
    or "skipped" when no parameter carries a weight_loader (host test models, not an engine).
    Raises InvalidArgumentError / UnimplementedError naming the parameter."""
    pairs = list(pairs)
    if not any(_attr(t, "weight_loader") is not None for _, t in pairs):
        return "skipped"
    for name, t in pairs:
        packed = _attr(t, "packed_dim")
        factor = _attr(t, "packed_factor") or _attr(t, "pack_factor")
        if packed is not None or (factor is not None and factor != 1):
            raise UnimplementedError(
                f"parameter '{name}': packed (quantized) storage (packed_dim={packed}, "
                f"packed_factor={factor}); the shard map writes unpacked canonical bytes only"
            )
        if _attr(t, "is_shuffled"):
            raise UnimplementedError(
                f"parameter '{name}': shuffled by the MoE backend after load (is_shuffled, "
                "ROCm AITER); its layout is not the canonical one shardsync writes"
            )
        want = expected_loader_kind(name)
        got, desc = loader_kind(t, (owners or {}).get(name))
        if want is None:
            continue
        if want == "replicated":
            if got not in (None, "default", "replicated"):
                raise InvalidArgumentError(
                    f"parameter '{name}': weight loader {desc} ({got}) but the shard map "
                    "holds it replicated on every rank"
                )
            continue
        if got != want:
            raise InvalidArgumentError(
                f"parameter '{name}': weight loader {desc} ({got or 'none'}), the shard map "
                f"expects a {want} layer's loader"
            )
        if want in _SHARD_DIM and tp > 1:
            attr, dim = _SHARD_DIM[want]
            have = _attr(t, attr)
            if have is not None and int(have) != dim:
                raise InvalidArgumentError(
                    f"parameter '{name}': {attr}={have}, the shard map splits dim {dim}"
                )
    return "checked"


# Finalize methods known to leave the canonical layout in place, by quant-method class. Anything
# else (FP8, GPTQ/AWQ/Marlin repacks, ...) rewrites parameters after load and is refused.
_CANONICAL_QUANT_METHODS = {
    "UnquantizedLinearMethod",
    "UnquantizedEmbeddingMethod",
    "UnquantizedFusedMoEMethod",
}
# vLLM fused_moe/oracle/unquantized.py convert_to_unquantized_kernel_format: TRITON and
# BATCHED_TRITON keep [E, 2I, H] / [E, H, I] as loaded; FLASHINFER_CUTLASS swaps w13 to w31,
# FLASHINFER_TRTLLM pads and permutes to a block layout, AITER shuffles, MOONEP regroups; CPU
# kernels repack per architecture.
CANONICAL_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")


# Block FP8 (docs/fp8.md "What the engines do after loading"). The engines' FP8 methods, by
# class name, are accepted when the plan is block FP8 and the backend keeps the e4m3 weight and
# its fp32 weight_scale_inv as loaded (checked per backend below); otherwise refused.
_FP8_METHODS = {"Fp8LinearMethod", "Fp8MoEMethod"}
# vLLM fused_moe/oracle/fp8.py convert_to_fp8_moe_kernel_format: TRITON and BATCHED_TRITON take
# [E, 2I, H] e4m3 with [E, 2I/128, H/128] scales as loaded; DEEPGEMM re-lays the scales (and
# E8M0 requantizes), MARLIN repacks, AITER shuffles, FlashInfer swaps w1/w3 and shuffles.
CANONICAL_FP8_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")


def _fp8_refusal(mname: str, qm: Any, module: Any) -> Optional[str]:
    """Why an FP8 quant method's post-load step leaves a layout other than the canonical block
    FP8 bytes a sync lands (None: it keeps them). vLLM's modules never get here: the vLLM hook
    binds them as served (vllm_fp8.VllmFp8Views, check_finalize_methods' `handled`); this is
    SGLang's check, and any engine's without such views. Read from the attributes the engines
    set:
    - weight_block_size [128, 128] (vLLM / SGLang Fp8Config): per-tensor or channel FP8 is another
      format; SGLang `use_mxfp8`: UE8M0 scales per 32 elements.
    - `use_marlin` (both, GPUs without FP8 hardware): prepare_fp8_layer_for_marlin repacks
      (vLLM quantization/fp8.py Fp8LinearMethod.__init__ `self.use_marlin = not
      has_device_capability(89) or VLLM_TEST_FORCE_FP8_MARLIN`; process_weights_after_loading
      calls prepare_fp8_layer_for_marlin and returns).
    - vLLM Fp8LinearMethod `use_deep_gemm` (quantization/fp8.py Fp8LinearMethod.__init__:
      `self.use_deep_gemm = is_deep_gemm_supported()`; process_weights_after_loading then calls
      `maybe_post_process_fp8_weight_block(layer)` when block_quant): maybe_post_process_fp8_weight_block ->
      deepgemm_post_process_fp8_weight_block requantizes to E8M0 and re-lays the scales, into new
      Parameters (quantization/utils/fp8_utils.py).
    - SGLang `format_ue8m0` on a scale (fp8.py process_weights_after_loading_block_quant ->
      requant_weight_ue8m0_inplace for DeepGEMM): set once, so the step is not re-run on synced
      bytes and DeepGEMM would read fp32 scales as UE8M0.
    - a block-FP8 module holding `weight_scale` and no `weight_scale_inv` (the plan's name is
      gone; vLLM's rename is bound by its views instead).
    - vLLM Fp8MoEMethod `fp8_backend` outside CANONICAL_FP8_MOE_BACKENDS (quantization/fp8.py
      Fp8MoEMethod.__init__: `self.fp8_backend = get_fp8_moe_backend(self.block_quant)`, an
      Fp8MoeBackend enum, in the version read; oracle/fp8.py is not confirmed here).
    ROCm (float8_e4m3fnuz after normalize_e4m3fn_to_e4m3fnuz) is refused by the dtype check."""
    cfg = getattr(qm, "quant_config", None)
    block = getattr(qm, "weight_block_size", None) or getattr(cfg, "weight_block_size", None)
    if getattr(qm, "use_mxfp8", False):
        return "MXFP8 (UE8M0 scales per 32 elements) is not block FP8 [128, 128]"
    if block is None or [int(b) for b in block] != [128, 128]:
        return f"weight_block_size={block}: only block FP8 [128, 128] is synced"
    if getattr(qm, "use_marlin", False):
        return "Marlin repacks the e4m3 weights after load (prepare_fp8_layer_for_marlin)"
    if getattr(qm, "use_deep_gemm", False):
        return ("vLLM's DeepGEMM post-load step (maybe_post_process_fp8_weight_block) requantizes "
                "the scales to E8M0 into new parameters; run with DeepGEMM off "
                "(VLLM_USE_DEEP_GEMM=0)")
    own = dict(getattr(module, "named_parameters", lambda **_: [])(recurse=False))
    if "weight_scale" in own and "weight_scale_inv" not in own:
        return ("the post-load step renamed weight_scale_inv to weight_scale: the plan's "
                "parameter is gone and this engine's hook has no view of the served layout")
    for pname, p in own.items():
        if pname.endswith("scale_inv") and getattr(p, "format_ue8m0", False):
            return (f"'{pname}' was requantized to UE8M0 for DeepGEMM "
                    "(requant_weight_ue8m0_inplace) and is marked so; SGLang does not redo it "
                    "on reloaded bytes: run with SGLANG_ENABLE_JIT_DEEPGEMM=0")
    backend = getattr(qm, "fp8_backend", None)
    if backend is not None:
        bname = getattr(backend, "name", str(backend)).split(".")[-1]
        if bname not in CANONICAL_FP8_MOE_BACKENDS:
            return (f"FP8 MoE backend {bname} re-lays w13/w2 or their scales after load "
                    "(fused_moe/oracle/fp8.py convert_to_fp8_moe_kernel_format); use one of "
                    f"{list(CANONICAL_FP8_MOE_BACKENDS)}")
    return None


def check_finalize_methods(model: Any, *, allow_moe_backends: Sequence[str] = (),
                           fp8: bool = False, handled: Iterable[str] = ()) -> int:
    """Refuses modules whose post-load step leaves a non-canonical layout. Returns how many
    quant methods were checked. `fp8`: the plan is block FP8, so the engines' FP8 methods are
    accepted where their backend keeps the canonical bytes (_fp8_refusal). `handled`: module
    names an engine's own FP8 views already classified (vllm_fp8.VllmFp8Views)."""
    handled = set(handled)
    named = getattr(model, "named_modules", None)
    if not callable(named):
        return 0
    allowed = set(CANONICAL_MOE_BACKENDS) | set(allow_moe_backends)
    n = 0
    for mname, module in named():
        qm = getattr(module, "quant_method", None)
        if qm is None:
            continue
        n += 1
        if mname in handled:
            continue
        cls = type(qm).__name__
        if fp8 and cls in _FP8_METHODS:
            why = _fp8_refusal(mname, qm, module)
            if why is not None:
                raise UnimplementedError(f"module '{mname}': quant method {cls}: {why}")
            continue
        if cls in _FP8_METHODS:
            raise UnimplementedError(
                f"module '{mname}': quant method {cls}: the engine holds block-FP8 weights but "
                "the plan is not block FP8; build the Plan with quant='fp8-block128' (or from "
                "the FP8 checkpoint's config.json)")
        if cls not in _CANONICAL_QUANT_METHODS:
            raise UnimplementedError(
                f"module '{mname}': quant method {cls} rewrites its weights after load "
                "(quantized or repacked layout); shardsync writes canonical unquantized bytes only"
            )
        # vLLM fused_moe/unquantized_fused_moe_method.py UnquantizedFusedMoEMethod.__init__:
        # `self.unquantized_backend = select_unquantized_moe_backend(...)` (UnquantizedMoeBackend).
        backend = getattr(qm, "unquantized_backend", None)
        if backend is not None:
            bname = getattr(backend, "name", str(backend)).split(".")[-1]
            if bname not in allowed:
                raise UnimplementedError(
                    f"module '{mname}': MoE backend {bname} permutes w13/w2 after load (vLLM "
                    "fused_moe/oracle/unquantized.py convert_to_unquantized_kernel_format); its "
                    f"post-load layout is not canonical. Use one of {sorted(allowed)} "
                    "(e.g. VLLM moe_backend='triton')"
                )
    return n
