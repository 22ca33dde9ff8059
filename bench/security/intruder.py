#!/ usr / bin / env python3
"""Issue 37's intruder measurement: a 4-rank job (2 trainer ranks, 2 engine ranks) whose trainer
rank 1 starts late, and a lone process with other weights that claims rank 1 first, with no
launch identity, with the job's id, with the job's id and a wrong secret, with another launch's
id and secret. Counts the runs where any rank of the job reports a verified sync while holding
the intruder's weights (must be 0), and how the job and the intruder ended.

CLI: every rank is a `shardsync run` process (the job's ranks get SHARDSYNC_JOB_ID and
SHARDSYNC_JOB_SECRET as a launcher gives them). Python: every rank a thread with its own
shardsync.Session (shm transport), the job's made with shardsync.new_launch().

    /usr/bin/python3 bench/security/intruder.py --cli build/shardsync --trials 20
(the shardsync package importable: pip-installed from the build, as scripts/test.sh does)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time

import numpy as np

import shardsync

TINY = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "vocab_size": 200, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
KINDS = ("no identity", "the job's id", "the job's id, wrong secret", "another launch")
TOKEN = "intruder-bench-token-0123456789"


def intruder_launch(kind: str, launch: dict) -> dict:
    return {"no identity": {"job_id": "", "job_secret": ""},
            "the job's id": {"job_id": launch["job_id"], "job_secret": ""},
            "the job's id, wrong secret": {"job_id": launch["job_id"],
                                           "job_secret": shardsync.new_launch()["job_secret"]},
            "another launch": shardsync.new_launch()}[kind]


def verified_wrong(r: dict) -> bool:
    rep = r.get("report") or r
    ok, total = rep.get("checksums_ok", 0), rep.get("checksums_total", 0)
    return total > 0 and ok == total and r.get("element_mismatches", 0) > 0


def cli_trial(cli: str, model: str, kind: str) -> dict:
    launch = shardsync.new_launch()
    bad = intruder_launch(kind, launch)
    with shardsync.StoreServer(token=TOKEN) as srv:
        def spawn(rank: int, seed: int, ident: dict) -> subprocess.Popen:
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SHARDSYNC_", "TORCHELASTIC_", "SLURM_", "RAY_"))}
            env.update(SHARDSYNC_STORE=srv.address, SHARDSYNC_TOKEN=TOKEN, WORLD_SIZE="4",
                       RANK=str(rank))
            if ident["job_id"]:
                env["SHARDSYNC_JOB_ID"] = ident["job_id"]
            if ident["job_secret"]:
                env["SHARDSYNC_JOB_SECRET"] = ident["job_secret"]
            role = "trainer" if rank < 2 else "engine"
            return subprocess.Popen(
                [cli, "run", "--model", model, "--trainer", "fsdp=2", "--rollout",
                 "dp=1,tp=2,pp=1", "--engine", "sglang", "--transport", "shm", "--syncs", "2",
                 "--timeout-ms", "8000", "--seed", str(seed), "--role", role],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        job = {r: spawn(r, 3, launch) for r in (0, 2, 3)}
        intruder = spawn(1, 9, bad)
        try:
            intruder.wait(timeout=3)  # refused at once, or (a bug) in the job: rank 1 comes late
        except subprocess.TimeoutExpired:
            pass
        job[1] = spawn(1, 3, launch)
        out = {}
        for r, p in list(job.items()) + [("intruder", intruder)]:
            so, se = p.communicate(timeout=60)
            lines = [ln for ln in so.splitlines() if ln.startswith("{")]
            out[r] = (p.returncode, json.loads(lines[-1]) if lines else {}, se.strip()[-300:])
    return out


def python_rank(plan, rank, address, seed, ident, out):
    rng = np.random.default_rng(seed)
    full = {n: rng.standard_normal(s).astype(np.float32) for n, s, _ in plan.hf_tensors()}
    s = shardsync.Session(plan, rank, address, token=TOKEN, transport="shm",
                          connect_timeout=8, sync_timeout=8, **ident)
    try:
        keep = {}
        if s.is_trainer:
            for n, a in full.items():
                reg = plan.held_region(rank, a.shape)
                if reg.numel:
                    keep[n] = np.ascontiguousarray(a[reg.slices()])
                    s.bind_source(n, keep[n])
        else:
            for p in s.expected_params():
                keep[p.name] = np.zeros(p.shape, np.float32)
                s.bind_destination(p.name, keep[p.name])
        try:
            s.connect()
            verified = all(s.sync(v)["verified"] for v in (1, 2))
        except shardsync.Error as e:
            out[rank] = {"ok": False, "error": str(e)[:300]}
            return
        bad = 0
        if not s.is_trainer:
            rng = np.random.default_rng(3)  # the job's own weights
            own = {n: rng.standard_normal(sh).astype(np.float32) for n, sh, _ in plan.hf_tensors()}
            for p in s.expected_params():
                exp = np.zeros(p.shape, np.float32)
                for pc in p.pieces:
                    exp[pc.dst.slices()] = own[pc.source][pc.src.slices()].reshape(pc.dst.extent)
                bad += int(np.sum(keep[p.name] != exp))
        out[rank] = {"ok": True, "verified": verified, "element_mismatches": bad}
    finally:
        s.close()


def python_trial(plan, kind: str) -> dict:
    launch = shardsync.new_launch()
    bad = intruder_launch(kind, launch)
    out, intr = {}, {}
    with shardsync.StoreServer(token=TOKEN) as srv:
        ts = [threading.Thread(target=python_rank, args=(plan, r, srv.address, 3, launch, out))
              for r in (0, 2, 3)]
        it = threading.Thread(target=python_rank, args=(plan, 1, srv.address, 9, bad, intr))
        for t in ts + [it]:
            t.start()
        it.join(3)
        late = threading.Thread(target=python_rank, args=(plan, 1, srv.address, 3, launch, out))
        late.start()
        for t in ts + [it, late]:
            t.join(60)
    return {"job": out, "intruder": intr.get(1, {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", help="the shardsync binary (skip the CLI runs without it)")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--no-python", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(TINY, f)
        if a.cli:
            for kind in KINDS:
                wrong = job_ok = refused = 0
                t0 = time.time()
                for _ in range(a.trials):
                    o = cli_trial(a.cli, os.path.join(d, "config.json"), kind)
                    wrong += any(verified_wrong(o[r][1]) for r in range(4))
                    job_ok += all(o[r][0] == 0 for r in range(4))
                    refused += o["intruder"][0] != 0 and not o["intruder"][1].get("ok", False)
                print(f"CLI, intruder with {kind}: {a.trials} runs, {wrong} with a rank verified "
                      f"holding the intruder's weights; job verified whole in {job_ok}; intruder "
                      f"refused in {refused} ({time.time() - t0:.0f} s)", flush=True)
        if not a.no_python:
            plan = shardsync.Plan.from_spec(dict(
                model=d, trainer="fsdp=2", rollout="dp=1,tp=2,pp=1", engine="sglang",
                wire_dtype="f32", trainer_dtype="f32", bucket_bytes=64 << 10))
            for kind in KINDS:
                wrong = job_ok = refused = 0
                t0 = time.time()
                for _ in range(a.trials):
                    o = python_trial(plan, kind)
                    wrong += any(v.get("verified") and v.get("element_mismatches", 0) > 0
                                 for v in o["job"].values())
                    job_ok += len(o["job"]) == 4 and all(
                        v.get("ok") and v.get("verified") and v.get("element_mismatches", 0) == 0
                        for v in o["job"].values())
                    refused += not o["intruder"].get("ok", False)
                print(f"Python, intruder with {kind}: {a.trials} runs, {wrong} with a rank "
                      f"verified holding the intruder's weights; job verified whole in {job_ok}; "
                      f"intruder refused in {refused} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
