#!/usr/bin/env bash
# Sampling throughput with each layer's experts spread over ranks, through the real server:
# tinkerd --nproc=2 on a mixture of experts (BASE_MODEL=DIR, e.g. the one fwd_bwd_bench --experts
# writes), with --expert_parallel=1 (rank 0 holds every expert and samples alone) and then 2 (rank 0
# leads each forward, rank 1 runs its half of every layer's experts); each rank THREADS intra-op
# threads. tinkerctl samples NUM_SAMPLES completions of up to MAX_TOKENS tokens of the base, REPS
# times after one warm-up; prints the median generated tokens/s of each and their ratio.
#   BASE_MODEL=DIR bench/ep_sample_time.sh [BUILD_DIR]   (default build)
set -euo pipefail
BUILD=${1:-build}
: "${BASE_MODEL:?set BASE_MODEL to a mixture-of-experts model directory}"
THREADS=${THREADS:-1}
NUM_SAMPLES=${NUM_SAMPLES:-16}
MAX_TOKENS=${MAX_TOKENS:-32}
REPS=${REPS:-3}
PROMPT=${PROMPT:-5,17,2,99,41,8,23,64}

run() {  # EXPERT_PARALLEL
  local log
  log=$(mktemp)
  "$BUILD/server/tinkerd" --listen=127.0.0.1:0 --nproc=2 --threads="$THREADS" \
    --base_model="$BASE_MODEL" --expert_parallel="$1" >"$log" 2>&1 &
  local server=$!
  local port=""
  for _ in $(seq 1 1200); do
    port=$(sed -n 's/^tinkerd listening on port \([0-9]*\)$/\1/p' "$log")
    [[ -n $port ]] && break
    sleep 0.1
  done
  echo "+ tinkerd --nproc=2 --threads=$THREADS --base_model=$BASE_MODEL --expert_parallel=$1;" \
    "tinkerctl sample --num_samples=$NUM_SAMPLES --max_tokens=$MAX_TOKENS --seed=R $PROMPT" >&2
  for rep in $(seq 0 "$REPS"); do
    local start end tokens
    start=$(date +%s.%N)
    tokens=$("$BUILD/client/tinkerctl" --target=127.0.0.1:"$port" sample \
      --num_samples="$NUM_SAMPLES" --max_tokens="$MAX_TOKENS" --seed=$((rep + 1)) "$PROMPT" |
      awk '{n += split($NF, t, ",")} END {print n}')
    end=$(date +%s.%N)
    ((rep == 0)) && continue  # warm-up
    awk -v n="$tokens" -v a="$start" -v b="$end" 'BEGIN {printf "%.1f\n", n / (b - a)}'
  done | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'
  kill -TERM "$server"
  wait "$server"
}

whole=$(run 1)
split=$(run 2)
echo "2 ranks, every expert on each (E = 1), rank 0 sampling alone: $whole tokens/s (median)"
echo "2 ranks, experts split (E = 2), rank 1 serving its experts:   $split tokens/s"
awk -v a="$whole" -v b="$split" 'BEGIN {printf "E = 2 / E = 1 sampling throughput: %.2fx\n", b/a}'
