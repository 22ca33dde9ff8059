#!/usr/bin/env bash
# Device-machine GPU check of the Python package (docs/python.md, "GPU check").
# The device image has no Debian C++ libraries, so the shardsync layers are built here (CPU
# build, static libs) and bundled with their shared libraries:
#   bash /work/shared/tools/device-bundle.sh .bundle-py build/python/shardsync/_C*.so
#   rm .bundle-py/lib/_C*.so; cp build/src/*/libss_*.a .bundle-py/lib/
#   mkdir -p .bundle-py/include/dlpack; cp /usr/include/dlpack/dlpack.h .bundle-py/include/dlpack/
# and this script, run there with .bundle-py carried, compiles the bindings against the device's
# Python (3.12) and pip pybind11, then runs python/tools/gpu_fsdp_sync.py.
# Overrides (device_gpu_check_cuda.sh uses them): BUNDLE (default .bundle-py), EXTRA_DEFS, EXTRA_INCS,
# EXTRA_LIBS, PY_SRC (folder of the binding sources, default python/src).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${BUNDLE:-.bundle-py}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$PWD/$B/lib/ucx
export PYTHONUNBUFFERED=1
D=build-dev/python/shardsync
mkdir -p "$D" build-dev/obj
cp -r python/shardsync/. "$D/"
inc="${PYBIND11_INCLUDES:-$(python3 -m pybind11 --includes)} -Iinclude -Ipython/src -I$B/include ${EXTRA_INCS:-}"
defs='-DSHARDSYNC_VERSION="0.1.0" -DSS_PY_HAVE_LAYOUT=1 -DSS_PY_HAVE_MODEL=1 -DSS_PY_HAVE_PLAN=1 -DSS_PY_HAVE_STORE=1 -DSS_PY_HAVE_SESSION=1'" ${EXTRA_DEFS:-}"
t0=$(date +%s)
pids=()
for f in "${PY_SRC:-python/src}"/*.cc; do
  # shellcheck disable=SC2086
  g++ -O2 -std=c++20 -fPIC $inc $defs -c "$f" -o "build-dev/obj/$(basename "$f" .cc).o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
ext=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
g++ -shared -o "$D/_C$ext" build-dev/obj/*.o -Wl,--start-group $B/lib/libss_*.a -Wl,--end-group \
  $B/lib/*.so.* ${EXTRA_LIBS:-}
echo "bindings built in $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONPATH=build-dev/python python3 -c "import shardsync, torch; print(shardsync._C.PARTS, shardsync._C.transports(), shardsync._C.DEVICE_BINDING, torch.__version__, torch.cuda.device_count())"
[ -n "${SKIP_RUN:-}" ] && exit 0
PYTHONPATH=build-dev/python python3 python/tools/gpu_fsdp_sync.py --out "${OUT:-/tmp}/gpu_fsdp_sync.json" "$@"
