#!/usr/bin/env bash
# ctest wrapper: tinkerd's logprobs against transformers' own models (transformers_reference.py).
# Usage: tests/reference/run_reference_test.sh TINKERD_BINARY
#   1. gets tinker-cookbook's venv (scripts/tinker-sdk-venv.sh cookbook-0.6.1), which pins torch,
#      transformers and the Tinker SDK; exit 77 (SKIP) where it cannot be installed, a failure
#      under CI=true;
#   2. runs the check over every case, then its broken control, which must fail (the script exits
#      0 for a control that failed as it must).
# Nothing leaves the machine: HTTP(S) proxies point at a closed loopback port, the hub is offline,
# and the server on loopback is reached directly.
set -uo pipefail

if (($# != 1)); then
  echo "usage: $0 TINKERD_BINARY" >&2
  exit 2
fi
binary=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

venv_out=$(bash "$repo/scripts/tinker-sdk-venv.sh" cookbook-0.6.1)
rc=$?
if ((rc == 77)); then
  echo "run_reference_test: SKIP: no venv with transformers (see above)" >&2
  exit 77
elif ((rc != 0)); then
  echo "run_reference_test: scripts/tinker-sdk-venv.sh cookbook-0.6.1 failed (rc $rc)" >&2
  exit "$rc"
fi
py=${venv_out##*$'\n'}

run() {
  env -u TINKER_PROJECT_ID -u TINKER_CREDENTIAL_CMD -u TINKER_BASE_URL -u TINKER_API_KEY \
    -u ALL_PROXY -u all_proxy \
    HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 \
    http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 \
    NO_PROXY="127.0.0.1,localhost" no_proxy="127.0.0.1,localhost" \
    HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TINKER_TELEMETRY=0 \
    PYTHONUNBUFFERED=1 "$@" "$py" "$here/transformers_reference.py" "$binary"
}

run || exit 1
echo "run_reference_test: the broken control (a misread dynamic RoPE threshold), which must fail:"
run TINKERD_REFERENCE_CONTROL=1
