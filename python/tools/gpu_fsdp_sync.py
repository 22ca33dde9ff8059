"""GPU sync through the Python API: an FSDP2-sharded model on GPUs as the trainer source,
engine-named GPU parameters as destinations, both bound as torch tensors (no copies), synced with
`shardsync.Session` (device sessions by default: the first bound tensor is a CUDA tensor) and
timed; then checked element for element.

    python3 python/tools/gpu_fsdp_sync.py --model qwen3-8b --trainer fsdp=1 \\
        --rollout dp=1,tp=2,pp=2 --trainer-dtype bf16 --reps 7 [--gpus 1] [--transport auto]

Sync world: trainer ranks 0..S-1 (one process each, trainer t on GPU t % GPUs, FSDP2
`fully_shard` over a 1-d mesh of the trainers), then the engine ranks (parameters with SGLang names
and local shapes in the wire dtype, engine rank (pp, tp) on GPU (pp*T + tp) % GPUs: colocated, as
SGLang places them). Weights are drawn on the GPU per HF tensor from a generator seeded by the
tensor's name, so engines rebuild any tensor to check what landed. After `--warmup` + `--reps`
timed syncs the trainer doubles every local shard in place (an optimizer step, exact in bf16) and
syncs once more; engines compare every element with 2x the expected value. The JSON report has
the median sync seconds as the trainers and the session reports see it. `--dry` runs the same flow
on CPU with host sessions (machines without GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import zlib

import torch
import torch.multiprocessing as mp

import shardsync

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "fp32": torch.float32, "f16": torch.float16}


def hf_tensor(name, shape, dtype, device):
    """The synthetic HF tensor `name`, the same in every process on the same kind of device."""
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def hf_module(plan, dtype, device):
    """An nn.Module whose parameters carry the HF names (nested submodules per dotted name)."""
    root = torch.nn.Module()
    for name, shape, _ in plan.hf_tensors():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, torch.nn.Parameter(hf_tensor(name, shape, dtype, device),
                                                      requires_grad=False))
    return root


def gpu_of(plan, rank, ngpu):
    d = plan.describe_rank(rank)
    if rank < plan.trainer_world:
        return d["trainer_rank"] % ngpu
    return (d["replica"] * plan.tp * plan.pp + d["pp_rank"] * plan.tp + d["tp_rank"]) % ngpu


def session(plan, rank, store, args):
    kw = {"token": "gpu-test-token-0123456789", "connect_timeout": 300, "sync_timeout": 120,
          "transport": args["transport"]}
    if args["dry"]:
        kw["device"] = None
    return shardsync.Session(plan, rank, store, **kw)


def watchdog(args):
    """--watchdog-s: every rank prints its Python stacks once that long has passed (hangs)."""
    if args.get("watchdog"):
        import faulthandler

        faulthandler.dump_traceback_later(args["watchdog"], exit=False)


def trainer(rank, args, store, q):
    watchdog(args)
    try:
        plan = shardsync.Plan.from_spec(args["spec"])
        S = plan.trainer_world
        dtype = DTYPES[plan.trainer_dtype.lower()]
        if args["dry"]:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
            from fakes import fsdp_state_dict

            full = {n: hf_tensor(n, s, torch.float32, "cpu").numpy() for n, s, _ in plan.hf_tensors()}
            module = fsdp_state_dict(full, rank, S)
            locals_ = None
        else:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            dev = torch.device("cuda", gpu_of(plan, rank, args["gpus"]))
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", rank=rank, world_size=S, device_id=dev)
            module = hf_module(plan, dtype, dev)
            fully_shard(module, mesh=init_device_mesh("cuda", (S,)))
            locals_ = [p.to_local() for p in module.parameters()]
        s = session(plan, rank, store, args)
        src = shardsync.bind_trainer(s, module)
        s.connect()
        times, reports = [], []
        for v in range(1, args["warmup"] + args["reps"] + 1):
            t0 = time.perf_counter()
            reports.append(s.sync(v))
            times.append(time.perf_counter() - t0)
        with torch.no_grad():  # an optimizer step, in place: every local shard x2
            for t in (locals_ if locals_ is not None else src.tensors.values()):
                t.mul_(2) if hasattr(t, "mul_") else t.__imul__(2)
        final = s.sync(args["warmup"] + args["reps"] + 1)
        s.close()
        timed = times[args["warmup"]:]
        q.put(("trainer", rank, {
            "device": s.device, "seconds": timed, "median_seconds": statistics.median(timed),
            "report_seconds_median": statistics.median(r["seconds"] for r in reports[args["warmup"]:]),
            "bytes": final["bytes"], "checksums_ok": final["checksums_ok"],
            "checksums_total": final["checksums_total"], "verified": final["verified"]}))
    except Exception as e:  # noqa: BLE001
        q.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def engine(rank, args, store, q):
    watchdog(args)
    try:
        plan = shardsync.Plan.from_spec(args["spec"])
        d = plan.describe_rank(rank)
        dev = torch.device("cpu") if args["dry"] else torch.device("cuda", gpu_of(plan, rank, args["gpus"]))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        sm = plan.shard_map().rank(d["tp_rank"], d["pp_rank"])
        wire = DTYPES[plan.wire_dtype.lower()]
        params = {p.name: torch.zeros(p.shape, dtype=wire, device=dev) for p in sm.params}
        s = session(plan, rank, store, args)
        shardsync.bind_engine(s, params.items())
        s.connect()
        for v in range(1, args["warmup"] + args["reps"] + 2):
            s.sync(v)
        s.close()
        # Every element against 2x the HF value (trainer dtype, then the wire dtype).
        tdtype = DTYPES[plan.trainer_dtype.lower()] if plan.trainer_dtype.lower() in DTYPES else torch.float32
        shapes = {n: sh for n, sh, _ in plan.hf_tensors()}
        bad = total = 0
        for p in sm.params:
            want = torch.zeros(p.shape, dtype=wire, device=dev)
            for pc in p.pieces:
                full = hf_tensor(pc.source, shapes[pc.source], tdtype, dev)
                want[pc.dst.slices()] = (full[pc.src.slices()] * 2).to(wire).reshape(pc.dst.extent)
                del full
            got = params[p.name]
            bad += int((got.view(torch.int16 if wire != torch.float32 else torch.int32) !=
                        want.view(torch.int16 if wire != torch.float32 else torch.int32)).sum())
            total += got.numel()
        q.put(("engine", rank, {"device": str(dev), "session_device": s.device,
                                "params": len(sm.params), "mismatches": bad, "elements": total}))
    except Exception as e:  # noqa: BLE001
        q.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--trainer", default=None, help="default: fsdp=<GPUs>")
    ap.add_argument("--rollout", default="dp=1,tp=2,pp=1")
    ap.add_argument("--engine", default="sglang")
    ap.add_argument("--trainer-dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to place ranks on (0: all)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--watchdog-s", type=float, default=0,
                    help="print every rank's Python stacks after this many seconds")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ngpu = 0 if a.dry else (a.gpus or torch.cuda.device_count())
    spec = dict(model=a.model, trainer=a.trainer or f"fsdp={max(ngpu, 1)}", rollout=a.rollout,
                engine=a.engine, wire_dtype="bf16", trainer_dtype=a.trainer_dtype,
                bucket_bytes=a.bucket_mb << 20)
    plan = shardsync.Plan.from_spec(spec)
    if not a.dry and plan.trainer_world > max(ngpu, 1):
        # The trainer is a real FSDP2 job over torch.distributed's NCCL backend, which refuses two
        # ranks on one GPU ("Duplicate GPU detected") and then hangs: refuse up front.
        ap.error(f"--trainer {spec['trainer']}: {plan.trainer_world} FSDP ranks need as many GPUs "
                 f"(torch.distributed NCCL puts one rank per GPU), {max(ngpu, 1)} given; "
                 "use --dry, or shardsync bench --device cuda for several trainer ranks on a GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = {"spec": spec, "dry": a.dry, "transport": a.transport, "gpus": max(ngpu, 1),
            "warmup": a.warmup, "reps": a.reps, "watchdog": a.watchdog_s}
    with shardsync.StoreServer(token="gpu-test-token-0123456789") as srv:
        procs = []
        for r in range(plan.world_size):
            fn = trainer if r < plan.trainer_world else engine
            p = ctx.Process(target=fn, args=(r, args, srv.address, q))
            p.start()
            procs.append(p)
        results = []
        for _ in procs:  # a rank's failure is printed at once (its peers may then hang)
            try:
                item = q.get(timeout=900 if not any(k == "error" for k, _, _ in results) else 60)
            except Exception:  # noqa: BLE001 - queue.Empty: the rest never reported
                break
            if item[0] == "error":
                print(f"rank {item[1]} failed: {item[2]}", file=sys.stderr, flush=True)
            results.append(item)
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    results.sort(key=lambda x: x[1])
    ok = len(results) == len(procs) and all(kind != "error" for kind, _, _ in results)
    mism = sum(v["mismatches"] for k, _, v in results if k == "engine")
    elems = sum(v["elements"] for k, _, v in results if k == "engine")
    tr = [v for k, _, v in results if k == "trainer"]
    summary = {"ok": ok and mism == 0 and elems > 0 and all(t["verified"] for t in tr),
               "plan": plan.spec, "plan_hash": plan.hash, "gpus": ngpu, "torch": torch.__version__,
               "median_seconds": max((t["median_seconds"] for t in tr), default=None),
               "bytes": tr[0]["bytes"] if tr else None,
               "mismatches": mism, "elements_compared": elems, "ranks": results}
    if summary["median_seconds"]:
        summary["gbps"] = summary["bytes"] / summary["median_seconds"] / 1e9
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
