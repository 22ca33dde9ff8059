"""Duck-typed stand-ins for torch DTensor / DeviceMesh and for an engine rank's parameters (torch
1.13 here has no DTensor). Fake SGLang / vLLM engines are in fakes_engines.py."""

from __future__ import annotations

import numpy as np


class Shard:
    def __init__(self, dim):
        self.dim = dim

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim

    def is_replicate(self):
        return False


class Replicate:
    def is_shard(self, dim=None):
        return False

    def is_replicate(self):
        return True


class Partial:
    def is_shard(self, dim=None):
        return False

    def is_replicate(self):
        return False


class Mesh:
    def __init__(self, shape, coord):
        self.shape = tuple(shape)
        self._coord = tuple(coord)
        self.ndim = len(shape)

    def get_local_rank(self, mesh_dim=None):
        return self._coord[0 if mesh_dim is None else mesh_dim]

    def size(self, mesh_dim=None):
        return int(np.prod(self.shape)) if mesh_dim is None else self.shape[mesh_dim]


class DTensor:
    """A full tensor's local shard under torch.chunk semantics (ceil(n/S) rows per rank)."""

    def __init__(self, full, mesh, placements, shard_index, shards):
        self.shape = full.shape
        self.dtype = full.dtype
        self.device_mesh = mesh
        self.placements = tuple(placements)
        if any(getattr(p, "dim", None) == 0 for p in placements):
            n = full.shape[0]
            c = -(-n // shards)
            lo, hi = min(n, shard_index * c), min(n, (shard_index + 1) * c)
            self._local = np.ascontiguousarray(full[lo:hi])
        else:
            self._local = np.ascontiguousarray(full)

    def to_local(self):
        return self._local


def fsdp_state_dict(full, rank, shards, replicas=1):
    """State dict of trainer `rank` under fsdp=S (replicas == 1) or hsdp=RxS."""
    if replicas == 1:
        mesh, pl, s = Mesh([shards], [rank]), [Shard(0)], rank
    else:
        g, s = divmod(rank, shards)
        mesh, pl = Mesh([replicas, shards], [g, s]), [Replicate(), Shard(0)]
    return {n: DTensor(a, mesh, pl, s, shards) for n, a in full.items()}


class EngineModel:
    """An engine rank's model: named_parameters() with the engine's names and local shapes."""

    def __init__(self, params, dtype=np.float32, extra=()):
        self.params = {p.name: np.zeros(p.shape, dtype) for p in params}
        for name, shape in extra:
            self.params[name] = np.zeros(shape, dtype)

    def named_parameters(self):
        return list(self.params.items())
