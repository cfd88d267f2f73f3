#!/usr/bin/env bash
# Static checks: ruff, then mypy (its file list is in pyproject.toml). Both always run;
# the exit status is non-zero if either fails.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit

[[ -x .venv/bin/ruff && -x .venv/bin/mypy ]] || scripts/bootstrap.sh || exit

status=0
echo "[lint] ruff check ." >&2
.venv/bin/ruff check . || status=1
echo "[lint] mypy" >&2
.venv/bin/mypy || status=1
exit "$status"
