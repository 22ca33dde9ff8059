"""A complete shardsync job on one machine, host memory: an FSDP-style trainer syncs its weights
into TP x PP engine ranks three times, and every engine element is checked.

    python examples/host_sync.py

starts one process per sync rank itself, as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); under torchrun it is one of those processes:

    torchrun --standalone --nproc_per_node 6 examples/host_sync.py

(with shardsync installed into torchrun's python: `pip install .`, docs/python.md). The sync
world is the trainer's 2 ranks plus the 4 engine ranks of rollout dp=1,tp=2,pp=2: 6 processes.
Other layouts: `--trainer hsdp=2x2 --rollout dp=2,tp=2,pp=1 --engine vllm` (8 processes). Real
dimensions: `--model qwen3-0.6b` (slower: every rank draws the full weights to check against).

What each process does:
  1. It reads RANK and WORLD_SIZE; the process group (gloo) is only used to hand every rank the
     address of the shardsync store that rank 0 serves in-process, and for a final barrier.
  2. Every rank builds the same Plan. Sync ranks [0, S) are trainer ranks; the others are engine
     rank (replica, tp, pp) at S + replica*T*P + pp*T + tp.
  3. A trainer rank holds, like FSDP2's Shard(0), its row slab of every HF tensor as a plain
     tensor (`plan.held_region(rank, shape)`: torch.chunk sizes) and binds it as a source.
     An engine rank holds its own parameters, named and shaped as the engine does
     (`plan.shard_map().rank(tp, pp).params`: fused qkv / gate_up, padded vocab, its layers),
     and binds them as destinations. Nothing is copied: each sync reads the trainer's tensors
     and writes the engine's in place.
  4. connect() once, then per step: the trainer updates its shards in place (the "optimizer
     step"), every rank calls sync(step); the report says whether every bucket's checksum
     matched. Engine ranks then compare every element with the expected weights.
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import shardsync

# torch is imported by the rank processes only (run_rank): the launcher process needs none.

HERE = Path(__file__).resolve().parent
TINY = HERE / "models" / "tiny-qwen2"  # a 4-layer Qwen2 config: seconds on 2 CPU cores


def weights(name: str, shape, version: int):
    """The full HF tensor `name` at training step `version`, fp32: what a trainer would hold
    unsharded. Deterministic, so engine ranks can recompute it to check what they received."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
    return torch.randn(*shape, generator=g)


def expected_param(param, shapes, version: int, dtype):
    """What engine parameter `param` must hold after syncing `version`: its pieces cut from the
    full HF tensors (a fused qkv_proj holds rows of q, k and v), zeros where the engine pads."""
    import torch

    out = torch.zeros(param.shape, dtype=torch.float32)
    full = {}
    for piece in param.pieces:
        if piece.source not in full:
            full[piece.source] = weights(piece.source, shapes[piece.source], version)
        src = full[piece.source][piece.src.slices()]
        out[piece.dst.slices()] = src.reshape(piece.dst.extent)
    return out.to(dtype)  # the wire cast: bf16 rounds to nearest even, as the packer does


def publish_store(rank: int, bind: str):
    """Rank 0 serves the store in this process; every rank learns its address and token."""
    import torch.distributed as dist

    server = None
    box = [None, None]
    if rank == 0:
        token = secrets.token_hex(16)  # the job's shared secret
        server = shardsync.StoreServer(host=bind, port=0, token=token)
        # Reachable address: this node's MASTER_ADDR (torchrun's) with the port bound.
        host = "127.0.0.1" if bind == "127.0.0.1" else os.environ.get("MASTER_ADDR", bind)
        box = [f"{host}:{server.port}", token]
    dist.broadcast_object_list(box, src=0)
    return server, box[0], box[1]


def say(line: str) -> None:
    """One write per line, so lines of concurrent ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def launch_local(world: int, argv, timeout: float) -> int:
    """What `torchrun --standalone` does, for one machine: one process per rank with the launch
    contract in its environment; the first failure ends the job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # for the gloo rendezvous of rank 0
    # One launch identity for the job's ranks, as torchrun gives its workers TORCHELASTIC_RUN_ID:
    # a job of several ranks without one refuses to connect (its ranks could not be told from
    # another job's on the same store); the secret keeps other processes out of its slots.
    launch = shardsync.new_launch()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   SHARDSYNC_JOB_ID=launch["job_id"], SHARDSYNC_JOB_SECRET=launch["job_secret"])
        procs.append(subprocess.Popen([sys.executable, __file__] + list(argv), env=env))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            why = f"rank {procs.index(failed[0])} exited {failed[0].returncode}" if failed else \
                f"still running after {timeout:.0f} s"
            print(f"host_sync: {why}; stopped the other ranks", file=sys.stderr)
            return 1
        time.sleep(0.05)
    return max(p.returncode for p in procs)


def require_torch(prog: str) -> None:
    """Checked once, before any rank starts: without torch every rank would die with its own
    traceback. A pyenv / conda python3 first on PATH has no torch; Debian's (/usr/bin/python3,
    python3-torch) has."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        sys.exit(f"{prog}: this python ({sys.executable}) cannot import torch ({e}); make the venv "
                 "from Debian's python, which has it: /usr/bin/python3 -m venv "
                 "--system-site-packages v (README, 'From Python')")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(TINY), help="embedded name or config.json directory")
    ap.add_argument("--trainer", default="fsdp=2", help="fsdp=S | hsdp=RxS | replicate=N | single")
    ap.add_argument("--rollout", default="dp=1,tp=2,pp=2", help="dp=D,tp=T,pp=P[,ep=E]")
    ap.add_argument("--engine", default="sglang", choices=["sglang", "vllm"])
    ap.add_argument("--steps", type=int, default=3, help="training steps, one sync each")
    ap.add_argument("--store-bind", default="127.0.0.1",
                    help="interface rank 0's store listens on (0.0.0.0 across nodes)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before giving up")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where tensors live (cuda: examples/cuda_sync.py)")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        require_torch("host_sync")

    # Every rank builds the same plan; a layout the engine would refuse fails here, named.
    plan = shardsync.Plan(args.model, args.trainer, args.rollout, engine=args.engine,
                          trainer_dtype="fp32", wire_dtype="bf16", bucket_bytes=1 << 20)
    if "RANK" not in os.environ:  # not under torchrun: start the ranks here
        return launch_local(plan.world_size, argv, args.timeout)
    return run_rank(plan, args)


def run_rank(plan: shardsync.Plan, args: argparse.Namespace) -> int:
    """One sync rank: RANK and WORLD_SIZE from the environment (torchrun's launch contract)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if args.device == "cuda":  # ranks round-robin over the visible GPUs (all on one: colocated)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) %
                              torch.cuda.device_count())
        torch.cuda.set_device(device)
    if world != plan.world_size:
        sys.exit(f"WORLD_SIZE is {world}; trainer={args.trainer} + rollout={args.rollout} is a "
                 f"sync world of {plan.world_size}: pass --nproc_per_node {plan.world_size}")
    shapes = {name: shape for name, shape, _ in plan.hf_tensors()}  # the HF checkpoint's tensors
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    server, store, token = publish_store(rank, args.store_bind)

    session = shardsync.Session(plan, rank, store, token=token, connect_timeout=args.timeout,
                                sync_timeout=args.timeout)
    who = plan.describe_rank(rank)
    if session.is_trainer:
        # FSDP2-style: this rank's dim-0 slab of every HF tensor, as a plain tensor it owns.
        shards = {}
        for name, shape in shapes.items():
            region = plan.held_region(rank, shape)
            if region.numel == 0:
                continue  # trailing FSDP ranks can hold nothing of a small tensor
            shards[name] = weights(name, shape, 0)[region.slices()].contiguous().to(device)
            session.bind_source(name, shards[name])
        role = f"trainer rank {who['trainer_rank']} of {args.trainer}: {len(shards)} shards"
    else:
        # The engine rank's own parameters, as the engine names and shapes them on this rank.
        mine = plan.shard_map().rank(who["tp_rank"], who["pp_rank"])
        params = shardsync.allocate_params(mine.params, device)  # zeros, the wire dtype (bf16)
        for name, tensor in params.items():
            session.bind_destination(name, tensor)
        role = (f"engine replica {who['replica']} tp {who['tp_rank']} pp {who['pp_rank']}: "
                f"{len(params)} parameters, layers {mine.layer_start}-{mine.layer_end - 1}")
    say(f"rank {rank} ({device}): {role}")

    session.connect()  # every rank checks the plan hash and its bindings before a byte moves
    checked = 0
    for step in range(1, args.steps + 1):
        if session.is_trainer:
            for name, shard in shards.items():  # the optimizer step, in place
                region = plan.held_region(rank, shapes[name])
                shard.copy_(weights(name, shapes[name], step)[region.slices()])
        report = session.sync(version=step)
        if not report["verified"]:
            raise SystemExit(f"rank {rank}: sync {step} not verified: {report}")
        if not session.is_trainer:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            for p in mine.params:
                want = expected_param(p, shapes, step, torch.bfloat16).to(device)
                if not torch.equal(params[p.name], want):
                    bad = int((params[p.name] != want).sum())
                    raise SystemExit(f"rank {rank}: step {step}: {p.name}: {bad} elements differ")
                checked += want.numel()
        if rank == 0:
            say(f"step {step}: synced {report['bytes']} bytes in {report['seconds'] * 1e3:.1f} ms, "
                f"{report['checksums_ok']}/{report['checksums_total']} checksums")

    total = torch.tensor([checked], dtype=torch.int64)
    dist.all_reduce(total)
    dist.barrier()  # every rank is done with the store before rank 0 stops it
    session.close()
    if rank == 0:
        say(f"VERIFIED: {args.steps} syncs, {int(total)} engine elements equal the trainer's "
            f"weights (plan {plan.hash})")
        server.stop()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
