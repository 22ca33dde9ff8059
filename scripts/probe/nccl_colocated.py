"""Probe: NCCL send/recv between two GPUs when each GPU also hosts a second process doing NCCL
work (colocated trainer + engine ranks), vs one pair alone and vs the pairs taking turns.
4 processes: 0 = trainer on GPU0, 1 = trainer on GPU1, 2 = engine on GPU0, 3 = engine on GPU1.
Pairs: 0 -> 3 (GPU0 -> GPU1) and 1 -> 2 (GPU1 -> GPU0), one 2-rank NCCL communicator each."""
import os, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp

N = 512 << 20
REPS = 8

def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gpu = rank % 2
    torch.cuda.set_device(gpu)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g03 = dist.new_group([0, 3], backend="nccl")
    g12 = dist.new_group([1, 2], backend="nccl")
    buf = torch.empty(N, dtype=torch.uint8, device=f"cuda:{gpu}")
    peer, grp = {0: (3, g03), 3: (0, g03), 1: (2, g12), 2: (1, g12)}[rank]
    sender = rank in (0, 1)
    def xfer(n=REPS):
        for _ in range(n):
            (dist.send if sender else dist.recv)(buf, peer, group=grp)
        torch.cuda.synchronize()
    xfer(2)  # warm-up: connections
    def timed(active):
        dist.barrier()
        t0 = time.perf_counter()
        if active:
            xfer()
        t1 = time.perf_counter()
        dist.barrier()
        return t1 - t0
    res = {}
    res["concurrent"] = timed(True)
    res["pair03_alone"] = timed(rank in (0, 3))
    res["pair12_alone"] = timed(rank in (1, 2))
    a = timed(rank in (0, 3)); b = timed(rank in (1, 2))
    res["turns_total"] = a + b
    out = [None] * world
    dist.all_gather_object(out, res)
    if rank == 0:
        for k in res:
            t = max(o[k] for o in out)
            nbytes = N * REPS * (2 if k in ("concurrent", "turns_total") else 1)
            print(f"{k:14s} {t*1e3:8.1f} ms  {nbytes/t/1e9:7.1f} GB/s total, per pair {N*REPS/ (t if 'alone' in k else t/ (1 if k=='concurrent' else 2)) /1e9:7.1f}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(4, 29511), nprocs=4)
