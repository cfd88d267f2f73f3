# Shared by scripts/bootstrap.sh and scripts/infra.sh; sourced, not run.
# shellcheck shell=bash

# Progress goes to stderr so that stdout stays parseable (`scripts/infra.sh env`).
log() { printf '[%s] %s\n' "${PLEXRL_LOG_TAG:-plexrl}" "$*" >&2; }
die() {
  printf '[%s] ERROR: %s\n' "${PLEXRL_LOG_TAG:-plexrl}" "$*" >&2
  exit 1
}

# apt_install PKG... — install Debian packages without prompting. Uses sudo only when
# not root, and `sudo -n` so that CI fails with a message instead of waiting for a
# password. Refreshes the package lists only if the first attempt cannot find a package.
apt_install() {
  local -a as_root=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null ||
      die "need to install '$*' but not root and no sudo; install it by hand"
    as_root=(sudo -n)
  fi
  command -v apt-get >/dev/null ||
    die "need to install '$*' but apt-get is missing (not Debian/Ubuntu?); install it by hand"
  local -a apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -q
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
  log "installing Debian packages: $*"
  if ! "${apt[@]}" install --no-install-recommends "$@" >&2; then
    log "install failed; refreshing package lists and retrying"
    "${apt[@]}" update >&2 || die "apt-get update failed"
    "${apt[@]}" install --no-install-recommends "$@" >&2 || die "apt-get install $* failed"
  fi
}

# ensure_cmd CMD PACKAGE — install PACKAGE when CMD is not on PATH.
ensure_cmd() {
  command -v "$1" >/dev/null && return 0
  apt_install "$2"
  command -v "$1" >/dev/null || die "installed $2 but '$1' is still not on PATH"
}

# site_packages PYTHON — the folder PYTHON installs pure-Python packages into.
site_packages() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# compile_bytecode PYTHON DIR... — the .pyc of every module under DIRs, written once at
# install. Python reads them at every start but never writes them where
# PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines), so without them each
# new interpreter compiles torch, transformers and the rest from source: about 6 of the
# 15 s of CPU a worker's imports take. A file that does not compile (a package's Python 2
# sample, say) stays source only, as it would anyway.
compile_bytecode() {
  local python=$1 started=$SECONDS
  shift
  "$python" -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true
  log "compiled bytecode in $((SECONDS - started))s"
}

# ensure_java — Java 17+ on PATH (the Kafka 4 broker refuses older runtimes).
ensure_java() {
  ensure_cmd java openjdk-17-jre-headless
  local version major
  version=$(java -XshowSettings:properties -version 2>&1 |
    sed -n 's/^ *java\.specification\.version = //p')
  major=${version#1.}
  major=${major%%.*}
  [[ ${major:-0} -ge 17 ]] ||
    die "java on PATH is version ${version:-unknown}; Kafka needs 17 or newer (apt-get install openjdk-17-jre-headless, then put it first on PATH)"
}

# go_cmd — print the Go toolchain's path (for the tools built from the Go module proxy:
# scripts/helm.sh, scripts/seaweedfs.sh).
go_cmd() {
  if command -v go >/dev/null; then
    command -v go
  elif [[ -x /usr/local/go/bin/go ]]; then
    echo /usr/local/go/bin/go
  else
    die "go is not on PATH (nor /usr/local/go/bin/go); install Go 1.26+ (https://go.dev/dl/) to build the tools under .plexrl/bin"
  fi
}
