#!/usr/bin/env bash
# SeaweedFS, the S3-compatible object store the disk tier can live on: built once from
# the Go module proxy, then run from the cache.
#
#   scripts/seaweedfs.sh build   build .plexrl/bin/weed unless it is there; prints its path
#   scripts/seaweedfs.sh path    the binary's path (fails if it is not built)
#
# SeaweedFS (Apache-2.0) is one binary, `weed`; `weed server -s3` runs its master, a
# volume server, the filer and the S3 gateway in one process. The module has no tagged
# Go versions (its releases are tagged 4.xx, not v4.xx), so a pseudo-version pins the
# commit. Its go.mod has a `replace` directive, which `go install path@version` refuses,
# so the source is fetched through the proxy and built as the main module, as
# scripts/jaeger.sh builds Jaeger. The first build's time on this machine is in
# docs/infra.md; later runs find the stamped binary and do nothing. PLEXRL_GO_NICE=1
# builds at the lowest priority on one thread so other work keeps its CPUs.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=seaweedfs
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

SEAWEEDFS_MODULE=github.com/seaweedfs/seaweedfs
SEAWEEDFS_VERSION=${PLEXRL_SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}
BIN_DIR=$ROOT/.plexrl/bin
BIN=$BIN_DIR/weed
STAMP=$BIN_DIR/weed.version

built() { [[ -x $BIN && -f $STAMP && $(<"$STAMP") == "$SEAWEEDFS_VERSION" ]]; }

build() {
  if built; then
    echo "$BIN"
    return 0
  fi
  local go
  go=$(go_cmd)
  mkdir -p "$BIN_DIR"
  local -a prefix=(env GOFLAGS=-mod=mod)
  if [[ ${PLEXRL_GO_NICE:-0} == 1 ]]; then
    prefix=(nice -n 19 env GOMAXPROCS=1 GOFLAGS="-mod=mod -p=1")
  fi
  log "building $SEAWEEDFS_MODULE/weed@$SEAWEEDFS_VERSION into ${BIN_DIR#"$ROOT"/}"
  local start=$SECONDS src dir
  src=$("$go" mod download -json "$SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d $src ]] || die "go mod download $SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION gave no source directory"
  dir=$(mktemp -d "${TMPDIR:-/tmp}/plexrl-seaweedfs.XXXXXX")
  # shellcheck disable=SC2064 # expand now: dir is local
  trap "rm -rf '$dir'" EXIT
  cp -r "$src/." "$dir" && chmod -R u+w "$dir"
  (cd "$dir" && "${prefix[@]}" CGO_ENABLED=0 "$go" build -trimpath -ldflags "-s -w" -o "$BIN.tmp" ./weed) >&2 ||
    die "go build of $SEAWEEDFS_MODULE/weed@$SEAWEEDFS_VERSION failed; see the output above"
  mv "$BIN.tmp" "$BIN"
  echo "$SEAWEEDFS_VERSION" >"$STAMP"
  log "built $BIN in $((SECONDS - start)) s"
  echo "$BIN"
}

case ${1:-} in
  build) build ;;
  path) if built; then echo "$BIN"; else die "SeaweedFS is not built: run scripts/seaweedfs.sh build"; fi ;;
  *) die "usage: scripts/seaweedfs.sh build|path" ;;
esac
