#!/usr/bin/env bash
# Installs dependencies, builds tinkerd with its tests, and runs every test suite.
# Usage: scripts/test.sh [extra ctest args, e.g. -L numerics]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
ctest --preset default "$@"
