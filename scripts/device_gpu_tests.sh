#!/usr/bin/env bash
# GPU data path on a GPU machine (issue 7): GPU tests, then shardsync_gpu runs for correctness,
# fault handling and speed. Usage (repo root):
#   scripts/device_gpu_tests.sh [quick|full]      logs and JSON reports go to ${OUT:-gpu-logs}/
# Binaries: .bundle-gpu/bin (built elsewhere, see scripts/multigpu_harness.sh) or build-gpu/
# (configured here with -DSHARDSYNC_CUDA=ON if missing). NVLink multicast stays off.
set -uo pipefail
mode=${1:-full}
out=${OUT:-gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -x .bundle-gpu/bin/shardsync_gpu ]; then
  bin=.bundle-gpu/bin
  export LD_LIBRARY_PATH=$PWD/.bundle-gpu/lib:${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$PWD/.bundle-gpu/lib/ucx
else
  if [ ! -x build-gpu/shardsync_gpu ]; then
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSHARDSYNC_CUDA=ON >/dev/null &&
      cmake --build build-gpu -j"$(nproc)" --target shardsync_gpu test_gpu >/dev/null || exit 1
  fi
  bin=build-gpu
  [ -x "$bin/test_gpu" ] || bin_tests=build-gpu/tests/cuda
fi
tests=${bin_tests:-$bin}/test_gpu
fails=0
run() {  # run NAME ARGS...: one shardsync_gpu bench, report in $out/NAME.json, log in $out/NAME.log
  local name=$1; shift
  echo "== $name: shardsync_gpu bench $*" | tee -a "$out/summary.txt"
  timeout 580 "$bin/shardsync_gpu" bench "$@" >"$out/$name.json" 2>"$out/$name.log"
  local rc=$?
  tail -n 1 "$out/$name.log" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || { echo "   -> FAILED (exit $rc)" | tee -a "$out/summary.txt"; fails=$((fails + 1)); }
}
{ nvidia-smi -L; nvidia-smi topo -m; "$bin/shardsync_gpu" info; } >"$out/env.txt" 2>&1
echo "== test_gpu (ctest label gpu)" | tee -a "$out/summary.txt"
timeout 300 "$tests" >"$out/test_gpu.log" 2>&1 || fails=$((fails + 1))
grep -E "PASSED|FAILED|SKIPPED \]" "$out/test_gpu.log" | tee -a "$out/summary.txt"

small=(--model qwen3-0.6b --iters 2 --no-kernel-bench)
# Colocated correctness: trainer fsdp=2, engine tp=2,pp=2, all six processes on GPU 0.
run coloc_small_f32 "${small[@]}" --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
  --transport cuda_ipc --trainer-dtype f32
run coloc_small_pass "${small[@]}" --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
  --transport cuda_ipc --trainer-dtype bf16 --landed-check pass
# A sender killed mid-sync: every other rank errors within the timeout (10 s).
run fault_sender_ipc "${small[@]}" --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
  --transport cuda_ipc --kill-rank 1 --timeout-ms 10000 --no-memcpy
if [ "$mode" = full ]; then
  # Speed: qwen3-8b colocated on GPU 0 vs cudaMemcpy D2D of the same bytes, plus kernel GB/s.
  # One trainer process on the GPU (as in a colocated deployment: one trainer rank per GPU, the
  # engine ranks of that GPU beside it) ...
  run coloc_8b_bf16_1trainer --model qwen3-8b --gpus 1 --trainer fsdp=1 --rollout dp=1,tp=2,pp=2 \
    --transport cuda_ipc --trainer-dtype bf16 --iters 20
  run coloc_8b_f32_1trainer --model qwen3-8b --gpus 1 --trainer fsdp=1 --rollout dp=1,tp=2,pp=2 \
    --transport cuda_ipc --trainer-dtype f32 --iters 20 --no-kernel-bench
  # ... and two trainer processes sharing it (fsdp=2 emulated on one GPU; they pack in turn).
  run coloc_8b_bf16 --model qwen3-8b --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
    --transport cuda_ipc --trainer-dtype bf16 --iters 20 --no-kernel-bench
  run coloc_8b_f32 --model qwen3-8b --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
    --transport cuda_ipc --trainer-dtype f32 --iters 5 --no-kernel-bench
  # The same bf16 sync with the receivers' separate verify pass instead of the fused readback.
  run coloc_8b_bf16_pass --model qwen3-8b --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
    --transport cuda_ipc --trainer-dtype bf16 --iters 5 --no-kernel-bench --landed-check pass
  # Trainers sharing the GPU time-sliced by the GPU instead of packing in turn.
  run coloc_8b_bf16_noturns --model qwen3-8b --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
    --transport cuda_ipc --trainer-dtype bf16 --iters 5 --no-kernel-bench --no-turns
  # Four pairs in flight per thread in the landed kernels instead of two.
  SHARDSYNC_GPU_UNROLL=4 run coloc_8b_bf16_u4 --model qwen3-8b --gpus 1 --trainer fsdp=2 \
    --rollout dp=1,tp=2,pp=2 --transport cuda_ipc --trainer-dtype bf16 --iters 5 --no-kernel-bench
fi
echo "failures: $fails" | tee -a "$out/summary.txt"
exit $((fails > 0))
