#!/usr/bin/env bash
# The main job: installs dependencies, builds, starts tinkerd on the embedded default model (a
# small Llama-style model generated deterministically in memory; nothing is downloaded) on a
# loopback port, runs the supervised fine-tuning example against it through the C++ client, and
# shuts the server down cleanly with SIGTERM. Extra arguments go to the example (e.g. --steps=60).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target tinkerd sft_example tinkerctl

LOG=$(mktemp -t tinkerd.XXXXXX.log)
./build/server/tinkerd --listen=127.0.0.1:0 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
PORT=""
for _ in $(seq 1 300); do
  PORT=$(sed -n 's/^tinkerd listening on port \([0-9]*\)$/\1/p' "$LOG")
  [[ -n $PORT ]] && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; echo "tinkerd exited early" >&2; exit 1; }
  sleep 0.1
done
[[ -n $PORT ]] || { cat "$LOG"; echo "tinkerd did not start" >&2; exit 1; }
echo "== tinkerd (pid $SERVER) serving the embedded default model on 127.0.0.1:$PORT; log: $LOG"
./build/client/tinkerctl --target=127.0.0.1:$PORT health

./build/client/sft_example --target=127.0.0.1:$PORT "$@"
status=$?

echo "== stopping tinkerd (SIGTERM)"
kill -TERM $SERVER
wait $SERVER
trap - EXIT
tail -n 3 "$LOG"
exit $status
