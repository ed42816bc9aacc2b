#!/usr/bin/env bash
# Builds the GPU checks here, against the LibTorch of the same PyTorch wheel the GPU machine runs,
# and packs them with the shared libraries that machine lacks, so that a device session spends its
# time on the checks instead of on carrying build dependencies and building.
#
# usage: scripts/gpu-bundle.sh [TORCH_VERSION]      (default 2.11.0, the GPU image's PyTorch)
# then, on the GPU machine, with .gpu carried (it is git-ignored; ~10 MB):
#   scripts/gpu-check.sh .gpu/build OUT_DIR .gpu/lib
#
# Steps:
# - downloads the torch wheel from PyPI (no dependencies) and unpacks its LibTorch into
#   build-gpu/libtorch-VERSION; also cuFile, cuSPARSELt and NVSHMEM, three libraries LibTorch
#   links against that this machine's CUDA toolkit lacks: the linker needs them here, the GPU
#   machine's PyTorch has them. The toolkit must provide the rest, cuDNN and NCCL included
#   (/usr/local/cuda-13.0 here does);
# - configures the runner-only CUDA build (`cmake --preset cuda -DTINKERD_WITH_GRPC=OFF`) in
#   build-gpu/build and builds the suites gpu-check.sh runs and fwd_bwd_bench;
# - copies them, stripped, to .gpu/build/{tests,bench}, and to .gpu/lib every shared library they
#   load that is neither LibTorch's, CUDA's nor the C/C++ runtime's (abseil, spdlog, fmt).
# A binary built here may still fail to start there; then build there as gpu-check.sh's header says.
set -euo pipefail
VERSION=${1:-2.11.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$ROOT/build-gpu
LIBTORCH=${GPU_LIBTORCH:-$WORK/libtorch-$VERSION}  # where the wheel's LibTorch is (or goes)
TORCH=$LIBTORCH/torch
LINK_ONLY=$LIBTORCH/link-only
BUILD=${GPU_BUILD:-$WORK/build}
BUNDLE=$ROOT/.gpu
PIP=(python3 -m pip download --quiet --no-deps --only-binary=:all:)

# .complete marks a finished download, so that a rerun after a failed one starts it again.
if [[ ! -f $LIBTORCH/.complete ]]; then
  wheels=$LIBTORCH/wheels
  mkdir -p "$wheels" "$LINK_ONLY"
  "${PIP[@]}" -d "$wheels" "torch==$VERSION"
  found=("$wheels"/torch-"$VERSION"-*.whl)
  unzip -q -o "${found[0]}" 'torch/lib/*' 'torch/include/*' 'torch/share/*' '*.dist-info/METADATA' \
    -d "$LIBTORCH"
  # The versions the wheel pins, where it pins one. cuFile's soname is all the linker reads.
  pins=$( (grep -h '^Requires-Dist: nvidia-\(cusparselt\|nvshmem\)' \
    "$LIBTORCH"/torch-*.dist-info/METADATA || true) | sed 's/^Requires-Dist: //; s/;.*//')
  # shellcheck disable=SC2086
  "${PIP[@]}" -d "$wheels" $pins nvidia-cufile
  for w in "$wheels"/nvidia_*.whl; do
    unzip -q -o "$w" '*.so*' -d "$wheels/unpacked"
  done
  find "$wheels/unpacked" \( -name 'libcufile.so*' -o -name 'libcusparseLt.so*' \
    -o -name 'libnvshmem_host.so*' \) -exec cp -a {} "$LINK_ONLY/" \;
  touch "$LIBTORCH/.complete"
fi
export LD_LIBRARY_PATH="$LINK_ONLY:$TORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

targets=(kernel_tests numerics_tests unit_tests fwd_bwd_bench)
cd "$ROOT"
mkdir -p "$BUILD"
# The library path, not the wheel's root on the prefix path: TorchConfig's find_library calls must
# find the wheel's libraries before a Debian LibTorch, and the root's include/ would put the
# wheel's bundled protobuf headers ahead of the system's for every find_package.
cmake --preset cuda -B "$BUILD" -DTINKERD_WITH_GRPC=OFF "-DCMAKE_PREFIX_PATH=$TORCH/share/cmake" \
  "-DCMAKE_LIBRARY_PATH=$TORCH/lib" \
  >"$BUILD/configure.log"
cmake --build "$BUILD" -j"${JOBS:-2}" --target "${targets[@]}"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/build/tests" "$BUNDLE/build/bench" "$BUNDLE/lib"
for t in "${targets[@]}"; do
  dir=tests
  [[ $t == *_bench ]] && dir=bench
  strip -o "$BUNDLE/build/$dir/$t" "$BUILD/$dir/$t"
  deps=$(ldd "$BUILD/$dir/$t")
  if grep 'not found' <<<"$deps"; then
    echo "$t: the libraries above are missing here" >&2
    exit 1
  fi
  # ldd's "name => path" lines; the runtime, LibTorch and CUDA are on the GPU machine already.
  awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' <<<"$deps" | while read -r name path; do
    case $name in
      libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libutil.so* | libgcc_s.so* | \
        libstdc++.so* | libgomp.so* | ld-linux*) continue ;;
    esac
    case $path in
      "$TORCH"/* | "$LINK_ONLY"/* | /usr/local/cuda* | /usr/local/lib/libcu* | /usr/local/lib/libnv*)
        continue ;;
    esac
    cp -L "$path" "$BUNDLE/lib/$name"
  done
done
echo "bundle: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1), LibTorch $VERSION)"
echo "on the GPU machine (carry .gpu): scripts/gpu-check.sh .gpu/build \$OUT .gpu/lib"
