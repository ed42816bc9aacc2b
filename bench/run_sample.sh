#!/usr/bin/env bash
# Runs the sampling comparison: the runner's engine (sample_bench, already built) and the PyTorch
# eager KV-cache loop (torch_eager_decode.py) on the same model, prompts and thread count, one
# after the other; then prints the ratios, ready to paste into bench/RESULTS.md. Builds nothing.
#
# usage: bench/run_sample.sh [BUILD_DIR]   (default build)
#   THREADS=2 BATCHES=1,8,64 MAX_TOKENS=64 REPS=3 ADAPTERS=8 OUT_DIR=/tmp/tinkerd_sample
#   PYTHON=/usr/bin/python3 (Debian's, which has torch)
set -euo pipefail

BUILD_DIR=${1:-build}
THREADS=${THREADS:-2}
BATCHES=${BATCHES:-1,8,64}
MAX_TOKENS=${MAX_TOKENS:-64}
REPS=${REPS:-3}
ADAPTERS=${ADAPTERS:-8}
OUT_DIR=${OUT_DIR:-/tmp/tinkerd_sample}
PYTHON=${PYTHON:-/usr/bin/python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BENCH=$BUILD_DIR/bench/sample_bench
if [[ ! -x $BENCH ]]; then
  echo "run_sample.sh: $BENCH not found; build the sample_bench target first" >&2
  exit 1
fi
mkdir -p "$OUT_DIR"

# shellcheck source=lib.sh
source "$HERE/lib.sh"

run runner "$BENCH" --out_dir="$OUT_DIR" --num_threads="$THREADS" --batches="$BATCHES" \
  --max_tokens="$MAX_TOKENS" --reps="$REPS" --adapters="$ADAPTERS"
same_blas_core
run eager "$PYTHON" "$HERE/torch_eager_decode.py" --out_dir="$OUT_DIR" --threads="$THREADS" \
  --batches="$BATCHES" --max_tokens="$MAX_TOKENS" --reps="$REPS"

"$PYTHON" - "$OUT_DIR" <<'PY'
import json, os, platform, sys
out = sys.argv[1]
r = json.load(open(os.path.join(out, "runner.json")))
e = json.load(open(os.path.join(out, "eager.json")))
cpu = "unknown CPU"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
print()
print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, {platform.platform()}; {r['threads']} threads")
print()
print("| decode batch | tinkerd tokens/s | eager tokens/s | tinkerd / eager "
      "| steady: tinkerd | steady: eager | steady: tinkerd / eager | greedy tokens equal |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for b, t in sorted(r["decode_tokens_per_s"].items(), key=lambda kv: int(kv[0])):
    x = e["decode_tokens_per_s"][b]
    st, sx = r["steady_decode_tokens_per_s"][b], e["steady_decode_tokens_per_s"][b]
    same = sum(a == c for a, c in zip(r["greedy_tokens"][b], e["greedy_tokens"][b]))
    print(f"| {b} | {t:.1f} | {x:.1f} | {t / x:.2f}x | {st:.1f} | {sx:.1f} | {st / sx:.2f}x "
          f"| {same}/{len(r['greedy_tokens'][b])} |")
print()
print(f"time to first token: tinkerd {r['ttft_s']:.3f} s, eager {e['ttft_s']:.3f} s "
      f"(tinkerd / eager time {r['ttft_s'] / e['ttft_s']:.2f})")
a = r.get("adapters")
if a:
    print(f"across {a['count']} LoRA adapters (one sample each): one forward per step "
          f"{a['mixed_tokens_per_s']:.1f} tokens/s, one per adapter {a['apart_tokens_per_s']:.1f} "
          f"({a['mixed_tokens_per_s'] / a['apart_tokens_per_s']:.2f}x); greedy tokens equal "
          f"{a['greedy_equal']}/{a['count']} (unlike the base model's: {a['unlike_base']}/{a['count']})")
s = r["beside"]
def of(x, alone):  # alone is 0 where BATCHES left out the beside batch
    return f"{x / alone:.2f} of alone" if alone > 0 else "alone not measured"
print(f"beside training (batch {s['batch']}): decode {s['decode_tokens_per_s']:.1f} tokens/s "
      f"({of(s['decode_tokens_per_s'], s['decode_alone_tokens_per_s'])}), training "
      f"{s['train_tokens_per_s']:.1f} tokens/s ({of(s['train_tokens_per_s'], s['train_alone_tokens_per_s'])})")
PY
