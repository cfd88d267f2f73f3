#!/usr/bin/env bash
# The host bed: a PlexRL cluster over several hosts, each a network namespace on a bridge
# with its own address (plexrl_tools.hostbed, plexrl_tools.hostnet; docs/deploy.md, "The host bed").
#
#   scripts/hosts.sh up       build the hosts, start Kafka (3 brokers), Redis (primary,
#                             replica, 3 Sentinels), SeaweedFS and the services; print where
#   scripts/hosts.sh status   the beds on this machine and their addresses
#   scripts/hosts.sh down     remove every bed: its processes, namespaces, interfaces, files
#   scripts/hosts.sh prepare  install and build what a bed needs, start nothing (CI runs it)
#
# Needs root (network namespaces, veth pairs, a bridge, iptables inside the namespaces; the
# root namespace's own rules are never touched). Installs Debian's iptables, haproxy (the
# one address in front of the gateways) and redis-sentinel when missing, Java and the Kafka jars (scripts/infra.sh), and builds
# SeaweedFS once (scripts/seaweedfs.sh: about 30 minutes the first time).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=hosts
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"
cd "$ROOT"

need_root() {
  [[ $(id -u) -eq 0 ]] || die "the host bed needs root: network namespaces, veth pairs, a bridge"
}

prepare() {
  command -v ip >/dev/null || apt_install iproute2
  ensure_cmd iptables iptables
  ensure_cmd haproxy haproxy
  PLEXRL_INFRA_PARTS="kafka redis sentinel" scripts/infra.sh prepare
  scripts/seaweedfs.sh build >/dev/null
  [[ -x .venv/bin/python ]] || scripts/bootstrap.sh
}

case ${1:-} in
  prepare) prepare ;;
  up)
    need_root
    prepare
    exec .venv/bin/python -m plexrl_tools.hostbed up "${@:2}"
    ;;
  status) exec .venv/bin/python -m plexrl_tools.hostbed status ;;
  down)
    need_root
    exec .venv/bin/python -m plexrl_tools.hostbed down
    ;;
  *) die "usage: scripts/hosts.sh up|status|down|prepare   (see docs/deploy.md)" ;;
esac
