#!/usr/bin/env bash
# Local infrastructure for PlexRL: Apache Kafka (KRaft, one node) and Redis, on 127.0.0.1.
#
#   scripts/infra.sh up       start whatever does not already answer; idempotent
#   scripts/infra.sh down     stop what `up` started (by pid file); leave anything else alone
#   scripts/infra.sh status   what answers where, and whether `up` started it
#   scripts/infra.sh env      `export` lines for PLEXRL_KAFKA_BOOTSTRAP and PLEXRL_REDIS_URL
#   scripts/infra.sh prepare  install and fetch what `up` needs for the parts, start nothing
#                             (before several `up`s run at once: they would race the
#                             installs and the jar fetch)
#
# PLEXRL_INFRA_PARTS="redis" (or "kafka") limits up, down and status to that part;
# "sentinel" is a Redis Sentinel (not started by default).
#
# The host bed (scripts/hosts.sh) runs the same parts on other addresses: one broker of
# a three-node KRaft quorum (PLEXRL_KAFKA_NODE_ID, PLEXRL_KAFKA_VOTERS), a Redis replica
# (PLEXRL_REDIS_REPLICA_OF) or a Sentinel, each bound to its host's address
# (PLEXRL_INFRA_HOST) with its state under PLEXRL_INFRA_DIR. docs/infra.md lists them.
#
# State (jars, data, pid files, logs, generated configs) lives under the git-ignored
# .plexrl/infra/. Reset: scripts/infra.sh down && rm -rf .plexrl/infra. See docs/infra.md.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=infra
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

HOST=${PLEXRL_INFRA_HOST:-127.0.0.1}
KAFKA_PORT=${PLEXRL_KAFKA_PORT:-9092}
KAFKA_CONTROLLER_PORT=${PLEXRL_KAFKA_CONTROLLER_PORT:-$((KAFKA_PORT + 1))}
KAFKA_HEAP=${PLEXRL_KAFKA_HEAP:-512m}
REDIS_PORT=${PLEXRL_REDIS_PORT:-6379}
# "HOST PORT" of the primary this Redis replicates; empty: a primary.
REDIS_REPLICA_OF=${PLEXRL_REDIS_REPLICA_OF:-}
SENTINEL_PORT=${PLEXRL_SENTINEL_PORT:-26379}
# "NAME HOST PORT QUORUM": the primary a Sentinel watches, and how many Sentinels must
# agree it is down before one fails it over.
SENTINEL_MONITOR=${PLEXRL_SENTINEL_MONITOR:-plexrl 127.0.0.1 6379 2}
# How long the primary may be silent before a Sentinel calls it down (ms).
SENTINEL_DOWN_MS=${PLEXRL_SENTINEL_DOWN_MS:-5000}
# One broker of a KRaft quorum of several: its node id, and every controller as
# "id@host:port,..." (empty: one node, formatted --standalone, as on one machine).
KAFKA_NODE_ID=${PLEXRL_KAFKA_NODE_ID:-1}
KAFKA_VOTERS=${PLEXRL_KAFKA_VOTERS:-}
# TLS listeners beside PLAINTEXT (which the brokers and infra.sh's own probe keep
# using): a directory holding ca.pem (the CA clients' certificates are checked against)
# and server-key-and-cert.pem (the broker's unencrypted PKCS#8 key, then its
# certificate chain); an SSL listener on PLEXRL_KAFKA_SSL_PORT that requires a client
# certificate, and a SASL_SSL one (mechanism PLAIN, users from PLEXRL_KAFKA_SASL_USERS,
# "user:password,...") on PLEXRL_KAFKA_SASL_SSL_PORT. Empty: neither.
KAFKA_TLS_DIR=${PLEXRL_KAFKA_TLS_DIR:-}
KAFKA_SSL_PORT=${PLEXRL_KAFKA_SSL_PORT:-}
KAFKA_SASL_SSL_PORT=${PLEXRL_KAFKA_SASL_SSL_PORT:-}
KAFKA_SASL_USERS=${PLEXRL_KAFKA_SASL_USERS:-}
# The quorum's cluster id, the same for every node (empty: a fresh random one).
KAFKA_CLUSTER_ID=${PLEXRL_KAFKA_CLUSTER_ID:-}
TIMEOUT=${PLEXRL_INFRA_TIMEOUT:-120}
PARTS=" ${PLEXRL_INFRA_PARTS:-kafka redis} "
for part in $PARTS; do
  [[ $part == kafka || $part == redis || $part == sentinel ]] || { echo "[infra] PLEXRL_INFRA_PARTS: unknown part '$part'; use kafka, redis, sentinel" >&2; exit 2; }
done
wanted() { [[ $PARTS == *" $1 "* ]]; }

# Data, pid files and logs; the broker jars stay in .plexrl/infra (one copy per checkout).
STATE=${PLEXRL_INFRA_DIR:-$ROOT/.plexrl/infra}
POM=$ROOT/scripts/kafka/pom.xml
KAFKA_LIBS=$ROOT/.plexrl/infra/kafka-libs
# Data is per port: a KRaft log formatted for one listener set stays with it.
KAFKA_DIR=$STATE/kafka-$KAFKA_PORT
KAFKA_PID=$KAFKA_DIR/kafka.pid
KAFKA_LOG=$KAFKA_DIR/logs/server.log
# JVM stdout/stderr: only what happens before log4j is up (bad flags, crashes).
KAFKA_OUT=$KAFKA_DIR/logs/kafka.out
REDIS_DIR=$STATE/redis-$REDIS_PORT
REDIS_PID=$REDIS_DIR/redis.pid
REDIS_LOG=$REDIS_DIR/redis.log
SENTINEL_DIR=$STATE/sentinel-$SENTINEL_PORT
SENTINEL_PID=$SENTINEL_DIR/sentinel.pid
SENTINEL_LOG=$SENTINEL_DIR/sentinel.log
# Pinned, so a new plugin release on Maven Central cannot change what `up` does.
DEPENDENCY_PLUGIN=org.apache.maven.plugins:maven-dependency-plugin:3.8.1

KAFKA_BOOTSTRAP=$HOST:$KAFKA_PORT
REDIS_URL=redis://$HOST:$REDIS_PORT/0

# ---------------------------------------------------------------- probes

# The venv's interpreter first: the pyenv shim for python3 costs ~100 ms per call.
PROBE_PY=
for py in "$ROOT/.venv/bin/python" /usr/bin/python3 python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c '' 2>/dev/null; then
    PROBE_PY=$py
    break
  fi
done

tcp_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# kafka_probe — 0: a ready broker answers; 1: nothing listens; 2: something else listens.
kafka_probe() {
  if [[ -n $PROBE_PY ]]; then
    "$PROBE_PY" "$ROOT/scripts/kafka/probe.py" "$KAFKA_BOOTSTRAP" 2
  elif tcp_open "$KAFKA_PORT"; then
    # No Python at all: fall back to "port open and our broker logged its start".
    [[ -f $KAFKA_LOG ]] && grep -q 'Kafka Server started' "$KAFKA_LOG" && return 0
    echo "$KAFKA_BOOTSTRAP is open (no python3 to check it speaks Kafka)"
    return 2
  else
    echo "no connection to $KAFKA_BOOTSTRAP"
    return 1
  fi
}

# redis_probe — same codes as kafka_probe.
redis_probe() {
  local reply=
  if command -v redis-cli >/dev/null; then
    reply=$(timeout 5 redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>&1) || true
  elif tcp_open "$REDIS_PORT"; then
    reply=$(
      exec 3<>"/dev/tcp/$HOST/$REDIS_PORT" && printf 'PING\r\n' >&3 &&
        IFS= read -r -t 5 line <&3 && printf '%s' "${line%$'\r'}"
    ) || true
    reply=${reply#+}
  fi
  if [[ $reply == PONG ]]; then
    echo "redis at $HOST:$REDIS_PORT answers PING"
    return 0
  fi
  if tcp_open "$REDIS_PORT"; then
    echo "$HOST:$REDIS_PORT accepts connections but does not answer PING with PONG: ${reply:-no reply}"
    return 2
  fi
  echo "no connection to $HOST:$REDIS_PORT"
  return 1
}

# managed_pid PIDFILE WORD... — print the pid in PIDFILE if that process is alive and its
# command line holds every WORD, so a recycled pid is never mistaken for ours.
managed_pid() {
  local file=$1 pid cmdline word
  shift
  [[ -s $file ]] || return 1
  pid=$(<"$file")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  if [[ -r /proc/$pid/cmdline ]]; then
    cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline")
  else
    cmdline=$(ps -o args= -p "$pid" 2>/dev/null) || return 1
  fi
  for word in "$@"; do
    [[ $cmdline == *"$word"* ]] || return 1
  done
  echo "$pid"
}

kafka_pid() { managed_pid "$KAFKA_PID" kafka.Kafka "$KAFKA_DIR/server.properties"; }
redis_pid() { managed_pid "$REDIS_PID" redis-server ":$REDIS_PORT"; }

# show_failure LOG... — the lines most likely to say why a service failed: the error
# lines of a log, and the end of a *.out file (raw JVM output, short and all relevant).
show_failure() {
  local file errors
  for file in "$@"; do
    [[ -s $file ]] || continue
    if [[ $file == *.out ]]; then
      errors=$(tail -n 10 "$file")
    else
      errors=$(grep -E '(ERROR|FATAL|Exception|Error:)' "$file" | tail -n 12) || true
    fi
    echo "--- $file" >&2
    printf '%s\n' "${errors:-$(tail -n 20 "$file")}" >&2
  done
}

# wait_ready NAME PROBE PID LOG... — poll PROBE until it answers or TIMEOUT passes;
# stop early, with the logs' errors, if process PID (may be empty: unknown) has exited.
wait_ready() {
  local name=$1 probe=$2 started=$3 deadline=$((SECONDS + TIMEOUT)) msg
  shift 3
  while true; do
    msg=$($probe) && return 0
    if [[ -n $started ]] && ! kill -0 "$started" 2>/dev/null; then
      show_failure "$@"
      die "$name exited during startup (errors above; logs: $*)"
    fi
    if ((SECONDS >= deadline)); then
      show_failure "$@"
      die "$name did not answer within ${TIMEOUT}s ($msg). Logs: $*. Longer wait: PLEXRL_INFRA_TIMEOUT=300"
    fi
    sleep 0.5
  done
}

# ---------------------------------------------------------------- kafka

kafka_fetch_jars() {
  local want tmp
  want=$(sha256sum "$POM" | cut -d' ' -f1)
  [[ -f $KAFKA_LIBS/.pom-sha256 && $(<"$KAFKA_LIBS/.pom-sha256") == "$want" ]] && return 0
  ensure_cmd mvn maven
  log "kafka: fetching broker jars from Maven Central (scripts/kafka/pom.xml) into $KAFKA_LIBS"
  local libs_parent=${KAFKA_LIBS%/*}
  mkdir -p "$libs_parent"
  tmp=$(mktemp -d "$libs_parent/kafka-libs.tmp.XXXXXX")
  if ! mvn -B -q -Dstyle.color=never -f "$POM" "$DEPENDENCY_PLUGIN:copy-dependencies" \
    -DoutputDirectory="$tmp" -DincludeScope=runtime >"$libs_parent/mvn.log" 2>&1; then
    cat "$libs_parent/mvn.log" >&2
    rm -rf "$tmp"
    die "mvn could not fetch the Kafka jars (its output is above and in $libs_parent/mvn.log). Check access to https://repo.maven.apache.org (a proxy goes in ~/.m2/settings.xml)"
  fi
  ls "$tmp"/kafka_2.13-*.jar >/dev/null 2>&1 || die "mvn succeeded but fetched no kafka_2.13 jar; see $libs_parent/mvn.log"
  # Swap in whole, so an interrupted fetch never leaves a half-filled classpath.
  echo "$want" >"$tmp/.pom-sha256"
  rm -rf "$KAFKA_LIBS"
  mv "$tmp" "$KAFKA_LIBS"
}

# kafka_quorum — the lines that differ between one node and a quorum of several.
kafka_quorum() {
  if [[ -z $KAFKA_VOTERS ]]; then
    cat <<EOF
# Dynamic quorum (formatted with --standalone): controller.quorum.voters would conflict.
controller.quorum.bootstrap.servers=$HOST:$KAFKA_CONTROLLER_PORT
# One node: every internal topic has one replica.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
EOF
    return
  fi
  local voters
  voters=$(tr ',' '\n' <<<"$KAFKA_VOTERS" | grep -c .)
  local factor=$((voters < 3 ? voters : 3)) isr=$((voters < 3 ? 1 : 2))
  cat <<EOF
# One of a static quorum of $voters controllers (each node also a broker). Every
# internal topic, and any topic made without a factor, has $factor replicas, $isr in sync
# for a write: one broker's host can be lost without losing a message or a write.
controller.quorum.voters=$KAFKA_VOTERS
offsets.topic.replication.factor=$factor
transaction.state.log.replication.factor=$factor
transaction.state.log.min.isr=$isr
share.coordinator.state.topic.replication.factor=$factor
share.coordinator.state.topic.min.isr=$isr
default.replication.factor=$factor
min.insync.replicas=$isr
unclean.leader.election.enable=false
# A broker whose host vanished is fenced by the controllers after 6 s without a
# heartbeat (9 s by default), and its partitions get new leaders; a follower silent for
# 6 s leaves the in-sync set (30 s by default), so acks=all writes stop waiting for it.
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=6000
replica.lag.time.max.ms=6000
EOF
}

# kafka_tls_listeners — the TLS listeners' names and addresses (none without a TLS dir).
KAFKA_TLS_LISTENERS='' KAFKA_TLS_MAP=''
kafka_tls_listeners() {
  [[ -n $KAFKA_TLS_DIR ]] || return 0
  [[ -f $KAFKA_TLS_DIR/ca.pem && -f $KAFKA_TLS_DIR/server-key-and-cert.pem ]] ||
    die "PLEXRL_KAFKA_TLS_DIR=$KAFKA_TLS_DIR needs ca.pem and server-key-and-cert.pem"
  [[ -n $KAFKA_SSL_PORT || -n $KAFKA_SASL_SSL_PORT ]] ||
    die "PLEXRL_KAFKA_TLS_DIR is set: set PLEXRL_KAFKA_SSL_PORT, PLEXRL_KAFKA_SASL_SSL_PORT or both"
  if [[ -n $KAFKA_SSL_PORT ]]; then
    KAFKA_TLS_LISTENERS+=",SSL://$HOST:$KAFKA_SSL_PORT"
    KAFKA_TLS_MAP+=",SSL:SSL"
  fi
  if [[ -n $KAFKA_SASL_SSL_PORT ]]; then
    [[ -n $KAFKA_SASL_USERS ]] || die "PLEXRL_KAFKA_SASL_SSL_PORT needs PLEXRL_KAFKA_SASL_USERS (user:password,...)"
    KAFKA_TLS_LISTENERS+=",SASL_SSL://$HOST:$KAFKA_SASL_SSL_PORT"
    KAFKA_TLS_MAP+=",SASL_SSL:SASL_SSL"
  fi
}

# kafka_tls_config — the brokers' TLS and SASL settings (nothing without a TLS dir).
kafka_tls_config() {
  [[ -n $KAFKA_TLS_DIR ]] || return 0
  cat <<EOF
# TLS (PEM files): the broker's key and certificate, and the CA it checks clients'
# certificates against. The SSL listener admits only clients with a certificate that
# CA signed; the SASL_SSL one, users with a password (PLAIN, over TLS).
ssl.keystore.type=PEM
ssl.keystore.location=$KAFKA_TLS_DIR/server-key-and-cert.pem
ssl.truststore.type=PEM
ssl.truststore.location=$KAFKA_TLS_DIR/ca.pem
listener.name.ssl.ssl.client.auth=required
EOF
  if [[ -n $KAFKA_SASL_SSL_PORT ]]; then
    local users='' pair
    for pair in ${KAFKA_SASL_USERS//,/ }; do users+=" user_${pair%%:*}=\"${pair#*:}\""; done
    echo "sasl.enabled.mechanisms=PLAIN"
    echo "listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required$users;"
  fi
}

kafka_write_config() {
  mkdir -p "$KAFKA_DIR/logs" "$KAFKA_DIR/data"
  kafka_tls_listeners
  cat >"$KAFKA_DIR/server.properties" <<EOF
# Generated by scripts/infra.sh on every \`up\`; edits here are overwritten.
process.roles=broker,controller
node.id=$KAFKA_NODE_ID
listeners=PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$KAFKA_CONTROLLER_PORT$KAFKA_TLS_LISTENERS
advertised.listeners=PLAINTEXT://$HOST:$KAFKA_PORT$KAFKA_TLS_LISTENERS
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT$KAFKA_TLS_MAP
$(kafka_tls_config)
log.dirs=$KAFKA_DIR/data
num.partitions=1
auto.create.topics.enable=true
$(kafka_quorum)
# Fewer internal partitions than the default 50: the first consumer group and the first
# transaction then load in well under a second on a small machine.
offsets.topic.num.partitions=8
transaction.state.log.num.partitions=8
# Tests join and leave groups constantly; do not wait 3 s for more members.
group.initial.rebalance.delay.ms=0
EOF
  cat >"$KAFKA_DIR/log4j2.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!-- Generated by scripts/infra.sh: the broker logs to a file, never to stdout. -->
<Configuration status="WARN">
  <Appenders>
    <RollingFile name="server" fileName="$KAFKA_LOG" filePattern="$KAFKA_LOG.%i">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
      <Policies><SizeBasedTriggeringPolicy size="50 MB"/></Policies>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>
  </Appenders>
  <Loggers>
    <Root level="INFO"><AppenderRef ref="server"/></Root>
    <Logger name="kafka.request.logger" level="WARN"/>
    <Logger name="state.change.logger" level="WARN"/>
    <Logger name="kafka.log.LogCleaner" level="WARN"/>
    <Logger name="org.apache.kafka.storage.internals.log" level="WARN"/>
    <Logger name="org.apache.kafka.clients" level="WARN"/>
  </Loggers>
</Configuration>
EOF
  cat >"$KAFKA_DIR/tools-log4j2.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!-- Generated by scripts/infra.sh: one-shot tools (StorageTool) warn on stderr only. -->
<Configuration status="WARN">
  <Appenders>
    <Console name="stderr" target="SYSTEM_ERR"><PatternLayout pattern="%p %m (%c)%n"/></Console>
  </Appenders>
  <Loggers>
    <Root level="WARN"><AppenderRef ref="stderr"/></Root>
  </Loggers>
</Configuration>
EOF
}

# java_cmd LOG4J_CONFIG ARG... — set JAVA_CMD to the java command line shared by the
# Kafka tools and the broker. PLEXRL_KAFKA_JAVA_OPTS adds flags.
java_cmd() {
  local config=$1
  local -a extra
  shift
  read -r -a extra <<<"${PLEXRL_KAFKA_JAVA_OPTS:-}"
  JAVA_CMD=(java -Djava.awt.headless=true -Dlog4j2.configurationFile="$config"
    "${extra[@]}" -cp "$KAFKA_LIBS/*" "$@")
}

kafka_tool() {
  java_cmd "$KAFKA_DIR/tools-log4j2.xml" "$@"
  "${JAVA_CMD[@]}"
}

kafka_format() {
  [[ -f $KAFKA_DIR/data/meta.properties ]] && return 0
  local id
  # No meta.properties means no usable log: clear leftovers of an interrupted format.
  rm -rf "$KAFKA_DIR/data"
  mkdir -p "$KAFKA_DIR/data"
  id=$KAFKA_CLUSTER_ID
  [[ $id != -* ]] ||
    die "kafka: PLEXRL_KAFKA_CLUSTER_ID '$id' starts with '-', which Kafka's storage tool reads as an option; use another (kafka-storage.sh random-uuid never makes one)"
  if [[ -z $id ]]; then
    id=$(kafka_tool kafka.tools.StorageTool random-uuid 2>>"$KAFKA_OUT") ||
      die "kafka: StorageTool random-uuid failed; see $KAFKA_OUT"
  fi
  log "kafka: formatting KRaft storage in $KAFKA_DIR/data (cluster id $id)"
  echo "$id" >"$KAFKA_DIR/cluster.id"
  local -a quorum=(--standalone)
  # A static quorum (controller.quorum.voters) is formatted without it.
  [[ -z $KAFKA_VOTERS ]] || quorum=()
  kafka_tool kafka.tools.StorageTool format -t "$id" -c "$KAFKA_DIR/server.properties" \
    "${quorum[@]}" >>"$KAFKA_OUT" 2>&1 ||
    { tail -n 20 "$KAFKA_OUT" >&2; die "kafka: formatting storage failed; see $KAFKA_OUT"; }
}

kafka_launch() {
  log "kafka: starting broker on $KAFKA_BOOTSTRAP (heap $KAFKA_HEAP, log $KAFKA_LOG)"
  rm -f "$KAFKA_PID"
  # The child writes its own pid and then execs java, so the pid file names the JVM even
  # if setsid had to fork. setsid detaches it from this shell's session and job control;
  # fd 9 (the lock) is closed so the broker does not hold it.
  java_cmd "$KAFKA_DIR/log4j2.xml" "-Xmx$KAFKA_HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError \
    kafka.Kafka "$KAFKA_DIR/server.properties"
  # shellcheck disable=SC2016  # $$ and $@ belong to the inner shell
  setsid bash -c 'echo $$ >"$0"; exec "$@"' "$KAFKA_PID" "${JAVA_CMD[@]}" \
    </dev/null >>"$KAFKA_OUT" 2>&1 9>&- &
  local i
  for i in {1..50}; do
    [[ -s $KAFKA_PID ]] && { KAFKA_WAIT_PID=$(<"$KAFKA_PID"); return 0; }
    sleep 0.1
  done
  die "kafka: the broker process did not start; see $KAFKA_OUT"
}

# kafka_start — make sure a broker is answering or on its way; does not wait for it.
# Sets KAFKA_WAIT=1 (and KAFKA_WAIT_PID) when the caller must wait for a broker that
# `up` started.
kafka_start() {
  local pid msg rc=0
  msg=$(kafka_probe) || rc=$?
  if pid=$(kafka_pid); then
    if ((rc == 0)); then
      log "kafka: already running (pid $pid)"
    else
      log "kafka: started earlier (pid $pid), not answering yet; waiting"
      KAFKA_WAIT=1
      KAFKA_WAIT_PID=$pid
    fi
  elif ((rc == 0)); then
    log "kafka: $msg; not started by infra.sh, using it as is"
  elif ((rc == 2)); then
    die "port $KAFKA_PORT is held by something that is not a ready Kafka broker ($msg). Stop it, or choose other ports with PLEXRL_KAFKA_PORT"
  else
    ensure_java
    kafka_fetch_jars
    kafka_write_config
    kafka_format
    kafka_launch
    KAFKA_WAIT=1
  fi
}

# ---------------------------------------------------------------- redis

redis_up() {
  local pid msg rc=0 started=
  msg=$(redis_probe) || rc=$?
  if pid=$(redis_pid); then
    ((rc == 0)) && { log "redis: already running (pid $pid)"; return 0; }
    log "redis: started earlier (pid $pid), not answering yet; waiting"
    started=$pid
  elif ((rc == 0)); then
    log "redis: $msg; not started by infra.sh, using it as is"
    return 0
  elif ((rc == 2)); then
    die "port $REDIS_PORT is held by something that is not a usable Redis ($msg). Stop it, or choose another port with PLEXRL_REDIS_PORT"
  else
    if ! command -v redis-server >/dev/null; then
      ensure_cmd redis-server redis-server
      # On hosts with an init system the package starts its own server on 6379.
      if msg=$(redis_probe); then
        log "redis: $msg (started by the Debian package); using it as is"
        return 0
      fi
    fi
    mkdir -p "$REDIS_DIR/data"
    rm -f "$REDIS_PID"
    log "redis: starting on $HOST:$REDIS_PORT (log $REDIS_LOG)"
    # Redis is the only record of sessions, jobs, futures, results and checkpoint
    # records: an append-only file in data/, fsynced every second (a crash loses at
    # most ~1 s; what workers and blobs can re-announce is rebuilt from them).
    local -a replica=() exposed=()
    # On an address other than loopback (a host of the bed, a private network) Redis
    # refuses everyone without a password unless told not to: the network is the trust
    # boundary here (docs/deploy.md says how to add a password and TLS).
    [[ $HOST == 127.* ]] || exposed=(--protected-mode no)
    if [[ -n $REDIS_REPLICA_OF ]]; then
      # shellcheck disable=SC2206 # "HOST PORT": two words on purpose
      replica=(--replicaof $REDIS_REPLICA_OF)
      log "redis: a replica of $REDIS_REPLICA_OF"
    fi
    redis-server --bind "$HOST" --port "$REDIS_PORT" --daemonize yes \
      --pidfile "$REDIS_PID" --dir "$REDIS_DIR/data" --logfile "$REDIS_LOG" \
      --save '' --appendonly yes --appendfsync everysec "${replica[@]}" "${exposed[@]}" \
      </dev/null >"$REDIS_DIR/redis.out" 2>&1 9>&- ||
      {
        cat "$REDIS_DIR/redis.out" >&2
        die "redis-server failed to start (its output is above; log: $REDIS_LOG)"
      }
  fi
  # The daemon writes its pid file after forking; without it, only the timeout applies.
  [[ -n $started ]] || started=$(redis_pid) || started=
  wait_ready redis redis_probe "$started" "$REDIS_LOG"
  [[ -z $REDIS_REPLICA_OF ]] || wait_ready "redis (replica)" redis_synced "$started" "$REDIS_LOG"
  log "redis: ready at $REDIS_URL"
}

# redis_synced — 0 once a replica holds its primary's data (its link is up).
redis_synced() {
  local info
  info=$(timeout 5 redis-cli -h "$HOST" -p "$REDIS_PORT" info replication 2>&1) || true
  if [[ $info == *master_link_status:up* ]]; then
    return 0
  fi
  echo "not yet in sync with its primary ($REDIS_REPLICA_OF)"
  return 1
}

# ---------------------------------------------------------------- sentinel

sentinel_probe() {
  local reply
  reply=$(timeout 5 redis-cli -h "$HOST" -p "$SENTINEL_PORT" ping 2>&1) || true
  if [[ $reply == PONG ]]; then
    echo "sentinel at $HOST:$SENTINEL_PORT answers PING"
    return 0
  fi
  if tcp_open "$SENTINEL_PORT"; then
    echo "$HOST:$SENTINEL_PORT accepts connections but does not answer PING: ${reply:-no reply}"
    return 2
  fi
  echo "no connection to $HOST:$SENTINEL_PORT"
  return 1
}

sentinel_pid() { managed_pid "$SENTINEL_PID" redis-sentinel ":$SENTINEL_PORT"; }

sentinel_up() {
  local pid msg rc=0 started=
  msg=$(sentinel_probe) || rc=$?
  if pid=$(sentinel_pid); then
    ((rc == 0)) && { log "sentinel: already running (pid $pid)"; return 0; }
    started=$pid
  elif ((rc == 0)); then
    log "sentinel: $msg; not started by infra.sh, using it as is"
    return 0
  elif ((rc == 2)); then
    die "port $SENTINEL_PORT is held by something that is not a Sentinel ($msg); choose another with PLEXRL_SENTINEL_PORT"
  else
    ensure_cmd redis-sentinel redis-sentinel
    mkdir -p "$SENTINEL_DIR"
    # Written once: a Sentinel rewrites its own file with what it learns (the current
    # primary, the other Sentinels, the config epoch), which a restart must keep.
    if [[ ! -s $SENTINEL_DIR/sentinel.conf ]]; then
      local name primary port quorum
      read -r name primary port quorum <<<"$SENTINEL_MONITOR"
      cat >"$SENTINEL_DIR/sentinel.conf" <<EOF
# Written by scripts/infra.sh once; Sentinel itself rewrites it from then on.
bind $HOST
port $SENTINEL_PORT
protected-mode no
dir $SENTINEL_DIR
sentinel announce-ip $HOST
sentinel monitor $name $primary $port $quorum
sentinel down-after-milliseconds $name $SENTINEL_DOWN_MS
sentinel failover-timeout $name $((SENTINEL_DOWN_MS * 4))
sentinel parallel-syncs $name 1
EOF
    fi
    rm -f "$SENTINEL_PID"
    log "sentinel: starting on $HOST:$SENTINEL_PORT watching '$SENTINEL_MONITOR' (log $SENTINEL_LOG)"
    redis-sentinel "$SENTINEL_DIR/sentinel.conf" --daemonize yes --pidfile "$SENTINEL_PID" \
      --logfile "$SENTINEL_LOG" </dev/null >"$SENTINEL_DIR/sentinel.out" 2>&1 9>&- ||
      {
        cat "$SENTINEL_DIR/sentinel.out" >&2
        die "redis-sentinel failed to start (its output is above; log: $SENTINEL_LOG)"
      }
  fi
  [[ -n $started ]] || started=$(sentinel_pid) || started=
  wait_ready sentinel sentinel_probe "$started" "$SENTINEL_LOG"
  log "sentinel: ready at $HOST:$SENTINEL_PORT"
}

# ---------------------------------------------------------------- commands

print_env() {
  echo "export PLEXRL_KAFKA_BOOTSTRAP=$KAFKA_BOOTSTRAP"
  echo "export PLEXRL_REDIS_URL=$REDIS_URL"
}

take_lock() {
  mkdir -p "$STATE"
  exec 9>"$STATE/.lock"
  flock -w "$TIMEOUT" 9 || die "another scripts/infra.sh still holds $STATE/.lock after ${TIMEOUT}s"
}

cmd_up() {
  # Fast path: both answer, so there is nothing to start and no lock to take.
  if { ! wanted kafka || kafka_probe >/dev/null; } && { ! wanted redis || redis_probe >/dev/null; } &&
    { ! wanted sentinel || sentinel_probe >/dev/null; }; then
    log "kafka and redis already answer (PLEXRL_KAFKA_BOOTSTRAP=$KAFKA_BOOTSTRAP PLEXRL_REDIS_URL=$REDIS_URL)"
    return 0
  fi
  local started=$SECONDS
  take_lock
  KAFKA_WAIT=0 KAFKA_WAIT_PID=
  if wanted kafka; then kafka_start; fi
  # Redis starts while the JVM boots.
  if wanted redis; then redis_up; fi
  if wanted sentinel; then sentinel_up; fi
  if ((KAFKA_WAIT)); then
    wait_ready kafka kafka_probe "$KAFKA_WAIT_PID" "$KAFKA_LOG" "$KAFKA_OUT"
    log "kafka: ready at $KAFKA_BOOTSTRAP"
  fi
  log "up in $((SECONDS - started))s: PLEXRL_KAFKA_BOOTSTRAP=$KAFKA_BOOTSTRAP PLEXRL_REDIS_URL=$REDIS_URL"
}

# stop NAME PIDFN PIDFILE PROBE — stop the process `up` started; leave others alone.
stop() {
  local name=$1 pidfn=$2 pidfile=$3 probe=$4 pid i
  if ! pid=$($pidfn); then
    rm -f "$pidfile"
    if $probe >/dev/null; then
      log "$name: answers, but was not started by infra.sh; left alone"
    else
      log "$name: not running"
    fi
    return 0
  fi
  log "$name: stopping pid $pid"
  kill -TERM "$pid" 2>/dev/null || true
  for i in {1..600}; do
    kill -0 "$pid" 2>/dev/null || break
    if ((i == 600)); then
      log "$name: pid $pid ignored SIGTERM for 60s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    sleep 0.1
  done
  rm -f "$pidfile"
  log "$name: stopped"
}

cmd_down() {
  take_lock
  if wanted kafka; then stop kafka kafka_pid "$KAFKA_PID" kafka_probe; fi
  if wanted redis; then stop redis redis_pid "$REDIS_PID" redis_probe; fi
  if wanted sentinel; then stop sentinel sentinel_pid "$SENTINEL_PID" sentinel_probe; fi
}

# status_line NAME PROBE PIDFN ADDRESS LOG — one line per service; fails if it is down.
status_line() {
  local name=$1 probe=$2 pidfn=$3 addr=$4 logfile=$5 msg pid rc=0 owner
  msg=$($probe) || rc=$?
  if pid=$($pidfn); then owner="pid $pid, started by infra.sh, log $logfile"; else owner="not started by infra.sh"; fi
  if ((rc == 0)); then
    printf '%-6s up    %-22s %s\n' "$name" "$addr" "$owner"
  elif [[ -n $pid ]]; then
    printf '%-6s start %-22s %s (%s)\n' "$name" "$addr" "$owner" "$msg"
  else
    printf '%-6s down  %-22s %s\n' "$name" "$addr" "$msg"
  fi
  return "$rc"
}

cmd_status() {
  local rc=0
  if wanted kafka; then status_line kafka kafka_probe kafka_pid "$KAFKA_BOOTSTRAP" "$KAFKA_LOG" || rc=1; fi
  if wanted redis; then status_line redis redis_probe redis_pid "$HOST:$REDIS_PORT" "$REDIS_LOG" || rc=1; fi
  if wanted sentinel; then status_line sentinel sentinel_probe sentinel_pid "$HOST:$SENTINEL_PORT" "$SENTINEL_LOG" || rc=1; fi
  print_env
  return "$rc"
}

cmd_prepare() {
  take_lock
  if wanted kafka; then
    ensure_java
    kafka_fetch_jars
  fi
  if wanted redis; then ensure_cmd redis-server redis-server; fi
  if wanted sentinel; then ensure_cmd redis-sentinel redis-sentinel; fi
  log "prepared:$PARTS"
}

case ${1:-} in
  up) cmd_up ;;
  prepare) cmd_prepare ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) print_env ;;
  *)
    echo "usage: scripts/infra.sh up|down|status|env|prepare   (see docs/infra.md)" >&2
    exit 2
    ;;
esac
