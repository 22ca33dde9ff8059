#!/usr/bin/python3
"""Delta sync of real AdamW steps through a Python session (issue 35's benchmark).

Trains the qwen3-shaped model of density.py (qwen3-0.6b dimensions, `--layers` of its decoder
layers, a `--vocab` tied embedding) with AdamW on fp32 masters on random tokens, and after every
step syncs it through shardsync sessions with Plan(encoding="delta") (in-process: one thread per
sync rank, loopback transport): one trainer rank ("single", binding the fp32 master tensors the
optimizer updates in place) and `--tp` engine ranks holding bf16 parameters (SGLang's fused
qkv_proj / gate_up_proj). Per step: the session's delta figures (changed-element fraction, wire
bytes against the whole buckets, buckets as deltas / whole, fallbacks, encode / decode seconds)
and an element-by-element check of every engine parameter against the masters rounded to bf16
(torch's cast), plus the changed fraction counted independently from two bf16 images of the
masters (density.py's count), which must equal the session's.

`--quant fp8-block128`: block-FP8 engines (Plan(quant=...)): e4m3 weights bound as uint8 and
fp32 weight_scale_inv, checked byte for byte against the numpy reference quantizer of
python/tests/conftest.py (fp8_quantize) applied to the masters; the other parameters against the
masters in bf16. The session's changed count is then of image bytes (e4m3 codes, scale bytes,
copies' bytes), so the independent count is not taken.

Run: /usr/bin/python3 bench/delta/sync_adamw.py [--layers 2] [--vocab 16384] [--steps 10]
     [--lrs 1e-6,1e-5] [--tp 1] [--bucket-mb 64] [--quant none|fp8-block128] [--json out]
(with the shardsync package importable: scripts/test.sh's venv, or PYTHONPATH=python with
SHARDSYNC_BUILD_DIR set as python/shardsync/_native.py reads it).
"""
import argparse
import json
import os
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from density import Model, init_  # noqa: E402

import shardsync  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python",
                                "tests"))

TOKEN = "bench-token-0123456789"


def qwen3_config(layers, vocab):
    # The dimensions density.Model builds (qwen3-0.6b's).
    return {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
            "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "num_hidden_layers": layers, "vocab_size": vocab,
            "tie_word_embeddings": True, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16"}


def hf_name(torch_name):
    """density.Model's parameter name -> the HF checkpoint's (Qwen3ForCausalLM)."""
    parts = torch_name.split(".")
    if parts[0] == "layers":
        i, rest = parts[1], parts[2]
        group = ("self_attn." if rest in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                          "k_norm")
                 else "mlp." if rest in ("gate_proj", "up_proj", "down_proj") else "")
        return f"model.layers.{i}.{group}{rest}.weight"
    return f"model.{torch_name}"


def expected(param, hf):
    """Engine parameter `param` as the masters say, in bf16: its pieces, zeros where zero-filled."""
    out = torch.zeros(param.shape, dtype=torch.bfloat16)
    for pc in param.pieces:
        src = hf[pc.source][pc.src.slices()].reshape(pc.dst.extent)
        out[pc.dst.slices()] = src.to(torch.bfloat16)
    return out


def run(args, lr, cfg_dir):
    torch.manual_seed(args.seed)
    model = Model(args.layers, args.vocab)
    init_(model)
    hf = {hf_name(n): p.data for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    fp8 = args.quant != "none"
    plan = shardsync.Plan(cfg_dir, "single", f"dp=1,tp={args.tp}", wire_dtype="bf16",
                          trainer_dtype="fp32", bucket_bytes=args.bucket_mb << 20,
                          encoding="delta", **({"quant": args.quant} if fp8 else {}))
    if fp8:
        from conftest import expected_fp8_param  # the reference quantizer (numpy)
    world = plan.world_size
    engines, sessions, reports, errors = {}, {}, {}, {}
    ready, go = threading.Barrier(world + 1), threading.Barrier(world + 1)
    versions = list(range(1, args.steps + 2))  # version 1: the initial weights, whole
    launch = shardsync.new_launch()  # one job's identity for its in-process ranks
    with shardsync.StoreServer(token=TOKEN) as srv:
        def body(r):
            try:
                s = shardsync.Session(plan, r, srv.address, token=TOKEN, transport="loopback",
                                      connect_timeout=120, sync_timeout=600, **launch)
                sessions[r] = s
                if s.is_trainer:
                    for n, t in hf.items():
                        s.bind_source(n, t)  # the masters AdamW updates in place
                else:
                    dts = {"F8_E4M3": torch.uint8}
                    mine = {p.name: torch.zeros(p.shape, dtype=dts.get(
                        p.dtype, torch.float32 if p.name.endswith("_scale_inv")
                        else torch.bfloat16)) for p in s.expected_params()}
                    engines[r] = mine
                    shardsync.bind_engine(s, mine.items())
                s.connect()
                for v in versions:
                    ready.wait(3600)
                    go.wait(3600)
                    reports.setdefault(v, {})[r] = s.sync(v)
                ready.wait(3600)
            except BaseException as e:  # noqa: BLE001
                errors[r] = e
                print(f"sync rank {r} failed: {e!r}", file=sys.stderr, flush=True)
                ready.abort()
                go.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        rows = []
        nparams = sum(p.numel() for p in model.parameters())
        print(f"lr {lr:g}: quant {args.quant}, {args.layers} layers, vocab {args.vocab}, {nparams} parameters, "
              f"tp {args.tp}, buckets of {args.bucket_mb} MiB, plan {plan.hash}", flush=True)
        state = {}

        def check(v):
            # Every rank synced v (they wait at `ready` for the next version).
            if errors:
                raise RuntimeError(f"ranks failed: {errors}")
            rep = reports[v][0]
            d = rep["delta"]
            # Every element of every engine parameter against the masters in bf16.
            checked = mismatched = 0
            full = {n: t.detach().numpy() for n, t in hf.items()} if fp8 else None
            cache = {}
            for r, mine in engines.items():
                for p in sessions[r].expected_params():
                    got = mine[p.name]
                    if fp8 and got.dtype != torch.bfloat16:  # e4m3 codes, scales: bit for bit
                        want = torch.from_numpy(expected_fp8_param(p, full, cache))
                        if want.dtype == torch.float32:
                            want, got = want.view(torch.int32), got.view(torch.int32)
                    else:
                        want = expected(p, hf).view(torch.int16)
                        got = got.view(torch.int16)
                    checked += got.numel()
                    mismatched += int((got != want).sum())
            sync_s = time.time() - state["t_go"]
            row = dict(lr=lr, version=v, step=v - 1, loss=state["loss"],
                       train_seconds=state["train_s"], sync_seconds=sync_s,
                       verified=rep["verified"], elements_checked=checked,
                       element_mismatches=mismatched, own_changed=state["own_changed"],
                       delta={k: d[k] for k in d if k != "first_fallback"})
            rows.append(row)
            frac = d["changed"] / d["elements"] if d["elements"] else float("nan")
            print(f"  step {v - 1:2d} loss {state['loss']:.4f} changed {frac:.4%} "
                  f"(own count {state['own_changed']}, session {d['changed']}) wire "
                  f"{d['wire_bytes'] / 1e6:.2f} MB of {d['full_bytes'] / 1e6:.2f} MB = "
                  f"{d['wire_bytes'] / d['full_bytes']:.2%}; buckets {d['buckets_delta']} delta /"
                  f" {d['buckets_full']} whole, fallbacks {d['fallbacks']}; encode "
                  f"{d['encode_seconds']:.3f} s decode {d['decode_seconds']:.3f} s, session "
                  f"{rep['seconds']:.2f} s (wall {sync_s:.2f} s incl. the check's wait); "
                  f"{checked} elements checked, {mismatched} mismatched", flush=True)

        prev = None
        for v in versions:
            ready.wait(3600)
            if v > 1:
                check(v - 1)
            t0 = time.time()
            loss = float("nan")
            if v > 1:
                tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
                logits = model(tokens[:, :-1])
                loss_t = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                         tokens[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss_t.backward()
                opt.step()
                loss = float(loss_t)
            cur = {n: t.to(torch.bfloat16).view(torch.int16) for n, t in hf.items()}
            state.update(loss=loss, train_s=time.time() - t0,
                         own_changed=(sum(int((cur[n] != prev[n]).sum()) for n in cur)
                                      if prev and not fp8 else None))
            prev = cur
            state["t_go"] = time.time()
            go.wait(3600)
        ready.wait(3600)
        check(versions[-1])
        for t in threads:
            t.join(60)
    for s in sessions.values():
        s.close()
    return rows


def add_args(ap, layers, vocab, bucket_mb):
    """The model, training and plan arguments (sync_adamw_gpu.py's too, with its defaults)."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--bucket-mb", type=int, default=bucket_mb)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quant", default="none", choices=["none", "fp8-block128"])
    ap.add_argument("--json")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap, layers=2, vocab=16384, bucket_mb=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    run_lrs(args, run)


def run_lrs(args, run):
    """run(args, lr, config dir) for each lr, then the verdict (exit 1 where any sync has a
    mismatch, no check, is not verified, or counts otherwise than the masters) and --json."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump(qwen3_config(args.layers, args.vocab), fh)
        rows = []
        for lr in [float(s) for s in args.lrs.split(",")]:
            rows += run(args, lr, d)
    bad = [r for r in rows if r["element_mismatches"] or not r["verified"] or
           r["elements_checked"] == 0 or
           (r["own_changed"] is not None and r["delta"] is not None and
            r["own_changed"] != r["delta"]["changed"])]
    print(f"{len(rows)} syncs, {sum(r['elements_checked'] for r in rows)} elements checked, "
          f"{len(bad)} with a mismatch, no check, or a count that differs", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), results=rows), fh, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
