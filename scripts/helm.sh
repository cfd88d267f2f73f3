#!/usr/bin/env bash
# Helm, kubeconform and the Kubernetes JSON schemas, for tests/test_helm.py (the chart in
# deploy/helm/plexrl): installed once under .plexrl/, later runs find them and do nothing.
#
#   scripts/helm.sh        install what is missing, then print three paths, one a line:
#                          helm, kubeconform, the schema folder (kubeconform's -schema-location)
#
# Helm and kubeconform are built from the Go module proxy with `go install`: the first
# build took 4 min 47 s on 2 cores with an empty module cache (Helm 276 s, kubeconform
# 8 s), later runs take no time. The schemas come from PyPI: the kubernetes-validate
# wheel carries Kubernetes' OpenAPI definitions as JSON schema per Kubernetes version,
# strict (unknown fields refused) beside lax. Its files refer to one another by URL
# (https://kubernetes.io/api/_definitions.json), which kubeconform cannot reach here (it
# then reports "could not find schema" for every object), so the copies under
# .plexrl/kube-schemas refer to the file beside them instead. Each piece has a version
# stamp; a changed pin redoes only that piece. PLEXRL_HELM_NICE=1 builds at the lowest
# priority on one thread so that other work on the machine keeps its CPUs.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=helm
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

HELM_VERSION=v3.22.0
KUBECONFORM_VERSION=v0.8.0
KUBERNETES_VALIDATE_VERSION=1.37.0
# The Kubernetes versions the chart is validated against: the oldest its Chart.yaml
# accepts (kubeVersion) and the newest the wheel has. Keep in step with tests/test_helm.py.
KUBE_VERSIONS=(1.29.0 1.37.0)

BIN_DIR=$ROOT/.plexrl/bin
SCHEMA_DIR=$ROOT/.plexrl/kube-schemas

stamped() { [[ -f $1 && $(<"$1") == "$2" ]]; }

# go_install NAME PACKAGE VERSION [LDFLAGS] — build PACKAGE@VERSION into $BIN_DIR/NAME, once.
go_install() {
  local name=$1 package=$2 version=$3 ldflags=${4:-} stamp=$BIN_DIR/$1.version
  local want="$version${ldflags:+ ldflags: $ldflags}"
  if [[ -x $BIN_DIR/$name ]] && stamped "$stamp" "$want"; then
    return 0
  fi
  local go
  go=$(go_cmd)
  local -a prefix=(env)
  if [[ ${PLEXRL_HELM_NICE:-0} == 1 ]]; then
    prefix=(nice -n 19 env GOMAXPROCS=1 GOFLAGS="-p=1")
  fi
  mkdir -p "$BIN_DIR"
  log "building $package@$version into ${BIN_DIR#"$ROOT"/}"
  local start=$SECONDS
  "${prefix[@]}" GOBIN="$BIN_DIR" CGO_ENABLED=0 "$go" install -trimpath -ldflags "$ldflags" "$package@$version" >&2 ||
    die "go install $package@$version failed; see the output above"
  echo "$want" >"$stamp"
  log "built $BIN_DIR/$name in $((SECONDS - start)) s"
}

schemas() {
  local stamp=$SCHEMA_DIR/.version want
  want="kubernetes-validate==$KUBERNETES_VALIDATE_VERSION ${KUBE_VERSIONS[*]}"
  stamped "$stamp" "$want" && return 0
  local tmp
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: tmp is local
  trap "rm -rf '$tmp'" RETURN
  log "fetching kubernetes-validate==$KUBERNETES_VALIDATE_VERSION from PyPI for its schemas"
  "$ROOT/.venv/bin/python" -m pip download --quiet --no-deps -d "$tmp" \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" >&2 ||
    die "pip download kubernetes-validate==$KUBERNETES_VALIDATE_VERSION failed"
  rm -rf "$SCHEMA_DIR" && mkdir -p "$SCHEMA_DIR"
  local version wheel
  wheel=$(echo "$tmp"/kubernetes_validate-*.whl)
  for version in "${KUBE_VERSIONS[@]}"; do
    "$ROOT/.venv/bin/python" - "$wheel" "v$version-local-strict" "$SCHEMA_DIR/v$version-strict" <<'PY'
import json, sys, zipfile
from pathlib import Path

wheel, folder, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
prefix = f"kubernetes_validate/kubernetes-json-schema/{folder}/"
out.mkdir(parents=True)


def local(node):
    """The wheel's $refs name https://kubernetes.io/api/_definitions.json: point them at
    the file beside, and drop $id, so that every reference resolves on disk."""
    if isinstance(node, dict):
        node.pop("$id", None)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("/api/_definitions.json"):
            node["$ref"] = ref.removeprefix("/api/")
        for value in node.values():
            local(value)
    elif isinstance(node, list):
        for value in node:
            local(value)
    return node


with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".json")]
    if not names:
        sys.exit(f"{wheel} has no {prefix}")
    for name in names:
        schema = local(json.loads(z.read(name)))
        (out / name[len(prefix):]).write_text(json.dumps(schema))
PY
  done
  echo "$want" >"$stamp"
  log "schemas for Kubernetes ${KUBE_VERSIONS[*]} in ${SCHEMA_DIR#"$ROOT"/}"
}

# What Helm's own Makefile stamps in: its version, and the Kubernetes version of the
# client-go it is built with (v0.37 → 1.37), which `helm template` and `helm lint` take
# as the cluster's when none is given (v1.20 otherwise, older than Chart.yaml accepts).
HELM_LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in pkg/chartutil pkg/lint/rules; do
  HELM_LDFLAGS+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=37"
done
go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "$HELM_LDFLAGS"
go_install kubeconform github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION"
schemas
echo "$BIN_DIR/helm"
echo "$BIN_DIR/kubeconform"
echo "$SCHEMA_DIR"
