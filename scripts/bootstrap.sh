#!/usr/bin/env bash
# Make this checkout ready to run: .venv (Python 3.11) with PlexRL installed editable and
# every dependency at the exact version in requirements.lock (scripts/lock.sh updates it),
# plus Java 17+ and Maven for the local Kafka broker (scripts/infra.sh).
#
# Reinstalls only when what the install depends on changed (pyproject.toml, the lock, the
# set of top-level packages, the checkout's path, the interpreter); PLEXRL_REINSTALL=1
# forces it.
# Non-interactive; on a Debian host it installs missing system packages with apt-get.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=bootstrap
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

VENV=$ROOT/.venv
LOCK=$ROOT/requirements.lock
# The installer, pinned like everything else; it also resolves the lock (scripts/lock.sh).
UV_VERSION=0.13.9
STAMP=$VENV/.plexrl-install-stamp
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
[[ ${CI:-} == true ]] && export PIP_PROGRESS_BAR=off

# A Python that pyproject.toml accepts (>=3.11,<3.13).
python_ok() { "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 13))' 2>/dev/null; }

# install_stamp — everything an editable install bakes in. setuptools maps each top-level
# package to its folder when installing, so a new package needs a reinstall too.
install_stamp() {
  local -a packages
  shopt -s nullglob
  packages=("$ROOT"/libs/*/__init__.py "$ROOT"/services/*/*/__init__.py)
  shopt -u nullglob
  {
    sha256sum "$ROOT/pyproject.toml" "$LOCK" | cut -d' ' -f1
    "$VENV/bin/python" -VV
    printf '%s\n' "$ROOT" "${packages[@]%/__init__.py}"
    echo bytecode  # compiled at install (compile_bytecode)
  } | sha256sum | cut -d' ' -f1
}

create_venv() {
  local py=${PLEXRL_PYTHON:-python3.11}
  if ! command -v "$py" >/dev/null; then
    [[ -n ${PLEXRL_PYTHON:-} ]] && die "PLEXRL_PYTHON=$py is not an executable on PATH"
    apt_install python3.11 python3.11-venv
  fi
  python_ok "$py" || die "$py is not Python 3.11 or 3.12; set PLEXRL_PYTHON to one that is"
  log "creating $VENV with $("$py" -V 2>&1)"
  if ! "$py" -m venv "$VENV"; then
    # Debian splits venv's ensurepip into its own package.
    rm -rf "$VENV"
    apt_install python3.11-venv
    "$py" -m venv "$VENV" || die "$py -m venv failed; see the error above"
  fi
}

main() {
  log "checking Java and Maven (for the local Kafka broker)"
  ensure_java
  ensure_cmd mvn maven

  mkdir -p "$ROOT/.plexrl"
  exec 9>"$ROOT/.plexrl/bootstrap.lock"
  flock -w 1800 9 || die "another scripts/bootstrap.sh holds .plexrl/bootstrap.lock"

  if [[ -x $VENV/bin/python ]] && ! python_ok "$VENV/bin/python"; then
    die "$VENV/bin/python is not a working Python 3.11 or 3.12; remove .venv and rerun"
  fi
  [[ -x $VENV/bin/python ]] || create_venv

  local want
  want=$(install_stamp)
  if [[ ${PLEXRL_REINSTALL:-0} != 1 && -f $STAMP && $(<"$STAMP") == "$want" ]]; then
    log ".venv is up to date ($("$VENV/bin/python" -V 2>&1))"
    return 0
  fi
  [[ -f $LOCK ]] || die "$LOCK is missing; restore it from git (or create it: scripts/lock.sh)"
  log "installing the locked dependencies into .venv (first run downloads torch: minutes)"
  local started=$SECONDS
  "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION" ||
    die "pip install uv==$UV_VERSION failed; see pip's output above"
  local -a uv=("$VENV/bin/uv" pip install --python "$VENV/bin/python")
  [[ ${CI:-} == true ]] && uv+=(--no-progress)
  "${uv[@]}" -r "$LOCK" ||
    die "installing requirements.lock failed; see the output above"
  # The project itself, editable, with nothing beyond the lock.
  (cd "$ROOT" && "${uv[@]}" --no-deps -e .) ||
    die "installing PlexRL (editable) failed; see the output above"
  "$VENV/bin/uv" pip check --python "$VENV/bin/python" ||
    die "the installed packages conflict; regenerate the lock with scripts/lock.sh"
  local site
  site=$(site_packages "$VENV/bin/python")
  compile_bytecode "$VENV/bin/python" "$site" "$ROOT/libs" "$ROOT/services"
  echo "$want" >"$STAMP"
  log "installed in $((SECONDS - started))s"
}

main "$@"
