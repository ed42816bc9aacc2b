#!/usr/bin/env bash
# The main job: installs dependencies, builds, and trains a LoRA adapter on the embedded default
# model (generated deterministically; nothing is downloaded), printing the loss per step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target train_demo
./build/tools/train_demo "$@"
