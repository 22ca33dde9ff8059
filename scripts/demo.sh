#!/usr/bin/env bash
# Installs deps, builds what the demo runs (the `shardsync` CLI, nothing else), and runs the main
# job on the embedded default. Says what it is doing at each step (on a fresh machine the install
# and the build take minutes): one line per step on stderr, the build's percentage as it goes,
# its full log in build/demo-build.log. The build dir is the one `scripts/test.sh` and the
# README's `SHARDSYNC_BUILD_DIR=build pip install` reuse: neither compiles these files again.
#
# CUDA: built only when asked (SHARDSYNC_CUDA=ON|OFF|AUTO) or when this machine has a GPU
# (nvidia-smi lists one, or /dev/nvidia0 exists); the demo runs on the CPU either way.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "demo: $*" >&2; }
t0=$SECONDS

say "[1/4] Debian packages (scripts/install-deps.sh)"
bash scripts/install-deps.sh >&2

cuda=${SHARDSYNC_CUDA:-}
if [ -n "$cuda" ]; then
  why="SHARDSYNC_CUDA=$cuda"
elif { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; } ||
     [ -e /dev/nvidia0 ]; then
  cuda=AUTO why="a GPU is present"
else
  cuda=OFF why="no GPU found (SHARDSYNC_CUDA=ON bash scripts/demo.sh builds the CUDA code)"
fi
say "[2/4] configure (cmake, Release; CUDA $cuda: $why)"
mkdir -p build
if ! cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSHARDSYNC_CUDA="$cuda" \
    >build/demo-configure.log 2>&1; then
  tail -30 build/demo-configure.log >&2
  say "configure failed (build/demo-configure.log)"
  exit 1
fi

say "[3/4] build the shardsync CLI on $(nproc) cores (first build: minutes; log: build/demo-build.log)"
# cmake's "[ 42%]" lines become one updating line on a terminal, one line per 10% elsewhere.
set +e
cmake --build build -j"$(nproc)" --target shardsync_cli 2>&1 | tee build/demo-build.log | {
  last=-10
  while IFS= read -r line; do
    [[ $line =~ ^\[\ *([0-9]+)%\] ]] || continue
    pct=${BASH_REMATCH[1]}
    if [ -t 2 ]; then
      printf '\rdemo: build %3d%%' "$pct" >&2
    elif [ "$pct" -ge $((last + 10)) ]; then
      say "build ${pct}%"
      last=$pct
    fi
  done
  [ -t 2 ] && printf '\n' >&2
  true
}
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  grep -E "error|Error" build/demo-build.log | head -20 >&2
  say "build failed (build/demo-build.log)"
  exit "$rc"
fi
say "built in $((SECONDS - t0)) s"

say "[4/4] shardsync demo $*"
exec build/shardsync demo "$@"
