#!/usr/bin/env bash
# The main job: installs dependencies, builds, starts tinkerd on the embedded default model (a
# small Llama-style model generated deterministically in memory; nothing is downloaded) on a
# loopback port, runs the RL example against it through the Python client (a policy learns to emit
# even token ids: sampled groups, group-relative advantages, trajectories streamed into
# StreamForwardBackward, one optimizer step each), and shuts the server down with SIGTERM.
#   scripts/run-demo.sh [--steps=N ...]   RL (client/python/examples/rl.py); plot in build/rl-reward.png
#   scripts/run-demo.sh --sft [--steps=N] supervised fine-tuning (client/examples/sft_example.cc)
# Extra arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
EXAMPLE=rl
if [[ ${1:-} == --sft ]]; then
  EXAMPLE=sft
  shift
fi
bash scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target tinkerd sft_example tinkerctl python_client

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

status=0
if [[ $EXAMPLE == sft ]]; then
  ./build/client/sft_example --target=127.0.0.1:$PORT "$@" || status=$?
else
  # Debian's python3 has python3-grpcio, python3-protobuf and python3-numpy (install-deps.sh).
  PYTHONPATH=build/client/python /usr/bin/python3 client/python/examples/rl.py \
    --target=127.0.0.1:$PORT --png=build/rl-reward.png "$@" || status=$?
fi

echo "== stopping tinkerd (SIGTERM)"
kill -TERM $SERVER
wait $SERVER
trap - EXIT
tail -n 3 "$LOG"
exit $status
