#!/usr/bin/env bash
# Quick GPU iteration on the device machine: GPU tests, then the qwen3-8b colocated sync (bf16,
# fused landed check) with kernel GB/s; prints one line per run. Binaries from .bundle-gpu.
# Knobs: DTYPES (default "bf16 f32"), TRAINER (default fsdp=2), GPU_BIN (another binary in
# .bundle-gpu/bin), SKIP_TESTS=1 (bench only), ITERS; extra arguments go to every bench run.
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.bundle-gpu/lib:${LD_LIBRARY_PATH:-}
bin=.bundle-gpu/bin
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 300 $bin/test_gpu >"$out/test_gpu.log" 2>&1
[ "${SKIP_TESTS:-0}" = 1 ] || grep -E "^\[  (PASSED|FAILED)" "$out/test_gpu.log"
[ "${SKIP_TESTS:-0}" = 1 ] || grep -E "Failure|Expected|Which is|actual" "$out/test_gpu.log" | head -10
for dt in ${DTYPES:-bf16 f32}; do
  timeout 200 $bin/${GPU_BIN:-shardsync_gpu} bench --model qwen3-8b --gpus 1 --trainer ${TRAINER:-fsdp=2} \
    --rollout dp=1,tp=2,pp=2 --transport cuda_ipc --trainer-dtype $dt --iters ${ITERS:-5} "$@" \
    >"$out/8b_$dt.json" 2>"$out/8b_$dt.log"
  tail -n 1 "$out/8b_$dt.log"
  /usr/bin/env python3 - "$out/8b_$dt.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print({k: round(v) for k, v in j.items() if k.endswith('gbps') and v})
for r in j['ranks'][:2]:
    print('  rank', r['rank'], 'kernel ms', [round(x * 1e3, 2) for x in r['kernel_seconds']])
t0 = min(p[1] for r in j['ranks'] for p in r.get('phases', []) if p[0] == 't0')
for r in j['ranks']:
    print('  rank', r['rank'], ' '.join('%s %.2f' % (p[0], (p[1] - t0) * 1e3) for p in r.get('phases', [])))
PY
done
