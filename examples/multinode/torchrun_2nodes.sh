#!/usr/bin/env bash
# The examples/host_sync.py job on 2 nodes x 8 GPUs with torchrun's c10d rendezvous: the trainer
# (FSDP, fsdp=8) on node 0, the rollout (2 SGLang replicas of tp=4) on node 1, device sessions.
# Run the same command on both nodes:
#
#   HEAD=node0.example:29400 NODE_RANK=0 bash examples/multinode/torchrun_2nodes.sh   # on node 0
#   HEAD=node0.example:29400 NODE_RANK=1 bash examples/multinode/torchrun_2nodes.sh   # on node 1
#
# torchrun numbers ranks node by node, so sync ranks 0-7 (the trainer: shardsync puts trainer
# ranks first) land on node 0 and engine ranks 8-15 on node 1; every (trainer, engine) pair
# crosses nodes and takes the nccl transport (cuda_ipc serves pairs inside a node). Rank 0
# serves the store on all interfaces (--store-bind 0.0.0.0) and hands every rank its address as
# MASTER_ADDR:port, MASTER_ADDR being the host torchrun chose for rank 0. Extra arguments go to
# host_sync.py (e.g. --model qwen3-8b). On one node, --nnodes 1 with 16 processes on 8 GPUs runs
# the same job colocated (two ranks per GPU, cuda_ipc for every pair). Host memory instead of
# CUDA: drop --device cuda (pairs across nodes then take ucx). Needs torch >= 2 (Debian 12's
# torchrun 1.13 fails on Python 3.11 before starting any worker); not run here (no GPUs).
set -euo pipefail
: "${HEAD:?set HEAD=host:port, the rendezvous on node 0}" "${NODE_RANK:?set NODE_RANK=0 or 1}"
cd "$(dirname "$0")/../.."
exec torchrun --nnodes 2 --node_rank "$NODE_RANK" --nproc_per_node 8 \
  --rdzv_backend c10d --rdzv_endpoint "$HEAD" --rdzv_id shardsync-example \
  examples/host_sync.py --device cuda --store-bind 0.0.0.0 \
  --trainer fsdp=8 --rollout dp=2,tp=4,pp=1 "$@"
