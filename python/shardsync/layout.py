"""Rollout layout: the C++ planner (layout.h) through the native module."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

from ._native import native

if TYPE_CHECKING:
    from ._C import Layout

__all__ = ["compute_layout"]


def compute_layout(
    dp: int,
    tp: int,
    pp: int = 1,
    *,
    engine: str = "sglang",
    gpus_per_node: Optional[int] = None,
    node_gpus: Optional[Sequence[int]] = None,
    base_gpu_id: int = 0,
    gpu_id_step: int = 1,
    allow_multinode: bool = False,
    rollout_gpus: Optional[int] = None,
) -> "Layout":
    """The rollout layout of dp x tp x pp workers on nodes of `gpus_per_node` GPUs (default: all on
    one node), or on an explicit per-node GPU list: which worker is each replica's head (pp0/tp0,
    the one that owns the engine object) and which are shells, every worker's
    CUDA_VISIBLE_DEVICES, and where the engine places each of its ranks. Raises
    InvalidArgumentError naming the argument (`tp: must be positive, got 0`)."""
    C = native("layout")
    if node_gpus is None:
        # Build the cluster only; the C++ planner validates every field and names it.
        total = dp * tp * pp
        if gpus_per_node is None:
            node_gpus = [max(total, 1)]
        elif gpus_per_node > 0:
            node_gpus = [gpus_per_node] * max(1, -(-total // gpus_per_node))
        else:
            node_gpus = [gpus_per_node]
    return C.compute_layout(
        dp,
        tp,
        pp,
        engine,
        list(node_gpus),
        base_gpu_id=base_gpu_id,
        gpu_id_step=gpu_id_step,
        allow_multinode=allow_multinode,
        rollout_gpus=rollout_gpus,
    )


def head_workers(layout: "Layout") -> List[int]:
    """Worker indices of the replica heads (the pp0/tp0 worker of each replica)."""
    return list(layout.head_workers())
