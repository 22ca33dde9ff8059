#!/usr/bin/env bash
# Installs the Debian packages shardsync builds and tests with (C++ libraries, the pybind11 /
# dlpack headers, and what `pip install --no-build-isolation .` needs: setuptools, wheel, venv).
# Idempotent: installs only what is missing. Run as root (or with sudo).
set -euo pipefail
pkgs=(build-essential cmake pkg-config libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
      libcli11-dev libfmt-dev libspdlog-dev libxxhash-dev libssl-dev libucx-dev ucx-utils pybind11-dev
      libdlpack-dev python3-dev python3-numpy python3-pytest python3-torch python3-setuptools
      python3-wheel python3-venv)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "deps: installing ${#missing[@]} Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "deps: ok (${#pkgs[@]} packages present)"
