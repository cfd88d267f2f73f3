#!/usr/bin/env bash
# The project's test command: bootstrap, start local Kafka and Redis, run pytest.
#
#   scripts/test.sh [pytest args...]      e.g. scripts/test.sh -k scheduler -x
#
# Lint (scripts/lint.sh) runs first when PLEXRL_LINT=1 or CI=true; tests still run if it
# fails, and the exit status is lint's then, else pytest's. Kafka and Redis stay up
# afterwards so the next run reuses them (scripts/infra.sh down stops them).
# PLEXRL_SKIP_INFRA=1 starts nothing and uses PLEXRL_KAFKA_BOOTSTRAP / PLEXRL_REDIS_URL.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit

scripts/bootstrap.sh || exit
# The SGLang sampler tier (its own venv, several GB): always under CI, else on request.
if [[ ${CI:-} == true || ${PLEXRL_SGLANG:-0} == 1 ]]; then scripts/sglang.sh || exit; fi
# Older tinker SDKs and the tinker-cookbook, side by side (tests/test_sdk_versions.py,
# tests/test_cookbook_recipes.py): always under CI, else on request.
if [[ ${CI:-} == true || ${PLEXRL_SDK_MATRIX:-0} == 1 ]]; then scripts/sdk_matrix.sh || exit; fi
# lm-evaluation-harness beside .venv (tests/test_openai.py): always under CI, else on request.
if [[ ${CI:-} == true || ${PLEXRL_EVAL_CLIENT:-0} == 1 ]]; then scripts/eval_client.sh || exit; fi
scripts/chromium.sh >/dev/null || exit  # headless Chromium for the dashboard test
# Helm, kubeconform and the Kubernetes schemas for the chart's test (tests/test_helm.py):
# always under CI, else on request; the first build takes about 5 minutes.
if [[ ${CI:-} == true || ${PLEXRL_HELM_TOOLS:-0} == 1 ]]; then scripts/helm.sh >/dev/null || exit; fi
# SeaweedFS, the object store of the disk tier's S3 tests and of the host bed
# (tests/test_object_store.py, tests/test_hosts.py): always under CI, else on request; the
# first build takes about 30 minutes on 2 cores (docs/infra.md), later runs none.
if [[ ${CI:-} == true || ${PLEXRL_SEAWEEDFS:-0} == 1 ]]; then scripts/seaweedfs.sh build >/dev/null || exit; fi
# The host bed's tools (iptables, haproxy, redis-sentinel, Java, the Kafka jars) for
# tests/test_hosts.py and the Sentinel tests: always under CI, else on request. The bed
# itself needs root; without it the test fails under CI, and is skipped otherwise.
if [[ ${CI:-} == true || ${PLEXRL_HOST_BED:-0} == 1 ]]; then scripts/hosts.sh prepare || exit; fi

lint_status=0
if [[ ${PLEXRL_LINT:-0} == 1 || ${CI:-} == true ]]; then
  scripts/lint.sh || lint_status=$?
fi

if [[ ${PLEXRL_SKIP_INFRA:-0} != 1 ]]; then
  scripts/infra.sh up || exit
  # Point the tests at what infra.sh manages, unless the caller chose other endpoints.
  while read -r _export assignment; do
    name=${assignment%%=*}
    [[ -n ${!name:-} ]] || export "$name=${assignment#*=}"
  done < <(scripts/infra.sh env)
fi

# The slowest tests, printed at the end, keep the suite's time budget visible.
.venv/bin/python -m pytest -q --durations=25 "$@"
test_status=$?

if ((lint_status != 0)); then
  echo "[test] lint failed (status $lint_status); pytest exited $test_status" >&2
  exit "$lint_status"
fi
exit "$test_status"
