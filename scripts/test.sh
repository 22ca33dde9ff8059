#!/usr/bin/env bash
# Installs deps, builds, runs every test (C++ via ctest, Python via pytest). What CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 300
if [ -d python/tests ] && [ -f build/python/shardsync/__init__.py ]; then
  PYTHONPATH=build/python /usr/bin/python3 -m pytest -q python/tests
fi
