#!/usr/bin/env bash
# Installs deps, builds, runs every test: C++ via ctest, then the Python package as a user gets it
# (pip-installed into a venv, from the same build: nothing compiles twice) with its tests run
# against that install from another directory. What CI runs. Builds every target (tests, benches,
# the CUDA code whenever nvcc is present: CI compiles the GPU code it cannot run), in the build/
# dir `scripts/demo.sh` may have started: the layers it built are reused, and CUDA goes back to
# AUTO (the demo turns it off on a machine with no GPU; the layers that link the CUDA code, job
# and the CLI, then compile again). SHARDSYNC_CUDA=OFF|ON overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bash scripts/install-deps.sh
bash scripts/build.sh -DSHARDSYNC_CUDA="${SHARDSYNC_CUDA:-AUTO}"
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 300

venv=$root/build/venv
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
echo "test: pip install into $venv (SHARDSYNC_BUILD_DIR=build)"
SHARDSYNC_BUILD_DIR="$root/build" "$venv/bin/pip" install --quiet --no-build-isolation \
  --force-reinstall --no-deps --no-cache-dir "$root"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # not the source tree: `import shardsync` must find the installed package
installed=$("$venv/bin/python" -c "import shardsync; print(shardsync.__file__)")
case "$installed" in
  "$venv"/*) echo "test: shardsync imported from $installed" ;;
  *) echo "test: shardsync imported from $installed, not from $venv" >&2; exit 1 ;;
esac
"$venv/bin/shardsync" version
SHARDSYNC_SOURCE_DIR="$root" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  "$root/python/tests"
