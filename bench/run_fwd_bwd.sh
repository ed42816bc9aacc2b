#!/usr/bin/env bash
# Runs the forward_backward comparison: the runner (fwd_bwd_bench, already built) and PyTorch eager
# (torch_eager.py) padded and packed, on the same model, batch and thread count; then prints a
# table with the ratios and MFU, ready to paste into bench/RESULTS.md. Builds nothing.
#
# usage: bench/run_fwd_bwd.sh [BUILD_DIR] [-- extra fwd_bwd_bench flags]
#   BUILD_DIR defaults to build (relative to the current directory).
#   Flags after -- go to fwd_bwd_bench only (model sizes, --num_seqs, --seed, ...); the eager side
#   reads the model and batch it writes, so they stay in step. What both sides need is set here:
#     THREADS=2  STEPS=3  WARMUP=1  MICRO_BATCH_TOKENS=4096  LORA_RANK=32
#     OUT_DIR=/tmp/tinkerd_fwd_bwd  PYTHON=/usr/bin/python3 (Debian's, which has torch)
# Default sizes take about ten minutes on 2 cores.
set -euo pipefail

BUILD_DIR=build
if [[ $# -gt 0 && $1 != -- ]]; then
  BUILD_DIR=$1
  shift
fi
if [[ $# -gt 0 && $1 == -- ]]; then shift; fi
EXTRA=("$@")

THREADS=${THREADS:-2}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-1}
MICRO_BATCH_TOKENS=${MICRO_BATCH_TOKENS:-4096}
LORA_RANK=${LORA_RANK:-32}
OUT_DIR=${OUT_DIR:-/tmp/tinkerd_fwd_bwd}
PYTHON=${PYTHON:-/usr/bin/python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BENCH=$BUILD_DIR/bench/fwd_bwd_bench

if [[ ! -x $BENCH ]]; then
  echo "run_fwd_bwd.sh: $BENCH not found; build the fwd_bwd_bench target first" >&2
  exit 1
fi
mkdir -p "$OUT_DIR"

# shellcheck source=lib.sh
source "$HERE/lib.sh"

CMDLINE=$(printf ' %q' "$BUILD_DIR")
if ((${#EXTRA[@]})); then CMDLINE+=" --$(printf ' %q' "${EXTRA[@]}")"; fi
echo "# bench/run_fwd_bwd.sh$CMDLINE"
echo "# THREADS=$THREADS STEPS=$STEPS WARMUP=$WARMUP MICRO_BATCH_TOKENS=$MICRO_BATCH_TOKENS" \
  "LORA_RANK=$LORA_RANK OUT_DIR=$OUT_DIR"

# One at a time, never overlapping: each side gets the whole machine.
run runner "$BENCH" --out_dir="$OUT_DIR" --num_threads="$THREADS" --steps="$STEPS" \
  --warmup_steps="$WARMUP" --micro_batch_tokens="$MICRO_BATCH_TOKENS" --lora_rank="$LORA_RANK" \
  ${EXTRA[@]+"${EXTRA[@]}"}
same_blas_core
for mode in padded packed; do
  run "eager_$mode" "$PYTHON" "$HERE/torch_eager.py" --model_dir="$OUT_DIR/model" \
    --batch="$OUT_DIR/batch.bin" --mode="$mode" --threads="$THREADS" --steps="$STEPS" \
    --warmup_steps="$WARMUP" --micro_batch_tokens="$MICRO_BATCH_TOKENS" --lora_rank="$LORA_RANK"
done

"$PYTHON" - "$OUT_DIR" <<'EOF'
import json, os, platform, subprocess, sys
out = sys.argv[1]
r = {k: json.load(open(os.path.join(out, k + ".json"))) for k in ("runner", "eager_padded", "eager_packed")}
cpu = "unknown CPU"
try:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
except OSError:
    pass
x = r["runner"]
print()
print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, {platform.platform()}; {x['threads']} threads")
print(f"model: {x['params'] / 1e6:.1f}M params ({x['matmul_params'] / 1e6:.1f}M in matmuls, "
      f"LoRA {x['lora_params'] / 1e6:.2f}M); batch {x['sequences']} sequences, {x['tokens_per_step']} "
      f"tokens/step; {x['flops_per_step'] / 1e9:.0f} model GFLOP/step "
      f"({x['attn_flops_per_step'] / 1e9:.0f} attention)")
print()
print("| run | tokens/s | step s | model GFLOP/s | matmul GFLOP/s | MFU | first loss |")
print("|---|---:|---:|---:|---:|---:|---:|")
for k, label in (("runner", "runner"), ("eager_padded", "eager padded"), ("eager_packed", "eager packed")):
    v = r[k]
    print(f"| {label} | {v['tokens_per_s']:.1f} | {v['step_s']:.3f} | {v['model_gflops_per_s']:.1f} "
          f"| {v['matmul_gflops']:.1f} | {100 * v['mfu']:.1f}% | {v['first_loss']:.6f} |")
print()
for k, label in (("eager_padded", "eager padded"), ("eager_packed", "eager packed")):
    print(f"runner / {label}: {x['tokens_per_s'] / r[k]['tokens_per_s']:.2f}x tokens/s")
print(f"runner MFU: {100 * x['mfu']:.1f}% (4·N·T frozen base + 6·N_lora·T + 12·layers·d·ΣL², "
      "see bench/README.md)")
# Step 0 is the base model on both sides (LoRA B = 0), so the losses must agree to float32 noise.
worst = max(abs(x["first_loss"] - r[k]["first_loss"]) / abs(x["first_loss"])
            for k in ("eager_padded", "eager_packed"))
print(f"first-step loss check: max relative difference {worst:.1e} "
      f"{'ok' if worst < 1e-4 else '-- MISMATCH: not the same model or data?'}")
EOF
