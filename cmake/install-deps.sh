#!/usr/bin/env bash
# Installs the Debian packages remat's build, tests and examples need: oneDNN (the float GEMM) and
# Open MPI (remat::dist, data parallelism), both optional to the library; python3-torch, the peer of
# the parity test and the benchmarks (with OpenBLAS, so that it does not run the reference BLAS);
# ADOL-C, whose revolve() is the peer of the streamed schedules; clang, its runtime and its OpenMP
# (libomp) for the sanitizer build and the libFuzzer harnesses; pkgconf (pkg-config), which the
# remat.pc packaging test builds with; Doxygen for the API reference (the `docs` target and its
# test); ccache to make rebuilds cheap. Installs only what is missing, so running it again is cheap.
# Run as root (or through sudo).
set -euo pipefail
packages=(g++ cmake make pkgconf ccache doxygen libeigen3-dev libfmt-dev catch2 nlohmann-json3-dev libdnnl-dev libopenmpi-dev openmpi-bin python3 python3-torch python3-matplotlib libopenblas0-openmp
          clang libclang-rt-14-dev libomp-dev libadolc-dev "$@")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
