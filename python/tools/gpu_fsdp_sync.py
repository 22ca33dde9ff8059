"""GPU check: an FSDP2-sharded model on GPUs as the trainer source, engine-named GPU parameters as
destinations, synced through the Python API and compared element for element.

    python3 python/tools/gpu_fsdp_sync.py [--model qwen2.5-0.5b] [--rollout dp=1,tp=2,pp=1]

Sync world: trainer ranks 0..S-1 (one process per GPU, FSDP2 `fully_shard` over a 1-d mesh, fp32
master weights), then the engine ranks (bf16 parameters with SGLang names and local shapes, engine
rank j on GPU j % GPUs: colocated). Two versions are synced: the initial weights, then the weights
after an in-place update on the trainer (x2, exact in bf16). `--dry` runs the same flow on CPU with
DTensor stand-ins (for machines without FSDP2 or GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

import shardsync

SEED = 1234


def full_weights(plan):
    g = torch.Generator().manual_seed(SEED)
    return {n: torch.randn(s, generator=g) for n, s, _ in plan.hf_tensors()}


def hf_module(full):
    """An nn.Module whose parameters carry the HF names (nested submodules per dotted name)."""
    root = torch.nn.Module()
    for name, t in full.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, torch.nn.Parameter(t.clone()))
    return root


def expected(param, full, scale):
    out = torch.zeros(param.shape, dtype=torch.float32)
    for pc in param.pieces:
        out[pc.dst.slices()] = full[pc.source][pc.src.slices()].reshape(pc.dst.extent)
    return (out * scale).to(torch.bfloat16)


def session_kwargs(args, device_index):
    """Host sessions over UCX (CUDA tensors staged through host memory), or with
    --device-binding device sessions over a GPU transport (CUDA builds)."""
    if args["device_binding"] and device_index is not None:
        return {"transport": args["transport"] or "cuda_ipc", "device": device_index}
    return {"transport": args["transport"] or "ucx"}


def trainer(rank, args, store, q):
    try:
        plan = shardsync.Plan.from_spec(args["spec"])
        S = plan.trainer_world
        full = full_weights(plan)
        if args["dry"]:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
            from fakes import fsdp_state_dict

            sd = fsdp_state_dict({k: v.numpy() for k, v in full.items()}, rank, S)
            owner = {k: torch.from_numpy(v.to_local()) for k, v in sd.items()}
            module = sd
        else:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", rank=rank, world_size=S, device_id=dev)
            module = hf_module(full).to(dev)
            fully_shard(module, mesh=init_device_mesh("cuda", (S,)))
        s = shardsync.Session(plan, rank, store, token="gpu", connect_timeout=120,
                              sync_timeout=120, **session_kwargs(args, None if args["dry"] else dev.index))
        src = shardsync.bind_trainer(s, module)
        if args["dry"]:
            pass  # bound numpy views of the stand-in shards
        s.connect()
        t0 = time.perf_counter()
        r1 = s.sync(1)
        w1 = time.perf_counter() - t0
        with torch.no_grad():  # an optimizer step, in place: every local shard x2
            if args["dry"]:
                for t in src.tensors.values():
                    t *= 2
            else:
                for p in module.parameters():
                    p.to_local().mul_(2)
        t0 = time.perf_counter()
        r2 = s.sync(2)
        w2 = time.perf_counter() - t0
        local = {k: (list(t.shape), str(t.device) if hasattr(t, "device") else "cpu")
                 for k, t in list(src.tensors.items())[:2]}
        s.close()
        q.put(("trainer", rank, {"spec": src.spec, "report1": r1, "report2": r2,
                                 "wall1": w1, "wall2": w2, "sample": local}))
    except Exception as e:  # noqa: BLE001
        q.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def engine(rank, args, store, q):
    try:
        plan = shardsync.Plan.from_spec(args["spec"])
        d = plan.describe_rank(rank)
        ngpu = 0 if args["dry"] else torch.cuda.device_count()
        dev = torch.device("cuda", (rank - plan.trainer_world) % ngpu) if ngpu else torch.device("cpu")
        sm = plan.shard_map().rank(d["tp_rank"], d["pp_rank"])
        params = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16, device=dev) for p in sm.params}
        s = shardsync.Session(plan, rank, store, token="gpu", connect_timeout=120,
                              sync_timeout=120, **session_kwargs(args, dev.index))
        shardsync.bind_engine(s, params.items())
        s.connect()
        full = full_weights(plan)
        out = {}
        for version, scale in ((1, 1.0), (2, 2.0)):
            t0 = time.perf_counter()
            rep = s.sync(version)
            wall = time.perf_counter() - t0
            bad = total = 0
            for p in sm.params:
                got = params[p.name].cpu()
                want = expected(p, full, scale)
                bad += int((got.view(torch.int16) != want.view(torch.int16)).sum())
                total += got.numel()
            out[version] = {"report": rep, "wall": wall, "mismatches": bad, "elements": total}
        s.close()
        q.put(("engine", rank, {"device": str(dev), "params": len(sm.params), **out}))
    except Exception as e:  # noqa: BLE001
        q.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--trainer", default=None, help="default: fsdp=<GPUs>")
    ap.add_argument("--rollout", default="dp=1,tp=2,pp=1")
    ap.add_argument("--engine", default="sglang")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device-binding", action="store_true",
                    help="bind CUDA tensors directly (needs shardsync._C.DEVICE_BINDING)")
    ap.add_argument("--transport", default=None, help="default: ucx, or cuda_ipc with --device-binding")
    a = ap.parse_args()
    ngpu = 0 if a.dry else torch.cuda.device_count()
    trainer_spec = a.trainer or f"fsdp={max(ngpu, 2)}"
    spec = dict(model=a.model, trainer=trainer_spec, rollout=a.rollout, engine=a.engine,
                wire_dtype="bf16", trainer_dtype="f32", bucket_bytes=64 << 20)
    plan = shardsync.Plan.from_spec(spec)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if a.device_binding and not shardsync.native().DEVICE_BINDING:
        sys.exit("--device-binding: this build of shardsync has no device sessions")
    args = {"spec": spec, "dry": a.dry, "device_binding": a.device_binding,
            "transport": a.transport}
    with shardsync.StoreServer(token="gpu") as srv:
        procs = []
        for r in range(plan.world_size):
            fn = trainer if r < plan.trainer_world else engine
            p = ctx.Process(target=fn, args=(r, args, srv.address, q))
            p.start()
            procs.append(p)
        results = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
    results.sort(key=lambda x: x[1])
    ok = all(kind != "error" for kind, _, _ in results)
    mism = sum(v[ver]["mismatches"] for k, _, v in results if k == "engine" for ver in (1, 2))
    elems = sum(v[ver]["elements"] for k, _, v in results if k == "engine" for ver in (1, 2))
    summary = {"ok": ok and mism == 0, "plan": plan.spec, "device_binding": a.device_binding, "plan_hash": plan.hash,
               "gpus": ngpu, "torch": torch.__version__, "mismatches": mism,
               "elements_compared": elems, "ranks": results}
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
