#!/usr/bin/env bash
# The GPU checks, on a machine with an NVIDIA GPU and a CUDA build of PyTorch 2.x whose LibTorch the
# runner was built against. Either built elsewhere against the same wheel and carried
# (scripts/gpu-bundle.sh; then BUILD_DIR is .gpu/build and LIB_DIR .gpu/lib), or built on that
# machine (a runner-only CUDA build:
#   cmake --preset cuda -DTINKERD_WITH_GRPC=OFF -DCMAKE_PREFIX_PATH=<torch>/share/cmake
# then the targets kernel_tests numerics_tests unit_tests fwd_bwd_bench).
#
# usage: [STAGES="tests bench"] [BENCHES="..."] scripts/gpu-check.sh BUILD_DIR OUT_DIR [LIB_DIR]
#   LIB_DIR: extra shared libraries the build needs that the GPU machine lacks (abseil, spdlog,
#   fmt, GoogleTest from the build machine), put first on LD_LIBRARY_PATH.
# Runs the kernels, numerics and unit suites with TINKERD_TEST_DEVICE=cuda (the CUDA paths against
# the same float64 host references), then the benchmarks recorded in bench/RESULTS.md. Logs and
# one JSON line per benchmark go to OUT_DIR; the summary is printed last.
set -uo pipefail
BUILD=$1
OUT=$2
LIBS=${3:-}
mkdir -p "$OUT"
TORCH_LIB=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export LD_LIBRARY_PATH="${LIBS:+$LIBS:}$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__)' | tee -a "$OUT/gpu.txt"

# LibTorch from a PyTorch wheel exports the parts of libstdc++ it linked statically
# (std::filesystem among them); a process that binds some of those calls to LibTorch's copy and
# others to the system's crashes in std::filesystem::remove_all. Preloading the system libstdc++
# puts one implementation first for every caller (CMakeLists.txt also links it first).
STDCXX=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')

summary=()
suite() {
  local name=$1
  shift
  LD_PRELOAD=$STDCXX TINKERD_TEST_DEVICE=cuda "$BUILD/tests/$name" --gtest_brief=1 "$@" \
    >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.log" | tr '\n' ' ')")
  grep -E '^\[  FAILED  \]|Failure|Expected|actual|Which is' "$OUT/$name.log" | head -40
}
want() { [[ " ${STAGES:-tests bench} " == *" $1 "* ]]; }
if want tests; then
  suite kernel_tests
  suite numerics_tests
  suite unit_tests
fi

bench() {
  local name=$1
  shift
  want bench || return 0
  [[ -z ${BENCHES:-} || " $BENCHES " == *" $name "* ]] || return 0
  LD_PRELOAD=$STDCXX timeout "${BENCH_TIMEOUT:-240}" "$BUILD/bench/fwd_bwd_bench" \
    --device=cuda --num_threads=0 \
    --out_dir="/tmp/bench_$name" "$@" >"$OUT/bench_$name.log" 2>&1
  local rc=$?
  summary+=("bench $name rc=$rc: $(grep '^{' "$OUT/bench_$name.log" | tail -1)")
  grep '^{' "$OUT/bench_$name.log" | tail -1 >>"$OUT/bench.jsonl"
  rm -rf "/tmp/bench_$name"
}
# Memory against tokens at a 131,072-token vocabulary (the bench model), one sequence, bf16 with
# activation checkpointing; then fp32 at 8k for the bf16-vs-fp32 comparison.
for T in ${LENGTHS:-8192 32768}; do
  bench "mem_bf16_$T" --vocab=131072 --num_seqs=1 --min_len=$T --max_len=$T --max_pos=$T \
    --compute_dtype=bfloat16 --activation_checkpointing=1 --micro_batch_tokens=$T \
    --steps=2 --warmup_steps=1 --matmul_n=8192
done
bench mem_fp32_8192 --vocab=131072 --num_seqs=1 --min_len=8192 --max_len=8192 --max_pos=8192 \
  --compute_dtype=float32 --activation_checkpointing=1 --micro_batch_tokens=8192 --steps=2 \
  --warmup_steps=1 --matmul_n=8192
# MFU of full fine-tuning of a dense ~1.1B model (TinyLlama's shape) in bf16, then one more step
# traced (bench/trace.h): where the step's time goes, GPU busy against idle and the kernels by time.
FULL_1B=(--vocab=32000 --hidden=2048 --intermediate=5632 --layers=22 --heads=32 --kv_heads=4
  --head_dim=64 --max_pos=4096 --num_seqs=16 --min_len=1024 --max_len=4096 --compute_dtype=bfloat16
  --full_finetune=1 --micro_batch_tokens=16384 --steps=3 --warmup_steps=1 --matmul_n=8192)
rm -f /tmp/trace_full_1b.json
bench full_1b "${FULL_1B[@]}" --trace=/tmp/trace_full_1b.json
if [[ -f /tmp/trace_full_1b.json ]]; then
  python3 "$(dirname "$0")/../bench/trace_summary.py" /tmp/trace_full_1b.json --top 30 \
    | tee "$OUT/trace_full_1b.txt"
  rm -f /tmp/trace_full_1b.json
fi
# The same row over c10d in a world of one (NCCL for the gradients), with replicas, then with
# sharded optimizer state, then with sharded parameters (each layer gathered as it runs): NCCL's
# reduce-scatter and all-gather run, and the rows' last_loss must agree (at W = 1 the shard is the
# whole model).
for S in none optimizer full; do
  bench "full_1b_c10d_$S" "${FULL_1B[@]}" --c10d=1 --shard=$S
done
# LoRA on the whole 8B shape (Llama 3 8B's: 32 layers, hidden 4096, 32/8 heads, vocabulary
# 128,256), random weights written in bf16 (16 GB), one sequence of 8k, then 32k tokens. Each row
# writes and loads its model, so they run only when named, one to a device call:
# STAGES=bench BENCHES=lora_8b_8192 (then lora_8b_32768).
for T in ${LENGTHS_8B:-8192 32768}; do
  [[ " ${BENCHES:-} " == *" lora_8b_$T "* ]] || continue
  BENCH_TIMEOUT=${BENCH_TIMEOUT_8B:-540} bench "lora_8b_$T" --vocab=128256 --hidden=4096 \
    --intermediate=14336 --layers=32 --heads=32 --kv_heads=8 --head_dim=128 --max_pos=32768 \
    --num_seqs=1 --min_len=$T --max_len=$T --micro_batch_tokens=$T --compute_dtype=bfloat16 \
    --stored_dtype=bfloat16 --activation_checkpointing=1 --lora_rank=32 --steps=2 \
    --warmup_steps=1 --matmul_n=8192
done
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
