#!/usr/bin/env bash
# Same-call A/B of the one-H200 benchmark (docs/benchmarks.md): H200 machines differ by up to 2%,
# so variants are only compared inside one device call, alternating round by round.
# Usage (repo root, on the GPU machine): OUT=dir [ROUNDS="1 2 3"] [OLD_BIN=path] [TRACE=1]
#   [TESTS=1] bash scripts/device_ab.sh
# Variants per round: `old` (OLD_BIN, default .bundle/bin/shardsync_old: a build of the commit to
# compare with, copied into the bundle after scripts/device_bundle.sh), `new` (.bundle/bin/shardsync)
# and `noboard` (new with SHARDSYNC_VERDICT_BOARD=0). TRACE=1 adds a traced run of the new binary
# (SHARDSYNC_TRACE=buffered, one log per rank in $OUT/trace). Reports: $OUT/<variant>_<round>.json.
set -u
out=${OUT:?set OUT}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.bundle/lib:${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$PWD/.bundle/lib/ucx
old=${OLD_BIN:-.bundle/bin/shardsync_old}
new=.bundle/bin/shardsync
job=(--model qwen3-8b --gpus 1 --trainer fsdp=1 --rollout dp=1,tp=2,pp=2 --trainer-dtype bf16)
nvidia-smi -L
summary() {  # summary JSON LABEL
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], 'sharded %.3f ms cudaMemcpy %.3f ms ratio %.4f broadcast %.2fx checksums %s/%s mismatches %s' % (j['sharded_seconds']*1e3, j['raw_seconds']*1e3, j['ratio_to_raw'], j['speedup_vs_broadcast'], j.get('checksums_ok'), j.get('checksums_total'), j.get('element_mismatches')))" "$1" "$2"
}
if [ "${TESTS:-0}" = 1 ]; then
  timeout 300 .bundle/bin/test_gpu 2>&1 | grep -E "^\[  (PASSED|FAILED) |FAILED" | head -20
fi
for r in ${ROUNDS:-1 2 3}; do
  for v in old new noboard; do
    bin=$new
    envs=()
    [ $v = old ] && bin=$old
    [ $v = noboard ] && envs=(SHARDSYNC_VERDICT_BOARD=0)
    [ -x "$bin" ] || { echo "skip $v: no $bin"; continue; }
    env "${envs[@]}" timeout 300 "$bin" bench --device cuda "${job[@]}" --warmup 2 --reps 15 \
      --json >"$out/${v}_$r.json" 2>"$out/${v}_$r.log"
    summary "$out/${v}_$r.json" "round $r $v" || tail -5 "$out/${v}_$r.log"
  done
done
if [ "${TRACE:-0}" = 1 ]; then
  mkdir -p "$out/trace"
  SHARDSYNC_TRACE=buffered SHARDSYNC_RANK_LOG_DIR=$out/trace timeout 300 $new bench --device cuda \
    "${job[@]}" --warmup 2 --reps 5 --json >"$out/traced.json" 2>"$out/traced.log"
  summary "$out/traced.json" traced
fi
