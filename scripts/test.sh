#!/usr/bin/env bash
# Installs dependencies, builds tinkerd with its tests, and runs every test suite:
#   1. the default build (g++): every label (unit, kernels, numerics, e2e, dist);
#   2. an AddressSanitizer + UndefinedBehaviorSanitizer build (preset asan): unit, kernels and e2e;
#   3. the libFuzzer targets (preset fuzz, clang): each fuzzer for TINKERD_FUZZ_SECONDS (default 40)
#      from the checked-in seed corpus.
# Usage: scripts/test.sh [ctest args, e.g. -L numerics]. With arguments, only stage 1 runs, with
# those arguments passed to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

stage() { echo; echo "== [test.sh] $* (at ${SECONDS} s)"; }

# The three builds take about 10.2 GB (5.3 default, 4.7 ASan, 0.2 fuzz; `du -sh build*` after a
# full run), and a first run installs the cookbook's venv (7.6 GB) under ~/.cache; a full disk
# otherwise shows up as a compiler's "cannot write PCH file" half-way in.
free_kb=$(df -Pk . | awk 'NR == 2 { print $4 }')
if ((free_kb < 12 * 1024 * 1024)); then
  echo "[test.sh] warning: $((free_kb / 1024)) MB free here; a full run writes ~10 GB" >&2
fi

stage "1/3 default build: all suites"
cmake --preset default >/dev/null
cmake --build --preset default
ctest --preset default "$@"
if (($#)); then exit 0; fi

stage "2/3 ASan + UBSan build: unit, kernels and e2e suites"
cmake --preset asan >/dev/null
cmake --build --preset asan
ctest --preset asan

stage "3/3 fuzzers (${TINKERD_FUZZ_SECONDS:-40} s each)"
cmake --preset fuzz -DTINKERD_FUZZ_SECONDS="${TINKERD_FUZZ_SECONDS:-40}" >/dev/null
cmake --build --preset fuzz
ctest --preset fuzz
echo "== [test.sh] all stages passed in ${SECONDS} s"
