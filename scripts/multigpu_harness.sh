#!/usr/bin/env bash
# Multi-GPU runs (issue 8) from a fresh clone on a machine with 2-8 GPUs:
#   git clone ... shardsync && cd shardsync && scripts/multigpu_harness.sh [--build-only|--run-only]
# Builds with CUDA (needs nvcc, cmake, the Debian deps of scripts/install-deps.sh), then runs the
# GPU tests and shardsync_gpu over NCCL and CUDA IPC: correctness on a small model (element-equal
# and the reference engine's tokens), speed against the broadcast-all baseline and the link bound
# (qwen3-32b and qwen3-30b-a3b, bf16), and a dead engine peer. Trainer fsdp=G (one process per
# GPU), rollout dp=1,tp=1|2,pp=2 colocated on the same G GPUs (G = 2 or 4; with 8: fsdp=8 ->
# dp=2,tp=2,pp=2). Knobs: WHAT ("correct speed fault"), MODELS, SMALL_MODEL, FSDP, SKIP_TESTS=1.
# Reports: ${OUT:-gpu-logs}/*.json, summary in summary.txt.
# Where the GPU machine cannot build (no UCX/xxhash headers), build elsewhere and carry:
#   cmake -S . -B build-gpu -DSHARDSYNC_CUDA=ON && cmake --build build-gpu --target shardsync_gpu test_gpu
#   ../shared/tools/device-bundle.sh .bundle-gpu build-gpu/shardsync_gpu build-gpu/tests/cuda/test_gpu
set -uo pipefail
what=${1:-}
if [ "$what" != --run-only ] && [ ! -x .bundle-gpu/bin/shardsync_gpu ]; then
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSHARDSYNC_CUDA=ON >/dev/null || exit 1
  cmake --build build-gpu -j"$(nproc)" --target shardsync_gpu test_gpu >/dev/null || exit 1
fi
[ "$what" = --build-only ] && exit 0
out=${OUT:-gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -x .bundle-gpu/bin/shardsync_gpu ]; then
  bin=.bundle-gpu/bin; tests=$bin/test_gpu
  export LD_LIBRARY_PATH=$PWD/.bundle-gpu/lib:${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$PWD/.bundle-gpu/lib/ucx
else
  bin=build-gpu; tests=build-gpu/tests/cuda/test_gpu
fi
gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
fails=0
run() {
  local name=$1; shift
  echo "== $name: shardsync_gpu bench $*" | tee -a "$out/summary.txt"
  timeout 580 "$bin/shardsync_gpu" bench "$@" >"$out/$name.json" 2>"$out/$name.log"
  local rc=$?
  grep -E "^(qwen|generation)" "$out/$name.log" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || { echo "   -> FAILED (exit $rc)" | tee -a "$out/summary.txt"; fails=$((fails + 1)); }
}
{ nvidia-smi -L; nvidia-smi topo -m; "$bin/shardsync_gpu" info; } >"$out/env_multi.txt" 2>&1
[ "${SKIP_TESTS:-0}" = 1 ] || { timeout 300 "$tests" >"$out/test_gpu_multi.log" 2>&1 || fails=$((fails + 1)); }
# Layouts: 8 GPUs: fsdp=8 -> dp=2,tp=2,pp=2; 2 or 4 GPUs: fsdp=G -> dp=1,tp=1|2,pp=2 (the
# engine ranks on the GPUs SGLang's PP-major rule gives them, colocated with the trainers).
if [ "$gpus" -ge 8 ]; then layouts=("dp=2,tp=2,pp=2"); fsdp=8
elif [ "$gpus" -ge 4 ]; then layouts=("dp=1,tp=2,pp=2" "dp=1,tp=1,pp=2"); fsdp=4
else layouts=("dp=1,tp=1,pp=2"); fsdp=$gpus; fi
# One GPU: a dry run of the same jobs (fsdp=2, every rank on GPU 0, so every pair is cuda_ipc).
transports=(nccl cuda_ipc)
if [ "$gpus" -eq 1 ]; then fsdp=2; transports=(cuda_ipc); fi
fsdp=${FSDP:-$fsdp}
what=${WHAT:-correct speed fault}
# 1. Correctness on a small model: every engine element equal to its HF source, and the reference
#    engine's greedy tokens on the received parameters equal the unsharded model's.
if [[ $what == *correct* ]]; then
  for lay in "${layouts[@]}"; do
    for tr in "${transports[@]}"; do
      run "correct_${tr}_${lay//[=,]/_}" --model "${SMALL_MODEL:-qwen3-0.6b}" --gpus "$gpus" \
        --trainer "fsdp=$fsdp" --rollout "$lay" --transport "$tr" --trainer-dtype f32 --iters 2 \
        --gen-tokens 8 --no-kernel-bench --no-memcpy
    done
  done
fi
# 2. Speed: sharded vs broadcast-all vs the link bound, bf16, on the first layout.
if [[ $what == *speed* ]]; then
  for model in ${MODELS:-qwen3-32b qwen3-30b-a3b}; do
    for tr in "${transports[@]}"; do
      run "speed_${model}_${tr}" --model "$model" --gpus "$gpus" --trainer "fsdp=$fsdp" \
        --rollout "${layouts[0]}" --transport "$tr" --trainer-dtype bf16 --iters 5 --broadcast \
        --no-kernel-bench
    done
  done
fi
# 3. Dead peer: an engine process dies mid-sync; every other rank must error within 10 s.
if [[ $what == *fault* ]]; then
  for tr in "${transports[@]}"; do
    run "fault_engine_${tr}" --model qwen3-0.6b --gpus "$gpus" --trainer "fsdp=$fsdp" \
      --rollout "${layouts[0]}" --transport "$tr" --kill-rank "$((fsdp + 1))" --timeout-ms 10000 \
      --iters 2 --no-kernel-bench --no-memcpy
  done
fi
echo "failures: $fails" | tee -a "$out/summary.txt"
exit $((fails > 0))
