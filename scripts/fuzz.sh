#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for a bounded time.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET=20]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
command -v clang++ >/dev/null || { echo "fuzz: clang++ not installed; skipping"; exit 0; }
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_C_COMPILER=clang -DSHARDSYNC_FUZZ=ON \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined" \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link,address,undefined" -DSHARDSYNC_CUDA=OFF -DSHARDSYNC_BUILD_TESTS=OFF \
  -DSHARDSYNC_BUILD_BENCH=OFF -DSHARDSYNC_BUILD_PYTHON=OFF >/dev/null
targets=$(cd fuzz && ls *_fuzz.cc 2>/dev/null | sed 's/_fuzz\.cc$//' | sed 's/^/fuzz_/')
[ -n "$targets" ] || { echo "fuzz: no targets"; exit 0; }
cmake --build build-fuzz -j"$(nproc)" --target $targets
for t in $targets; do
  corpus=fuzz/corpus/${t#fuzz_}; mkdir -p build-fuzz/corpus-$t
  echo "fuzz: $t for ${secs}s"
  build-fuzz/$t -max_total_time="$secs" -timeout=5 -rss_limit_mb=2048 build-fuzz/corpus-$t \
    $( [ -d "$corpus" ] && echo "$corpus" ) 2>&1 | tail -2
done
