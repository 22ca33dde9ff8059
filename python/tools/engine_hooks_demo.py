"""Engine-hook demo: every supported engine version range's call sequence, played against the
shardsync hooks through the versioned stand-in engines, with trainer ranks syncing for real and
every engine element checked; the unsupported ranges refused at init, by version and capability.

    PYTHONPATH=build/python /usr/bin/python3 python/tools/engine_hooks_demo.py            # CPU
    python3 python/tools/engine_hooks_demo.py --device cuda --transport cuda_ipc          # GPU

Scenarios (engine, profile, path, head); the profiles (python/tests/fakes_sglang.py,
fakes_vllm.py) keep each version's contract as the engine's source has it:
- SGLang main releases 0.4.7 (plain pickle), 0.5.4 and 0.5.12 (SafeUnpickler, no session):
  custom loader, in-process, 0.5.12 also over HTTP; sglang-miles with the begin/end session
  ("miles-session"): custom loader in-process, through the Engine adapter and over HTTP;
  sglang-miles with receivers: receiver. Refused: 0.4.6 (no custom loader), the receiver path on
  SGLang main, a head launched with --weight-cache-mode client.
- vLLM 0.16 and 0.21: worker extension; 0.23: native backend with the worker-owned start /
  finish (LLM, AsyncLLM on its own loop, HTTP in dev mode) and extension; 0.24: RoutedExperts
  names, native in-process and over HTTP; 0.25: the engine-owned start / finish (PR #44353),
  in-process and over HTTP. Refused: native on 0.16 / 0.21 (no four-phase API), HTTP without
  VLLM_SERVER_DEV_MODE.
- Block FP8 (FP8_SCENARIOS, a Qwen3-MoE on the 128 grid): SGLang 0.5.12 custom loader; vLLM
  native on 0.23 (worker-owned, over HTTP) and 0.25 (in-process), serving its post-load layout
  (the scale renamed to weight_scale and transposed by SM90 CUTLASS; the MoE method on TRITON);
  every e4m3 byte and scale compared with the reference quantizer. Refused by backend name:
  vLLM Marlin and the DeepGEMM MoE backend.

Every rank is a thread of this process: the "loopback" transport on CPU; with --device cuda the
parameters and the trainer's shards are CUDA tensors and every rank is a device session over
"cuda_ipc" (same-process peers) or "nccl". Prints one JSON line per scenario and exits non-zero
when a supported scenario fails or an unsupported one is not refused by name.
"""

from __future__ import annotations

import argparse
import asyncio
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
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the stand-in engines

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
# (engine, profile, path, head, expected outcome: "ok" or the refusal's capability words)
SCENARIOS = (
    ("sglang", "0.4.7", "loader", "inproc", "ok"),
    ("sglang", "0.5.4", "loader", "inproc", "ok"),
    ("sglang", "0.5.12", "loader", "inproc", "ok"),
    ("sglang", "0.5.12", "loader", "http", "ok"),
    ("sglang", "miles-session", "loader", "inproc", "ok"),
    ("sglang", "miles-session", "loader", "adapter", "ok"),
    ("sglang", "miles-session", "loader", "http", "ok"),
    ("sglang", "miles", "receiver", "inproc", "ok"),
    ("sglang", "0.4.6", "auto", "inproc", "no --custom-weight-loader"),
    ("sglang", "0.5.12", "receiver", "http", "no external weight-update receivers"),
    ("sglang", "0.5.12", "loader", "weight-cache", "--weight-cache-mode client"),
    ("vllm", "0.16", "extension", "inproc", "ok"),
    ("vllm", "0.21", "extension", "inproc", "ok"),
    ("vllm", "0.23", "native", "inproc", "ok"),
    ("vllm", "0.23", "extension", "inproc", "ok"),
    ("vllm", "0.23", "native", "async", "ok"),
    ("vllm", "0.23", "native", "http", "ok"),
    ("vllm", "0.24", "native", "inproc", "ok"),
    ("vllm", "0.24", "native", "http", "ok"),
    ("vllm", "0.25", "native", "inproc", "ok"),
    ("vllm", "0.25", "native", "http", "ok"),
    ("vllm", "0.21", "native", "inproc", "no four-phase weight-transfer API"),
    ("vllm", "0.23", "native", "http-nodev", "VLLM_SERVER_DEV_MODE=1"),
)


# Block FP8 (docs/fp8.md): every TP part on the 128 grid at tp 2 (head_dim 128, 256-row experts).
TINY_FP8 = dict(TINY, hidden_size=128, intermediate_size=256, moe_intermediate_size=256,
                num_experts=2, num_experts_per_tok=1, head_dim=128, num_hidden_layers=2,
                vocab_size=128, mlp_only_layers=[0],
                quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]})
# (engine, profile, path, head, expected outcome, FP8 backend of the stand-in engine)
FP8_SCENARIOS = (
    ("sglang", "0.5.12", "loader", "inproc", "ok", "sglang"),
    ("vllm", "0.23", "native", "http", "ok", "sm90-cutlass"),
    ("vllm", "0.25", "native", "inproc", "ok", "sm90-cutlass"),
    ("vllm", "0.25", "native", "inproc", "backend Marlin", "marlin"),
    ("vllm", "0.25", "native", "inproc", "FP8 MoE backend DEEPGEMM", "moe-deepgemm"),
)


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


class Scenario:
    """Builds one scenario's engines (one per replica), group and driver; tears them down."""

    def __init__(self, engine, profile, path, head, args, model, fp8=None):
        self.engine, self.profile, self.path, self.head = engine, profile, path, head
        self.args, self.model, self.fp8 = args, model, fp8
        self.cleanup = []
        self.models = {}

    def modules(self):
        import fakes_sglang as fs
        import fakes_vllm as fv
        import fakes_vllm_fp8 as ff

        if self.engine == "sglang":
            return fs.sglang_modules(self.profile)
        return {**fv.vllm_modules(self.profile), **ff.vllm_fp8_modules(ff.Fp8Env())}

    def fp8_methods(self):
        """(linear, MoE) quant-method factories of the stand-in FP8 engine."""
        import fakes_engines as fe
        import fakes_vllm_fp8 as ff

        if self.engine == "sglang":
            return (lambda: fe.Fp8LinearMethod("sglang")), (lambda: fe.Fp8MoEMethod("TRITON"))
        lin = {"marlin": {"generation": "rename", "marlin": True}}.get(
            self.fp8, {"generation": "rename"})
        moe = "DEEPGEMM" if self.fp8 == "moe-deepgemm" else "TRITON"
        return (lambda: ff.Fp8LinearMethod(**lin)), (lambda: ff.Fp8MoEMethod(moe))

    def plan(self):
        from shardsync.hooks import engines

        kw = engines.plan_kwargs(engines.probe_installed(self.engine))
        return shardsync.Plan(self.model, self.args.trainer, self.args.rollout,
                              engine=self.engine, wire_dtype=self.args.wire_dtype,
                              trainer_dtype="f32", **kw)

    def build(self, plan, config):
        import fakes_engines as fe
        from shardsync.engine_group import EngineGroup, worker_coords
        from shardsync.hooks.driver import HTTPEngine, SGLangDriver, SGLangEngineAdapter, \
            VLLMDriver

        sm = plan.shard_map()
        self.dtype = getattr(torch, {"f32": "float32", "bf16": "bfloat16"}[self.args.wire_dtype])
        device = "cuda:0" if self.args.device == "cuda" else "cpu"
        heads, loop = [], None
        quant = {}
        if self.fp8:
            lin, moe = self.fp8_methods()
            quant = {"quant": lin, "moe_quant": moe}
        for d in range(plan.dp):
            per = {}
            for pp in range(plan.pp):
                for tp in range(plan.tp):
                    m = fe.FakeModel(sm.rank(tp, pp).params, device=device, dtype=self.dtype,
                                     **quant)
                    if self.fp8 and self.engine == "vllm":
                        import fakes_vllm_fp8 as ff

                        ff.attach_kv_cache_method(m)
                    self.models[(d, tp, pp)] = per[(tp, pp)] = m
            heads.append(self._engine(plan, per))
        if self.head == "async":
            loop = asyncio.new_event_loop()
            t = threading.Thread(target=loop.run_forever, daemon=True)
            t.start()
            self.cleanup.append(lambda: (loop.call_soon_threadsafe(loop.stop), t.join(10)))
            import fakes_vllm as fv

            heads = [fv.FakeAsyncLLM(h, loop) for h in heads]
        elif self.head.startswith("http"):
            import fakes_sglang as fs
            import fakes_vllm as fv

            served = []
            for h in heads:
                url, srv = (fs.serve_sglang_http(h) if self.engine == "sglang" else
                            fv.serve_vllm_http(h, dev_mode=self.head == "http"))
                self.cleanup.append(srv.shutdown)
                served.append(HTTPEngine(url, self.engine))
            heads = served
        elif self.head == "adapter":
            heads = [SGLangEngineAdapter(h) for h in heads]
        coords = worker_coords(plan.dp, plan.tp, plan.pp)
        group = EngineGroup([heads[c.dp] if c.is_head else None for c in coords],
                            tp=plan.tp, pp=plan.pp)
        if self.engine == "sglang":
            return group, SGLangDriver(group, plan, config, path=self.path)
        return group, VLLMDriver(group, plan, config, path=self.path, loop=loop)

    def _engine(self, plan, per):
        if self.engine == "sglang":
            import fakes_sglang as fs

            cache = {"weight_cache_mode": "client"} if self.head == "weight-cache" else {}
            e = fs.FakeSGLangEngine(per, plan.tp, plan.pp, profile=self.profile,
                                    server_args=fs.sglang_server_args(
                                        plan.tp, plan.pp, self.profile, ep_size=plan.inputs.ep,
                                        **cache))
            self.cleanup.append(e.shutdown)
            return e
        import fakes_vllm as fv
        from shardsync.hooks import vllm as vh

        vh.register_vllm_backend()
        native = self.path == "native" and fv.VLLM_PROFILES[self.profile].native
        cfg = fv.vllm_config(plan.tp, plan.pp, backend="shardsync" if native else None,
                             enable_expert_parallel=plan.inputs.ep > 1,
                             quantization="fp8" if self.fp8 else None)
        llm = fv.FakeLLM(per, cfg, profile=self.profile,
                         extension=vh.ShardsyncWorkerExtension if self.path == "extension"
                         else None)
        self.cleanup.append(lambda: [w.weight_transfer_engine.shutdown()
                                     for w in llm.workers.values()
                                     if w.weight_transfer_engine is not None])
        return llm

    def close(self):
        for fn in reversed(self.cleanup):
            try:
                fn()
            except Exception:  # noqa: BLE001 - tearing down
                pass


def served(model, name):
    """The tensor the engine serves for plan parameter `name` on CPU, as the plan lays it out
    (vLLM FP8: a scale renamed to weight_scale, transposed by SM90 CUTLASS)."""
    live = dict(model.named_parameters())
    t = live.get(name)
    if t is None and name.endswith("weight_scale_inv"):
        t = live[name[: -len("_inv")]]
    t = t.detach().to("cpu")
    return t


def check_fp8(plan, full, model, p, cache, transposed):
    """(elements, mismatches) of one parameter against the reference quantizer (conftest);
    `transposed`: the engine serves linear layers' scales transposed (vLLM SM90 CUTLASS)."""
    import numpy as np
    from conftest import expected_fp8_param

    want = expected_fp8_param(p, {n: v.numpy() for n, v in full.items()}, cache)
    got = served(model, p.name).numpy()
    if transposed and p.name.endswith("weight_scale_inv") and ".experts." not in p.name:
        got = got.T
    if want.dtype == np.float32:
        got, want = got.view(np.uint32), want.view(np.uint32)
    return int(want.size), int((got != want).sum()) if got.shape == want.shape else int(want.size)


def run_one(sc, args, model, fp8=None):
    import fakes_engines as fe

    engine, profile, path, head, expect = sc
    s = Scenario(engine, profile, path, head, args, model, fp8)
    out = {"engine": engine, "profile": profile, "path": path, "head": head, "expect": expect,
           "rollout": args.rollout, "device": args.device, "ok": False}
    if fp8:
        out["quant"], out["fp8_backend"] = "fp8-block128", fp8
    with fe.installed(s.modules()), shardsync.StoreServer(token=TOKEN) as srv:
        plan = s.plan()
        out["plan"], out["expert_naming"] = plan.hash, plan.expert_naming
        config = {"store": srv.address, "token": TOKEN, "transport": args.transport,
                  "connect_timeout": args.timeout, "sync_timeout": args.timeout}
        trainers, results, inited = [], {}, False
        try:
            t0 = time.monotonic()
            group, driver = s.build(plan, config)
            out["version"], out["path"] = driver.caps.version, driver.path
            trainers = [Trainer(plan, r, srv.address, args, results)
                        for r in range(plan.trainer_world)]
            for t in trainers:
                t.start()
            driver.init()
            out["init_s"] = round(time.monotonic() - t0, 4)
            inited = True
            out["versions"] = []
            for v in range(1, args.versions + 1):
                for t in trainers:
                    t.q.put(v)
                t0 = time.monotonic()
                rep = driver.sync(v)
                wall = time.monotonic() - t0
                full, checked, mism, cache = full_weights(plan, v), 0, 0, {}
                sm = plan.shard_map()
                for (d, tp, pp), m in s.models.items():
                    for p in sm.rank(tp, pp).params:
                        if fp8:
                            n, bad = check_fp8(plan, full, m, p, cache,
                                               engine == "vllm" and fp8 == "sm90-cutlass")
                            checked, mism = checked + n, mism + bad
                            continue
                        got = served(m, p.name)
                        mism += int((got != expected(p, full, s.dtype)).sum())
                        checked += got.numel()
                out["versions"].append({"version": v, "verified": rep["verified"],
                                        "bytes": rep["bytes"], "driver_s": round(wall, 4),
                                        "elements": checked, "mismatches": mism})
            driver.close()
            errs = [v for k, v in results.items() if k[0] == "error"]
            out["trainer_errors"] = errs
            out["ok"] = expect == "ok" and not errs and all(
                x["verified"] and x["mismatches"] == 0 for x in out["versions"])
        except shardsync.Error as e:
            out["error"] = f"{type(e).__name__}: {e}"
            version = {"miles": "0.5.12+miles", "miles-session": "0.5.12+miles"}.get(profile,
                                                                                    profile)
            # Capability refusals name the version; FP8 ones the module and backend.
            out["ok"] = expect != "ok" and expect in str(e) and (bool(fp8) or version in str(e))
            if expect == "ok":
                out["traceback"] = traceback.format_exc(limit=5)
        finally:
            for t in trainers:
                t.q.put(None)
            # A refusal at init leaves the trainers waiting in connect: they fail once this
            # scenario's store closes (daemon threads), so do not wait out their timeout.
            for t in trainers:
                t.join(args.timeout if inited else 1.0)
            s.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sglang", "vllm", "both"), default="both")
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
    ap.add_argument("--no-fp8", dest="fp8", action="store_false",
                    help="skip the block-FP8 scenarios (FP8_SCENARIOS)")
    args = ap.parse_args(argv)
    if args.transport is None:
        args.transport = "cuda_ipc" if args.device == "cuda" else "loopback"
    if args.device == "cuda" and not getattr(shardsync.native(), "DEVICE_BINDING", False):
        print(json.dumps({"ok": False, "error": "--device cuda needs a CUDA build of shardsync "
                                                "(shardsync._C.DEVICE_BINDING)"}))
        return 2
    model, tmp = args.model, None
    tmp = tempfile.mkdtemp(prefix="ss-demo-")
    if model is None:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(TINY, f)
        model = tmp
    fp8_model = os.path.join(tmp, "fp8")
    os.makedirs(fp8_model)
    with open(os.path.join(fp8_model, "config.json"), "w") as f:
        json.dump(TINY_FP8, f)
    ok = True
    try:
        for sc in SCENARIOS:
            if args.engine not in ("both", sc[0]):
                continue
            res = run_one(sc, args, model)
            ok &= bool(res["ok"])
            print(json.dumps(res), flush=True)
        # Block FP8 runs on the FP8 model at tp 2 (its parts sit on the 128 grid there).
        fp8_args = argparse.Namespace(**dict(vars(args), rollout="dp=1,tp=2,pp=1",
                                             wire_dtype="f32"))
        for *sc, backend in FP8_SCENARIOS if args.fp8 else ():
            if args.engine not in ("both", sc[0]):
                continue
            res = run_one(tuple(sc), fp8_args, fp8_model, fp8=backend)
            ok &= bool(res["ok"])
            print(json.dumps(res), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
