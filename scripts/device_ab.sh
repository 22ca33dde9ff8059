#!/usr/bin/env bash
# Same-call A/B of the one-H200 benchmark (docs/benchmarks.md): H200 machines differ by up to 2%,
# so variants are only compared inside one device call, alternating round by round.
# Usage (repo root, on the GPU machine): OUT=dir [ROUNDS="1 2 3"] [OLD_BIN=path] [TRACE=1]
#   [TESTS=1] [TRAINERS="fsdp=1 megatron=tp=2,pp=2"] [VARIANTS="old new noboard noturn"]
#   bash scripts/device_ab.sh
# Variants per round and trainer: `old` (OLD_BIN, default .bundle/bin/shardsync_old: a build of
# the commit to compare with, copied into the bundle after scripts/device_bundle.sh), `new`
# (.bundle/bin/shardsync), `noboard` (new with SHARDSYNC_VERDICT_BOARD=0) and `noturn` (new with
# SHARDSYNC_GPU_TURNSTILE=0: co-located senders launch without taking turns). TRACE=1 adds a traced
# run of the new binary per trainer (SHARDSYNC_TRACE=buffered, one log per rank in
# $OUT/trace[_<trainer>]). Reports: $OUT/<variant>_<round>.json (fsdp=1) or
# $OUT/<variant>_<trainer>_<round>.json.
set -u
out=${OUT:?set OUT}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.bundle/lib:${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$PWD/.bundle/lib/ucx
old=${OLD_BIN:-.bundle/bin/shardsync_old}
new=.bundle/bin/shardsync
job=(--model qwen3-8b --gpus 1 --rollout dp=1,tp=2,pp=2 --trainer-dtype bf16)
nvidia-smi -L
summary() {  # summary JSON LABEL
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], 'sharded %.3f ms cudaMemcpy %.3f ms ratio %.4f broadcast %.2fx checksums %s/%s mismatches %s' % (j['sharded_seconds']*1e3, j['raw_seconds']*1e3, j['ratio_to_raw'], j['speedup_vs_broadcast'], j.get('checksums_ok'), j.get('checksums_total'), j.get('element_mismatches')))" "$1" "$2"
}
if [ "${TESTS:-0}" = 1 ]; then
  timeout 300 .bundle/bin/test_gpu 2>&1 | grep -E "^\[  (PASSED|FAILED) |FAILED" | head -20
fi
tag() { [ "$1" = fsdp=1 ] && echo "" || echo "_$(echo "$1" | tr -c 'a-z0-9\n' '_')"; }
for r in ${ROUNDS:-1 2 3}; do
  for tr in ${TRAINERS:-fsdp=1}; do
    for v in ${VARIANTS:-old new noboard}; do
      bin=$new
      envs=()
      [ $v = old ] && bin=$old
      [ $v = noboard ] && envs=(SHARDSYNC_VERDICT_BOARD=0)
      [ $v = noturn ] && envs=(SHARDSYNC_GPU_TURNSTILE=0)
      [ -x "$bin" ] || { echo "skip $v: no $bin"; continue; }
      name=${v}$(tag "$tr")_$r
      env "${envs[@]}" timeout 300 "$bin" bench --device cuda "${job[@]}" --trainer "$tr" \
        --warmup 2 --reps 15 --json >"$out/$name.json" 2>"$out/$name.log"
      summary "$out/$name.json" "round $r $v $tr" || tail -5 "$out/$name.log"
    done
  done
done
if [ "${TRACE:-0}" = 1 ]; then
  for tr in ${TRAINERS:-fsdp=1}; do
    t=$(tag "$tr")
    mkdir -p "$out/trace$t"
    SHARDSYNC_TRACE=buffered SHARDSYNC_RANK_LOG_DIR=$out/trace$t timeout 300 $new bench \
      --device cuda "${job[@]}" --trainer "$tr" --warmup 2 --reps 5 --json \
      >"$out/traced$t.json" 2>"$out/traced$t.log"
    summary "$out/traced$t.json" "traced $tr"
  done
fi
