#!/usr/bin/env bash
# ctest wrapper: drives a real tinkerd through its Tinker HTTP API with the official Tinker Python SDK,
# or with tinker-cookbook's training loops.
# Usage: tests/sdk/run_sdk_test.sh TINKERD_BINARY SDK_VERSION|cookbook-VERSION [PEEK_BYTES]
#   1. gets a venv with tinker==SDK_VERSION, or with tinker-cookbook==VERSION and what it runs on
#      (scripts/tinker-sdk-venv.sh; exit 77 = SKIP when PyPI cannot be reached);
#   2. starts TINKERD_BINARY on free ports (127.0.0.1:0) with the default model written to disk
#      with a tokenizer (make_tiny_model --family=demo --tokenizer, beside the binary's build),
#      a fresh checkpoint root and an API-key file with two tenants;
#   3. runs tests/sdk/tinker_flow.py, or tests/cookbook/cookbook_flow.py, against it. The exit
#      code is the flow's.
# PEEK_BYTES is the server's --http_peek_bytes (default 1 MiB): 1 makes every result go through
# retrieve_future's metadata-only peek.
# The server is stopped on every exit path; its log is printed when the flow fails.
# Environment: TINKERD_SDK_KEEP_TMP=1 keeps the temporary directory (keys, checkpoints, logs);
# TINKERD_SDK_START_TIMEOUT (seconds, default 120); TINKER_FLOW_* are passed to the flow.
set -uo pipefail

if (($# < 2 || $# > 3)); then
  echo "usage: $0 TINKERD_BINARY SDK_VERSION|cookbook-VERSION [PEEK_BYTES]" >&2
  exit 2
fi
binary=$1
version=$2
peek_bytes=${3:-1048576}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
start_timeout=${TINKERD_SDK_START_TIMEOUT:-120}

if [[ ! -x $binary ]]; then
  echo "run_sdk_test: $binary is not an executable tinkerd" >&2
  exit 1
fi

# 1. The SDK's venv (outside the source tree). 77 passes through as SKIP.
venv_out=$(bash "$repo/scripts/tinker-sdk-venv.sh" "$version")
rc=$?
if ((rc == 77)); then
  echo "run_sdk_test: SKIP: no venv for $version (see above)" >&2
  exit 77
elif ((rc != 0)); then
  echo "run_sdk_test: scripts/tinker-sdk-venv.sh $version failed (rc $rc)" >&2
  exit "$rc"
fi
py=${venv_out##*$'\n'}
if [[ ! -x $py ]]; then
  echo "run_sdk_test: scripts/tinker-sdk-venv.sh printed no python path (got '$py')" >&2
  exit 1
fi

# 2. Keys, checkpoint root, server.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tinkerd-sdk-$version.XXXXXX")
log=$tmp/tinkerd.log
server_pid=
flow_rc=1

stop_server() {
  [[ -n $server_pid ]] || return 0
  if kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null
    # Wait for it to exit (polling the process, bounded), then force it.
    local deadline=$((SECONDS + 15))
    while kill -0 "$server_pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    if kill -0 "$server_pid" 2>/dev/null; then
      echo "run_sdk_test: tinkerd did not exit 15 s after SIGTERM; SIGKILL" >&2
      kill -KILL "$server_pid" 2>/dev/null
    fi
  fi
  wait "$server_pid" 2>/dev/null
  server_pid=
}

print_log() {
  echo "----- tinkerd log ($log) -----" >&2
  cat "$log" >&2 2>/dev/null
  echo "----- end of tinkerd log -----" >&2
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  stop_server
  if ((rc != 0 && rc != 77)); then print_log; fi
  if [[ ${TINKERD_SDK_KEEP_TMP:-0} == 1 ]]; then
    echo "run_sdk_test: kept $tmp" >&2
  else
    rm -rf "$tmp"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rand() { od -An -N12 -tx1 /dev/urandom | tr -d ' \n'; }
alice_key="tml-alice-$(rand)"
bob_key="tml-bob-$(rand)"
printf 'alice %s\nbob %s\n' "$alice_key" "$bob_key" >"$tmp/api_keys"
chmod 600 "$tmp/api_keys"
mkdir -p "$tmp/checkpoints"

# The default model and a tokenizer of its vocabulary, so that get_tokenizer() and stop strings
# can be checked (check t).
make_model=$(dirname "$binary")/../tools/make_tiny_model
if ! "$make_model" --out="$tmp/model" --family=demo --tokenizer >"$tmp/make_model.log" 2>&1; then
  echo "run_sdk_test: $make_model failed:" >&2
  cat "$tmp/make_model.log" >&2
  exit 1
fi
# With the newest SDK, a second base model, served as "teacher" beside the default (check x):
# other weights, the same vocabulary, as on-policy distillation's teacher. The other SDK's run
# keeps a server of one base.
teacher_flags=()
teacher_name=
if [[ $version == 0.38.0 ]]; then
  if ! "$make_model" --out="$tmp/teacher" --family=demo --seed=7 >>"$tmp/make_model.log" 2>&1; then
    echo "run_sdk_test: $make_model (teacher) failed:" >&2
    cat "$tmp/make_model.log" >&2
    exit 1
  fi
  teacher_flags=(--base_model=teacher="$tmp/teacher")
  teacher_name=teacher
fi
"$binary" --base_model="$tmp/model" "${teacher_flags[@]}" \
  --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 \
  --checkpoint_root="$tmp/checkpoints" --api_keys_file="$tmp/api_keys" \
  --http_peek_bytes="$peek_bytes" >"$log" 2>&1 &
server_pid=$!

# Wait for the port line: poll the log (and that the server is still alive), bounded.
port=
deadline=$((SECONDS + start_timeout))
while :; do
  port=$(sed -n 's/^tinkerd http listening on port \([0-9][0-9]*\)$/\1/p' "$log" | head -n1)
  [[ -n $port ]] && break
  if ! kill -0 "$server_pid" 2>/dev/null; then
    wait "$server_pid"
    echo "run_sdk_test: tinkerd exited (rc $?) before listening for HTTP" >&2
    exit 1
  fi
  if ((SECONDS >= deadline)); then
    echo "run_sdk_test: no 'tinkerd http listening on port N' line within ${start_timeout} s" >&2
    exit 1
  fi
  sleep 0.1
done
echo "run_sdk_test: tinkerd pid $server_pid, http port $port, tinker SDK $version ($py)"

# 3. The flow. Only our variables reach the SDK: no project, credential command or proxy from the
# caller's environment. The cookbook fetches a pricing file from the web on start-up and would
# reach for the hub without a local tokenizer: its HTTP(S) goes to a closed loopback port, so
# nothing leaves the machine (it logs the failed fetch and trains on), while the server on
# loopback is reached directly (NO_PROXY).
flow=("$here/tinker_flow.py")
extra=()
if [[ $version == cookbook-* ]]; then
  flow=("$repo/tests/cookbook/cookbook_flow.py")
  extra=(TINKERD_COOKBOOK_MODEL="$tmp/model" TINKERD_COOKBOOK_LOGS="$tmp/cookbook"
    HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9
    http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9
    HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled)
fi
env -u TINKER_PROJECT_ID -u TINKER_CREDENTIAL_CMD -u TINKER_TAGS \
  -u CLOUDFLARE_ACCESS_CLIENT_ID -u CLOUDFLARE_ACCESS_CLIENT_SECRET \
  -u HTTP_PROXY -u HTTPS_PROXY -u ALL_PROXY -u http_proxy -u https_proxy -u all_proxy \
  TINKER_BASE_URL="http://127.0.0.1:$port" \
  TINKER_API_KEY="$alice_key" \
  TINKERD_OTHER_API_KEY="$bob_key" \
  TINKERD_CHECKPOINT_ROOT="$tmp/checkpoints" \
  TINKERD_PEEK_BYTES="$peek_bytes" \
  TINKERD_FLOW_TOKENIZER=1 \
  TINKERD_FLOW_TEACHER="$teacher_name" \
  TINKER_TELEMETRY=0 \
  NO_PROXY="127.0.0.1,localhost" no_proxy="127.0.0.1,localhost" \
  HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 PYTHONUNBUFFERED=1 \
  "${extra[@]}" "$py" "${flow[@]}"
flow_rc=$?

if ! kill -0 "$server_pid" 2>/dev/null; then
  echo "run_sdk_test: tinkerd died during the flow" >&2
  ((flow_rc == 0)) && flow_rc=1
fi
exit "$flow_rc"
