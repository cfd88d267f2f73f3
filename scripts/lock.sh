#!/usr/bin/env bash
# Refresh requirements.lock, the exact versions every install uses (scripts/bootstrap.sh,
# CI, the Dockerfile), from the ranges in pyproject.toml.
#
#   scripts/lock.sh                   re-resolve only what pyproject.toml's change needs
#   scripts/lock.sh --upgrade         everything to the newest versions allowed today
#   scripts/lock.sh --upgrade-package torch     one package (and what it drags along)
#
# The lock is universal (one file for Linux and macOS, Python 3.11 and 3.12). After an
# update: run scripts/test.sh and scripts/demo.sh, and record the new figures in the
# README, since numerics (and with them the demo's rewards) move with torch and transformers.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=lock
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"
cd "$ROOT"

[[ -x .venv/bin/uv ]] || scripts/bootstrap.sh
.venv/bin/uv pip compile pyproject.toml --extra test --universal --python-version 3.11 \
  --quiet --custom-compile-command scripts/lock.sh --output-file requirements.lock "$@"
log "wrote requirements.lock; reinstall with scripts/bootstrap.sh"
