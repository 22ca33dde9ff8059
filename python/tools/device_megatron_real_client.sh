#!/usr/bin/env bash
# Device-machine run of python/tools/megatron_real_client.py (docs/megatron.md, "The real client"):
# real Megatron-Core chunks filled by Megatron-Bridge's load path, synced into SGLang tp2 pp2
# device ranks. The device image has torch but neither Megatron nor shardsync's C++ libraries, so
# a bundle made here carries them (BUNDLE, default .bundle-megatron; git-ignored):
#   BUNDLE/lib        libss_*.a of a CUDA build (-DSHARDSYNC_CUDA=ON) and the shared libraries
#                     they need (/work/shared/tools/device-bundle.sh on build/python/shardsync/_C*.so,
#                     minus the _C itself), plus BUNDLE/bin/shardsync (the CLI, for the token check)
#   BUNDLE/cuda       libcudart_static.a (the cudart the layers were built against)
#   BUNDLE/include    dlpack/dlpack.h
#   BUNDLE/src        this checkout's include/, python/src, python/shardsync and python/tools (the
#                     bindings are compiled there against the device's Python)
#   BUNDLE/mlm        Megatron-LM's megatron/{core,training,post_training} (*.py)
#   BUNDLE/mbr        Megatron-Bridge's src/megatron/bridge/{models,utils,peft,training} (*.py)
#   BUNDLE/pydeps     pure-Python packages the device image lacks (omegaconf, antlr4: Debian's
#                     python3-omegaconf / python3-antlr4, unpacked)
# Run there: bash BUNDLE/src/python/tools/device_megatron_real_client.sh [--case dense|moe|all]
set -euo pipefail
B=$(realpath "${BUNDLE:-.bundle-megatron}")
S=$B/src
export LD_LIBRARY_PATH=$B/lib:${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$B/lib/ucx
export PYTHONUNBUFFERED=1
D=build-megatron/python/shardsync
mkdir -p "$D" build-megatron/obj
cp -r "$S/python/shardsync/." "$D/"
inc="$(python3 -m pybind11 --includes) -I$S/include -I$S/python/src -I$B/include"
defs='-DSHARDSYNC_VERSION="0.1.0" -DSS_PY_HAVE_LAYOUT=1 -DSS_PY_HAVE_MODEL=1 -DSS_PY_HAVE_PLAN=1'
defs+=' -DSS_PY_HAVE_STORE=1 -DSS_PY_HAVE_SESSION=1 -DSS_PY_HAVE_CUDA=1'
t0=$(date +%s)
pids=()
for f in "$S"/python/src/*.cc; do
  # shellcheck disable=SC2086
  g++ -O2 -std=c++20 -fPIC $inc $defs -c "$f" -o "build-megatron/obj/$(basename "$f" .cc).o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
ext=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
g++ -shared -o "$D/_C$ext" build-megatron/obj/*.o -Wl,--start-group "$B"/lib/libss_*.a \
  -Wl,--end-group "$B"/lib/*.so.* "$B/cuda/libcudart_static.a" -ldl -lrt -lpthread
echo "bindings built in $(($(date +%s) - t0)) s"
export PYTHONPATH=$B/mlm:$B/mbr:$PWD/build-megatron/python:$B/pydeps
[ -n "${SKIP_RUN:-}" ] && exec python3 -c "import shardsync; print('shardsync', shardsync._C.PARTS)"
python3 -c "import shardsync, torch; print('shardsync', shardsync._C.DEVICE_BINDING, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 "$S/python/tools/megatron_real_client.py" --out "${OUT:-/tmp}" --cli "$B/bin/shardsync" "$@"
