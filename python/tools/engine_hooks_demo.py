"""Engine-hook demo: plays SGLang's scheduler and vLLM's worker call sequences against the
shardsync hooks, with trainer ranks syncing for real, and checks every engine element.

    PYTHONPATH=build/python /usr/bin/python3 python/tools/engine_hooks_demo.py            # CPU
    python3 python/tools/engine_hooks_demo.py --device cuda --transport cuda_ipc          # GPU

Per engine and path it runs the whole sequence the engine runs:
- SGLang, external receiver: init_weights_update_group(receiver=..., receiver_init_payload=)
  then per version begin_weight_update -> update_weights_from_distributed({"op": "start"}) ->
  ({"op": "wait"}) -> end_weight_update;
- SGLang, custom loader: the same with update_weights_from_tensor(JSON command,
  load_format=shardsync.hooks.sglang.load_weights);
- vLLM, native backend: init_weight_transfer_engine -> per version start_weight_update ->
  update_weights({"version": v}) -> finish_weight_update (post-load step included);
- vLLM, worker extension: collective_rpc("shardsync_init") -> collective_rpc("shardsync_sync").

The engines are the stand-ins the tests use (python/tests/fakes_engines.py): each reproduces its
engine's request handling (stage-by-stage forwarding, pp0/tp0-only replies, patched tensor
pickling, begin/end session asserts, worker RPC fan-out, post-load finalize), with parameters of
the engines' names, local shapes and weight-loader classes. Every rank is a thread of this
process: the "loopback" transport on CPU; with --device cuda the parameters and the trainer's
shards are CUDA tensors and every rank is a device session (device=<the parameters' GPU>) over
"cuda_ipc" (same-process peers need no IPC handle) or "nccl". Prints one JSON line per
(engine, path) and exits non-zero on any mismatch or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # fakes_engines.py

import torch  # noqa: E402

import shardsync  # noqa: E402

TOKEN = "demo-token-0123456789"
TINY = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
    "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 200, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [],
}
PATHS = {"sglang": ("receiver", "loader"), "vllm": ("native", "extension")}


def full_weights(plan, version):
    g = torch.Generator().manual_seed(1000 + version)
    return {n: torch.randn(s, generator=g) for n, s, _ in plan.hf_tensors()}


def expected(param, full, dtype):
    out = torch.zeros(param.shape, dtype=torch.float32)
    for pc in param.pieces:
        out[pc.dst.slices()] = full[pc.source][pc.src.slices()].reshape(pc.dst.extent)
    return out.to(dtype)


class Trainer(threading.Thread):
    """One trainer rank: its FSDP-style row slab of every HF tensor (plan.held_region), synced
    for every version put on its queue."""

    def __init__(self, plan, rank, store, args, results):
        super().__init__(daemon=True)
        self.plan, self.rank, self.store, self.args = plan, rank, store, args
        self.q: "queue.Queue" = queue.Queue()
        self.results = results

    def run(self):
        dev = torch.device(self.args.device, 0) if self.args.device == "cuda" else None
        s = None
        try:
            s = shardsync.Session(self.plan, self.rank, self.store, token=TOKEN,
                                  transport=self.args.transport, device=0 if dev else None,
                                  connect_timeout=self.args.timeout,
                                  sync_timeout=self.args.timeout)
            shards = {}
            for n, shape, _ in self.plan.hf_tensors():
                held = self.plan.held_region(self.rank, shape)
                if all(e > 0 for e in held.extent):
                    shards[n] = (held, torch.zeros(list(held.extent), dtype=torch.float32,
                                                   device=dev or "cpu"))
                    s.bind_source(n, shards[n][1])
            s.connect()
            self.results[("connect", self.rank)] = True
            while True:
                v = self.q.get()
                if v is None:
                    break
                full = full_weights(self.plan, v)
                for n, (held, t) in shards.items():
                    t.copy_(full[n][held.slices()].reshape(t.shape))
                if dev is not None:
                    torch.cuda.synchronize(dev)
                self.results[(v, self.rank)] = s.sync(v)
        except Exception as e:  # noqa: BLE001
            self.results[("error", self.rank)] = f"{type(e).__name__}: {e}"
        finally:
            if s is not None:
                s.close()


def build(engine, path, plan, args):
    import fakes_engines as fe
    from shardsync.engine_group import EngineGroup, worker_coords
    from shardsync.hooks import vllm as vh

    sm = plan.shard_map()
    dtype = getattr(torch, {"f32": "float32", "bf16": "bfloat16"}[args.wire_dtype])
    device = f"{args.device}:0" if args.device == "cuda" else "cpu"
    models, engines = {}, []
    for d in range(plan.dp):
        per = {}
        for pp in range(plan.pp):
            for tp in range(plan.tp):
                m = fe.FakeModel(sm.rank(tp, pp).params, device=device, dtype=dtype)
                models[(d, tp, pp)] = per[(tp, pp)] = m
        ep = int(plan.inputs.ep)  # the live engine config must say what the plan says
        if engine == "sglang":
            engines.append(fe.FakeSGLangEngine(
                per, plan.tp, plan.pp, server_args=fe.sglang_server_args(plan.tp, plan.pp,
                                                                         ep_size=ep)))
        else:
            cfg = fe.vllm_config(plan.tp, plan.pp,
                                 backend="shardsync" if path == "native" else None,
                                 enable_expert_parallel=ep > 1)
            engines.append(fe.FakeLLM(per, cfg, extension=vh.ShardsyncWorkerExtension
                                      if path == "extension" else None))
    coords = worker_coords(plan.dp, plan.tp, plan.pp)
    group = EngineGroup([engines[c.dp] if c.is_head else None for c in coords],
                        tp=plan.tp, pp=plan.pp)
    return group, engines, models, dtype


def run_one(engine, path, args, model):
    import fakes_engines as fe
    from shardsync.hooks.driver import SGLangDriver, VLLMDriver

    plan = shardsync.Plan(model, args.trainer, args.rollout, engine=engine,
                          wire_dtype=args.wire_dtype, trainer_dtype="f32")
    out = {"engine": engine, "path": path, "rollout": args.rollout, "trainer": args.trainer,
           "device": args.device, "transport": args.transport, "plan": plan.hash, "ok": False}
    mods = fe.sglang_modules() if engine == "sglang" else fe.vllm_modules()
    with fe.installed(mods), shardsync.StoreServer(token=TOKEN) as srv:
        if engine == "vllm":
            from shardsync.hooks import vllm as vh

            vh.register_vllm_backend()
        group, engines, models, dtype = build(engine, path, plan, args)
        config = {"store": srv.address, "token": TOKEN, "transport": args.transport,
                  "connect_timeout": args.timeout, "sync_timeout": args.timeout}
        Driver = SGLangDriver if engine == "sglang" else VLLMDriver
        driver = Driver(group, plan, config, path=path)
        results = {}
        trainers = [Trainer(plan, r, srv.address, args, results)
                    for r in range(plan.trainer_world)]
        for t in trainers:
            t.start()
        try:
            t0 = time.monotonic()
            driver.init()
            out["init_s"] = round(time.monotonic() - t0, 4)
            out["versions"] = []
            for v in range(1, args.versions + 1):
                group.call("pause_generation")
                for t in trainers:
                    t.q.put(v)
                t0 = time.monotonic()
                rep = driver.sync(v)
                wall = time.monotonic() - t0
                group.call("continue_generation" if engine == "sglang" else "resume_generation")
                full = full_weights(plan, v)
                checked = mism = 0
                sm = plan.shard_map()
                for (d, tp, pp), m in models.items():
                    live = dict(m.named_parameters())
                    for p in sm.rank(tp, pp).params:
                        got = live[p.name].detach().to("cpu")
                        want = expected(p, full, dtype)
                        mism += int((got != want).sum())
                        checked += got.numel()
                out["versions"].append({"version": v, "verified": rep["verified"],
                                        "bytes": rep["bytes"], "driver_s": round(wall, 4),
                                        "elements": checked, "mismatches": mism})
            errs = {k: v for k, v in results.items() if k[0] == "error"}
            out["trainer_errors"] = [v for v in errs.values()]
            out["ok"] = (not errs and all(x["verified"] and x["mismatches"] == 0
                                          for x in out["versions"]))
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc(limit=5)
        finally:
            for t in trainers:
                t.q.put(None)
            for t in trainers:
                t.join(args.timeout)
            try:
                driver.close()
            except Exception:  # noqa: BLE001
                pass
            for e in engines:
                if engine == "sglang":
                    e.shutdown()
                else:
                    for w in e.workers.values():
                        if w.weight_transfer_engine is not None:
                            w.weight_transfer_engine.shutdown()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sglang", "vllm", "both"), default="both")
    ap.add_argument("--path", default="all",
                    help="receiver | loader (sglang), native | extension (vllm), or all")
    ap.add_argument("--model", default=None,
                    help="embedded model name or config.json (default: a tiny Qwen3-MoE)")
    ap.add_argument("--trainer", default="fsdp=2")
    ap.add_argument("--rollout", default="dp=2,tp=2,pp=2")
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--wire-dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--transport", default=None,
                    help="default: loopback on cpu, cuda_ipc on cuda")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    if args.transport is None:
        args.transport = "cuda_ipc" if args.device == "cuda" else "loopback"
    if args.device == "cuda" and not getattr(shardsync.native(), "DEVICE_BINDING", False):
        print(json.dumps({"ok": False, "error": "--device cuda needs a CUDA build of shardsync "
                                                "(shardsync._C.DEVICE_BINDING)"}))
        return 2
    model = args.model
    tmp = None
    if model is None:
        tmp = tempfile.mkdtemp(prefix="ss-demo-")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(TINY, f)
        model = tmp
    engines = ("sglang", "vllm") if args.engine == "both" else (args.engine,)
    ok = True
    try:
        for engine in engines:
            for path in PATHS[engine]:
                if args.path not in ("all", path):
                    continue
                res = run_one(engine, path, args, model)
                ok &= bool(res["ok"])
                print(json.dumps(res), flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
