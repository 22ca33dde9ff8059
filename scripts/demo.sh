#!/usr/bin/env bash
# Installs deps, builds, and runs the main job on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh >/dev/null
bash scripts/build.sh >/dev/null
exec build/shardsync demo "$@"
