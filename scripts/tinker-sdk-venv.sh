#!/usr/bin/env bash
# Creates (or reuses) a Python virtual environment with the official Tinker SDK at an exact version,
# for the SDK compatibility tests (tests/sdk), or with tinker-cookbook at an exact version and the
# pinned packages it runs on (tests/cookbook/requirements.txt), for the cookbook's tests. The venv
# lives OUTSIDE the source tree:
#   ${TINKERD_SDK_VENVS:-$HOME/.cache/tinkerd/sdk}/tinker-VERSION  or  .../cookbook-VERSION
# Usage: scripts/tinker-sdk-venv.sh VERSION           (e.g. 0.25.0)
#        scripts/tinker-sdk-venv.sh cookbook-VERSION  (e.g. cookbook-0.6.1; about 7.6 GB, a cold
#                                                      install took 6.5 minutes here)
# The last line of stdout is the venv's python path. Progress goes to stderr.
# Exit codes: 0 ok; 77 the SDK cannot be installed because PyPI (or the configured index) is not
# reachable, or no usable python/venv exists (ctest reports 77 as SKIP); 2 usage; 1 other errors.
# Where CI=true (as .ci/run is run), what would be a skip is an error (1): CI must not pass
# without having run the SDK against the server.
# Environment: TINKERD_SDK_PYTHON (interpreter to build the venv from; default python3, needs >= 3.11
# and the venv module: on Debian 12 `apt-get install python3-venv`), TINKERD_SDK_VENVS (cache root),
# PIP_INDEX_URL and the other PIP_* variables are honoured by pip.
set -euo pipefail

if (($# != 1)) || [[ ! $1 =~ ^(cookbook-)?[0-9]+(\.[0-9]+)*([a-z0-9.+-]*)$ ]]; then
  echo "usage: $0 VERSION | cookbook-VERSION   (e.g. 0.25.0, cookbook-0.6.1)" >&2
  exit 2
fi
root=${TINKERD_SDK_VENVS:-$HOME/.cache/tinkerd/sdk}
if [[ $1 == cookbook-* ]]; then
  version=${1#cookbook-}
  package=tinker-cookbook
  module=tinker_cookbook
  venv=$root/cookbook-$version
  requirements=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/cookbook/requirements.txt
else
  version=$1
  package=tinker
  module=tinker
  venv=$root/tinker-$version
  requirements=
fi
py=$venv/bin/python
base_python=${TINKERD_SDK_PYTHON:-python3}

log() { echo "[tinker-sdk-venv] $*" >&2; }
skip() {
  if [[ ${CI:-} == true ]]; then
    echo "tinker-sdk-venv: FAIL (CI=true, where the SDK tests may not be skipped): $*" >&2
    exit 1
  fi
  echo "tinker-sdk-venv: SKIP: $*" >&2
  exit 77
}

# The venv is usable when it imports the package at exactly the wanted version, and holds exactly
# the pinned requirements it was built from.
usable() {
  [[ -x $py && -f $venv/.tinkerd-complete ]] || return 1
  if [[ -n $requirements ]]; then
    cmp -s "$requirements" "$venv/.tinkerd-requirements" || return 1
  fi
  local got
  got=$("$py" -c "import importlib.metadata as m, $module; print(m.version('$package'))" 2>/dev/null) || return 1
  [[ $got == "$version" ]]
}

if usable; then
  log "reusing $venv"
  echo "$py"
  exit 0
fi

command -v "$base_python" >/dev/null 2>&1 || skip "no $base_python interpreter to build the venv from"
"$base_python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' ||
  skip "$base_python is older than 3.11 (the SDK requires >= 3.11)"
"$base_python" -c 'import venv, ensurepip' 2>/dev/null ||
  skip "$base_python lacks the venv/ensurepip modules (Debian: apt-get install python3-venv)"

mkdir -p "$root"
# One installer at a time per version (ctest may run the wrapper for several tests in parallel).
exec 9>"$venv.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi
if usable; then
  log "reusing $venv (built by a concurrent run)"
  echo "$py"
  exit 0
fi

# Build in place; the stamp file written last marks a complete venv, so an interrupted install is
# detected (no stamp) and rebuilt from scratch by the next run.
rm -rf "$venv"
log "creating $venv for $package==$version with $("$base_python" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
"$base_python" -m venv "$venv" >&2 || skip "'$base_python -m venv' failed (Debian: apt-get install python3-venv)"

piplog=$(mktemp "${TMPDIR:-/tmp}/tinker-sdk-pip.XXXXXX")
trap 'rm -f "$piplog"' EXIT
start=$SECONDS
# The cookbook's wheels are gigabytes: they are not kept a second time in pip's cache.
cache=()
if [[ -n $requirements ]]; then cache=(--no-cache-dir); fi
pip_install() {
  "$py" -m pip install --disable-pip-version-check --no-input --progress-bar off "${cache[@]}" \
    --timeout 30 --retries 2 "$@" >>"$piplog" 2>&1
}
installed=0
if [[ -n $requirements ]]; then
  # The pinned packages, then the cookbook alone (its tml-renderers pin cannot be met; see the file).
  pip_install -r "$requirements" && pip_install --no-deps "$package==$version" && installed=1
else
  pip_install "$package==$version" && installed=1
fi
if ((!installed)); then
  # "Cannot reach the index" is a skip; "reached it, but the install failed" is an error. A
  # transient retry warning stays in the log of a long install, so a failure of the install
  # itself (the disk, the resolver's conflict, a refused file) is an error whatever else the log
  # holds. (With the index unreachable pip also finds "no version": that stays a skip.)
  neterr='NewConnectionError|Failed to establish a new connection|Name or service not known|Temporary failure in name resolution|Network is unreachable|ConnectTimeout|Read timed out|ProxyError|Connection refused|No route to host|Max retries exceeded'
  hard='No space left on device|ResolutionImpossible|HTTP error 40[34]'
  if ! grep -qiE "$hard" "$piplog" && grep -qiE "$neterr" "$piplog"; then
    rm -rf "$venv"
    skip "pip cannot reach the package index to install $package==$version: $(grep -m1 -oiE "$neterr" "$piplog" | head -n1)"
  fi
  cat "$piplog" >&2
  echo "tinker-sdk-venv: pip install $package==$version failed (see above)" >&2
  exit 1
fi
log "installed $package==$version in $((SECONDS - start)) s"
# What was resolved, for reproducing failures.
"$py" -m pip freeze --disable-pip-version-check >"$venv/requirements.lock.txt" 2>/dev/null || true
if [[ -n $requirements ]]; then cp "$requirements" "$venv/.tinkerd-requirements"; fi
touch "$venv/.tinkerd-complete"

usable || { echo "tinker-sdk-venv: $venv does not import $package==$version after install" >&2; exit 1; }
echo "$py"
