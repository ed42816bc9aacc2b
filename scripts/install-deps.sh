#!/usr/bin/env bash
# Installs every build and runtime dependency of tinkerd from Debian 12's archive.
# Idempotent: a second run installs nothing and exits quickly.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build ccache pkg-config git
  clang libclang-rt-14-dev
  libtorch-dev libgloo-dev
  libopenblas0-openmp libopenblas-dev
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libcpp-httplib-dev libboost1.81-dev
  libsentencepiece-dev
  libgtest-dev libgmock-dev
  python3-torch python3-numpy python3-yaml python3-venv openssl curl procps
  python3-grpcio python3-protobuf python3-pytest
)

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "[install-deps] installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "[install-deps] all ${#PKGS[@]} packages already installed"
fi

# OpenBLAS (OpenMP build) must be the selected BLAS: Debian's reference BLAS is ~30x slower and
# LibTorch's CPU matmuls go through whichever libblas.so.3 the alternatives system points at.
arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
for lib in libblas.so.3 liblapack.so.3; do
  target=/usr/lib/$arch/openblas-openmp/$lib
  if [[ -e $target ]]; then
    current=$(readlink -f /etc/alternatives/$lib-$arch 2>/dev/null || true)
    if [[ "$current" != "$target" ]]; then
      $SUDO update-alternatives --set "$lib-$arch" "$target"
    fi
  fi
done
echo "[install-deps] BLAS: $(readlink -f /etc/alternatives/libblas.so.3-$arch 2>/dev/null || echo unknown)"
