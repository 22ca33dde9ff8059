#!/usr/bin/env bash
# GPU runs of the product path on a GPU machine: test_gpu, then `shardsync bench --device cuda`
# (SyncSession with device bindings, routed cuda_ipc / nccl pairs) for correctness, faults and
# speed. Usage (repo root):   scripts/device_gpu_tests.sh [quick|full|multi]
# Logs and JSON reports go to ${OUT:-gpu-logs}/. Binaries: .bundle/bin (scripts/device_bundle.sh,
# built here) or build/. NVLink multicast stays off.
#   quick: test_gpu, small-model correctness with the generation check (FSDP and Megatron
#          trainers), a killed trainer.
#   full:  quick + qwen3-8b fsdp=1 -> dp=1,tp=2,pp=2 colocated on one GPU, bf16 and fp32, and
#          qwen3-8b megatron=tp=2,pp=2 -> dp=1,tp=2,pp=2 bf16.
#   multi: 2+ GPUs: fsdp=G -> dp=1,tp=1,pp=2 over nccl (hint) and auto, correctness with
#          generation, qwen3-8b / qwen3-32b speed, a killed engine rank.
set -uo pipefail
mode=${1:-full}
out=${OUT:-gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -x .bundle/bin/shardsync ]; then
  bin=.bundle/bin/shardsync tests=.bundle/bin/test_gpu
  export LD_LIBRARY_PATH=$PWD/.bundle/lib:${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$PWD/.bundle/lib/ucx
else
  bin=build/shardsync tests=build/tests/cuda/test_gpu
fi
fails=0
run() {  # run NAME ARGS...: one `shardsync bench --device cuda`, JSON in $out/NAME.json
  local name=$1; shift
  echo "== $name: shardsync bench --device cuda $*" | tee -a "$out/summary.txt"
  local t=(--timeout-ms "${TIMEOUT_MS:-60000}")
  [[ " $* " == *" --timeout-ms "* ]] && t=()
  timeout "${RUN_TIMEOUT_S:-580}" "$bin" bench --device cuda --json "${t[@]}" "$@" \
    >"$out/$name.json" 2>"$out/$name.log"
  local rc=$?
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print('  ', {k: j[k] for k in ['sharded_seconds','broadcast_seconds','raw_seconds','ratio_to_raw','speedup_vs_broadcast','raw_nccl_seconds','ratio_to_raw_nccl','verified','element_mismatches','checksums_ok','checksums_total','generation','cross_gpu_bytes','reconnect_ok','every_survivor_failed','survivors'] if k in j})" "$out/$name.json" 2>/dev/null | tee -a "$out/summary.txt"
  tail -n 2 "$out/$name.log" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || { echo "   -> FAILED (exit $rc)" | tee -a "$out/summary.txt"; fails=$((fails + 1)); }
}
{ nvidia-smi -L; nvidia-smi topo -m; "$bin" gpu-info; } >"$out/env.txt" 2>&1
gpus=$(nvidia-smi -L | wc -l)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== test_gpu" | tee -a "$out/summary.txt"
  timeout 300 "$tests" >"$out/test_gpu_$gpus.log" 2>&1 || fails=$((fails + 1))
  grep -E "PASSED|FAILED|SKIPPED \]" "$out/test_gpu_$gpus.log" | tee -a "$out/summary.txt"
fi
small=(--model qwen3-0.6b --reps 2 --warmup 1)
if [ "$mode" != multi ]; then
  run coloc_small_f32 "${small[@]}" --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
    --trainer-dtype fp32 --gen-tokens 8
  run fault_trainer "${small[@]}" --gpus 1 --trainer fsdp=2 --rollout dp=1,tp=2,pp=2 \
    --kill-rank 1 --timeout-ms 10000
  # Megatron trainer: local parameters (padded vocab rows garbage) read at the plan's regions.
  run coloc_small_megatron "${small[@]}" --gpus 1 --trainer megatron=tp=2,pp=2,vpp=2 \
    --rollout dp=1,tp=2,pp=2 --trainer-dtype fp32 --gen-tokens 8
fi
if [ "$mode" = full ]; then
  run coloc_8b_bf16 --model qwen3-8b --gpus 1 --trainer fsdp=1 --rollout dp=1,tp=2,pp=2 \
    --trainer-dtype bf16 --warmup 2 --reps 15
  run coloc_8b_f32 --model qwen3-8b --gpus 1 --trainer fsdp=1 --rollout dp=1,tp=2,pp=2 \
    --trainer-dtype fp32 --warmup 1 --reps 5
  # Issue 28: Megatron tp2 pp2 -> SGLang tp2 pp2, >= 0.8x cudaMemcpy of the same bytes.
  run coloc_8b_megatron_bf16 --model qwen3-8b --gpus 1 --trainer megatron=tp=2,pp=2 \
    --rollout dp=1,tp=2,pp=2 --trainer-dtype bf16 --warmup 2 --reps 15
fi
if [ "$mode" = multi ]; then
  g=${GPUS:-$gpus}
  for tr in ${CORRECT_TRANSPORTS:-nccl auto}; do
    run "correct_${tr}" "${small[@]}" --gpus "$g" --trainer "fsdp=$g" --rollout dp=1,tp=1,pp=2 \
      --transport "$tr" --trainer-dtype fp32 --gen-tokens 8
  done
  for mb in ${BUCKETS_MB:-}; do  # round size (plan bucket) sweep on qwen3-8b
    run "speed_qwen3-8b_nccl_b$mb" --model qwen3-8b --gpus "$g" --trainer "fsdp=$g" \
      --rollout dp=1,tp=1,pp=2 --transport nccl --trainer-dtype bf16 --warmup 1 --reps 5 \
      --bucket-mb "$mb"
  done
  for model in ${MODELS:-qwen3-8b qwen3-32b}; do
    run "speed_${model}_nccl" --model "$model" --gpus "$g" --trainer "fsdp=$g" \
      --rollout dp=1,tp=1,pp=2 --transport nccl --trainer-dtype bf16 --warmup 1 --reps 5 \
      ${BENCH_ARGS:-}
  done
  run correct_megatron_nccl "${small[@]}" --gpus "$g" --trainer megatron=tp=1,pp=2 \
    --rollout dp=1,tp=1,pp=2 --transport nccl --trainer-dtype bf16 --gen-tokens 8
  run fault_engine_nccl "${small[@]}" --gpus "$g" --trainer "fsdp=$g" --rollout dp=1,tp=1,pp=2 \
    --transport nccl --kill-rank "$((g + 1))" --timeout-ms 10000
fi
echo "failures: $fails" | tee -a "$out/summary.txt"
exit $((fails > 0))
