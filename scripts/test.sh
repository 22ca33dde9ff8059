#!/usr/bin/env bash
# Installs deps, builds, runs every test: C++ via ctest, then the Python package as a user gets it
# (pip-installed into a venv, from the same build: nothing compiles twice) with its tests run
# against that install from another directory. What CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bash scripts/install-deps.sh
bash scripts/build.sh
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
