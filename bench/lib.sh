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
