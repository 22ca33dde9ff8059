"""The real client: real Megatron-Core GPTModel chunks, filled from an HF checkpoint by
Megatron-Bridge's own load path, bound with `shardsync.bind_trainer(..., layout="megatron")` and
synced into SGLang tp2 pp2 engine ranks on the GPU; every engine element is compared with the HF
checkpoint and the reference engine's tokens on the engines' received parameters must MATCH the
unsharded model's (docs/megatron.md, "The real client").

    PYTHONPATH=<Megatron-LM root>:<Megatron-Bridge src>:<shardsync python> \\
    python3 python/tools/megatron_real_client.py --out DIR [--case dense|moe|all] \\
        [--cli PATH/TO/shardsync]

Neither Megatron-LM nor Megatron-Bridge is part of this repository: the command line puts a
checkout of each on PYTHONPATH (NVIDIA/Megatron-LM's `megatron/`, NVIDIA-NeMo/Megatron-Bridge's
`src/megatron/bridge`; both are namespace packages under `megatron`).

Cases (one job each: trainer ranks 0..3, then SGLang engine ranks 4..7, all on GPU 0):
- dense: a small Qwen3 (8 layers), `megatron=tp=2,pp=2,vpp=2,norms=local` -> SGLang tp2 pp2;
- moe: a small Qwen3-MoE (4 layers, 8 experts), `megatron=tp=2,pp=2,ep=2,etp=1,norms=local`
  (SequentialMLP experts) -> SGLang tp2 pp2.
The local spec because the GPU machine has no Transformer Engine (Bridge's gpt_provider.py
local_layer_spec; get_gpt_layer_local_spec).

Each trainer process: torch.distributed over gloo (several ranks share the one GPU, which NCCL
refuses), `parallel_state.initialize_model_parallel`, Bridge's `AutoBridge.from_hf_pretrained` ->
`to_megatron_provider(load_weights=False)` -> `provide_distributed_model(wrap_with_ddp=False,
use_cpu_initialization=True, bf16=True)` (Float16Module-wrapped GPTModel chunks, one per virtual
stage; `--init cuda` builds them on the GPU), `AutoBridge.load_hf_weights(chunks)` (Bridge's param
mappings scatter each HF tensor over the tp / ep groups), chunks moved to the GPU, then bound
(bind_trainer reads the chunks' TransformerConfig and the real parallel_state) and synced.
Engine processes bind NaN-filled CUDA buffers with SGLang's names, sync, compare every element with
the HF checkpoint cut by the shard map, and dump what they received (WriteEngineDump's format:
safetensors with the rank in __metadata__); the parent then runs `shardsync generate
--engine-dump` (the reference engine's sharded forward on the dumps against the unsharded model on
the HF checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import types

import torch
import torch.multiprocessing as mp

TOKEN = "megatron-real-client-token-01234"

DENSE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 32, "num_hidden_layers": 8, "vocab_size": 1024,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
}
MOE = dict(DENSE, **{
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 4,
    "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
})
CASES = {
    "dense": dict(config=DENSE, trainer="megatron=tp=2,pp=2,vpp=2,norms=local",
                  par=dict(tp=2, pp=2, vpp=2, ep=1, etp=None)),
    "moe": dict(config=MOE, trainer="megatron=tp=2,pp=2,ep=2,etp=1,norms=local",
                par=dict(tp=2, pp=2, vpp=1, ep=2, etp=1)),
}
ROLLOUT = "dp=1,tp=2,pp=2"


def import_shardsync():
    import shardsync

    return shardsync


def write_hf_checkpoint(case, d):
    """config.json + model.safetensors (bf16) with the HF names and shapes shardsync's inventory
    gives; values seeded per tensor name. Norm weights near 1, matrices N(0, 0.05)."""
    import zlib

    from safetensors.torch import save_file

    shardsync = import_shardsync()
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(case["config"], f, indent=1)
    plan = shardsync.Plan(d, "fsdp=1", ROLLOUT)
    out = {}
    for name, shape, _ in plan.hf_tensors():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g)
        out[name] = (1 + 0.1 * x if name.endswith("norm.weight") else 0.05 * x).to(torch.bfloat16)
    save_file(out, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return len(out)


def import_bridge(notes):
    """Megatron-Bridge's conversion modules without its package __init__s, which import and
    register every model family (and their optional dependencies): `megatron.bridge`,
    `megatron.bridge.models` and `megatron.bridge.models.qwen` are entered as bare packages over
    the same directories, then the Qwen3 / Qwen3-MoE bridges register themselves on import, as
    the package __init__ would have done for them."""
    import importlib.util

    try:
        import omegaconf  # noqa: F401 - models/config.py imports it at module level
    except Exception as e:  # noqa: BLE001
        # Bridge's load path never calls OmegaConf (it serializes configs); only the import.
        notes.append(f"omegaconf not importable ({type(e).__name__}: {e}): a stub module")
        stub = types.ModuleType("omegaconf")
        stub.OmegaConf = type("OmegaConf", (), {})
        stub.DictConfig = type("DictConfig", (), {})
        stub.ListConfig = type("ListConfig", (), {})
        sys.modules["omegaconf"] = stub
    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None:
        raise RuntimeError("megatron.bridge is not on PYTHONPATH (Megatron-Bridge's src/)")
    root = list(spec.submodule_search_locations)[0]
    for name, sub in (("megatron.bridge", ""), ("megatron.bridge.models", "models"),
                      ("megatron.bridge.models.qwen", "models/qwen")):
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(root, sub) if sub else root]
        sys.modules[name] = m
    # peft/lora_layers.py imports transformer_engine.pytorch at module level (for its fused LoRA
    # branches; the load path never builds one), reached through models/conversion/peft_bridge.py,
    # which model_bridge.py imports. The GPU machine has no Transformer Engine: while that one
    # module is imported, `transformer_engine` is a MagicMock, the fallback Megatron-Core itself
    # uses when TE is absent (core/extensions/transformer_engine.py: `te = MagicMock()`), and it
    # is removed again at once, so nothing imported later sees a TE. Its dependencies are imported
    # first, without it.
    import importlib
    from unittest.mock import MagicMock

    for dep in ("megatron.bridge.peft.utils", "megatron.bridge.peft.adapter_wrapper",
                "megatron.bridge.peft.lora_merge", "megatron.core.transformer.moe.moe_utils"):
        importlib.import_module(dep)
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        te = MagicMock()
        sys.modules["transformer_engine"] = te
        sys.modules["transformer_engine.pytorch"] = te.pytorch
        try:
            importlib.import_module("megatron.bridge.peft.lora_layers")
        finally:
            del sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"]
        notes.append("transformer_engine absent: MagicMock while importing "
                     "megatron.bridge.peft.lora_layers only")
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec
    import megatron.bridge.models.qwen.qwen3_bridge  # noqa: F401 - registers Qwen3Bridge
    import megatron.bridge.models.qwen.qwen3_moe_bridge  # noqa: F401 - registers Qwen3MoEBridge

    return AutoBridge, local_layer_spec


def trainer(rank, a, case, store, port, q):
    notes = []
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE="4", LOCAL_RANK="0")
        torch.cuda.set_device(0)
        import torch.distributed as dist
        from datetime import timedelta

        dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=300))
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        par = case["par"]
        ps.initialize_model_parallel(
            tensor_model_parallel_size=par["tp"], pipeline_model_parallel_size=par["pp"],
            virtual_pipeline_model_parallel_size=par["vpp"] if par["vpp"] > 1 else None,
            expert_model_parallel_size=par["ep"], expert_tensor_parallel_size=par["etp"])
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        AutoBridge, local_layer_spec = import_bridge(notes)
        bridge = AutoBridge.from_hf_pretrained(a["hf"], torch_dtype=torch.bfloat16)
        provider = bridge.to_megatron_provider(load_weights=False)
        overrides = dict(
            tensor_model_parallel_size=par["tp"], pipeline_model_parallel_size=par["pp"],
            virtual_pipeline_model_parallel_size=par["vpp"] if par["vpp"] > 1 else None,
            expert_model_parallel_size=par["ep"], expert_tensor_parallel_size=par["etp"],
            sequence_parallel=False, transformer_layer_spec=local_layer_spec,
            # No apex / Transformer Engine on the GPU machine: the unfused paths.
            gradient_accumulation_fusion=False, masked_softmax_fusion=False,
            bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
            apply_rope_fusion=False, cross_entropy_loss_fusion=False, moe_permute_fusion=False,
            # The local spec builds SequentialMLP either way on core 0.17+; on 0.13-0.16
            # moe_grouped_gemm would build the legacy GroupedMLP.
            moe_grouped_gemm=False,
            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True,
            perform_initialization=False, use_cpu_initialization=a["init"] == "cpu")
        for k, v in overrides.items():
            if hasattr(provider, k):
                setattr(provider, k, v)
            else:
                notes.append(f"provider has no {k}")
        provider.finalize()
        chunks = provider.provide_distributed_model(wrap_with_ddp=False, bf16=True,
                                                    use_cpu_initialization=a["init"] == "cpu")
        t0 = time.perf_counter()
        bridge.load_hf_weights(chunks)
        load_s = time.perf_counter() - t0
        for c in chunks:
            c.cuda(0)
        shardsync = import_shardsync()
        plan = shardsync.Plan(a["hf"], case["trainer"], ROLLOUT, engine="sglang",
                              trainer_dtype="bf16", wire_dtype="bf16")
        s = shardsync.Session(plan, rank, store, token=TOKEN, connect_timeout=300,
                              sync_timeout=120)
        src = shardsync.bind_trainer(s, chunks, layout="megatron")
        s.connect()
        rep = s.sync(1)
        names = sorted({n for _, n in src.tensors})
        q.put(("trainer", rank, {
            "coords_from": src.coords_from, "config_checked": src.config_checked,
            "coords": plan.trainer_coords(rank), "bound": len(src.tensors),
            "chunks": len(chunks), "chunk_types": [type(c).__name__ for c in chunks],
            "inner_types": sorted({type(m).__name__ for c in chunks for m in c.modules()
                                   if "MLP" in type(m).__name__ or "Norm" in type(m).__name__}),
            "sample_names": [n for n in names if "experts" in n or "layernorm" in n][:4],
            "bridge_load_s": load_s, "device": s.device, "verified": rep["verified"],
            "checksums": f"{rep['checksums_ok']}/{rep['checksums_total']}",
            "sync_s": rep["seconds"], "bytes": rep["bytes"], "notes": notes}))
        s.close()
    except Exception as e:  # noqa: BLE001
        q.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}\n{notes}"))


def engine(rank, a, case, store, q):
    try:
        from safetensors.torch import load_file, save_file

        shardsync = import_shardsync()
        torch.cuda.set_device(0)
        plan = shardsync.Plan(a["hf"], case["trainer"], ROLLOUT, engine="sglang",
                              trainer_dtype="bf16", wire_dtype="bf16")
        d = plan.describe_rank(rank)
        sm = plan.shard_map().rank(d["tp_rank"], d["pp_rank"])
        params = {p.name: torch.full(tuple(p.shape), float("nan"), dtype=torch.bfloat16,
                                     device="cuda") for p in sm.params}
        s = shardsync.Session(plan, rank, store, token=TOKEN, connect_timeout=300,
                              sync_timeout=120)
        shardsync.bind_engine(s, params.items())
        s.connect()
        rep = s.sync(1)
        s.close()
        hf = load_file(os.path.join(a["hf"], "model.safetensors"))
        bad = total = 0
        for p in sm.params:
            want = torch.full(tuple(p.shape), float("nan"), dtype=torch.bfloat16)
            for pc in p.pieces:
                want[pc.dst.slices()] = hf[pc.source][pc.src.slices()].reshape(pc.dst.extent)
            for z in p.zero_fills:
                want[z.slices()] = 0
            got = params[p.name].cpu()
            bad += int((got.view(torch.int16) != want.view(torch.int16)).sum())
            total += got.numel()
        os.makedirs(a["dump"], exist_ok=True)
        save_file({n: t.cpu().contiguous() for n, t in params.items()},
                  os.path.join(a["dump"], f"rank-{rank}.safetensors"),
                  metadata={"shardsync.replica": "0", "shardsync.tp_rank": str(d["tp_rank"]),
                            "shardsync.pp_rank": str(d["pp_rank"])})
        q.put(("engine", rank, {"tp": d["tp_rank"], "pp": d["pp_rank"], "params": len(sm.params),
                                "elements": total, "mismatches": bad, "device": s.device,
                                "verified": rep["verified"]}))
    except Exception as e:  # noqa: BLE001
        q.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_case(name, a, port):
    shardsync = import_shardsync()
    case = CASES[name]
    hf = os.path.join(a.work, f"hf-{name}")
    tensors = write_hf_checkpoint(case, hf)
    args = {"hf": hf, "dump": os.path.join(a.work, f"dump-{name}"), "init": a.init}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time()
    results = []
    with shardsync.StoreServer(token=TOKEN) as srv:
        procs = [ctx.Process(target=trainer, args=(r, args, case, srv.address, port, q))
                 for r in range(4)]
        procs += [ctx.Process(target=engine, args=(r, args, case, srv.address, q))
                  for r in range(4, 8)]
        for p in procs:
            p.start()
        for _ in procs:
            try:
                item = q.get(timeout=a.timeout if not any(k == "error" for k, _, _ in results)
                             else 5)
            except Exception:  # noqa: BLE001 - queue.Empty: the rest never reported
                break
            if item[0] == "error":
                print(f"[{name}] rank {item[1]} failed: {item[2]}", file=sys.stderr, flush=True)
            results.append(item)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    results.sort(key=lambda x: x[1])
    ok = len(results) == 8 and all(k != "error" for k, _, _ in results)
    eng = [v for k, _, v in results if k == "engine"]
    summary = {"case": name, "trainer": case["trainer"], "rollout": f"sglang {ROLLOUT}",
               "hf_tensors": tensors, "seconds": round(time.time() - t0, 1),
               "elements": sum(v["elements"] for v in eng),
               "mismatches": sum(v["mismatches"] for v in eng), "ranks": results}
    ok = ok and summary["mismatches"] == 0 and summary["elements"] > 0
    if ok and a.cli:
        cmd = [a.cli, "generate", "--weights", hf, "--engine", "sglang", "--tp", "2", "--pp", "2",
               "--engine-dump", args["dump"], "--max-new-tokens", "8", "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        summary["generate_cmd"] = " ".join(cmd)
        summary["generate_rc"] = r.returncode
        try:
            summary["generation"] = json.loads(r.stdout)
        except ValueError:
            summary["generation"] = {"stdout": r.stdout[-2000:], "stderr": r.stderr[-2000:]}
        ok = ok and r.returncode == 0 and summary["generation"].get("match") is True
    summary["ok"] = ok
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="where the JSON results go")
    ap.add_argument("--work", default="/tmp/megatron-real-client",
                    help="the HF checkpoints and the engine dumps")
    ap.add_argument("--case", default="all", choices=["dense", "moe", "all"])
    ap.add_argument("--cli", default=None, help="the shardsync CLI, for the token check")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--init", default="cpu", choices=["cpu", "cuda"],
                    help="where the chunks are built and Bridge loads them (cpu: its tp scatters "
                         "run on CPU tensors over gloo); they are moved to the GPU to be bound")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    names = ["dense", "moe"] if a.case == "all" else [a.case]
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "cases": []}
    # The cases are independent jobs (their own store, gloo port, processes): run side by side.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(names)) as ex:
        futures = [ex.submit(run_case, n, a, 29611 + i) for i, n in enumerate(names)]
        for f in futures:
            s = f.result()
            out["cases"].append(s)
            print(json.dumps(s, indent=1, default=str), flush=True)
    out["ok"] = all(c["ok"] for c in out["cases"])
    with open(os.path.join(a.out, "megatron_real_client.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print("ALL OK" if out["ok"] else "FAILED", flush=True)
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
