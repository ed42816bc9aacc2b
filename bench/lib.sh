# Sourced by the bench/run_*.sh drivers; needs OUT_DIR.

# Echoes the exact command (shell-quoted), runs it with its output also saved to
# $OUT_DIR/<name>.log, and keeps the last JSON line of that log in $OUT_DIR/<name>.json for the table.
run() {
  local name=$1
  shift
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  grep '^{' "$OUT_DIR/$name.log" | tail -n 1 >"$OUT_DIR/$name.json"
}

# The eager baseline runs on the OpenBLAS kernels the runner ran on (runner/util/cpu_environment.h
# may have named them): the runner's JSON says which; a value the caller exported is kept.
same_blas_core() {
  local core
  core=$(sed -n 's/.*"blas_core": *"\([^"]*\)".*/\1/p' "$OUT_DIR/runner.json")
  if [[ -z ${OPENBLAS_CORETYPE:-} && -n $core ]]; then export OPENBLAS_CORETYPE=$core; fi
  echo "# OpenBLAS kernels: ${OPENBLAS_CORETYPE:-as detected}"
}
