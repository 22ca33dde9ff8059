#!/usr/bin/env bash
# Bundles what the GPU machine needs from a CUDA build here (build/, configured with nvcc present):
# the CLI and test_gpu with their shared libraries (.bundle), and the layers plus headers the
# device-side Python bindings link (.bundle-devsess, see python/tools/device_gpu_check_cuda.sh).
# Both folders are git-ignored; name them in the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${BUILD:-build}
rm -rf .bundle .bundle-devsess
bash ../shared/tools/device-bundle.sh .bundle "$b/shardsync" "$b/tests/cuda/test_gpu" >/dev/null
bash ../shared/tools/device-bundle.sh .bundle-devsess "$b"/python/shardsync/_C*.so >/dev/null
rm -f .bundle-devsess/lib/_C*.so
cp "$b"/src/*/libss_*.a .bundle-devsess/lib/
mkdir -p .bundle-devsess/cuda .bundle-devsess/include/dlpack
cp /usr/local/cuda/lib64/libcudart_static.a .bundle-devsess/cuda/
cp /usr/include/dlpack/dlpack.h .bundle-devsess/include/dlpack/
du -sh .bundle .bundle-devsess
