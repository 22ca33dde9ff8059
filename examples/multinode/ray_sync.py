"""shardsync on a Ray cluster, colocated: one actor per sync rank, placed by a placement group so
that trainer rank i and engine rank i share GPU i, across 2 nodes x 8 GPUs by default.

    ray start --head                                   # node 0
    ray start --address <node 0>:6379                  # node 1
    python examples/multinode/ray_sync.py              # on node 0: 2 x 8 GPUs, 32 sync ranks

Layout (docs/python.md, "Multi-node"): G = nodes x gpus_per_node bundles of {"GPU": 1}, reordered
so each node's bundles are consecutive (a placement group may number them in any node order).
Trainer rank i (fsdp=G) and engine rank i (rollout dp=G/T, tp=T, pp=1) both take bundle i with
num_gpus=0.5: Ray gives both the same CUDA_VISIBLE_DEVICES, as colocated RL runs trainer and
rollout on the same GPUs. An engine replica's T ranks fill T consecutive bundles, so with T
dividing gpus_per_node a replica never straddles nodes. Each (trainer, engine) pair then takes
cuda_ipc inside a node and nccl across (device sessions, routed at connect()). The driver
serves the store on this node's address; every actor connects to it.

Needs ray, torch with CUDA and a CUDA build of shardsync on every node (the actors are defined
in this file and shipped by Ray; nothing else has to be copied). Written against Ray's
documented placement-group API (ray.util.placement_group, placement_group_table,
PlacementGroupSchedulingStrategy); not run here (no Ray, no GPUs on the development machine).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import zlib
from collections import defaultdict

import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import shardsync


def weights(name, shape, version):
    """Full HF tensor `name` at step `version` (fp32, deterministic; as in host_sync.py)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
    return torch.randn(*shape, generator=g)


@ray.remote
class SyncRank:
    """One sync rank: a trainer rank holding FSDP-style shards, or an engine rank holding its
    TP x PP parameters, both CUDA tensors on the GPU Ray assigned."""

    def __init__(self, spec, rank, store, token, timeout):
        import torch

        self.torch = torch
        self.plan = shardsync.Plan.from_spec(spec)
        self.rank = rank
        self.device = torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES: this bundle's GPU
        torch.cuda.set_device(self.device)
        self.shapes = {n: s for n, s, _ in self.plan.hf_tensors()}
        self.session = shardsync.Session(self.plan, rank, store, token=token,
                                         connect_timeout=timeout, sync_timeout=timeout)
        who = self.plan.describe_rank(rank)
        if self.session.is_trainer:
            self.shards = {}
            for name, shape in self.shapes.items():
                region = self.plan.held_region(rank, shape)
                if region.numel:
                    t = weights(name, shape, 0)[region.slices()].contiguous().to(self.device)
                    self.shards[name] = t
                    self.session.bind_source(name, t)
        else:
            self.mine = self.plan.shard_map().rank(who["tp_rank"], who["pp_rank"])
            self.params = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16, device=self.device)
                           for p in self.mine.params}
            for name, t in self.params.items():
                self.session.bind_destination(name, t)

    def where(self):
        """(node address, GPU ids) of this actor."""
        return ray.util.get_node_ip_address(), ray.get_gpu_ids()

    def connect(self):
        self.session.connect()

    def step(self, version):
        """The trainer updates its shards in place; every rank syncs; engines check elements."""
        torch = self.torch
        if self.session.is_trainer:
            for name, shard in self.shards.items():
                region = self.plan.held_region(self.rank, self.shapes[name])
                shard.copy_(weights(name, self.shapes[name], version)[region.slices()])
        report = self.session.sync(version)
        checked = 0
        if not self.session.is_trainer:
            torch.cuda.synchronize(self.device)
            for p in self.mine.params:
                want = torch.zeros(p.shape, dtype=torch.float32)
                for pc in p.pieces:
                    src = weights(pc.source, self.shapes[pc.source], version)[pc.src.slices()]
                    want[pc.dst.slices()] = src.reshape(pc.dst.extent)
                want = want.to(torch.bfloat16).to(self.device)
                if not torch.equal(self.params[p.name], want):
                    raise RuntimeError(f"sync rank {self.rank}: {p.name} differs at step {version}")
                checked += want.numel()
        return {"verified": report["verified"], "bytes": report["bytes"],
                "seconds": report["seconds"], "checked": checked}

    def close(self):
        self.session.close()


def node_ordered_bundles(pg):
    """Bundle indices with each node's bundles consecutive (nodes in first-seen order)."""
    by_node = defaultdict(list)
    for bundle, node in sorted(placement_group_table(pg)["bundles_to_node_id"].items()):
        by_node[node].append(bundle)
    return [b for bundles in by_node.values() for b in bundles]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--tp", type=int, default=4, help="engine tensor parallel size")
    ap.add_argument("--model", default="qwen3-0.6b", help="embedded name or config.json path")
    ap.add_argument("--engine", default="sglang", choices=["sglang", "vllm"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()

    G = args.nodes * args.gpus_per_node
    if args.gpus_per_node % args.tp:
        sys.exit(f"--tp {args.tp} must divide --gpus-per-node {args.gpus_per_node} (a replica "
                 "inside one node)")
    plan = shardsync.Plan(args.model, f"fsdp={G}", f"dp={G // args.tp},tp={args.tp},pp=1",
                          engine=args.engine, bucket_bytes=64 << 20)
    print(plan, f"sync world {plan.world_size}")
    est = plan.cost_model(nodes=args.nodes, gpus_per_node=args.gpus_per_node)["estimates"]
    print(f"cost model: {est['plan_seconds'] * 1e3:.1f} ms per sync "
          f"(broadcast-all {est['broadcast_seconds'] * 1e3:.1f} ms)")

    ray.init(address="auto")
    pg = placement_group([{"GPU": 1, "CPU": 2}] * G, strategy="PACK")
    ray.get(pg.ready(), timeout=args.timeout)
    bundles = node_ordered_bundles(pg)

    token = secrets.token_hex(16)
    store = shardsync.StoreServer(host="0.0.0.0", port=0, token=token)
    address = f"{ray.util.get_node_ip_address()}:{store.port}"
    actors = []
    for rank in range(plan.world_size):
        gpu = rank if rank < G else rank - G  # trainer rank i and engine rank i: bundle i
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                    placement_group_bundle_index=bundles[gpu])
        actors.append(SyncRank.options(num_gpus=0.5, num_cpus=1, scheduling_strategy=strategy)
                      .remote(plan.spec, rank, address, token, args.timeout))
    for rank, (node, gpus) in enumerate(ray.get([a.where.remote() for a in actors],
                                                timeout=args.timeout)):
        if rank in (0, G - 1, G, plan.world_size - 1):
            print(f"sync rank {rank}: node {node}, GPU {gpus}")
    ray.get([a.connect.remote() for a in actors], timeout=args.timeout)
    for step in range(1, args.steps + 1):
        out = ray.get([a.step.remote(step) for a in actors], timeout=args.timeout)
        if not all(o["verified"] for o in out):
            sys.exit(f"step {step}: not verified")
        print(f"step {step}: {out[0]['bytes']} bytes in {out[0]['seconds'] * 1e3:.1f} ms, "
              f"{sum(o['checked'] for o in out)} engine elements checked")
    ray.get([a.close.remote() for a in actors], timeout=args.timeout)
    store.stop()
    print("VERIFIED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
