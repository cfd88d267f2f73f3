#!/usr/bin/env bash
# Install the SGLang sampler tier: .plexrl/sglang-venv with sglang and everything it needs
# at the exact versions in requirements-sglang.lock, plus the CPU import shim
# (services/gpu-worker/plexrl_worker/sglang/cpu_shim.py; see docs/sglang.md).
#
#   scripts/sglang.sh            install, or do nothing when it is up to date
#   scripts/sglang.sh lock       re-resolve requirements-sglang.lock from SGLANG_VERSION
#   scripts/sglang.sh path       print the venv's python (for PLEXRL_SGLANG_PYTHON)
#
# SGLang gets its own virtualenv because sglang==0.5.23 pins torch, transformers and
# tokenizers to other versions than requirements.lock (torch 2.14.1 vs 2.15.0,
# transformers 5.19.0 vs 5.24.0); the worker runs it as a child server process.
# The install is about 9.5 GB (torch's CUDA libraries and SGLang's CUDA kernels come from
# PyPI even on a CPU machine; there is no CPU build) and takes minutes on a fresh machine.
# Reinstalls only when the lock, the shim, the interpreter or the checkout's path changed;
# PLEXRL_REINSTALL=1 forces it. Linux with glibc 2.34+; the lock is resolved for x86_64
# (on aarch64 run `scripts/sglang.sh lock` first).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=sglang
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

SGLANG_VERSION=0.5.23
VENV=${PLEXRL_SGLANG_VENV:-$ROOT/.plexrl/sglang-venv}
LOCK=$ROOT/requirements-sglang.lock
SHIM=$ROOT/services/gpu-worker/plexrl_worker/sglang/cpu_shim.py
STAMP=$VENV/.plexrl-install-stamp
UV=$ROOT/.venv/bin/uv

ensure_uv() {
  # bootstrap.sh installs the pinned uv into .venv.
  [[ -x $UV ]] || "$ROOT/scripts/bootstrap.sh" || die "scripts/bootstrap.sh failed; it installs uv"
  [[ -x $UV ]] || die "$UV is missing after scripts/bootstrap.sh"
}

lock() {
  ensure_uv
  local platform
  platform="$(uname -m)-manylinux_2_34"
  log "resolving sglang==$SGLANG_VERSION for Python 3.11 on $platform"
  printf 'sglang==%s\n' "$SGLANG_VERSION" |
    "$UV" pip compile - --python-version 3.11 --python-platform "$platform" --quiet \
      --custom-compile-command "scripts/sglang.sh lock" --output-file "$LOCK"
  log "wrote $LOCK; install it with scripts/sglang.sh"
}

install_stamp() {
  {
    sha256sum "$LOCK" "$SHIM" | cut -d' ' -f1
    "$VENV/bin/python" -VV
    echo "$ROOT"
    echo bytecode  # compiled at install (compile_bytecode)
  } | sha256sum | cut -d' ' -f1
}

install() {
  [[ $(uname -s) == Linux ]] || die "SGLang's PyPI wheels are Linux-only; use PLEXRL_SAMPLER=torch here"
  local glibc
  glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  if [[ -n $glibc ]] && ! printf '2.34\n%s\n' "$glibc" | sort -C -V; then
    die "glibc $glibc is older than 2.34, which sglang $SGLANG_VERSION's wheels need; use a newer distribution or PLEXRL_SAMPLER=torch"
  fi
  [[ -f $LOCK ]] || die "$LOCK is missing; restore it from git (or create it: scripts/sglang.sh lock)"
  [[ -f $SHIM ]] || die "$SHIM is missing; restore it from git"
  ensure_uv
  mkdir -p "$ROOT/.plexrl"
  exec 9>"$ROOT/.plexrl/sglang.lock"
  flock -w 1800 9 || die "another scripts/sglang.sh holds .plexrl/sglang.lock"

  if [[ ! -x $VENV/bin/python ]]; then
    local py=${PLEXRL_PYTHON:-python3.11}
    command -v "$py" >/dev/null || die "$py is not on PATH; run scripts/bootstrap.sh first or set PLEXRL_PYTHON"
    log "creating $VENV with $("$py" -V 2>&1)"
    "$UV" venv --quiet --python "$py" "$VENV" || die "creating $VENV failed; see the error above"
  fi
  local want
  want=$(install_stamp)
  if [[ ${PLEXRL_REINSTALL:-0} != 1 && -f $STAMP && $(<"$STAMP") == "$want" ]]; then
    log "$VENV is up to date (sglang $SGLANG_VERSION)"
    return 0
  fi
  log "installing requirements-sglang.lock into $VENV (about 9.5 GB on a fresh machine: minutes)"
  local started=$SECONDS
  local -a uv=("$UV" pip install --python "$VENV/bin/python")
  [[ ${CI:-} == true ]] && uv+=(--no-progress)
  "${uv[@]}" -r "$LOCK" || die "installing requirements-sglang.lock failed; see the output above"
  # The shim loads at interpreter start (a .pth line) and stands in for sgl_kernel only
  # when the real package fails to import; see the module's docstring.
  local site
  site=$(site_packages "$VENV/bin/python")
  cp "$SHIM" "$site/plexrl_sglang_cpu_shim.py"
  echo "import plexrl_sglang_cpu_shim" >"$site/plexrl_sglang_cpu_shim.pth"
  log "checking that sglang imports"
  "$VENV/bin/python" -c 'import sglang, sgl_kernel; print(sglang.__version__)' >/dev/null ||
    die "sglang does not import in $VENV; see the error above (PLEXRL_REINSTALL=1 reinstalls)"
  compile_bytecode "$VENV/bin/python" "$site"
  install_stamp >"$STAMP"
  log "installed in $((SECONDS - started))s ($(du -sh "$VENV" | cut -f1))"
}

case ${1:-install} in
  install) install ;;
  lock) lock ;;
  path) echo "$VENV/bin/python" ;;
  *) die "unknown command '$1'; use: scripts/sglang.sh [install|lock|path]" ;;
esac
