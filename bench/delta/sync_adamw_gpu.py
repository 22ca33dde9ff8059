#!/usr/bin/python3
"""Delta sync of real AdamW steps on a GPU through device sessions (issue 35's benchmark, H200).

sync_adamw.py's model, data and optimizer (density.py's qwen3-0.6b-shaped model, AdamW on fp32
masters, random tokens), here on the GPU and at full size by default (28 layers, vocab 151936),
synced after every step through device sessions with Plan(encoding=...): one trainer process
binding the fp32 CUDA masters the optimizer updates in place, and `--tp` engine processes
binding CUDA parameters (bf16, or with `--quant fp8-block128` e4m3 codes as uint8 and fp32
weight_scale_inv), so the pairs are the device delta pairs: cuda_ipc on one node, or nccl with
`--emulate-nodes` (every rank process its own node: NCCL's socket transport, a slow link).

Checks, every sync: every engine element against the masters (the engine processes map the
trainer's master tensors through CUDA IPC): bf16 against torch's cast; block FP8's codes and
scales against an independent quantizer (torch's float8_e4m3fn cast of the block-scaled fp32
values, scales amax / 448 with amax at least 1e-4, docs/fp8.md); for bf16 also the changed
fraction counted from two bf16 images of the masters, which must equal the session's.

Run (device machine, the bindings built with SS_PY_HAVE_CUDA: python/tools/device_gpu_check_cuda.sh
with SKIP_RUN=1, then PYTHONPATH=build-dev/python):
  python3 bench/delta/sync_adamw_gpu.py [--layers 28] [--vocab 151936] [--steps 10]
      [--lrs 1e-6,1e-5] [--tp 1] [--bucket-mb 512] [--quant none|fp8-block128]
      [--encoding delta|full|auto] [--transport cuda_ipc|nccl] [--emulate-nodes] [--json out]
`--dry --transport shm`: the same flow with CPU tensors and host sessions (bf16), to try it here.
"""
import argparse
import os
import socket
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from density import Model, init_  # noqa: E402
from sync_adamw import add_args, hf_name, run_lrs  # noqa: E402

import shardsync  # noqa: E402

TOKEN = "bench-token-0123456789"
WAIT_S = 1800  # every barrier's bound


def fp8_reference(w):
    """(codes uint8, scales fp32) of an fp32 matrix, 128 x 128 blocks from (0, 0): amax of the
    block (at least 1e-4) / 448, codes the e4m3 (RNE) of value x (1 / scale), by torch's cast."""
    r, c = w.shape
    R, C = -(-r // 128), -(-c // 128)
    x = F.pad(w.float(), (0, C * 128 - c, 0, R * 128 - r)).view(R, 128, C, 128)
    amax = x.abs().amax(dim=(1, 3)).clamp(min=1e-4)
    # Tensor by tensor: torch's CUDA division by a Python scalar multiplies by its reciprocal,
    # which is not amax / 448 in every block.
    scale = amax / torch.full_like(amax, 448.0)
    inv = torch.ones_like(scale) / scale
    codes = (x * inv[:, None, :, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(R * 128, C * 128)[:r, :c], scale


def check_engine(params, expected, masters):
    """(elements checked, mismatches) of this engine rank's parameters against the masters."""
    checked = bad = 0
    kinds = {"e4m3": 0, "scale": 0, "bf16": 0}
    cache = {}
    for p in expected:
        got = params[p.name]
        fp8 = p.dtype == "F8_E4M3" or p.name.endswith("weight_scale_inv")
        want = torch.zeros_like(got)
        for pc in p.pieces:
            if fp8:
                scale = p.dtype != "F8_E4M3"
                src = pc.source[: -len("_scale_inv")] if scale else pc.source
                if src not in cache:
                    cache[src] = fp8_reference(masters[src])
                part = cache[src][1 if scale else 0]
            else:
                part = masters[pc.source].to(torch.bfloat16)
            want[pc.dst.slices()] = part[pc.src.slices()].reshape(pc.dst.extent)
        iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        checked += got.numel()
        n = int((got.view(iv) != want.view(iv)).sum())
        bad += n
        kinds["e4m3" if p.dtype == "F8_E4M3" else "scale" if fp8 else "bf16"] += n
    return checked, bad, kinds


def emulate_node(args, rank):
    if args["emulate_nodes"]:
        node = f"{socket.gethostname()}/node{rank}"
        os.environ["SHARDSYNC_HOST_ID"] = node
        os.environ["NCCL_HOSTID"] = node


def session(plan, rank, args):
    kw = {"device": None} if args["dry"] else {}
    return shardsync.Session(plan, rank, args["store"], token=TOKEN, transport=args["transport"],
                             connect_timeout=300, sync_timeout=600, **kw, **args["launch"])


def sync_device(args):
    if args["dry"]:
        return "cpu"
    torch.cuda.set_device(0)
    return "cuda"


def rank_main(rank, args, bars, out, body):
    """Runs one rank process's `body` (it returns its session), then says done, or the error (and
    breaks the barriers, so the other ranks stop waiting)."""
    emulate_node(args, rank)
    try:
        body().close()
        out.put(("done", rank, None))
    except BaseException as e:  # noqa: BLE001
        out.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        for b in bars.values():
            b.abort()


def trainer(rank, args, bars, qs, out):
    def body():
        dev = sync_device(args)
        torch.manual_seed(args["seed"])
        model = Model(args["layers"], args["vocab"])
        init_(model)
        model = model.to(dev)
        hf = {hf_name(n): p.data for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=args["lr"],
                                weight_decay=args["weight_decay"])
        # The engines read the masters for their checks: CUDA IPC, or (--dry) shared memory,
        # which moves a CPU tensor's storage, so it is moved before the masters are bound.
        if dev == "cpu":
            model.share_memory()
        for q in qs:
            q.put(hf)
        plan = shardsync.Plan.from_spec(args["spec"])
        s = session(plan, rank, args)
        for n, t in hf.items():
            s.bind_source(n, t)  # the masters AdamW updates in place
        s.connect()
        prev = None
        for v in range(1, args["steps"] + 2):
            t0 = time.perf_counter()
            loss = float("nan")
            if v > 1:
                tokens = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1),
                                       device=dev)
                logits = model(tokens[:, :-1])
                loss_t = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                         tokens[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss_t.backward()
                opt.step()
                loss = float(loss_t.detach())
            if dev == "cuda":
                torch.cuda.synchronize()
            train_s = time.perf_counter() - t0
            own = None
            if not args["fp8"]:
                cur = {n: t.to(torch.bfloat16).view(torch.int16) for n, t in hf.items()}
                own = sum(int((cur[n] != prev[n]).sum()) for n in cur) if prev else None
                prev = cur
            bars["ready"].wait(WAIT_S)
            t0 = time.perf_counter()
            rep = s.sync(v)
            sync_s = time.perf_counter() - t0
            bars["synced"].wait(WAIT_S)  # the engines check now; the masters stay as synced
            bars["checked"].wait(WAIT_S)
            out.put(("step", rank, dict(version=v, step=v - 1, loss=loss, train_seconds=train_s,
                                        sync_seconds=sync_s, session_seconds=rep["seconds"],
                                        verified=rep["verified"], own_changed=own,
                                        delta=rep.get("delta"))))
        return s

    rank_main(rank, args, bars, out, body)


def engine(rank, args, bars, q, out):
    def body():
        dev = sync_device(args)
        plan = shardsync.Plan.from_spec(args["spec"])
        s = session(plan, rank, args)
        expected = s.expected_params()
        dts = {"F8_E4M3": torch.uint8}
        params = {p.name: torch.zeros(p.shape, device=dev, dtype=dts.get(
            p.dtype, torch.float32 if p.name.endswith("_scale_inv") else torch.bfloat16))
            for p in expected}
        shardsync.bind_engine(s, params.items())
        masters = q.get(timeout=WAIT_S)
        s.connect()
        for v in range(1, args["steps"] + 2):
            bars["ready"].wait(WAIT_S)
            s.sync(v)
            bars["synced"].wait(WAIT_S)
            if dev == "cuda":
                torch.cuda.synchronize()
            checked, bad, kinds = check_engine(params, expected, masters)
            out.put(("check", rank, dict(version=v, elements_checked=checked,
                                         element_mismatches=bad, mismatches_by_kind=kinds)))
            bars["checked"].wait(WAIT_S)
        return s

    rank_main(rank, args, bars, out, body)


def run(a, lr, cfg_dir):
    fp8 = a.quant != "none"
    plan = shardsync.Plan(cfg_dir, "single", f"dp=1,tp={a.tp}", wire_dtype="bf16",
                          trainer_dtype="fp32", bucket_bytes=a.bucket_mb << 20,
                          encoding=a.encoding, **({"quant": a.quant} if fp8 else {}))
    world = plan.world_size
    ctx = mp.get_context("spawn")
    bars = {k: ctx.Barrier(world) for k in ("ready", "synced", "checked")}
    out = ctx.Queue()
    qs = [ctx.Queue() for _ in range(world - 1)]
    with shardsync.StoreServer(token=TOKEN) as srv:
        args = dict(spec=plan.spec, store=srv.address, launch=shardsync.new_launch(),
                    transport=a.transport, emulate_nodes=a.emulate_nodes, layers=a.layers,
                    vocab=a.vocab, lr=lr, weight_decay=a.weight_decay, seed=a.seed,
                    steps=a.steps, batch=a.batch, seq=a.seq, fp8=fp8, dry=a.dry)
        procs = [ctx.Process(target=trainer, args=(0, args, bars, qs, out))]
        procs += [ctx.Process(target=engine, args=(r, args, bars, qs[r - 1], out))
                  for r in range(1, world)]
        for p in procs:
            p.start()
        print(f"lr {lr:g}: quant {a.quant}, encoding {a.encoding}, {a.layers} layers, vocab "
              f"{a.vocab}, tp {a.tp}, transport {a.transport}"
              f"{' (emulated nodes)' if a.emulate_nodes else ''}, buckets of {a.bucket_mb} MiB, "
              f"plan {plan.hash}", flush=True)
        steps, checks, printed, done, errors = {}, {}, set(), 0, []
        while done < world and not errors:
            kind, rank, body = out.get(timeout=WAIT_S)
            if kind == "error":
                errors.append(f"rank {rank}: {body}")
            elif kind == "done":
                done += 1
            elif kind == "check":
                checks.setdefault(body["version"], []).append(body)
            else:
                steps[body["version"]] = body
            # A step is whole once the trainer's row and every engine's check are in (the
            # processes' queue feeders may deliver them in either order).
            for v in sorted(steps):
                if v in printed or len(checks.get(v, [])) < world - 1:
                    continue
                printed.add(v)
                row = steps[v]
                row.update(lr=lr, elements_checked=sum(c["elements_checked"] for c in checks[v]),
                           element_mismatches=sum(c["element_mismatches"] for c in checks[v]),
                           mismatches_by_kind={k: sum(c["mismatches_by_kind"][k]
                                                      for c in checks[v])
                                               for k in checks[v][0]["mismatches_by_kind"]})
                d = row["delta"] or {}
                frac = d["changed"] / d["elements"] if d.get("elements") else float("nan")
                wire = d.get("wire_bytes", 0)
                whole = d.get("full_bytes", 0)
                print(f"  step {row['step']:2d} loss {row['loss']:.4f} changed {frac:.4%} (own "
                      f"count {row['own_changed']}, session {d.get('changed')}) wire "
                      f"{wire / 1e6:.2f} MB of {whole / 1e6:.2f} MB = "
                      f"{wire / whole if whole else float('nan'):.2%}; buckets "
                      f"{d.get('buckets_delta')} delta / {d.get('buckets_full')} whole, "
                      f"fallbacks {d.get('fallbacks')}; encode {d.get('encode_seconds', 0):.4f} s"
                      f" decode {d.get('decode_seconds', 0):.4f} s; sync {row['sync_seconds']:.4f}"
                      f" s (session {row['session_seconds']:.4f} s); "
                      f"{row['elements_checked']} elements checked, "
                      f"{row['element_mismatches']} mismatched {row['mismatches_by_kind']}",
                      flush=True)
        for p in procs:
            p.join(60 if not errors else 5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    if len(printed) != len(steps) or len(steps) != a.steps + 1:
        raise RuntimeError(f"{len(steps)} syncs reported, {len(printed)} with every check")
    return [steps[v] for v in sorted(steps)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap, layers=28, vocab=151936, bucket_mb=512)
    ap.add_argument("--encoding", default="delta", choices=["delta", "full", "auto"])
    ap.add_argument("--transport", default="cuda_ipc",
                    choices=["cuda_ipc", "nccl", "auto", "shm", "ucx"])
    ap.add_argument("--emulate-nodes", action="store_true")
    ap.add_argument("--dry", action="store_true",
                    help="CPU tensors and host sessions (machines without a GPU; bf16 only)")
    a = ap.parse_args()
    if a.dry and a.quant != "none":
        ap.error("--dry checks bf16 only (the FP8 reference needs torch's float8_e4m3fn)")
    if a.dry and a.transport not in ("shm", "ucx"):
        ap.error(f"--dry runs host sessions: --transport shm or ucx, not {a.transport}")
    run_lrs(a, run)


if __name__ == "__main__":
    main()
