"""The job of examples/host_sync.py with CUDA tensors: device sessions.

    python examples/cuda_sync.py                 # one process per rank, as torchrun would
    torchrun --standalone --nproc_per_node 6 examples/cuda_sync.py

Needs a CUDA build of shardsync (`shardsync._C.DEVICE_BINDING` is true when nvcc was present at
`pip install .`) and at least one GPU. Sync rank r uses GPU LOCAL_RANK % (visible GPUs), so on
one GPU every rank shares it (colocated, as RL jobs run trainer and rollout on the same GPUs).

What changes against host_sync.py is only where the tensors live: the trainer's shards and the
engine's parameters are CUDA tensors. A Session whose first bound tensor is a CUDA tensor becomes
a device session on that GPU (`device="auto"`): it binds the CUDA memory directly, packs (with the
fp32 -> bf16 cast and the checksum fused) and lands on the GPU, and routes each pair to the
transport that fits it, compiled once at connect(): `cuda_ipc` for ranks on one node (one kernel
launch per trainer per sync writes straight into every engine's parameters), `nccl` across nodes.
Every element is then compared on the GPU. Other options: `python examples/host_sync.py --help`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_sync  # noqa: E402 - the job itself, with --device cuda

import shardsync  # noqa: E402


def main() -> int:
    host_sync.require_torch("cuda_sync")
    if not shardsync.native().DEVICE_BINDING:
        sys.exit("cuda_sync: this shardsync was built without CUDA (shardsync._C.DEVICE_BINDING "
                 "is false); reinstall with nvcc on PATH (pip install . builds the CUDA layers "
                 "when it finds nvcc)")
    import torch

    if not torch.cuda.is_available():
        sys.exit("cuda_sync: torch sees no CUDA device")
    return host_sync.main(["--device", "cuda"] + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
