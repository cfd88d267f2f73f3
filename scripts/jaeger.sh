#!/usr/bin/env bash
# Jaeger v2 for local traces: built once from the Go module proxy, then run from the cache.
#
#   scripts/jaeger.sh build    build .plexrl/bin/jaeger (v1.76.0) unless it is there
#   scripts/jaeger.sh up       build if needed, start it (in-memory storage); idempotent
#   scripts/jaeger.sh down     stop what `up` started (by pid file)
#   scripts/jaeger.sh status   whether the query API answers
#   scripts/jaeger.sh env      `export` lines pointing OTLP at it
#
# Jaeger v2 is one binary (an OpenTelemetry Collector distribution); with no config it
# runs "all in one": OTLP on :4317 (gRPC) and :4318 (HTTP), UI and query API on :16686,
# spans kept in memory. The first build takes about 18 minutes on 2 cores and is
# cached in .plexrl/bin/; set PLEXRL_JAEGER_NICE=1 to build at the lowest priority on
# one thread so other work on the machine keeps its CPUs.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=jaeger
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

# Jaeger v2 ships from the v1 module path: cmd/jaeger is the v2 binary in releases v1.6x+.
JAEGER_MODULE=github.com/jaegertracing/jaeger/cmd/jaeger
JAEGER_VERSION=${PLEXRL_JAEGER_VERSION:-v1.76.0}
BIN_DIR=$ROOT/.plexrl/bin
BIN=$BIN_DIR/jaeger
STAMP=$BIN_DIR/jaeger.version
STATE=$ROOT/.plexrl/jaeger
PID=$STATE/jaeger.pid
LOG=$STATE/jaeger.log
HOST=127.0.0.1
QUERY_PORT=16686
OTLP_HTTP_PORT=4318
TIMEOUT=${PLEXRL_JAEGER_TIMEOUT:-60}

built() { [[ -x $BIN && -f $STAMP && $(cat "$STAMP") == "$JAEGER_VERSION" ]]; }

build() {
  if built; then
    log "jaeger $JAEGER_VERSION already built: $BIN"
    return 0
  fi
  command -v go >/dev/null || die "go is not on PATH; install Go 1.24+ (https://go.dev/dl/) to build Jaeger"
  mkdir -p "$BIN_DIR"
  local -a prefix=()
  if [[ ${PLEXRL_JAEGER_NICE:-0} == 1 ]]; then
    # One OS thread for Go and for the compiler's backend: slower, but it leaves the
    # other cores to the tests that share this machine.
    prefix=(nice -n 19 env GOMAXPROCS=1 GOFLAGS="-mod=mod -p=1")
  else
    prefix=(env GOFLAGS=-mod=mod)
  fi
  log "building $JAEGER_MODULE@$JAEGER_VERSION into $BIN_DIR (first time: ~18 min on 2 cores)"
  # `go install path@version` refuses a module whose go.mod has `replace` directives
  # (Jaeger's has one, for sarama), so build it as the main module: fetch the module's
  # source through the proxy, copy it somewhere writable, `go build` there.
  # -mod=mod: the module zip carries go.mod and go.sum but no vendor directory.
  local src dir
  src=$(go mod download -json "github.com/jaegertracing/jaeger@$JAEGER_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d $src ]] || die "go mod download github.com/jaegertracing/jaeger@$JAEGER_VERSION gave no source directory"
  dir=$ROOT/.plexrl/jaeger/src-$JAEGER_VERSION
  rm -rf "$dir" && mkdir -p "$(dirname "$dir")" && cp -r "$src" "$dir" && chmod -R u+w "$dir"
  (cd "$dir" && "${prefix[@]}" CGO_ENABLED=0 go build -trimpath -o "$BIN" ./cmd/jaeger) >&2 ||
    die "go build of $JAEGER_MODULE@$JAEGER_VERSION failed; see the output above"
  rm -rf "$dir"
  echo "$JAEGER_VERSION" >"$STAMP"
  log "built $BIN"
}

answers() { curl -fsS -o /dev/null "http://$HOST:$QUERY_PORT/api/services" 2>/dev/null; }

up() {
  if answers; then
    log "a Jaeger query API already answers on :$QUERY_PORT"
    return 0
  fi
  build
  mkdir -p "$STATE"
  log "starting $BIN (log: $LOG)"
  nohup "$BIN" >"$LOG" 2>&1 &
  echo $! >"$PID"
  local waited=0
  until answers; do
    kill -0 "$(cat "$PID")" 2>/dev/null || die "jaeger exited at start; see $LOG"
    ((waited++ < TIMEOUT)) || die "jaeger did not answer on :$QUERY_PORT within ${TIMEOUT}s; see $LOG"
    sleep 1
  done
  log "up: UI and query API http://$HOST:$QUERY_PORT, OTLP http://$HOST:$OTLP_HTTP_PORT"
}

down() {
  [[ -f $PID ]] || { log "not started by this script"; return 0; }
  local pid
  pid=$(cat "$PID")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    log "stopped pid $pid"
  fi
  rm -f "$PID"
}

case ${1:-} in
  build) build ;;
  up) up ;;
  down) down ;;
  status) if answers; then echo "jaeger: answers on :$QUERY_PORT"; else echo "jaeger: down"; exit 1; fi ;;
  env) echo "export OTEL_EXPORTER_OTLP_ENDPOINT=http://$HOST:$OTLP_HTTP_PORT" ;;
  *) die "usage: scripts/jaeger.sh build|up|down|status|env" ;;
esac
