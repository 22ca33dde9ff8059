#!/usr/bin/env bash
# Bundles what python/tools/device_megatron_real_client.sh needs on the GPU machine (its header
# lists the layout) from a CUDA build here and checkouts of Megatron-LM and Megatron-Bridge:
#   OUT=.bundle-megatron MEGATRON_LM=/path/Megatron-LM MEGATRON_BRIDGE=/path/Megatron-Bridge \
#     OMEGACONF_DEBS=/path/unpacked-debs bash scripts/megatron_bundle.sh
# (OMEGACONF_DEBS: python3-omegaconf and python3-antlr4 unpacked with dpkg -x; optional: without
# them the client stubs omegaconf, which Bridge's load path imports but never calls.)
set -euo pipefail
cd "$(dirname "$0")/.."
b=${BUILD:-build}
out=${OUT:?OUT=bundle dir}
mlm=${MEGATRON_LM:?MEGATRON_LM=Megatron-LM checkout}
mbr=${MEGATRON_BRIDGE:?MEGATRON_BRIDGE=Megatron-Bridge checkout}
rm -rf "$out"
bash ../shared/tools/device-bundle.sh "$out" "$b/shardsync" \
  "$b"/python/shardsync/_C*.so >/dev/null
rm -f "$out"/lib/_C*.so
cp "$b"/src/*/libss_*.a "$out/lib/"
mkdir -p "$out/cuda" "$out/include/dlpack" "$out/mlm/megatron" "$out/mbr/megatron/bridge" \
  "$out/pydeps" "$out/src/python/tools"
cp /usr/local/cuda/lib64/libcudart_static.a "$out/cuda/"
cp /usr/include/dlpack/dlpack.h "$out/include/dlpack/"
cp -r include "$out/src/"
cp -r python/src python/shardsync "$out/src/python/"
cp python/tools/megatron_real_client.py python/tools/device_megatron_real_client.sh \
  "$out/src/python/tools/"
# Only the Python sources: Megatron-LM's core, training (Bridge imports megatron.training.models)
# and post_training; Bridge's packages on its load path.
(cd "$mlm/megatron" && find core training post_training -name '*.py' | tar -cf - -T -) |
  tar -xf - -C "$out/mlm/megatron"
(cd "$mbr/src/megatron/bridge" && find ./*.py models utils peft training -name '*.py' |
  tar -cf - -T -) | tar -xf - -C "$out/mbr/megatron/bridge"
if [ -n "${OMEGACONF_DEBS:-}" ]; then
  cp -r "$OMEGACONF_DEBS"/usr/lib/python3/dist-packages/{omegaconf,antlr4} "$out/pydeps/"
fi
find "$out" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$out"
