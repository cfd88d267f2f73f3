#!/usr/bin/env bash
# The main job: several RLVR jobs sharing a small PlexRL pool, savings printed.
# Installs what is missing (Python deps, Kafka jars, Redis), starts the infrastructure,
# then runs examples/rlvr_demo.py (which starts and stops the four services itself).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
scripts/bootstrap.sh
scripts/infra.sh up
exec .venv/bin/python examples/rlvr_demo.py "$@"
