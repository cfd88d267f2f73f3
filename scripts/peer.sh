#!/usr/bin/env bash
# Install the peer Tinker-API server that bench/peer.py measures PlexRL beside:
# .plexrl/peer-venv with skyrl-tx (SkyRL's tx: a public Tinker API server with a JAX
# backend that batches LoRA adapters together) and JAX for CPU, at the exact versions in
# requirements-peer.lock. Benchmark only: nothing in PlexRL or its tests imports it.
#
#   scripts/peer.sh            install, or do nothing when it is up to date
#   scripts/peer.sh lock       re-resolve requirements-peer.lock from the pins below
#   scripts/peer.sh path       print the venv's python
#
# Its own virtualenv because skyrl-tx needs transformers < 5 (requirements.lock has 5.x).
# Not its `jax` extra: on Linux that pulls jax[cuda12]; the CPU build is plain jax. About
# 6 GB all the same: skyrl-tx needs peft, which needs torch, whose PyPI wheels carry CUDA.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=peer
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

PINS=("skyrl-tx[tinker]==0.3.0" "jax==0.10.2" "flax==0.12.8" "optax==0.2.8")
VENV=${PLEXRL_PEER_VENV:-$ROOT/.plexrl/peer-venv}
LOCK=$ROOT/requirements-peer.lock
STAMP=$VENV/.plexrl-install-stamp
UV=$ROOT/.venv/bin/uv

ensure_uv() {
  [[ -x $UV ]] || "$ROOT/scripts/bootstrap.sh" || die "scripts/bootstrap.sh failed; it installs uv"
}

lock() {
  ensure_uv
  printf '%s\n' "${PINS[@]}" |
    "$UV" pip compile - --python-version 3.11 --python-platform "$(uname -m)-manylinux_2_28" \
      --quiet --custom-compile-command "scripts/peer.sh lock" --output-file "$LOCK"
  log "wrote $LOCK; install it with scripts/peer.sh"
}

install() {
  [[ -f $LOCK ]] || die "$LOCK is missing; restore it from git (or create it: scripts/peer.sh lock)"
  ensure_uv
  if [[ ! -x $VENV/bin/python ]]; then
    local py=${PLEXRL_PYTHON:-python3.11}
    command -v "$py" >/dev/null || die "$py is not on PATH; run scripts/bootstrap.sh first or set PLEXRL_PYTHON"
    "$UV" venv --quiet --python "$py" "$VENV" || die "creating $VENV failed; see the error above"
  fi
  local want
  want=$({ sha256sum "$LOCK" | cut -d' ' -f1; "$VENV/bin/python" -VV; } | sha256sum | cut -d' ' -f1)
  if [[ ${PLEXRL_REINSTALL:-0} != 1 && -f $STAMP && $(<"$STAMP") == "$want" ]]; then
    log "$VENV is up to date"
    return 0
  fi
  log "installing requirements-peer.lock into $VENV"
  "$UV" pip install --quiet --python "$VENV/bin/python" -r "$LOCK" ||
    die "installing requirements-peer.lock failed; see the output above"
  "$VENV/bin/python" -c 'import jax, tx.tinker.api' || die "skyrl-tx does not import in $VENV"
  echo "$want" >"$STAMP"
  log "installed ($(du -sh "$VENV" | cut -f1))"
}

case ${1:-install} in
  install) install ;;
  lock) lock ;;
  path) echo "$VENV/bin/python" ;;
  *) die "unknown command '$1'; use: scripts/peer.sh [install|lock|path]" ;;
esac
