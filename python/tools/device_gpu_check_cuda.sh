#!/usr/bin/env bash
# Device-machine GPU check of device sessions (docs/python.md, "GPU check"): the bindings built
# with SS_PY_HAVE_CUDA, so a Session bound to CUDA tensors is a device session (prepared cuda_ipc /
# nccl pairs). Layers built here with CUDA and bundled in .bundle-devsess:
#   cmake -S . -B build-devsess -DCMAKE_BUILD_TYPE=Release -DSHARDSYNC_CUDA=ON \
#     -DSHARDSYNC_BUILD_TESTS=OFF -DSHARDSYNC_BUILD_BENCH=OFF && cmake --build build-devsess --target shardsync_python
#   bash /work/shared/tools/device-bundle.sh .bundle-devsess build-devsess/python/shardsync/_C*.so
#   rm .bundle-devsess/lib/_C*.so; cp build-devsess/src/*/libss_*.a .bundle-devsess/lib/
#   cp /usr/local/cuda/lib64/libcudart_static.a .bundle-devsess/cuda/   # the cudart ss_cuda was built against
#   mkdir -p .bundle-devsess/include/dlpack; cp /usr/include/dlpack/dlpack.h .bundle-devsess/include/dlpack/
# Run there (carry .bundle-devsess):
#   bash python/tools/device_gpu_check_cuda.sh --model qwen3-8b --trainer fsdp=1 --rollout dp=1,tp=2,pp=2 \
#     --trainer-dtype bf16 --reps 7       (sessions default to device sessions for CUDA tensors)
set -euo pipefail
cd "$(dirname "$0")/../.."
B=.bundle-devsess
echo "device CUDA dirs: $(ls -d /usr/local/cuda* 2>/dev/null | tr '\n' ' ')"
# The static cudart from the bundle (same major as the nvcc that built ss_cuda); the device's
# libcudart only if the bundle lacks it. NCCL is dlopen-ed by ss_cuda, not linked.
if [ -f "$B/cuda/libcudart_static.a" ]; then
  cudart="$B/cuda/libcudart_static.a"
else
  cudadir=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 2>/dev/null | head -1)
  cudart="-L$cudadir -lcudart -Wl,-rpath,$cudadir"
fi
echo "cudart: $cudart"
export BUNDLE=$B EXTRA_DEFS="-DSS_PY_HAVE_CUDA=1" EXTRA_LIBS="$cudart -ldl -lrt -lpthread"
exec bash python/tools/device_gpu_check.sh "$@"
