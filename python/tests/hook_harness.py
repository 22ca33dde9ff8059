"""Trainer ranks and checks shared by the engine-hook tests: trainers are threads over the
loopback transport, fed fake FSDP2 shards of a fresh set of HF tensors per version."""

from __future__ import annotations

import json
import queue
import threading

import numpy as np

import shardsync
from conftest import expected_fp8_param, reference_weights
from fakes import fsdp_state_dict

TOKEN = "hooks-test-token-0123456789"

# A tiny Qwen3-MoE: fused qkv, q/k norms, router, stacked experts (w13 / w2).
TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
    "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2, "vocab_size": 128,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def make_plan(model, rollout, engine, trainer="fsdp=2", quant=None, commit="inplace"):
    return shardsync.Plan(model, trainer, rollout, engine=engine, wire_dtype="f32",
                          trainer_dtype="f32", bucket_bytes=64 << 10, quant=quant, commit=commit)


def base_config(plan, srv, **over):
    cfg = {"plan": plan.spec, "store": srv.address, "token": TOKEN, "transport": "loopback",
           "connect_timeout": 20.0, "sync_timeout": 20.0}
    cfg.update(over)
    return json.loads(json.dumps(cfg))  # what crosses an RPC: plain JSON


class Trainers:
    """Every trainer rank of the plan, each a thread that connects, then syncs the versions it
    is asked for (filling its shards from reference_weights(plan, seed=version) first)."""

    def __init__(self, plan, srv):
        self.plan, self.srv = plan, srv
        self.full = {}
        self._q = [queue.Queue() for _ in range(plan.trainer_world)]
        self.results = {r: {} for r in range(plan.trainer_world)}
        self._done = threading.Condition()
        self._threads = [threading.Thread(target=self._run, args=(r,), daemon=True)
                         for r in range(plan.trainer_world)]

    def weights(self, version):
        if version not in self.full:
            self.full[version] = reference_weights(self.plan, seed=version)
        return self.full[version]

    def _run(self, rank):
        s = None
        try:
            s = shardsync.Session(self.plan, rank, self.srv.address, token=TOKEN,
                                  transport="loopback", connect_timeout=20.0, sync_timeout=20.0)
            sd = fsdp_state_dict(self.weights(1), rank, self.plan.trainer_world)
            shardsync.bind_trainer(s, sd)
            s.connect()
            self._set(rank, "connect", True)
            while True:
                v = self._q[rank].get()
                if v is None:
                    break
                fresh = fsdp_state_dict(self.weights(v), rank, self.plan.trainer_world)
                for n, dt in sd.items():
                    dt._local[...] = fresh[n]._local
                try:
                    self._set(rank, v, s.sync(v))
                except Exception as e:  # noqa: BLE001
                    self._set(rank, v, e)
        except Exception as e:  # noqa: BLE001
            self._set(rank, "connect", e)
        finally:
            if s is not None:
                s.close()

    def _set(self, rank, key, value):
        with self._done:
            self.results[rank][key] = value
            self._done.notify_all()

    def start(self):
        for t in self._threads:
            t.start()
        return self

    def sync(self, version):
        self.weights(version)
        for q in self._q:
            q.put(version)

    def wait(self, key, timeout=60.0):
        with self._done:
            ok = self._done.wait_for(
                lambda: all(key in self.results[r] for r in self.results), timeout)
        assert ok, f"trainers did not finish {key!r} within {timeout}s"
        return [self.results[r][key] for r in sorted(self.results)]

    def stop(self):
        for q in self._q:
            q.put(None)
        for t in self._threads:
            t.join(30)


def check_models(plan, full, models):
    """Every engine parameter holds exactly its pieces of `full` (zero fills included; block-FP8
    weights and scales as the reference quantizer makes them, scales compared as bits)."""
    sm = plan.shard_map()
    n = 0
    cache = {}
    for (replica, tp, pp), model in models.items():
        params = dict(model.named_parameters())
        for p in sm.rank(tp, pp).params:
            got = params[p.name].detach().numpy()
            want = expected_fp8_param(p, full, cache)
            if want.dtype == np.float32:
                got, want = got.view(np.uint32), want.view(np.uint32)
            assert np.array_equal(got, want), (replica, tp, pp, p.name)
            n += 1
    assert n > 0
