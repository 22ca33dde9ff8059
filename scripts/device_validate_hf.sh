#!/usr/bin/env bash
# Device-machine check: shardsync's CPU reference engine vs Hugging Face transformers (fp32).
# The shardsync binary is built on the dev machine with CUDA off and bundled with its libraries:
#   /work/shared/tools/device-bundle.sh .bundle-ref build-ref/shardsync
# then run here with .bundle-ref carried:
#   export LD_LIBRARY_PATH=$PWD/.bundle-ref/lib:$LD_LIBRARY_PATH; bash scripts/device_validate_hf.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${SHARDSYNC_BIN:-$PWD/.bundle-ref/bin/shardsync}
[ -x "$bin" ] || { echo "device_validate_hf: no shardsync binary at $bin" >&2; exit 2; }
export LD_LIBRARY_PATH=$PWD/.bundle-ref/lib:${LD_LIBRARY_PATH:-}
"$bin" version
py=$(command -v python3 || command -v python)
out=${OUT:-/tmp}
set +e
"$py" scripts/validate_hf.py --bin "$bin" --out "$out/validate_hf.json" "$@"
rc=$?
# Speed on a real size (synthetic weights, 16 cores): load + prefill + 8 tokens of Qwen2.5-0.5B.
"$bin" generate --model qwen2.5-0.5b --seed 1 --max-new-tokens 8 | tail -1 || true
exit $rc
