#!/usr/bin/env bash
# Step time of 1 rank vs. 2 data-parallel ranks on the same global batch, through the real server:
# tinkerd --nproc=N on the embedded default model, driven by the SFT example (forward_backward +
# optim_step per step). Both configurations get the same total number of threads.
#   bench/dp_step_time.sh [BUILD_DIR]   (default build)
# With BASE_MODEL=DIR (a mixture of experts, e.g. the one fwd_bwd_bench --experts writes): 2 ranks
# holding every expert (--expert_parallel=1) vs. 2 ranks splitting them (--expert_parallel=2).
set -euo pipefail
BUILD=${1:-build}
STEPS=${STEPS:-8}
BATCH=${BATCH:-32}
SEQ_LEN=${SEQ_LEN:-128}
TOTAL_THREADS=${TOTAL_THREADS:-2}

median_tokens_per_s() {  # reads the example's "step N ... X tokens/s" lines, skips step 1 (warm-up)
  awk '/^step/ && $2 > 1 {print $(NF-1)}' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'
}

run() {  # NPROC [TINKERD_FLAGS...]
  local nproc=$1 threads=$(( TOTAL_THREADS / $1 ))
  shift
  local log
  log=$(mktemp)
  "$BUILD/server/tinkerd" --listen=127.0.0.1:0 --nproc="$nproc" --threads="$threads" "$@" \
    >"$log" 2>&1 &
  local server=$!
  local port=""
  for _ in $(seq 1 1200); do
    port=$(sed -n 's/^tinkerd listening on port \([0-9]*\)$/\1/p' "$log")
    [[ -n $port ]] && break
    sleep 0.1
  done
  echo "+ tinkerd --nproc=$nproc --threads=$threads $*; sft_example --steps=$STEPS --batch=$BATCH --seq_len=$SEQ_LEN" >&2
  "$BUILD/client/sft_example" --target=127.0.0.1:"$port" --steps="$STEPS" --batch="$BATCH" \
    --seq_len="$SEQ_LEN" | median_tokens_per_s
  kill -TERM "$server"
  wait "$server"
}

if [[ -n ${BASE_MODEL:-} ]]; then
  whole=$(run 2 --base_model="$BASE_MODEL" --expert_parallel=1)
  split=$(run 2 --base_model="$BASE_MODEL" --expert_parallel=2)
  echo "2 ranks, every expert on each (E = 1): $whole tokens/s (median step, ${BATCH}x${SEQ_LEN})"
  echo "2 ranks, experts split (E = 2):        $split tokens/s"
  awk -v a="$whole" -v b="$split" \
    'BEGIN {printf "E = 2 / E = 1 throughput: %.2fx (step time ratio %.2fx)\n", b/a, a/b}'
  exit 0
fi
one=$(run 1)
two=$(run 2)
echo "1 rank:  $one tokens/s (median step, ${BATCH}x${SEQ_LEN} tokens per step)"
echo "2 ranks: $two tokens/s"
awk -v a="$one" -v b="$two" 'BEGIN {printf "2 ranks / 1 rank throughput: %.2fx (step time ratio %.2fx)\n", b/a, a/b}'
