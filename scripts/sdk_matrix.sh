#!/usr/bin/env bash
# Install the Tinker SDK versions PlexRL is tested against, and the tinker-cookbook, side
# by side under .plexrl/sdk/ without touching .venv:
#
#   scripts/sdk_matrix.sh          then  .venv/bin/python -m pytest tests/test_sdk_versions.py
#   scripts/sdk_matrix.sh --all    also every other minor 0.16-0.38 (bench/sdk_minors.py)
#
# Each lands in its own folder (.plexrl/sdk/tinker-0.16.1, ...) with --no-deps: a test puts
# that folder first on PYTHONPATH and runs .venv's Python, whose packages (the lock's, which
# include tinker 0.38.0's dependencies) cover every version listed here. Pinned and
# idempotent: a folder whose stamp names its version is kept. PLEXRL_SDK_DIR moves them.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=sdk-matrix
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

SDK_DIR=${PLEXRL_SDK_DIR:-$ROOT/.plexrl/sdk}
# The oldest SDK served, two middle minors, the newest. Keep in step with docs/sdk.md
# and tests/test_sdk_versions.py.
TINKER_VERSIONS=(0.16.1 0.22.7 0.30.4 0.38.0)
# Every minor from 0.16 to 0.38 on PyPI, the latest patch of each (PyPI had no 0.17 and no
# 0.37 on 2026-11-30), for the sweep outside CI: scripts/sdk_matrix.sh --all, then
# bench/sdk_minors.py. Keep in step with bench/sdk_minors.py and docs/sdk.md.
TINKER_ALL=(
  0.16.1 0.18.2 0.19.0 0.20.0 0.21.0 0.22.7 0.23.4 0.24.1 0.25.0 0.26.2 0.27.2
  0.28.1 0.29.1 0.30.4 0.31.0 0.32.0 0.33.1 0.34.0 0.35.0 0.36.0 0.38.0
)
# What a version imports that the lock lacks goes in beside it. 0.21.0 alone imports grpc
# (for a gRPC transport a server may advertise; PlexRL does not, so it is never used).
declare -A TINKER_EXTRA=([0.21.0]="grpcio==1.85.3")
# The cookbook pins tml-renderers>=0.4.1, which PyPI does not have (0.2.1 at most), so it
# goes in with --no-deps beside its other dependencies that .venv lacks: the set
# `uv pip install --dry-run --python .venv/bin/python datasets chz blobfile termcolor
# tiktoken cloudpickle aiohttp pyrage pylatexenc math-verify` names against the lock (the
# last two are its math-rl extra, which rl_loop and math_rl import; docs/sdk.md).
COOKBOOK_VERSION=0.6.1
COOKBOOK_EXTRA=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 antlr4-python3-runtime==4.13.2
  attrs==26.1.0 blobfile==3.3.0 chz==0.4.0 cloudpickle==3.1.3 datasets==5.2.0 dill==0.4.1
  frozenlist==1.8.0 latex2sympy2-extended==1.11.0 lxml==6.1.3 math-verify==0.9.0
  multidict==7.2.1 multiprocess==0.70.19 pandas==3.1.1 propcache==0.5.4 pyarrow==26.0.1
  pycryptodomex==3.24.2 pylatexenc==2.11 pyrage==1.4.0 termcolor==3.3.0 tiktoken==0.14.0
  xxhash==4.1.0 yarl==1.25.1
)

# install NAME SPEC... — SPECs into $SDK_DIR/NAME, once.
install() {
  local name=$1 dir=$SDK_DIR/$1 stamp
  shift
  stamp=$(printf '%s\n' "$@")
  if [[ -f $dir/.plexrl-stamp && $(<"$dir/.plexrl-stamp") == "$stamp" ]]; then
    log "$name is installed"
    return 0
  fi
  log "installing $* into ${dir#"$ROOT"/}"
  rm -rf "$dir"
  local -a uv=("$ROOT/.venv/bin/uv" pip install --python "$ROOT/.venv/bin/python" --no-deps)
  [[ ${CI:-} == true ]] && uv+=(--no-progress)
  "${uv[@]}" --target "$dir" "$@" || die "installing $* failed; see the output above"
  compile_bytecode "$ROOT/.venv/bin/python" "$dir"
  echo "$stamp" >"$dir/.plexrl-stamp"
}

main() {
  local -a versions=("${TINKER_VERSIONS[@]}")
  case ${1:-} in
    "") ;;
    --all) versions=("${TINKER_ALL[@]}") ;;
    *) die "usage: scripts/sdk_matrix.sh [--all]  (--all: every minor 0.16-0.38, not only CI's)" ;;
  esac
  # uv comes with .venv (scripts/bootstrap.sh pins it).
  [[ -x $ROOT/.venv/bin/uv ]] || "$ROOT/scripts/bootstrap.sh"
  mkdir -p "$SDK_DIR"
  for version in "${versions[@]}"; do
    # shellcheck disable=SC2086  # the extras are a word list
    install "tinker-$version" "tinker==$version" ${TINKER_EXTRA[$version]:-}
  done
  install "tinker-cookbook-$COOKBOOK_VERSION" "tinker-cookbook==$COOKBOOK_VERSION" \
    "${COOKBOOK_EXTRA[@]}"
}

main "$@"
